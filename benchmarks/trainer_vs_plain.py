"""The trainer's RL step against a plain PyTorch loop of the same model, batch and length
distribution, side by side in one run.

* trainer: `python -m prime_hpc.trainer.bench` (the bench path of `prime-hpc submit ...
  --bench trainer`: the real session, `Engine.train_step` with the run's loss, packed
  micro-batches of `micro_batch_size x seq_len` tokens at most, one rank) on a trainer
  config built from the schema's defaults (`TrainerRunConfig`, no Hydra) with this script's
  shape and `--set KEY=VALUE`; one run more per `--variant NAME:KEY=VALUE,...`;
* plain: what a user's own loop would do with the same weights: the HF model
  (`AutoModelForCausalLM`, sdpa, float32 weights) under bfloat16 autocast on CUDA (on CPU
  in the trainer's compute dtype), AdamW (fused on CUDA), gradient clipping; each step's
  samples are the trainer's (`prime_hpc.trainer.bench.rl_samples`, the same seeds) in the
  order drawn, `--micro-batch-size` at a time, each micro-batch right-padded to its longest
  sample; the completion tokens' log-probabilities from their full logits (the output
  layer at those positions only), and a policy-gradient loss weighted by the importance
  ratio;
* matmul: the device's own rate for an n x n x n matrix product in that compute dtype
  (`--matmul-n`: 8192 on CUDA, 2048 on CPU), the ceiling the MFU is also given against.

Each part runs in a process of its own, one after the other. Per part: tokens/s (a step's
real tokens over its time, the median of `--steps` after `--warmup-steps`), the ratio to
the plain loop, the first step's time (and the part of it spent compiling, as the trainer
reports it), peak memory (CUDA's max_memory_allocated, on CPU the process's peak resident
set, VmHWM; reset after every step, the largest of the measured steps), the padding share
(positions computed that hold no token), and the MFU (6 x parameters per token) against
the spec's peak (`prime_hpc.core.device`, CUDA only) and against the measured matmul rate.

Needs only torch, transformers, safetensors, loguru, omegaconf (with antlr4-python3-runtime)
and PyYAML: no Hydra, vLLM or verifiers. From the repository root:

    .venv/bin/python benchmarks/trainer_vs_plain.py [--model tiny-35m] [--device cpu]
        [--samples 16] [--seq-len 512] [--completion-len 384] [--micro-batch-size 4]
        [--steps 4] [--warmup-steps 1] [--set trainer.KEY=VALUE ...]
        [--variant NAME:KEY=VALUE,KEY=VALUE ...] [--json OUT.json] [--workdir DIR]

The GPU command (one H200, the Qwen3-0.6B shape) is in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

PLAIN = "plain"
TRAINER = "trainer"


# ----------------------------------------------------------------------------- pure helpers
def parse_variant(text: str) -> tuple[str, list[str]]:
    """`NAME:KEY=VALUE,KEY=VALUE` -> (NAME, [KEY=VALUE, ...])."""
    name, sep, rest = text.partition(":")
    sets = [s.strip() for s in rest.split(",") if s.strip()]
    if not sep or not name.strip() or not sets or any("=" not in s for s in sets):
        raise ValueError(f"--variant {text!r}: expected NAME:KEY=VALUE[,KEY=VALUE...]")
    if name.strip() in (PLAIN, TRAINER):
        raise ValueError(f"--variant {text!r}: {name.strip()!r} names a part already; choose another name")
    return name.strip(), sets


def right_padded(samples: list, micro_batch_size: int) -> list[dict]:
    """A plain loop's micro-batches: `samples` (`rundir.batch.Sample`) in the order given (as
    drawn, not sorted by length), `micro_batch_size` at a time, each right-padded to its
    longest (`rundir.batch.collate`)."""
    from prime_hpc.rundir.batch import collate

    return [collate(samples[i : i + micro_batch_size]) for i in range(0, len(samples), micro_batch_size)]


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


# ----------------------------------------------------------------------------- the trainer's config
def trainer_config(a: argparse.Namespace, root: Path, sets: list[str]) -> Path:
    """`<root>/configs/trainer.yaml`: a bench run of the trainer alone, the schema's defaults
    (`TrainerRunConfig`; no Hydra) with this script's shape, then `sets` (dotted keys).
    Refused in one line when a key is unknown or a value of the wrong type."""
    from omegaconf import OmegaConf

    from prime_hpc.config.component import TrainerRunConfig, typed
    from prime_hpc.config.dump import to_yaml
    from prime_hpc.rundir import RunDir, atomic_write_text

    raw: dict[str, Any] = {
        "name": "trainer-vs-plain",
        "output_dir": str(root),
        "seq_len": a.seq_len,
        "seed": a.seed,
        "model": {"name": a.model},
        "device": a.device,
        "max_steps": None,
        "async_level": 1,
        "bench": {
            "mode": "trainer",
            "steps": a.steps,
            "warmup_steps": a.warmup_steps,
            "samples_per_step": a.samples,
            "group_size": 1,
            "completion_len": a.completion_len,
        },
        "trainer": {"micro_batch_size": a.micro_batch_size},
    }
    merged = OmegaConf.merge(OmegaConf.create(raw), OmegaConf.from_dotlist(list(sets)))
    raw = OmegaConf.to_container(merged)  # type: ignore[assignment]
    typed(TrainerRunConfig, raw, f"trainer config ({' '.join(sets) or 'defaults'})")  # fail here, not in the child
    path = RunDir(root).component_config("trainer")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, to_yaml(raw))
    return path


# ----------------------------------------------------------------------------- parts
def child_env(threads: Optional[int]) -> dict[str, str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def run_child(argv: list[str], log: Path, timeout_s: float, what: str, threads: Optional[int] = None) -> None:
    """Run one part's process, its output to `log`; on failure, raise with the log's end."""
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"[trainer_vs_plain] {what}: {' '.join(argv[1:])} (log {log})", flush=True)
    with open(log, "wb") as f:
        try:
            rc = subprocess.run(
                argv, stdout=f, stderr=subprocess.STDOUT, env=child_env(threads), timeout=timeout_s
            ).returncode
        except subprocess.TimeoutExpired:
            rc = None
    if rc != 0:
        lines = log.read_text(errors="replace").splitlines()
        said = f"timed out after {timeout_s:.0f}s" if rc is None else f"exited {rc}"
        last = next((line.strip() for line in reversed(lines) if line.strip()), "")
        tail = "\n".join(lines[-25:])
        raise RuntimeError(f"{what} {said}: {last}\nthe end of {log}:\n{tail}")


def trainer_part(a: argparse.Namespace, name: str, sets: list[str], config: Path) -> dict:
    """One trainer run through its bench path (`config`, written by `trainer_config`); its
    figures from bench/trainer.json and the metrics rows of its steps."""
    from prime_hpc.rundir import RunDir, read_json
    from prime_hpc.rundir.files import read_rows

    run = RunDir(config.parents[1])
    cpu_file = run.root / "step_cpu_s.json"
    argv = [
        sys.executable,
        "-u",
        str(Path(__file__).resolve()),
        "--worker",
        TRAINER,
        "--spec",
        str(config),
        str(cpu_file),
    ]
    run_child(argv, run.root / "trainer.log", a.timeout_s, name, a.threads)
    summary = read_json(run.bench_part("trainer"))
    rows = read_rows(run.metrics("trainer"))
    measured = [r for r in rows if r.get("bench/measured")]
    cpu = json.loads(cpu_file.read_text())[-len(summary["step_times_s"]) :]
    mems = [r["perf/peak_memory"] for r in measured if r.get("perf/peak_memory") is not None]
    pads = [r["perf/padding_share"] for r in measured if r.get("perf/padding_share") is not None]
    return {
        "name": name,
        "sets": sets,
        "step_times_s": summary["step_times_s"],
        "step_time_s": summary["step_time_s"],
        "tokens_per_step": summary["tokens_per_step"],
        "tokens_per_s": summary["tokens_per_s"],
        "step_cpu_s": cpu,
        "tokens_per_cpu_s": summary["tokens_per_step"] / statistics.median(cpu),
        "first_step_s": rows[0]["time/step"] if rows else None,
        "compile_s": sum(r.get("time/compile") or 0.0 for r in rows),
        "peak_memory_gib": max(mems) if mems else None,
        "padding_share": statistics.fmean(pads) if pads else None,
        "params": summary["params"],
        "device_name": summary["device_name"],
        "peak_flops": summary["peak_flops_per_device"],
        "config": str(config),
    }


def worker_part(kind: str, spec: dict, work: Path, a: argparse.Namespace, tag: str) -> dict:
    """Run this script as the `kind` worker (plain | matmul) on `spec`; its JSON result
    (its files in `work`, named `<kind><tag>.*`)."""
    spec_path, out = work / f"{kind}{tag}.spec.json", work / f"{kind}{tag}.json"
    spec_path.write_text(json.dumps({**spec, "out": str(out)}))
    argv = [sys.executable, "-u", str(Path(__file__).resolve()), "--worker", kind, "--spec", str(spec_path)]
    run_child(argv, work / f"{kind}{tag}.log", a.timeout_s, kind, a.threads)
    return json.loads(out.read_text())


# ----------------------------------------------------------------------------- workers
def trainer_worker(config: Path, cpu_file: Path) -> None:
    """`python -m prime_hpc.trainer.bench --config <config>`, as it is, with the CPU time of
    this process (every thread) in each `Engine.train_step` appended to `cpu_file` (written
    after every step: the bench leaves with os._exit)."""
    from prime_hpc.trainer import bench
    from prime_hpc.trainer.engine import Engine

    step, cpu = Engine.train_step, []

    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.process_time()
        try:
            return step(self, *args, **kwargs)
        finally:
            cpu.append(time.process_time() - t0)
            cpu_file.write_text(json.dumps(cpu))

    Engine.train_step = timed  # type: ignore[method-assign]
    bench.main(["--config", str(config)])


def plain_worker(spec: dict) -> None:
    """The plain loop on the trainer's samples; writes its figures to spec["out"]."""
    import torch
    from transformers import AutoModelForCausalLM

    from prime_hpc.core import device as devices
    from prime_hpc.model import resolve_model
    from prime_hpc.rundir.batch import padding_share
    from prime_hpc.trainer import bench
    from prime_hpc.trainer.config import load_config

    cfg = load_config(spec["config"])
    dev = devices.torch_device(cfg.device)
    source = resolve_model(cfg.model.name, seed=cfg.model.seed)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, attn_implementation="sdpa").to(dev)
    model.config.use_cache = False
    model.train()
    o = cfg.trainer.optim
    opt = torch.optim.AdamW(
        model.parameters(), lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay, fused=dev.type == "cuda"
    )
    amp = getattr(torch, spec["dtype"])
    warmup, total = int(cfg.bench.warmup_steps), int(cfg.bench.warmup_steps) + int(cfg.bench.steps)
    times, cpus, tokens, mems, pads, first = [], [], [], [], [], 0.0
    devices.reset_peak_memory(cfg.device)
    for step in range(1, total + 1):  # the trainer's steps: the same seeds, the same samples
        samples = bench.rl_samples(cfg, int(model.config.vocab_size), seed=cfg.seed + step)
        mbs = right_padded(samples, spec["micro_batch_size"])
        devices.synchronize(cfg.device)
        t0, c0 = time.perf_counter(), time.process_time()
        plain_step(model, opt, mbs, dev, amp, float(o.max_norm))
        devices.synchronize(cfg.device)
        t, c = time.perf_counter() - t0, time.process_time() - c0
        mem = devices.peak_memory_gib(cfg.device)
        devices.reset_peak_memory(cfg.device)
        real = sum(len(s) for s in samples)
        first = first or t
        if step > warmup:
            times.append(t)
            cpus.append(c)
            tokens.append(real)
            pads.append(padding_share(mbs))
            mems.append(mem)
        print(
            f"plain step {step}/{total}: {t:.3f}s, {real / t:.0f} tok/s, padding {padding_share(mbs):.1%}", flush=True
        )
    step_s = statistics.median(times)
    result = {
        "name": PLAIN,
        "step_times_s": times,
        "step_time_s": step_s,
        "tokens_per_step": statistics.fmean(tokens),
        "tokens_per_s": statistics.fmean(tokens) / step_s,
        "step_cpu_s": cpus,
        "tokens_per_cpu_s": statistics.fmean(tokens) / statistics.median(cpus),
        "first_step_s": first,
        "peak_memory_gib": max(mems) if None not in mems else None,
        "padding_share": statistics.fmean(pads),
        "params": sum(p.numel() for p in model.parameters()),
        "micro_batch_size": spec["micro_batch_size"],
        "dtype": spec["dtype"],
    }
    Path(spec["out"]).write_text(json.dumps(result))


