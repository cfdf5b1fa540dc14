"""Recipes in the reference's TOML layout (`prime-hpc submit @ rl.toml [@ more.toml] [overrides]`)
and its `PRIME_<SECTION>__<KEY>=value` variables, turned into prime-hpc overrides through one
table (`MAPPING`: the reference's key -> prime-hpc's key, and how the value converts).

Precedence, lowest first: the experiment defaults (`conf/`), `$PRIME_LOG_LEVEL` (for
`log.level` when nothing else sets it), `PRIME_*` variables, the files in the order given,
the command line's overrides. A key the table does not have is refused in one line naming
the file (or variable), the key and the nearest key the table has: never dropped.

A file's `[prime_hpc]` table holds prime-hpc keys as they are (`null_keys`: those set to
null). `export` writes a run's recorded config back in this layout (`prime-hpc config
export`), `to_toml` the TOML.

Imported only when an `@` argument or a `PRIME_` variable is there, or by `config export`
(the CLI stays fast)."""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Mapping

from prime_hpc.config.overrides import override
from prime_hpc.core.errors import UserError

# How a value converts: AS_IS (the same value), PRESENT (the table given, even empty, sets the
# prime-hpc key to true; `key = true/false` sets it too), ENVS (a list of env tables, each
# entry's keys through ENV_ENTRY).
AS_IS, PRESENT, ENVS = "", "present", "envs"

