"""The orchestrator of a bench run (`bench.mode` all or inference; `prime_hpc.rundir.bench`): fixed
prompts sent to the run's inference servers through the router by the orchestrator's own
client (`make_client`: one request with `n` completions per group) with the run's sampling
arguments; no environment is loaded.

A step is one batch of the configured shape: `samples_per_step / group_size` prompts (each
different, so no step reuses another's prefix cache) × `group_size` completions, all sent at
once (at most `max_concurrent` in flight), every completion exactly `completion_len` tokens
(vLLM's `min_tokens` and `ignore_eos`). Step time: from sending the first request to the
last completion. Writes `bench/inference.json`; then, when the trainer is benched too,
waits for its part and merges both into `bench.json`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

from loguru import logger

from prime_hpc.config.component import OrchestratorRunConfig
from prime_hpc.core import device as devices
from prime_hpc.core import jobenv
from prime_hpc.core.errors import required
from prime_hpc.rundir import RunDir, bench, read_json

TRAINER_PART_TIMEOUT_S = 3600.0  # mode all: how long the orchestrator waits for the trainer's part


FILLER = " word"


def prompt(step: int, index: int, fill: int = 0) -> list[dict]:
    """The fixed prompt `index` of step `step` (different at its start: no shared prefix),
    lengthened by `fill` filler words."""
    return [{"role": "user", "content": f"{step}.{index}" + FILLER * fill}]


def prompt_fill(cfg: OrchestratorRunConfig, budget: int, longest: tuple[int, int]) -> int:
    """How many filler words make the longest prompt (`longest`: its step and index) fill
    `budget` tokens with the model's chat template, as a prompt of the configured shape
    does; 0 when the tokenizer cannot be loaded here (then the prompts are short)."""
    try:
        from transformers import AutoTokenizer

        from prime_hpc.model import resolve_model

        tok = AutoTokenizer.from_pretrained(
            resolve_model(cfg.model.name, cfg.model.seed), trust_remote_code=cfg.model.trust_remote_code
        )

        def length(fill: int) -> int:
            return len(
                tok.apply_chat_template(
                    prompt(*longest, fill), tokenize=True, add_generation_prompt=True, return_dict=False
                )
            )
    except Exception as e:
        logger.info(f"bench: no tokenizer for {cfg.model.name} here ({type(e).__name__}); short prompts")
        return 0
    lo, hi = 0, max(0, budget)
    while lo < hi:  # the largest fill that fits
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if length(mid) <= budget else (lo, mid - 1)
    return lo


def request_args(cfg: OrchestratorRunConfig, completion: int) -> dict:
    """The run's own sampling arguments, every completion `completion` tokens long."""
    from prime_hpc.orchestrator.generate import sampling_args

    args = sampling_args(cfg.orchestrator.sampling)
    args["max_tokens"] = completion
    args.pop("stop", None)
    args["extra_body"] = {**args["extra_body"], "min_tokens": completion, "ignore_eos": True}
    return args


def choice_tokens(choice: Any) -> int:
    ids = getattr(choice, "token_ids", None) or (getattr(choice, "model_extra", None) or {}).get("token_ids")
    if ids is not None:
        return len(ids)
    content = getattr(getattr(choice, "logprobs", None), "content", None)
    return len(content or [])


async def one_step(
    client: Any, model: str, step: int, groups: int, group_size: int, args: dict, max_concurrent: int, fill: int
) -> tuple[float, int, int, int]:
    """(seconds, completions, completion tokens, prompt tokens computed once per group)."""
    sem = asyncio.Semaphore(max_concurrent)

    async def rollout(i: int) -> Any:
        async with sem:
            return await client.get_native_response(prompt(step, i, fill), model, args)

    t0 = time.perf_counter()
    responses = await asyncio.gather(*(rollout(g) for g in range(groups) for _ in range(group_size)))
    seconds = time.perf_counter() - t0
    completion_tokens = sum(choice_tokens(r.choices[0]) for r in responses)
    prompt_tokens = sum(int(r.usage.prompt_tokens) for r in responses[::group_size]) if responses[0].usage else 0
    return seconds, len(responses), completion_tokens, prompt_tokens


