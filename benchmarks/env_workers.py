"""A CPU-heavy reward in the orchestrator's process, or in an env server's workers
(`orchestrator.env[i].workers`), side by side.

Three local RL runs of the reverse_text recipe (no warm-up, no eval), the same seed and
steps, whose env is benchmarks/envs/slow_reverse_text (reverse_text with a reward that
burns `--cpu-ms` of CPU per rollout):
  plain    cpu_ms=0, the env in the orchestrator's process (what the machine does anyway)
  inproc   cpu_ms=N, the env in the orchestrator's process
  workers  cpu_ms=N, the env in a server of its own with `--workers` worker processes
Printed: each run's median step time (the wall time between the trainer's step ends,
after the first steps) and the ratios of the step rates; and how long the orchestrator's
event loop was held (`time/loop_lag/max` of each step's row, its median over the same
steps, and the worst), side by side. With the reward in the orchestrator's process its
event loop scores each rollout in turn (64 x N ms a step), holding every group in flight,
the heartbeat and the weight relay meanwhile; in workers the scoring runs beside the
loop, on as many cores as the machine has left. The step rate needs cores to spare for
the workers (a GPU node's head has tens); the loop lag does not.

From the repository root:

    .venv/bin/python benchmarks/env_workers.py [--steps 20] [--cpu-ms 50] [--workers 2] [--workdir DIR]

A finished run in `--workdir` is read again instead of re-run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_trl import SKIP_STEPS, machine, median_step_s, project_versions, read_jsonl, submit_and_wait  # noqa: E402

ENV = Path(__file__).resolve().parent / "envs" / "slow_reverse_text"


def run(workdir: Path, name: str, steps: int, cpu_ms: float, workers: int) -> tuple[float, int, float, float]:
    out = workdir / name
    overrides = [
        "+experiment=reverse_text",
        "warmup.experiment=null",
        f"max_steps={steps}",
        "orchestrator.eval.interval=0",
        "orchestrator.eval.at_start=false",
        f"orchestrator.env.0.id={ENV}",
        f"+orchestrator.env.0.args.cpu_ms={cpu_ms}",
        f"orchestrator.env.0.workers={workers}",
        "-f",
    ]
    submit_and_wait(out, overrides, name, steps)
    ends = [float(r["time"]) for r in read_jsonl(out / "metrics" / "trainer.jsonl")]
    rows = [r for r in read_jsonl(out / "metrics" / "orchestrator.jsonl") if "time/loop_lag/max" in r]
    lags = [float(r["time/loop_lag/max"]) for r in rows if r["step"] > SKIP_STEPS] or [float("nan")]
    return (*median_step_s(ends), statistics.median(lags), max(lags))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--cpu-ms", type=float, default=50.0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--workdir", type=Path, default=None)
    a = p.parse_args()
    workdir = a.workdir or Path(tempfile.mkdtemp(prefix="env-workers-"))
    print(f"machine: {machine()}; {project_versions()}; runs in {workdir}", flush=True)
    plain = run(workdir, "plain", a.steps, 0.0, 0)
    inproc = run(workdir, "inproc", a.steps, a.cpu_ms, 0)
    workers = run(workdir, "workers", a.steps, a.cpu_ms, a.workers)
    print(
        f"{'run':<34} {'median step s':>14} {'steps':>6} {'step rate vs plain':>19}"
        f" {'loop held s (median of step max)':>33} {'worst':>6}"
    )
    for label, (s, n, lag, worst) in (
        ("plain (reward 0 ms, in process)", plain),
        (f"inproc (reward {a.cpu_ms:g} ms, in process)", inproc),
        (f"workers (reward {a.cpu_ms:g} ms, {a.workers} workers)", workers),
    ):
        print(f"{label:<34} {s:>14.3f} {n:>6} {plain[0] / s:>18.2f}x {lag:>33.3f} {worst:>6.2f}")
    print(
        f"workers vs inproc: {inproc[0] / workers[0]:.2f}x the step rate, the loop held {inproc[2] / workers[2]:.1f}x less"
    )


if __name__ == "__main__":
    main()
