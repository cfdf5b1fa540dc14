"""Checkpoints survive kills: a trainer that saves every step is SIGKILLed again and again,
at the moment a checkpoint is being written or rotated away. After every kill, the step a
resume would pick (`ckpt.step=-1`) loads and training continues from it; a torn
checkpoint is never picked. An unwritable checkpoint fails the trainer in one line and
keeps the checkpoints before it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from prime_hpc.rundir import STABLE, RunDir
from tests.trainer_support import child_env, explain, run_trainer, trainer_cmd, trainer_yaml

SFT = "prime_hpc.trainer.sft"
DATA = ["trainer=sft", "seq_len=128", "trainer.data.name=reverse_text:make_sft_dataset",
        "+trainer.data.args={num_examples: 400}", "trainer.data.batch_size=8", "trainer.micro_batch_size=4"]
CKPT = ["max_steps=60", "ckpt.interval=1", "ckpt.keep_last=2"]
KILLS = 4


def _in_progress(run: RunDir) -> bool:
    """A trainer checkpoint being written (its directory exists, its marker not yet) or a
    marked one being rotated away (more than keep_last marked parts on disk)."""
    try:
        parts = [run.checkpoint_part(s, "trainer") for s in run.checkpoint_steps("trainer")]
    except OSError:
        return False
    marked = [p for p in parts if (p / STABLE).exists()]
    return any(p.is_dir() and not (p / STABLE).exists() for p in parts) or len(marked) > 2


def _kill_while_saving(run: RunDir, config: Path, timeout_s: float = 300) -> None:
    proc = subprocess.Popen(trainer_cmd(SFT, config, nproc=1), env=child_env(), cwd=str(config.parent),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        start = run.complete_checkpoint_steps(("trainer",))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"the trainer exited ({proc.returncode}) before it could be killed"
            if run.complete_checkpoint_steps(("trainer",)) != start and _in_progress(run):
                proc.send_signal(signal.SIGKILL)
                proc.wait(30)
                return
            time.sleep(0.001)
        raise AssertionError("no checkpoint write to interrupt")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_a_trainer_killed_while_checkpointing_resumes_from_a_complete_checkpoint(tmp_path):
    run = RunDir(tmp_path / "run")
    resumed = []
    for k in range(KILLS):
        config = trainer_yaml(run.root, [*DATA, *CKPT, *(["ckpt.step=-1"] if k else [])])
        _kill_while_saving(run, config)
        complete = run.complete_checkpoint_steps(("trainer",))
        assert complete, "no complete checkpoint after the kill"
        latest = complete[-1]
        files = {p.name for p in run.checkpoint_part(latest, "trainer").iterdir()}
        assert {".metadata", "state.json", STABLE} <= files, files
        resumed.append(latest)
    # the last kill's pick loads: a short continuation from it trains and saves again
    config = trainer_yaml(run.root, [*DATA, "ckpt.interval=1", "ckpt.keep_last=2", "ckpt.step=-1",
                                     f"max_steps={resumed[-1] + 2}"])
    proc = run_trainer(SFT, config, nproc=1)
    assert proc.returncode == 0, explain(proc)
    rows = [json.loads(line) for line in run.metrics("trainer").read_text().splitlines()]
    assert [r["step"] for r in rows][-2:] == [resumed[-1] + 1, resumed[-1] + 2]
    assert resumed == sorted(resumed) and len(set(resumed)) == KILLS, resumed  # each attempt got further


def test_an_unwritable_checkpoint_fails_in_one_line_and_keeps_the_earlier_ones(tmp_path):
    run = RunDir(tmp_path / "run")
    proc = run_trainer(SFT, trainer_yaml(run.root, [*DATA, "max_steps=2", "ckpt.interval=1"]), nproc=1)
    assert proc.returncode == 0, explain(proc)
    assert run.complete_checkpoint_steps(("trainer",)) == [1, 2]
    run.checkpoint_step(3).parent.mkdir(exist_ok=True)
    run.checkpoint_step(3).write_text("in the way")  # a file where step 3's directory must go
    config = trainer_yaml(run.root, [*DATA, "max_steps=4", "ckpt.interval=1", "ckpt.step=-1"])
    proc = run_trainer(SFT, config, nproc=1)
    assert proc.returncode == 1, explain(proc)
    last = proc.stderr.strip().splitlines()[-1]
    assert "the checkpoint of step 3 could not be written" in last and str(run.checkpoint_step(3)) in last and "Traceback" not in last, last
    assert run.complete_checkpoint_steps(("trainer",)) == [1, 2]
    assert os.path.isfile(run.checkpoint_step(3))


ORCHESTRATOR_SAVES = r"""
import sys
from prime_hpc.config.compose import compose, component_config
from prime_hpc.orchestrator.loop import Orchestrator

cfg = compose(["+experiment=reverse_text", f"output_dir={sys.argv[1]}", "ckpt.keep_last=2"])
orch = Orchestrator(component_config(cfg, "orchestrator"))
step = int(sys.argv[2])
print("saving", flush=True)
while True:
    orch.snapshots[step] = {"step": step, "policy": step, "totals": {"tokens": step}, "sampler": {"pad": "x" * 200000}}
    orch.save_checkpoint(step)
    step += 1
"""


def test_an_orchestrator_killed_while_saving_its_state_leaves_only_loadable_parts(tmp_path):
    import random
    import sys

    run = RunDir(tmp_path / "run")
    rng = random.Random(3)
    first = 1
    for _ in range(KILLS):
        proc = subprocess.Popen([sys.executable, "-c", ORCHESTRATOR_SAVES, str(run.root), str(first)], env=child_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "saving", proc.stderr.read()
            time.sleep(rng.uniform(0.05, 0.5))
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
        complete = run.complete_checkpoint_steps(("orchestrator",))
        assert complete, "no complete orchestrator state after the kill"
        for step in complete:  # every part resume could pick is whole
            state = json.loads((run.checkpoint_part(step, "orchestrator") / "state.json").read_text())
            assert state["step"] == step and len(state["sampler"]["pad"]) == 200000
        first = max(run.checkpoint_steps("orchestrator")) + 1