def served_model(cfg: OrchestratorRunConfig) -> tuple[Optional[int], Optional[float], str, int]:
    """(parameters, peak FLOP/s per device, device name, devices) of what the servers serve,
    as far as known here: parameters from the model's safetensors, the device from the
    servers' endpoint records."""
    from prime_hpc.model import resolve_model

    params = None
    try:
        params = bench.safetensors_params(resolve_model(cfg.model.name, cfg.model.seed))
    except Exception as e:  # e.g. a hub id: its files are not a directory here
        logger.info(f"bench: parameters of {cfg.model.name} unknown ({type(e).__name__}); no inference MFU")
    run = RunDir(cfg.output_dir)
    records = [read_json(run.inference_endpoint(n)) for n in range(cfg.inference_nodes)]
    name = str(records[0].get("device_name") or cfg.device)
    per_server = max(1, int(records[0].get("devices") or 1))
    peak = devices.peak_flops_of(name) if cfg.device == "cuda" else None
    return params, peak, name, per_server * len(records)


async def wait_for_trainer(run_dir: RunDir, step: int) -> None:
    """Until the trainer's part is written (the supervisor ends the job if the trainer fails)."""
    deadline = time.monotonic() + TRAINER_PART_TIMEOUT_S
    part = run_dir.bench_part("trainer")
    while not part.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"no trainer results ({part}) after {TRAINER_PART_TIMEOUT_S:g}s")
        run_dir.beat("orchestrator", 0, step=step, progress_at=time.time(), waiting_on="trainer")
        await asyncio.sleep(0.5)


async def run(cfg: OrchestratorRunConfig) -> dict:
    from prime_hpc.inference.client import api_key, discover
    from prime_hpc.orchestrator.client import SERVERS_WAIT_S, make_client

    b, o = cfg.bench, cfg.orchestrator
    run_dir = RunDir(cfg.output_dir)
    logs = jobenv.logs_dir()
    ep = discover(run_dir, cfg.inference_nodes, timeout_s=SERVERS_WAIT_S, logs=logs)
    client = make_client(ep.openai_base_url, api_key(), timeout_s=o.generation_timeout_s)
    completion = bench.completion_len(b.completion_len, int(cfg.seq_len))
    group_size = required(b.group_size, "bench.group_size")
    groups = max(1, required(b.samples_per_step, "bench.samples_per_step") // group_size)
    args = request_args(cfg, completion)
    total = int(b.warmup_steps) + int(b.steps)
    fill = await asyncio.to_thread(prompt_fill, cfg, int(cfg.seq_len) - completion, (total, groups - 1))
    times, tokens, samples, computed = [], [], [], []
    logger.info(
        f"bench: {groups} prompts x {group_size} completions of {completion} tokens per step, "
        f"router {ep.router}, {len(ep.servers)} server(s)"
    )
    for step in range(1, total + 1):
        run_dir.beat("orchestrator", 0, step=step - 1, progress_at=time.time())
        seconds, n, comp_tok, prompt_tok = await one_step(
            client, cfg.model.name, step, groups, group_size, args, int(o.max_concurrent), fill
        )
        measured = step > int(b.warmup_steps)
        if measured:
            times.append(seconds)
            tokens.append(comp_tok)
            samples.append(n)
            computed.append(comp_tok + prompt_tok)
        logger.info(
            f"bench step {step}/{total}{'' if measured else ' (warm-up)'}: {seconds:.3f}s, "
            f"{comp_tok / seconds:.0f} generated tok/s"
        )
    params, peak, name, n_devices = served_model(cfg)
    result = bench.summarize(
        times,
        tokens,
        samples,
        devices.inference_flops_per_token(params or 0),
        params or 0,
        n_devices,
        name,
        peak if params else None,
        flops_tokens=computed,
        shape={
            "prompts": groups,
            "group_size": group_size,
            "completion_len": completion,
            "prompt_len": (computed[0] - tokens[0]) // groups if groups else 0,
            "servers": len(ep.servers),
        },
    )
    bench.write_part(run_dir, "inference", result)
    if b.mode == "all":
        await wait_for_trainer(run_dir, total)
    merged = bench.merge(
        run_dir, bench.header(required(b.mode, "bench.mode"), cfg.name, cfg.device, b.steps, b.warmup_steps)
    )
    run_dir.beat("orchestrator", 0, step=total, progress_at=time.time(), done=True)
    logger.info(
        f"bench: inference {result['step_time_s']:.3f}s per step (median), "
        f"{result['tokens_per_s']:.0f} generated tok/s; {run_dir.bench_json}"
    )
    return {"bench": merged}