MAPPING: dict[str, tuple[str, str]] = {
    # run
    "max_steps": ("max_steps", AS_IS),
    "seq_len": ("seq_len", AS_IS),
    "output_dir": ("output_dir", AS_IS),
    "clean_output_dir": ("clean_output_dir", AS_IS),
    "model": ("model.name", AS_IS),  # `model = "..."` (one line) as `[model] name`
    "model.name": ("model.name", AS_IS),
    "model.trust_remote_code": ("model.trust_remote_code", AS_IS),
    "log.level": ("log.level", AS_IS),
    # checkpoints: `[ckpt]` (or `[trainer.ckpt]`) turns them on
    "ckpt": ("ckpt.enabled", PRESENT),
    "ckpt.interval": ("ckpt.interval", AS_IS),
    "ckpt.keep_last": ("ckpt.keep_last", AS_IS),
    "ckpt.keep_interval": ("ckpt.keep_interval", AS_IS),
    "ckpt.save_async": ("ckpt.save_async", AS_IS),
    "ckpt.resume_step": ("ckpt.step", AS_IS),
    "ckpt.weights.save_adapter_separately": ("ckpt.weights.save_adapter_separately", AS_IS),
    "ckpt.weights_only": ("ckpt.weights_only", AS_IS),
    "ckpt.weights.interval": ("ckpt.weights.interval", AS_IS),
    "ckpt.weights.keep_last": ("ckpt.weights.keep_last", AS_IS),
    "trainer.ckpt": ("ckpt.enabled", PRESENT),
    "trainer.ckpt.interval": ("ckpt.interval", AS_IS),
    "trainer.ckpt.keep_last": ("ckpt.keep_last", AS_IS),
    "trainer.ckpt.keep_interval": ("ckpt.keep_interval", AS_IS),
    "trainer.ckpt.resume_step": ("ckpt.step", AS_IS),
    # W&B: `[wandb]` turns it on
    "wandb": ("wandb.enabled", PRESENT),
    "wandb.project": ("wandb.project", AS_IS),
    "wandb.name": ("wandb.name", AS_IS),
    "wandb.entity": ("wandb.entity", AS_IS),
    "wandb.offline": ("wandb.offline", AS_IS),
    "wandb.log_extras.interval": ("wandb.log_extras.interval", AS_IS),
    "wandb.log_extras.sample_ratio": ("wandb.log_extras.sample_ratio", AS_IS),
    "wandb.log_extras.samples": ("wandb.log_extras.samples", AS_IS),
    "wandb.log_extras.distributions": ("wandb.log_extras.distributions", AS_IS),
    # orchestrator
    "orchestrator.batch_size": ("orchestrator.batch_size", AS_IS),
    "orchestrator.rollouts_per_example": ("orchestrator.group_size", AS_IS),
    "orchestrator.group_size": ("orchestrator.group_size", AS_IS),
    "orchestrator.max_off_policy_steps": ("orchestrator.max_off_policy_steps", AS_IS),
    "orchestrator.training_mode": ("orchestrator.training_mode", AS_IS),
    "orchestrator.oversampling_factor": ("orchestrator.oversampling_factor", AS_IS),
    "orchestrator.trajectory_strategy": ("orchestrator.trajectory_strategy", AS_IS),
    "orchestrator.buffer.online_difficulty_filtering": ("orchestrator.online_difficulty_filtering", AS_IS),
    "orchestrator.sampling.max_tokens": ("orchestrator.sampling.max_tokens", AS_IS),
    "orchestrator.sampling.temperature": ("orchestrator.sampling.temperature", AS_IS),
    "orchestrator.sampling.top_p": ("orchestrator.sampling.top_p", AS_IS),
    "orchestrator.sampling.top_k": ("orchestrator.sampling.top_k", AS_IS),
    "orchestrator.sampling.min_p": ("orchestrator.sampling.min_p", AS_IS),
    "orchestrator.sampling.repetition_penalty": ("orchestrator.sampling.repetition_penalty", AS_IS),
    "orchestrator.sampling.stop": ("orchestrator.sampling.stop", AS_IS),
    "orchestrator.sampling.extra_body": ("orchestrator.sampling.extra_body", AS_IS),
    "orchestrator.env": ("orchestrator.env", ENVS),
    "orchestrator.train.env": ("orchestrator.env", ENVS),
    "orchestrator.eval.env": ("orchestrator.eval.env", ENVS),
    "orchestrator.eval.interval": ("orchestrator.eval.interval", AS_IS),
    "orchestrator.eval.num_examples": ("orchestrator.eval.num_examples", AS_IS),
    "orchestrator.eval.rollouts_per_example": ("orchestrator.eval.rollouts_per_example", AS_IS),
    "orchestrator.teacher.client.base_url": ("orchestrator.teacher.client.base_url", AS_IS),
    "orchestrator.log.level": ("orchestrator.log.level", AS_IS),
    "orchestrator.log.vf_level": ("orchestrator.log.vf_level", AS_IS),
    # trainer
    "trainer.model.name": ("trainer.model.name", AS_IS),
    "trainer.tokenizer.name": ("trainer.tokenizer.name", AS_IS),
    "trainer.model.ac.freq": ("trainer.model.ac.freq", AS_IS),
    "trainer.model.optimization_dtype": ("trainer.model.optimization_dtype", AS_IS),
    "trainer.model.reduce_dtype": ("trainer.model.reduce_dtype", AS_IS),
    "trainer.model.lora": ("trainer.model.lora.enabled", PRESENT),  # `[trainer.model.lora]` turns LoRA on
    "trainer.model.lora.rank": ("trainer.model.lora.rank", AS_IS),
    "trainer.model.lora.alpha": ("trainer.model.lora.alpha", AS_IS),
    "trainer.model.lora.dropout": ("trainer.model.lora.dropout", AS_IS),
    "trainer.model.lora.target_modules": ("trainer.model.lora.target_modules", AS_IS),
    "trainer.optim.lr": ("trainer.optim.lr", AS_IS),
    "trainer.optim.weight_decay": ("trainer.optim.weight_decay", AS_IS),
    "trainer.log.level": ("trainer.log.level", AS_IS),
    # inference
    "inference.gpu_memory_utilization": ("inference.gpu_memory_utilization", AS_IS),
    "inference.model.name": ("inference.model.name", AS_IS),
    "inference.model.dtype": ("inference.dtype", AS_IS),
    "inference.model.max_model_len": ("inference.max_model_len", AS_IS),
    "inference.model.enable_auto_tool_choice": ("inference.model.enable_auto_tool_choice", AS_IS),
    "inference.model.tool_call_parser": ("inference.model.tool_call_parser", AS_IS),
    "inference.model.reasoning_parser": ("inference.model.reasoning_parser", AS_IS),
    # the SFT trainer's layout (`sft @ sft.toml`): a file with these is an SFT run (trainer=sft)
    "data.name": ("trainer.data.name", AS_IS),
    "data.seq_len": ("seq_len", AS_IS),
    "data.batch_size": ("trainer.data.batch_size", AS_IS),
    "data.micro_batch_size": ("trainer.micro_batch_size", AS_IS),
    "optim.lr": ("trainer.optim.lr", AS_IS),
    "optim.weight_decay": ("trainer.optim.weight_decay", AS_IS),
    "loss_mask.system": ("trainer.loss_mask.system", AS_IS),
    "loss_mask.user": ("trainer.loss_mask.user", AS_IS),
    "loss_mask.assistant": ("trainer.loss_mask.assistant", AS_IS),
    "loss_mask.tool": ("trainer.loss_mask.tool", AS_IS),
    "val.interval": ("trainer.val.interval", AS_IS),
    "val.data.name": ("trainer.val.data.name", AS_IS),
    "val.data.batch_size": ("trainer.val.data.batch_size", AS_IS),
    # the one-file lab layout: run-level orchestrator and trainer keys, `[[env]]`, `[sampling]`, `[lora]`
    "batch_size": ("orchestrator.batch_size", AS_IS),
    "rollouts_per_example": ("orchestrator.group_size", AS_IS),
    "learning_rate": ("trainer.optim.lr", AS_IS),
    "warmup_steps": ("trainer.optim.warmup_steps", AS_IS),
    "env": ("orchestrator.env", ENVS),
    "sampling.max_tokens": ("orchestrator.sampling.max_tokens", AS_IS),
    "sampling.temperature": ("orchestrator.sampling.temperature", AS_IS),
    "sampling.top_p": ("orchestrator.sampling.top_p", AS_IS),
    "sampling.stop": ("orchestrator.sampling.stop", AS_IS),
    "lora.enabled": ("trainer.model.lora.enabled", AS_IS),
    "lora.r": ("trainer.model.lora.rank", AS_IS),
    "lora.alpha": ("trainer.model.lora.alpha", AS_IS),
    "lora.dropout": ("trainer.model.lora.dropout", AS_IS),
    "lora.target_modules": ("trainer.model.lora.target_modules", AS_IS),
    "difficulty_filter.min_reward": ("orchestrator.difficulty_filter.min_reward", AS_IS),
    "difficulty_filter.max_reward": ("orchestrator.difficulty_filter.max_reward", AS_IS),
    "difficulty_filter.min_reward_variance": ("orchestrator.difficulty_filter.min_reward_variance", AS_IS),
    # `[kl_penalty]`: the penalty toward the initial policy, its coefficient adapted toward target_kl
    "kl_penalty.beta": ("trainer.loss.ref_kl_coef", AS_IS),
    "kl_penalty.target_kl": ("trainer.loss.target_kl", AS_IS),
}

