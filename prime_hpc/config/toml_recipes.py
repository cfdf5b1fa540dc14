"""Recipes in the reference's TOML layout (`prime-hpc submit @ rl.toml [@ more.toml] [overrides]`)
and its `PRIME_<SECTION>__<KEY>=value` variables, turned into prime-hpc overrides through one
table (`MAPPING`: the reference's key -> prime-hpc's key, and how the value converts).

Precedence, lowest first: the experiment defaults (`conf/`), `$PRIME_LOG_LEVEL` (for
`log.level` when nothing else sets it), `PRIME_*` variables, the files in the order given,
the command line's overrides. A key the table does not have is refused in one line naming
the file (or variable), the key and the nearest key the table has: never dropped; one the
reference has but prime-hpc has no counterpart of (`REFUSED`) names the nearest prime-hpc key
and why not. Some keys convert by more than a name (the async level, GPU lists, `[slurm]`,
`[trainer.scheduler]`, `enabled` switches: the kinds below).

A file's `[prime_hpc]` table holds prime-hpc keys as they are (`null_keys`: those set to
null). `export` writes a run's recorded config back in this layout (`prime-hpc config
export`), `to_toml` the TOML.

Imported only when an `@` argument or a `PRIME_` variable is there, or by `config export`
(the CLI stays fast); `submit`, `doctor`, `serve`, `eval` and `synthesize` take recipes through
`prime_hpc.cli.with_recipes`."""

from __future__ import annotations

import difflib
import re
import sys
from pathlib import Path
from typing import Any, Mapping

from prime_hpc.config.overrides import override
from prime_hpc.core.errors import UserError

# How a value converts: AS_IS (the same value), PRESENT (the table given, even empty, sets the
# prime-hpc key to true; `key = true/false` sets it too), ENVS (a list of env tables, each
# entry's keys through ENV_ENTRY), LEVEL (a log level, `LOG_LEVELS`), PLUS_ONE (an async level:
# the reference counts from 0, synchronous, prime-hpc from 1), GPU_LIST (`[0, 1]`: the group's
# `gpu_ids` "0,1" and its `gpus_per_node` 2), TABLE (the table given, even empty, sets the
# prime-hpc key to `TABLE_VALUE`), SWITCH (`enabled = true/false`: `SWITCHES`), SCHEDULER (the
# whole `[trainer.scheduler]` table, `scheduler_overrides`), VALUES (`TAKEN_VALUES`: what each value
# stands for).
AS_IS, PRESENT, ENVS = "", "present", "envs"
LEVEL, PLUS_ONE, GPU_LIST, TABLE, SWITCH, SCHEDULER, VALUES = (
    "level",
    "plus_one",
    "gpu_list",
    "table",
    "switch",
    "scheduler",
    "values",
)
EXPORTED_KINDS = (AS_IS, PRESENT, ENVS, LEVEL, PLUS_ONE)
"""the kinds `config export` writes back under their reference key (the others' prime-hpc keys
go to `[prime_hpc]` where not the default)"""

