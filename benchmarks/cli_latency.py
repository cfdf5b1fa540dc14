"""CLI latency: each read-only command next to `python -c pass` (the interpreter's own
start-up) and `squeue` (what a user compares it with), measured in one run.

    .venv/bin/python benchmarks/cli_latency.py [--runs 7] [--job JOB]

Every command runs `--runs` times after one warm-up; the table gives the median wall
time, the min–max spread and the ratio of medians to `python -c pass`. JOB (default: the
newest job in the index) is what `status` and `tail` are asked about. Without SLURM
(no `squeue` on PATH) that row is left out. `submit --dry-run` is timed three ways: as a user
repeats it (the composition cached, `prime_hpc.config.compose_cache`), with new values at
each run (a new learning rate and output_dir: the cached composition of the experiment,
the values applied to it), and composed by Hydra every time (`PRIME_HPC_COMPOSE_CACHE=0`:
the first use of an experiment or cluster choice).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GOAL_S = 0.3  # each CLI command, on a 2-core machine


# Timed as a user's shell runs them: Python writes and reuses bytecode (.pyc) unless told
# not to; a PYTHONDONTWRITEBYTECODE in the caller's environment would time compiling every
# module of the package at each start instead.
USER_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def wall_times(argv: list[str], runs: int, env: dict[str, str] | None = None) -> tuple[list[float], set[int]]:
    """Wall seconds of each counted run, and the exit codes seen (a failing command is
    timed too, but its row says so)."""
    env = {**USER_ENV, **(env or {})}
    out, codes = [], set()
    for i in range(runs + 1):  # run 0 is a warm-up (page cache, .pyc)
        words = [w.format(i=i) for w in argv]  # "{i}": a value new at each run
        t0 = time.perf_counter()
        codes.add(subprocess.run(words, capture_output=True, cwd=REPO, timeout=300, env=env).returncode)
        out.append(time.perf_counter() - t0)
    return out[1:], codes


def newest_job() -> str | None:
    sys.path.insert(0, str(REPO))
    from prime_hpc.rundir import jobs

    recent = jobs.recent(1)
    return recent[0].job_id if recent else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--job", default=None, help="job for status/tail (default: the newest)")
    a = ap.parse_args()
    py = sys.executable
    cli = [str(Path(py).parent / "prime-hpc")]  # the entry point a user types
    job = a.job or newest_job()
    dry = Path(tempfile.mkdtemp(prefix="cli-latency-"))
    rows: list[tuple] = [("python -c pass", [py, "-c", "pass"])]
    if shutil.which("squeue"):
        rows.append(("squeue", ["squeue"]))
    rows += [("prime-hpc --help", cli + ["--help"]), ("prime-hpc list", cli + ["list"])]
    if job:
        rows += [
            ("prime-hpc status JOB", cli + ["status", job]),
            ("prime-hpc tail JOB --no-follow", cli + ["tail", job, "--no-follow"]),
        ]
    submit = cli + ["submit", "+experiment=reverse_text", "--dry-run", f"output_dir={dry}/run", "clean_output_dir=true"]
    rows.append(("prime-hpc submit --dry-run", submit))  # composed before: from the composition cache
    rows.append(
        ("  ... new values (lr, output_dir)", [*submit[:-2], f"output_dir={dry}/{{i}}", "trainer.optim.lr=1{i}e-7"])
    )
    rows.append(("  ... composed by Hydra", submit, {"PRIME_HPC_COMPOSE_CACHE": "0"}))
    base = None
    print(f"{'command':34} {'median s':>9} {'min-max s':>13} {'x python':>9}")
    for name, argv, *env in rows:
        t, codes = wall_times(argv, a.runs, *env)
        med = statistics.median(t)
        base = base or med
        failed = f"  (FAILED: exit {sorted(codes - {0})})" if codes - {0} else ""
        print(f"{name:34} {med:9.3f} {min(t):6.3f}-{max(t):6.3f} {med / base:9.2f}{failed}")
    print(f"(goal: each prime-hpc command <= {GOAL_S} s; {a.runs} runs after a warm-up; job {job or '-'})")
    shutil.rmtree(dry, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
