"""Checkpoints survive kills: the trainer is SIGKILLed at the exact moment it writes a
checkpoint (synchronously, and from the background thread of `ckpt.save_async`) or deletes
one in rotation (`tests/killpoint.py` stops it before a chosen file operation). After each
kill the test first checks that the kill left what it meant to (a torn, unmarked
checkpoint), then resumes as `prime-hpc resume` does: the step picked is the previous
complete one, it loads, and training continues from it. A checkpoint the disk has no room
for (a real ENOSPC, on a small tmpfs) fails the trainer in one line and keeps the earlier
ones. The orchestrator's part is killed the same way, inside the write of its state, of its
marker and inside rotation's deletion; each kill is checked to have landed there."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from prime_hpc.job.attempt import resume_point
from prime_hpc.rundir import STABLE, TMP_PREFIX, RunDir
from tests.trainer_support import child_env, explain, run_trainer, trainer_yaml

SFT = "prime_hpc.trainer.sft"
DATA = [
    "trainer=sft",
    "seq_len=128",
    "trainer.data.name=reverse_text:make_sft_dataset",
    "+trainer.data.args={num_examples: 400}",
    "trainer.data.batch_size=8",
    "trainer.micro_batch_size=4",
]
CKPT = ["ckpt.interval=1", "ckpt.keep_last=2"]
SHARD, DCP_METADATA = "__0_0.distcp", ".metadata"  # one rank: DCP writes one shard file, then its metadata
WHOLE = {SHARD, DCP_METADATA, "rng_rank_0.pt", "state.json", STABLE}  # a complete trainer checkpoint


def _kill_trainer_at(run: RunDir, overrides: list[str], kind: str, step: int, name: str, nth: int = 1) -> str:
    """Run the SFT trainer and SIGKILL it before its `nth` `kind` operation (write, rename,
    remove) on a file of `checkpoints/step_<step>/trainer/` whose name starts with `name`;
    returns the line saying where it was killed. A resume (`ckpt.step=-1`) goes the way
    `prime-hpc resume` goes: the step is picked and what came after it cleared first."""
    config = trainer_yaml(run.root, [*DATA, *CKPT, *overrides])
    if "ckpt.step=-1" in overrides:
        resume_point(run, restarted=False)
    pattern = re.escape(f"{run.checkpoint_part(step, 'trainer')}/{name}")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.killpoint", kind, pattern, str(nth), "-m", SFT, "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=900,
        env=child_env(),
        cwd=str(config.parent),
    )
    assert proc.returncode == -signal.SIGKILL, explain(proc)
    return next(line for line in proc.stderr.splitlines() if line.startswith("killpoint: "))


def _files(run: RunDir, step: int) -> set[str]:
    return {p.name for p in run.checkpoint_part(step, "trainer").iterdir()}


def _assert_torn_write(run: RunDir, step: int) -> None:
    """Step `step` was being written: its shard is on disk, DCP's metadata and the marker are not."""
    files = _files(run, step)
    assert SHARD in files and (run.checkpoint_part(step, "trainer") / SHARD).stat().st_size > 0, files
    assert DCP_METADATA not in files and STABLE not in files, files


def _resume(run: RunDir, picks: int, overrides: list[str], kill: tuple) -> str:
    """Resume (`ckpt.step=-1`): the pick must be `picks`; then run until the kill `kill`."""
    complete = run.complete_checkpoint_steps(("trainer",))
    assert complete and complete[-1] == picks, complete
    return _kill_trainer_at(run, ["ckpt.step=-1", *overrides], *kill)


def _steps_trained(run: RunDir) -> list[int]:
    return [json.loads(line)["step"] for line in run.metrics("trainer").read_text().splitlines()]