MAPPING: dict[str, tuple[str, str]] = {
    # run
    "max_steps": ("max_steps", AS_IS),
    "seq_len": ("seq_len", AS_IS),
    "output_dir": ("output_dir", AS_IS),
    "clean_output_dir": ("clean_output_dir", AS_IS),
    "max_async_level": ("async_level", PLUS_ONE),
    "async_level": ("async_level", PLUS_ONE),
    "orchestrator.max_async_level": ("async_level", PLUS_ONE),
    "orchestrator.async_level": ("async_level", PLUS_ONE),
    "trainer.max_async_level": ("async_level", PLUS_ONE),
    "trainer.async_level": ("async_level", PLUS_ONE),
    "inference_gpu_ids": ("cluster.inference", GPU_LIST),
    "trainer_gpu_ids": ("cluster.trainer", GPU_LIST),
    "teacher_gpu_ids": ("cluster.teacher", GPU_LIST),
    "model": ("model.name", AS_IS),  # `model = "..."` (one line) as `[model] name`
    "model.name": ("model.name", AS_IS),
    "model.trust_remote_code": ("model.trust_remote_code", AS_IS),
    "log.level": ("log.level", LEVEL),
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
    "orchestrator.log.level": ("orchestrator.log.level", LEVEL),
    "orchestrator.log.vf_level": ("orchestrator.log.vf_level", LEVEL),
    # the processes' own W&B tables: one W&B run here, so their extras are the run's
    "orchestrator.wandb": ("wandb.enabled", PRESENT),
    "orchestrator.wandb.log_extras.interval": ("wandb.log_extras.interval", AS_IS),
    "orchestrator.wandb.log_extras.sample_ratio": ("wandb.log_extras.sample_ratio", AS_IS),
    "orchestrator.wandb.log_extras.samples": ("wandb.log_extras.samples", AS_IS),
    "orchestrator.wandb.log_extras.distributions": ("wandb.log_extras.distributions", AS_IS),
    "trainer.wandb": ("wandb.enabled", PRESENT),
    "trainer.wandb.log_extras.interval": ("wandb.log_extras.trainer.interval", AS_IS),
    "trainer.wandb.log_extras.distributions": ("wandb.log_extras.trainer.distributions", AS_IS),
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
    "trainer.scheduler": ("trainer.optim.schedule", SCHEDULER),
    "trainer.log.level": ("trainer.log.level", LEVEL),
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
    "data.type": ("trainer.type", VALUES),
    "data.subsets": ("trainer.data.subsets", AS_IS),
    "data.splits": ("trainer.data.splits", AS_IS),
    "data.probabilities": ("trainer.data.probabilities", AS_IS),
    "scheduler": ("trainer.optim.schedule", SCHEDULER),
    "optim.lr": ("trainer.optim.lr", AS_IS),
    "optim.weight_decay": ("trainer.optim.weight_decay", AS_IS),
    "loss_mask.system": ("trainer.loss_mask.system", AS_IS),
    "loss_mask.user": ("trainer.loss_mask.user", AS_IS),
    "loss_mask.assistant": ("trainer.loss_mask.assistant", AS_IS),
    "loss_mask.tool": ("trainer.loss_mask.tool", AS_IS),
    "val.interval": ("trainer.val.interval", AS_IS),
    "val.data.name": ("trainer.val.data.name", AS_IS),
    "val.data.batch_size": ("trainer.val.data.batch_size", AS_IS),
    "val.data.subsets": ("trainer.val.data.subsets", AS_IS),
    "val.data.splits": ("trainer.val.data.splits", AS_IS),
    "val.data.probabilities": ("trainer.val.data.probabilities", AS_IS),
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
    "difficulty_filter.enabled": ("orchestrator.online_difficulty_filtering", SWITCH),
    "difficulty_filter.min_reward": ("orchestrator.difficulty_filter.min_reward", AS_IS),
    "difficulty_filter.max_reward": ("orchestrator.difficulty_filter.max_reward", AS_IS),
    "difficulty_filter.min_reward_variance": ("orchestrator.difficulty_filter.min_reward_variance", AS_IS),
    # `[kl_penalty]`: the penalty toward the initial policy, its coefficient adapted toward target_kl
    "kl_penalty.enabled": ("trainer.loss.ref_kl_coef", SWITCH),
    "kl_penalty.beta": ("trainer.loss.ref_kl_coef", AS_IS),
    "kl_penalty.target_kl": ("trainer.loss.target_kl", AS_IS),
    # `[slurm]`: the job goes to SLURM (the nodes' shapes are the `cluster=...` group's)
    "slurm": ("cluster.backend", TABLE),
    "slurm.partition": ("cluster.partition", AS_IS),
    "slurm.account": ("cluster.account", AS_IS),
    "slurm.time": ("cluster.time", AS_IS),
    "slurm.exclude": ("cluster.exclude", AS_IS),
}

