"""`trainer.loss.target_kl` in the RL trainer, on the tiny model in one process: a step
trains with the controller's weight of the reference KL, the weight moves by the KL the
step measured, a checkpoint keeps the next step's weight (a real DCP checkpoint and its
state.json) and a resumed run continues with it; a checkpoint without one starts from the
configured value; the weight is a metric of the step."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch

from prime_hpc.rundir import RunDir, batch

KNOBS = ["trainer.loss.ref_kl_coef=0.1", "trainer.loss.target_kl=0.0001", "trainer.loss.kl_horizon=4"]


def _tiny():
    from transformers import AutoModelForCausalLM

    from prime_hpc.model import resolve_model

    return AutoModelForCausalLM.from_pretrained(resolve_model("tiny"), dtype=torch.float32)


def _samples(n: int = 4) -> list[batch.Sample]:
    g = torch.Generator().manual_seed(0)
    return [
        batch.Sample(
            input_ids=torch.randint(0, 101, (9,), generator=g).tolist(),
            loss_mask=[False] * 3 + [True] * 6,
            inference_logprobs=(-torch.rand(9, generator=g) * 3).tolist(),
            advantage=float(torch.randn(1, generator=g)),
            policy_step=0,
            env="count",
        )
        for _ in range(n)
    ]


@pytest.fixture
def one_process(tmp_path):
    """A gloo process group of one rank (what a checkpoint's collectives need), gone after."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _session(tmp_path: Path, overrides: list[str], resumed: dict | None = None, start: int = 0) -> NS:
    """The parts of a trainer session the RL step reads, all real: the run's composed
    trainer config, the tiny model's engine, its checkpointer."""
    from prime_hpc.trainer.ckpt import Checkpointer
    from prime_hpc.trainer.config import load_config
    from prime_hpc.trainer.engine import Engine
    from prime_hpc.trainer.model import Policy
    from tests.trainer_support import trainer_yaml

    run = RunDir(tmp_path / "run")
    cfg = load_config(trainer_yaml(run.root, ["seq_len=64", "ckpt.interval=1", "max_steps=5", *overrides]))
    model = _tiny()
    policy = Policy(
        model=model,
        tokenizer=None,
        source="",
        hf_config=model.config,
        generation_config=None,
        save_dtype=torch.float32,
        sharded=False,
        chunked_logprobs="false",
    )
    env = NS(device=torch.device("cpu"), device_kind="cpu", world_size=1, rank=0, is_main=True)
    engine = Engine(policy, env, cfg.trainer.optim, total_steps=cfg.max_steps)  # type: ignore[arg-type]
    ckpt = Checkpointer(run, cfg.ckpt, env)  # type: ignore[arg-type]
    return NS(cfg=cfg, run=run, env=env, policy=policy, engine=engine, ckpt=ckpt, resumed=resumed, start_step=start)


def _reference(model) -> torch.nn.Module:
    """A frozen policy somewhat apart from the trained one, so the reference KL is > 0."""
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
            p.requires_grad_(False)
    return ref.eval()


def test_a_step_trains_with_the_controller_s_weight_and_a_resumed_run_continues_with_it(tmp_path, one_process):
    from prime_hpc.trainer import rl

    s = _session(tmp_path, KNOBS)
    reference = _reference(s.policy.model)
    kl = rl._kl_controller(s)  # type: ignore[arg-type]
    assert (kl.coef, kl.target, kl.horizon) == (0.1, 0.0001, 4)
    progress = {"num_tokens": 0, "num_samples": 0}
    batch.write_step(s.run, 1, batch.shard(_samples(), 1, 2), {"mode": "rl"})
    data = batch.read_rank(s.run, 1, 0, timeout_s=5)
    coef = kl.coef
    result = rl._train_on(s, data, 1, reference, coef)  # type: ignore[arg-type]
    measured = rl.ref_kl_mean(result.sums)
    assert measured is not None and measured > 0.0001  # far above the target: the weight grows
    assert kl.update(measured) == pytest.approx(0.1 * (1 + 0.2 / 4), rel=1e-12)
    rl._checkpoint_and_prune(s, 1, result, progress, kl.state())  # type: ignore[arg-type]
    s.ckpt.close()
    state = json.loads((s.run.checkpoint_part(1, "trainer") / "state.json").read_text())
    assert state["ref_kl_coef"] == pytest.approx(0.105, rel=1e-12) and state["progress"] == progress

    again = _session(tmp_path, KNOBS, start=1)
    again.resumed = again.ckpt.load(1, again.engine)
    assert rl._kl_controller(again).coef == pytest.approx(0.105, rel=1e-12)  # type: ignore[arg-type]
    again.ckpt.close()


def test_the_weight_weighs_the_step_s_reference_kl(tmp_path, one_process):
    """Two steps from the same weights on the same batch, with weights 0.1 and 0.4 of the
    reference KL: their losses differ by 0.3 x the reference KL per loss token."""
    from prime_hpc.trainer import rl

    losses, kls = [], []
    for coef in (0.1, 0.4):
        torch.manual_seed(0)
        s = _session(tmp_path / str(coef), KNOBS)
        reference = _reference(s.policy.model)
        batch.write_step(s.run, 1, batch.shard(_samples(), 1, 2), {"mode": "rl"})
        result = rl._train_on(s, batch.read_rank(s.run, 1, 0, timeout_s=5), 1, reference, coef)  # type: ignore[arg-type]
        losses.append(result.sums["loss"] / result.sums["tokens"])
        kls.append(rl.ref_kl_mean(result.sums))
        s.ckpt.close()
    assert kls[0] == pytest.approx(kls[1], rel=1e-9)
    assert losses[1] - losses[0] == pytest.approx(0.3 * kls[0], rel=1e-6)


def test_a_checkpoint_without_a_weight_resumes_from_the_configured_one_and_a_bad_one_is_refused(tmp_path):
    from prime_hpc.core.errors import UserError
    from prime_hpc.trainer import rl
    from prime_hpc.trainer.config import load_config
    from tests.trainer_support import trainer_yaml

    run = RunDir(tmp_path / "run")
    cfg = load_config(trainer_yaml(run.root, KNOBS))
    old = {"step": 4, "world_size": 1, "scheduler": {}, "progress": {"num_tokens": 1, "num_samples": 1}}
    s = NS(cfg=cfg, run=run, resumed=old, start_step=4)
    assert rl._kl_controller(s).coef == 0.1  # type: ignore[arg-type]
    s.resumed = {**old, "ref_kl_coef": -2}
    where = run.checkpoint_part(4, "trainer") / "state.json"
    with pytest.raises(UserError, match=f"^{where}: ref_kl_coef -2 is not a positive number"):
        rl._kl_controller(s)  # type: ignore[arg-type]


def test_the_step_s_weight_is_a_metric_of_the_step(tmp_path):
    from prime_hpc.trainer.engine import StepResult
    from prime_hpc.trainer.rl import log_step

    rows = []
    s = NS(
        cfg=NS(device="cpu"),
        env=NS(world_size=1, local_rank=0),
        num_params=10,
        load_ckpt_s=None,
        metrics=NS(log=lambda step, m: rows.append((step, m))),
    )
    sums = {
        "tokens": 4.0,
        "loss": 2.0,
        "entropy": 1.0,
        "num_tokens": 8.0,
        "num_samples": 2.0,
        "off_policy_steps": 0.0,
        "ref_kl": 0.4,
    }
    result = StepResult(sums=sums, grad_norm=1.0, lr=1e-3, time_forward_backward_s=0.1)
    log_step(s, 3, result, 1.0, 0.0, 0.0, {"num_tokens": 8, "num_samples": 2}, {}, ref_kl_coef=0.25)  # type: ignore[arg-type]
    log_step(s, 4, result, 1.0, 0.0, 0.0, {"num_tokens": 8, "num_samples": 2}, {})  # type: ignore[arg-type]
    (_, with_penalty), (_, without) = rows
    assert with_penalty["loss/ref_kl_coef"] == 0.25 and with_penalty["ref_kl/mean"] == pytest.approx(0.1)
    assert "loss/ref_kl_coef" not in without
