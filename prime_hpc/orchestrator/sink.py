"""The sink of train groups: judges finished groups for the step being filled and writes
the step's batch.

Consumes: finished groups from a `GroupSource` (asking it to admit more before each
wait), the policy served now (a callable), an optional `Teacher` (opd), and two
callbacks: `stopping()` (checked between groups: None to go on, or the stop code
`runtime.stopping` decided; it raises when the run cannot go on) and `unfilled(step,
fill)` (record a step that will not be filled). Produces, per step, a `StepFill`: the
`batch_size / group_size` groups accepted (with their advantages), every rollout judged
(for metrics), the groups judged and dropped by reason (`Drop`); `write` then writes
`rollouts/step_<n>/` (one file per trainer rank, `rundir.batch`) and adds to the totals.

Judging a group (`judge`): an errored group (`rollouts.group_error`) is counted as
`Drop.ERRORED` and noted in its env's worker log; `max_errored_groups` of them in a row
end the run with one line quoting the env's last error and naming its worker log
(`EnvFailed`, after the unfilled step's row). Any other group goes through the
policy-lag rules and filters (`rollouts.judge_group`), then, in opd, to the teacher.
Groups finished beyond the step being filled carry over to the next one. While a step does
not fill (and the orchestrator is not only waiting for the trainer's weights), one line
every `FILL_LOG_S` says how far it got and why groups were dropped; a stall message of
the watchdog quotes it.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable, Optional

from loguru import logger

from prime_hpc.config.schema import OrchestratorConfig
from prime_hpc.orchestrator import envs
from prime_hpc.orchestrator.envs import EnvFailed
from prime_hpc.orchestrator.rollouts import ErrorStreak, Rollout, judge_group
from prime_hpc.orchestrator.source import GroupSource
from prime_hpc.orchestrator.teacher import Teacher
from prime_hpc.rundir import RunDir, batch, logtree, window
from prime_hpc.rundir.drops import Drop

FILL_LOG_S = 30.0  # while a step does not fill: how often to say how far it got
ERROR_QUOTED = 300  # characters of the env's error in the give-up line


@dataclass
class StepFill:
    """What filling one step collected."""

    t0: float  # when filling began (monotonic)
    t_wait: float = 0.0  # waiting for recent-enough weights
    accepted: list[list[Rollout]] = field(default_factory=list)  # groups for the step
    finished: list[Rollout] = field(default_factory=list)  # every judged rollout (for metrics)
    judged: int = 0  # groups judged
    dropped: Counter = field(default_factory=Counter)  # groups dropped, by `Drop`
    spanning: int = 0  # rollouts dropped for spanning too many policies
    reported: float = 0.0  # when the last line about this step's progress was logged (monotonic)

    @property
    def kept(self) -> list[Rollout]:
        return [r for g in self.accepted for r in g]


class StepSink:
    def __init__(
        self,
        ocfg: OrchestratorConfig,
        async_level: int,
        source: GroupSource,
        *,
        policy: Callable[[], int],
        teacher: Optional[Teacher],
        stopping: Callable[[], Awaitable[Optional[int]]],
        unfilled: Callable[[int, StepFill], None],
        run: RunDir,
        logs: Optional[Path],
        ranks: int,
        micro_batch_size: int,
    ) -> None:
        self.ocfg = ocfg
        self.async_level = async_level
        self.groups_per_step = ocfg.batch_size // ocfg.group_size
        self.source = source
        self.policy = policy
        self.teacher = teacher
        self.stopping = stopping
        self.unfilled = unfilled
        self.run = run
        self.logs = logs
        self.ranks = ranks
        self.micro_batch_size = micro_batch_size
        self.errors = ErrorStreak(ocfg.max_errored_groups)  # errored train groups in a row
        self.carry: list[list[Rollout]] = []  # finished groups beyond the step being filled
        self.filling: Optional[int] = None  # the step being filled
        self.step = 0  # the last step written
        self.samples = 0  # samples written, over the run
        self.tokens = 0  # ... and their tokens

    async def fill(self, step: int) -> Optional[StepFill]:
        """Collect `batch_size / group_size` accepted groups for `step`, judging finished
        groups in order. None when the data is used up or a stop is decided (then, on an
        EXIT, `unfilled` records what this step judged, when it judged anything)."""
        from prime_hpc.runtime.stopping import EXIT

        fill = StepFill(t0=time.monotonic(), reported=time.monotonic())
        self.filling = step
        pending, self.carry = self.carry, []
        try:
            while len(fill.accepted) < self.groups_per_step:
                code = await self.stopping()
                if code is not None:
                    if code == EXIT and fill.judged:
                        self.unfilled(step, fill)
                    return None
                recent = not window.is_stale(self.policy(), step, self.async_level)
                self.source.admit(step, len(fill.accepted), len(pending) + len(self.carry))
                if self.source.used_up(len(fill.accepted) + len(pending) + len(self.carry)):
                    logger.info(f"the train data is used up; step {step} cannot be filled")
                    return None
                if not pending:
                    tw = time.monotonic()
                    pending = await self.source.next_finished()
                    if not recent:
                        fill.t_wait += time.monotonic() - tw
                for group in pending:
                    if len(fill.accepted) >= self.groups_per_step:
                        self.carry.append(group)
                    else:
                        await self.judge(step, group, fill)
                pending = []
                self.report(step, fill)
            return fill
        finally:
            self.filling = None

    async def judge(self, step: int, group: list[Rollout], fill: StepFill) -> None:
        """Accept a finished group for `step`, or count why it is dropped; give up after
        `max_errored_groups` errored groups in a row."""
        fill.finished += group
        fill.judged += 1
        limit_reached = self.errors.add(group)
        if self.errors.count:  # this group errored: every rollout of it errored or was empty
            fill.dropped[Drop.ERRORED] += 1
            envs.note_errored("train", group[0].env, group[0].example_id, self.errors.error or "")
            if limit_reached:
                self.give_up(step, fill)
            return
        o = self.ocfg
        v = judge_group(
            group,
            step,
            self.async_level,
            o.max_off_policy_steps,
            o.online_difficulty_filtering,
            o.advantage,
            o.difficulty_filter,
        )
        fill.spanning += v.dropped_spanning
        if v.reason:
            fill.dropped[v.reason] += 1
            return
        if self.teacher is not None:
            await self.teacher.add_logprobs(v.kept)
        fill.accepted.append(v.kept)

    def give_up(self, step: int, fill: StepFill) -> None:
        """The train env only errors: record what filling `step` judged, then end the run
        with one line quoting the env's last error and naming its worker log."""
        e = self.errors
        self.unfilled(step, fill)
        last = e.error or ""
        error = last if len(last) <= ERROR_QUOTED else last[:ERROR_QUOTED] + "..."
        raise EnvFailed(
            f"train env {e.env!r}: {e.count} groups in a row errored (orchestrator.max_errored_groups="
            f"{e.limit}); the last: {error}",
            logtree.env_worker_log(self.logs, "train", e.env or "") if self.logs is not None else None,
        )

    def waiting_for_trainer(self) -> bool:
        """Nothing generating, and the served policy too old for the step being filled."""
        return (
            not self.source.inflight
            and self.filling is not None
            and window.is_stale(self.policy(), self.filling, self.async_level)
        )

    def report(self, step: int, fill: StepFill) -> None:
        """Every `FILL_LOG_S` while `step` does not fill (unless only waiting for the
        trainer's weights): how far it got and why groups were dropped."""
        now = time.monotonic()
        if now - fill.reported < FILL_LOG_S or self.waiting_for_trainer():
            return
        fill.reported = now
        why = ", ".join(f"{d}: {n}" for d, n in sorted(fill.dropped.items()) if n)
        logger.info(
            f"step {step}: {len(fill.accepted)}/{self.groups_per_step} groups accepted after "
            f"{fill.judged} judged in {now - fill.t0:.0f}s" + (f" ({why})" if why else "")
        )

    def write(self, step: int, fill: StepFill) -> int:
        """`rollouts/step_<n>/` (one file per trainer rank, balanced by tokens); the totals.
        Returns the number of samples written."""
        kept = fill.kept
        samples = [s for r in kept for s in r.to_samples()]
        per_rank = batch.shard(samples, self.ranks, self.micro_batch_size)
        info = {
            "policies": sorted({r.oldest_policy for r in kept}),
            "mode": self.ocfg.training_mode,
            "temperature": float(self.ocfg.sampling.temperature),
        }
        batch.write_step(self.run, step, per_rank, info)
        self.step = step
        self.samples += len(samples)
        self.tokens += sum(len(s) for s in samples)
        return len(samples)