TABLE_VALUE = {"slurm": "slurm"}
"""TABLE: the value the table given sets"""

SWITCHES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "difficulty_filter.enabled": (
        {"orchestrator.online_difficulty_filtering": True},
        {
            "orchestrator.online_difficulty_filtering": False,
            "orchestrator.difficulty_filter.min_reward": None,
            "orchestrator.difficulty_filter.max_reward": None,
            "orchestrator.difficulty_filter.min_reward_variance": 0.0,
        },
    ),
    "kl_penalty.enabled": ({}, {"trainer.loss.ref_kl_coef": 0.0, "trainer.loss.target_kl": None}),
}
"""SWITCH: `<table>.enabled` -> (what true sets, what false sets); false also leaves the
table's other keys unused (the feature is off)"""

TAKEN_VALUES: dict[str, dict[Any, dict[str, Any]]] = {"data.type": {"sft": {}}}
"""VALUES: the values taken and what each sets (`sft`: nothing more, the `[data]` table is
already an SFT run); another is refused with its `REFUSED` line"""

REFUSED: dict[str, tuple[str, str]] = {
    "renderer": (
        "orchestrator.trajectory_strategy",
        "a classic env's turns are tokenized with the model's own chat template (a verifiers v1 task set's "
        "renderer is orchestrator.env[i].renderer); for a template "
        "that drops earlier reasoning (Qwen3's) give orchestrator.trajectory_strategy=branching",
    ),
    "data.type": (
        "bench.mode",
        "prime-hpc trains on real data only; batches of fake data of the configured shape are its "
        "trainer benchmark (submit --bench trainer)",
    ),
    "trainer.scheduler.decay_steps": (
        "trainer.optim.schedule",
        "prime-hpc's linear schedule decays from the end of warm-up to max_steps, with no constant "
        "stretch before it: only decay_steps = 0 or max_steps - warmup_steps is the same",
    ),
    "trainer.scheduler.min_lr": (
        "trainer.optim.min_lr_ratio",
        "prime-hpc's floor is a fraction of trainer.optim.lr, not a learning rate: only 0 is the same",
    ),
    "orchestrator.wandb": (
        "wandb.project",
        "prime-hpc logs trainer and orchestrator into one W&B run (wandb.*), not one run each",
    ),
    "trainer.wandb": (
        "wandb.project",
        "prime-hpc logs trainer and orchestrator into one W&B run (wandb.*), not one run each",
    ),
    "trainer.wandb.log_extras.samples": (
        "wandb.log_extras.samples",
        "the trainer logs no samples table: the run's (the orchestrator's) is wandb.log_extras.samples",
    ),
    "slurm.job_name": ("name", "the job's name is the run's name, which also names its output_dir"),
    "slurm.nodelist": ("cluster.exclude", "prime-hpc places each het group on nodes itself; it takes no node list"),
    "slurm.template_path": (
        "cluster.sbatch_extra",
        "prime-hpc renders its own het-job script (sbatch_templates/); extra #SBATCH lines go in cluster.sbatch_extra",
    ),
    "slurm.project_dir": ("cluster.python", "the nodes run the submitting interpreter (or cluster.python), no uv sync"),
    "slurm.pre_run_command": (
        "cluster.env_setup",
        "cluster.env_setup runs before every component on every node, not once on the head node",
    ),
    "slurm.cleanup_grace_period": (
        "cluster.signal_delay_s",
        "a job whose component fails ends at once; checkpoints are complete or absent, never partial",
    ),
    "slurm.shared_fs": ("cluster.cache_dir", "prime-hpc needs a filesystem every node shares: the run directory"),
}
"""Reference keys (or tables) with no counterpart: the nearest prime-hpc key and why not"""
REFUSED["scheduler.decay_steps"] = REFUSED["trainer.scheduler.decay_steps"]
REFUSED["scheduler.min_lr"] = REFUSED["trainer.scheduler.min_lr"]

