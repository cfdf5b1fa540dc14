"""Compose a run config from `conf/` + command-line overrides with Hydra's compose API,
onto the typed schema, and turn every Hydra/OmegaConf complaint into one `ConfigError`
line naming the key. Imports only hydra/omegaconf (no torch, no vllm)."""

from __future__ import annotations

import os
import re
from functools import lru_cache
from pathlib import Path
from typing import IO, Sequence

from omegaconf import DictConfig, OmegaConf

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


def _one_line(err: BaseException) -> str:
    text = str(err).strip()
    # OmegaConf appends a "full_key: ... object_type=..." block; keep only the message.
    text = re.split(r"\n\s*full_key:", text)[0]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return " ".join(lines)


def _explain(err: BaseException) -> ConfigError | UserError:
    """Map a Hydra/OmegaConf exception (possibly wrapping another) to a one-line error."""
    cause = err
    while cause.__cause__ is not None and not isinstance(cause, ConfigError):
        cause = cause.__cause__
    key = getattr(cause, "full_key", None) or getattr(err, "full_key", None)
    msg = _one_line(cause)
    outer = _one_line(err)
    m = re.search(r"Could not override '([^']+)'", outer)
    if m:
        key = m.group(1)
    if re.search(r"Key '[^']+' not in|Key '[^']+' is not in struct|not in struct", msg + outer):
        bad = key or "?"
        return ConfigError(bad, f"unknown key; {_valid_siblings(bad)}")
    if "Could not load" in outer or "Could not find" in outer or "In '" in outer and "not found" in outer:
        return UserError(_group_choice_error(outer))
    if key:
        return ConfigError(str(key), msg)
    return UserError(outer)


def _valid_siblings(dotted: str) -> str:
    """'valid keys here: a, b, c' for the parent node of `dotted` in the schema."""
    import typing
    from dataclasses import fields, is_dataclass

    from prime_hpc.config.schema import RunConfig

    node: object = RunConfig
    for part in dotted.split(".")[:-1]:
        origin = typing.get_origin(node)
        if origin is typing.Union:  # Optional[X]
            node = next(a for a in typing.get_args(node) if a is not type(None))
            origin = typing.get_origin(node)
        if origin is list and part.isdigit():
            node = typing.get_args(node)[0]
            continue
        hints = typing.get_type_hints(node) if is_dataclass(node) else {}
        if part not in hints:
            return "no such section"
        node = hints[part]
    if typing.get_origin(node) is typing.Union:
        node = next(a for a in typing.get_args(node) if a is not type(None))
    if not is_dataclass(node):
        return "no such section"
    return "valid keys here: " + ", ".join(sorted(f.name for f in fields(node)))


def _group_choice_error(text: str) -> str:
    m = re.search(r"Could not (?:load|find) '([^/']+)/([^']+)'", text)
    if m:
        group, choice = m.group(1), m.group(2)
        options = sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))
        return f"{group}={choice}: unknown {group}; choose from {', '.join(options)}"
    return text


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
        raise _explain(e) from None
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
        raise _explain(e) from None
    return cfg


def _check_schema(cfg: DictConfig) -> None:
    """Reject keys added with `+key=...` that the schema does not have (Hydra lets an
    append through, and OmegaConf's merge does not catch it either)."""
    from dataclasses import fields, is_dataclass

    def walk(node: object, prefix: str) -> None:
        if isinstance(node, DictConfig):
            typ = OmegaConf.get_type(node)
            if typ is not None and is_dataclass(typ):
                allowed = {f.name for f in fields(typ)}
                extra = sorted(set(node.keys()) - allowed - {"hydra"})
                if extra:
                    key = prefix + str(extra[0])
                    raise ConfigError(key, f"unknown key; {_valid_siblings(key)}")
            else:
                return  # free-form mapping (e.g. env args)
            for k in node.keys():
                walk(node._get_node(k), f"{prefix}{k}.")
        elif OmegaConf.is_list(node):
            for i in range(len(node)):  # type: ignore[arg-type]
                walk(node._get_node(i), f"{prefix}{i}.")  # type: ignore[union-attr]

    walk(cfg, "")


def override(key: str, value: object) -> str:
    """`key=value` as a Hydra override, the value quoted so any characters survive (in a
    quoted value only the backslashes before a quote or at the end are escapes)."""
    text = re.sub(r"(\\+)('|$)", lambda m: m.group(1) * 2 + m.group(2), str(value))
    return f"{key}='" + text.replace("'", "\\'") + "'"


def recorded_config(path: Path | IO[str], overrides: Sequence[str] = ()) -> DictConfig:
    """A run's recorded `config.yaml` (a path, or the file opened) on the typed schema, with
    `key=value` overrides applied (typed: a wrong type or unknown key fails like at
    submit). Config groups cannot be switched on a resolved config, and a run keeps its
    output_dir."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    _register_schema()
    from prime_hpc.config.schema import RunConfig

    cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.load(path))
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception as e:
        raise UserError(_one_line(e)) from None
    for o in parsed:
        key = o.key_or_group
        if key == "output_dir":
            raise ConfigError("output_dir", "a run keeps its directory; to start a new run use prime-hpc submit")
        node = OmegaConf.select(cfg, key, default="__missing__")
        if isinstance(node, str) and node == "__missing__":
            raise ConfigError(key, f"unknown key; {_valid_siblings(key)}")
        if isinstance(node, DictConfig) and not isinstance(o.value(), dict):
            raise ConfigError(
                key,
                f"is a config section: config groups cannot be switched on a recorded run; "
                f"change its keys instead (e.g. {key}.<key>=...)",
            )
        try:
            OmegaConf.update(cfg, key, o.value(), merge=True)
        except Exception as e:
            raise _explain(e) from None
    _check_schema(cfg)
    return cfg


def expand_sweep(overrides: Sequence[str]) -> list[list[str]]:
    """Expand Hydra sweep syntax (`a=1,2 b=x,y`, `range(...)`, `choice(...)`) into the
    cartesian product of plain override lists, in Hydra's order."""
    import itertools

    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception as e:
        raise UserError(_one_line(e)) from None
    axes: list[list[str]] = []
    for o in parsed:
        key = o.get_key_element()
        if o.is_sweep_override():
            axes.append([f"{key}={v}" for v in o.sweep_string_iterator()])
        else:
            axes.append([o.input_line])
    return [list(combo) for combo in itertools.product(*axes)]


