"""Runs that outlive their allocation, on the dev cluster: an RL run survives an `scontrol
requeue` (the trainer and the orchestrator checkpoint the step they are at, the next
attempt continues there), is cancelled and resumed by hand with more steps; an SFT run
whose time limit is shorter than the run reaches its last step over several attempts.
Asserted on the run directory and SLURM: every step trained and recorded exactly once, each
attempt recorded with why it ended."""
from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from prime_hpc.rundir import jobs
from prime_hpc.config import compose
from prime_hpc.launcher import launch
from prime_hpc.rundir import RunDir
from tests.conftest import cli
from tests.runs import run_processes

pytestmark = pytest.mark.slurm


def _rows(run: RunDir, component: str) -> list[dict]:
    path = run.metrics(component)
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _steps(run: RunDir, component: str) -> list[int]:
    return [r["step"] for r in _rows(run, component) if "loss/mean" in r or "reward/all/mean" in r]


def _wait(pred, timeout_s: float, what: str, run: RunDir, poll_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out waiting for {what}; job.json: {jobs.read_job(run)}")


def _release_held(job_id: str) -> bool:
    """SLURM holds a job it requeued (an `scontrol requeue` from outside) for about two
    minutes (pending, reason BeginTime) before it may start again; shorten the hold, as an
    admin could (saves test time). Not to "now": a node refuses a job whose credential it
    revoked within the same second."""
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T %r %S"], capture_output=True, text=True).stdout
    if "PENDING BeginTime" in out:
        try:
            wait_s = (datetime.datetime.fromisoformat(out.split()[2]) - datetime.datetime.now()).total_seconds()
        except (IndexError, ValueError):  # no begin time shown (it has passed): leave it be
            wait_s = 0
        if wait_s > 30:
            subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now+10"], capture_output=True,
                           timeout=60)
    return False


def _writer_of(log: Path) -> int:
    """The process of the run whose output goes to `log`."""
    for pid in run_processes(log.parent):
        try:
            if os.readlink(f"/proc/{pid}/fd/1") == str(log):
                return pid
        except OSError:
            continue
    raise AssertionError(f"no process of the run writes {log}")


def _attempt_starts(run: RunDir) -> list[float]:
    return [a["started_at"] for a in jobs.read_job(run)["attempts"]]


