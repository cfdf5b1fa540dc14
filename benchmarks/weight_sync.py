"""The weight sync of one RL step, by model size, next to a plain copy of the same bytes.

For each size, one of the run's real inference servers (`python -m prime_hpc.inference`,
the run's config, loopback) serves a model of that size built offline; then, `--repeats`
times, the trainer's own code writes `weights/step_n` from the full state dict (staging
dir, safetensors, `STABLE` last) and the orchestrator's own client asks every server to
load it (`/update_weights`: drain, vLLM's reload, policy n). Side by side:

* publish: the trainer starts writing -> `weights/step_n` is marked complete;
* update: the update call -> the server answers with policy n (drain + load);
* sync = publish + update (the relay's file handoff, a poll of <= 0.02 s, is measured by
  `overhead.py` inside a real run and left out here);
* a plain copy + fsync of the same files into the same filesystem (goal: sync <= 2x),
  and the same copy without fsync (the publish fsyncs its directories, not the file data:
  NFS's close-to-open makes the data visible to other nodes; weights lost in a crash are
  written again from the checkpoint).

From the repository root:

    .venv/bin/python benchmarks/weight_sync.py [--sizes tiny,tiny-35m,tiny-150m] [--repeats 5] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import copy_fsync_s  # noqa: E402
from vllm_start import launch_server  # noqa: E402
from vs_trl import machine, project_versions  # noqa: E402

from prime_hpc.model.tiny import SIZES  # noqa: E402  (the offline builder's size ladder)

KEY = "bench-weight-sync"  # this benchmark's own servers, on loopback


def start_server(root: Path, model: Path, timeout_s: float) -> tuple[subprocess.Popen, str]:
    from prime_hpc.inference.client import wait_for_servers
    from prime_hpc.rundir import RunDir

    proc, _ = launch_server(
        root,
        ["+experiment=reverse_text", f"model.name={model}", "inference.dtype=float32", "cluster.inference.nodes=1"],
        {"INFERENCE_SERVER_API_KEY": KEY},
    )
    logs = root / "logs"
    try:
        records = wait_for_servers(RunDir(root), 1, timeout_s, logs, alive=lambda: proc.poll() is None)
    except BaseException:
        stop(proc)
        raise
    return proc, records[0]["url"]


def stop(proc: subprocess.Popen) -> None:
    """The server and what it started (its session): only this benchmark's processes."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def measure(root: Path, model: Path, url: str, repeats: int) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from prime_hpc.inference.client import Admin
    from prime_hpc.rundir import RunDir
    from prime_hpc.trainer.model import Policy, write_weights

    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    pol = Policy(
        model=net,
        tokenizer=AutoTokenizer.from_pretrained(model),
        source=str(model),
        hf_config=AutoConfig.from_pretrained(model),
        generation_config=GenerationConfig.from_pretrained(model),
        save_dtype=torch.float32,
        sharded=False,
    )
    run = RunDir(root)
    admin = Admin([url], key=KEY)
    publish, update, sync, copy, nosync = [], [], [], [], []
    size = 0

    async def go() -> None:
        nonlocal size
        for n in range(1, repeats + 2):  # the first round warms both sides up and is left out
            with torch.no_grad():
                for p in net.parameters():
                    p.add_(1e-4)  # new weights each step, as after an optimizer step
            sd = net.state_dict()
            t0 = time.perf_counter()
            final = write_weights(run, n, pol, sd)
            t1 = time.perf_counter()
            [answer] = await admin.update_weights(final, n)
            t2 = time.perf_counter()
            if answer.get("policy_step") != n:
                raise SystemExit(f"[weight_sync] the server answered {answer} for step {n}")
            c, size = copy_fsync_s(final, repeats=1)
            c_nosync, _ = copy_fsync_s(final, repeats=1, fsync=False)
            if n > 1:
                publish.append(t1 - t0)
                update.append(t2 - t1)
                sync.append(t2 - t0)
                copy.append(c)
                nosync.append(c_nosync)
            shutil.rmtree(final)
        await admin.aclose()

    asyncio.run(go())
    params = sum(p.numel() for p in net.parameters())
    return {
        "params": params,
        "bytes": size,
        "publish": statistics.median(publish),
        "update": statistics.median(update),
        "sync": statistics.median(sync),
        "copy": statistics.median(copy),
        "nosync": statistics.median(nosync),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="tiny,tiny-35m,tiny-150m", help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--workdir", type=Path, default=Path("outputs/bench-weight-sync"))
    ap.add_argument("--startup-timeout-s", type=float, default=900)
    a = ap.parse_args()
    sizes = [s.strip() for s in a.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        ap.error(f"unknown size {unknown[0]!r}: choose from {', '.join(SIZES)}")
    from prime_hpc.model.tiny import build_tiny_model

    work = a.workdir.resolve()
    results = {}
    for name in sizes:
        root = work / name
        shutil.rmtree(root, ignore_errors=True)
        model = build_tiny_model(work / "models" / name, **SIZES[name])
        print(f"[weight_sync] {name}: starting a server for {model}", flush=True)
        proc, url = start_server(root, model, a.startup_timeout_s)
        try:
            results[name] = measure(root, model, url, a.repeats)
        finally:
            stop(proc)
        r = results[name]
        print(f"[weight_sync] {name}: sync {r['sync']:.3f} s, copy {r['copy']:.3f} s", flush=True)

    print()
    print(f"machine:   {machine()}")
    print(f"prime-hpc: {project_versions()}")
    print(f"medians of {a.repeats} steps after a warm-up step; filesystem of {work}")
    print()
    print(
        f"{'model':>6} {'params':>8} {'MB':>7} {'publish s':>10} {'update s':>9} {'sync s':>8} "
        f"{'copy+fsync s':>13} {'sync/copy':>10} {'copy s':>7} {'sync/copy':>10}"
    )
    for name, r in results.items():
        print(
            f"{name:>6} {r['params'] / 1e6:7.1f}M {r['bytes'] / 1e6:7.1f} {r['publish']:10.3f} {r['update']:9.3f} "
            f"{r['sync']:8.3f} {r['copy']:13.3f} {r['sync'] / r['copy']:9.1f}x {r['nosync']:7.3f} "
            f"{r['sync'] / r['nosync']:9.1f}x"
        )
    print("goal: sync / (copy+fsync) <= 2x; the last two columns: a copy without fsync")
    return 0


if __name__ == "__main__":
    sys.exit(main())
