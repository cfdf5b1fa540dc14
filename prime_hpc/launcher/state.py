"""A submitted job's state, its pipeline, following its logs until it ends, its extra
inference jobs and its cancellation, from job.json and the job's backend
(`prime_hpc.sched`). Light: what `status`, `list`, `tail` and `cancel` need, without the
config, planning or rendering of `submit`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Optional

from prime_hpc.rundir import RunDir, jobs
from prime_hpc.sched.registry import choose

SLURM_CHECK_S = 30.0  # how often a follow asks SLURM whether a job ended without saying so


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


def state_fn(ref: jobs.JobRef) -> Callable[[], tuple[str, dict]]:
    """The job's state as its own record says, and, for a job that could end without
    recording it (its supervisor killed), SLURM's or the process table's now and then."""
    last = [0.0]

    def state() -> tuple[str, dict]:
        job = jobs.read_job(ref.run)
        recorded = job.get("state", "UNKNOWN")
        if recorded in jobs.FINAL_STATES or time.monotonic() - last[0] < SLURM_CHECK_S:
            return recorded, job
        last[0] = time.monotonic()
        actual = job_state(ref)
        return (actual if actual in jobs.FINAL_STATES else recorded), job

    return state


def follow_ref(ref: jobs.JobRef, **opts: Any) -> int:
    """Follow the job's logs until it ends (`prime_hpc.watch.tail.follow`); 0 if it completed."""
    from prime_hpc.watch.tail import follow

    return follow(ref.run, state_fn=state_fn(ref), **opts)


def batch_log(ref: jobs.JobRef) -> Path:
    """The job script's own output (what to read before any component log exists)."""
    return choose(ref.backend).batch_log(ref.run, ref.job_id)


# ------------------------------------------ the run's extra inference jobs (prime-hpc scale)
def live_extras(run: RunDir, job: Optional[dict[str, Any]] = None) -> list[dict[str, Any]]:
    """The run's extra jobs that are queued or running (oldest first), each record with
    its `live` state, asked of the backend at once."""
    job = jobs.read_job(run) if job is None else job
    recorded = [x for x in jobs.extra_jobs(job) if x.get("state") not in jobs.FINAL_STATES]
    if not recorded:
        return []
    states, _ = choose(job.get("backend")).plain_states([str(x["job_id"]) for x in recorded])
    return [{**x, "live": states[str(x["job_id"])]} for x in recorded if states.get(str(x["job_id"])) in LIVE]


LIVE = ("PENDING", "RUNNING", "COMPLETING")


def cancel_extra(run: RunDir, backend: str, record: dict[str, Any]) -> None:
    """Cancel one extra job: CANCELLED in its record first (its script reads it: a cancel,
    not a preemption). A running job is asked to leave (SIGUSR2 to its script alone, which
    tells its servers to drain and then ends the job: no request fails); one that has not
    started is cancelled."""
    job_id = str(record["job_id"])
    prior = record.get("state")
    jobs.update_extra_job(run, job_id, state=jobs.CANCELLED, cancelled_at=time.time())
    sched = choose(backend)
    try:
        if record.get("live") != "RUNNING" or not sched.signal_script(job_id, "USR2"):
            sched.cancel(run, job_id)
    except BaseException:
        jobs.update_extra_job(run, job_id, state=prior, cancelled_at=None)
        raise


def cancel_all(run: RunDir) -> list[dict[str, Any]]:
    """Cancel every live extra job of the run (with the run: `prime-hpc cancel`); only of a
    run of the user's own (`jobs.own_job`: its job.json names the jobs cancelled)."""
    job = jobs.own_job(run, "cancel")
    live = live_extras(run, job)
    for x in reversed(live):
        cancel_extra(run, job["backend"], x)
    return live


def cancel(ref: jobs.JobRef) -> bool:
    """Cancel every group of the job, and its extra inference jobs; job.json records who
    ended it. False if the job had already ended. Only a run of the user's own
    (`jobs.own_job`): another's job.json could name any pid or job id."""
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
