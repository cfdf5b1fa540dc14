"""The source of train groups: picks tasks, keeps groups generating within the admission
window, hands back the groups that finished.

Consumes: the env sampler (which env, which task; `envs.EnvSampler`), a `Generator`, and
the policy the servers serve now (a callable: the relay changes it). Produces: finished
groups (lists of `Rollout`s) in the order they finish, through `next_finished`. The sink
asks it to `admit` before each wait, saying which step it fills and how many groups it
already holds. `started` counts the tasks started (`progress/total_problems`; a resumed
run starts from its checkpoint's count). While groups generate but none has finished for
`QUIET_S`, it only waits for inference (`waiting_for_inference`: the heartbeat says so,
and the watchdog then looks at the servers, which hold the work).

Admission (`admission_limit`): a group started now, under policy p, can train steps up to
p + async_level (`rundir/window.py`); only as many groups are generating as those steps
(not past `max_steps`) still need, times `oversampling_factor`, minus those already
accepted or waiting to be judged; at most `max_concurrent / group_size`. Generating more
would only make groups that turn stale before a step can use them.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Callable, Optional

from prime_hpc.config.schema import OrchestratorConfig
from prime_hpc.orchestrator.envs import EnvSampler
from prime_hpc.orchestrator.generate import Generator
from prime_hpc.orchestrator.rollouts import Rollout
from prime_hpc.rundir import window

QUIET_S = 10.0  # groups generating and none finished for this long: only waiting for inference


class GroupSource:
    def __init__(
        self,
        sampler: EnvSampler,
        generator: Generator,
        policy: Callable[[], int],
        ocfg: OrchestratorConfig,
        async_level: int,
        max_steps: Optional[int],
    ) -> None:
        self.sampler = sampler
        self.generator = generator
        self.policy = policy
        self.async_level = async_level
        self.max_steps = max_steps
        self.groups_per_step = ocfg.batch_size // ocfg.group_size
        self.max_groups = generator.max_groups
        self.oversampling = ocfg.oversampling_factor
        self.inflight: set[asyncio.Task] = set()  # groups generating
        self.started = 0  # tasks started, over the run
        self.finished_at = time.time()  # a group last finished (or generation started from none)

    def admission_limit(self, step: int, accepted: int, waiting: int) -> int:
        """How many groups may be generating while step `step` is filled, with `accepted`
        groups accepted for it and `waiting` finished but not judged yet."""
        last = window.last_trainable(self.policy(), self.async_level)
        if self.max_steps is not None:
            last = min(last, int(self.max_steps))
        need = math.ceil((last - step + 1) * self.groups_per_step * self.oversampling) - accepted - waiting
        return max(0, min(self.max_groups, need))

    def admit(self, step: int, accepted: int, waiting: int) -> None:
        """Start new groups while the admission limit allows and there is data."""
        while len(self.inflight) < self.admission_limit(step, accepted, waiting):
            picked = self.sampler.next()
            if picked is None:
                return
            slot, row = picked
            self.started += 1
            if not self.inflight:
                self.finished_at = time.time()
            self.inflight.add(asyncio.create_task(self.generator.group(slot, row)))

    def used_up(self, held: int) -> bool:
        """Whether the tasks left, with the `held` groups (accepted or waiting) and those
        generating, cannot fill a step any more (never without an end: `max_steps` set)."""
        left = self.sampler.remaining()
        return left is not None and held + len(self.inflight) + left < self.groups_per_step

    async def next_finished(self) -> list[list[Rollout]]:
        """The groups that finish next (waits at most 0.5 s)."""
        if not self.inflight:  # waiting for a policy: new groups start at most 0.01 s after it is loaded
            await asyncio.sleep(0.01)
            return []
        done, self.inflight = await asyncio.wait(self.inflight, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
        if done:
            self.finished_at = time.time()
        return [d.result() for d in done]

    def waiting_for_inference(self) -> bool:
        """Groups generating, and none finished for `QUIET_S`: what the run waits for is
        the servers' work."""
        return bool(self.inflight) and time.time() - self.finished_at > QUIET_S

    async def aclose(self) -> None:
        """Cancel the groups generating."""
        for t in self.inflight:
            t.cancel()
        await asyncio.gather(*self.inflight, return_exceptions=True)
