"""The trainer's per-environment and zero-gradient figures: each sample's environment
travels from the orchestrator's batch file through packing (older batches, without it,
still read), the step's metrics per scope, and the zero-gradient count."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch

from prime_hpc.rundir import RunDir, batch


def _sample(n: int, env: str, step: int = 0) -> batch.Sample:
    return batch.Sample(
        input_ids=list(range(1, n + 1)),
        loss_mask=[False, False] + [True] * (n - 2),
        inference_logprobs=[-0.5] * n,
        advantage=1.0,
        policy_step=step,
        env=env,
    )


def test_each_sample_s_environment_travels_to_the_packed_micro_batches(tmp_path):
    run = RunDir(tmp_path / "run")
    samples = [_sample(5, "count"), _sample(9, "math/easy"), _sample(4, ""), _sample(7, "count")]
    per_rank = batch.shard(samples, 2, 1)
    batch.write_step(run, 1, per_rank, {"mode": "rl"})
    got = [batch.read_rank(run, 1, rank, timeout_s=5) for rank in (0, 1)]
    # every rank's file names every environment of the step, even one it has no sample of
    assert [b.envs for b in got] == [["count", "math/easy"]] * 2
    unpacked = [s for b in got for s in batch.unpack(b.micro_batches)]
    assert sorted((len(s), s.env) for s in unpacked) == [(4, ""), (5, "count"), (7, "count"), (9, "math/easy")]
    for b in got:
        for mb in batch.pack(batch.unpack(b.micro_batches), 16, 32):
            lengths = [int((mb["sample_index"] == k).sum()) for k in range(len(mb["envs"]))]
            assert [{4: "", 5: "count", 7: "count", 9: "math/easy"}[n] for n in lengths] == mb["envs"]
    assert batch.empty_packed()["envs"] == []


def test_a_batch_of_an_older_run_reads_without_environments(tmp_path):
    run = RunDir(tmp_path / "run")
    batch.write_step(run, 1, batch.shard([_sample(5, "count"), _sample(6, "math")], 1, 2))
    path = run.rollout_file(1, 0)
    data = torch.load(path, weights_only=True)
    del data["envs"]
    for mb in data["micro_batches"]:
        del mb["envs"]
    torch.save(data, path)
    got = batch.read_rank(run, 1, 0, timeout_s=5)
    assert got.envs == []
    assert [s.env for s in batch.unpack(got.micro_batches)] == ["", ""]


def test_a_file_whose_environments_are_not_names_is_one_line_naming_it(tmp_path):
    run = RunDir(tmp_path / "run")
    batch.write_step(run, 1, batch.shard([_sample(5, "count")], 1, 1))
    path = run.rollout_file(1, 0)
    data = torch.load(path, weights_only=True)
    data["envs"] = [3]
    torch.save(data, path)
    with pytest.raises(RuntimeError, match=f"{path}: 'envs' must be a list of environment names"):
        batch.read_rank(run, 1, 0, timeout_s=5)


def test_the_env_index_places_each_sample_in_the_step_s_environments():
    from prime_hpc.trainer.rl import add_env_index

    mbs = batch.pack([_sample(5, "b"), _sample(9, "a"), _sample(4, ""), _sample(7, "c")], 32, 64)
    mbs.append(batch.empty_packed())
    add_env_index(mbs, ["a", "b"])
    assert mbs[0]["env_index"].tolist() == [{"a": 0, "b": 1}.get(e, 2) for e in mbs[0]["envs"]]
    assert mbs[1]["env_index"].shape == (0,)


def test_scoped_metrics_leave_out_an_environment_without_tokens_and_the_kl_of_sft():
    from prime_hpc.trainer.rl import scoped_metrics

    sums = {
        "tokens": 4.0,
        "entropy": 8.0,
        "mismatch_kl": 2.0,
        "mismatch_kl_sq": 1.5,
        "mismatch_kl/max": 0.9,
        **{"env/a/tokens": 4.0, "env/a/entropy": 8.0, "env/a/mismatch_kl": 2.0},
        **{"env/a/mismatch_kl_sq": 1.5, "env/a/mismatch_kl/max": 0.9},
        **{"env/b/tokens": 0.0, "env/b/entropy": 0.0, "env/b/mismatch_kl": 0.0},
        **{"env/b/mismatch_kl_sq": 0.0, "env/b/mismatch_kl/max": 0.0},
    }
    got = scoped_metrics(sums)
    for scope in ("all", "a"):
        assert got[f"mismatch_kl/{scope}/mean"] == 0.5
        assert got[f"mismatch_kl/{scope}/std"] == pytest.approx((1.5 / 4 - 0.25) ** 0.5)
        assert got[f"mismatch_kl/{scope}/max"] == 0.9
        assert got[f"entropy/{scope}/mean"] == 2.0
    assert not [k for k in got if "/b/" in k]
    sft = {k: v for k, v in sums.items() if "mismatch_kl" not in k}
    assert scoped_metrics(sft) == {"entropy/all/mean": 2.0, "entropy/a/mean": 2.0}


def test_zero_gradients_count_every_element_of_a_parameter_without_one():
    from prime_hpc.trainer.engine import Engine

    a, b, c = (torch.nn.Parameter(torch.ones(n)) for n in (4, 6, 10))
    policy = NS(model=None, trainable=[a, b, c])
    optim = NS(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, warmup_steps=0, schedule="constant", min_lr_ratio=0.0)
    engine = Engine(policy, NS(device=torch.device("cpu"), world_size=1), optim)  # type: ignore[arg-type]
    a.grad = torch.tensor([0.0, 1.0, 0.0, -2.0])
    b.grad = torch.tensor([1e-30, 0.0, 3.0, 0.0, 0.0, 4.0])
    c.grad = None
    assert engine.zero_grads().tolist() == [2 + 3 + 10, 20]