ENV_ENTRY = {"id": "id", "args": "args", "ratio": "ratio", "weight": "ratio", "name": "name"}
"""the keys of one `[[orchestrator.env]]` / `[[env]]` table"""

SFT_SECTIONS = ("data", "optim", "scheduler", "loss_mask", "val")
"""top-level tables of the SFT trainer's layout: a file with one composes `trainer=sft`"""

OWN_TABLE = "prime_hpc"
"""`[prime_hpc]`: prime-hpc keys given as they are (what `config export` writes for the keys
the reference's layout has no counterpart of)"""
NULL_KEYS = "null_keys"
"""`[prime_hpc] null_keys = ["key", ...]`: those keys set to null"""

LOG_LEVEL_VAR = "PRIME_LOG_LEVEL"
LOG_LEVELS = {"debug": "debug", "info": "info", "warning": "warning", "warn": "warning", "error": "error"}
"""the reference's log level names (any case) -> prime-hpc's (`schema.LEVELS`); its `trace`,
`success` and `critical` have none: prime-hpc logs nothing finer than debug, between info and
warning, or coarser than error"""
TOOLKIT_VARS = ("PRIME_API_KEY", LOG_LEVEL_VAR)
"""`PRIME_` variables that are not config (with every `PRIME_HPC_*`): never read as keys, never
warned about"""
ORIGINS: dict[str, str] = {}
"""prime-hpc key -> `source: reference key` of the last `expand` (see `origin`)"""
_SECTIONS = {".".join(k.split(".")[:i]) for k in MAPPING for i in range(1, k.count(".") + 1)}
"""every table of the layout: each proper prefix of a key of the table"""
_DICT_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*")


def is_config_var(name: str) -> bool:
    """A `PRIME_` variable that may be config (not the toolkit's own: `TOOLKIT_VARS`, `PRIME_HPC_*`)."""
    return name.startswith("PRIME_") and not name.startswith("PRIME_HPC_") and name not in TOOLKIT_VARS


def _say(line: str) -> None:
    print(f"prime-hpc: {line}", file=sys.stderr)


def log_level(value: Any, where: str, fix: str = "") -> str:
    """prime-hpc's log level for the reference's `value` (any case; WARN is warning); one line
    naming `where` (and `fix`, how else) for one prime-hpc has not."""
    from prime_hpc.config.schema import LEVELS

    level = LOG_LEVELS.get(str(value).strip().lower()) if isinstance(value, str) else None
    if level is None:
        raise UserError(
            f"{where}={value!r}: prime-hpc has no such log level; choose from {', '.join(LEVELS)} (WARN is "
            f"warning){fix}"
        )
    return level


