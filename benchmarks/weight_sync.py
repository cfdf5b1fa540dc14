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

With `--transports ...,broadcast`, a second server per size started with
`weights.transport=broadcast`: the trainer's own sender (`prime_hpc.inference.broadcast.
Broadcaster`, the server's weight group joined once) sends each policy to it, against the
raw gloo broadcast of the same bytes between two processes on this host (goal <= 1.5x);
of it, the server's load (vLLM's layerwise reload of what it received). Every send carries
each tensor's SHA-256, which the server's worker checks as the tensors arrive: the digest
columns give the sender's share (the policy's digests, on its threads, inside the
broadcast's time, after the policy's one cast to the server's dtype) and the worker's (the same bytes hashed here as the worker hashes them,
`transfer.HASH_THREADS` threads, overlapping its receive and load).

Each server has the machine to itself (the sizes' runs in `sizes.py` measure the same in
a run, where the trainer's next step shares the cores): the sync's own cost. The servers
load in the model's own dtype (`inference.dtype=auto`: float32 for the small sizes,
bfloat16 for tiny-0.6b).

From the repository root:

    .venv/bin/python benchmarks/weight_sync.py [--sizes tiny,tiny-35m,tiny-150m] [--repeats 5] [--workdir DIR]
        [--transports filesystem,broadcast]
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
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import copy_fsync_s  # noqa: E402
from vllm_start import launch_server  # noqa: E402
from vs_trl import machine, project_versions  # noqa: E402

from prime_hpc.model.tiny import SIZES  # noqa: E402  (the offline builder's size ladder)

KEY = "bench-weight-sync"  # this benchmark's own servers, on loopback
LOOPBACK = "127.0.0.1"


def start_server(root: Path, model: Path, timeout_s: float, transport: str) -> tuple[subprocess.Popen, str]:
    from prime_hpc.inference.client import wait_for_servers
    from prime_hpc.rundir import RunDir

    proc, _ = launch_server(
        root,
        [
            "+experiment=reverse_text",
            f"model.name={model}",
            "inference.dtype=auto",
            "cluster.inference.nodes=1",
            f"weights.transport={transport}",
        ],
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


def trainer_model(model: Path) -> tuple[Any, Any]:
    """The model as the trainer holds it (float32) and its `Policy`, which saves it in the
    model's own dtype (`trainer.model.save_dtype=auto`)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from prime_hpc.trainer.model import Policy

    config = AutoConfig.from_pretrained(model)
    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    pol = Policy(
        model=net,
        tokenizer=AutoTokenizer.from_pretrained(model),
        source=str(model),
        hf_config=config,
        generation_config=GenerationConfig.from_pretrained(model),
        save_dtype=getattr(config, "dtype", None) or torch.float32,
        sharded=False,
    )
    return net, pol


def step_weights(net: Any) -> None:
    """New weights, as after an optimizer step."""
    import torch

    with torch.no_grad():
        for p in net.parameters():
            p.add_(1e-4)


def measure_broadcast(root: Path, model: Path, url: str, repeats: int) -> dict:
    """The trainer's sender to one server: join once (a file store in the run's private
    directory: one host), then `repeats` policies (after a warm-up one), each from the
    send, its digests included, to the server's answer that it serves it."""
    from sizes import raw_broadcast_s

    from prime_hpc.inference.broadcast import Broadcaster
    from prime_hpc.rundir import RunDir

    net, _ = trainer_model(model)
    sender = Broadcaster(url, host=LOOPBACK, key=KEY, store_dir=RunDir(root).rendezvous_dir)
    sender.join()
    seconds, loads, digests, checks = [], [], [], []
    nbytes = 0
    try:
        for n in range(1, repeats + 2):
            step_weights(net)
            named = [(k, v.detach()) for k, v in net.named_parameters()]
            t0 = time.perf_counter()
            served = sender.served(named)  # as the trainer's sender does: cast once, then digested
            ts = time.perf_counter()
            sums = sender.digests(served)
            td = time.perf_counter()
            reply = sender.send(n, served, digests=sums)
            t1 = time.perf_counter()
            if reply.get("policy_step") != n:
                raise SystemExit(f"[weight_sync] the server answered {reply} for step {n}")
            nbytes = int(reply["bytes"])
            if n > 1:
                seconds.append(t1 - t0)
                loads.append(float(reply.get("load_s", 0.0)))
                digests.append(td - ts)
                checks.append(worker_check_s(served))
    finally:
        sender.close()
    return {
        "broadcast": statistics.median(seconds),
        "broadcast load": statistics.median(loads),
        "broadcast bytes": nbytes,
        "raw broadcast": raw_broadcast_s(nbytes),
        "digest": statistics.median(digests),
        "check": statistics.median(checks),
    }


def worker_check_s(served: list) -> float:
    """The worker's share of the digests: the bytes it receives hashed as it hashes them
    (`transfer.DigestCheck`'s threads), in this process."""
    from concurrent.futures import ThreadPoolExecutor

    from prime_hpc.inference.broadcast import tensor_digest

    threads = min(4, os.cpu_count() or 1)  # transfer.HASH_THREADS (that module imports vLLM)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(tensor_digest, [t for _, t in served]))
    return time.perf_counter() - t0


def measure(root: Path, model: Path, url: str, repeats: int) -> dict:
    from prime_hpc.inference.client import Admin
    from prime_hpc.rundir import RunDir
    from prime_hpc.trainer.model import write_weights

    net, pol = trainer_model(model)
    run = RunDir(root)
    admin = Admin([url], key=KEY)
    publish, update, sync, copy, nosync, loads = [], [], [], [], [], []
    size = 0

    async def go() -> None:
        nonlocal size
        for n in range(1, repeats + 2):  # the first round warms both sides up and is left out
            step_weights(net)
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
                loads.append(float(answer.get("load_s", 0.0)))
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
        "load": statistics.median(loads),
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
    ap.add_argument("--transports", default="filesystem", help="comma-separated, of filesystem, broadcast")
    a = ap.parse_args()
    transports = [t.strip() for t in a.transports.split(",") if t.strip()]
    if set(transports) - {"filesystem", "broadcast"}:
        ap.error(f"unknown transport in {a.transports!r}: choose from filesystem, broadcast")
    sizes = [s.strip() for s in a.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        ap.error(f"unknown size {unknown[0]!r}: choose from {', '.join(SIZES)}")
    from prime_hpc.model.tiny import build_tiny_model

    work = a.workdir.resolve()
    results: dict[str, dict[str, Any]] = {}
    for name in sizes:
        model = build_tiny_model(work / "models" / name, **SIZES[name])
        r = results[name] = {}
        for transport in transports:
            root = work / f"{name}-{transport}"
            shutil.rmtree(root, ignore_errors=True)
            print(f"[weight_sync] {name}: starting a server for {model} ({transport})", flush=True)
            proc, url = start_server(root, model, a.startup_timeout_s, transport)
            try:
                r.update(measure(root, model, url, a.repeats) if transport == "filesystem" else {})
                r.update(measure_broadcast(root, model, url, a.repeats) if transport == "broadcast" else {})
            finally:
                stop(proc)
        if "sync" in r:
            print(f"[weight_sync] {name}: sync {r['sync']:.3f} s, copy {r['copy']:.3f} s", flush=True)
        if "broadcast" in r:
            print(f"[weight_sync] {name}: broadcast {r['broadcast']:.3f} s, raw {r['raw broadcast']:.3f} s", flush=True)

    print()
    print(f"machine:   {machine()}")
    print(f"prime-hpc: {project_versions()}")
    print(f"medians of {a.repeats} steps after a warm-up step; filesystem of {work}")
    print()
    if "filesystem" in transports:
        print(
            f"{'model':>9} {'params':>8} {'MB':>7} {'publish s':>10} {'update s':>9} {'load s':>7} {'sync s':>8} "
            f"{'copy+fsync s':>13} {'sync/copy':>10} {'copy s':>7} {'sync/copy':>10}"
        )
        for name, r in results.items():
            print(
                f"{name:>9} {r['params'] / 1e6:7.1f}M {r['bytes'] / 1e6:7.1f} {r['publish']:10.3f} "
                f"{r['update']:9.3f} {r['load']:7.3f} {r['sync']:8.3f} {r['copy']:13.3f} "
                f"{r['sync'] / r['copy']:9.1f}x {r['nosync']:7.3f} {r['sync'] / r['nosync']:9.1f}x"
            )
        print("goal: sync / (copy+fsync) <= 2x; the last two columns: a copy without fsync")
    if "broadcast" in transports:
        print()
        print(
            f"{'model':>9} {'MB sent':>8} {'broadcast s':>12} {'load s':>7} {'raw gloo s':>11} {'ratio':>7} "
            f"{'digest s':>9} {'check s':>8} {'digests/broadcast':>18}"
        )
        for name, r in results.items():
            print(
                f"{name:>9} {r['broadcast bytes'] / 1e6:8.1f} {r['broadcast']:12.3f} {r['broadcast load']:7.3f} "
                f"{r['raw broadcast']:11.3f} {r['broadcast'] / r['raw broadcast']:6.1f}x {r['digest']:9.3f} "
                f"{r['check']:8.3f} {(r['digest'] + r['check']) / r['broadcast']:17.2f}x"
            )
        print("goal: broadcast / raw gloo broadcast of the same bytes <= 1.5x")
        print(
            "digest: the sender's SHA-256 of the policy as sent (inside the broadcast's time); check: the "
            "worker's of the same bytes, overlapping its receive and load"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
