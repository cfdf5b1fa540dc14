"""Weights-only snapshots (`ckpt.weights_only`, `ckpt.weights.interval`,
`ckpt.weights.keep_last`), on the tiny model in one process: the RL trainer's step loop
(`rl._train_on`, the filesystem hand-off `runner.save_weights`, `rl._checkpoint_and_prune`)
keeps `weights/step_<n>` at the snapshot steps without writing a checkpoint, keeps them past
the async window by their own retention (never the weights of a checkpointed step), and a
snapshot is not a resume point."""

from __future__ import annotations

from pathlib import Path

import pytest

from prime_hpc.core.errors import UserError
from prime_hpc.rundir import RunDir, batch
from tests.unit.test_adaptive_kl import _samples, _session, one_process  # noqa: F401  (a fixture)


def _run_steps(tmp_path: Path, overrides: list[str], steps: int = 6) -> RunDir:
    """`steps` RL steps of the tiny model, each followed by what the trainer does after a
    step with `weights.transport=filesystem`: write the weights, checkpoint when due, prune."""
    import dataclasses

    from prime_hpc.model import resolve_model
    from prime_hpc.trainer import rl, runner

    s = _session(tmp_path, [f"max_steps={steps}", "async_level=1", *overrides])
    s.policy = dataclasses.replace(s.policy, source=str(resolve_model("tiny")))  # its tokenizer files
    progress = {"num_tokens": 0, "num_samples": 0}
    try:
        for step in range(1, steps + 1):
            batch.write_step(s.run, step, batch.shard(_samples(), 1, 2), {"mode": "rl"})
            data = batch.read_rank(s.run, step, 0, timeout_s=5)
            result = rl._train_on(s, data, step, None, 0.0)  # type: ignore[arg-type]
            runner.save_weights(s, step)  # type: ignore[arg-type]
            rl._checkpoint_and_prune(s, step, result, progress, {})  # type: ignore[arg-type]
    finally:
        s.ckpt.close()
    return s.run


def test_weights_only_keeps_hf_weights_at_the_checkpoint_steps_and_writes_no_checkpoint(tmp_path, one_process):  # noqa: F811
    run = _run_steps(tmp_path, ["ckpt.interval=2", "ckpt.weights_only=true"])
    assert run.checkpoint_steps("trainer") == []
    assert not run.checkpoints_dir.exists() or not any(run.checkpoints_dir.iterdir())
    # 2, 4, 6 are snapshots; 5 is still in the async window; 1 and 3 were pruned as usual
    assert run.weight_steps() == [2, 4, 5, 6]
    assert (run.weights_step(2) / "model.safetensors").is_file() and (run.weights_step(2) / "config.json").is_file()
    from prime_hpc.rundir.checkpoints import resolve_resume_step

    with pytest.raises(UserError) as e:
        resolve_resume_step(run, 4, ("trainer", "orchestrator"))
    msg = str(e.value)
    assert "\n" not in msg and "ckpt.step=4" in msg and "only weights" in msg and "full checkpoint" in msg


def test_snapshot_retention_keeps_the_newest_and_never_a_checkpointed_step_s_weights(tmp_path, one_process):  # noqa: F811
    run = _run_steps(tmp_path, ["ckpt.interval=3", "ckpt.weights.interval=1", "ckpt.weights.keep_last=2"], steps=8)
    assert run.complete_checkpoint_steps(("trainer",)) == [3, 6, 8]
    # snapshots 1, 2, 4, 5, 7: retention keeps the newest two (5, 7); 1, 2 and 4 are past
    # the async window and go; the checkpointed 3 and 6 stay whatever keep_last says
    assert run.weight_steps() == [3, 5, 6, 7, 8]


def test_without_keep_last_every_snapshot_stays(tmp_path, one_process):  # noqa: F811
    run = _run_steps(tmp_path, ["ckpt.interval=null", "ckpt.weights.interval=2"])
    assert run.checkpoint_steps("trainer") == []
    assert run.weight_steps() == [2, 4, 5, 6]


def test_the_snapshot_schedule_and_the_broadcast_hand_off():
    from prime_hpc.rundir.checkpoints import full_weights_due, is_due, snapshot_due

    only = {"enabled": False, "interval": 5, "weights_only": True, "weights": {"interval": None}}
    assert not any(is_due(s, s == 12, only) for s in range(1, 13))
    assert [s for s in range(1, 13) if snapshot_due(s, s == 12, only)] == [5, 10, 12]
    both = {"enabled": True, "interval": 4, "weights_only": False, "weights": {"interval": 3}}
    assert [s for s in range(1, 13) if is_due(s, s == 12, both)] == [4, 8, 12]
    assert [s for s in range(1, 13) if snapshot_due(s, s == 12, both)] == [3, 6, 9, 12]
    sent = [s for s in range(1, 13) if full_weights_due(s, s == 12, both, "broadcast")]
    assert sent == [3, 4, 6, 8, 9, 12]  # broadcast writes the weights of snapshots and checkpoints
    end_only = {"enabled": False, "interval": None, "weights_only": True}  # no weights section: as before
    assert [s for s in range(1, 13) if snapshot_due(s, s == 12, end_only)] == [12]
