"""The local backend (cluster=local): the job's groups as processes on this machine,
supervised by the rendered `submit/<kind>.local.sh`, started in a session of its own.
Its state is job.json's, checked against that script being alive (its pid and the pid's
start time are recorded, so a reused pid does not count). No time limit, no requeue."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
from pathlib import Path
from typing import Any, Optional

from prime_hpc.rundir import RunDir, atomic_write_text
from prime_hpc.rundir.jobs import FINAL_STATES, job_groups, read_job, start_time
from prime_hpc.sched.base import Backend, JobSpec


def supervisor_alive(job: dict[str, Any]) -> bool:
    """The job script job.json records (pid and its start time) is still running."""
    pid, started = job.get("pid"), job.get("pid_start")
    return pid is not None and started is not None and start_time(int(pid)) == started


def job_state(job: dict[str, Any]) -> str:
    """A local job's state: its record (job.json), checked against its supervising script
    being alive."""
    recorded = job.get("state", "UNKNOWN")
    if recorded in FINAL_STATES:
        return recorded
    if supervisor_alive(job):  # pending only while it waits for the job it starts after (a warm-up)
        return "PENDING" if recorded == "PENDING" and (job.get("pipeline") or {}).get("warmup") else "RUNNING"
    return "FAILED" if recorded in ("RUNNING", "PENDING") else recorded


def run_state(run: RunDir) -> str:
    return job_state(read_job(run))


class Local(Backend):
    name = "local"
    one_machine = True

    def submit(self, job: JobSpec) -> tuple[str, dict[str, Any]]:
        """Start the job script in the background; job.json gets its pid and start time."""
        run = job.run
        job_id = f"local-{secrets.token_hex(4)}"  # the prefix is for people; nothing reads it
        script = run.local_script(job.kind)
        atomic_write_text(script, job.shell_script(job_id))
        with open(run.local_batch_log, "ab") as out:
            proc = subprocess.Popen(
                ["bash", str(script)],
                cwd=run.root,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: cancel ends exactly this run
            )
        return job_id, {"pid": proc.pid, "pid_start": start_time(proc.pid)}

    def cancel(self, run: RunDir, job_id: str) -> None:
        """SIGTERM to the script's process group: it records CANCELLED and stops the rest."""
        job = read_job(run)
        if supervisor_alive(job):
            try:
                os.killpg(int(job["pid"]), signal.SIGTERM)
            except ProcessLookupError:
                pass

    def group_states(self, run: RunDir, job_id: str) -> tuple[dict[str, str], Optional[str]]:
        job = read_job(run)
        st = job_state(job)
        return {g: st for g in job_groups(job)}, None

    def states(self, records: dict[str, dict[str, Any]]) -> tuple[dict[str, str], str]:
        return {j: job_state(rec) for j, rec in records.items()}, ""

    def alive(self, run: RunDir, job_id: str) -> bool:
        return supervisor_alive(read_job(run))

    def batch_log(self, run: RunDir, job_id: str) -> Path:
        return run.local_batch_log