ENV_ENTRY = {"id": "id", "args": "args", "ratio": "ratio", "weight": "ratio", "name": "name"}
"""the keys of one `[[orchestrator.env]]` / `[[env]]` table"""

SFT_SECTIONS = ("data", "optim", "loss_mask", "val")
"""top-level tables of the SFT trainer's layout: a file with one composes `trainer=sft`"""

OWN_TABLE = "prime_hpc"
"""`[prime_hpc]`: prime-hpc keys given as they are (what `config export` writes for the keys
the reference's layout has no counterpart of)"""
NULL_KEYS = "null_keys"
"""`[prime_hpc] null_keys = ["key", ...]`: those keys set to null"""

LOG_LEVEL_VAR = "PRIME_LOG_LEVEL"
ORIGINS: dict[str, str] = {}
"""prime-hpc key -> `source: reference key` of the last `expand` (see `origin`)"""
_SECTIONS = {".".join(k.split(".")[:i]) for k in MAPPING for i in range(1, k.count(".") + 1)}
"""every table of the layout: each proper prefix of a key of the table"""
_DICT_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*")


def _is_reference_var(name: str) -> bool:
    return name.startswith("PRIME_") and not name.startswith("PRIME_HPC_")


def expand(words: list[str], environ: Mapping[str, str]) -> list[str]:
    """The command line's `words` with each `@ file` / `@file` replaced: the overrides of the
    `PRIME_` variables, then of the files in order, then the remaining words."""
    files: list[str] = []
    rest: list[str] = []
    it = iter(words)
    for w in it:
        if w == "@":
            path = next(it, None)
            if path is None or path.startswith("-"):
                raise UserError("@ needs a TOML file after it, e.g. prime-hpc submit @ rl.toml")
            files.append(path)
        elif w.startswith("@"):
            files.append(w[1:])
        else:
            rest.append(w)
    ORIGINS.clear()
    from_vars = variable_overrides(environ)
    from_files = [o for f in files for o in file_overrides(Path(f))]
    for key in map(_key_of, rest):  # the command line's: no longer the file's or the variable's
        ORIGINS.pop(key, None)
    out = [*from_vars, *from_files, *rest]
    level = environ.get(LOG_LEVEL_VAR)
    if level is not None and not any(_key_of(o) == "log.level" for o in out):
        from prime_hpc.config.schema import LEVELS

        value = level.strip().lower()
        if value not in LEVELS:
            raise UserError(f"{LOG_LEVEL_VAR}={level!r}: unknown log level; choose from {', '.join(LEVELS)}")
        out.insert(0, override("log.level", value))
    return out


