"""Several LoRA runs in one job against the same runs as jobs of their own, one after another,
side by side in one run of this script.

The same three runs of the reverse_text recipe (LoRA, no warm-up, three learning rates), on
this machine (`cluster=local`):

* together: `prime-hpc submit -m ... trainer.optim.lr=a,b,c --together`, one job: one vLLM
  server holding the three adapters, one trainer training them in turns, three
  orchestrators;
* apart: three jobs, each submitted when the one before it ended.

For each: the wall time from the first submit to the last run's end (job.json), the
completions generated (the runs' orchestrator metrics), completions per second over that
wall time, and each run's last reward. Goal: together >= 1.5x the completions per second of
one after another.

From the repository root:

    .venv/bin/python benchmarks/together.py [--steps 30] [--workdir DIR]

A finished job in `--workdir` is read again instead of re-run (delete it to measure anew).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_trl import machine, project_versions, read_jsonl, submit_and_wait  # noqa: E402

LRS = ("1e-3", "3e-3", "1e-2")


def overrides(steps: int) -> list[str]:
    return [
        "+experiment=reverse_text",
        "cluster=local",
        "warmup.experiment=null",
        f"max_steps={steps}",
        "orchestrator.eval.interval=0",
        "orchestrator.eval.at_start=false",
        "trainer.model.lora.enabled=true",
        "trainer.model.lora.rank=8",
        "trainer.optim.schedule=constant",
    ]


def job_times(run: Path) -> tuple[float, float]:
    """(submitted at, ended at) of the job in `run`."""
    job = json.loads((run / "job.json").read_text())
    return float(job["submitted_at"]), float(job["ended_at"])


def completions(run: Path) -> tuple[int, float]:
    """(completions generated, the last step's mean reward) of one run's orchestrator."""
    rows = [r for r in read_jsonl(run / "metrics" / "orchestrator.jsonl") if "reward/all/mean" in r]
    total = int(rows[-1].get("progress/total_samples", 0)) if rows else 0
    return total, (rows[-1]["reward/all/mean"] if rows else float("nan"))


def together(workdir: Path, steps: int) -> dict:
    job = workdir / "together"
    submit_and_wait(
        job, ["-m", *overrides(steps), f"trainer.optim.lr={','.join(LRS)}", "--together"], "together", steps
    )
    start, end = job_times(job)
    runs = sorted((job / "runs").iterdir())
    got = [completions(r) for r in runs]
    return {"wall": end - start, "completions": sum(c for c, _ in got), "rewards": [r for _, r in got]}


def apart(workdir: Path, steps: int) -> dict:
    times, got = [], []
    for i, lr in enumerate(LRS):
        run = workdir / f"apart_{i}"
        submit_and_wait(run, [*overrides(steps), f"trainer.optim.lr={lr}", f"name=apart_{i}"], f"apart {i}", steps)
        times.append(job_times(run))
        got.append(completions(run))
    return {
        "wall": times[-1][1] - times[0][0],
        "completions": sum(c for c, _ in got),
        "rewards": [r for _, r in got],
    }


def report(t: dict, a: dict, steps: int) -> None:
    print()
    print(f"machine:   {machine()}")
    print(f"prime-hpc: {project_versions()}")
    print(f"runs:      3 LoRA runs of reverse_text (lr {', '.join(LRS)}), {steps} steps each, cluster=local")
    print()
    print(f"{'':44}{'together':>14}{'apart':>14}{'together/apart':>16}")

    def row(name: str, tv: str, av: str, ratio: str = "") -> None:
        print(f"{name:44}{tv:>14}{av:>14}{ratio:>16}")

    row(
        "wall time, first submit -> last end (s)",
        f"{t['wall']:.1f}",
        f"{a['wall']:.1f}",
        f"{t['wall'] / a['wall']:.2f}x",
    )
    row("completions generated", str(t["completions"]), str(a["completions"]))
    tps, aps = t["completions"] / t["wall"], a["completions"] / a["wall"]
    row("completions per second (goal >= 1.5x)", f"{tps:.1f}", f"{aps:.1f}", f"{tps / aps:.2f}x")
    for i, lr in enumerate(LRS):
        row(f"  last reward, lr {lr}", f"{t['rewards'][i]:.3f}", f"{a['rewards'][i]:.3f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--workdir", type=Path, default=Path("outputs/bench-together"))
    a = ap.parse_args()
    workdir = a.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    t = together(workdir, a.steps)
    s = apart(workdir, a.steps)
    report(t, s, a.steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
