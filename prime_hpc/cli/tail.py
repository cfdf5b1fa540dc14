"""`prime-hpc tail JOB [--component C]... [--rank R|all] [--all] [--no-follow] [-n N]`:
follow every log of the job's current attempt until it ends (see prime_hpc/watch/tail.py)."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any) -> argparse.ArgumentParser:
    from prime_hpc.watch.tail import COMPONENTS, parse_rank

    t = sub.add_parser("tail", help="follow every log of a job until it ends (exit 0 if it completed)")
    t.add_argument("job", help="job id, run name or output dir")
    t.add_argument("--component", action="append", choices=COMPONENTS, help="only these sources (repeatable)")
    t.add_argument("--rank", type=parse_rank, default=0, help="trainer rank to show: a number or 'all' (default 0)")
    t.add_argument(
        "--all", action="store_true", dest="show_all", help="also the per-request lines of the servers and the router"
    )
    t.add_argument("--no-follow", action="store_true", help="print the last lines and exit")
    t.add_argument("-n", "--lines", type=int, default=10, help="last lines of each source to start with")
    return t


def run(a: argparse.Namespace) -> int:
    from prime_hpc.launcher.state import follow_ref
    from prime_hpc.rundir import jobs

    ref = jobs.resolve(a.job)
    return follow_ref(ref, components=a.component, rank=a.rank, show_all=a.show_all, once=a.no_follow, lines=a.lines)
