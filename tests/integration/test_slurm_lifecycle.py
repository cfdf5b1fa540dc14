"""Runs that outlive their allocation, on the dev cluster: an RL run is preempted, reaches
its time limit and is requeued by `scontrol requeue` (each time the trainer and the
orchestrator checkpoint the step they are at and the next attempt continues there) until
cluster.max_requeues stops it, then is resumed by hand. Asserted on the run directory and
SLURM: every step trained and recorded exactly once, each attempt recorded with why it
ended. (An SFT run that outlives its time limits: test_sft_learns.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from prime_hpc.config.compose import compose
from prime_hpc.launcher import launch
from prime_hpc.rundir import RunDir, jobs
from tests.conftest import cli
from tests.runs import release_held, run_processes

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


def _take_nodes_of(job_id: str, out: Path) -> str:
    """Submit a plain job to the dev cluster's urgent partition that needs every node of the
    run, whole: SLURM preempts the run (preemptible partition) to start it."""
    listed = subprocess.run(
        ["squeue", "-h", "-j", job_id, "-o", "%N"], capture_output=True, text=True, timeout=60
    ).stdout.split()
    nodes = subprocess.run(
        ["scontrol", "show", "hostnames", ",".join(listed)], capture_output=True, text=True, timeout=60
    ).stdout.split()
    assert nodes, f"no nodes of job {job_id}: {listed}"
    r = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--partition=urgent",
            "--exclusive",
            f"--nodes={len(nodes)}",
            f"--nodelist={','.join(nodes)}",
            f"--output={out}/urgent-%j.out",
            "--wrap",
            "sleep 600",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


def _squeue_state(job_id: str) -> str:
    return subprocess.run(
        ["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=60
    ).stdout.strip()


def _attempts(run: RunDir) -> list[dict]:
    return jobs.read_job(run).get("attempts", [])


def _saved(run: RunDir, step: int) -> bool:
    """Both parts of the checkpoint of `step` are complete."""
    return all((run.checkpoint_part(step, part) / "STABLE").exists() for part in ("trainer", "orchestrator"))


@pytest.mark.vllm
def test_rl_run_is_preempted_outlives_its_time_limit_and_stops_at_its_requeue_limit(tmp_path):
    """One RL run (orchestrator, inference, trainer: a het job) in the preemptible partition,
    with a 3-minute time limit and cluster.max_requeues=2, through four attempts:
    1. a job of the urgent partition needs its nodes: SLURM preempts the run, signalling
       only its components (grace time); both checkpoint the step they are at, the attempt
       ends PREEMPTED, the job is requeued and starts again once that job is gone;
    2. from that checkpoint on, until the warning before the time limit: both checkpoint,
       the attempt ends TIMEOUT, the job is requeued;
    3. from that checkpoint on, until `scontrol requeue`, a third requeue: past the limit the
       run ends, checkpointed, with one line naming cluster.max_requeues (in job.json and
       `status`), and the job SLURM brings back does not start;
    4. `prime-hpc resume` continues from that checkpoint to max_steps.
    Every step trained and recorded once, each attempt's from the checkpoint before it."""
    cfg = compose(
        [
            "+experiment=reverse_text",
            "warmup.experiment=null",
            "cluster=dev",
            f"output_dir={tmp_path}/run",
            "cluster.partition=scavenger",
            "cluster.time=3",
            "cluster.signal_delay_s=85",  # warned 95 s into an attempt: the first is preempted by then
            "cluster.max_requeues=2",
            "max_steps=2000",
            "ckpt.interval=1000",
            "orchestrator.batch_size=32",
            "orchestrator.eval.interval=0",
            "orchestrator.eval.at_start=false",
        ]
    )
    sub = launch.submit(cfg, [])
    run, job_id = sub.ref.run, sub.ref.job_id
    urgent = ""
    try:
        # 1. preempted at step 2 or later
        _wait(lambda: len(_steps(run, "trainer")) >= 2, 600, "step 2", run)
        # SLURM signals every process of the job, the watchdog too, maybe before the job
        # script: a watchdog ended by a signal is no failure of the run
        watchdog = _writer_of(run.latest_logs.resolve() / "watchdog.log")
        os.kill(watchdog, signal.SIGTERM)
        time.sleep(4)  # the supervisor looks every second, then gives its own trap 2 s
        assert not jobs.read_job(run).get("ended_at"), jobs.read_job(run)
        urgent = _take_nodes_of(job_id, tmp_path)
        _wait(
            lambda: _squeue_state(urgent) == "RUNNING", 300, "the urgent job to start on the run's nodes", run, poll_s=2
        )
        first = _attempts(run)[0]
        assert first["end"] == "PREEMPTED" and first.get("stopping") == "PREEMPTED", first
        assert jobs.read_job(run)["requeues"] == 1 and jobs.read_job(run)["state"] == "REQUEUED"
        saved = [s for s in run.complete_checkpoint_steps() if _saved(run, s)]
        assert len(saved) == 1 and saved[0] >= 2, saved  # the step it was at (no periodic checkpoint yet)
        subprocess.run(["scancel", urgent], check=True, timeout=60)
        gone = time.time()
        # 2. back once the urgent job is gone, from that checkpoint, until the time limit
        _wait(lambda: release_held(job_id) or len(_attempts(run)) >= 3, 600, "the end of the time limit", run, poll_s=2)
        second = _attempts(run)[1]
        assert second["started_at"] > gone and second["resumed_from"] == saved[0], second
        assert second["end"] == "TIMEOUT" and second.get("stopping") == "TIMEOUT", second
        saved.append(_attempts(run)[2]["resumed_from"])
        assert saved[1] > saved[0] and _saved(run, saved[1]), saved
        # 3. requeued once more than cluster.max_requeues allows: the run ends, checkpointed
        _wait(lambda: max(_steps(run, "trainer")) >= saved[1] + 2, 300, "two steps after the time limit", run)
        subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=60)
        _wait(lambda: jobs.read_job(run).get("state") == "FAILED", 120, "the end of the run", run)
        job = jobs.read_job(run)
        assert job["attempts"][2]["end"] == "REQUEUED" and job["requeues"] == 2, job
        assert "cluster.max_requeues=2 reached" in job["failure"]["reason"], job["failure"]
        st = cli("status", job_id)
        assert "failed: job REQUEUED by SLURM: not continued (cluster.max_requeues=2 reached)" in st.stdout, st.stdout
        saved.append(run.latest_checkpoint_step())
        assert saved[2] > saved[1] and _saved(run, saved[2]), saved
        _wait(lambda: release_held(job_id) or not launch.active_job(run), 300, "SLURM to let the job go", run, poll_s=2)
        assert (
            len(_attempts(run)) == 3
            and "not continued (continue with: prime-hpc resume" in run.slurm_batch_log(job_id).read_text()
        )  # SLURM started it again: refused before anything ran
        # 4. resume from that checkpoint, without a time limit to meet, to the end
        r = cli("resume", job_id, f"max_steps={saved[2] + 3}", "cluster.time=30")
        assert r.returncode == 0, r.stderr
        resumed = jobs.read_job(run)["job_ids"][-1]
        assert resumed != job_id and f"from checkpoint step {saved[2]}" in r.stdout
        again = cli("resume", job_id)  # a live job is not resumed twice
        assert again.returncode == 2 and "still alive" in again.stderr and again.stderr.count("\n") == 1
        _wait(
            lambda: (
                jobs.read_job(run).get("state") in jobs.FINAL_STATES and jobs.read_job(run)["job_ids"][-1] == resumed
            ),
            900,
            "the resumed run",
            run,
            poll_s=2,
        )
    finally:
        for i in [urgent, *jobs.read_job(run).get("job_ids", [])]:
            if i:
                subprocess.run(["scancel", str(i)], capture_output=True, timeout=60)
    job = jobs.read_job(run)
    assert job["state"] == "COMPLETED", job
    assert [a["end"] for a in job["attempts"]] == ["PREEMPTED", "TIMEOUT", "REQUEUED", "COMPLETED"]
    assert [a["resumed_from"] for a in job["attempts"]] == [None, *saved]
    # every step once, in both components, trained by the attempt after the checkpoint before it
    last = saved[2] + 3
    starts = _attempt_starts(run) + [float("inf")]
    for component in ("trainer", "orchestrator"):
        assert _steps(run, component) == list(range(1, last + 1)), component
        rows = {r["step"]: r for r in _rows(run, component) if "time" in r}
        for k, (lo, hi) in enumerate(zip([0, *saved], [*saved, last])):
            assert all(starts[k] < rows[s]["time"] < starts[k + 1] for s in range(lo + 1, hi + 1)), (component, k)
    logs = sorted(p.name for p in run.logs_root.iterdir() if p.name.startswith("attempt_"))
    assert logs == ["attempt_0", "attempt_1", "attempt_2", "attempt_3"]  # earlier attempts' logs are kept
