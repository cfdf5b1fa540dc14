"""From `prime-hpc submit` to the first trainer step on the dev cluster, vLLM's start shown
apart, with an empty inference compile cache and then with the cache the first run left.

    tools/dev-cluster start
    .venv/bin/python benchmarks/first_step.py [--workdir DIR]

Each run is the reverse_text RL recipe without its warm-up (the offline tiny model, 3
steps). Figures, from the run directory (job.json, the server's endpoint record, the
router's, the trainer's first metrics row):

* queue + launch: submitted -> the job's attempt started (sbatch, scheduling, the job
  script's start);
* vLLM start: the inference server process started -> healthy (imports, model load,
  compile or the compile cache, KV cache);
* router: the server healthy -> the router published;
* first step: submitted -> the trainer's first step logged (everything, incl. the first
  generation and the trainer's own start, which overlap vLLM's).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_trl import REPO, machine, prime_hpc, project_versions  # noqa: E402


def read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def one_run(run: Path, cache: Path) -> dict:
    import os

    os.environ["PRIME_HPC_CACHE"] = str(cache)
    overrides = [
        "+experiment=reverse_text",
        "cluster=dev",
        "warmup.experiment=null",
        "model.name=tiny",
        "name=bench_first_step",
        "max_steps=3",
        "orchestrator.eval.interval=0",
        f"output_dir={run}",
    ]
    r = prime_hpc("submit", *overrides)
    if r.returncode:
        raise SystemExit(f"submit failed:\n{r.stderr}")
    server = router = first = None
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and first is None:
        server = server if server and server.get("healthy_at") else read(run / "endpoints" / "inference_0.json")
        router = router or read(run / "endpoints" / "router.json")
        rows = run / "metrics" / "trainer.jsonl"
        if rows.exists() and rows.read_text().strip():
            first = json.loads(rows.read_text().splitlines()[0])
        job = read(run / "job.json") or {}
        if job.get("ended_at") and first is None:
            raise SystemExit(f"the run ended {job.get('state')} before its first step: {job.get('failure')}")
        time.sleep(0.2)
    if first is None or not server or not router:
        raise SystemExit(f"no first step within 900 s in {run}")
    job = read(run / "job.json")
    while not (job or {}).get("ended_at") and time.monotonic() < deadline:  # let it finish: 3 steps
        time.sleep(1)
        job = read(run / "job.json")
    submitted, started = job["submitted_at"], job["attempts"][0]["started_at"]
    return {
        "queue + launch": started - submitted,
        "vLLM start": server["healthy_at"] - server["process_started_at"],
        "router": router["started_at"] - server["healthy_at"],
        "first step": first["time"] - submitted,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=REPO / "outputs" / "bench-first-step")
    a = ap.parse_args()
    work = a.workdir.resolve()
    shutil.rmtree(work, ignore_errors=True)
    cache = work / "cache"  # empty: the first run compiles, the second finds its cache
    results = {"cold cache": one_run(work / "cold", cache), "warm cache": one_run(work / "warm", cache)}
    print()
    print(f"machine:   {machine()} (dev cluster: every node is this machine)")
    print(f"prime-hpc: {project_versions()}")
    print()
    print(f"{'':14}" + "".join(f"{k:>16}" for k in next(iter(results.values()))))
    for name, r in results.items():
        print(f"{name:14}" + "".join(f"{v:15.1f}s" for v in r.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