def origin(key: str) -> str | None:
    """`FILE: reference key` (or `VARIABLE: ...`) that set prime-hpc's `key` (or the section
    or list above it) in the last `expand`, for an error about that key; None if none did."""
    while key:
        if key in ORIGINS:
            return ORIGINS[key]
        key = key.rpartition(".")[0]
    return None


def _key_of(word: str) -> str:
    return word.split("=", 1)[0].lstrip("+~")


def file_overrides(path: Path) -> list[str]:
    """The overrides a TOML file in the reference's layout stands for (refused in one line:
    a missing or malformed file, a key with no counterpart)."""
    import tomllib

    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise UserError(f"@ {path}: no such file") from None
    except OSError as e:
        raise UserError(f"@ {path}: cannot read it ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path}: not valid TOML: {e}") from None
    return overrides_of(data, str(path))


def variable_overrides(environ: Mapping[str, str]) -> list[str]:
    """`PRIME_<SECTION>__<KEY>=value` (the reference's key names, `__` for nesting; a value
    read as a TOML value where it is one, else as a string). `PRIME_<KEY>` of a run-level
    value of the table (`PRIME_MAX_STEPS`) counts too; other `PRIME_` variables (`PRIME_API_KEY`, `PRIME_HPC_*`,
    `PRIME_LOG_LEVEL`) are not config."""
    out: list[str] = []
    for name in sorted(environ):
        if not _is_reference_var(name) or name == LOG_LEVEL_VAR:
            continue
        parts = name[len("PRIME_") :].lower().split("__")
        if len(parts) == 1 and MAPPING.get(parts[0], ("", ENVS))[1] != AS_IS:
            continue  # a run-level value only: PRIME_ENV, PRIME_WANDB... may well mean something else
        tree: dict = {}
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = _parse_value(environ[name])
        out += overrides_of(tree, name)
    return out


def _parse_value(text: str) -> Any:
    import tomllib

    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
    return value if isinstance(value, (bool, int, float, str, list, dict)) else text  # a date stays text