def expand(words: list[str], environ: Mapping[str, str]) -> list[str]:
    """The command line's `words` with each `@ file` / `@file` replaced: the overrides of the
    `PRIME_` variables, then of the files in order, then the remaining words. A log level in
    `$PRIME_LOG_LEVEL` that prime-hpc lacks is refused only when it would be used (nothing
    else sets `log.level`)."""
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
        fix = f", or give log.level=... (then ${LOG_LEVEL_VAR} is not read)"
        out.insert(0, override("log.level", log_level(level, f"${LOG_LEVEL_VAR}", fix)))
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
    value of the table (`PRIME_MAX_STEPS`, `PRIME_MODEL`) counts too, and says so on stderr
    in one line; one that is no such value (`PRIME_MAX_STEP`, `PRIME_WANDB`) is not applied,
    with a warning naming the nearest. The toolkit's own variables (`TOOLKIT_VARS`,
    `PRIME_HPC_*`) are not config."""
    out: list[str] = []
    for name in sorted(environ):
        if not is_config_var(name):
            continue
        parts = name[len("PRIME_") :].lower().split("__")
        if len(parts) == 1:
            key = parts[0]
            how = MAPPING[key][1] if key in MAPPING else None
            if how not in (AS_IS, LEVEL, PLUS_ONE, GPU_LIST):
                _say(f"warning: {name} is not applied: {_one_part_hint(key)}")
                continue
        tree: dict = {}
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = _parse_value(environ[name])
        got = overrides_of(tree, name)
        if len(parts) == 1:
            _say(f"{name}={environ[name]} applied: {', '.join(got)}")
        out += got
    return out


def _one_part_hint(key: str) -> str:
    values = [k for k, (_, how) in MAPPING.items() if "." not in k and how in (AS_IS, LEVEL, PLUS_ONE, GPU_LIST)]
    if key in MAPPING:
        return f"{key} is a table of the reference's layout, not a value (PRIME_{key.upper()}__<KEY>=...)"
    near = difflib.get_close_matches(key, values, n=1, cutoff=0.0)
    target = f" ({MAPPING[near[0]][0]})" if near else ""
    return "no run-level key of the reference's layout" + (
        f"; nearest: PRIME_{near[0].upper()}{target}" if near else ""
    )


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
    _walk(data, "", source, out, data)
    return out


def _set(out: list[str], ours: str, value: Any, source: str, key: str) -> None:
    """One override of prime-hpc's `ours` to `value` (TOML data; None: null), from `key`."""
    text = "null" if value is None else _hydra(value, key, source)
    out.append(f"{'++' if isinstance(value, dict) else ''}{ours}={text}")
    ORIGINS[ours] = f"{source}: {key}"


def _walk(node: dict, prefix: str, source: str, out: list[str], root: dict) -> None:
    for k, value in node.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if key == OWN_TABLE:
            if not isinstance(value, dict):
                raise UserError(f"{source}: {OWN_TABLE} is a table of prime-hpc keys ([{OWN_TABLE}]), not {value!r}")
            _own(value, "", source, out)
            continue
        target = MAPPING.get(key)
        if target is not None and target[1] == SCHEDULER:
            if not isinstance(value, dict):
                raise UserError(f"{source}: {key} is a table ([{key}]), not {value!r}")
            for ours, v in scheduler_overrides(value, key, source, root).items():
                _set(out, ours, v, source, key)
            continue
        if isinstance(value, dict) and (key in _SECTIONS or (target is None and value)):
            if target is not None and target[1] == PRESENT:
                _set(out, target[0], True, source, key)
            elif target is not None and target[1] == TABLE:
                _set(out, target[0], TABLE_VALUE[key], source, key)
            switch = f"{key}.enabled"
            if switch in SWITCHES and value.get("enabled") is False:  # the feature off: its other keys unused
                value = {"enabled": False}
            _walk(value, key, source, out, root)  # an unknown table: refused at its first key
            continue
        if target is None:
            raise _unknown(source, key)
        ours, how = target
        if how == PRESENT:
            if not isinstance(value, bool):
                raise UserError(f"{source}: {key} is a table ([{key}]) or true/false, not {value!r}")
            _set(out, ours, value, source, key)
        elif how == TABLE:
            raise UserError(f"{source}: {key} is a table ([{key}]), not {value!r}")
        elif how == ENVS:
            out.append(f"{ours}={_envs(value, key, source)}")
            ORIGINS[ours] = f"{source}: {key}"
        elif how == LEVEL:
            _set(out, ours, log_level(value, f"{source}: {key}"), source, key)
        elif how == PLUS_ONE:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise UserError(f"{source}: {key} is a whole number of steps >= 0 (0: synchronous), not {value!r}")
            _set(out, ours, value + 1, source, key)  # the reference's 0 (synchronous) is prime-hpc's 1
        elif how == GPU_LIST:
            ok = (
                isinstance(value, list) and value and all(isinstance(i, int) and not isinstance(i, bool) for i in value)
            )
            if not ok or min(value) < 0:
                raise UserError(f"{source}: {key} is a list of GPU ids, e.g. [0, 1], not {value!r}")
            _set(out, f"{ours}.gpu_ids", ",".join(map(str, value)), source, key)
            _set(out, f"{ours}.gpus_per_node", len(value), source, key)
        elif how == SWITCH:
            if not isinstance(value, bool):
                raise UserError(f"{source}: {key} is true or false, not {value!r}")
            for o, v in SWITCHES[key][0 if value else 1].items():
                _set(out, o, v, source, key)
        elif how == VALUES:
            if isinstance(value, bool) or value not in TAKEN_VALUES[key]:
                near, why = REFUSED[key]
                raise UserError(
                    f"{source}: {key} = {value!r} has no prime-hpc counterpart: {why} (nearest prime-hpc key: {near})"
                )
            for o, v in TAKEN_VALUES[key][value].items():
                _set(out, o, v, source, key)
        else:  # a table value (extra_body) merges into the one there: Hydra overrides no dict with `key=`
            _set(out, ours, value, source, key)


