"""Cross-field validation: every rule that involves more than one key lives here, runs at
submit time (and at `--dry-run`), and raises one `ConfigError` naming the key and the fix.

Type and unknown-key errors are caught earlier, by the typed schema during composition.
"""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from typing import Any, Callable, Iterable

from omegaconf import DictConfig

from prime_hpc.errors import ConfigError

CHOICES = {
    "cluster.backend": ("local", "slurm"),
    "cluster.device": ("cpu", "cuda"),
    "trainer.type": ("rl", "sft"),
    "trainer.loss.type": ("dppo", "cispo"),
    "trainer.model.optimization_dtype": ("bfloat16", "float32"),
    "trainer.model.reduce_dtype": ("bfloat16", "float32"),
    "orchestrator.training_mode": ("rl", "opd", "sft"),
    "orchestrator.advantage": ("mean", "std", "loo"),
    "trainer.optim.schedule": ("constant", "linear", "cosine"),
    "inference.dtype": ("auto", "float16", "bfloat16", "float32"),
    "log.level": ("debug", "info", "warning", "error"),
    "trainer.log.level": ("debug", "info", "warning", "error"),
    "orchestrator.log.level": ("debug", "info", "warning", "error"),
    "orchestrator.log.vf_level": ("debug", "info", "warning", "error"),
}


