"""The trainer's distributions in W&B (`wandb.log_extras.trainer`): on a due step, histograms
of the trained tokens' entropy and advantages, binned between their smallest and largest
values; an RL trainer (whose W&B run the orchestrator writes) appends them to
`metrics/trainer_distributions.jsonl`, which the orchestrator's logger forwards into the
run's W&B run under the trainer's step."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace as NS

import pytest
import torch

from prime_hpc.config.schema import WandbConfig
from prime_hpc.rundir import RunDir, batch
from prime_hpc.runtime.metrics import MetricsLogger
from prime_hpc.trainer import distributions, loss
from tests.unit.test_trainer_engine import LOSS, _engine, _samples, _tiny
from tests.wandb_records import history_keys


def _wandb(**extras) -> WandbConfig:
    cfg = WandbConfig(enabled=True, project="p", offline=True)
    for k, v in extras.items():
        setattr(cfg.log_extras.trainer if k.startswith("trainer_") else cfg.log_extras, k.removeprefix("trainer_"), v)
    return cfg


def test_due_steps_follow_the_trainer_s_interval_or_the_run_s():
    assert [s for s in range(1, 31) if distributions.due(_wandb(), s)] == [10, 20, 30]
    assert [s for s in range(1, 31) if distributions.due(_wandb(trainer_interval=15), s)] == [15, 30]
    assert not any(distributions.due(_wandb(trainer_interval=0), s) for s in range(1, 31))
    assert not any(distributions.due(_wandb(trainer_distributions=False), s) for s in range(1, 31))
    off = _wandb()
    off.enabled = False
    assert not any(distributions.due(off, s) for s in range(1, 31))


def test_a_due_step_writes_the_trained_tokens_histograms_and_the_orchestrator_forwards_them(tmp_path):
    from prime_hpc.trainer.rl import make_loss_fn

    samples = _samples([7, 12, 5, 9, 4, 11], seed=5)
    padded = batch.shard(samples, 1, 3)[0]
    model = _tiny()
    ref = copy.deepcopy(model)
    entropies, advantages = [], []  # of each trained token, by the model before the step
    for mb in padded:
        _, ent = loss.token_logprobs(
            ref(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"].long()).logits, mb["input_ids"]
        )
        mask = mb["loss_mask"].bool()
        entropies += ent[mask].tolist()
        advantages += mb["advantages"][mask].tolist()

    run = RunDir(tmp_path)
    cfg = NS(wandb=_wandb(interval=2))
    engine = _engine(model)
    loss_fn = make_loss_fn(NS(type="dppo", **LOSS), step=1, mode="rl")
    with MetricsLogger(run, "trainer", cfg.wandb, wandb_writer=False) as metrics:
        s = NS(cfg=cfg, engine=engine, env=engine.env, metrics=metrics)
        for step in (1, 2):
            distributions.logged(s, step, lambda: engine.train_step(batch.pack(batch.unpack(padded), 16, 64), loss_fn))
    assert engine.collector is None
    (row,) = [json.loads(line) for line in run.metrics("trainer_distributions").read_text().splitlines()]
    assert row["step"] == 2 and set(row) == {"step", "distributions/trainer/entropy", "distributions/trainer/advantage"}
    # step 2's entropies are those of the model step 1 trained (their count compared); the
    # advantages are the batch's, binned as torch bins them
    ent = row["distributions/trainer/entropy"]
    adv = row["distributions/trainer/advantage"]
    for hist, values in ((ent, None), (adv, advantages)):
        assert len(hist["counts"]) == distributions.BINS and len(hist["edges"]) == distributions.BINS + 1
        assert sum(hist["counts"]) == len(entropies)  # every trained token, once
        if values is not None:
            assert hist["edges"][0] == pytest.approx(min(values)) and hist["edges"][-1] == pytest.approx(max(values))
            want = torch.histc(torch.tensor(values, dtype=torch.float64), distributions.BINS, min(values), max(values))
            assert hist["counts"] == [int(c) for c in want.tolist()]
    assert 0 <= ent["edges"][0] < ent["edges"][-1] <= torch.log(torch.tensor(float(model.config.vocab_size)))

    # the orchestrator's logger (the run's W&B writer) forwards them with the trainer's rows
    with MetricsLogger(run, "orchestrator", _wandb()) as o:
        o.follow("trainer")
        assert o.forward() == 1
    (offline,) = run.wandb_dir.rglob("offline-run-*")
    keys = set().union(*history_keys(next(offline.glob("run-*.wandb"))))
    assert {"distributions/trainer/entropy/_type", "distributions/trainer/advantage/_type", "trainer/step"} <= keys


def test_an_sft_step_has_no_advantages_and_a_single_value_gets_a_bin_of_its_own():
    c = distributions.Collector()
    mask = torch.tensor([[False, True, True, False]])
    c.add({"loss_mask": mask}, torch.tensor([[9.0, 0.25, 0.25, 9.0]]))
    env = NS(world_size=1, device=torch.device("cpu"))
    (name, hist), *rest = c.histograms(env, bins=4).items()
    assert not rest and name == "distributions/trainer/entropy"
    assert sum(hist["counts"]) == 2 and hist["edges"][0] < 0.25 < hist["edges"][-1]
    assert distributions.Collector().histograms(env) == {}
