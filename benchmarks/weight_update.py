"""Weight updates in flight against drained ones, side by side in one run of this script.

Two local RL runs of the reverse_text recipe (no warm-up: the offline tiny model, whose
completions run to `max_tokens`), the same but for `inference.weight_update`:

* `in_flight` (the default): an update pauses generation keeping the requests in flight
  and their KV cache, loads, resumes;
* `drain`: an update waits until no generation is in flight, holding new ones back.

From each run's own metrics (medians of the steps after the first `SKIP_STEPS`): the
trainer's step and its wait for the batch, the update call to the servers and of it the
wait before the load (`time/weight_drain`: the requests in flight, or the pause), the
share of samples generated across an update and their mismatch KL against all samples',
the policy lag, the reward over the last steps, and the ratio in_flight / drain of each.

From the repository root:

    .venv/bin/python benchmarks/weight_update.py [--steps 60] [--async-level 3] [--workdir DIR]

A finished run in `--workdir` is read again instead of re-run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import SKIP_STEPS, median  # noqa: E402
from vs_trl import machine, project_versions, read_jsonl, submit_and_wait  # noqa: E402

MODES = ("in_flight", "drain")


def measure(run: Path) -> dict[str, float]:
    every = [r for r in read_jsonl(run / "metrics" / "trainer.jsonl") if "loss/mean" in r]
    trainer = [r for r in every if r["step"] > SKIP_STEPS]
    orch = [r for r in read_jsonl(run / "metrics" / "orchestrator.jsonl") if r.get("step", 0) > SKIP_STEPS]
    if not trainer or not orch or len(every) == len(trainer):
        raise SystemExit(f"[weight_update] {run} has no steps after the first {SKIP_STEPS}")
    before = every[len(every) - len(trainer) - 1]["progress/num_samples"]
    samples = float(trainer[-1]["progress/num_samples"] - before)  # trained in the measured steps
    spanning = sum(float(r.get("off_policy/spanning_samples", 0)) for r in trainer)
    last = orch[-10:]
    return {
        "trainer step s": median(trainer, "time/step"),
        "  waiting for the batch s": median(trainer, "time/wait_for_batch"),
        "update call s": median(orch, "time/weight_update"),
        "  wait before the load s": median(orch, "time/weight_drain"),
        "  load s": median(orch, "time/weight_load"),
        "samples spanning an update": spanning / max(samples, 1.0),
        "mismatch KL, all samples": median(trainer, "mismatch_kl/mean"),
        "mismatch KL, spanning samples": median(trainer, "mismatch_kl/spanning/mean"),
        "policy lag (mean)": median(orch, "off_policy/lag/mean"),
        "reward, last 10 steps": statistics.mean(float(r["reward/all/mean"]) for r in last),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--async-level", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=Path("outputs/bench-weight-update"))
    ap.add_argument("overrides", nargs="*", help="more overrides for both runs")
    a = ap.parse_args()
    results = {}
    for mode in MODES:
        run = a.workdir.resolve() / mode
        overrides = [
            "+experiment=reverse_text",
            "cluster=local",
            "warmup.experiment=null",
            "model.name=tiny",
            f"name=bench_{mode}",
            f"max_steps={a.steps}",
            f"async_level={a.async_level}",
            "orchestrator.eval.interval=0",
            f"inference.weight_update={mode}",
            *a.overrides,
        ]
        print(f"[weight_update] {' '.join(overrides)}", flush=True)
        submit_and_wait(run, overrides, mode, a.steps)
        results[mode] = measure(run)

    print()
    print(f"machine:   {machine()}")
    print(f"prime-hpc: {project_versions()}")
    print(f"runs:      {a.workdir.resolve()} ({a.steps} steps each, async_level={a.async_level}; medians)")
    print()
    print(f"{'':34} {'in_flight':>10} {'drain':>10} {'in_flight/drain':>16}")
    for key in results["in_flight"]:
        x, y = results["in_flight"][key], results["drain"][key]
        ratio = f"{x / y:15.2f}x" if y and y == y and x == x else f"{'-':>16}"
        print(f"{key:34} {x:10.4f} {y:10.4f} {ratio}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
