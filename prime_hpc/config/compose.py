"""Compose a run config from `conf/` + command-line overrides with Hydra's compose API onto
the typed schema (or a run's recorded config with overrides), refusing keys the schema
does not have. Every Hydra/OmegaConf complaint becomes one line naming the key
(`prime_hpc.config.explain`). Imports only hydra/omegaconf (no torch, no vllm)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO, Sequence, cast

from omegaconf import DictConfig, OmegaConf

from prime_hpc.config import walk
from prime_hpc.config.explain import explain, one_line
from prime_hpc.core.errors import ConfigError, UserError

SCHEMA_NAME = "prime_hpc_schema"


def conf_dir() -> Path:
    """The `conf/` tree: `$PRIME_HPC_CONF_DIR`, else the one next to the package."""
    env = os.environ.get("PRIME_HPC_CONF_DIR")
    path = Path(env) if env else Path(__file__).resolve().parents[2] / "conf"
    if not (path / "config.yaml").is_file():
        raise UserError(f"no config tree at {path} (set PRIME_HPC_CONF_DIR to a directory with config.yaml)")
    return path


def _register_schema() -> None:
    """Once per process (storing converts the whole dataclass tree: ~0.1 s each time)."""
    from hydra.core.config_store import ConfigStore

    from prime_hpc.config.schema import RunConfig

    store = ConfigStore.instance()
    if f"{SCHEMA_NAME}.yaml" not in store.repo:
        store.store(name=SCHEMA_NAME, node=RunConfig)


def compose(overrides: Sequence[str] = (), *, resolve: bool = True) -> DictConfig:
    """Compose `conf/config.yaml` with `overrides` (Hydra syntax) onto the typed schema.

    Raises `ConfigError`/`UserError` (one line) on an unknown key, a wrong type or an
    unknown group option. With `resolve`, interpolations are resolved and `output_dir`
    made absolute, so what is returned is exactly what every component will see.
    Compositions are cached per user (`prime_hpc.config.compose_cache`)."""
    for o in overrides:
        if o.startswith("-") and not o.startswith("~"):
            raise UserError(f"unexpected option {o!r} among overrides; options go before the overrides")
    from prime_hpc.config import compose_cache

    conf = conf_dir()
    cfg = compose_cache.cached(conf, overrides, lambda ovr: _compose_hydra(conf, ovr))
    return finish(cfg) if resolve else cfg


def _compose_hydra(conf: Path, overrides: Sequence[str]) -> DictConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    _register_schema()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
            cfg = hydra_compose(config_name="config", overrides=list(overrides))
        _check_schema(cfg)
    except (ConfigError, UserError):
        raise
    except Exception as e:  # hydra/omegaconf raise many types; all are user mistakes here
        raise explain(e, conf) from None
    finally:
        GlobalHydra.instance().clear()
    return cfg


def finish(cfg: DictConfig) -> DictConfig:
    """Resolve a config composed with `resolve=False` (in place) and make `output_dir` and
    env ids that are paths absolute: what every component will see, wherever it starts."""
    from prime_hpc.config.env_ids import absolute

    try:
        OmegaConf.resolve(cfg)
        if not str(cfg.output_dir).strip():
            raise ConfigError("output_dir", "must not be empty; give the run's directory, e.g. outputs/my-run")
        cfg.output_dir = str(Path(cfg.output_dir).expanduser().absolute())
        for entry in [*cfg.orchestrator.env, *cfg.orchestrator.eval.env]:
            if not OmegaConf.is_missing(entry, "id"):  # a missing id is validation's to name
                entry.id = absolute(str(entry.id))
    except (ConfigError, UserError):
        raise
    except Exception as e:
        raise explain(e) from None
    return cfg


def _check_schema(cfg: DictConfig) -> None:
    """Reject keys added with `+key=...` that the schema does not have."""
    key = walk.unknown_key(cfg)
    if key is not None:
        raise ConfigError(key, f"unknown key; {walk.valid_keys(key)}")


def recorded_config(path: Path | IO[str], overrides: Sequence[str] = ()) -> DictConfig:
    """A run's recorded `config.yaml` (a path, or the file opened) on the typed schema, with
    `key=value` overrides applied (typed: a wrong type or unknown key fails like at
    submit). Config groups cannot be switched on a resolved config, and a run keeps its
    output_dir. A recorded config holds values only (submit writes it resolved): one that
    holds an interpolation (`${...}`, escaped or not) is refused in one line naming the
    file and the key, unless an override restates that key. Resolved here, it would read
    the environment of whoever runs the command (`${oc.env:HF_TOKEN}`) into the files
    written next (`configs/*.yaml`), or, written back as text, in a component's."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    _register_schema()
    from prime_hpc.config.schema import RunConfig

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception as e:
        raise UserError(one_line(e)) from None
    loaded = OmegaConf.load(path)
    key = interpolated_key(OmegaConf.to_container(loaded, resolve=False), {o.key_or_group for o in parsed})
    if key is not None:
        name = path if isinstance(path, Path) else getattr(path, "name", "config.yaml")
        key = key if key.isprintable() else ascii(key)  # the file's text, shown as text only
        raise UserError(
            f"{name}: {key} holds an interpolation (${{...}}), which a recorded config never does (submit writes "
            f"values): refusing to resolve it in your environment; give its value as an override ({key}=...)"
        )
    cfg = cast(DictConfig, OmegaConf.merge(OmegaConf.structured(RunConfig), loaded))
    for o in parsed:
        key = o.key_or_group
        if key == "output_dir":
            raise ConfigError("output_dir", "a run keeps its directory; to start a new run use prime-hpc submit")
        node = OmegaConf.select(cfg, key, default="__missing__")
        if isinstance(node, str) and node == "__missing__":
            raise ConfigError(key, f"unknown key; {walk.valid_keys(key)}")
        if isinstance(node, DictConfig) and not isinstance(o.value(), dict):
            raise ConfigError(
                key,
                f"is a config section: config groups cannot be switched on a recorded run; "
                f"change its keys instead (e.g. {key}.<key>=...)",
            )
        try:
            OmegaConf.update(cfg, key, o.value(), merge=True)
        except Exception as e:
            raise explain(e) from None
    _check_schema(cfg)
    return cfg


def interpolated_key(node: object, restated: set[str], prefix: str = "") -> str | None:
    """The first dotted key of the plain data `node` whose value holds `${` (an
    interpolation, a resolver's call, or one escaped that would be one once written back),
    leaving out keys in `restated` and below them; None when there is none."""
    if isinstance(node, dict):
        items: list = list(node.items())
    elif isinstance(node, list):
        items = list(enumerate(node))
    else:
        return prefix if isinstance(node, str) and "${" in node else None
    for k, v in items:
        key = f"{prefix}.{k}" if prefix else str(k)
        if key in restated:
            continue
        found = interpolated_key(v, restated, key)
        if found is not None:
            return found
    return None


def defaults_choices(overrides: Sequence[str] = ()) -> list[tuple[str, str]]:
    """[(config group, chosen option)] the run is composed from (Hydra's defaults list,
    after the overrides), e.g. ("cluster", "local"), ("experiment", "reverse_text")."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    _register_schema()
    conf = conf_dir()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
            cfg = hydra_compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
        choices = cast(dict, OmegaConf.to_container(cfg.hydra.runtime.choices))
    except (ConfigError, UserError):
        raise
    except Exception as e:
        raise explain(e, conf) from None
    finally:
        GlobalHydra.instance().clear()
    return [(str(g), str(o)) for g, o in choices.items() if not str(g).startswith("hydra/") and g != SCHEMA_NAME]
