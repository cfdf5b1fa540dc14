"""Checkpoint rules every component applies the same way (pure, no torch): when a step is
checkpointed, which steps rotation deletes, and which step a resume loads."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from prime_hpc.core.errors import UserError
from prime_hpc.rundir import RunDir, remove_marked


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, a directory that cannot be made);
    the earlier checkpoints are untouched."""

    def __init__(self, step: int, where: Any, cause: BaseException) -> None:
        cause = root_cause(cause)
        super().__init__(
            f"the checkpoint of step {step} could not be written to {where}: "
            f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}; "
            "the earlier checkpoints are kept"
        )


def root_cause(error: BaseException) -> BaseException:
    """What a user can act on behind a failed write: the first `OSError` (disk full, no
    permission) in the error's chain, else the error itself. A torch DCP
    `CheckpointException` carries each rank's error in `failures`; a writer that saw
    ENOSPC raises its own error with the `OSError` as context."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        error = first[0] if isinstance(first, tuple) else first
    seen: set[int] = set()
    e: Optional[BaseException] = error
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return error


def _get(cfg: Any, key: str) -> Any:
    return cfg.get(key) if isinstance(cfg, dict) else getattr(cfg, key)


def _opt(cfg: Any, key: str) -> Any:
    """`cfg[key]` or None when the section has no such key."""
    return cfg.get(key) if isinstance(cfg, dict) else getattr(cfg, key, None)


def _scheduled(step: int, final: bool, cfg: Any) -> bool:
    interval = _get(cfg, "interval")
    if interval and step % interval == 0:
        return True
    return final and bool(_get(cfg, "enabled") or interval or _opt(cfg, "weights_only"))


def is_due(step: int, final: bool, cfg: Any) -> bool:
    """Save a checkpoint after `step`? (`final`: the last step of this run; `cfg`: the
    run's `ckpt` section, as a mapping or an object). Never with `ckpt.weights_only`: the
    scheduled steps keep their weights only (`snapshot_due`)."""
    return not _opt(cfg, "weights_only") and _scheduled(step, final, cfg)


def snapshot_due(step: int, final: bool, cfg: Any) -> bool:
    """Keep `weights/step_<step>` as a weights-only snapshot (no optimizer, not a resume
    point)? Every `ckpt.weights.interval` steps, and with `ckpt.weights_only` at the steps
    a checkpoint would be saved at (`is_due` without it)."""
    weights = _opt(cfg, "weights")
    interval = _opt(weights, "interval") if weights is not None else None
    if interval and step % interval == 0:
        return True
    return bool(_opt(cfg, "weights_only")) and _scheduled(step, final, cfg)


def snapshot_keep(run: RunDir, cfg: Any) -> set[int]:
    """The weight steps `ckpt`'s snapshot retention keeps beyond the async window: the
    snapshot steps on disk (`snapshot_due`), all of them or the newest
    `ckpt.weights.keep_last`. The steps of trainer checkpoints are kept by the caller."""
    weights = _opt(cfg, "weights")
    keep_last = _opt(weights, "keep_last") if weights is not None else None
    checkpointed = set(run.checkpoint_steps("trainer"))
    snaps = [k for k in run.weight_steps(stable_only=False) if k not in checkpointed and snapshot_due(k, False, cfg)]
    return set(sorted(snaps)[-keep_last:] if keep_last else snaps)


def full_weights_due(step: int, final: bool, cfg: Any, transport: str) -> bool:
    """Write the full weights of `step` to `weights/step_<step>`? Always with
    `weights.transport=filesystem` (the servers load them from there); with `broadcast`
    (the policy goes to the servers over the network; `sent/step_<n>.json` says so) at
    the steps that are checkpointed (`is_due`, `cfg`: the run's `ckpt` section) and at the
    last step, so eval, a resume and uploads find weights on disk; and at the snapshot
    steps (`snapshot_due`)."""
    return transport != "broadcast" or final or is_due(step, final, cfg) or snapshot_due(step, final, cfg)


def rotation(steps: Sequence[int], keep_last: Optional[int], keep_interval: Optional[int]) -> list[int]:
    """Which checkpoint `steps` to delete: all but the newest `keep_last` and the multiples
    of `keep_interval`. Without `keep_last` nothing is deleted."""
    if not keep_last:
        return []
    ordered = sorted(set(steps))
    keep = set(ordered[-keep_last:])
    if keep_interval:
        keep |= {s for s in ordered if s % keep_interval == 0}
    return [s for s in ordered if s not in keep]


def resolve_resume_step(run: RunDir, requested: Optional[int], parts: Sequence[str]) -> Optional[int]:
    """The checkpoint step to load (None: start from the base model); `parts` are the
    components whose markers make a step complete."""
    if requested is None or requested == 0:
        return None
    complete = run.complete_checkpoint_steps(parts)
    if requested in complete:
        return requested
    if requested == -1 and complete:
        return complete[-1]
    if requested > 0 and run.has_weights(requested) and requested not in run.checkpoint_steps(parts[0]):
        raise UserError(
            f"ckpt.step={requested}: step {requested} has only weights ({run.weights_step(requested)}, e.g. a "
            f"ckpt.weights_only snapshot), no checkpoint: a resume needs a full checkpoint in {run.checkpoints_dir}; "
            f"complete checkpoints: {complete or 'none'}"
        )
    partial = sorted(set(run.checkpoint_steps(parts[0])) - set(complete))
    what = f"complete checkpoints: {complete or 'none'}" + (f", incomplete: {partial}" if partial else "")
    need = " and ".join(f"{p}/STABLE" for p in parts)
    where = "no complete checkpoint" if requested == -1 else f"no complete checkpoint at step {requested}"
    raise UserError(f"ckpt.step={requested}: {where} in {run.checkpoints_dir} (needs {need}); {what}")


def rotate(run: RunDir, component: str, keep_last: Optional[int], keep_interval: Optional[int]) -> list[int]:
    """Apply `rotation` to `component`'s complete parts; a step directory goes once every
    component has removed its part. An unmarked part older than the newest complete one
    is what a kill left halfway through writing or deleting it: it goes too. Returns the
    steps whose part was removed. Call right after marking a part (nothing of
    `component` is being written then)."""
    parts = run.checkpoint_steps(component)
    steps = run.complete_checkpoint_steps((component,))
    torn = [s for s in parts if steps and s < steps[-1] and s not in steps]
    gone = sorted(rotation(steps, keep_last, keep_interval) + torn)
    for s in gone:
        remove_marked(run.checkpoint_part(s, component))
        try:
            run.checkpoint_step(s).rmdir()
        except OSError:
            pass
    return gone
