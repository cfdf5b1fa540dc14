"""`prime-hpc resume JOB [ckpt.step=-1|N] [key=value...]`."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any) -> argparse.ArgumentParser:
    r = sub.add_parser("resume", help="continue a run from a checkpoint, in its directory, as a new attempt")
    r.add_argument("job", help="job id, run name or output dir")
    r.add_argument("-f", "--follow", action="store_true", help="then follow its logs until it ends")
    r.add_argument(
        "--run",
        metavar="NAME",
        help="a job of several runs (submit --together): resume this run alone from its own checkpoint "
        "(in the running job, or by submitting the job again)",
    )
    r.add_argument(
        "--scale",
        metavar="inference=+N",
        help="also submit an extra inference job of N nodes for it (prime-hpc scale); extra jobs of the run's "
        "earlier jobs are not started again otherwise",
    )
    r.add_argument(
        "overrides",
        nargs="*",
        help="ckpt.step=-1 (default: the latest complete checkpoint) or N, and "
        "key=value changes of the recorded config, e.g. max_steps=40",
    )
    return r


def run(a: argparse.Namespace) -> int:
    from prime_hpc.core import jobenv
    from prime_hpc.launcher import launch, scale
    from prime_hpc.rundir import jobs

    ref = jobs.resolve(a.job)
    jobs.own_job(ref.run, "resume")  # a job submitted from its config: only a run of the user's own
    if a.run:
        return _resume_run(a, ref)
    nodes = scale.parse_delta(a.scale) if a.scale else 0
    if nodes < 0:
        raise scale.ScaleError(f"resume --scale {a.scale}: a resumed run has no extra job to remove; give +N")
    if nodes:
        scale.check_kind(ref)
    with jobenv.job_api_key(launch.keep_job_key(ref.run)):  # the run and its extra job: the run's key
        sub = launch.resume(ref, a.overrides)
        print(
            f"resumed {ref.name} as job {sub.ref.job_id} ({sub.ref.backend}) from checkpoint step "
            f"{sub.resume_step}; output dir {ref.output_dir}"
        )
        for x in scale.scale(sub.ref, nodes) if nodes else []:
            print(f"  with extra inference job {x['job_id']} ({x['nodes']} node(s)); logs: {x['logs']}")
    print(f"  follow:     prime-hpc tail {sub.ref.job_id}    state: prime-hpc status {sub.ref.job_id}")
    return _follow(a, sub.ref)


def _resume_run(a: argparse.Namespace, ref: Any) -> int:
    from prime_hpc.core import jobenv
    from prime_hpc.launcher import launch

    if a.scale:
        raise SystemExit("prime-hpc resume: error: --scale resumes a whole job; drop it with --run")
    with jobenv.job_api_key(launch.keep_job_key(ref.run)):
        step, sub = launch.resume_run(ref, a.run, a.overrides)
    where = f"from checkpoint step {step}" if step else "from its start"
    if sub is None:
        print(f"run {a.run} of job {ref.job_id} ({ref.name}) runs again {where} in the running job")
        print(f"  state: prime-hpc status {ref.job_id}")
        return 0
    print(
        f"resumed run {a.run} of {ref.name} {where} as job {sub.ref.job_id} ({sub.ref.backend}); output dir {ref.output_dir}"
    )
    print(f"  follow:     prime-hpc tail {sub.ref.job_id}    state: prime-hpc status {sub.ref.job_id}")
    return _follow(a, sub.ref)


def _follow(a: argparse.Namespace, ref: Any) -> int:
    if a.follow:
        from prime_hpc.launcher.state import follow_ref

        return follow_ref(ref)
    return 0
