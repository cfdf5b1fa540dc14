"""Judging a run's learning from its metrics: the rows a component wrote, and the trend of a
noisy per-step curve (the reward) as a least-squares line."""

from __future__ import annotations

import json
import statistics
from typing import Optional

from prime_hpc.rundir import RunDir


def rows(run: RunDir, component: str) -> list[dict]:
    """`metrics/<component>.jsonl`, one dict per line (none before the file exists)."""
    path = run.metrics(component)
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def rewards(run: RunDir) -> list[float]:
    """`reward/all/mean` of every step the orchestrator wrote, in order."""
    return [r["reward/all/mean"] for r in rows(run, "orchestrator") if "reward/all/mean" in r]


def trend(ys: list[float], xs: Optional[list[float]] = None) -> tuple[float, float]:
    """The rise of the least-squares line over the run and its t-statistic (slope / its
    standard error): a noisy curve that really climbs has t above 2.5 (one-sided p < 0.01
    over 100+ steps of independent noise; a flat curve rarely passes 2). `xs`: the steps
    of the values when some steps have none (an env's groups are not in every step); the
    values are one a step otherwise."""
    n = len(ys)
    xs = list(range(n)) if xs is None else xs
    xm, ym = statistics.mean(xs), statistics.mean(ys)
    sxx = sum((x - xm) ** 2 for x in xs)
    slope = sum((x - xm) * (y - ym) for x, y in zip(xs, ys)) / sxx
    resid = sum((y - ym - slope * (x - xm)) ** 2 for x, y in zip(xs, ys))
    stderr = (resid / (n - 2) / sxx) ** 0.5
    return slope * (xs[-1] - xs[0]), slope / stderr if stderr else float("inf")