def test_a_trainer_killed_while_checkpointing_resumes_from_the_previous_complete_checkpoint(tmp_path):
    run = RunDir(tmp_path / "run")
    # 1. killed while writing step 3 (its shard written, DCP's metadata next)
    _kill_trainer_at(run, ["max_steps=8"], "write", 3, DCP_METADATA)
    _assert_torn_write(run, 3)
    assert run.complete_checkpoint_steps(("trainer",)) == [1, 2]
    # 2. resumed from 2 (not the torn 3), it writes 3 and 4; killed while rotation deletes
    #    step 2 (its marker and one file gone, the rest not yet)
    _resume(run, 2, ["max_steps=8"], ("remove", 2, "", 3))
    left = _files(run, 2)
    assert STABLE not in left and 0 < len(left) < len(WHOLE) - 1, left
    assert run.complete_checkpoint_steps(("trainer",)) == [3, 4]
    assert _steps_trained(run) == [1, 2, 3]  # from step 2 on (4's row follows its checkpoint: killed before)
    # 3. resumed from 4 (not the half-deleted 2) with background saves: killed while the
    #    background thread writes step 5, as the training thread goes on
    where = _resume(run, 4, ["max_steps=8", "ckpt.save_async=true"], ("write", 5, DCP_METADATA))
    assert "in thread MainThread" not in where, where
    _assert_torn_write(run, 5)
    assert run.complete_checkpoint_steps(("trainer",)) == [3, 4]
    # 4. resumed from 4 once more: the pick loads, training continues to the end, and the
    #    next rotation removes what the kills left (the half-deleted step 2)
    complete = run.complete_checkpoint_steps(("trainer",))
    assert complete[-1] == 4, complete
    config = trainer_yaml(run.root, [*DATA, *CKPT, "ckpt.save_async=true", "ckpt.step=-1", "max_steps=7"])
    assert resume_point(run, restarted=False) == 4
    proc = run_trainer(SFT, config, nproc=1)
    assert proc.returncode == 0, explain(proc)
    assert _steps_trained(run) == [1, 2, 3, 5, 6, 7]  # each step once: every resume went on from its pick
    assert run.complete_checkpoint_steps(("trainer",)) == run.checkpoint_steps("trainer") == [6, 7]
    assert _files(run, 7) == WHOLE


@contextlib.contextmanager
def _tmpfs(where: Path, size: str) -> Iterator[None]:
    """A tmpfs of `size` mounted at `where` for the duration (root only: CI runs as root)."""
    where.mkdir(parents=True)
    got = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)], capture_output=True, text=True
    )
    if got.returncode != 0:
        pytest.fail(
            f"this test needs to mount a tmpfs (root, as in CI): mount at {where} failed: {got.stderr.strip()}",
            pytrace=False,
        )
    try:
        yield
    finally:
        if subprocess.run(["umount", str(where)]).returncode != 0:
            subprocess.run(["umount", "--lazy", str(where)])


def _error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, explain(proc)
    return proc.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("save_async", [False, True], ids=["save", "save_async"])
def test_a_full_disk_fails_the_checkpoint_in_one_line_and_keeps_the_earlier_ones(tmp_path, save_async):
    """A real ENOSPC: checkpoints/ is a tmpfs with room for the first checkpoint (10.2 MB
    with one rank: model, Adam state, RNG) and not for the second."""
    run = RunDir(tmp_path / "run")
    with _tmpfs(run.checkpoints_dir, "16m"):
        overrides = [*DATA, "max_steps=3", "ckpt.interval=1", f"ckpt.save_async={str(save_async).lower()}"]
        proc = run_trainer(SFT, trainer_yaml(run.root, overrides), nproc=1)
        assert _error_line(proc) == (
            f"python -m {SFT}: error: the checkpoint of step 2 could not be written to "
            f"{run.checkpoint_part(2, 'trainer')}: OSError: [Errno 28] No space left on device; "
            "the earlier checkpoints are kept"
        )
        assert run.complete_checkpoint_steps(("trainer",)) == [1] and _files(run, 1) == WHOLE
        # room again: the resume loads step 1 and goes on
        subprocess.run(["mount", "-o", "remount,size=64m", str(run.checkpoints_dir)], check=True)
        config = trainer_yaml(run.root, [*DATA, "max_steps=3", "ckpt.interval=1", "ckpt.step=-1"])
        assert resume_point(run, restarted=False) == 1
        proc = run_trainer(SFT, config, nproc=1)
        assert proc.returncode == 0, explain(proc)
        assert _steps_trained(run) == [1, 2, 3]
        assert run.complete_checkpoint_steps(("trainer",)) == [1, 2, 3]


def test_a_checkpoint_directory_that_cannot_be_made_fails_in_one_line_and_keeps_the_earlier_ones(tmp_path):
    run = RunDir(tmp_path / "run")
    run.checkpoint_step(2).parent.mkdir(parents=True)
    run.checkpoint_step(2).write_text("in the way")  # a file where step 2's directory must go
    proc = run_trainer(SFT, trainer_yaml(run.root, [*DATA, "max_steps=3", "ckpt.interval=1"]), nproc=1)
    last = _error_line(proc)
    assert f"the checkpoint of step 2 could not be written to {run.checkpoint_part(2, 'trainer')}: " in last, last
    assert last.endswith("; the earlier checkpoints are kept"), last
    assert run.complete_checkpoint_steps(("trainer",)) == [1] and _files(run, 1) == WHOLE
    assert os.path.isfile(run.checkpoint_step(2))