@pytest.mark.vllm
def test_rl_run_survives_a_requeue_is_cancelled_and_resumed(tmp_path):
    cfg = compose(["+experiment=reverse_text", "warmup.experiment=null", "cluster=dev", f"output_dir={tmp_path}/run",
                   "max_steps=10", "ckpt.interval=5", "orchestrator.batch_size=32", "orchestrator.eval.interval=0",
                   "orchestrator.eval.at_start=false"])
    sub = launch.submit(cfg, [])
    run, job_id = sub.ref.run, sub.ref.job_id
    try:
        # 1. scontrol requeue mid-run: both components checkpoint the step they are at
        _wait(lambda: len(_steps(run, "trainer")) >= 3, 600, "step 3", run)
        # SLURM signals every process of the job, the watchdog too, maybe before the job
        # script: a watchdog ended by a signal is no failure of the run
        watchdog = _writer_of(run.latest_logs.resolve() / "watchdog.log")
        os.kill(watchdog, signal.SIGTERM)
        time.sleep(4)  # the supervisor looks every second, then gives its own trap 2 s
        assert not jobs.read_job(run).get("ended_at"), jobs.read_job(run)
        assert launch.active_job(run)
        subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=60)
        _wait(lambda: _release_held(job_id) or len(jobs.read_job(run).get("attempts", [])) >= 2, 300,
              "the second attempt", run, poll_s=2)
        first = jobs.read_job(run)["attempts"][0]
        assert first["end"] == "REQUEUED" and first.get("stopping") == "REQUEUED", first
        saved = jobs.read_job(run)["attempts"][1]["resumed_from"]
        assert saved is not None and saved >= 3
        for part in ("trainer", "orchestrator"):
            assert (run.checkpoint_part(saved, part) / "STABLE").exists()
        # 2. cancel it after step 7: recorded as a cancel, not as a failure
        _wait(lambda: max(_steps(run, "orchestrator") or [0]) >= 7 and max(_steps(run, "trainer") or [0]) >= 7,
              600, "step 7", run)
        c = cli("cancel", job_id)
        assert c.returncode == 0, c.stderr
        _wait(lambda: jobs.read_job(run).get("ended_at"), 120, "the end of the job", run)
        job = jobs.read_job(run)
        assert job["state"] == "CANCELLED" and job["attempts"][-1]["end"] == "CANCELLED"
        _wait(lambda: not launch.active_job(run), 120, "SLURM to let the job go", run)
        # 3. resume from the latest complete checkpoint, with more steps
        latest = run.latest_checkpoint_step()
        r = cli("resume", job_id, "max_steps=12")
        assert r.returncode == 0, r.stderr
        resumed = jobs.read_job(run)["job_ids"][-1]
        assert resumed != job_id and f"from checkpoint step {latest}" in r.stdout
        again = cli("resume", job_id)  # a live job is not resumed twice
        assert again.returncode == 2 and "still alive" in again.stderr and again.stderr.count("\n") == 1
        _wait(lambda: jobs.read_job(run).get("state") in jobs.FINAL_STATES
              and jobs.read_job(run)["job_ids"][-1] == resumed, 900, "the resumed run", run, poll_s=2)
    finally:
        for i in jobs.read_job(run).get("job_ids", []):
            subprocess.run(["scancel", str(i)], capture_output=True, timeout=60)
    job = jobs.read_job(run)
    assert job["state"] == "COMPLETED", job
    assert [a["end"] for a in job["attempts"]] == ["REQUEUED", "CANCELLED", "COMPLETED"]
    assert job["attempts"][2]["resumed_from"] == latest
    # every step once, in both components; steps after the resume point come from the last attempt
    for component in ("trainer", "orchestrator"):
        assert _steps(run, component) == list(range(1, 13)), component
        rows = {r["step"]: r for r in _rows(run, component) if "time" in r}
        start = _attempt_starts(run)[-1]
        assert all(rows[s]["time"] > start for s in range(latest + 1, 13)), component
        assert all(rows[s]["time"] < start for s in range(1, latest + 1)), component
    assert run.latest_checkpoint_step() == 12 or 10 in run.complete_checkpoint_steps()
    logs = sorted(p.name for p in run.logs_root.iterdir() if p.name.startswith("attempt_"))
    assert logs == ["attempt_0", "attempt_1", "attempt_2"]  # earlier attempts' logs are kept


def test_sft_run_outlives_a_time_limit_shorter_than_the_run(tmp_path):
    """cluster.time=2 (minutes) for a run of ~3 minutes: at the warning before each time
    limit the trainer checkpoints, the job goes back to the queue, and the next attempt
    continues; no step is lost or trained twice."""
    steps = 600
    cfg = compose(["+experiment=reverse_text_sft", "cluster=dev", f"output_dir={tmp_path}/run", f"max_steps={steps}",
                   "cluster.time=2", "cluster.signal_delay_s=45", "trainer.data.args.num_examples=4000",
                   "trainer.val.interval=null", "ckpt.interval=1000"])
    sub = launch.submit(cfg, [])
    run = sub.ref.run
    try:
        _wait(lambda: _release_held(sub.ref.job_id) or jobs.read_job(run).get("state") in jobs.FINAL_STATES, 1200,
              "the end of the run", run, poll_s=2)
    finally:
        subprocess.run(["scancel", sub.ref.job_id], capture_output=True, timeout=60)
    job = jobs.read_job(run)
    ends = [a["end"] for a in job["attempts"]]
    assert job["state"] == "COMPLETED" and len(ends) >= 2, job
    assert ends[:-1] == ["TIMEOUT"] * (len(ends) - 1) and ends[-1] == "COMPLETED"
    assert job["requeues"] == len(ends) - 1 and job["job_ids"] == [sub.ref.job_id]  # the same job, requeued
    # each attempt continued from the step the previous one checkpointed when warned
    resumed = [a["resumed_from"] for a in job["attempts"]]
    assert resumed[0] is None and all(b > (a or 0) for a, b in zip(resumed, resumed[1:]))
    rows = [r for r in _rows(run, "trainer") if "loss/mean" in r]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    # no sample trained twice or skipped: the data position continues across attempts
    samples = [r["progress/num_samples"] for r in rows]
    assert all(b > a for a, b in zip(samples, samples[1:]))
    assert run.weight_steps()[-1] == steps