def trainer_nproc_per_node(cfg: DictConfig) -> int:
    """Trainer ranks per node: `nproc_per_node`, else one per GPU (one on CPU)."""
    c = cfg.cluster
    return int(c.trainer.nproc_per_node or (c.trainer.gpus_per_node if c.device == "cuda" else 1))


def trainer_ranks(cfg: DictConfig) -> int:
    """The trainer's data-parallel world size (one rollout file per rank)."""
    return int(cfg.cluster.trainer.nodes) * trainer_nproc_per_node(cfg)


def cache_root(cfg: DictConfig) -> str:
    """The shared cache of a run (`cluster.cache_dir`, default next to the run)."""
    return str(Path(cfg.cluster.cache_dir or Path(cfg.output_dir).parent / ".prime-hpc-cache").expanduser().absolute())


def to_yaml(cfg: DictConfig | dict, resolve: bool = True) -> str:
    """`OmegaConf.to_yaml`'s text (strings that would read back as another type quoted),
    emitted by libyaml when it is there: ~10x faster on a run's config."""
    import yaml

    data = cfg if isinstance(cfg, dict) else OmegaConf.to_container(cfg, resolve=resolve, enum_to_str=True)
    return yaml.dump(data, Dumper=_yaml_dumper(), default_flow_style=False, allow_unicode=True, sort_keys=False)


@lru_cache(maxsize=1)
def _yaml_dumper() -> type:
    import yaml
    from omegaconf._utils import OmegaConfDumper

    class Dumper(getattr(yaml, "CSafeDumper", yaml.SafeDumper)):  # type: ignore[misc, valid-type]
        pass

    Dumper.add_representer(str, OmegaConfDumper.str_representer)
    return Dumper


def defaults_choices(overrides: Sequence[str] = ()) -> list[tuple[str, str]]:
    """[(config group, chosen option)] the run is composed from (Hydra's defaults list,
    after the overrides), e.g. ("cluster", "local"), ("experiment", "reverse_text")."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    _register_schema()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            cfg = hydra_compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
        choices = OmegaConf.to_container(cfg.hydra.runtime.choices)
    except (ConfigError, UserError):
        raise
    except Exception as e:
        raise _explain(e) from None
    finally:
        GlobalHydra.instance().clear()
    return [(g, str(o)) for g, o in choices.items() if not g.startswith("hydra/") and g != "prime_hpc_schema"]


def write_component_config(cfg: DictConfig, component: str) -> Path:
    """`<output_dir>/configs/<component>.yaml`, what the component is started with."""
    from prime_hpc.rundir import RunDir, atomic_write_text

    path = RunDir(cfg.output_dir).component_config(component)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, to_yaml(component_config(cfg, component)))
    return path


def bench_section(cfg: DictConfig) -> dict:
    """`bench` as the components get it: its nulls replaced by the run's own values (the
    shape a bench measures is the configured one unless set)."""
    b = OmegaConf.to_container(cfg.bench, resolve=True)
    o = cfg.orchestrator
    b["samples_per_step"] = b["samples_per_step"] or int(o.batch_size)
    b["group_size"] = b["group_size"] or int(o.group_size)
    b["completion_len"] = b["completion_len"] or o.sampling.max_tokens
    return b


def component_config(cfg: DictConfig, component: str) -> dict:
    """What `component` is started with: its own sub-tree plus the run-level values it
    needs, copied in explicitly (a component never reads another component's config)."""
    run_level = {
        "name": cfg.name,
        "output_dir": cfg.output_dir,
        "max_steps": cfg.max_steps,
        "seq_len": cfg.seq_len,
        "async_level": cfg.async_level,
        "seed": cfg.seed,
        "model": OmegaConf.to_container(cfg.model, resolve=True),
        "device": cfg.cluster.device,
        "ckpt": OmegaConf.to_container(cfg.ckpt, resolve=True),
        "wandb": OmegaConf.to_container(cfg.wandb, resolve=True),
        "bench": bench_section(cfg),
    }
    own = OmegaConf.to_container(cfg[component], resolve=True)
    if component == "inference":
        for k in ("ckpt", "wandb", "max_steps", "async_level", "bench"):
            run_level.pop(k)
        lora = cfg.trainer.model.lora
        run_level["nodes"] = int(cfg.cluster.inference.nodes)  # servers the router waits for
        run_level["address"] = cfg.cluster.address  # bind/publish address (None: the node's own)
        run_level["gpus_per_node"] = int(cfg.cluster.inference.gpus_per_node)
        run_level["lora"] = {"enabled": bool(lora.enabled), "rank": int(lora.rank)}
    if component == "orchestrator":
        run_level["trainer_ranks"] = trainer_ranks(cfg)  # one rollout file per rank
        run_level["micro_batch_size"] = int(cfg.trainer.micro_batch_size)
        run_level["inference_nodes"] = int(cfg.cluster.inference.nodes)
        run_level["lora"] = {"enabled": bool(cfg.trainer.model.lora.enabled), "rank": int(cfg.trainer.model.lora.rank)}
    return {**run_level, component: own}
