"""benchmarks/trainer_vs_plain.py: the plain loop takes the samples in the order drawn and
right-pads each micro-batch to its longest, as a user's own loop would; the trainer's config is built from the schema without Hydra and refuses a bad
key in one line; the trainer's bench path and the script import neither Hydra, vLLM,
verifiers nor submitit (the GPU machine has none of them)."""

from __future__ import annotations

import importlib.util
import statistics
import subprocess
import sys
from argparse import Namespace

import pytest
import torch

from prime_hpc.core.errors import UserError
from prime_hpc.rundir import batch
from prime_hpc.rundir.batch import Sample
from tests.conftest import REPO

SCRIPT = REPO / "benchmarks" / "trainer_vs_plain.py"


def _load():
    spec = importlib.util.spec_from_file_location("trainer_vs_plain", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


tvp = _load()


def _samples(lengths: list[int], prompt: int = 3) -> list[Sample]:
    g = torch.Generator().manual_seed(1)
    return [
        Sample(
            input_ids=torch.randint(1, 100, (n,), generator=g).tolist(),
            loss_mask=[False] * prompt + [True] * (n - prompt),
            inference_logprobs=[-0.5] * n,
            advantage=float(i),
        )
        for i, n in enumerate(lengths)
    ]


def test_the_plain_loop_keeps_the_drawn_order_and_pads_each_micro_batch_to_its_longest():
    samples = _samples([10, 4, 6, 8, 5])
    mbs = tvp.right_padded(samples, 2)
    assert [mb["input_ids"].shape for mb in mbs] == [(2, 10), (2, 8), (1, 5)]  # not sorted by length first
    for mb, chunk in zip(mbs, [samples[0:2], samples[2:4], samples[4:]]):
        for row, mask, s in zip(mb["input_ids"], mb["attention_mask"], chunk):
            n = len(s)
            assert row[:n].tolist() == s.input_ids and row[n:].eq(0).all()
            assert mask.sum() == n
    # 33 tokens in 20 + 16 + 5 positions
    assert batch.padding_share(mbs) == pytest.approx(1 - 33 / 41)


@pytest.mark.parametrize("text", ["nocolon", "x:", "x:key", "plain:a=1", "trainer:a=1", ":a=1"])
def test_a_bad_variant_is_refused(text):
    with pytest.raises(ValueError, match="--variant"):
        tvp.parse_variant(text)


def test_a_variant_names_its_overrides():
    assert tvp.parse_variant("eager: trainer.model.ac.freq=1 ,seed=3") == (
        "eager",
        ["trainer.model.ac.freq=1", "seed=3"],
    )


def _args(**kw) -> Namespace:
    base = dict(
        model="tiny", device="cpu", samples=6, seq_len=64, completion_len=40, micro_batch_size=2, steps=3,
        warmup_steps=1, seed=7,
    )  # fmt: skip
    return Namespace(**{**base, **kw})


def test_the_trainer_config_is_the_schema_with_the_bench_shape(tmp_path):
    from prime_hpc.trainer.config import load_config

    path = tvp.trainer_config(_args(), tmp_path / "run", ["trainer.optim.lr=0.001"])
    cfg = load_config(path)
    assert cfg.output_dir == str(tmp_path / "run") and cfg.seq_len == 64 and cfg.seed == 7
    assert (cfg.bench.mode, cfg.bench.steps, cfg.bench.warmup_steps) == ("trainer", 3, 1)
    assert (cfg.bench.samples_per_step, cfg.bench.completion_len) == (6, 40)
    assert cfg.trainer.micro_batch_size == 2 and cfg.trainer.optim.lr == 0.001
    assert cfg.trainer.model.name == "tiny" and cfg.device == "cpu"


def test_an_unknown_trainer_key_is_refused_in_one_line(tmp_path):
    with pytest.raises(UserError, match="no_such_key") as e:
        tvp.trainer_config(_args(), tmp_path / "run", ["trainer.no_such_key=1"])
    assert "\n" not in str(e.value)
    assert not (tmp_path / "run" / "configs").exists()


def test_the_bench_path_and_the_script_import_no_hydra_vllm_verifiers_or_submitit():
    code = (
        "import sys, importlib.util\n"
        "import prime_hpc.trainer.bench, prime_hpc.trainer.runner, prime_hpc.trainer.engine, prime_hpc.trainer.model\n"
        "import prime_hpc.trainer.rl, prime_hpc.trainer.ckpt, prime_hpc.trainer.config, prime_hpc.trainer.dist\n"
        "import prime_hpc.runtime.metrics, prime_hpc.runtime.stopping, prime_hpc.rundir.checkpoints\n"
        "import prime_hpc.config.component, prime_hpc.config.dump, prime_hpc.model.tiny\n"
        f"spec = importlib.util.spec_from_file_location('tvp', {str(SCRIPT)!r})\n"
        "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
        "print(sorted(m for m in ('hydra', 'vllm', 'verifiers', 'submitit') if m in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "[]", r.stdout + r.stderr


def test_rounds_merge_into_the_median_of_all_their_steps():
    a = {
        "name": "trainer",
        "step_times_s": [1.0, 9.0],
        "step_cpu_s": [2.0, 2.0],
        "tokens_per_step": 100.0,
        "peak_memory_gib": 2.0,
    }
    b = {
        "name": "trainer",
        "step_times_s": [2.0, 3.0],
        "step_cpu_s": [4.0, 4.0],
        "tokens_per_step": 100.0,
        "peak_memory_gib": 3.0,
    }
    for r, share in ((a, 0.1), (b, 0.3)):
        r.update(
            step_time_s=statistics.median(r["step_times_s"]), padding_share=share, first_step_s=len(r["step_times_s"])
        )
    m = tvp.merge_rounds([a, b])
    assert m["step_time_s"] == 2.5 and m["tokens_per_s"] == 40.0 and m["rounds"] == 2
    assert m["tokens_per_cpu_s"] == pytest.approx(100 / 3.0)
    assert m["peak_memory_gib"] == 3.0 and m["padding_share"] == pytest.approx(0.2)
    assert tvp.merge_rounds([a]) is a
    failed = {"name": "trainer", "error": "trainer exited 1: boom"}
    assert tvp.merge_rounds([a, failed]) is failed