def plain_step(model: Any, opt: Any, mbs: list[dict], dev: Any, amp: Any, max_norm: float) -> None:
    """One optimizer step of the plain loop: per micro-batch, the completion tokens'
    log-probabilities from their full logits (float32 log-softmax), the loss
    -sum(sg(ratio) * A * logp) over the step's loss tokens; then clip and AdamW."""
    import torch

    opt.zero_grad(set_to_none=True)
    n = max(sum(int(mb["loss_mask"][:, 1:].sum()) for mb in mbs), 1)
    for mb in mbs:
        mb = {k: v.to(dev, non_blocking=True) for k, v in mb.items() if isinstance(v, torch.Tensor)}  # not envs
        sel = mb["loss_mask"][:, 1:]  # hidden state t predicts token t + 1
        with torch.autocast(device_type=dev.type, dtype=amp, enabled=amp != torch.float32):
            out = model.model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"].long())
            hidden = out.last_hidden_state
            logits = model.lm_head(hidden[:, :-1][sel])
        logp = torch.log_softmax(logits.float(), dim=-1)
        lp = logp.gather(-1, mb["input_ids"][:, 1:][sel].unsqueeze(-1)).squeeze(-1)
        weight = torch.exp((lp.detach() - mb["inference_logprobs"][:, 1:][sel]).clamp(-20, 20))
        loss = -(weight * mb["advantages"][:, 1:][sel] * lp).sum() / n
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    opt.step()


