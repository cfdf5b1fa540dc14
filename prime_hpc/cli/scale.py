"""`prime-hpc scale JOB inference=+N|-N [overrides...]`: extra inference servers for a
running RL run, as jobs of their own (see prime_hpc/launcher/scale.py)."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any) -> argparse.ArgumentParser:
    s = sub.add_parser(
        "scale",
        help="add inference nodes to a running RL run as an extra job (inference=+N), or remove extra jobs (-N)",
    )
    s.add_argument("job", help="job id, run name or output dir of the run")
    s.add_argument("change", metavar="inference=+N|-N", help="nodes to add (one new job) or remove (whole extra jobs)")
    s.add_argument(
        "overrides",
        nargs="*",
        help="where the extra job runs (+N only): partition=, time=, qos=, account=, constraint=, exclude=, "
        "gpus=, cpus=, mem_gb=, signal_delay_s= or any cluster.<key>= / cluster.inference.<key>=",
    )
    return s


def run(a: argparse.Namespace) -> int:
    from prime_hpc.launcher import scale
    from prime_hpc.rundir import jobs

    delta = scale.parse_delta(a.change)
    ref = jobs.resolve(a.job)
    jobs.own_job(ref.run, "scale")  # a job submitted from its config, or its jobs cancelled: only the user's own
    done = scale.scale(ref, delta, a.overrides)
    for x in done:
        if delta > 0:
            where = ", ".join(f"{k} {x[k]}" for k in ("partition", "time") if x.get(k))
            print(
                f"submitted extra inference job {x['job_id']} ({x['nodes']} node(s){', ' + where if where else ''}) "
                f"for {ref.name} (job {ref.job_id})"
            )
            print(
                f"  its servers join the run once healthy; logs: {x['logs']}    "
                f"remove it: prime-hpc scale {ref.job_id} inference=-{x['nodes']}"
            )
        else:
            print(
                f"cancelled extra inference job {x['job_id']} ({x['nodes']} node(s)) of {ref.name} "
                f"(job {ref.job_id}): its servers drain and leave"
            )
    return 0
