"""The README's first command on this machine: `prime-hpc submit +experiment=reverse_text`
with the default cluster (local) submits the SFT warm-up and the RL run together; the RL job's
script waits for the warm-up (`attempt wait-for`, the local twin of SLURM's afterok) and
starts once it completed, from its final weights, and RL raises the reward.

Shortened to RL_STEPS steps at the recipe's learning rate held constant (its cosine decay
over so few steps would spend half of them at a small lr), without eval. The same recipe
runs on the dev cluster, longer and with everything after it, in test_slurm_pipeline.py."""

from __future__ import annotations

import time

import pytest
import yaml

from prime_hpc.rundir import RunDir, jobs
from prime_hpc.sched.local import run_state
from tests.conftest import cli
from tests.rewards import rewards, rows, trend

pytestmark = [pytest.mark.vllm]

# from the warm-up's weights at a constant 5e-4 the reward is flat for ~40 steps, then climbs:
# in three runs +0.052, +0.068, +0.072 (t 3.7-4.1) by step 60; by step 80 +0.089, +0.100,
# +0.109 and, in this test, +0.120 (t 6.4-7.2) (docs/trainer.md)
RL_STEPS = 80


def test_the_readme_command_warms_up_then_raises_the_reward_on_this_machine(tmp_path):
    out = tmp_path / "rt"
    r = cli(
        "submit",
        "+experiment=reverse_text",
        f"output_dir={out}",
        f"max_steps={RL_STEPS}",
        "trainer.optim.schedule=constant",
        "orchestrator.eval.at_start=false",
        "orchestrator.eval.interval=0",
    )
    assert r.returncode == 0, r.stderr
    rl, warm = RunDir(out), RunDir(out / "warmup")
    rl_id, warm_id = jobs.read_job(rl)["job_ids"][-1], jobs.read_job(warm)["job_ids"][-1]
    assert f"submitted warm-up job {warm_id} (reverse_text_warmup, sft, local)" in r.stdout, r.stdout
    assert f"submitted run job {rl_id} (reverse_text, rl, local), starts after job {warm_id} completes" in r.stdout
    try:
        assert run_state(rl) == "PENDING"  # waiting for the warm-up
        deadline = time.monotonic() + 1200
        while time.monotonic() < deadline and jobs.read_job(rl).get("state") not in jobs.FINAL_STATES:
            time.sleep(2)
        job, wjob = jobs.read_job(rl), jobs.read_job(warm)
        assert (wjob.get("state"), job.get("state")) == ("COMPLETED", "COMPLETED"), (wjob, job)
    finally:
        if jobs.read_job(rl).get("state") not in jobs.FINAL_STATES:
            cli("cancel", rl_id)  # the pipeline's two jobs
    # the RL job's one attempt began once the warm-up had ended
    assert len(job["attempts"]) == 1 and job["attempts"][0]["started_at"] >= wjob["ended_at"], (wjob, job)
    # the warm-up stopped early on its validation loss, its final weights those of its last step
    wrows = rows(warm, "trainer")
    stop_below = yaml.safe_load((warm.root / "config.yaml").read_text())["trainer"]["val"]["stop_below"]
    assert wrows[-1]["val/loss"] < stop_below and wrows[-1]["step"] < 1000, wrows[-1]
    last = warm.weight_steps()[-1]
    assert last == wrows[-1]["step"]
    # RL started from them: its server loaded them, and at step 1 the trainer's logprobs of
    # the server's samples are the server's (the same weights on both sides)
    server_log = (rl.latest_logs / "inference" / "node_0.log").read_text()
    assert f"--model {warm.weights_step(last)} " in server_log, server_log[:3000]
    trainer = rows(rl, "trainer")
    assert trainer[0]["off_policy_steps/mean"] == 0 and trainer[0]["mismatch_kl/mean"] < 1e-6, trainer[0]
    # and raised the reward: the least-squares line of the steps' mean reward (64 samples
    # each, scattering by ~0.04) rises, clear of that noise
    reward = rewards(rl)
    assert [r["step"] for r in trainer] == list(range(1, RL_STEPS + 1)) and len(reward) == RL_STEPS
    rise, t = trend(reward)
    print(f"RL from the warm-up's weights: reward {reward[0]:.3f} ... {reward[-1]:.3f}, rise {rise:.3f} (t = {t:.1f})")
    assert rise >= 0.03 and t >= 2.5, (rise, t)
