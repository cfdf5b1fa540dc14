"""Bench runs (`prime-hpc submit ... --bench [all|trainer|inference]`): the run's own config
and placement for `bench.warmup_steps + bench.steps` steps on synthetic data, measuring
the real code paths.

- trainer: the RL (or SFT) trainer's real step (`Engine.train_step`, FSDP, micro-batches)
  on fake batches of the configured shape (`prime_hpc.trainer.bench`);
- inference: fixed prompts sent through the router by the orchestrator's own client
  (`prime_hpc.orchestrator.bench`), no environment loaded.

Who writes what: each benched component writes its part, `bench/<part>.json` (trainer:
rank 0; inference: the orchestrator); the last one to finish (the orchestrator when both
are benched, after waiting for the trainer's part) merges them into `bench.json`:

    {"mode": "all", "name": ..., "device": "cpu", "steps": 5, "warmup_steps": 1,
     "trainer": PART, "inference": PART}

PART: `step_times_s` (the measured steps), `step_time_s` (their median),
`tokens_per_step` and `samples_per_step` (means over the measured steps),
`tokens_per_s` = tokens_per_step / step_time_s, `samples_per_s` likewise, `params`,
`flops_per_token`, `devices`, `device_name`, `peak_flops_per_device` (null when unknown),
`mfu` (null when the peak is unknown), and `shape` (what a step was made of).

Light to import (no torch): the CLI reads results with it.
"""

from __future__ import annotations

import json
import statistics
import struct
from pathlib import Path
from typing import Optional, Sequence

from prime_hpc.core import device as devices
from prime_hpc.core.text import columns
from prime_hpc.rundir import RunDir, atomic_write_json, read_json

PARTS = ("trainer", "inference")


def parts_of(mode: str) -> tuple[str, ...]:
    """The components a bench of `mode` measures."""
    return PARTS if mode == "all" else (mode,)


def completion_len(configured: Optional[int], seq_len: int) -> int:
    """Tokens of a fake completion: `bench.completion_len` (the run's sampling.max_tokens),
    or half of seq_len when unset; at least 1 and at most seq_len - 1 (a prompt token)."""
    n = int(configured) if configured else seq_len // 2
    return max(1, min(n, seq_len - 1))


def summarize(
    step_times_s: Sequence[float],
    tokens: Sequence[float],
    samples: Sequence[float],
    flops_per_token: float,
    params: int,
    devices_used: int,
    device_name: str,
    peak_flops_per_device: Optional[float],
    flops_tokens: Optional[Sequence[float]] = None,
    shape: Optional[dict] = None,
) -> dict:
    """One part's figures from its measured steps (`tokens`, `samples`: per step).
    `flops_tokens`: tokens per step that cost `flops_per_token` each, when they differ from
    the throughput's tokens (inference: prompts are computed too, once per group)."""
    if not step_times_s:
        raise ValueError("no measured steps")
    step = statistics.median(step_times_s)
    tok, smp = statistics.fmean(tokens), statistics.fmean(samples)
    computed = statistics.fmean(flops_tokens) if flops_tokens is not None else tok
    util = devices.mfu(computed / step / max(devices_used, 1), flops_per_token, peak_flops_per_device)
    return {
        "step_times_s": [round(t, 6) for t in step_times_s],
        "step_time_s": step,
        "tokens_per_step": tok,
        "samples_per_step": smp,
        "tokens_per_s": tok / step,
        "samples_per_s": smp / step,
        "params": int(params),
        "flops_per_token": flops_per_token,
        "devices": int(devices_used),
        "device_name": device_name,
        "peak_flops_per_device": peak_flops_per_device,
        "mfu": util,
        "shape": dict(shape or {}),
    }


def write_part(run: RunDir, part: str, result: dict) -> Path:
    path = run.bench_part(part)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_json(path, result)


def read_part(run: RunDir, part: str) -> Optional[dict]:
    try:
        return read_json(run.bench_part(part))
    except (OSError, ValueError):
        return None


def merge(run: RunDir, header: dict) -> dict:
    """`bench.json`: `header` (mode, name, device, steps) plus every part written so far."""
    out = dict(header)
    for part in parts_of(header["mode"]):
        got = read_part(run, part)
        if got is not None:
            out[part] = got
    atomic_write_json(run.bench_json, out)
    return out


def header(mode: str, name: str, device: str, steps: int, warmup_steps: int) -> dict:
    return {"mode": mode, "name": name, "device": device, "steps": int(steps), "warmup_steps": int(warmup_steps)}


def _num(x: float) -> str:
    if float(x).is_integer():
        return f"{x:,.0f}"
    return f"{x:,.0f}" if x >= 100 else f"{x:,.1f}" if x >= 10 else f"{x:.2f}"


def mfu_text(part: dict) -> str:
    if part.get("mfu") is None:
        return f"peak unknown ({part.get('device_name') or 'device'})"
    return f"{100 * part['mfu']:.1f}%"


def table(results: dict) -> str:
    """The one-screen summary of `bench.json`."""
    lines = [
        f"bench {results.get('name')} ({results.get('device')}): {results.get('steps')} measured step(s) "
        f"after {results.get('warmup_steps')} warm-up"
    ]
    rows = [("part", "step time (median)", "tokens/s", "samples/s", "MFU")]
    notes = []
    for part in PARTS:
        r = results.get(part)
        if r is None:
            if part in parts_of(results.get("mode", "all")):
                rows.append((part, "no result", "-", "-", "-"))
            continue
        rows.append((part, f"{r['step_time_s']:.3f} s", _num(r["tokens_per_s"]), _num(r["samples_per_s"]), mfu_text(r)))
        shape = ", ".join(f"{k} {v}" for k, v in r.get("shape", {}).items())
        notes.append(
            f"{part}: {_num(r['tokens_per_step'])} tokens and {_num(r['samples_per_step'])} samples per step "
            f"on {r['devices']} device(s), {r['params'] / 1e6:.2f}M parameters; {shape}"
        )
    lines += columns(rows, indent="  ")
    lines += notes
    return "\n".join(lines)


def safetensors_params(model_dir: str | Path) -> Optional[int]:
    """Parameters stored in a model directory's `*.safetensors` (read from the files'
    headers, no tensor loaded); None when there are none."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for path in files:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            head = json.loads(f.read(n))
        for key, meta in head.items():
            if key != "__metadata__":
                count = 1
                for d in meta["shape"]:
                    count *= int(d)
                total += count
    return total