def overrides_of(data: dict, source: str) -> list[str]:
    """Overrides (Hydra syntax, prime-hpc keys) for the reference-layout tree `data`."""
    out: list[str] = []
    if any(isinstance(data.get(s), dict) for s in SFT_SECTIONS):
        out.append("trainer=sft")
    _walk(data, "", source, out)
    return out


def _walk(node: dict, prefix: str, source: str, out: list[str]) -> None:
    for k, value in node.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if key == OWN_TABLE:
            if not isinstance(value, dict):
                raise UserError(f"{source}: {OWN_TABLE} is a table of prime-hpc keys ([{OWN_TABLE}]), not {value!r}")
            _own(value, "", source, out)
            continue
        target = MAPPING.get(key)
        if isinstance(value, dict) and (key in _SECTIONS or (target is None and value)):
            if target is not None and target[1] == PRESENT:
                out.append(f"{target[0]}=true")
                ORIGINS[target[0]] = f"{source}: {key}"
            _walk(value, key, source, out)  # an unknown table: refused at its first key
            continue
        if target is None:
            raise _unknown(source, key)
        ours, how = target
        if how == PRESENT:
            if not isinstance(value, bool):
                raise UserError(f"{source}: {key} is a table ([{key}]) or true/false, not {value!r}")
            out.append(f"{ours}={str(value).lower()}")
        elif how == ENVS:
            out.append(f"{ours}={_envs(value, key, source)}")
        else:  # a table value (extra_body) merges into the one there: Hydra overrides no dict with `key=`
            out.append(f"{'++' if isinstance(value, dict) else ''}{ours}={_hydra(value, key, source)}")
        ORIGINS[ours] = f"{source}: {key}"


def _own(node: dict, prefix: str, source: str, out: list[str]) -> None:
    """`[prime_hpc]`: prime-hpc keys as they are (nested tables or dotted keys), and
    `null_keys = [...]`, the keys set to null (TOML has no null)."""
    for k, value in node.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if key == NULL_KEYS:
            if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
                raise UserError(f"{source}: {OWN_TABLE}.{NULL_KEYS} is a list of prime-hpc keys, not {value!r}")
            for name in value:
                out.append(f"{name}=null")
                ORIGINS[name] = f"{source}: {OWN_TABLE}.{NULL_KEYS}"
            continue
        if isinstance(value, dict) and value:
            _own(value, key, source, out)
            continue
        # `++`: a key of a table-valued setting (orchestrator.sampling.extra_body.x) is added;
        # a key the schema does not have is still refused, naming it (compose)
        out.append(f"++{key}={_hydra(value, f'{OWN_TABLE}.{key}', source)}")
        ORIGINS[key] = f"{source}: {OWN_TABLE}.{key}"


def _unknown(source: str, key: str) -> UserError:
    near = difflib.get_close_matches(key, list(MAPPING), n=1, cutoff=0.0)
    hint = f"; nearest known key: {near[0]}" if near else ""
    return UserError(
        f"{source}: {key} has no prime-hpc counterpart{hint} (docs/configuration.md, recipes in the reference's "
        f"TOML layout; give prime-hpc's key as an override instead)"
    )


def _envs(value: Any, key: str, source: str) -> str:
    if not isinstance(value, list) or not all(isinstance(e, dict) for e in value):
        raise UserError(f"{source}: {key} is a list of tables ([[{key}]]), not {value!r}")
    entries = []
    for i, entry in enumerate(value):
        mapped = {}
        for k, v in entry.items():
            if k not in ENV_ENTRY:
                near = difflib.get_close_matches(k, list(ENV_ENTRY), n=1, cutoff=0.0)
                raise UserError(
                    f"{source}: {key}[{i}].{k} has no prime-hpc counterpart; nearest known key: {key}[{i}].{near[0]}"
                )
            mapped[ENV_ENTRY[k]] = v
        entries.append(mapped)
    return _hydra(entries, key, source)


