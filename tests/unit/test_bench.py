"""Bench runs (`prime-hpc submit ... --bench`): the FLOPs/MFU arithmetic with hand-computed
values and what a bench job runs."""

from __future__ import annotations

import pytest

from prime_hpc.core import device as devices
from prime_hpc.rundir import bench

RL = ["+experiment=reverse_text"]


# ----------------------------------------------------------------------------- arithmetic
def test_flops_per_token_and_mfu_by_hand():
    assert devices.train_flops_per_token(1_000_000) == 6_000_000
    assert devices.inference_flops_per_token(1_000_000) == 2_000_000
    # 7B trained at 1000 tokens/s on one H100: 6 * 7e9 * 1000 / 989e12 = 0.042467...
    assert devices.mfu(1000.0, devices.train_flops_per_token(7_000_000_000), 989e12) == pytest.approx(
        0.0424671, rel=1e-5
    )
    # generating 5000 tokens/s with 8B on an A100: 2 * 8e9 * 5000 / 312e12 = 0.25641...
    assert devices.mfu(5000.0, devices.inference_flops_per_token(8_000_000_000), 312e12) == pytest.approx(
        0.2564103, rel=1e-6
    )
    assert devices.mfu(1000.0, 6e9, None) is None  # CPU: the peak is unknown, so is the MFU
    assert devices.peak_flops("cpu") is None


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA L40S", 362e12),  # not the L4's 121e12: the longest matching key wins
        ("NVIDIA L4", 121e12),
        ("NVIDIA B200", 2250e12),
        ("Tesla T4", None),
    ],
)
def test_peak_flops_by_device_name(name, peak):
    assert devices.peak_flops_of(name) == peak


def test_summarize_by_hand():
    r = bench.summarize(
        [0.5, 0.4, 0.6],
        tokens=[1000, 1000, 1000],
        samples=[10, 10, 10],
        flops_per_token=6e6,
        params=1_000_000,
        devices_used=2,
        device_name="NVIDIA X",
        peak_flops_per_device=1e12,
        shape={"seq_len": 100},
    )
    assert r["step_time_s"] == 0.5  # median
    assert r["tokens_per_s"] == 2000.0 and r["samples_per_s"] == 20.0
    assert r["mfu"] == pytest.approx(1000 * 6e6 / 1e12)  # 2000 tok/s over 2 devices
    # inference: throughput counts generated tokens, the FLOPs count prompts (once per group) too
    r = bench.summarize(
        [0.25],
        tokens=[800],
        samples=[16],
        flops_per_token=2e6,
        params=1_000_000,
        devices_used=1,
        device_name="NVIDIA X",
        peak_flops_per_device=1e12,
        flops_tokens=[1000],
    )
    assert r["tokens_per_s"] == 3200.0 and r["mfu"] == pytest.approx(4000 * 2e6 / 1e12)
    unknown = bench.summarize([1.0], [10], [1], 6.0, 1, 1, "cpu", None)
    assert unknown["mfu"] is None
    text = bench.table({**bench.header("trainer", "x", "cpu", 1, 0), "trainer": unknown})
    assert "peak unknown (cpu)" in text and "inference" not in text


def test_completion_len_defaults_to_half_of_seq_len_and_leaves_a_prompt_token():
    assert bench.completion_len(32, 80) == 32
    assert bench.completion_len(None, 80) == 40
    assert bench.completion_len(500, 80) == 79


def test_the_bench_draws_completion_lengths_and_packs_them_as_the_trainer_does(tmp_path):
    """The trainer's bench batch: completions of 1 .. bench.completion_len tokens (seeded,
    spread), packed into rows of up to seq_len and micro-batches of the token budget, the
    same number on every rank, every sample once, less padding than right-padded rows."""
    from prime_hpc.rundir import batch
    from prime_hpc.trainer import bench as trainer_bench
    from prime_hpc.trainer.config import load_config
    from tests.trainer_support import trainer_yaml

    over = ["seq_len=96", "bench.samples_per_step=24", "bench.completion_len=64", "trainer.micro_batch_size=4"]
    cfg = load_config(trainer_yaml(tmp_path, [*RL, *over]))
    lengths = trainer_bench.completion_lengths(24, 64, seed=7)
    assert lengths == trainer_bench.completion_lengths(24, 64, seed=7) and min(lengths) >= 1 and max(lengths) <= 64
    assert len(set(lengths)) > 8  # a spread, not one length
    samples = trainer_bench.rl_samples(cfg, 101, seed=7)
    assert [sum(s.loss_mask) for s in samples] == lengths and all(len(s) == 32 + n for s, n in zip(samples, lengths))
    per_rank = [trainer_bench.rl_batch(cfg, 101, r, 2, seed=7) for r in (0, 1)]
    assert len(per_rank[0]) == len(per_rank[1])
    for mbs in per_rank:
        for mb in mbs:
            rows, width = mb["input_ids"].shape
            assert "position_ids" in mb and width <= 96 and rows * width <= 4 * 96
    packed = [s for mbs in per_rank for s in batch.unpack(mbs)]
    assert sorted(map(len, packed)) == sorted(map(len, samples))
    padded = batch.shard(samples, 2, 4)
    assert batch.padding_share(per_rank[0] + per_rank[1]) < batch.padding_share(padded[0] + padded[1])


def test_safetensors_params_reads_the_headers(tmp_path):
    import torch
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(3, 4), "b": torch.zeros(5)}, str(tmp_path / "model.safetensors"))
    assert bench.safetensors_params(tmp_path) == 17
    assert bench.safetensors_params(tmp_path / "nothing") is None


# ----------------------------------------------------------------------------- what a bench runs
@pytest.mark.parametrize(
    "mode, groups",
    [
        ("all", ["orchestrator", "inference", "trainer"]),
        ("trainer", ["trainer"]),
        ("inference", ["orchestrator", "inference"]),
    ],
)
def test_a_bench_runs_only_the_groups_it_measures(mode, groups, tmp_path):
    from prime_hpc.launcher.bench import bench_config
    from prime_hpc.launcher.plan import make_plan
    from prime_hpc.launcher.render import render_local, render_sbatch

    cfg = bench_config([*RL, f"output_dir={tmp_path}/run"], mode)
    assert cfg.output_dir == f"{tmp_path}/run-bench" and cfg.name == "reverse_text-bench"
    assert cfg.warmup.experiment is None and not cfg.ckpt.enabled and not cfg.wandb.enabled
    plan = make_plan(cfg)
    assert plan.group_names == groups
    for script in (render_sbatch(plan), render_local(plan, "local-x")):
        assert ("torch.distributed.run" in script) == ("trainer" in groups)
        assert ("prime_hpc.inference" in script) == ("inference" in groups)
