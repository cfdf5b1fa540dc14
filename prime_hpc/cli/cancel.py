"""`prime-hpc cancel JOB`: a job (with its extra inference jobs), both jobs of a pipeline,
or every point of a sweep."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any) -> argparse.ArgumentParser:
    c = sub.add_parser("cancel", help="cancel a job (a pipeline's jobs together, a sweep's points)")
    c.add_argument("job", help="job id, run name, output dir or sweep id")
    return c


def run(a: argparse.Namespace) -> int:
    from prime_hpc.launcher import scale, state
    from prime_hpc.rundir import jobs

    # a sweep's last points first: cancelling a point must not release the one that waits for it
    for point in jobs.resolve_many(a.job)[::-1]:
        for ref in state.pipeline_refs(point)[::-1]:  # the run first: its warm-up cannot start it any more
            for x in scale.cancel_all(ref.run):  # its extra inference jobs before the run itself
                print(f"cancelled extra inference job {x['job_id']} ({x['nodes']} node(s)) of {ref.name}")
            if state.cancel(ref):
                print(f"cancelled job {ref.job_id} ({ref.name})")
            else:
                print(f"job {ref.job_id} ({ref.name}) already ended: {state.job_state(ref)}")
    return 0