def scheduler_overrides(table: dict, key: str, source: str, root: dict) -> dict[str, Any]:
    """prime-hpc's schedule keys for the reference's `[trainer.scheduler]` (or the SFT layout's
    `[scheduler]`): `type` constant (no warm-up), cosine or linear, `warmup_steps` (10 unless
    constant, the reference's default), `min_lr` 0 only; linear only when its decay is
    prime-hpc's (from the end of warm-up to max_steps: `decay_steps` = the file's max_steps -
    warmup_steps) or absent (`decay_steps = 0`: constant after the warm-up)."""
    kind = table.get("type", "constant")
    keys = {"constant": ("type",), "cosine": ("type", "warmup_steps", "min_lr")}
    keys["linear"] = (*keys["cosine"], "decay_steps")
    if kind not in keys:
        raise UserError(f"{source}: {key}.type is one of {', '.join(keys)}, not {kind!r}")
    for k in table:
        if k not in keys[kind]:
            raise _unknown(source, f"{key}.{k}", f" (a {kind} schedule has {', '.join(keys[kind])})")
    for k in ("warmup_steps", "decay_steps"):
        v = table.get(k, 0)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise UserError(f"{source}: {key}.{k} is a whole number of steps >= 0, not {v!r}")
    min_lr = table.get("min_lr", 0)
    if isinstance(min_lr, bool) or not isinstance(min_lr, (int, float)):
        raise UserError(f"{source}: {key}.min_lr is a number, not {min_lr!r}")
    if min_lr != 0:
        raise _refused(source, f"{key}.min_lr", REFUSED[f"{key}.min_lr"])
    warmup = 0 if kind == "constant" else table.get("warmup_steps", 10)
    schedule = kind
    if kind == "linear":
        decay = table.get("decay_steps", 10)
        max_steps = root.get("max_steps", (root.get("trainer") or {}).get("max_steps"))
        if decay == 0:
            schedule = "constant"  # warm-up, then constant: no decay phase
        elif max_steps != warmup + decay:
            raise _refused(source, f"{key}.decay_steps", REFUSED[f"{key}.decay_steps"])
    return {"trainer.optim.schedule": schedule, "trainer.optim.warmup_steps": warmup, "trainer.optim.min_lr_ratio": 0.0}


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


def refusal(key: str) -> tuple[str, str] | None:
    """(nearest prime-hpc key, why) of `REFUSED` for `key` or the table above it."""
    while key:
        if key in REFUSED:
            return REFUSED[key]
        key = key.rpartition(".")[0]
    return None


def _refused(source: str, key: str, why: tuple[str, str]) -> UserError:
    return UserError(f"{source}: {key} has no prime-hpc counterpart: {why[1]} (nearest prime-hpc key: {why[0]})")


