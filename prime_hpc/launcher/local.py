"""Local backend (cluster=local): the same three components as processes on this
machine, supervised by the rendered `submit/rl.local.sh` in its own session."""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
from typing import Any

from prime_hpc.jobs import FINAL_STATES, read_job
from prime_hpc.launcher.plan import Plan
from prime_hpc.launcher.render import render_local
from prime_hpc.rundir import RunDir, atomic_write_text


def submit(plan: Plan, task: Any) -> tuple[str, int]:
    """Start the run in the background; returns (job id, pid of the supervising script)."""
    run = plan.run
    job_id = f"local-{secrets.token_hex(4)}"
    plan.head_argv = task.argv(plan.python)
    atomic_write_text(run.local_script, render_local(plan, job_id))
    with open(run.submit_dir / "local.out", "ab") as out:
        proc = subprocess.Popen(
            ["bash", str(run.local_script)],
            cwd=run.root,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: cancel ends exactly this run
        )
    return job_id, proc.pid


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie (exited, not yet reaped by its parent) is not alive
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def state(run: RunDir) -> str:
    job = read_job(run)
    recorded = job.get("state", "UNKNOWN")
    if recorded in FINAL_STATES:
        return recorded
    pid = job.get("pid")
    if pid and alive(int(pid)):
        return "RUNNING"
    return "FAILED" if recorded in ("RUNNING", "PENDING") else recorded


def cancel(run: RunDir) -> None:
    pid = read_job(run).get("pid")
    if pid and alive(int(pid)):
        os.killpg(int(pid), signal.SIGTERM)
