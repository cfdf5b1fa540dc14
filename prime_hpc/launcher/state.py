"""A submitted job's state, its pipeline and its cancellation, from job.json and the
job's backend (`prime_hpc.sched`). Light: what `status`, `list`, `tail` and `cancel`
need, without the config, planning or rendering of `submit`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

from prime_hpc.rundir import RunDir, jobs
from prime_hpc.sched.registry import choose


def pipeline_refs(ref: jobs.JobRef) -> list[jobs.JobRef]:
    """The jobs of `ref`'s pipeline, warm-up first ([ref] when it is not in one)."""
    p = jobs.read_job(ref.run).get("pipeline") or {}
    if "warmup" in p:
        warm = jobs.resolve(p["warmup"]["output_dir"])
        return [warm, ref]
    if p.get("run") and (RunDir(p["run"]).job_json).exists():
        return [ref, jobs.resolve(p["run"])]
    return [ref]


def group_states(ref: jobs.JobRef) -> tuple[dict[str, str], Optional[str]]:
    """State of each group of the job, and a note when its backend could not be asked
    (then the states are what job.json recorded)."""
    return choose(ref.backend).group_states(ref.run, ref.job_id)


def job_state(ref: jobs.JobRef) -> str:
    return choose(ref.backend).state(ref.run, ref.job_id)


def batch_log(ref: jobs.JobRef) -> Path:
    """The job script's own output (what to read before any component log exists)."""
    return choose(ref.backend).batch_log(ref.run, ref.job_id)


def cancel(ref: jobs.JobRef) -> bool:
    """Cancel every group of the job, and its extra inference jobs; job.json records who
    ended it. False if the job had already ended."""
    from prime_hpc.launcher.scale import cancel_all

    cancel_all(ref.run)  # the run's extra inference jobs (prime-hpc scale) first: they serve it
    backend = choose(ref.backend)
    if backend.state(ref.run, ref.job_id) in jobs.FINAL_STATES:
        return False
    # recorded first: the job's supervisor reads it to tell a cancel from a requeue
    prior = jobs.read_job(ref.run).get("state")
    jobs.update_job(ref.run, state=jobs.CANCELLED, cancelled_at=time.time())
    try:
        backend.cancel(ref.run, ref.job_id)
    except BaseException:
        jobs.update_job(ref.run, state=prior)
        raise
    return True
