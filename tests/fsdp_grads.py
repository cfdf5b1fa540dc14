"""The gradient of one synthetic RL step (`prime_hpc.trainer.bench.rl_batch`: the same
samples whatever the number of ranks, each rank its share) of the run in `--config`, on the
ranks torchrun started (or one rank without it); rank 0 writes every parameter's whole
gradient to `--out`. `--chunk-rows N`: the output layer's log-probabilities N positions at
a time; `--whole-logits`: from the whole logits instead. Run by test_trainer_fsdp."""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    from prime_hpc.trainer import engine, loss
    from prime_hpc.trainer.bench import loss_for, rl_batch
    from prime_hpc.trainer.config import load_config
    from prime_hpc.trainer.dist import process_group
    from prime_hpc.trainer.model import build_policy, clean_key

    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--chunk-rows", type=int, default=0)
    p.add_argument("--whole-logits", action="store_true")
    args = p.parse_args()
    cfg = load_config(args.config)
    if args.whole_logits:
        engine.HEAD_AS_LOGITS = frozenset()
    with process_group(cfg.device) as env:
        torch.manual_seed(cfg.seed)
        policy = build_policy(cfg, env.mesh)
        vocab = policy.hf_config.vocab_size
        if args.chunk_rows:
            loss.LOGITS_CHUNK_BYTES = 4 * vocab * args.chunk_rows
        eng = engine.Engine(policy, env, cfg.trainer.optim)
        batch = rl_batch(cfg, vocab, env.rank, env.world_size, seed=0)
        eng._accumulate(batch, loss_for(cfg), 1.0, train=True)
        grads = {}
        for name, param in policy.model.named_parameters():
            g = param.grad
            full = getattr(g, "full_tensor", None)  # a DTensor's shard: every rank joins the gather
            grads[clean_key(name)] = (full() if full else g).detach().clone()
        if env.is_main:
            torch.save(grads, args.out)


if __name__ == "__main__":
    main()
    # as the trainer's ranks leave (`prime_hpc.trainer.runner.main`): the gradients are on
    # disk and the process group destroyed; the interpreter's teardown, where gloo's threads
    # held by objects freed only then can abort a rank (SIGABRT), is skipped
    from prime_hpc.runtime.stopping import leave

    leave(0)
