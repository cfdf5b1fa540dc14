"""The trainer of a bench run (`bench.mode` all or trainer; `prime_hpc.rundir.bench`): the real
session and step (`runner.session`, `Engine.train_step` with the run's loss, micro-batching
and sharding) on synthetic batches of the configured shape, instead of waiting for rollouts.

RL (`rl_samples`, `rl_batch`): `bench.samples_per_step` samples, each a prompt of
`seq_len - bench.completion_len` tokens and a completion whose length is drawn uniformly
from 1 .. `bench.completion_len` (`completion_lengths`: the spread of real rollouts, so the
figures show what padding costs), random token ids within the vocabulary, the loss mask
over the completion, random advantages and inference log-probabilities. They go the way a
real step's go: split over the ranks into right-padded micro-batches of
`trainer.micro_batch_size` by the orchestrator's own `prime_hpc.rundir.batch.shard`, then,
as the trainer does with its file (`runner.packed`), each rank's samples taken back out
(`batch.unpack`) and packed into rows of up to `seq_len` tokens and micro-batches of at
most `trainer.micro_batch_tokens` (default `micro_batch_size x seq_len`; `batch.pack`),
every rank as many micro-batches as the rank with the most (empty ones added). A packed
micro-batch's layout is in `prime_hpc.rundir.batch`'s module docstring: `position_ids`
restart at 0 at each sample, a row's unused tail is padding (a segment of its own, loss
mask False, `sample_index` equal to the micro-batch's number of samples), and
`batch.unpack` gives its samples back in order.
SFT (`sft_batch`): `trainer.data.batch_size // trainer.data.seq_len` packed rows of
`trainer.data.seq_len` tokens, split and collated by `prime_hpc.trainer.sft_data` as a real
step is (micro-batches of `trainer.micro_batch_tokens // seq_len` rows when that is set).

Each rank builds the same step from the same seed and takes its share, as it would read its
file. With `bench.mode=all` it starts once the inference part is measured (one after the
other: on a shared host neither measures the other's load). Runs `bench.warmup_steps` uncounted steps, then `bench.steps` measured ones (step time:
forward, backward and optimizer, synchronised; no weights are written), logs each to
`metrics/trainer.jsonl` (with `perf/padding_share`, and `time/compile` for the steps that
compiled), and rank 0 writes `bench/trainer.json` (and `bench.json` when the trainer is the
only part benched).
"""

from __future__ import annotations

import math
import time
from typing import Any, Optional

from prime_hpc.config.component import TrainerRunConfig
from prime_hpc.core.errors import required
from prime_hpc.rundir import bench
from prime_hpc.trainer import runner


def completion_lengths(n: int, longest: int, seed: int) -> list[int]:
    """`n` completion lengths drawn uniformly from 1 .. `longest` (seeded)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, longest + 1, (n,), generator=g).tolist()


def rl_samples(cfg: TrainerRunConfig, vocab_size: int, seed: int) -> list:
    """The samples of one synthetic RL step (`rundir.batch.Sample`), in the order drawn."""
    import torch

    from prime_hpc.rundir.batch import Sample

    b = cfg.bench
    n, seq = required(b.samples_per_step, "bench.samples_per_step"), int(cfg.seq_len)
    longest = bench.completion_len(b.completion_len, seq)
    prompt = seq - longest
    lengths = completion_lengths(n, longest, seed)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (n, seq), generator=g).tolist()
    logprobs = (-torch.rand(n, seq, generator=g) * 4).tolist()
    adv = torch.randn(n, generator=g).tolist()
    return [
        Sample(
            input_ids=ids[i][: prompt + c],
            loss_mask=[False] * prompt + [True] * c,
            inference_logprobs=logprobs[i][: prompt + c],
            advantage=adv[i],
        )
        for i, c in enumerate(lengths)
    ]


def rl_batch(cfg: TrainerRunConfig, vocab_size: int, rank: int, world: int, seed: int) -> list[dict]:
    """This rank's micro-batches of one synthetic RL step: packed, as the trainer trains them."""
    from prime_hpc.rundir import batch
    from prime_hpc.trainer.model import micro_batch_tokens

    per_rank = batch.shard(rl_samples(cfg, vocab_size, seed), world, int(cfg.trainer.micro_batch_size))
    packed = [batch.pack(batch.unpack(mbs), int(cfg.seq_len), micro_batch_tokens(cfg)) for mbs in per_rank]
    n = max(len(p) for p in packed)
    return packed[rank] + [batch.empty_packed() for _ in range(n - len(packed[rank]))]


