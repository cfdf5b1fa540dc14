"""The orchestrator's metrics row of a step (`metrics/orchestrator.jsonl`, and W&B).

Consumes: what filling a step judged (`sink.StepFill`: every rollout finished during the
step, the groups accepted, the groups dropped by reason), the groups it trains, and the
run's gauges at that moment (`gauges()`: the relay's policy, servers and update times,
the totals so far). Produces one row per step: per scope (`all` and each env) reward,
sequence length, truncation, turns, samples per rollout, empty and errored shares; the
policy lag of the trained rollouts; the groups judged and dropped by reason
(`rundir.drops.Drop.metric`); the train tasks not sent since the previous row because
their prompt is longer than `orchestrator.max_prompt_len` (`filter/long_prompts`,
`prompts.LimitedSampler`); spanning rollouts; the step's time and its wait for weights;
the generation of its accepted groups (`generation_times`: `time/generate`, from the
first request of any of them to the last answer, and `time/generate_group/mean`); how
late the event loop ran a timer since the previous row (`LoopLag`: `time/loop_lag/max`,
`time/loop_lag/mean`). A step that is not filled (the run gives up or is stopped) gets a row without
reward keys, without generation times and with `filter/unfilled` 1 (`log_unfilled`). Every
`wandb.log_extras.interval` steps with W&B, a table of sampled rollouts and histograms of
rewards and advantages (`log_extras`). The names are documented in docs/orchestrator.md.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import defaultdict
from statistics import mean
from typing import Any, Callable

from loguru import logger

from prime_hpc.config.schema import LogExtrasConfig
from prime_hpc.orchestrator.rollouts import Rollout
from prime_hpc.orchestrator.sink import StepFill
from prime_hpc.rundir import BEAT_S, RunDir, read_json
from prime_hpc.rundir.drops import Drop

TRAINER_WAIT_S = 300.0  # at the end, with W&B: how long to wait for the trainer's last metrics


def rollout_metrics(scope: str, rs: list[Rollout]) -> dict:
    lens = [len(seq.input_ids) for r in rs for seq in r.sequences()]  # per sample
    return {
        f"reward/{scope}/mean": mean(r.reward for r in rs),
        f"seq_len/{scope}/mean": mean(lens),
        f"seq_len/{scope}/max": max(lens),
        f"is_truncated/{scope}/mean": mean(float(r.is_truncated) for r in rs),
        f"num_turns/{scope}/mean": mean(r.num_turns for r in rs),
        f"samples_per_rollout/{scope}/mean": mean(1 + len(r.branches) for r in rs),  # > 1: branching
        f"empty_rollouts/{scope}": mean(float(r.empty and not r.error) for r in rs),
        f"errored_rollouts/{scope}": mean(float(bool(r.error)) for r in rs),
    }


def generation_times(groups: list[list[Rollout]]) -> dict:
    """`time/generate`: seconds from the first generation request of `groups` (a step's
    accepted groups) to the last answer; `time/generate_group/mean`: the seconds one of
    them took, on average (`Rollout.generated`). Empty when none of them was timed."""
    spans = [g[0].generated for g in groups if g and g[0].generated is not None]
    if not spans:
        return {}
    return {
        "time/generate": max(end for _, end in spans) - min(start for start, _ in spans),
        "time/generate_group/mean": mean(end - start for start, end in spans),
    }


class LoopLag:
    """How long the orchestrator's event loop was held: a timer every `interval_s`, and how
    late it ran. Work that runs in the loop's thread (a classic env's reward or env
    response in the orchestrator's process, a synchronous call) holds every group in
    flight, the heartbeat and the relay for as long; `take()` gives the max and the mean
    lateness since the last take (0 before the first tick). A hold longer than `warn_s`
    (a heartbeat's period: the watchdog may take it for a stall) is also logged."""

    def __init__(self, interval_s: float = 0.05, warn_s: float = BEAT_S) -> None:
        self.interval_s = interval_s
        self.warn_s = warn_s
        self.late: list[float] = []

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(self.interval_s)
            late = max(0.0, loop.time() - t - self.interval_s)
            self.late.append(late)
            if late > self.warn_s:
                logger.warning(f"the event loop was blocked for {late:.1f}s (time/loop_lag/max)")

    def take(self) -> dict:
        late, self.late = self.late, []
        return {"time/loop_lag/max": max(late, default=0.0), "time/loop_lag/mean": mean(late) if late else 0.0}


class StepMetrics:
    def __init__(
        self,
        logger: Any,
        extras: LogExtrasConfig,
        seed: int,
        gauges: Callable[[], dict],
        long_prompts: Callable[[], int] = lambda: 0,
    ) -> None:
        self.logger = logger  # runtime.metrics.MetricsLogger
        self.extras = extras
        self.seed = seed
        self.gauges = gauges
        self.long_prompts = long_prompts  # train tasks not sent so far (`orchestrator.max_prompt_len`)
        self.long_prompts_logged = 0  # ... of which earlier rows counted

    def row(self, step: int, fill: StepFill, kept: list[Rollout]) -> dict:
        """The step's row (`kept`: the rollouts it trains, none for an unfilled step); it
        counts the long prompts skipped since the previous row."""
        m: dict = {}
        by_env: dict = defaultdict(list)
        for r in fill.finished:
            by_env[r.env].append(r)
        for scope, rs in (("all", fill.finished), *sorted(by_env.items())):
            if rs:
                m.update(rollout_metrics(scope, rs))
        if kept:  # a step that is trained (an unfilled one has none)
            m.update(generation_times(fill.accepted))
        lags = [step - r.oldest_policy for r in kept]
        m.update(
            {
                "off_policy/lag/mean": mean(lags) if lags else 0.0,
                "off_policy/lag/max": max(lags) if lags else 0,
                "off_policy/stale_share": fill.dropped[Drop.STALE] / max(fill.judged, 1),
                "off_policy/spanning_rollouts": fill.spanning,
                "filter/judged_groups": fill.judged,
                "filter/long_prompts": self.long_prompts_since(),
                **{d.metric: fill.dropped[d] for d in Drop},
                **self.gauges(),
                "time/step": time.monotonic() - fill.t0,
                "time/wait_for_ckpt": fill.t_wait,
            }
        )
        return m

    def long_prompts_since(self) -> int:
        """Train tasks skipped for a prompt longer than `max_prompt_len` since the last row."""
        total = self.long_prompts()
        since, self.long_prompts_logged = total - self.long_prompts_logged, total
        return since

    def log_step(self, step: int, fill: StepFill, kept: list[Rollout]) -> dict:
        """The row of a step written, its extras, and the trainer's new rows into the same W&B run."""
        m = self.row(step, fill, kept)
        self.logger.log(step, m)
        self.log_extras(step, kept)
        self.logger.forward()
        return m

    def log_unfilled(self, step: int, fill: StepFill) -> None:
        """A row for a step that will not be filled: what it judged and why groups were
        dropped, `filter/unfilled` 1; no reward keys (nothing of it is trained)."""
        m = self.row(step, fill, [])
        self.logger.log(
            step,
            {
                **{k: v for k, v in m.items() if not k.startswith("reward/")},
                "filter/accepted_groups": len(fill.accepted),
                "filter/unfilled": 1,
            },
        )

    def log_extras(self, step: int, kept: list[Rollout]) -> None:
        """Every `wandb.log_extras.interval` steps: a table of sampled rollouts and
        histograms of the step's rewards and advantages (W&B only)."""
        every = self.extras.interval
        if self.logger.wandb is None or not every or step % every or not kept:
            return
        if self.extras.samples:
            n = max(1, round(len(kept) * self.extras.sample_ratio))
            picked = random.Random(f"{self.seed}:{step}").sample(kept, min(n, len(kept)))
            self.logger.log_table(
                step,
                "samples",
                ["step", "env", "example_id", "prompt", "completion", "reward", "advantage"],
                [
                    [step, r.env, str(r.example_id), r.prompt_text, r.completion_text, r.reward, r.advantage]
                    for r in picked
                ],
            )
        if self.extras.distributions:
            self.logger.log_histograms(
                step,
                {
                    "distributions/reward": [r.reward for r in kept],
                    "distributions/advantage": [r.advantage for r in kept],
                },
            )

    async def wait_for_trainer(self, run: RunDir, step: int, timeout_s: float = TRAINER_WAIT_S) -> None:
        """With W&B, at the end: until the trainer's heartbeat says it is done or at `step`
        (bounded), so that its last rows go into the same W&B run."""
        if self.logger.wandb is None:
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                beat = read_json(run.heartbeat("trainer", 0))
            except (OSError, ValueError):
                beat = {}
            if beat.get("done") or int(beat.get("step", 0)) >= step:
                return
            await asyncio.sleep(0.5)
