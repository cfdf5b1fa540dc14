"""vLLM start-up: one inference server of the run (`python -m prime_hpc.inference`) started
with an empty compile cache, then again with the cache the first start left, measured in
one run, from the process start to its endpoint record (what the orchestrator waits for).

    .venv/bin/python benchmarks/vllm_start.py [--starts 2] [--engine fork,spawn] [--experiment reverse_text]

Each start gets a fresh run directory; all starts share one fresh cache root
(`$PRIME_HPC_CACHE`, as the nodes of a run share `cluster.cache_dir`), so start 1 is cold
and the others warm; each way of starting the engine process (`--engine`) gets a cache
root of its own. The table gives each start's seconds, the engine's own
initialisation (vLLM's "init engine ... took" line) and the ratio to the cold start.
Extra `key=value` arguments are overrides of the composed run.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def launch_server(root: Path, overrides: list[str], extra_env: dict | None = None) -> tuple[subprocess.Popen, Path]:
    """One inference server of the run composed from `overrides` (node rank 0, its own
    session, a key of its own unless `extra_env` gives one), and its log; `extra_env` on
    top of this environment."""
    import secrets

    from prime_hpc.config.component import write_component_config
    from prime_hpc.config.compose import compose

    config = write_component_config(compose([f"output_dir={root}", *overrides]), "inference")
    logs = root / "logs"
    (logs / "inference").mkdir(parents=True, exist_ok=True)
    log = logs / "inference" / "node_0.log"
    env = {
        **os.environ,
        "PRIME_HPC_LOGS": str(logs),
        "PRIME_HPC_NODE_RANK": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "INFERENCE_SERVER_API_KEY": secrets.token_urlsafe(24),
        **(extra_env or {}),
    }
    with open(log, "ab") as f:
        p = subprocess.Popen(
            [sys.executable, "-u", "-m", "prime_hpc.inference", "--config", str(config)],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    return p, log


def start_once(
    root: Path, cache: Path, overrides: list[str], experiment: str, extra_env: dict | None = None
) -> tuple[float, float | None]:
    from prime_hpc.rundir import RunDir

    run = RunDir(root)
    t0 = time.monotonic()
    p, log = launch_server(
        root,
        [f"+experiment={experiment}", "warmup.experiment=null", *overrides],
        {"PRIME_HPC_CACHE": str(cache), **(extra_env or {})},
    )
    try:
        endpoint = run.inference_endpoint(0)
        while not endpoint.exists():
            if p.poll() is not None:
                raise SystemExit(f"the server exited with {p.returncode}; see {log}")
            if time.monotonic() - t0 > 900:
                raise SystemExit(f"the server did not start within 900 s; see {log}")
            time.sleep(0.05)
        seconds = time.monotonic() - t0
    finally:
        try:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(p.pid, signal.SIGKILL)
    m = re.search(r"init engine \(.*?\) took ([\d.]+) s", log.read_text(errors="replace"))
    return seconds, float(m.group(1)) if m else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--starts", type=int, default=2)
    ap.add_argument("--experiment", default="reverse_text")
    ap.add_argument(
        "--engine",
        default="fork,spawn",
        help="how the API server starts its engine process, each with a fresh cache: fork (the "
        "default of prime-hpc on CPU), spawn (vLLM's own)",
    )
    ap.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="keep each start's run directory (its logs) here instead of a temporary directory",
    )
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    rows = []
    for engine_start in a.engine.split(","):
        env = {"PRIME_HPC_VLLM_FORK": "1" if engine_start == "fork" else "0"}
        with tempfile.TemporaryDirectory(prefix="vllm-start-") as tmp:
            if a.workdir is not None:
                tmp = a.workdir.resolve() / engine_start
                shutil.rmtree(tmp, ignore_errors=True)
            cache = Path(tmp) / "cache"
            first = None
            for i in range(a.starts):
                s, engine = start_once(Path(tmp) / f"run{i}", cache, a.overrides, a.experiment, env)
                first = first or s
                rows.append((f"{engine_start}: start {i + 1} ({'cold' if i == 0 else 'warm'})", s, engine, s / first))
                print(f"{rows[-1][0]}: {s:.1f} s", flush=True)
    print(f"\n{'start':<26}{'s':>8}{'engine init s':>16}{'x cold':>9}")
    for name, s, engine, ratio in rows:
        print(f"{name:<26}{s:>8.1f}{(f'{engine:.1f}' if engine is not None else '-'):>16}{ratio:>9.2f}")
    print(f"(goal: a warm start at most 0.5x the cold one; {os.cpu_count()} cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
