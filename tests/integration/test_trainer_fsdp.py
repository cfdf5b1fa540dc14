"""Sharding does not change the gradient: one RL step's gradient on two gloo ranks (FSDP2:
every decoder layer, the embeddings and the output layer units of their own; activations
checkpointed; the output layer's log-probabilities in chunks of 3 positions; the gradients
reduce-scattered after the last micro-batch or after each) is the one a single plain rank
computes from the whole logits of the same samples."""

from __future__ import annotations

import subprocess
import sys

import torch

from tests.trainer_support import REPO, child_env, explain, trainer_yaml


def _grads(tmp_path, name: str, nproc: int, *flags: str, overrides: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    config = trainer_yaml(
        tmp_path / name,
        [
            "seq_len=24",
            "orchestrator.batch_size=8",
            "orchestrator.group_size=4",
            "bench.completion_len=12",
            "trainer.micro_batch_size=2",
            "trainer.model.ac.freq=1",
            *overrides,
        ],
    )
    out = tmp_path / f"{name}.pt"
    script = [sys.executable, str(REPO / "tests" / "fsdp_grads.py")]
    if nproc > 1:
        script = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            *script[1:],
        ]
    proc = subprocess.run(
        [*script, "--config", str(config), "--out", str(out), *flags],
        capture_output=True,
        text=True,
        timeout=600,
        env=child_env(),
    )
    assert proc.returncode == 0, explain(proc)
    return torch.load(out)


def test_two_sharded_ranks_compute_the_single_ranks_gradient(tmp_path):
    one = _grads(tmp_path, "one", 1, "--whole-logits")
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= one.keys()
    assert all(g.abs().sum() > 0 for g in one.values())  # every parameter is trained
    # the gradients reduce-scattered after the step's last micro-batch, and after every one
    for sync in ("last", "every"):
        two = _grads(tmp_path, f"two-{sync}", 2, "--chunk-rows", "3", overrides=(f"trainer.model.grad_sync={sync}",))
        assert one.keys() == two.keys()
        for name in one:
            diff = (one[name] - two[name]).abs().max()
            assert torch.allclose(one[name], two[name], rtol=1e-4, atol=1e-7), (sync, name, diff)
