"""`prime-hpc resume JOB [ckpt.step=-1|N] [key=value...]`."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any) -> argparse.ArgumentParser:
    r = sub.add_parser("resume", help="continue a run from a checkpoint, in its directory, as a new attempt")
    r.add_argument("job", help="job id, run name or output dir")
    r.add_argument("-f", "--follow", action="store_true", help="then follow its logs until it ends")
    r.add_argument(
        "overrides",
        nargs="*",
        help="ckpt.step=-1 (default: the latest complete checkpoint) or N, and "
        "key=value changes of the recorded config, e.g. max_steps=40",
    )
    return r


def run(a: argparse.Namespace) -> int:
    from prime_hpc.launcher import launch
    from prime_hpc.rundir import jobs

    ref = jobs.resolve(a.job)
    sub = launch.resume(ref, a.overrides)
    print(
        f"resumed {ref.name} as job {sub.ref.job_id} ({sub.ref.backend}) from checkpoint step "
        f"{sub.resume_step}; output dir {ref.output_dir}"
    )
    print(f"  follow:     prime-hpc tail {sub.ref.job_id}    state: prime-hpc status {sub.ref.job_id}")
    if a.follow:
        from prime_hpc.cli.tail import follow_ref

        return follow_ref(sub.ref)
    return 0
