"""A submitted job's state, its pipeline and its cancellation, from job.json and the
backend (squeue/sacct, or the local supervisor). Light: what `status`, `list`, `tail` and
`cancel` need, without the config, planning or rendering of `submit`."""

from __future__ import annotations

import time
from typing import Optional

from prime_hpc.rundir import RunDir, jobs


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
    """State of each group of the job, and a note when SLURM could not be asked (then the
    states are what job.json recorded). Local runs: the run's state for every group."""
    job = jobs.read_job(ref.run)
    groups = jobs.job_groups(job)
    if ref.backend == "slurm":
        from prime_hpc.launcher import slurm_state as slurm

        if job.get("state") == jobs.COMPLETED:  # written by the job itself as its last act
            return {g: jobs.COMPLETED for g in groups}, None
        try:
            states = slurm.component_states(ref.job_id, groups)
        except slurm.SlurmUnreachable as e:
            recorded = job.get("state", "UNKNOWN")
            return {g: recorded for g in groups}, f"SLURM could not be asked ({e}); state as recorded in job.json"
        if len(states) < len(groups):  # not (or no longer) known to SLURM: what the job recorded
            return {g: states.get(g) or job.get("state", "UNKNOWN") for g in groups}, None
        return states, None
    st = jobs.local_state(ref.run)
    return {g: st for g in groups}, None


def job_state(ref: jobs.JobRef) -> str:
    states, _ = group_states(ref)
    if ref.backend == "slurm":
        from prime_hpc.launcher.slurm_state import aggregate

        return aggregate(list(states.values()))
    return next(iter(states.values()))


def cancel(ref: jobs.JobRef) -> bool:
    """Cancel every group of the job; job.json records who ended it. False if the job
    had already ended."""
    if job_state(ref) in jobs.FINAL_STATES:
        return False
    # recorded first: the job's supervisor reads it to tell a cancel from a requeue
    prior = jobs.read_job(ref.run).get("state")
    jobs.update_job(ref.run, state=jobs.CANCELLED, cancelled_at=time.time())
    try:
        if ref.backend == "slurm":
            from prime_hpc.launcher import slurm

            slurm.cancel(ref.job_id)
        else:
            from prime_hpc.launcher import local

            local.cancel(ref.run)
    except BaseException:
        jobs.update_job(ref.run, state=prior)
        raise
    return True
