"""The orchestrator's part of a checkpoint: `checkpoints/step_<n>/orchestrator/state.json`
and its `STABLE` marker.

Consumes: a snapshot of the orchestrator's state taken right after it wrote each step
(`keep(step, state)`: the step, the policy served, the totals, the sampler's position);
the run's `ckpt` section. Produces: the part of step n from step n's snapshot, when the
checkpoint is due (`ckpt.interval`, and the final step), when the train data ran out on a
due final step, and when the supervisor asks (`save_requested`: the step the trainer
saved, which is usually behind the orchestrator, hence the `SNAPSHOTS_KEPT` recent
snapshots); rotation of its own parts like the trainer's (`ckpt.keep_last`,
`ckpt.keep_interval`). On resume, `load` returns a step's saved state. A part that cannot
be written raises `CheckpointWriteError` (the earlier ones are untouched).
"""

from __future__ import annotations

import asyncio
import time
from typing import Optional

from loguru import logger

from prime_hpc.config.schema import CkptConfig
from prime_hpc.rundir import RunDir, atomic_write_json, mark_stable, read_json
from prime_hpc.rundir.checkpoints import CheckpointWriteError, is_due, rotate

STATE_FILE = "state.json"
SNAPSHOTS_KEPT = 32  # recent steps whose state is kept (the trainer is at most async_level behind)
CHECKPOINT_WAIT_S = 120.0  # asked to checkpoint: how long to wait for the trainer's step


class Checkpointer:
    def __init__(self, run: RunDir, ckpt: CkptConfig, job: Optional[RunDir] = None) -> None:
        self.run = run
        self.ckpt = ckpt
        self.job = job  # a run of a job of several runs: the trainer's answer is the job's
        self.snapshots: dict[int, dict] = {}  # step -> state right after writing it

    def keep(self, step: int, state: dict) -> None:
        self.snapshots[step] = state
        for old in [k for k in self.snapshots if k <= step - SNAPSHOTS_KEPT]:
            del self.snapshots[old]

    def save(self, step: int) -> None:
        """`checkpoints/step_<n>/orchestrator/` from the snapshot taken when step n was written."""
        d = self.run.checkpoint_part(step, "orchestrator")
        try:
            d.mkdir(parents=True, exist_ok=True)
            atomic_write_json(d / STATE_FILE, {**self.snapshots[step], "saved_at": time.time()})
            mark_stable(d, {"step": step})
        except OSError as e:
            raise CheckpointWriteError(step, d, e) from e
        rotate(self.run, "orchestrator", self.ckpt.keep_last, self.ckpt.keep_interval)

    def load(self, step: int) -> dict:
        return read_json(self.run.checkpoint_part(step, "orchestrator") / STATE_FILE)

    def after_step(self, step: int, final: bool) -> None:
        """Save step `step` when the checkpoint is due (`final`: the run's last step)."""
        if is_due(step, final, self.ckpt):
            self.save(step)

    def at_end(self, last: int, first: int, max_steps: Optional[int]) -> None:
        """The train data ran out at step `last` (written in this attempt: past `first`,
        short of `max_steps`): it is the final step, saved if a final step is due."""
        if last > first and last != max_steps and is_due(last, True, self.ckpt) and not is_due(last, False, self.ckpt):
            self.save(last)

    async def save_requested(self, reason: str) -> None:
        """Asked to checkpoint before stopping: wait for the step the trainer saves and save
        this part of it from that step's snapshot."""
        from prime_hpc.runtime.stopping import checkpointed_step

        deadline = time.monotonic() + CHECKPOINT_WAIT_S
        saved = checkpointed_step(self.run, self.job)
        while saved is None and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            saved = checkpointed_step(self.run, self.job)
        if saved is None:
            logger.warning(
                f"the trainer did not say which step it saved within {CHECKPOINT_WAIT_S:g}s; "
                f"the next attempt continues from the last complete checkpoint"
            )
        elif saved in self.snapshots:
            self.save(saved)
            logger.info(f"checkpointed step {saved} as asked ({reason}); stopping")
        elif saved > 0:
            logger.warning(f"no state kept for step {saved} (kept: {sorted(self.snapshots)}); not checkpointed")