def _hydra(value: Any, key: str, source: str) -> str:
    """`value` (TOML data) in Hydra's override grammar, strings quoted."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return override("", value)[1:]
    if isinstance(value, list):
        return "[" + ",".join(_hydra(v, key, source) for v in value) + "]"
    if isinstance(value, dict):
        for k in value:
            if not _DICT_KEY.fullmatch(str(k)):
                raise UserError(f"{source}: {key}: the table key {str(k)!r} cannot be passed on (letters, digits, _ -)")
        return "{" + ",".join(f"{k}:{_hydra(v, key, source)}" for k, v in value.items()) + "}"
    raise UserError(f"{source}: {key}: a {type(value).__name__} value ({value!r}) has no prime-hpc counterpart")


def table_markdown() -> str:
    """docs/configuration.md's table of `MAPPING` (a test keeps the two the same)."""
    how = {
        AS_IS: "the value as it is",
        PRESENT: "`[table]` given (even empty) or `= true`: `true`; `= false`: `false`",
        ENVS: "each table's `id`, `args`, `ratio` (`weight`), `name`",
    }
    lines = ["| reference key | prime-hpc key | value |", "| --- | --- | --- |"]
    lines += [f"| `{k}` | `{t}` | {how[h]} |" for k, (t, h) in MAPPING.items()]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- export
LAYOUT_ALIASES = frozenset(
    k
    for k in MAPPING
    if k == "model"
    or k in ("batch_size", "rollouts_per_example", "learning_rate", "warmup_steps", "env")
    or k.split(".")[0] in ("sampling", "lora", "difficulty_filter")
)
"""reference keys `config export` writes only where nothing else reaches their prime-hpc key:
the one-line `model = ...` and the one-file lab layout's"""
NOT_EXPORTED = ("name", "output_dir", "job_dir")
"""what names the run's directory and job: a recipe submitted again is a new run (give them
as overrides to choose)"""


def export_key(target: str, sft: bool) -> str | None:
    """The reference key `config export` writes prime-hpc's `target` under: of those the
    table maps to it, the first of the `[section]` form (an SFT run: of the SFT trainer's
    layout first; an RL run: never one of it, which would make the file an SFT run's)."""
    found = [k for k, (t, _) in MAPPING.items() if t == target]
    if not sft:
        found = [k for k in found if k.split(".")[0] not in SFT_SECTIONS]
    found.sort(key=lambda k: (k in LAYOUT_ALIASES, sft and k.split(".")[0] not in SFT_SECTIONS))
    return found[0] if found else None


_MISSING = object()


