"""Runs submitted together (`submit [-m]`): every point of a sweep composed and validated
before any is submitted, each point named `<name>_<i>` in `<output_dir>/<i>` (unless the
sweep varies output_dir itself), then submitted in order, a point waiting for the one
`max_parallel` before it to end. A point is a list of runs: [run], or [warm-up, run]."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from prime_hpc.config.sweep import swept
from prime_hpc.core.errors import UserError
from prime_hpc.launcher import launch
from prime_hpc.launcher.plan import After

Point = tuple[list[str], list[Any]]  # (the point's overrides, its runs: [run] or [warm-up, run])


def compose_points(overrides: list[str], multirun: bool) -> list[Point]:
    """Compose and validate every point (of a sweep) before submitting any: nothing is
    submitted if one of them is wrong. Sweep points get `<output_dir>/<i>` and `<name>_<i>`.
    Each point is a list of runs: [run], or [warm-up, run] when the run has a warm-up."""
    from prime_hpc.config.compose import compose
    from prime_hpc.config.overrides import override
    from prime_hpc.config.pipeline import compose_stages
    from prime_hpc.config.sweep import expand_sweep
    from prime_hpc.config.validate import validate

    points = expand_sweep(overrides) if multirun else [overrides]
    # each point gets <output_dir>/<i>, unless the sweep varies output_dir itself
    sweeps_dir = (
        len(points) > 1 and len({o for p in points for o in p if o.lstrip("+~").startswith("output_dir=")}) <= 1
    )
    composed = []
    for i, point in enumerate(points):
        try:
            extra = []
            if len(points) > 1:
                base = compose(point)
                extra.append(override("name", f"{base.name}_{i}"))
                if sweeps_dir:
                    extra.append(override("output_dir", f"{base.output_dir}/{i}"))
            stages = compose_stages([*point, *extra])
            for cfg in stages:
                try:
                    validate(cfg)
                except UserError as e:
                    if cfg is not stages[-1]:
                        raise UserError(f"warm-up {cfg.output_dir}: {e}") from None
                    raise
        except UserError as e:
            if len(points) > 1:
                raise UserError(f"sweep point {i} ({swept(point, overrides)}): {e}") from None
            raise
        composed.append((point, stages))
    return composed


def check_fresh(points: Sequence[Point], dry_run: bool = False) -> None:
    """Refuse before writing or submitting anything when a point's run directory is used."""
    for _, stages in points:
        launch.check_fresh(stages[-1], dry_run=dry_run)


def write_launch_files(points: Sequence[Point]) -> Iterator[list[Path]]:
    """A dry run: each run's launch files written (nothing submitted); yields their paths."""
    for _, stages in points:
        for cfg in stages:
            run, plan = launch.prepare(cfg, "run", dry_run=True, validated=True)  # by compose_points
            yield launch.launch_files(run, plan)


def new_sweep_id(points: Sequence[Point]) -> Optional[str]:
    """A fresh id naming every point of a sweep (None for a single run)."""
    import secrets

    return f"sweep-{secrets.token_hex(3)}" if len(points) > 1 else None


def submit_points(
    points: Sequence[Point], overrides: list[str], sweep_id: Optional[str], max_parallel: Optional[int] = None
) -> Iterator[tuple[list[launch.Submitted], Optional[dict]]]:
    """Submit each point in order; yields its jobs ([run] or [warm-up, run]) and its sweep
    record (job.json `sweep`) as soon as it is submitted. With `max_parallel` K, point i
    starts once point i-K ended (SLURM afterany)."""
    submitted: list[list[launch.Submitted]] = []
    for i, (point, stages) in enumerate(points):
        after = []
        if max_parallel and i >= max_parallel:
            prior = submitted[i - max_parallel][-1].ref
            after = [After(job_id=prior.job_id, output_dir=prior.output_dir, ok=False)]
        sweep = (
            {"id": sweep_id, "point": i, "points": len(points), "swept": swept(point, overrides)} if sweep_id else None
        )
        subs = launch.submit_stages(stages, point, after=after, sweep=sweep)
        submitted.append(subs)
        yield subs, sweep
