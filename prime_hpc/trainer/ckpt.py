"""Trainer checkpoints and resume.

    checkpoints/step_<n>/trainer/
      .metadata, __<rank>_0.distcp    torch DCP: {"model": ..., "optim": ...}, sharded as trained
      state.json                      rank 0: step, progress, LR scheduler, dataloader position,
                                      the adaptive KL weight (`ref_kl_coef`, with trainer.loss.target_kl)
      rng_rank_<r>.pt                 each rank's RNG streams (tensors and plain values: loaded
                                      with torch.load(weights_only=True), nothing unpickled runs)
      STABLE                          written last, once every rank's shards are on disk

When: every `ckpt.interval` steps, and at the last step when `ckpt.enabled` (or an
interval) is set; never with `ckpt.weights_only`, whose steps keep only `weights/step_<n>`
(`rundir.checkpoints.snapshot_due`: not a resume point), except a stop on request. Rotation (`rotation()`): keep the newest `ckpt.keep_last` complete
checkpoints plus every one whose step is a multiple of `ckpt.keep_interval`; each component
removes its own part (the step directory goes with the last one). With `ckpt.save_async`, the shards are copied to host memory and written by a
background thread on a dedicated gloo group; the marker is written when that write
finishes, and the next save (or the end of training) waits for the previous one.

Resume: `ckpt.step=N` loads step N, `-1` the newest step that is complete (for an RL run:
the trainer's and the orchestrator's parts; SFT: the trainer's), `0`/null starts from the
base model. Asking for a step that is not complete (or `-1` when none is) fails with one
line listing the complete and incomplete steps. Model, optimizer, schedule, RNG and dataloader position are restored exactly,
so the resumed run continues bit for bit as the original would have.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystem

from prime_hpc.core import device as devices
from prime_hpc.core.errors import UserError
from prime_hpc.rundir import RunDir, atomic_write_bytes, atomic_write_json, mark_stable, read_json, remove_marked
from prime_hpc.rundir.checkpoints import CheckpointWriteError, root_cause, rotate
from prime_hpc.trainer.dist import DistEnv

PART = "trainer"


class Checkpointer:
    """Saves and loads this rank's share of a trainer checkpoint."""

    def __init__(self, run: RunDir, cfg: Any, env: DistEnv) -> None:
        self.run, self.cfg, self.env = run, cfg, env
        self._fs = _RecordingFileSystem()
        self._pending: Optional[tuple[int, Any]] = None
        self._group = dist.new_group(backend="gloo") if cfg.save_async else None
        self.saved: list[int] = []  # steps whose checkpoint is on disk and marked
        self.requested: list[int] = []  # steps a save was started for (async: maybe still writing)

    def save(self, step: int, engine: Any, state: dict) -> None:
        """Write checkpoint `step` (`state`: progress and dataloader, JSON-able); raises
        `CheckpointWriteError` when the filesystem refuses it."""
        from torch.distributed.checkpoint import CheckpointException  # DCP's wrapper of a writer's error: no Exception

        self.wait()
        self.requested.append(step)
        try:
            self._save(step, engine, state)
        except (OSError, dist.DistBackendError, CheckpointException) as e:
            raise self._write_error(step, e) from e

    def _write_error(self, step: int, error: BaseException) -> CheckpointWriteError:
        cause, self._fs.error = self._fs.error or error, None
        return CheckpointWriteError(step, self.run.checkpoint_part(step, PART), cause)

    def _save(self, step: int, engine: Any, state: dict) -> None:
        import torch.distributed.checkpoint as dcp

        d = self.run.checkpoint_part(step, PART)
        if self.env.is_main and d.exists():
            remove_marked(d)  # a leftover from an earlier attempt
        dist.barrier()
        d.mkdir(parents=True, exist_ok=True)
        model_sd, optim_sd = engine.state_dicts()
        save_rng(d / f"rng_rank_{self.env.rank}.pt", self.env.device_kind)
        if self.env.is_main:
            atomic_write_json(
                d / "state.json",
                {"step": step, "world_size": self.env.world_size, "scheduler": engine.scheduler.state_dict(), **state},
            )
        payload = {"model": model_sd, "optim": optim_sd}
        writer = dcp.FileSystemWriter(str(d))
        writer.fs = self._fs
        if self._group is not None:
            self._pending = (step, dcp.async_save(payload, storage_writer=writer, process_group=self._group))
        else:
            dcp.save(payload, storage_writer=writer)
            self._finish(step)

    def _finish(self, step: int) -> None:
        if self.env.is_main:
            mark_stable(self.run.checkpoint_part(step, PART), {"step": step})
            self._rotate()
        self.saved.append(step)

    def poll(self) -> None:
        """Finish a background save that is done (non-blocking)."""
        if self._pending is not None and self._pending[1].done():
            self.wait()

    def wait(self) -> None:
        """Block until the background save (if any) is on disk, then mark it."""
        from torch.distributed.checkpoint import CheckpointException

        if self._pending is None:
            return
        step, fut = self._pending
        self._pending = None
        try:
            fut.result()
        except (Exception, CheckpointException) as e:  # the background writer's error
            raise self._write_error(step, e) from e
        self._finish(step)

    def _rotate(self) -> None:
        rotate(self.run, PART, self.cfg.keep_last, self.cfg.keep_interval)

    def load(self, step: int, engine: Any) -> dict:
        """Restore model, optimizer, schedule and RNG of `step`; returns its state.json."""
        import torch.distributed.checkpoint as dcp

        d = self.run.checkpoint_part(step, PART)
        model_sd, optim_sd = engine.state_dicts()
        payload = {"model": model_sd, "optim": optim_sd}
        dcp.load(payload, checkpoint_id=str(d))
        engine.load_state_dicts(payload["model"], payload["optim"])
        state = read_json(d / "state.json")
        engine.scheduler.load_state_dict(state["scheduler"])
        rng = d / f"rng_rank_{self.env.rank}.pt"
        if rng.exists() and state.get("world_size") == self.env.world_size:
            load_rng(rng, self.env.device_kind)
        return state

    def close(self) -> None:
        self.wait()
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None


class _RecordingFileSystem(FileSystem):
    """DCP's own file access, remembering the first `OSError` behind a failed write (disk
    full, no permission). DCP hands a rank's error on pickled, which drops what a user can
    act on: torch.save reports ENOSPC only as the context of its own RuntimeError."""

    error: Optional[OSError] = None

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        try:
            with super().create_stream(path, mode) as stream:
                yield stream
        except BaseException as e:
            cause = root_cause(e)
            if isinstance(cause, OSError) and self.error is None:
                self.error = cause
            raise


def save_rng(path: Path, device_kind: str) -> None:
    """This rank's RNG streams, as tensors and plain Python values only (what
    `torch.load(weights_only=True)` accepts)."""
    import io

    buf = io.BytesIO()
    torch.save(devices.rng_state(device_kind), buf)
    atomic_write_bytes(path, buf.getvalue())


def load_rng(path: Path, device_kind: str) -> None:
    """Restore the RNG streams `save_rng` wrote. Loaded with `weights_only=True`: a file
    holding anything else (objects that would run code when unpickled) is refused in one
    line, and nothing of it is executed."""
    import pickle

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        devices.set_rng_state(device_kind, state)
    except (pickle.UnpicklingError, KeyError, TypeError, ValueError, RuntimeError) as e:
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(
            f"{path}: not an RNG state as the trainer writes it ({why}); resume from another checkpoint (ckpt.step=N)"
        ) from None
