"""`prime-hpc cancel JOB`: a job (with its extra inference jobs), both jobs of a pipeline,
or every point of a sweep; only runs of the user's own (`rundir.jobs.own_job`), every one
checked before any is cancelled."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any) -> argparse.ArgumentParser:
    c = sub.add_parser("cancel", help="cancel a job (a pipeline's jobs together, a sweep's points)")
    c.add_argument("job", help="job id, run name, output dir or sweep id")
    c.add_argument(
        "--run", metavar="NAME", help="a job of several runs (submit --together): stop this run alone, the others go on"
    )
    return c


def run(a: argparse.Namespace) -> int:
    from prime_hpc.launcher import state
    from prime_hpc.rundir import jobs

    if a.run:
        ref = jobs.resolve(a.job)
        jobs.own_job(ref.run, "cancel")
        return cancel_run(ref, a.run)
    # a sweep's last points first: cancelling a point must not release the one that waits for it
    # (the run first in a pipeline: its warm-up cannot start it any more)
    refs = [ref for point in jobs.resolve_many(a.job)[::-1] for ref in state.pipeline_refs(point)[::-1]]
    for ref in refs:  # every one the user's own before any is cancelled
        jobs.own_job(ref.run, "cancel")
    for ref in refs:
        for x in state.cancel_all(ref.run):  # its extra inference jobs before the run itself
            print(f"cancelled extra inference job {x['job_id']} ({x['nodes']} node(s)) of {ref.name}")
        if state.cancel(ref):
            print(f"cancelled job {ref.job_id} ({ref.name})")
        else:
            print(f"job {ref.job_id} ({ref.name}) already ended: {state.job_state(ref)}")
    return 0


def cancel_run(ref: Any, name: str) -> int:
    """Stop run `name` of a job of several: recorded CANCELLED in its `run.json`; the job's
    head stops its orchestrator, the trainer checkpoints nothing more of it and frees its
    adapter slot; the other runs go on. A run over already is left as it is."""
    import getpass

    from prime_hpc.core.errors import UserError
    from prime_hpc.rundir import jobs, runs

    known = jobs.read_job(ref.run).get("runs") or []
    if name not in known:
        raise UserError(
            f"--run {name}: job {ref.job_id} ({ref.name}) has " + (", ".join(known) or "no runs of its own")
        )
    run = ref.run.sub_run(name)
    rec = runs.state(run)
    if rec is not None:
        print(f"run {name} of job {ref.job_id} is over already: {rec['state']}")
        return 0
    runs.record(run, runs.CANCELLED, reason=f"cancelled by {getpass.getuser()}")
    print(
        f"cancelled run {name} of job {ref.job_id} ({ref.name}); its orchestrator stops and its adapter slot is freed"
    )
    return 0