def _get(cfg: DictConfig, dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        node = node[part]
    return node


def check_choices(cfg: DictConfig) -> None:
    for key, options in CHOICES.items():
        value = _get(cfg, key)
        if value not in options:
            raise ConfigError(key, f"unknown value {value!r}; choose from {', '.join(options)}")


def check_positive(cfg: DictConfig) -> None:
    for key in ("orchestrator.batch_size", "orchestrator.group_size", "orchestrator.max_concurrent",
                "orchestrator.max_off_policy_steps", "seq_len", "trainer.micro_batch_size",
                "cluster.orchestrator.nodes", "cluster.inference.nodes", "cluster.trainer.nodes",
                "inference.tensor_parallel_size", "inference.data_parallel_size"):
        if _get(cfg, key) is not None and _get(cfg, key) < 1:
            raise ConfigError(key, f"must be >= 1 (got {_get(cfg, key)})")
    if cfg.async_level < 1:
        raise ConfigError("async_level", f"must be >= 1 (got {cfg.async_level}); 1 is fully on-policy (step n "
                                         "trains on rollouts of policy n-1)")
    if cfg.cluster.max_requeues < 0:
        raise ConfigError("cluster.max_requeues", f"must be >= 0 (got {cfg.cluster.max_requeues})")
    for g in ("orchestrator", "inference", "trainer"):
        ids = cfg.cluster[g].cpu_ids
        if ids is not None and ids != "auto" and not re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", str(ids)):
            raise ConfigError(f"cluster.{g}.cpu_ids", f"{ids!r} is not a core list; use e.g. 0-3,8, auto or null")
    if cfg.max_steps is not None and cfg.max_steps < 1:
        raise ConfigError("max_steps", f"must be >= 1 or null (got {cfg.max_steps})")
    if cfg.cluster.orchestrator.nodes != 1:
        raise ConfigError("cluster.orchestrator.nodes", "the orchestrator runs on exactly one node; set it to 1")
    for key in ("trainer.optim.lr", "trainer.optim.max_norm"):
        if _get(cfg, key) <= 0:
            raise ConfigError(key, f"must be > 0 (got {_get(cfg, key)})")
    if not 0 <= cfg.trainer.optim.min_lr_ratio <= 1:
        raise ConfigError("trainer.optim.min_lr_ratio", f"must be in [0, 1] (got {cfg.trainer.optim.min_lr_ratio})")
    if not 0 < cfg.inference.gpu_memory_utilization <= 1:
        raise ConfigError("inference.gpu_memory_utilization", "must be in (0, 1]")


def check_batch(cfg: DictConfig) -> None:
    o = cfg.orchestrator
    if o.batch_size % o.group_size:
        lower = o.batch_size // o.group_size * o.group_size or o.group_size
        raise ConfigError(
            "orchestrator.batch_size",
            f"{o.batch_size} is not a multiple of orchestrator.group_size={o.group_size}; "
            f"set it to {lower} or {lower + o.group_size}",
        )


def check_lengths(cfg: DictConfig) -> None:
    mml = cfg.inference.max_model_len
    if mml is not None and mml > cfg.seq_len:
        raise ConfigError(
            "inference.max_model_len",
            f"{mml} exceeds seq_len={cfg.seq_len}: the trainer could not fit a full rollout; "
            f"set inference.max_model_len<={cfg.seq_len} or raise seq_len",
        )
    max_tokens = cfg.orchestrator.sampling.max_tokens
    limit = mml if mml is not None else cfg.seq_len
    if max_tokens is not None and max_tokens >= limit:
        raise ConfigError(
            "orchestrator.sampling.max_tokens",
            f"{max_tokens} leaves no room for the prompt within {limit} tokens (max_model_len); lower it",
        )


def check_gpus(cfg: DictConfig) -> None:
    c = cfg.cluster
    groups = {"orchestrator": c.orchestrator, "inference": c.inference, "trainer": c.trainer}
    if c.device == "cpu":
        for name, g in groups.items():
            if g.gpus_per_node:
                raise ConfigError(
                    f"cluster.{name}.gpus_per_node",
                    f"{g.gpus_per_node} GPUs requested but cluster.device=cpu; set it to 0 or cluster.device=cuda",
                )
        return
    inf = cfg.inference
    tp, dp, gpus = inf.tensor_parallel_size, inf.data_parallel_size, c.inference.gpus_per_node
    if dp is None and (gpus < tp or gpus % tp):
        raise ConfigError(
            "cluster.inference.gpus_per_node",
            f"{gpus} GPUs per node cannot hold replicas of inference.tensor_parallel_size={tp}; "
            f"use a multiple of {tp}",
        )
    if dp is not None and tp * dp != gpus:
        raise ConfigError(
            "cluster.inference.gpus_per_node",
            f"{gpus} GPUs per node but inference.tensor_parallel_size x data_parallel_size "
            f"= {tp} x {dp} = {tp * dp}; make them equal",
        )
    if c.trainer.gpus_per_node < 1:
        raise ConfigError("cluster.trainer.gpus_per_node", "cluster.device=cuda needs >= 1 GPU per trainer node")
    nproc = c.trainer.nproc_per_node
    if nproc is not None and nproc != c.trainer.gpus_per_node:
        raise ConfigError(
            "cluster.trainer.nproc_per_node",
            f"{nproc} ranks per node but {c.trainer.gpus_per_node} GPUs per node; one rank per GPU "
            f"(set it to {c.trainer.gpus_per_node} or null)",
        )


def check_slurm(cfg: DictConfig) -> None:
    from prime_hpc.launcher.slurm import minutes  # light: no SLURM needed

    c = cfg.cluster
    try:
        limit = minutes(c.time)
    except ValueError:
        raise ConfigError("cluster.time", f"{c.time!r} is not a SLURM time; use e.g. 04:00:00, 2-00:00:00 or "
                                          "UNLIMITED") from None
    if c.signal_delay_s < 0 or (limit is not None and c.signal_delay_s >= limit * 60):
        raise ConfigError("cluster.signal_delay_s", f"{c.signal_delay_s}s must be >= 0 and shorter than "
                                                    f"cluster.time={c.time}")
    for i, line in enumerate(c.sbatch_extra):
        if "\n" in line or not line.strip().startswith("-"):
            raise ConfigError(f"cluster.sbatch_extra.{i}", f"{line!r} must be one sbatch option such as "
                                                           "--mail-type=END (no newline)")
    for g in ("orchestrator", "inference", "trainer"):
        r = c[g]
        if r.cpus_per_task < 1:
            raise ConfigError(f"cluster.{g}.cpus_per_task", f"must be >= 1 (got {r.cpus_per_task})")
        if r.gpus_per_node < 0:
            raise ConfigError(f"cluster.{g}.gpus_per_node", f"must be >= 0 (got {r.gpus_per_node})")
        if r.nproc_per_node is not None and r.nproc_per_node < 1:
            raise ConfigError(f"cluster.{g}.nproc_per_node", f"must be >= 1 or null (got {r.nproc_per_node})")
        if r.mem_gb is not None and r.mem_gb <= 0:
            raise ConfigError(f"cluster.{g}.mem_gb", f"must be > 0 or null (got {r.mem_gb})")


def check_memory(cfg: DictConfig) -> None:
    """SLURM copies --mem from one het group to the next, so a group without mem_gb would
    silently inherit another group's limit."""
    groups = ("orchestrator", "inference", "trainer")
    unset = [g for g in groups if cfg.cluster[g].mem_gb is None]
    if unset and len(unset) < len(groups):
        given = next(g for g in groups if g not in unset)
        raise ConfigError(
            f"cluster.{unset[0]}.mem_gb",
            f"set mem_gb for every group or for none (cluster.{given}.mem_gb is set, and SLURM would copy it "
            "to groups without one)",
        )


def check_models(cfg: DictConfig) -> None:
    ref = cfg.model.name
    for key in ("trainer.model.name", "trainer.tokenizer.name", "inference.model.name", "orchestrator.model.name"):
        if _get(cfg, key) != ref:
            raise ConfigError(
                key, f"{_get(cfg, key)!r} differs from model.name={ref!r}; set model.name once and leave this unset"
            )


def check_envs(cfg: DictConfig, importable: Callable[[str], str | None] | None = None) -> None:
    """Every env id must be importable (installed package, or a module on the path)."""
    importable = importable or env_import_error
    o = cfg.orchestrator
    if cfg.trainer.type == "rl" and not o.env:
        raise ConfigError("orchestrator.env", "no training environment; add env=<name> or +experiment=<name>")
    for where, entries in (("orchestrator.env", o.env), ("orchestrator.eval.env", o.eval.env)):
        for i, e in enumerate(entries):
            if e.ratio <= 0:
                raise ConfigError(f"{where}.{i}.ratio", f"must be > 0 (got {e.ratio})")
            err = importable(e.id)
            if err:
                raise ConfigError(
                    f"{where}.{i}.id",
                    f"cannot import environment {e.id!r} ({err}); install its package (pip install -e <path>) "
                    "or fix the id",
                )


def env_import_error(module: str) -> str | None:
    """Why `module` cannot be imported (None if it can), without importing it."""
    if not module or any(not part.isidentifier() for part in module.split(".")):
        return "not a module name"
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError) as e:
        return str(e)
    return None if spec is not None else f"no module named {module!r} in {Path(sys.executable).parent.parent}"