def _unknown(source: str, key: str, extra: str = "") -> UserError:
    why = refusal(key)
    if why is not None:
        return _refused(source, key, why)
    near = difflib.get_close_matches(key, list(MAPPING), n=1, cutoff=0.0)
    hint = f"; nearest known key: {near[0]}" if near else ""
    return UserError(
        f"{source}: {key} has no prime-hpc counterpart{extra}{hint} (docs/configuration.md, recipes in the "
        f"reference's TOML layout; give prime-hpc's key as an override instead)"
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
        LEVEL: "the level, any case; `warn`: `warning`",
        PLUS_ONE: "the value + 1 (the reference's 0, synchronous, is prime-hpc's 1)",
        GPU_LIST: "`[0, 1]`: `gpu_ids` `0,1` and `gpus_per_node` 2",
        SCHEDULER: "the table: `type` (constant, cosine, linear) -> `trainer.optim.schedule`; `warmup_steps` "
        "(10 unless constant) -> `trainer.optim.warmup_steps`; `min_lr` 0 only; linear with `decay_steps` 0 "
        "(then constant) or the file's `max_steps` - `warmup_steps`",
    }

    def value(k: str, h: str) -> str:
        if h == TABLE:
            return f"`[{k}]` given (even empty): `{TABLE_VALUE[k]}`"
        if h == SWITCH:
            on, off = (
                ", ".join(f"`{o}={_hydra(v, k, '') if v is not None else 'null'}`" for o, v in d.items())
                for d in SWITCHES[k]
            )
            return f"`true`: {on or 'the table applies'}; `false`: {off}, the table's other keys unused"
        if h == VALUES:
            return (
                "; ".join(f"`{v}`: {', '.join(d) or 'nothing more'}" for v, d in TAKEN_VALUES[k].items())
                + "; else refused"
            )
        return how[h]

    lines = ["| reference key | prime-hpc key | value |", "| --- | --- | --- |"]
    lines += [f"| `{k}` | `{t}` | {value(k, h)} |" for k, (t, h) in MAPPING.items()]
    return "\n".join(lines) + "\n"


def refused_markdown() -> str:
    """docs/configuration.md's table of `REFUSED` (a test keeps the two the same)."""
    lines = ["| reference key | nearest prime-hpc key | why not |", "| --- | --- | --- |"]
    lines += [f"| `{k}` | `{near}` | {why} |" for k, (near, why) in REFUSED.items()]
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
    found = [k for k, (t, how) in MAPPING.items() if t == target and how in EXPORTED_KINDS]
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

    def off(ref: str) -> bool:  # a table above it that would turn on what is off in `run`
        parts = ref.split(".")
        for table in (".".join(parts[:i]) for i in range(1, len(parts))):
            ours, how = MAPPING.get(table, ("", AS_IS))
            if (how == PRESENT and _get(run, ours) is not True) or (
                how == TABLE and _get(run, ours) != TABLE_VALUE[table]
            ):
                return True
        return False

    for target, ref in exported.items():  # in the table's order
        if off(ref):
            continue  # its feature is off: a [table] would turn it on; in [prime_hpc] if not the default
        value = _get(run, target)
        how = MAPPING[ref][1]
        if value is _MISSING or (how == ENVS and value and not _in_env_layout(value)):
            continue  # (an env list with a setting the layout has not: in [prime_hpc], whole)
        covered.add(target)
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
            value = [{back[k]: v for k, v in e.items() if v is not None and k in back} for e in value]
        elif how == PLUS_ONE:
            value = value - 1  # prime-hpc's 1 (synchronous) is the reference's 0
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
            if isinstance(value, list):  # a list of entries: a key left null takes its default back
                value = [{k: v for k, v in e.items() if v is not None} if isinstance(e, dict) else e for e in value]
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


def _in_env_layout(entries: list) -> bool:
    """Whether every setting of these env entries (prime-hpc's `EnvEntry`) is one the layout's
    `[[orchestrator.env]]` has (`ENV_ENTRY`) or the schema's default."""
    import dataclasses

    from prime_hpc.config.schema import EnvEntry

    default = {
        f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        for f in dataclasses.fields(EnvEntry)
    }
    ours = set(ENV_ENTRY.values())
    return all(k in ours or v == default.get(k, _MISSING) for e in entries for k, v in e.items())


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
