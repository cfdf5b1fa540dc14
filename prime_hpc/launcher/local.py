"""Local backend (cluster=local): the same three components as processes on this
machine, supervised by the rendered `submit/rl.local.sh` in its own session."""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
from typing import TYPE_CHECKING, Any, Optional

from prime_hpc.jobs import FINAL_STATES, read_job
from prime_hpc.rundir import RunDir, atomic_write_text

if TYPE_CHECKING:
    from prime_hpc.launcher.plan import Plan


def submit(plan: "Plan", task: Any) -> tuple[str, dict]:
    """Start the run in the background; returns (job id, {pid, pid_start} of the
    supervising script, for job.json)."""
    run = plan.run
    job_id = f"local-{secrets.token_hex(4)}"
    plan.head_argv = task.argv(plan.python)
    script = run.local_script(plan.kind)
    from prime_hpc.launcher.render import render_local

    atomic_write_text(script, render_local(plan, job_id))
    with open(run.submit_dir / "local.out", "ab") as out:
        proc = subprocess.Popen(
            ["bash", str(script)],
            cwd=run.root,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: cancel ends exactly this run
        )
    return job_id, {"pid": proc.pid, "pid_start": start_time(proc.pid)}


def start_time(pid: int) -> Optional[str]:
    """The kernel's start time of `pid` (tells a reused pid from ours); None if gone or a
    zombie (exited, not yet reaped by its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else fields[19]


def supervisor_alive(job: dict) -> bool:
    pid, started = job.get("pid"), job.get("pid_start")
    return bool(pid) and started is not None and start_time(int(pid)) == started


def state(run: RunDir) -> str:
    job = read_job(run)
    recorded = job.get("state", "UNKNOWN")
    if recorded in FINAL_STATES:
        return recorded
    if supervisor_alive(job):  # pending only while it waits for the job it starts after (a warm-up)
        return "PENDING" if recorded == "PENDING" and (job.get("pipeline") or {}).get("warmup") else "RUNNING"
    return "FAILED" if recorded in ("RUNNING", "PENDING") else recorded


def cancel(run: RunDir) -> None:
    job = read_job(run)
    if supervisor_alive(job):
        try:
            os.killpg(int(job["pid"]), signal.SIGTERM)
        except ProcessLookupError:
            pass
