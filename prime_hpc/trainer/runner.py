"""What the RL and SFT entrypoints share: logging, the error contract, the session (process
group, policy, optimizer, checkpointer, metrics; resume), weights export and retention,
and the per-step metrics every trainer reports."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, NoReturn, Optional, Sequence

from prime_hpc.core import jobenv
from prime_hpc.core.errors import UserError
from prime_hpc.rundir import RunDir, WaitTimeout, logtree, remove_marked
from prime_hpc.rundir.window import prunable
from prime_hpc.runtime.limits import raise_open_files

if TYPE_CHECKING:  # the heavy modules are imported inside the functions
    from prime_hpc.config.component import TrainerRunConfig
    from prime_hpc.runtime.metrics import MetricsLogger
    from prime_hpc.runtime.stopping import Stop
    from prime_hpc.trainer.ckpt import Checkpointer
    from prime_hpc.trainer.dist import DistEnv
    from prime_hpc.trainer.engine import Engine, StepResult
    from prime_hpc.trainer.model import Policy


def setup_logging(level: str, rank: int) -> None:
    """loguru to stdout (torchrun tees each rank's output into its own log)."""
    from loguru import logger

    logger.remove()
    fmt = "{time:YYYY-MM-DD HH:mm:ss} | {level: <7} | trainer[" + str(rank) + "] | {message}"
    logger.add(sys.stdout, level=level.upper(), format=fmt, colorize=False)


def main(
    run_fn: Callable[["TrainerRunConfig"], None], prog: str, description: str, argv: Optional[list[str]] = None
) -> NoReturn:
    """Parse `--config`, run, and turn a user's mistake or a missing peer into one line on
    stderr (exit 2, resp. 1) instead of a traceback; the process then exits with that code
    (it does not return: see the end)."""
    from prime_hpc.rundir.checkpoints import CheckpointWriteError
    from prime_hpc.trainer.config import load_config, parse_args
    from prime_hpc.trainer.engine import Diverged, OutOfMemory

    args = parse_args(prog, description, argv)
    raise_open_files(prog)
    rank = int(os.environ.get("RANK", 0))
    ranked = "TORCHELASTIC_RUN_ID" in os.environ
    if ranked:  # a rank under torchrun: it does not outlive its agent
        from prime_hpc.runtime.stopping import die_with_parent

        die_with_parent()
    code = 0
    try:
        cfg = load_config(args.config)
        setup_logging(cfg.trainer.log.level, rank)
        run_fn(cfg)
    except UserError as e:
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        code = UserError.exit_code
    except WaitTimeout as e:
        print(f"{prog}: error: {str(e).splitlines()[0]}", file=sys.stderr, flush=True)
        code = 1
    except (CheckpointWriteError, Diverged, OutOfMemory) as e:
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        code = 1
    except Exception as e:
        if not _out_of_memory(e):
            raise
        # beyond a micro-batch (the optimizer's state, a weights export): the device's own words
        print(f"{prog}: error: out of memory: {str(e).splitlines()[0]}", file=sys.stderr, flush=True)
        code = 1
    # the rank's work is on disk (or its error said) and its process groups destroyed: it
    # leaves without the interpreter's teardown, where torch's gloo threads, still held by
    # objects freed only then (a rank's FSDP group, a lone trainer's group of the async
    # checkpoint save), can abort it and turn a run that ended well, or an error already
    # said, into a crash
    from prime_hpc.runtime.stopping import leave

    leave(code)


def _out_of_memory(e: BaseException) -> bool:
    """`torch.OutOfMemoryError` (a device's allocator), without importing torch to ask."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(e, getattr(torch, "OutOfMemoryError", ()))


@dataclass
class Session:
    cfg: "TrainerRunConfig"
    run: RunDir
    env: "DistEnv"
    policy: "Policy"
    engine: "Engine"
    ckpt: "Checkpointer"
    metrics: "Optional[MetricsLogger]"  # on rank 0, None elsewhere
    start_step: int  # last completed step (0 = base model)
    resumed: Optional[dict]  # state.json of the checkpoint resumed from
    num_params: int
    progress_at: float = 0.0  # the last time this rank started or finished a step (heartbeat)
    load_ckpt_s: Optional[float] = None  # seconds the resume's checkpoint took to load; reported once


@contextlib.contextmanager
def session(cfg: "TrainerRunConfig", component_parts: Sequence[str]) -> Iterator[Session]:
    """Everything a trainer needs, closed on every path. `component_parts`: the checkpoint
    parts a resumable step must have (RL: trainer + orchestrator; SFT: trainer)."""
    import torch
    from loguru import logger

    from prime_hpc.rundir.checkpoints import resolve_resume_step
    from prime_hpc.runtime.metrics import MetricsLogger
    from prime_hpc.trainer.ckpt import Checkpointer
    from prime_hpc.trainer.dist import process_group
    from prime_hpc.trainer.engine import Engine, param_count
    from prime_hpc.trainer.model import build_policy

    run = RunDir(cfg.output_dir)
    resume = resolve_resume_step(run, cfg.ckpt.step, component_parts)  # fail before loading anything
    with process_group(cfg.device) as env:
        torch.manual_seed(cfg.seed)  # the same initial values (e.g. LoRA A) on every rank
        policy = build_policy(cfg, env.mesh)
        torch.manual_seed(cfg.seed + env.rank)  # independent dropout per data-parallel rank
        engine = Engine(policy, env, cfg.trainer.optim, total_steps=cfg.max_steps)
        ckpt = Checkpointer(run, cfg.ckpt, env)
        metrics = None
        try:
            state, load_s = None, None
            if resume is not None:
                logger.info(f"resuming from {run.checkpoint_part(resume, 'trainer')}")
                t0 = time.perf_counter()
                state = ckpt.load(resume, engine)
                load_s = time.perf_counter() - t0
                logger.info(f"checkpoint {resume} loaded in {load_s:.2f}s")
            if env.is_main:
                # an RL run's W&B run is written by the orchestrator, which forwards these rows
                metrics = MetricsLogger(
                    run,
                    "trainer",
                    cfg.wandb,
                    run_name=cfg.name,
                    config={"trainer": plain(cfg.trainer), "max_steps": cfg.max_steps},
                    wandb_writer=cfg.trainer.type == "sft",
                )
            n = param_count(policy)
            logger.info(
                f"model {cfg.trainer.model.name} ({n / 1e6:.2f}M parameters, "
                f"{sum(p.numel() for p in policy.trainable) / 1e6:.3f}M trainable) on {env.world_size} "
                f"rank(s), device {cfg.device}"
            )
            yield Session(cfg, run, env, policy, engine, ckpt, metrics, resume or 0, state, n, load_ckpt_s=load_s)
        finally:
            ckpt.close()
            if metrics is not None:
                metrics.close()


def plain(obj: Any) -> Any:
    """A config dataclass as a plain dict (what a metrics logger records); anything else as it is."""
    from dataclasses import asdict, is_dataclass

    return asdict(obj) if is_dataclass(obj) and not isinstance(obj, type) else obj


def save_weights(s: Session, step: int, info: Optional[dict] = None) -> float:
    """Gather the full state dict (collective) and write `weights/step_<step>` on rank 0.
    Returns the seconds it took."""
    from prime_hpc.trainer.model import full_state_dict, write_weights

    t0 = time.perf_counter()
    sd = full_state_dict(s.policy.model)
    if s.env.is_main:
        write_weights(
            s.run, step, s.policy, sd, serve_adapter=bool(s.cfg.ckpt.weights.save_adapter_separately), info=info
        )
    return time.perf_counter() - t0


def prune_weights(run: RunDir, step: int, async_level: int, ckpt: Any = None) -> list[int]:
    """Rank 0, after writing `weights/step_<step>`: remove the weights no step can use any
    more (`window.prunable`) unless their step has a trainer checkpoint (checkpointed
    policies stay for resume and serving) or is a weights-only snapshot the run's `ckpt`
    section keeps (`rundir.checkpoints.snapshot_keep`), and the markers of such policies
    sent by broadcast (`sent/`). The weight steps removed."""
    from prime_hpc.rundir.checkpoints import snapshot_keep

    keep = set(run.checkpoint_steps("trainer"))
    if ckpt is not None:
        keep |= snapshot_keep(run, ckpt)
    removed = []
    for k in run.weight_steps(stable_only=False):
        if prunable(k, step, async_level) and k not in keep:
            remove_marked(run.weights_step(k))
            removed.append(k)
    for k in run.sent_steps():  # weights.transport=broadcast: the markers of policies sent
        if prunable(k, step, async_level):
            run.sent_step(k).unlink(missing_ok=True)
    return removed


def checkpoint_if_due(s: Session, step: int, final: bool, state: dict) -> tuple[bool, float]:
    """Save a checkpoint when `ckpt` says so: (saved?, seconds spent)."""
    from prime_hpc.rundir.checkpoints import is_due

    s.ckpt.poll()
    if not is_due(step, final, s.cfg.ckpt):
        return False, 0.0
    t0 = time.perf_counter()
    s.ckpt.save(step, s.engine, state)
    return True, time.perf_counter() - t0


def packed(s: Session, micro_batches: list[dict]) -> list[dict]:
    """This rank's rollouts (right-padded micro-batches as the orchestrator wrote them)
    packed into rows of up to `seq_len` tokens and micro-batches of the token budget
    (`rundir.batch.pack`, `model.micro_batch_tokens`), and as many micro-batches as the
    rank with the most has (empty ones added: FSDP runs the same forward passes on every
    rank; one small all-reduce)."""
    from prime_hpc.rundir import batch
    from prime_hpc.trainer.dist import all_reduce_max
    from prime_hpc.trainer.model import micro_batch_tokens

    mbs = batch.pack(batch.unpack(micro_batches), int(s.cfg.seq_len), micro_batch_tokens(s.cfg))
    n = all_reduce_max([len(mbs)], s.env)[0] if s.env.world_size > 1 else len(mbs)
    return mbs + [batch.empty_packed() for _ in range(n - len(mbs))]


def step_metrics(s: Session, result: "StepResult", t_step: float, t_wait: float) -> dict[str, Any]:
    """Optimizer and performance metrics of one step (`result`: engine.StepResult), those
    of both trainers (RL and SFT)."""
    from prime_hpc.core import device as devices
    from prime_hpc.trainer.engine import mfu

    sums = result.sums
    tokens = sums.get("num_tokens", 0.0)
    busy = max(t_step - t_wait, 1e-9)
    out: dict[str, Any] = {
        "loss/mean": sums["loss"] / max(sums["tokens"], 1.0),
        "entropy/mean": sums["entropy"] / max(sums["tokens"], 1.0),
        "optim/grad_norm": result.grad_norm,
        "optim/lr": result.lr,
        "optim/zero_grad_ratio": result.zero_grad_ratio,  # of the trained elements, gradient exactly 0
        "perf/throughput": tokens / busy,
        "perf/throughput_per_gpu": tokens / busy / s.env.world_size,
        "time/step": t_step,
        "time/wait_for_batch": t_wait,
        "time/forward_backward": result.time_forward_backward_s,
        # of the positions computed, the share that is padding (packed rows: a row's unused tail)
        "perf/padding_share": 1.0 - tokens / sums["computed_tokens"] if sums.get("computed_tokens") else 0.0,
        "perf/logprob_chunks": result.logprob_chunks,
    }
    if result.compile_s:  # trainer.model.compile: the first steps' compilation, apart
        out["time/compile"] = result.compile_s
    util = mfu(tokens / busy / s.env.world_size, s.num_params, devices.peak_flops(s.cfg.device, s.env.local_rank))
    if util is not None:
        out["perf/mfu"] = util
    mem = devices.peak_memory_gib(s.cfg.device)
    if mem is not None:
        out["perf/peak_memory"] = mem
        devices.reset_peak_memory(s.cfg.device)
    if s.load_ckpt_s is not None:  # the first step after a resume: what loading its checkpoint took
        out["time/load_ckpt"], s.load_ckpt_s = s.load_ckpt_s, None
    return out


def agreed_stop(s: Session, stop: "Stop", not_ready: bool = False) -> tuple[int, bool]:
    """What every rank does next, agreed over the process group (one small all-reduce):
    the strongest stop decision of any rank (`prime_hpc.runtime.stopping`: CONTINUE, EXIT,
    CHECKPOINT), and whether any rank found no more data (`not_ready`)."""
    from prime_hpc.runtime import stopping
    from prime_hpc.trainer.dist import all_reduce_max

    code = stop.decision() if stop.pending() else stopping.CONTINUE
    agreed = all_reduce_max([code, int(not_ready)], s.env)
    return agreed[0], bool(agreed[1])


def stop_here(s: Session, step: int, code: int, state: dict) -> None:
    """Stop at `step` as agreed: on CHECKPOINT save it (unless it is saved already), then
    tell the orchestrator which step that is (`control/checkpointed.json`)."""
    from loguru import logger

    from prime_hpc.rundir import atomic_write_json
    from prime_hpc.runtime import stopping

    if code == stopping.CHECKPOINT:
        if step > s.start_step and step not in s.ckpt.requested:
            s.ckpt.save(step, s.engine, state)
        s.ckpt.wait()
        if s.env.is_main:
            atomic_write_json(s.run.checkpoint_answer, {"step": step})
        logger.info(f"checkpointed step {step} as asked ({s.run.checkpoint_part(step, 'trainer')}); stopping")
    else:
        logger.info(f"stopping at step {step} (SIGTERM)")
    beat(s, step, stopped=True)


def beat(s: Session, step: int, progress: bool = True, **info: Any) -> None:
    """This rank's heartbeat; `progress`: it has just done something (started, a step)."""
    if progress or not s.progress_at:
        s.progress_at = time.time()
    s.run.beat("trainer", s.env.rank, step=step, progress_at=s.progress_at, **info)


def orchestrator_log() -> Optional[Path]:
    """`$PRIME_HPC_LOGS/orchestrator.log` (this attempt's), if the launcher said where."""
    logs = jobenv.logs_dir()
    return logtree.component_log(logs, "orchestrator") if logs else None