ORCHESTRATOR_SAVES = r"""
import sys
from prime_hpc.config.component import component_config
from prime_hpc.config.compose import compose
from prime_hpc.orchestrator.loop import Orchestrator

cfg = compose(["+experiment=reverse_text", f"output_dir={sys.argv[1]}", "ckpt.keep_last=2"])
orch = Orchestrator(component_config(cfg, "orchestrator"))
for step in range(int(sys.argv[2]), int(sys.argv[3])):
    orch.snapshots[step] = {"step": step, "policy": step, "totals": {"tokens": step}, "sampler": {"pad": "x" * 200000}}
    orch.save_checkpoint(step)
"""
PAD = 200000  # the size of a saved state is a little more


def _orchestrator_saves(run: RunDir, first: int, end: int, kill: tuple[str, int, str] | None = None) -> str:
    """The orchestrator saves its part of steps first..end-1 (rotation keeps 2), SIGKILLed
    (`tests/killpoint.py`) before its first `kind` operation on `checkpoints/step_<step>/
    orchestrator/<name>` when `kill` = (kind, step, name) is given; returns the killpoint's line."""
    code = [sys.executable, "-c", ORCHESTRATOR_SAVES, str(run.root), str(first), str(end)]
    if kill is not None:
        kind, step, name = kill
        pattern = re.escape(f"{run.checkpoint_part(step, 'orchestrator')}/{name}") + "$"
        code = [sys.executable, "-m", "tests.killpoint", kind, pattern, "1", *code[1:]]
    proc = subprocess.run(code, capture_output=True, text=True, timeout=300, env=child_env())
    if kill is None:
        assert proc.returncode == 0, explain(proc)
        return ""
    assert proc.returncode == -signal.SIGKILL, explain(proc)
    return next(line for line in proc.stderr.splitlines() if line.startswith("killpoint: "))


def _orchestrator_parts(run: RunDir, step: int) -> dict[str, int]:
    d = run.checkpoint_part(step, "orchestrator")
    return {p.name: p.stat().st_size for p in d.iterdir()}


def _assert_loadable(run: RunDir, complete: list[int]) -> None:
    """The complete parts are `complete`, and each is whole: what resume could pick loads."""
    assert run.complete_checkpoint_steps(("orchestrator",)) == complete
    for step in complete:
        state = json.loads((run.checkpoint_part(step, "orchestrator") / "state.json").read_text())
        assert state["step"] == step and len(state["sampler"]["pad"]) == PAD


def _killed_inside_a_write(where: str, run: RunDir, step: int, name: str) -> None:
    """The kill landed inside the atomic write of `name`: its data whole in a temporary file
    of the same directory (the killpoint saw it there, and it is still there), not yet in
    place under its name."""
    part = run.checkpoint_part(step, "orchestrator")
    m = re.fullmatch(
        rf"killpoint: SIGKILL before rename {re.escape(f'{part}/{name}')} from (\S+) \((\d+) bytes\) .*", where
    )
    assert m, where
    tmp, size = Path(m[1]), int(m[2])
    assert tmp.parent == part and tmp.name.startswith(f"{TMP_PREFIX}{name}."), where
    files = _orchestrator_parts(run, step)
    assert files.get(tmp.name) == size > 0 and name not in files and STABLE not in files, files


def test_an_orchestrator_killed_while_saving_its_state_leaves_only_loadable_parts(tmp_path):
    """SIGKILL at three moments of the orchestrator's save, each checked to have landed
    inside it: its state's file written and not in place, the state in place and its marker
    not, and rotation's deletion of an old part halfway. No moment leaves a part that looks
    complete and does not load, and the next saves' rotation removes what the kills left."""
    run = RunDir(tmp_path / "run")
    # 1. step 3's state.json whole in its temporary file, not renamed into place
    where = _orchestrator_saves(run, 1, 99, ("rename", 3, "state.json"))
    _killed_inside_a_write(where, run, 3, "state.json")
    assert int(re.search(r"\((\d+) bytes\)", where)[1]) > PAD  # the state's data, all of it
    _assert_loadable(run, [1, 2])
    # 2. step 4's state.json in place, its marker written to its temporary file, not in place
    where = _orchestrator_saves(run, 4, 99, ("rename", 4, STABLE))
    _killed_inside_a_write(where, run, 4, STABLE)
    assert _orchestrator_parts(run, 4)["state.json"] > PAD
    _assert_loadable(run, [1, 2])
    # 3. step 5 saved; rotation (keep 2) deletes step 1 first: its marker gone, its state not yet
    where = _orchestrator_saves(run, 5, 99, ("remove", 1, "state.json"))
    assert where.startswith(f"killpoint: SIGKILL before remove {run.checkpoint_part(1, 'orchestrator')}/state.json")
    assert set(_orchestrator_parts(run, 1)) == {"state.json"}
    _assert_loadable(run, [2, 5])
    # 4. the next saves: every part the kills left (1, 3, 4) and the rotated ones are gone
    _orchestrator_saves(run, 6, 8)
    _assert_loadable(run, [6, 7])
    assert run.checkpoint_steps("orchestrator") == [6, 7]
