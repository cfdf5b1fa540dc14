"""The orchestrator's generation times per step: each group's span, from its first request
to its last answer, travels on its rollouts (never into the batch files); a filled step's
row gives `time/generate` (the first request of its accepted groups to the last answer)
and `time/generate_group/mean`; an unfilled step's row gives neither."""

from __future__ import annotations

import asyncio
import itertools
import json

import pytest
import torch

from tests.unit.test_orchestrator import _orchestrator


class _Env:
    """An env whose groups answer at once with the token trajectories a server gives, rewards varying."""

    def __init__(self) -> None:
        self.groups = 0

    async def run_group(self, rows, client, model, sampling_args, state_columns=None):
        self.groups += 1
        await asyncio.sleep(0)  # other groups start meanwhile
        turn = {"prompt_ids": [1, 2, 3], "completion_ids": [4, 5], "completion_logprobs": [-0.1, -0.2]}
        return [
            {
                "example_id": row.get("example_id"),
                "reward": i / len(rows),
                "is_truncated": False,
                "trajectory": [{"tokens": turn, "response": {"policy_step": 0}}],
            }
            for i, row in enumerate(rows)
        ]


def _timed_orchestrator(root):
    """The reverse_text orchestrator generating through `_Env`, its clock a counter (1 s a reading)."""
    o = _orchestrator(root)
    env = _Env()
    for slot in o.source.sampler.slots:
        slot.env = env
    ticks = itertools.count()
    o.generator.clock = lambda: float(next(ticks))
    return o, env


def test_a_filled_step_s_row_gives_the_generation_time_of_its_accepted_groups(tmp_path):
    o, env = _timed_orchestrator(tmp_path / "run")
    fill = asyncio.run(o.sink.fill(1))
    assert fill is not None and len(fill.accepted) == o.sink.groups_per_step and env.groups >= len(fill.accepted)
    spans = []
    for group in fill.accepted:
        assert len({r.generated for r in group}) == 1  # one span per group, on each of its rollouts
        start, end = group[0].generated
        assert end > start
        spans.append((start, end))
    row = o.step_metrics.log_step(1, fill, fill.kept)
    assert row["time/generate"] == max(e for _, e in spans) - min(s for s, _ in spans)
    assert row["time/generate_group/mean"] == pytest.approx(sum(e - s for s, e in spans) / len(spans))
    written = json.loads(o.run.metrics("orchestrator").read_text().splitlines()[-1])
    assert written["time/generate"] == row["time/generate"]
    # the spans stay in the orchestrator: the trainer's files hold samples only
    o.sink.write(1, fill)
    data = torch.load(o.run.rollout_file(1, 0), weights_only=True)
    assert "generated" not in json.dumps(data, default=str)


def test_an_unfilled_step_s_row_has_no_generation_time(tmp_path):
    o, _ = _timed_orchestrator(tmp_path / "run")
    fill = asyncio.run(o.sink.fill(1))
    assert fill is not None and fill.accepted
    o.step_metrics.log_unfilled(1, fill)
    row = json.loads(o.run.metrics("orchestrator").read_text().splitlines()[-1])
    assert row["filter/unfilled"] == 1
    assert not [k for k in row if k.startswith("time/generate")]


def test_groups_without_a_span_give_no_generation_time():
    from prime_hpc.orchestrator.step_metrics import generation_times
    from tests.unit.test_orchestrator import _r

    assert generation_times([[_r(1.0), _r(0.0)]]) == {}
    timed = [_r(1.0), _r(0.0)]
    for r in timed:
        r.generated = (2.0, 5.0)
    later = [_r(1.0)]
    later[0].generated = (3.0, 9.0)
    assert generation_times([timed, later, [_r(0.5)]]) == {"time/generate": 7.0, "time/generate_group/mean": 4.5}


def test_the_loop_lag_is_how_long_work_in_the_loops_thread_held_it():
    """`time/loop_lag/max`: a synchronous 300 ms in the event loop (a reward run in the
    orchestrator's process) shows as a timer at least that late, and a hold past `warn_s` is
    logged once; each take starts over."""
    import time

    from loguru import logger

    from prime_hpc.orchestrator.step_metrics import LoopLag

    said: list[str] = []
    sink = logger.add(lambda m: said.append(m.record["message"]), level="WARNING")

    async def main() -> tuple[dict, dict, dict]:
        lag = LoopLag(interval_s=0.01, warn_s=0.2)
        probe = asyncio.create_task(lag.run())
        await asyncio.sleep(0.05)
        before = lag.take()
        time.sleep(0.3)  # holds the loop
        await asyncio.sleep(0.05)
        held = lag.take()
        probe.cancel()
        return before, held, lag.take()

    try:
        before, held, after = asyncio.run(main())
    finally:
        logger.remove(sink)
    assert len([m for m in said if m.startswith("the event loop was blocked for")]) == 1, said
    assert held["time/loop_lag/max"] >= 0.28 > before["time/loop_lag/max"], (before, held)
    assert held["time/loop_lag/mean"] < held["time/loop_lag/max"]  # the other ticks were on time-ish
    assert after == {"time/loop_lag/max": 0.0, "time/loop_lag/mean": 0.0}
