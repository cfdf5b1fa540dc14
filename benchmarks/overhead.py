"""prime-hpc's own machinery per RL step, from the run's own timers, next to the work.

One local RL run (the reverse_text recipe, no warm-up: the offline tiny model, whose
completions run to `max_tokens`, so every step has the recipe's full shape), then from
its metrics and weights, side by side:

* the trainer's step: compute (forward + backward + optimizer), and the machinery around
  it: the rollout handoff (`rollouts/step_n` marked complete -> the trainer sees it), the
  batch read, the weight publish (`weights/step_n` written and marked); its share of the
  step (goal: all machinery <= 5%);
* the weight sync of a step: trainer starts writing `weights/step_n` -> every server
  answers with policy n (= publish + the relay's handoff + the update call), against a
  plain copy + fsync of the same bytes on the same filesystem (goal <= 2x);
* the two file handoffs (goal <= 0.1 s on a local filesystem).

From the repository root:

    .venv/bin/python benchmarks/overhead.py [--steps 40] [--workdir DIR]

A finished run in `--workdir` is read again instead of re-run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_trl import machine, project_versions, read_jsonl, submit_and_wait  # noqa: E402

SKIP_STEPS = 5  # start-up, compilation and the first generations are left out


def median(rows: list[dict], key: str) -> float:
    xs = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return statistics.median(xs) if xs else float("nan")


def copy_fsync_s(src: Path, repeats: int = 5, fsync: bool = True) -> tuple[float, int]:
    """Median seconds to copy `src`'s files into a fresh directory next to it and fsync
    them (and the directory; `fsync=False`: neither), and the bytes copied."""
    size = sum(f.stat().st_size for f in src.iterdir() if f.is_file())
    times = []
    for _ in range(repeats):
        dst = Path(tempfile.mkdtemp(prefix=".copy.", dir=src.parent))
        t0 = time.perf_counter()
        for f in src.iterdir():
            if f.is_file():
                shutil.copyfile(f, dst / f.name)
                if fsync:
                    fd = os.open(dst / f.name, os.O_RDONLY)
                    os.fsync(fd)
                    os.close(fd)
        if fsync:
            fd = os.open(dst, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        times.append(time.perf_counter() - t0)
        shutil.rmtree(dst)
    return statistics.median(times), size


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--workdir", type=Path, default=Path("outputs/bench-overhead"))
    ap.add_argument("overrides", nargs="*", help="more overrides for the run, e.g. inference.extra_args=[...]")
    a = ap.parse_args()
    run = a.workdir.resolve() / "rl"
    overrides = [
        "+experiment=reverse_text",
        "cluster=local",
        "warmup.experiment=null",
        "model.name=tiny",
        "name=bench_overhead",
        f"max_steps={a.steps}",
        "orchestrator.eval.interval=0",
        *a.overrides,
    ]
    print(f"[overhead] {' '.join(overrides)}", flush=True)
    submit_and_wait(run, overrides, "overhead", a.steps)
    trainer = [r for r in read_jsonl(run / "metrics" / "trainer.jsonl") if r.get("step", 0) > SKIP_STEPS]
    orch = [r for r in read_jsonl(run / "metrics" / "orchestrator.jsonl") if r.get("step", 0) > SKIP_STEPS]
    if not trainer or not orch:
        raise SystemExit(f"[overhead] {run} has no steps after the first {SKIP_STEPS}")

    step = median(trainer, "time/step")
    wait = median(trainer, "time/wait_for_batch")
    compute = median(trainer, "time/forward_backward")
    parts = {
        "rollout handoff": median(trainer, "time/rollout_handoff"),
        "batch read": median(trainer, "time/read_batch"),
        "weight publish": median(trainer, "time/save_weights"),
    }
    weight_handoff = median(orch, "time/weight_handoff")
    weight_update = median(orch, "time/weight_update")
    drain, load = median(orch, "time/weight_drain"), median(orch, "time/weight_load")
    machinery = sum(parts.values())
    final = max(int(p.name.split("_")[1]) for p in (run / "weights").glob("step_*"))
    copy_s, size = copy_fsync_s(run / "weights" / f"step_{final}")
    sync = parts["weight publish"] + weight_handoff + weight_update

    print()
    print(f"machine:   {machine()}")
    print(f"prime-hpc: {project_versions()}")
    print(f"run:       {run} ({len(trainer)} steps after the first {SKIP_STEPS}; medians)")
    print()
    print(f"{'trainer step':34} {step:8.3f} s")
    print(f"{'  compute (fwd+bwd+optimizer)':34} {compute:8.3f} s  {compute / step:6.1%}")
    print(f"{'  waiting for the batch':34} {wait:8.3f} s  {wait / step:6.1%}  (generation the trainer waits for)")
    for name, v in parts.items():
        print(f"{'  ' + name:34} {v:8.3f} s  {v / step:6.1%}")
    print(f"{'  machinery, all of the above':34} {machinery:8.3f} s  {machinery / step:6.1%}   goal <= 5%")
    print()
    print(
        f"{'weight sync (publish+handoff+load)':34} {sync:8.3f} s   = {parts['weight publish']:.3f} + "
        f"{weight_handoff:.3f} + {weight_update:.3f}"
    )
    print(
        f"{'  of the update: drain, load':34} {drain:8.3f} s, {load:.3f} s (the slowest server's wait for its "
        f"in-flight generations, then its load)"
    )
    print(f"{'plain copy + fsync, same bytes':34} {copy_s:8.3f} s   ({size / 1e6:.1f} MB)")
    print(f"{'ratio':34} {sync / copy_s:8.2f} x   goal <= 2x")
    print()
    print(f"{'handoff: rollouts -> trainer':34} {parts['rollout handoff']:8.3f} s   goal <= 0.1 s")
    print(f"{'handoff: weights -> relay':34} {weight_handoff:8.3f} s   goal <= 0.1 s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
