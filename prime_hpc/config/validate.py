"""Cross-field validation: every rule that involves more than one key lives here, runs at
submit time (and at `--dry-run`), and raises one `ConfigError` naming the key and the fix.

Type and unknown-key errors are caught earlier, by the typed schema during composition.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from omegaconf import DictConfig, OmegaConf

from prime_hpc.config import walk
from prime_hpc.config.cluster import own_teacher
from prime_hpc.config.schema import TEACHER_ENGINE
from prime_hpc.core.errors import ConfigError, UserError
from prime_hpc.core.jobenv import API_KEY_VAR
from prime_hpc.core.paths import is_local_path
from prime_hpc.rundir import COMPONENTS


def cluster_groups(cfg: DictConfig) -> tuple[str, ...]:
    """The groups whose `cluster.<group>` resources the run uses: the three components and,
    with a teacher the run starts itself (`orchestrator.teacher.model`), the teacher's."""
    return (*COMPONENTS, "teacher") if own_teacher(cfg) else COMPONENTS


def _get(cfg: DictConfig, dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        node = node[part]
    return node


def check_fields(cfg: DictConfig) -> None:
    """Every field's own rule (range or choices), declared with its type in the schema
    (`prime_hpc.config.schema.ruled` / `one_of`), and the length of a fixed-length one
    (`Tuple[X, Y]`)."""
    for site in walk.config_fields(cfg):
        if site.missing:
            raise ConfigError(site.key, "is required here and not set; give it a value")
        if site.section is not None or site.entries is not None:
            continue
        value = site.value
        rule = site.field.metadata.get("rule")
        problem = rule.violation(value) if rule is not None and value is not None else None
        problem = problem or length_violation(site.hint, value, site.field.default)
        if problem:
            raise ConfigError(site.key, problem)


def length_violation(hint: Any, value: Any, default: Any = None) -> Optional[str]:
    """A fixed-length field (typed `Tuple[X, Y]` in the schema; `Tuple[X, ...]` takes any
    length) given another number of values."""
    from typing import get_args, get_origin

    hint = walk.bare(hint)  # Optional[Tuple[...]]
    args = get_args(hint)
    if get_origin(hint) is not tuple or value is None or (args and args[-1] is Ellipsis) or len(value) == len(args):
        return None
    example = list(default) if isinstance(default, tuple) else [a.__name__ for a in args]
    return f"takes exactly {len(args)} values, e.g. {example} (got {len(value)}: {list(value)})"


def check_difficulty_filter(cfg: DictConfig) -> None:
    f = cfg.orchestrator.difficulty_filter
    if f.min_reward is not None and f.max_reward is not None and f.min_reward > f.max_reward:
        raise ConfigError(
            "orchestrator.difficulty_filter.min_reward",
            f"{f.min_reward} is above max_reward={f.max_reward}: every group would be dropped",
        )


def check_positive(cfg: DictConfig) -> None:
    if cfg.async_level < 1:
        raise ConfigError(
            "async_level",
            f"must be >= 1 (got {cfg.async_level}); 1 is fully on-policy (step n trains on rollouts of policy n-1)",
        )
    for g in cluster_groups(cfg):
        ids = cfg.cluster[g].cpu_ids
        if ids is not None and ids != "auto" and not re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", str(ids)):
            raise ConfigError(f"cluster.{g}.cpu_ids", f"{ids!r} is not a core list; use e.g. 0-3,8, auto or null")
    if cfg.cluster.orchestrator.nodes != 1:
        raise ConfigError("cluster.orchestrator.nodes", "the orchestrator runs on exactly one node; set it to 1")


def check_batch(cfg: DictConfig) -> None:
    o = cfg.orchestrator
    if o.batch_size % o.group_size:
        lower = o.batch_size // o.group_size * o.group_size or o.group_size
        raise ConfigError(
            "orchestrator.batch_size",
            f"{o.batch_size} is not a multiple of orchestrator.group_size={o.group_size}; "
            f"set it to {lower} or {lower + o.group_size}",
        )


def check_group_size(cfg: DictConfig) -> None:
    """A group of one is always dropped: in rl its advantage (its reward minus the group's
    mean) is 0, and the orchestrator keeps no group of fewer than 2 valid rollouts in any
    training mode (`prime_hpc.orchestrator.rollouts.judge_group`), so opd and sft could not
    fill a step either. Runs without groups (SFT on a dataset, benches) do not care."""
    o = cfg.orchestrator
    if o.group_size >= 2 or cfg.trainer.type != "rl" or cfg.bench.mode is not None:
        return
    why = (
        "an RL group of one has zero advantage: its reward minus the group's mean"
        if o.training_mode == "rl"
        else f"the orchestrator keeps no group of fewer than 2 rollouts, with training_mode={o.training_mode} too"
    )
    raise ConfigError(
        "orchestrator.group_size", f"{o.group_size}: every group would be dropped ({why}); set it to 2 or more"
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


def check_gpu_ids(cfg: DictConfig) -> None:
    """`cluster.<group>.gpu_ids`: a GPU list, on cuda, as many as `gpus_per_node`, and
    inference and trainer apart unless `cluster.share_gpus`."""
    from prime_hpc.core.device import id_list

    c = cfg.cluster
    ids: dict[str, set[int]] = {}
    for name in cluster_groups(cfg):
        spec = c[name].gpu_ids
        if spec is None:
            continue
        key = f"cluster.{name}.gpu_ids"
        if not re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", str(spec)):
            raise ConfigError(key, f"{spec!r} is not a GPU list; use e.g. 0-3 or 0,2")
        if c.device != "cuda":
            raise ConfigError(key, "GPU ids need cluster.device=cuda; set it to null")
        got = id_list(spec)
        if len(set(got)) != len(got):
            raise ConfigError(key, f"{spec!r} names a GPU twice")
        if len(got) != int(c[name].gpus_per_node):
            raise ConfigError(
                key, f"{len(got)} GPU(s) but cluster.{name}.gpus_per_node={c[name].gpus_per_node}; make them equal"
            )
        ids[name] = set(got)
    for a, b in (("inference", "trainer"), ("inference", "teacher"), ("trainer", "teacher")):
        both = ids.get(a, set()) & ids.get(b, set())
        if both and not c.share_gpus:
            raise ConfigError(
                f"cluster.{b}.gpu_ids",
                f"GPU(s) {sorted(both)} are also {a}'s; give each its own or set cluster.share_gpus=true",
            )


def check_gpus(cfg: DictConfig) -> None:
    c = cfg.cluster
    groups = {name: c[name] for name in cluster_groups(cfg)}
    check_gpu_ids(cfg)
    if c.device == "cpu":
        for name, g in groups.items():
            if g.gpus_per_node:
                raise ConfigError(
                    f"cluster.{name}.gpus_per_node",
                    f"{g.gpus_per_node} GPUs requested but cluster.device=cpu; set it to 0 or cluster.device=cuda",
                )
        return
    inf = cfg.inference
    check_replicas("inference", inf.tensor_parallel_size, inf.data_parallel_size, c.inference.gpus_per_node)
    if "teacher" in groups:
        t = cfg.orchestrator.teacher
        tp = t.tensor_parallel_size or inf.tensor_parallel_size
        dp = t.data_parallel_size if t.tensor_parallel_size or t.data_parallel_size else inf.data_parallel_size
        check_replicas("teacher", tp, dp, c.teacher.gpus_per_node, "orchestrator.teacher")
    if c.trainer.gpus_per_node < 1:
        raise ConfigError("cluster.trainer.gpus_per_node", "cluster.device=cuda needs >= 1 GPU per trainer node")
    nproc = c.trainer.nproc_per_node
    if nproc is not None and nproc != c.trainer.gpus_per_node:
        raise ConfigError(
            "cluster.trainer.nproc_per_node",
            f"{nproc} ranks per node but {c.trainer.gpus_per_node} GPUs per node; one rank per GPU "
            f"(set it to {c.trainer.gpus_per_node} or null)",
        )
    if "teacher" in groups and c.teacher.gpus_per_node < 1:
        raise ConfigError("cluster.teacher.gpus_per_node", "cluster.device=cuda needs >= 1 GPU per teacher node")


def check_replicas(group: str, tp: int, dp: Optional[int], gpus: int, engine: str = "inference") -> None:
    """A node of `group` holds whole vLLM replicas: its GPUs a multiple of the tensor
    parallel size, or equal to tp x dp when dp is set (`engine`: where tp and dp are set)."""
    if dp is None and (gpus < tp or gpus % tp):
        raise ConfigError(
            f"cluster.{group}.gpus_per_node",
            f"{gpus} GPUs per node cannot hold replicas of {engine}.tensor_parallel_size={tp}; use a multiple of {tp}",
        )
    if dp is not None and tp * dp != gpus:
        raise ConfigError(
            f"cluster.{group}.gpus_per_node",
            f"{gpus} GPUs per node but {engine}.tensor_parallel_size x data_parallel_size "
            f"= {tp} x {dp} = {tp * dp}; make them equal",
        )


def minutes(slurm_time: str) -> Optional[int]:
    """A SLURM time limit in minutes (None = unlimited). Formats: M, M:S, H:M:S, D-H,
    D-H:M, D-H:M:S, UNLIMITED/infinite. Raises ValueError otherwise."""
    text = slurm_time.strip()
    if text.lower() in ("unlimited", "infinite"):
        return None
    days, dash, rest = text.rpartition("-")
    parts = [int(p) for p in rest.split(":")]  # ValueError on garbage
    if any(p < 0 for p in parts) or not 1 <= len(parts) <= 3:
        raise ValueError(slurm_time)
    if dash:
        h, m, s = (parts + [0, 0])[:3]
    elif len(parts) == 3:
        h, m, s = parts
    else:
        h, (m, s) = 0, (parts + [0])[:2]
    return int(days or 0) * 1440 + h * 60 + m + (1 if s else 0)


def check_slurm(cfg: DictConfig) -> None:
    c = cfg.cluster
    try:
        limit = minutes(c.time)
    except ValueError:
        raise ConfigError(
            "cluster.time", f"{c.time!r} is not a SLURM time; use e.g. 04:00:00, 2-00:00:00 or UNLIMITED"
        ) from None
    if limit is not None and c.signal_delay_s >= limit * 60:  # its range is the field's own rule
        raise ConfigError("cluster.signal_delay_s", f"{c.signal_delay_s}s must be shorter than cluster.time={c.time}")
    if c.inference_job == "own" and cfg.trainer.type != "sft":
        from prime_hpc.sched.registry import choose

        if not choose(c.backend).extra_jobs:
            raise ConfigError(
                "cluster.inference_job",
                f"own puts the inference servers in a job of their own, which needs a scheduler to give it nodes; "
                f"cluster.backend={c.backend} has none: use het (the default) or cluster=slurm",
            )
    for i, line in enumerate(c.sbatch_extra):
        if "\n" in line or not line.strip().startswith("-"):
            raise ConfigError(
                f"cluster.sbatch_extra.{i}", f"{line!r} must be one sbatch option such as --mail-type=END (no newline)"
            )
        check_sbatch_option(i, line)


def check_sbatch_option(i: int, line: str) -> None:
    """`--export` and `--export-file` (also abbreviated: sbatch takes `--export-f`) are
    prime-hpc's own: the job must get the submitting environment, the only way the
    inference API key reaches it (`prime_hpc.core.jobenv.job_api_key`); an export file
    replaces that environment even next to `--export=ALL`. `--get-user-env` only adds the
    login environment below it: allowed."""
    from prime_hpc.core.jobenv import API_KEY_VAR

    option = re.split(r"[=\s]", line.strip(), maxsplit=1)[0]
    if option == "--export" or (option.startswith("--export-") and "--export-file".startswith(option)):
        raise ConfigError(
            f"cluster.sbatch_extra.{i}",
            f"{line.strip()!r}: prime-hpc passes the job the submitting "
            f"environment itself (${API_KEY_VAR} reaches the job only that "
            "way); drop this line and set variables in cluster.env_setup, "
            "e.g. 'export NAME=value'",
        )


def check_memory(cfg: DictConfig) -> None:
    """SLURM copies --mem from one het group to the next, so a group without mem_gb would
    silently inherit another group's limit."""
    groups = cluster_groups(cfg)
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
    path = Path(str(ref)).expanduser()
    from prime_hpc.config.pipeline import WARMUP_DIR

    from_warmup = bool(cfg.warmup.experiment) and path == Path(cfg.output_dir) / WARMUP_DIR  # the warm-up writes it
    if is_local_path(str(ref)) and not path.exists() and not from_warmup:
        raise ConfigError(
            "model.name",
            f"{ref}: no such directory (a local path; a hub id has no leading / or ./); "
            "give an existing model directory, a run directory or a hub id",
        )
    for key in ("trainer.model.name", "trainer.tokenizer.name", "inference.model.name", "orchestrator.model.name"):
        if _get(cfg, key) != ref:
            raise ConfigError(
                key, f"{_get(cfg, key)!r} differs from model.name={ref!r}; set model.name once and leave this unset"
            )


def check_envs(cfg: DictConfig, importable: Callable[[str], str | None] | None = None) -> None:
    """Every env id must be importable (installed package, or a module on the path), here or,
    for a verifiers v1 task set or an entry with `python`, by the Python that runs it."""
    importable = importable or env_import_error
    if cfg.bench.mode is not None or cfg.serve.enabled:  # a bench, a serve job: no env is loaded
        return
    o = cfg.orchestrator
    evaluating = bool(cfg.eval_job.steps)  # an eval job loads only the eval envs
    if cfg.trainer.type == "rl" and not o.env and not evaluating:
        raise ConfigError("orchestrator.env", "no training environment; add env=<name> or +experiment=<name>")
    if evaluating and not o.eval.env:
        raise ConfigError("orchestrator.eval.env", "an eval job needs eval environments")
    checked = (
        (("orchestrator.eval.env", o.eval.env),)
        if evaluating
        else (
            ("orchestrator.env", o.env),
            ("orchestrator.eval.env", o.eval.env),
        )
    )
    from prime_hpc.config.env_kinds import CLASSIC_RENDERER, classic_here, submit_error

    for where, entries in checked:
        for i, e in enumerate(entries):
            python = e.get("python")
            here = importable(e.id) if python is None else None
            # a v1 task set, or an env of another Python: asked of the Python that runs it
            err = submit_error(e.id, python, f"{where}.{i}", here) if python is not None or here else None
            if err:
                raise ConfigError(f"{where}.{i}.{'python' if python else 'id'}", err)
            renderer = e.get("renderer")
            if renderer is not None and not renderer.get("name"):
                raise ConfigError(
                    f"{where}.{i}.renderer",
                    "names no renderer: give name (auto, default, qwen3, ...) beside its options",
                )
            if renderer is not None and python is None and here is None and classic_here(e.id):
                raise ConfigError(f"{where}.{i}.renderer", CLASSIC_RENDERER)


def env_import_error(env_id: str) -> str | None:
    """Why `env_id` cannot be loaded (None if it can), without importing it
    (`prime_hpc.config.env_ids`, the resolver the orchestrator loads with)."""
    from prime_hpc.config.env_ids import import_error

    return import_error(env_id)


TEACHER_SOURCES = ("client.base_url", "model", "serve")  # orchestrator.teacher.<one of these>


def check_training_mode(cfg: DictConfig) -> None:
    """opd and sft need one teacher (a URL, a serve job, or servers the run starts: never
    two), rl none; a URL's key is its own variable; a serve job must serve now."""
    mode, t = cfg.orchestrator.training_mode, cfg.orchestrator.teacher
    given = [k for k in TEACHER_SOURCES if OmegaConf.select(t, k)]
    if mode in ("opd", "sft") and not given:
        raise ConfigError(
            "orchestrator.teacher.client.base_url",
            f"training_mode={mode} needs a teacher: its OpenAI URL (http://host:port/v1), "
            "orchestrator.teacher.serve=<a serve job> or orchestrator.teacher.model=<a model the run serves itself>",
        )
    if mode == "rl" and given:
        raise ConfigError(
            f"orchestrator.teacher.{given[0]}",
            "a teacher is only used with training_mode=opd or sft; unset it or change the mode",
        )
    if len(given) > 1:
        raise ConfigError(
            f"orchestrator.teacher.{given[1]}",
            f"the run has one teacher: orchestrator.teacher.{given[0]} is set too; keep one of them",
        )
    if given and given[0] != "model" and t.client.api_key_var == API_KEY_VAR:
        raise ConfigError(
            "orchestrator.teacher.client.api_key_var",
            f"{API_KEY_VAR} is the job's own key, which never leaves the job; name the variable that holds the "
            "teacher's key (default TEACHER_API_KEY)",
        )
    if given == ["serve"]:
        check_teacher_serve(cfg)
    if given == ["model"] and t.client.model:
        raise ConfigError(
            "orchestrator.teacher.client.model",
            f"the run's own teacher serves {t.model} under that name; unset client.model",
        )
    if given != ["model"] and any(t.get(k) is not None for k in TEACHER_ENGINE):
        key = next(k for k in TEACHER_ENGINE if t.get(k) is not None)
        raise ConfigError(
            f"orchestrator.teacher.{key}",
            "sets the engine of a teacher the run starts itself (orchestrator.teacher.model); unset it",
        )


def check_teacher_serve(cfg: DictConfig) -> None:
    """`orchestrator.teacher.serve`: a serve job that serves now, whose key this
    environment holds in the teacher's variable (the run reads it at its start)."""
    from prime_hpc.rundir import jobs

    t = cfg.orchestrator.teacher
    try:
        job = jobs.serve_job(str(t.serve))
    except UserError as e:
        raise ConfigError("orchestrator.teacher.serve", str(e)) from None
    if jobs.served(job) is None:
        raise ConfigError(
            "orchestrator.teacher.serve",
            f"serve job {t.serve} ({job.root}) does not serve now; see prime-hpc status {job.root}",
        )
    if not os.environ.get(t.client.api_key_var):
        raise ConfigError(
            "orchestrator.teacher.client.api_key_var",
            f"serve job {t.serve} answers only with its key: set ${t.client.api_key_var} to it "
            f"(the value of its ${API_KEY_VAR})",
        )


def check_sft_parts(d: DictConfig, key: str) -> None:
    """`subsets` / `splits` / `probabilities` of an SFT dataset agree with each other."""
    subsets, splits = list(d.subsets or []), list(d.splits or [])
    if subsets and splits and len(subsets) != len(splits):
        raise ConfigError(
            f"{key}.splits",
            f"{len(splits)} splits for {len(subsets)} subsets; give one split per subset, "
            f"or null to read every subset's {key}.split",
        )
    labels = [f"{a}/{b}" for a, b in zip(subsets, splits)] if subsets and splits else subsets or splits
    twice = sorted({x for x in labels if labels.count(x) > 1})
    if twice:
        raise ConfigError(f"{key}.subsets" if subsets else f"{key}.splits", f"{twice[0]!r} is named twice")
    if d.probabilities is None:
        return
    probs = list(d.probabilities)
    if len(labels) < 2 or len(probs) != len(labels):
        raise ConfigError(
            f"{key}.probabilities",
            f"{len(probs)} weights for {len(labels)} parts; give one per entry of {key}.subsets "
            f"(or {key}.splits), which must name two or more",
        )
    if any(not (float(p) > 0 and float(p) < float("inf")) for p in probs):
        raise ConfigError(f"{key}.probabilities", f"weights must be positive numbers, got {probs}")


def check_sft(cfg: DictConfig) -> None:
    t = cfg.trainer
    if t.type != "sft":
        return
    if not t.data.name and cfg.bench.mode is None:  # a bench trains on synthetic rows
        raise ConfigError(
            "trainer.data.name",
            "an SFT run needs a dataset; set it to a HF dataset name, a local path or module:function",
        )
    check_sft_parts(t.data, "trainer.data")
    check_sft_parts(t.val.data, "trainer.val.data")
    if t.data.batch_size < t.data.seq_len:
        raise ConfigError(
            "trainer.data.batch_size",
            f"{t.data.batch_size} tokens per step is less than one packed "
            f"row of trainer.data.seq_len={t.data.seq_len}; raise it to a "
            f"multiple of {t.data.seq_len}",
        )
    if t.val.interval is not None:  # its range is the field's own rule
        if not t.val.data.name:
            raise ConfigError(
                "trainer.val.data.name",
                "trainer.val.interval is set but there is no validation "
                "dataset; name one (same forms as trainer.data.name)",
            )
    if t.val.stop_below is not None and not t.val.interval:
        raise ConfigError(
            "trainer.val.stop_below", "needs validation: set trainer.val.interval (and trainer.val.data.name)"
        )


def check_trainer(cfg: DictConfig) -> None:
    m = cfg.trainer.model
    if m.lora.enabled:
        if not m.lora.target_modules:
            raise ConfigError(
                "trainer.model.lora.target_modules", "name at least one linear layer, e.g. [q_proj, v_proj]"
            )
    loss = cfg.trainer.loss
    if loss.target_kl is not None and loss.ref_kl_coef <= 0:
        raise ConfigError(
            "trainer.loss.target_kl",
            "adapts the KL penalty to the initial policy, which is off (trainer.loss.ref_kl_coef=0): "
            "give ref_kl_coef > 0 as its starting value, or unset target_kl",
        )
    if cfg.trainer.max_concurrent_runs > 1 and (cfg.ckpt.weights_only or cfg.ckpt.weights.interval):
        raise ConfigError(
            "ckpt.weights_only" if cfg.ckpt.weights_only else "ckpt.weights.interval",
            "weights-only snapshots are not kept by the multi-run trainer (trainer.max_concurrent_runs > 1): "
            "unset it, or checkpoint with ckpt.interval",
        )
    if loss.ref_kl_coef > 0 and cfg.trainer.max_concurrent_runs > 1:
        raise ConfigError(
            "trainer.loss.ref_kl_coef",
            "the multi-run trainer (trainer.max_concurrent_runs > 1) keeps no reference policy to measure "
            "a KL against: set it to 0 (and unset target_kl)",
        )
    if cfg.trainer.max_concurrent_runs > 1:
        if cfg.trainer.type != "rl" or not m.lora.enabled:
            raise ConfigError(
                "trainer.max_concurrent_runs",
                "several runs share one trainer through LoRA adapters of one base model: it needs "
                "trainer.type=rl and trainer.model.lora.enabled=true",
            )
        if cfg.weights.transport != "filesystem":
            raise ConfigError(
                "trainer.max_concurrent_runs",
                "each run's adapter reaches the servers from disk: weights.transport=filesystem",
            )


def check_job_dir(cfg: DictConfig) -> None:
    if cfg.get("job_dir") and cfg.trainer.max_concurrent_runs < 2:
        raise ConfigError(
            "job_dir",
            "names the job this run is one of several in: set trainer.max_concurrent_runs to the job's (> 1)",
        )


def check_ckpt(cfg: DictConfig) -> None:
    w = cfg.ckpt.weights
    if w.get("keep_last") is not None and w.get("interval") is None and not cfg.ckpt.get("weights_only"):
        raise ConfigError(
            "ckpt.weights.keep_last",
            "retains weights-only snapshots: set ckpt.weights.interval or ckpt.weights_only=true",
        )
    if cfg.wandb.enabled and not cfg.wandb.project:
        raise ConfigError("wandb.project", "set a project name when wandb.enabled=true")
    if (
        cfg.weights.transport == "broadcast"
        and cfg.trainer.model.lora.enabled
        and cfg.ckpt.weights.save_adapter_separately
    ):
        raise ConfigError(
            "ckpt.weights.save_adapter_separately",
            "the servers load adapters only from disk; with weights.transport=broadcast they get the merged "
            "weights: set it to false, or weights.transport=filesystem",
        )


def check_bench(cfg: DictConfig) -> None:
    b = cfg.bench
    if b.mode is None:
        return
    if cfg.trainer.type == "sft" and b.mode == "inference":
        raise ConfigError("bench.mode", "an SFT run has no inference to benchmark; use --bench trainer")
    group = b.group_size or cfg.orchestrator.group_size
    samples = b.samples_per_step or cfg.orchestrator.batch_size
    if cfg.trainer.type == "rl" and samples % group:
        raise ConfigError(
            "bench.samples_per_step",
            f"{samples} is not a multiple of the group size {group}; "
            f"set it to a multiple, e.g. {max(group, samples - samples % group)}",
        )
    if b.completion_len is not None and b.completion_len >= cfg.seq_len:
        raise ConfigError(
            "bench.completion_len",
            f"{b.completion_len} leaves no prompt token within seq_len={cfg.seq_len}; set it below seq_len",
        )


def check_output_dir(cfg: DictConfig) -> None:
    """output_dir must be (or be creatable as) a writable directory. Probed for real with
    a temporary directory in the nearest existing ancestor, removed at once."""
    import tempfile

    path = Path(cfg.output_dir)
    if any(c in str(path) for c in "%\\\n"):
        raise ConfigError(
            "output_dir",
            f"{str(path)!r} contains '%', a backslash or a newline, which SLURM and "
            "submitit interpret in paths; choose a path without them",
        )
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
            "output_dir",
            f"cannot write in {probe} ({e.strerror}); choose an output_dir on a writable shared filesystem",
        ) from None


def check_cache_dir(cfg: DictConfig) -> None:
    """The compile caches (code vLLM and inductor load and run) live in the user's private
    directory of `cluster.cache_dir` (`usercache.compile_dir`): refused now, writing
    nothing, when it is a symlink, someone else's or writable by others, or cannot be
    made. The server checks it again before its engine starts."""
    from prime_hpc.config.cluster import cache_root
    from prime_hpc.core import usercache

    usercache.compile_dir(cache_root(cfg), create=False)


def check_umask(cfg: DictConfig) -> None:
    """`cluster.umask` leaves group and others no write permission on what the run writes
    (`core.umask.others_write`)."""
    from prime_hpc.core.umask import others_write

    why = others_write(str(cfg.cluster.umask))
    if why:
        raise ConfigError("cluster.umask", why)


def check_name(cfg: DictConfig) -> None:
    if not str(cfg.name).strip():
        raise ConfigError("name", "must not be empty")


# What reaches a job script (`prime_hpc.launcher.plan`): names, paths and SLURM options,
# on `#SBATCH` lines, in comments and in commands; a list's entries each. `cluster.env_setup`
# is shell the user writes, rendered as it is.
SCRIPT_KEYS = (
    "name",
    "output_dir",
    "job_dir",
    "cluster.python",
    "cluster.cache_dir",
    "cluster.address",
    "cluster.time",
    "cluster.partition",
    "cluster.account",
    "cluster.qos",
    "cluster.constraint",
    "cluster.exclude",
    "cluster.umask",
    "cluster.sbatch_extra",
    *(f"cluster.{g}.{k}" for g in (*COMPONENTS, "teacher") for k in ("cpu_ids", "gpu_ids")),
)


def check_control_chars(cfg: DictConfig) -> None:
    """No control character (a newline, a carriage return, ESC ...: `core.text.control_char`)
    in a value that reaches a job script: a newline in a name would end the comment or the
    `#SBATCH` line it is on, and the rest would run as a command."""
    from prime_hpc.core.text import control_char

    for key in SCRIPT_KEYS:
        value = OmegaConf.select(cfg, key)
        entries = enumerate(value) if OmegaConf.is_list(value) else [(None, value)]
        for i, v in entries:
            bad = None if v is None else control_char(str(v))
            if bad:
                raise ConfigError(
                    key if i is None else f"{key}.{i}",
                    f"{str(v)!r} holds the control character {bad}, which a job script cannot carry; remove it",
                )


RULES: tuple[Callable[[DictConfig], None], ...] = (
    check_name,
    check_control_chars,
    check_fields,
    check_difficulty_filter,
    check_positive,
    check_batch,
    check_group_size,
    check_lengths,
    check_gpus,
    check_slurm,
    check_memory,
    check_models,
    check_training_mode,
    check_sft,
    check_trainer,
    check_job_dir,
    check_ckpt,
    check_envs,
    check_bench,
    check_output_dir,
    check_cache_dir,
    check_umask,
)


def validate(cfg: DictConfig, rules: Iterable[Callable[[DictConfig], None]] = RULES) -> DictConfig:
    """Run every cross-field rule; the first violation raises `ConfigError`."""
    for rule in rules:
        rule(cfg)
    return cfg
