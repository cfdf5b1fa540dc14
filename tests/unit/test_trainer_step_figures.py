"""Figures every trainer gives: the zero-gradient share is one of the step metrics both
the RL and the SFT trainer log (`runner.step_metrics`), and a run of the multi-run trainer
gives its environments' figures as a run trained alone does (`multirun.step_inputs`)."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from prime_hpc.rundir import RunDir, batch
from tests.unit.test_trainer_engine import LOSS, _engine, _samples, _tiny


def test_the_step_metrics_of_both_trainers_give_the_zero_gradient_share():
    from prime_hpc.trainer import runner
    from prime_hpc.trainer.engine import StepResult

    s = NS(env=NS(world_size=1, local_rank=0), num_params=10, cfg=NS(device="cpu"), load_ckpt_s=None)
    sums = {"loss": 2.0, "tokens": 4.0, "entropy": 1.0, "num_tokens": 4.0, "computed_tokens": 4.0}
    result = StepResult(sums=sums, grad_norm=1.0, lr=1e-3, time_forward_backward_s=0.5, zero_grad_ratio=0.25)
    m = runner.step_metrics(s, result, 1.0, 0.1)  # type: ignore[arg-type]
    assert m["optim/zero_grad_ratio"] == 0.25


def test_a_run_of_the_multirun_trainer_gives_each_environment_s_figures(tmp_path):
    from prime_hpc.trainer.multirun import step_inputs
    from prime_hpc.trainer.rl import scoped_metrics

    run = RunDir(tmp_path / "run")
    batch.write_step(run, 3, batch.shard(_samples([7, 12, 5, 9, 4, 11], seed=1), 1, 2), {"mode": "rl"})
    data = batch.read_rank(run, 3, 0, timeout_s=5)
    assert data.envs == ["count", "math/easy"]
    loss_cfg = NS(type="dppo", seq_clip_low=0.05, seq_clip_high=0.05, **LOSS)
    trainer = NS(loss=loss_cfg, micro_batch_tokens=32, type="rl")
    s = NS(cfg=NS(seq_len=16, trainer=trainer), env=NS(world_size=1))
    micro_batches, loss_fn = step_inputs(s, data, 3, False)  # type: ignore[arg-type]
    assert all("env_index" in mb for mb in micro_batches)
    result = _engine(_tiny()).train_step(micro_batches, loss_fn, step=3)
    got = scoped_metrics(result.sums)
    for scope in ("all", "count", "math/easy"):
        assert got[f"entropy/{scope}/mean"] > 0, scope
        for stat in ("mean", "std", "max"):
            assert f"mismatch_kl/{scope}/{stat}" in got, (scope, stat)
    tokens = result.sums["env/count/tokens"] + result.sums["env/math/easy/tokens"]
    assert 0 < tokens < result.sums["tokens"]  # the samples without an environment count in `all` alone
    assert got["mismatch_kl/all/mean"] == pytest.approx(result.sums["mismatch_kl"] / result.sums["tokens"])