def _get(tree: Any, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return _MISSING
        tree = tree[part]
    return tree


def _put(tree: dict, key: str, value: Any) -> None:
    *parents, last = key.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[last] = value


def flat_leaves(tree: dict, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value of every leaf (a list is a leaf; so is an empty table)."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            out.update(flat_leaves(v, key))
        else:
            out[key] = v
    return out


def export(run: dict, defaults: dict, derived: frozenset[str] = frozenset()) -> str:
    """The recorded config `run` (plain data) as a TOML recipe in the reference's layout:
    every prime-hpc key the table reaches under its reference key (`export_key`), and every
    other key whose value is not `defaults`' (what `submit` composes with no overrides, for
    an SFT run with trainer=sft) in `[prime_hpc]`, null ones in its `null_keys`; `NOT_EXPORTED`
    and `derived` (keys submit sets itself: a warm-up's weights) left out. `submit @` the
    result composes to `run` (but for those)."""
    sft = _get(run, "trainer.type") == "sft"
    tree: dict = {}
    nulls: list[str] = []
    covered: set[str] = set()  # prime-hpc keys written in the reference's layout
    targets = {t: export_key(t, sft) for t in dict.fromkeys(t for t, _ in MAPPING.values())}
    exported = {t: ref for t, ref in targets.items() if ref is not None and t not in (*NOT_EXPORTED, *derived)}
    off = [ref for t, ref in exported.items() if MAPPING[ref][1] == PRESENT and _get(run, t) is not True]
    for target, ref in exported.items():  # in the table's order
        if any(ref.startswith(o + ".") for o in off):
            continue  # its feature is off: a [table] would turn it on; in [prime_hpc] if not the default
        value = _get(run, target)
        if value is _MISSING:
            continue
        covered.add(target)
        how = MAPPING[ref][1]
        if how == PRESENT:
            if value is True:
                node = tree
                for part in ref.split("."):
                    node = node.setdefault(part, {})
            else:
                _put(tree, ref, False)
            continue
        if value is None:
            if _get(defaults, target) is not None:
                nulls.append(target)
            continue
        if how == ENVS:
            back = {v: k for k, v in reversed(ENV_ENTRY.items())}  # the first reference name of each
            value = [{back[k]: v for k, v in e.items() if v is not None} for e in value]
        _put(tree, ref, value)
    own: dict = {}
    flat_defaults = flat_leaves(defaults)
    for key, value in flat_leaves(run).items():
        if key.split(".")[0] in NOT_EXPORTED or key in derived:
            continue
        if any(key == c or key.startswith(c + ".") for c in covered):
            continue
        if value == flat_defaults.get(key, _MISSING):
            continue
        if value is None:
            nulls.append(key)
        else:
            _put(own, key, value)
    text = to_toml(tree)
    if own or nulls:
        if nulls:
            own[NULL_KEYS] = nulls
        text += (
            f"\n# [{OWN_TABLE}]: prime-hpc keys the reference's layout has no counterpart of, where this run's\n"
            f"# value is not the default ({NULL_KEYS}: those set to null)\n"
        ) + to_toml({OWN_TABLE: own})
    return text


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def to_toml(tree: dict) -> str:
    """`tree` (str, int, float, bool, lists, tables; no null: TOML has none) as TOML text:
    each table's values, then its tables (`[a.b]`; an empty one too: a table given), then
    its lists of tables (`[[a.b]]`)."""
    lines: list[str] = []
    _table(tree, [], lines)
    return "\n".join(lines).lstrip("\n") + "\n"


def _is_tables(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _table(tree: dict, path: list[str], lines: list[str], header: str = "") -> None:
    plain = [(k, v) for k, v in tree.items() if not isinstance(v, dict) and not _is_tables(v)]
    if header and (plain or not tree):
        lines += ["", header]
    for k, v in plain:
        lines.append(f"{toml_key(k)} = {toml_value(v, [*path, k])}")
    for k, v in tree.items():
        if isinstance(v, dict):
            sub = [*path, k]
            _table(v, sub, lines, f"[{'.'.join(map(toml_key, sub))}]")
    for k, v in tree.items():
        if _is_tables(v):
            sub = [*path, k]
            for entry in v:
                lines += ["", f"[[{'.'.join(map(toml_key, sub))}]]"]
                lines += [f"{toml_key(ek)} = {toml_value(ev, [*sub, ek])}" for ek, ev in entry.items()]


def toml_key(key: Any) -> str:
    key = str(key)
    return key if _BARE_KEY.fullmatch(key) else toml_value(key, [])


def toml_value(value: Any, path: list[str]) -> str:
    """One TOML value (inline: lists, tables `{k = v}`)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != value:
            return "nan"
        if value in (float("inf"), float("-inf")):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        out = []
        for ch in value:
            if ch in _ESCAPES:
                out.append(_ESCAPES[ch])
            elif ord(ch) < 0x20 or ord(ch) == 0x7F:
                out.append(f"\\u{ord(ch):04X}")
            else:
                out.append(ch)
        return '"' + "".join(out) + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v, [*path, str(i)]) for i, v in enumerate(value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{toml_key(k)} = {toml_value(v, [*path, str(k)])}" for k, v in value.items()) + "}"
    where = ".".join(path) or "a value"
    what = "null (TOML has no null)" if value is None else f"a {type(value).__name__}"
    raise UserError(f"{where}: {what} cannot be written as TOML")