def matmul_worker(spec: dict) -> None:
    """FLOP/s of an n x n x n matrix product in `dtype` on `device` (the median of five
    rounds of ten products, after three), written to spec["out"]."""
    import torch

    from prime_hpc.core import device as devices

    dev = devices.torch_device(spec["device"])
    n, dtype = int(spec["n"]), getattr(torch, spec["dtype"])
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(n, n, device=dev, dtype=dtype, generator=gen)
    y = torch.randn(n, n, device=dev, dtype=dtype, generator=gen)
    for _ in range(3):
        x @ y
    rounds = []
    for _ in range(5):
        devices.synchronize(spec["device"])
        t0 = time.perf_counter()
        for _ in range(10):
            x @ y
        devices.synchronize(spec["device"])
        rounds.append((time.perf_counter() - t0) / 10)
    rate = 2.0 * n**3 / statistics.median(rounds)
    Path(spec["out"]).write_text(json.dumps({"n": n, "dtype": spec["dtype"], "flops": rate}))


# ----------------------------------------------------------------------------- report
def _fmt(x: Optional[float], spec: str, suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def mfus(part: dict, matmul_flops: Optional[float]) -> tuple[Optional[float], Optional[float]]:
    """The part's MFU (6 x parameters per token) against the spec's peak and the measured rate."""
    from prime_hpc.core import device as devices

    per_token = devices.train_flops_per_token(part["params"])
    return (
        devices.mfu(part["tokens_per_s"], per_token, part.get("peak_flops")),
        devices.mfu(part["tokens_per_s"], per_token, matmul_flops),
    )


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def table(parts: list[dict], matmul_flops: Optional[float], cpu_time: bool) -> list[str]:
    """The side-by-side table (markdown), the plain loop as the anchor; `cpu_time`: with
    tokens per CPU-second of the part's process (on CPU: what a shared machine's load
    inflates far less than the wall time)."""
    plain = next((p for p in parts if p["name"] == PLAIN and "error" not in p), None)
    heads = ["part", "tokens/s", "× plain"]
    heads += ["tokens per CPU-s", "× plain"] if cpu_time else []
    heads += ["step s (median)", "first step s (compiling)", "peak memory GiB", "padding", "MFU (spec)", "MFU (matmul)"]
    lines = ["| " + " | ".join(heads) + " |", "|" + " --- |" * len(heads)]
    for p in parts:
        label = p["name"] + (f" ({', '.join(p['sets'])})" if p.get("sets") else "")
        if "error" in p:
            lines.append(f"| {label} | failed: {p['error']} |" + " |" * (len(heads) - 2))
            continue
        spec_mfu, measured_mfu = mfus(p, matmul_flops)
        first = _fmt(p.get("first_step_s"), ".2f") + (f" ({p['compile_s']:.1f})" if p.get("compile_s") else "")
        cells = [label, f"{p['tokens_per_s']:,.0f}", _times(p, plain, "tokens_per_s")]
        if cpu_time:
            cells += [f"{p['tokens_per_cpu_s']:,.0f}", _times(p, plain, "tokens_per_cpu_s")]
        cells += [
            f"{p['step_time_s']:.3f}",
            first,
            _fmt(p.get("peak_memory_gib"), ".2f"),
            _pct(p.get("padding_share")),
            _pct(spec_mfu),
            _pct(measured_mfu),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _times(part: dict, plain: Optional[dict], key: str) -> str:
    return _fmt(ratio(part[key], plain[key] if plain else None), ".2f", "×")


def header(a: argparse.Namespace, parts: list[dict], matmul: dict) -> list[str]:
    from prime_hpc.core import device as devices

    done = [p for p in parts if "error" not in p]
    params = f" ({done[0]['params'] / 1e6:.1f}M parameters)" if done else ""
    name = next((p["device_name"] for p in done if p.get("device_name")), a.device)
    spec = devices.peak_flops_of(name) if a.device == "cuda" else None
    rate = (
        f"matmul ({matmul['dtype']}, {matmul['n']}^3): {matmul['flops'] / 1e12:.3g} TFLOP/s"
        if "error" not in matmul
        else f"matmul: failed ({matmul['error']})"
    )
    return [
        f"trainer vs a plain PyTorch loop: {a.model}{params} on {name}; {a.samples} samples of up to "
        f"{a.seq_len} tokens per step (completions up to {a.completion_len}); plain micro-batches of "
        f"{a.micro_batch_size} samples; medians of {a.steps} steps after {a.warmup_steps} warm-up"
        + (f", in each of {a.rounds} rounds (ABBA order)" if a.rounds > 1 else ""),
        f"machine: {machine()}; {versions()}",
        rate + (f"; spec peak {spec / 1e12:.0f} TFLOP/s" if spec else ""),
    ]


def machine() -> str:
    """The other benchmarks' line of the machine, and its load now."""
    from vs_trl import machine as cores_and_cpu  # the benchmarks' folder: standard library only at import

    load = f", load average (1 min) {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    return cores_and_cpu() + load


def versions() -> str:
    from importlib import metadata

    got = []
    for dist in ("torch", "transformers"):
        try:
            got.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            got.append(f"{dist} -")
    try:
        commit = subprocess.run(
            ["git", "-C", str(REPO), "log", "-1", "--format=%h"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return ", ".join(got) + f", prime-hpc {commit or '(no git)'}"


# ----------------------------------------------------------------------------- main
def parse(argv: Optional[list[str]] = None) -> argparse.Namespace:
    from prime_hpc.model.tiny import SIZES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-35m", help=f"model.name: one of {', '.join(SIZES)}, or a local directory")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--samples", type=int, default=16, help="samples per step")
    ap.add_argument("--seq-len", type=int, default=512, help="tokens of the longest sample (seq_len)")
    ap.add_argument("--completion-len", type=int, default=384, help="bench.completion_len")
    ap.add_argument(
        "--micro-batch-size", type=int, default=4, help="samples per micro-batch (plain; the trainer's default)"
    )
    ap.add_argument("--steps", type=int, default=4, help="measured steps")
    ap.add_argument("--warmup-steps", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1, help="run every part this many times, in ABBA order")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="every trainer run's config")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE,...", help="one more trainer run")
    ap.add_argument("--matmul-n", type=int, default=None, help="matrix size (default 8192 on cuda, 2048 on cpu)")
    ap.add_argument("--timeout-s", type=float, default=3600, help="each part's process")
    ap.add_argument("--workdir", type=Path, default=None, help="default: a temporary directory, removed after")
    ap.add_argument("--json", type=Path, default=None, help="write every figure here")
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of every part (default: torch's choice)")
    ap.add_argument("--worker", choices=(TRAINER, PLAIN, "matmul"), help=argparse.SUPPRESS)
    ap.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("cpu_file", nargs="?", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.rounds < 1 or a.steps < 1 or a.warmup_steps < 0:
        ap.error("--rounds and --steps take 1 or more, --warmup-steps 0 or more")
    if any(s.partition("=")[1] != "=" for s in a.set):
        ap.error(f"--set takes KEY=VALUE, got {a.set}")
    try:
        a.variants = [parse_variant(v) for v in a.variant]
    except ValueError as e:
        ap.error(str(e))
    return a


def run_all(a: argparse.Namespace, work: Path) -> dict:
    """Every part, one after the other: the trainer, the plain loop, the variants; with
    `--rounds` > 1 again, every other round in the reverse order (a drift of a shared
    machine's load then falls on every part alike). A part that fails is recorded with the
    end of its log, and the others still run."""
    from prime_hpc.model import resolve_model

    runs = [(TRAINER, list(a.set)), *[(name, [*a.set, *sets]) for name, sets in a.variants]]
    configs = {  # every override checked before anything runs
        (name, r): trainer_config(a, work / f"{name}.{r}", sets) for name, sets in runs for r in range(a.rounds)
    }
    print(f"[trainer_vs_plain] model {a.model}: {resolve_model(a.model)}", flush=True)  # built once, here
    compute = "bfloat16" if a.device == "cuda" else _compute_dtype(configs[TRAINER, 0])
    n = a.matmul_n or (8192 if a.device == "cuda" else 2048)
    matmul = attempt("matmul", worker_part, "matmul", {"device": a.device, "n": n, "dtype": compute}, work, a, "")
    plain = {"config": str(configs[TRAINER, 0]), "micro_batch_size": a.micro_batch_size, "dtype": compute}
    rounds: dict[str, list[dict]] = {name: [] for name in [TRAINER, PLAIN, *(v for v, _ in runs[1:])]}
    for r in range(a.rounds):
        jobs: list[tuple[str, Callable[..., dict], tuple]] = [
            (TRAINER, trainer_part, (a, TRAINER, runs[0][1], configs[TRAINER, r])),
            (PLAIN, worker_part, (PLAIN, plain, work, a, f".{r}")),
            *[(name, trainer_part, (a, name, sets, configs[name, r])) for name, sets in runs[1:]],
        ]
        for name, fn, args in jobs if r % 2 == 0 else jobs[::-1]:
            rounds[name].append(attempt(name, fn, *args))
    parts = [merge_rounds(rs) for rs in rounds.values()]
    peak = next((p["peak_flops"] for p in parts if p.get("peak_flops")), None)
    for p in parts:
        p.setdefault("peak_flops", peak)  # the plain loop ran on the same device
    return {"matmul": matmul, "parts": parts}


def merge_rounds(rounds: list[dict]) -> dict:
    """One part's figures over its rounds: the median of all their measured steps, the
    largest peak memory, the first round's first step; a failed round fails the part."""
    failed = next((r for r in rounds if "error" in r), None)
    if failed is not None or len(rounds) == 1:
        return failed or rounds[0]
    times = [t for r in rounds for t in r["step_times_s"]]
    cpus = [c for r in rounds for c in r["step_cpu_s"]]
    tokens = statistics.fmean(r["tokens_per_step"] for r in rounds)
    mems = [r["peak_memory_gib"] for r in rounds if r.get("peak_memory_gib") is not None]
    pads = [r["padding_share"] for r in rounds if r.get("padding_share") is not None]
    step = statistics.median(times)
    return {
        **rounds[0],
        "rounds": len(rounds),
        "step_times_s": times,
        "step_time_s": step,
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / step,
        "step_cpu_s": cpus,
        "tokens_per_cpu_s": tokens / statistics.median(cpus),
        "peak_memory_gib": max(mems) if mems else None,
        "padding_share": statistics.fmean(pads) if pads else None,
    }


def attempt(name: str, part: Callable[..., dict], *args: Any) -> dict:
    """`part(*args)`'s figures, or {"name", "error"} when its process failed."""
    try:
        return part(*args)
    except RuntimeError as e:
        print(f"[trainer_vs_plain] {e}", file=sys.stderr, flush=True)
        return {"name": name, "error": str(e).splitlines()[0]}


def _compute_dtype(config: Path) -> str:
    """The trainer's forward/backward dtype on CPU (`trainer.model.optimization_dtype`, resolved)."""
    from prime_hpc.trainer.config import load_config
    from prime_hpc.trainer.model import optimization_dtype

    return str(optimization_dtype(load_config(config))).removeprefix("torch.")


def main(argv: Optional[list[str]] = None) -> int:
    a = parse(argv)
    if a.worker == TRAINER:
        trainer_worker(a.spec, Path(a.cpu_file))
        return 0
    if a.worker:
        spec = json.loads(a.spec.read_text())
        (plain_worker if a.worker == PLAIN else matmul_worker)(spec)
        return 0
    work = (a.workdir or Path(tempfile.mkdtemp(prefix="trainer-vs-plain-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    print(f"[trainer_vs_plain] machine: {machine()}", flush=True)
    results = run_all(a, work)
    failed = [p for p in [results["matmul"], *results["parts"]] if "error" in p]
    lines = [
        *header(a, results["parts"], results["matmul"]),
        "",
        *table(results["parts"], results["matmul"].get("flops"), cpu_time=a.device == "cpu"),
    ]
    print("\n" + "\n".join(lines), flush=True)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, **results}, indent=2) + "\n")
    if failed:  # their logs stay
        print(
            f"trainer_vs_plain: {', '.join(p['name'] for p in failed)} failed; logs and configs in {work}",
            file=sys.stderr,
        )
        return 1
    if a.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
