"""What grows with the model, by size, each next to its anchor, in one run of this script.

For each model of the offline builder's size ladder (`prime_hpc.model.tiny.SIZES`: tiny,
tiny-35m, tiny-150m, tiny-0.6b), a short real local RL run of the reverse_text recipe
(checkpoints every `--ckpt-every` steps), then `prime-hpc resume` of it for one more step.
From the runs' own metrics (medians of the steps after the first) and a sampler of every
component's memory:

* the trainer's step;
* the weight sync by the filesystem: the trainer's publish (`weights/step_n` written and
  marked) + the servers' update call, against a plain copy + fsync of the same bytes on
  the same filesystem (goal <= 2x), and of the update, the servers' load;
* the weight sync by broadcast (a second run of the size with `weights.transport=broadcast`):
  the trainer's send of a policy to every server (`time/weight_broadcast`: from its
  publish to the last server serving it) against the raw gloo broadcast of the same bytes
  between two processes on this host (goal <= 1.5x), and the trainer's own share of it
  (`time/save_weights`: the gather and the marker, what the step waits for);
* checkpoint save (`time/save_ckpt`) and load (`time/load_ckpt`, the resumed step), against
  writing (with fsync) and reading the same bytes (goal: save <= 2x);
* the peak resident memory of each component (the process and everything it started:
  the trainer's ranks and torchrun's agent, vLLM's engine) against the weights' size
  (goal: no component holds more than two copies of the weights, optimizer state aside:
  the trainer's AdamW keeps two more).

From the repository root:

    .venv/bin/python benchmarks/sizes.py [--sizes tiny,tiny-35m,tiny-150m,tiny-0.6b] [--steps 4] [--workdir DIR]
        [--transports filesystem,broadcast]

A finished run in `--workdir` is read again instead of re-run (delete it to measure anew).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import copy_fsync_s, median  # noqa: E402
from vs_trl import job_state, machine, prime_hpc, project_versions, read_jsonl, submit_and_wait  # noqa: E402

from prime_hpc.core.net import LOOPBACK, free_port  # noqa: E402

DEFAULT_SIZES = "tiny,tiny-35m,tiny-150m,tiny-0.6b"
COMPONENTS = ("trainer", "orchestrator", "inference")


# ----------------------------------------------------------------------------- memory
def _proc_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, resident bytes) of every process readable now."""
    out = {}
    page = os.sysconf("SC_PAGE_SIZE")
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/statm") as f:
                rss = int(f.read().split()[1]) * page
        except (OSError, ValueError, IndexError):
            continue
        out[int(d)] = (parent, rss)
    return out


def _tree_rss(root: int, table: dict[int, tuple[int, int]]) -> int:
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        if pid in table:
            total += table[pid][1]
            todo += children.get(pid, [])
    return total


class MemorySampler:
    """Every `every_s`, the resident memory of each component's process tree (found by the
    pids in the run's heartbeats; the trainer's from torchrun's agent, the parent of rank
    0); keeps each component's largest."""

    def __init__(self, run: Path, every_s: float = 0.5) -> None:
        self.run, self.every_s = run, every_s
        self.peak = {c: 0 for c in COMPONENTS}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _roots(self, table: dict[int, tuple[int, int]]) -> dict[str, int]:
        import json

        roots = {}
        for c in COMPONENTS:
            beats = sorted((self.run / "heartbeats").glob(f"{c}_*"))
            if not beats:
                continue
            try:
                pid = int(json.loads(beats[0].read_text())["pid"])
            except (OSError, ValueError, KeyError):
                continue
            if c == "trainer" and pid in table:
                pid = table[pid][0]  # torchrun's agent: every rank below it
            roots[c] = pid
        return roots

    def _loop(self) -> None:
        while not self._stop.is_set():
            table = _proc_table()
            for c, pid in self._roots(table).items():
                self.peak[c] = max(self.peak[c], _tree_rss(pid, table))
            self._stop.wait(self.every_s)

    def __enter__(self) -> "MemorySampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# ----------------------------------------------------------------------------- anchors
