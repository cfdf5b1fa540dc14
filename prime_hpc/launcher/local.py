"""Local backend (cluster=local): the same three components as processes on this
machine, supervised by the rendered `submit/rl.local.sh` in its own session."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
from typing import TYPE_CHECKING, Any

from prime_hpc.rundir import RunDir, atomic_write_text
from prime_hpc.rundir.jobs import read_job, start_time, supervisor_alive

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


def cancel(run: RunDir) -> None:
    job = read_job(run)
    if supervisor_alive(job):
        try:
            os.killpg(int(job["pid"]), signal.SIGTERM)
        except ProcessLookupError:
            pass