def sft_batch(cfg: TrainerRunConfig, vocab_size: int, rank: int, world: int, seed: int) -> list[dict]:
    """This rank's micro-batches of one synthetic SFT step (one sample per packed row)."""
    import torch

    from prime_hpc.trainer import sft_data
    from prime_hpc.trainer.sft import rows_per_micro_batch

    d = cfg.trainer.data
    seq = int(d.seq_len)
    rows_per_rank = math.ceil(max(1, int(d.batch_size) // seq) / world)
    completion = bench.completion_len(cfg.bench.completion_len, seq)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (rows_per_rank * world, seq), generator=g).tolist()
    mask = [False] * (seq - completion) + [True] * completion
    rows = sft_data.pack([(row, list(mask)) for row in ids], seq)
    mine = sft_data.split_rows(rows, rank, world, rows_per_rank)
    return sft_data.micro_batches(mine, rows_per_micro_batch(cfg), pad_id=0)


def loss_for(cfg: TrainerRunConfig, compile: bool = False) -> Any:
    if cfg.trainer.type == "sft":
        from prime_hpc.trainer.loss import sft_loss

        return lambda lp, mb, normalizer: sft_loss(lp, mb["loss_mask"], normalizer)
    from prime_hpc.trainer.rl import make_loss_fn

    return make_loss_fn(cfg.trainer.loss, step=1, mode="rl", compile=compile)


def shape(cfg: TrainerRunConfig, world: int) -> dict:
    from prime_hpc.trainer.model import micro_batch_tokens
    from prime_hpc.trainer.sft import rows_per_micro_batch

    t = cfg.trainer
    if t.type == "sft":
        return {
            "type": "sft",
            "rows": max(1, int(t.data.batch_size) // int(t.data.seq_len)),
            "seq_len": int(t.data.seq_len),
            "micro_batch_size": rows_per_micro_batch(cfg),
            "ranks": world,
        }
    return {
        "type": "rl",
        "samples": required(cfg.bench.samples_per_step, "bench.samples_per_step"),
        "seq_len": int(cfg.seq_len),
        "completion_len": bench.completion_len(cfg.bench.completion_len, int(cfg.seq_len)),
        "completion_lengths": "uniform",
        "micro_batch_tokens": micro_batch_tokens(cfg),
        "ranks": world,
    }


def wait_for_inference(s: Any) -> None:
    """Bench `all`: the trainer's steps start once the inference part is measured, so on a
    shared host (cores, GPUs) neither part's figures include the other's load (nor the
    servers' start)."""
    from loguru import logger

    from prime_hpc.rundir import wait_for

    part = s.run.bench_part("inference")
    last = [time.monotonic()]

    def ready() -> bool:
        if time.monotonic() - last[0] >= 5.0:
            runner.beat(s, 0, progress=False, waiting_on="orchestrator")
            last[0] = time.monotonic()
        return part.exists()

    logger.info(f"bench: waiting for the inference part ({part}) before measuring the trainer")
    wait_for(
        ready,
        what=str(part),
        timeout_s=s.cfg.trainer.rollout_timeout_s,  # as long as the trainer waits for any rollouts
        producer="orchestrator",
        producer_log=runner.orchestrator_log(),
    )


def run(cfg: TrainerRunConfig) -> None:
    from loguru import logger

    from prime_hpc.core import device as devices

    b = cfg.bench
    parts = ("trainer",) if cfg.trainer.type == "sft" else ()
    with runner.session(cfg, parts) as s:
        env = s.env
        vocab = int(s.policy.hf_config.vocab_size)
        make = sft_batch if cfg.trainer.type == "sft" else rl_batch
        loss_fn = loss_for(cfg, s.policy.compiled)
        times, tokens, samples = [], [], []
        total = int(b.warmup_steps) + int(b.steps)
        runner.beat(s, 0)
        if b.mode == "all" and cfg.trainer.type == "rl":
            wait_for_inference(s)
        for step in range(1, total + 1):
            mbs = make(cfg, vocab, env.rank, env.world_size, seed=cfg.seed + step)
            t0 = time.perf_counter()
            result = s.engine.train_step(mbs, loss_fn)
            t = time.perf_counter() - t0
            measured = step > int(b.warmup_steps)
            if measured:
                times.append(t)
                tokens.append(result.sums["num_tokens"])
                samples.append(result.sums["num_samples"])
            if s.metrics is not None:
                s.metrics.log(step, {**runner.step_metrics(s, result, t, 0.0), "bench/measured": float(measured)})
            logger.info(
                f"bench step {step}/{total}{'' if measured else ' (warm-up)'}: {t:.3f}s, "
                f"{result.sums['num_tokens'] / t:.0f} tok/s"
            )
            runner.beat(s, step)
        if env.is_main:
            summary = bench.summarize(
                times,
                tokens,
                samples,
                devices.train_flops_per_token(s.num_params),
                s.num_params,
                env.world_size,
                devices.accelerator_name(cfg.device, env.local_rank),
                devices.peak_flops(cfg.device, env.local_rank),
                shape=shape(cfg, env.world_size),
            )
            bench.write_part(s.run, "trainer", summary)
            if b.mode == "trainer" or cfg.trainer.type == "sft":
                bench.merge(s.run, bench.header("trainer", cfg.name, cfg.device, b.steps, b.warmup_steps))
            logger.info(
                f"bench: trainer {summary['step_time_s']:.3f}s per step (median), "
                f"{summary['tokens_per_s']:.0f} tok/s; {s.run.bench_part('trainer')}"
            )
        runner.beat(s, total, done=True)


def main(argv: Optional[list[str]] = None) -> int:
    return runner.main(
        run,
        "python -m prime_hpc.trainer.bench",
        "Bench trainer: the run's trainer step on synthetic batches (bench.*).",
        argv,
    )


if __name__ == "__main__":
    raise SystemExit(main())