def _broadcast_rank(rank: int, port: int, nbytes: int, repeats: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    t = torch.empty(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        dist.broadcast(t, 0)
        times.append(time.perf_counter() - t0)
    dist.destroy_process_group()
    if rank == 1:
        out.put(statistics.median(times[1:]))


def raw_broadcast_s(nbytes: int, repeats: int = 3) -> float:
    """Median seconds of a gloo broadcast of `nbytes` from one process to another on this
    host (loopback TCP), after a warm-up one."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port(LOOPBACK)
    procs = [ctx.Process(target=_broadcast_rank, args=(r, port, nbytes, repeats, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    result = out.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    return float(result)


def write_read_s(nbytes: int, where: Path) -> tuple[float, float]:
    """Seconds to write `nbytes` to a file in `where` and fsync it, then to read it back."""
    block = os.urandom(1 << 20)
    fd, path = tempfile.mkstemp(dir=where, prefix=".raw.")
    try:
        t0 = time.perf_counter()
        left = nbytes
        while left > 0:
            left -= os.write(fd, block[: min(left, len(block))])
        os.fsync(fd)
        os.close(fd)
        write = time.perf_counter() - t0
        t0 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while f.read(1 << 24):
                pass
        return write, time.perf_counter() - t0
    finally:
        os.unlink(path)


def dir_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())


# ----------------------------------------------------------------------------- one size
def _overrides(size: str, steps: int, ckpt_every: int) -> list[str]:
    return [
        "+experiment=reverse_text",
        "cluster=local",
        "warmup.experiment=null",
        f"model.name={size}",
        f"name=bench_{size.replace('-', '_').replace('.', '_')}",
        f"max_steps={steps}",
        f"ckpt.interval={ckpt_every}",
        "ckpt.keep_last=1",  # what is measured again needs the last (a 0.6B checkpoint is 8.4 GiB)
        "orchestrator.batch_size=16",
        "orchestrator.group_size=8",
        "trainer.micro_batch_size=4",
        "orchestrator.eval.interval=0",
        "orchestrator.eval.at_start=false",
        "inference.dtype=auto",  # the model's own (float32 for the small ones, bfloat16 for 0.6b)
        "inference.cpu_kvcache_space_gb=2",
    ]


def measure_broadcast(size: str, workdir: Path, steps: int) -> dict[str, float]:
    """The same run with `weights.transport=broadcast` (weights on disk only at its end)."""
    run = workdir / f"{size}-broadcast"
    overrides = [*_overrides(size, steps, steps), "weights.transport=broadcast"]
    print(f"[sizes] {size} by broadcast: {' '.join(overrides)}", flush=True)
    submit_and_wait(run, overrides, f"{size} broadcast", steps)
    trainer = [r for r in read_jsonl(run / "metrics" / "trainer.jsonl") if "loss/mean" in r]
    sent = [r for r in trainer if r.get("weights/broadcast_servers")]  # a send that reached the servers
    return {
        "broadcast s": median(sent, "time/weight_broadcast"),
        "broadcast load s": median(sent, "time/weight_broadcast_load"),
        "broadcast publish s": median([r for r in trainer if r["step"] > 1], "time/save_weights"),
    }


def measure(size: str, workdir: Path, steps: int, ckpt_every: int) -> dict[str, float]:
    run = workdir / size
    overrides = _overrides(size, steps, ckpt_every)
    print(f"[sizes] {size}: {' '.join(overrides)}", flush=True)
    with MemorySampler(run) as memory:
        submit_and_wait(run, overrides, size, steps)
    trainer = [r for r in read_jsonl(run / "metrics" / "trainer.jsonl") if "loss/mean" in r]
    if not any("time/load_ckpt" in r for r in trainer):  # one more step, from the last checkpoint
        r = prime_hpc("resume", str(run), f"max_steps={steps + 1}", timeout=600)
        print(r.stdout.rstrip(), flush=True)
        if r.returncode:
            raise SystemExit(f"[sizes] resume of {run} failed:\n{r.stderr}")
        from prime_hpc.rundir.jobs import FINAL_STATES

        deadline = time.monotonic() + 3600
        while time.monotonic() < deadline:
            trainer = [r for r in read_jsonl(run / "metrics" / "trainer.jsonl") if "loss/mean" in r]
            if any("time/load_ckpt" in r for r in trainer) and job_state(run) in FINAL_STATES:
                break
            time.sleep(2)
        else:
            raise SystemExit(f"[sizes] the resumed run {run} did not end within an hour")
    orch = [r for r in read_jsonl(run / "metrics" / "orchestrator.jsonl") if "reward/all/mean" in r]
    later = [r for r in trainer if r["step"] > 1]
    updated = [r for r in orch if r.get("time/weight_update")]  # the steps written after an update
    weights = max((run / "weights").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    nbytes = dir_bytes(weights)
    ckpt = max((run / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1])) / "trainer"
    ckpt_bytes = dir_bytes(ckpt)
    copy, _ = copy_fsync_s(weights, repeats=3)
    write, read = write_read_s(ckpt_bytes, run)
    from prime_hpc.model.tiny import num_parameters

    out = {
        "parameters": float(num_parameters(size)),
        "weights bytes": float(nbytes),
        "trainer step s": median(later, "time/step"),
        "publish s": median(later, "time/save_weights"),
        "update call s": median(updated, "time/weight_update"),
        "server load s": median(updated, "time/weight_load"),
        "copy + fsync s": copy,
        "gloo broadcast s": raw_broadcast_s(nbytes),
        "checkpoint bytes": float(ckpt_bytes),
        "ckpt save s": median(
            [r for r in trainer if "time/save_ckpt" in r and r["time/save_ckpt"] > 0], "time/save_ckpt"
        ),
        "write + fsync s": write,
        "ckpt load s": median(trainer, "time/load_ckpt"),
        "read s": read,
    }
    for c in COMPONENTS:
        out[f"peak RSS {c} bytes"] = float(memory.peak[c])
    return out


# ----------------------------------------------------------------------------- report
def report(results: dict[str, dict[str, float]], steps: int) -> None:
    gib = 2**30
    print()
    print(f"machine:   {machine()}")
    print(f"prime-hpc: {project_versions()}")
    print(f"runs:      {steps} steps each (+1 resumed); medians of the steps after the first")
    cols = list(results)
    print()
    print(f"{'':40}" + "".join(f"{c:>14}" for c in cols))

    def row(name: str, f) -> None:
        cells = []
        for c in cols:
            try:
                cells.append(f(results[c]))
            except (KeyError, ZeroDivisionError, ValueError):
                cells.append("-")
        print(f"{name:40}" + "".join(f"{x:>14}" for x in cells))

    row("parameters (M)", lambda r: f"{r['parameters'] / 1e6:.1f}")
    row("weights (MiB)", lambda r: f"{r['weights bytes'] / 2**20:.0f}")
    row("trainer step (s)", lambda r: f"{r['trainer step s']:.2f}")
    row("fs sync: publish + update call (s)", lambda r: f"{r['publish s'] + r['update call s']:.3f}")
    row("  of the update, the servers' load (s)", lambda r: f"{r['server load s']:.3f}")
    row("  copy + fsync, same bytes (s)", lambda r: f"{r['copy + fsync s']:.3f}")
    row("  ratio (goal <= 2x)", lambda r: f"{(r['publish s'] + r['update call s']) / r['copy + fsync s']:.2f}x")
    row("broadcast: publish -> every server (s)", lambda r: f"{r['broadcast s']:.3f}")
    row("  of it, the servers' load (s)", lambda r: f"{r['broadcast load s']:.3f}")
    row("  raw gloo broadcast, same bytes (s)", lambda r: f"{r['gloo broadcast s']:.3f}")
    row("  ratio (goal <= 1.5x)", lambda r: f"{r['broadcast s'] / r['gloo broadcast s']:.2f}x")
    row("  the trainer's share: gather + marker (s)", lambda r: f"{r['broadcast publish s']:.3f}")
    row("broadcast vs fs sync", lambda r: f"{r['broadcast s'] / (r['publish s'] + r['update call s']):.2f}x")
    row("checkpoint (MiB)", lambda r: f"{r['checkpoint bytes'] / 2**20:.0f}")
    row("ckpt save (s)", lambda r: f"{r['ckpt save s']:.3f}")
    row("  write + fsync, same bytes (s)", lambda r: f"{r['write + fsync s']:.3f}")
    row("  ratio (goal <= 2x)", lambda r: f"{r['ckpt save s'] / r['write + fsync s']:.2f}x")
    row("ckpt load (s)", lambda r: f"{r['ckpt load s']:.3f}")
    row("  read, same bytes (s)", lambda r: f"{r['read s']:.3f}")
    for c in COMPONENTS:
        row(f"peak RSS {c} (GiB)", lambda r, c=c: f"{r[f'peak RSS {c} bytes'] / gib:.2f}")
        row("  in copies of the weights", lambda r, c=c: f"{r[f'peak RSS {c} bytes'] / r['weights bytes']:.1f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=DEFAULT_SIZES)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--ckpt-every", type=int, default=2)
    ap.add_argument("--workdir", type=Path, default=Path("outputs/bench-sizes"))
    ap.add_argument("--transports", default="filesystem,broadcast", help="weights.transport(s) to run each size with")
    a = ap.parse_args()
    transports = set(a.transports.split(","))
    if not transports or transports - {"filesystem", "broadcast"}:
        ap.error("--transports: filesystem, broadcast or both (comma-separated)")
    if a.steps < 4:  # at async_level 2 the first steps' rollouts need no update: nothing to measure
        ap.error("--steps must be at least 4 (the servers' first weight update comes at step 3 or later)")
    workdir = a.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    results = {}
    for size in a.sizes.split(","):
        results[size] = measure(size, workdir, a.steps, a.ckpt_every) if "filesystem" in transports else {}
        if "broadcast" in transports:
            results[size].update(measure_broadcast(size, workdir, a.steps))
        report(results, a.steps)  # so far: a long ladder shows its first rungs early
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