def check_training_mode(cfg: DictConfig) -> None:
    mode = cfg.orchestrator.training_mode
    teacher = cfg.orchestrator.teacher.client.base_url
    if mode in ("opd", "sft") and not teacher:
        raise ConfigError(
            "orchestrator.teacher.client.base_url",
            f"training_mode={mode} needs a teacher server; set it to the teacher's OpenAI URL (http://host:port/v1)",
        )
    if mode == "rl" and teacher:
        raise ConfigError(
            "orchestrator.teacher.client.base_url",
            "a teacher is only used with training_mode=opd or sft; unset it or change the mode",
        )


def check_sft(cfg: DictConfig) -> None:
    t = cfg.trainer
    if t.type != "sft":
        return
    if not t.data.name:
        raise ConfigError("trainer.data.name", "an SFT run needs a dataset; set it to a HF dataset name, a local "
                                               "path or module:function")
    if t.data.batch_size < t.data.seq_len:
        raise ConfigError("trainer.data.batch_size", f"{t.data.batch_size} tokens per step is less than one packed "
                                                     f"row of trainer.data.seq_len={t.data.seq_len}; raise it to a "
                                                     f"multiple of {t.data.seq_len}")
    if t.val.interval is not None:
        if t.val.interval < 1:
            raise ConfigError("trainer.val.interval", f"must be >= 1 or null (got {t.val.interval})")
        if not t.val.data.name:
            raise ConfigError("trainer.val.data.name", "trainer.val.interval is set but there is no validation "
                                                       "dataset; name one (same forms as trainer.data.name)")
    if t.val.stop_below is not None and not t.val.interval:
        raise ConfigError("trainer.val.stop_below", "needs validation: set trainer.val.interval (and "
                                                    "trainer.val.data.name)")


