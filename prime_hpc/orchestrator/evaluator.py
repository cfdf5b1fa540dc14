"""Evaluation: the served policy scored on the eval envs.

Consumes: the eval env slots (each with its eval rows: `orchestrator.eval.num_examples`
of them, or all), a `Generator` (the same client and model name as training, asked
`eval.rollouts_per_example` = k rollouts per row), and `log`, where a metrics row goes
(`MetricsLogger.log`; none outside a run: `prime-hpc eval`). Produces per env
`eval/<env>/avg@k` (the mean reward) and `eval/<env>/pass@k` (the share of rows with a
rollout of reward 1), at most `Generator.max_groups` groups generating at once; a call to
`on_group` after each group (an eval is finite: its groups are progress for the
heartbeat, where a train group is not).

In a run (`orchestrator.eval.interval` > 0), `start_if_due` evaluates every `interval`
steps in the background while steps go on (one at a time: a new one first waits for the
last), and the loop `wait`s for the last one at the end; `run` logs the row with
`time/eval` at the step it was started after. An eval that fails logs one warning and
writes no row; the run goes on.
"""

from __future__ import annotations

import asyncio
import time
from statistics import mean
from typing import Any, Callable, Optional

from loguru import logger

from prime_hpc.config.schema import EvalConfig
from prime_hpc.orchestrator.envs import EnvSlot
from prime_hpc.orchestrator.generate import Generator
from prime_hpc.orchestrator.rollouts import Rollout, pass_at_k


def sample_record(step: int, r: Rollout, i: int) -> dict:
    """One eval rollout as a person reads it and a script loads it (a line of
    `eval/step_<n>.samples.jsonl`): the policy step, env, example, which of its k
    rollouts, the prompt (its last message), the completion, the reward, the
    environment's metrics, and the error when it failed."""
    return {
        "step": step,
        "env": r.env,
        "example_id": r.example_id,
        "rollout": i,
        "prompt": r.prompt_text,
        "completion": r.completion_text,
        "reward": r.reward,
        "metrics": r.metrics,
        "error": r.error,
    }


class Evaluator:
    def __init__(
        self,
        ecfg: EvalConfig,
        slots: list[EnvSlot],
        generator: Generator,
        log: Optional[Callable[[int, dict], Any]] = None,
        on_group: Callable[[], None] = lambda: None,
    ) -> None:
        self.k = ecfg.rollouts_per_example
        self.interval = ecfg.interval if slots else 0
        self.slots = slots
        self.generator = generator
        self.log = log
        self.on_group = on_group
        self.pending: Optional[asyncio.Task] = None

    async def evaluate(self, step: int, samples: Optional[list[dict]] = None) -> dict:
        """avg@k and pass@k of every eval env under the policy served now; with `samples`,
        every rollout is appended to it too (`sample_record`)."""
        out: dict = {}
        sem = asyncio.Semaphore(self.generator.max_groups)
        for slot in self.slots:
            groups = await asyncio.gather(*(self.group(slot, row, sem) for row in slot.rows))
            if samples is not None:
                samples += [sample_record(step, r, i) for g in groups for i, r in enumerate(g)]
            rewards = [[r.reward for r in g] for g in groups]
            out[f"eval/{slot.name}/avg@{self.k}"] = mean(mean(x) for x in rewards) if rewards else 0.0
            out[f"eval/{slot.name}/pass@{self.k}"] = mean(pass_at_k(x) for x in rewards) if rewards else 0.0
        return out

    async def group(self, slot: EnvSlot, row: dict, sem: asyncio.Semaphore) -> list[Rollout]:
        async with sem:
            try:
                return await self.generator.group(slot, row, "eval", n=self.k)
            finally:
                self.on_group()

    async def run(self, step: int) -> None:
        """Evaluate and log the row as step `step`'s (a failure is one warning)."""
        t0 = time.monotonic()
        try:
            metrics = await self.evaluate(step)
        except Exception as e:
            logger.warning(f"eval at step {step} failed: {type(e).__name__}: {e}")
            return
        metrics["time/eval"] = time.monotonic() - t0
        if self.log is not None:
            self.log(step, metrics)
        logger.info(f"eval step {step}: " + ", ".join(f"{k}={v:.3f}" for k, v in metrics.items()))

    async def start_if_due(self, step: int) -> None:
        """After step `step`: start an eval in the background every `interval` steps."""
        if self.interval and step % self.interval == 0:
            await self.wait()
            self.pending = asyncio.create_task(self.run(step))

    async def wait(self) -> None:
        if self.pending is not None:
            await self.pending

    async def aclose(self) -> None:
        if self.pending is not None:
            self.pending.cancel()
            await asyncio.gather(self.pending, return_exceptions=True)
