"""`prime-hpc plot JOB... [-o FILE]`: one PNG of the runs' curves (reward, loss, mismatch
KL, entropy, seconds per step); a sweep's points overlay, labelled by their swept values."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("plot", help="draw the curves of one or more runs (or a sweep) into a PNG")
    p.add_argument("jobs", nargs="+", help="job ids, run names, output dirs or sweep ids")
    p.add_argument("-o", "--output", help="the PNG to write (default: <output dir>/plot.png of the first run)")
    p.add_argument("--title", help="a title for the figure")
    return p


def runs_of(names: list[str]) -> list[tuple[str, Any]]:
    """(legend label, run dir) for every job named; a sweep point's label is its swept values,
    a run of a job of several (`--together`) its name."""
    from prime_hpc.rundir import jobs

    out = []
    for name in names:
        refs = jobs.resolve_many(name)
        for ref in refs:
            record = jobs.read_job(ref.run)
            if record.get("runs"):  # a job of several runs: each one's curves
                out += [(run, ref.run.sub_run(run)) for run in record["runs"]]
                continue
            swept = (record.get("sweep") or {}).get("swept")
            out.append((swept or ref.name if len(refs) > 1 else ref.name, ref.run))
    labels = [label for label, _ in out]
    return [(f"{label} ({run.root.name})" if labels.count(label) > 1 else label, run) for label, run in out]


def run(a: argparse.Namespace) -> int:
    from prime_hpc.watch.plot import plot_runs

    runs = runs_of(a.jobs)
    out = Path(a.output) if a.output else runs[0][1].root / "plot.png"
    path = plot_runs(runs, out, title=a.title)
    print(f"wrote {path} ({len(runs)} run{'s' if len(runs) > 1 else ''})")
    return 0