def check_trainer(cfg: DictConfig) -> None:
    m = cfg.trainer.model
    if m.ac.freq is not None and m.ac.freq < 1:
        raise ConfigError("trainer.model.ac.freq", f"must be >= 1 (every N-th layer) or null (got {m.ac.freq})")
    if m.lora.enabled:
        if m.lora.rank < 1:
            raise ConfigError("trainer.model.lora.rank", f"must be >= 1 (got {m.lora.rank})")
        if m.lora.alpha <= 0:
            raise ConfigError("trainer.model.lora.alpha", f"must be > 0 (got {m.lora.alpha})")
        if not 0 <= m.lora.dropout < 1:
            raise ConfigError("trainer.model.lora.dropout", f"must be in [0, 1) (got {m.lora.dropout})")
        if not m.lora.target_modules:
            raise ConfigError("trainer.model.lora.target_modules", "name at least one linear layer, e.g. [q_proj, v_proj]")
    if cfg.trainer.rollout_timeout_s <= 0:
        raise ConfigError("trainer.rollout_timeout_s", f"must be > 0 (got {cfg.trainer.rollout_timeout_s})")


def check_ckpt(cfg: DictConfig) -> None:
    k = cfg.ckpt
    for key in ("interval", "keep_last", "keep_interval"):
        v = k[key]
        if v is not None and v < 1:
            raise ConfigError(f"ckpt.{key}", f"must be >= 1 or null (got {v})")
    if k.step is not None and k.step < -1:
        raise ConfigError("ckpt.step", f"must be -1 (latest) or a step >= 0 (got {k.step})")
    if cfg.wandb.enabled and not cfg.wandb.project:
        raise ConfigError("wandb.project", "set a project name when wandb.enabled=true")


def check_output_dir(cfg: DictConfig) -> None:
    """output_dir must be (or be creatable as) a writable directory. Probed for real with
    a temporary directory in the nearest existing ancestor, removed at once."""
    import tempfile

    path = Path(cfg.output_dir)
    if any(c in str(path) for c in "%\\\n"):
        raise ConfigError("output_dir", f"{str(path)!r} contains '%', a backslash or a newline, which SLURM and "
                                        "submitit interpret in paths; choose a path without them")
    if path.exists() and not path.is_dir():
        raise ConfigError("output_dir", f"{path} exists and is not a directory; choose another output_dir")
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError("output_dir", f"{probe} is not a directory; choose another output_dir")
    try:
        tempfile.TemporaryDirectory(prefix=".prime-hpc-probe-", dir=probe).cleanup()
    except OSError as e:
        raise ConfigError(
            "output_dir", f"cannot write in {probe} ({e.strerror}); choose an output_dir on a writable shared filesystem"
        ) from None


def check_name(cfg: DictConfig) -> None:
    if not str(cfg.name).strip():
        raise ConfigError("name", "must not be empty")


RULES: tuple[Callable[[DictConfig], None], ...] = (
    check_name,
    check_choices,
    check_positive,
    check_batch,
    check_lengths,
    check_gpus,
    check_slurm,
    check_memory,
    check_models,
    check_training_mode,
    check_sft,
    check_trainer,
    check_ckpt,
    check_envs,
    check_output_dir,
)


def validate(cfg: DictConfig, rules: Iterable[Callable[[DictConfig], None]] = RULES) -> DictConfig:
    """Run every cross-field rule; the first violation raises `ConfigError`."""
    for rule in rules:
        rule(cfg)
    return cfg
