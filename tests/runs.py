"""Helpers for tests that run a job: its processes (found by environment and parent chain,
never by command line) and its progress."""

from __future__ import annotations

import datetime
import json
import subprocess
import time
from pathlib import Path

from prime_hpc.rundir import RunDir, jobs
from prime_hpc.sched.local import supervisor_alive
from tests import procs


def run_processes(logs: Path) -> dict[int, int]:
    """{pid: start time} of every process of the run: those the job script started (they
    carry the attempt's PRIME_HPC_LOGS in their environment) and all their descendants."""
    now = procs.table()
    return {pid: now[pid][1] for pid in procs.descendants(procs.with_env(f"PRIME_HPC_LOGS={logs}", now), now)}


def supervisor_pid(ref: jobs.JobRef) -> int:
    """The job script's process: the one job.json records where the launcher started it
    itself (cluster=local); on SLURM the batch script, the parent of the run's processes
    that carries the job's SLURM_JOB_ID (slurmstepd, the parent of the step tasks, does not)."""
    job = jobs.read_job(ref.run)
    if job.get("pid"):
        assert supervisor_alive(job), job
        return int(job["pid"])
    now = procs.table()
    started = procs.with_env(f"PRIME_HPC_LOGS={ref.run.latest_logs.resolve()}", now)
    parents = {now[p][0] for p in started if now[p][0] not in started}
    found = procs.with_env(f"SLURM_JOB_ID={ref.job_id}", {p: now[p] for p in parents if p in now})
    assert len(found) == 1, (found, parents)
    return found.pop()


def rank0_pid(run: RunDir) -> int:
    """Trainer rank 0 (its heartbeat holds its pid)."""
    return int(json.loads(run.heartbeat("trainer", 0).read_text())["pid"])


def agent_pid(run: RunDir) -> int:
    """torchrun's agent: the parent of trainer rank 0."""
    rank0 = rank0_pid(run)
    st = procs.stat(rank0)
    assert st is not None, "trainer rank 0 is not running"
    assert procs.with_env("TORCHELASTIC_RUN_ID=", {rank0: st}, prefix=True), "rank 0 does not run under torchrun"
    return st[0]


def still_alive(started: dict[int, int]) -> list[str]:
    out = []
    for pid, start in started.items():
        st = procs.stat(pid)
        if st and st[1] == start and (cmd := procs.cmdline(pid)) is not None:
            out.append(f"{pid}: {cmd!r}")
    return out


def wait_for_step(run: RunDir, step: int, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if json.loads(run.heartbeat("trainer", 0).read_text()).get("step", 0) >= step:
                return
        except (OSError, ValueError):
            pass
        job = jobs.read_job(run)
        assert not job.get("ended_at"), f"the job ended before step {step}: {job.get('failure')}"
        time.sleep(0.5)
    raise AssertionError(f"no trainer step {step} within {timeout_s}s")


def engine_pid(server_pid: int) -> int:
    """vLLM's engine process under an inference server (it names itself VLLM::EngineCore)."""
    engines = [p for p in procs.descendants([server_pid]) if _comm(p).startswith("VLLM::EngineCor")]
    assert len(engines) == 1, (server_pid, engines)
    return engines[0]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def slurm_node(pid: int) -> str:
    """The SLURM node a step's process runs on (its SLURMD_NODENAME)."""
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next(v.split(b"=", 1)[1].decode() for v in env if v.startswith(b"SLURMD_NODENAME="))


def fleet_row(run: RunDir, slot: str) -> dict:
    """`status`'s row of the server in `slot` (an inference server's, or a teacher's)."""
    from prime_hpc.rundir import parse_slot
    from prime_hpc.rundir.fleet import fleet

    parsed = parse_slot(slot)
    group = parsed.group if parsed else "inference"
    return next((r for r in fleet(run.of_group(group)) if r["slot"] == slot), {})


def wait_fleet(run: RunDir, slot: str, pred, what: str, timeout_s: float = 300) -> dict:
    """Until `slot`'s fleet row satisfies `pred` (the job must not end meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        row = fleet_row(run, slot)
        if row and pred(row):
            return row
        job = jobs.read_job(run)
        assert not job.get("ended_at"), f"the job ended ({job.get('state')}, {job.get('failure')}) before {what}"
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}: {fleet_row(run, slot)}")


def release_held(job_id: str) -> bool:
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
            subprocess.run(
                ["scontrol", "update", f"JobId={job_id}", "StartTime=now+10"], capture_output=True, timeout=60
            )
    return False


def wait_until(pred, timeout_s: float, what: str, run: RunDir, poll_s: float = 0.5):
    """`pred()`'s first true value within `timeout_s`; fails naming `what` when the job ends
    first (completed, failed, cancelled: a requeue is no end) or the time is up."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        job = jobs.read_job(run)
        if job.get("state") in ("FAILED", "CANCELLED", "COMPLETED"):
            raise AssertionError(f"the job ended ({job.get('state')}, {job.get('failure')}) before {what}")
        time.sleep(poll_s)
    raise AssertionError(f"timed out waiting for {what}; job.json: {jobs.read_job(run)}")
