"""`prime-hpc serve model=<name|path> [overrides]`: a standalone inference job, the model on
`cluster.inference.nodes` servers behind the router, until cancelled or its time limit."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from prime_hpc.core.errors import UserError


def add_parser(sub: Any) -> argparse.ArgumentParser:
    s = sub.add_parser(
        "serve",
        help="serve a model as a job of its own: N inference servers behind the router, with your key "
        "(eval serve=JOB, a run's teacher and synthesize can name it); cancel to stop",
    )
    s.add_argument(
        "--no-wait",
        action="store_true",
        help="return once submitted, without waiting for the servers to answer",
    )
    s.add_argument(
        "overrides",
        nargs="*",
        help="model=<name|path> and overrides, e.g. cluster=slurm cluster.inference.nodes=2 cluster.time=4:00:00",
    )
    return s


def serve_config(overrides: list[str]) -> Any:
    """The serve job's config: the overrides on the default config, `serve.enabled`, named
    `serve-<model>` unless named, nothing of training."""
    from prime_hpc.config.compose import compose

    named = any(o.split("=", 1)[0].lstrip("+") == "name" for o in overrides)
    cfg = compose([*overrides, "serve.enabled=true", "warmup.experiment=null"])
    if not named:
        cfg.name = f"serve-{Path(str(cfg.model.name)).name}"
        if not any(o.split("=", 1)[0].lstrip("+") == "output_dir" for o in overrides):
            cfg.output_dir = f"outputs/{cfg.name}"
    cfg.wandb.enabled = False
    cfg.ckpt.enabled = False
    cfg.ckpt.interval = None
    if not any(o.split("=", 1)[0].lstrip("+") == "cluster.max_requeues" for o in overrides):
        cfg.cluster.max_requeues = 0  # it ends at its time limit unless told to come back
    return cfg


def run(a: argparse.Namespace) -> int:
    from prime_hpc.inference.client import API_KEY_VAR
    from prime_hpc.launcher import launch

    if not os.environ.get(API_KEY_VAR):
        raise UserError(
            f"serve needs a key its clients can send: export {API_KEY_VAR}=<a secret> first (the servers "
            "answer only with it; eval, a run's teacher and synthesize read it from the same variable)"
        )
    cfg = serve_config(a.overrides)
    sub = launch.submit(cfg, a.overrides)
    ref = sub.ref
    group = sub.plan.group("inference")
    nodes = group.nodes if group is not None else 0
    print(f"submitted serve job {ref.job_id} ({ref.name}: {cfg.model.name} on {nodes} server(s), {ref.backend})")
    print(f"  output dir: {ref.output_dir}")
    print(f"  stop:       prime-hpc cancel {ref.job_id}    logs: prime-hpc tail {ref.job_id}")
    if a.no_wait:
        return 0
    return wait_until_serving(ref, float(cfg.inference.startup_timeout_s) + 600)


def wait_until_serving(ref: Any, timeout_s: float) -> int:
    """Until the job publishes its URL (print it) or ends (one line naming its logs)."""
    from prime_hpc.launcher.state import state_fn
    from prime_hpc.rundir import jobs

    state = state_fn(ref)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            found = jobs.served(ref.run)
            if found:
                print(f"serving {found['model']} at {found['url']} (key: ${found['key_var']})", flush=True)
                return 0
            st, _ = state()
            if st in jobs.FINAL_STATES:
                raise UserError(
                    f"serve job {ref.job_id} ended {st} before serving; see prime-hpc tail {ref.job_id} "
                    f"--no-follow (logs: {ref.run.latest_logs})"
                )
            time.sleep(1.0)
    except KeyboardInterrupt:
        print(f"\nstopped waiting; the job goes on (prime-hpc status {ref.job_id})", file=sys.stderr)
        return 130
    print(
        f"serve job {ref.job_id} does not serve yet after {timeout_s:.0f}s; it goes on (prime-hpc status {ref.job_id})",
        file=sys.stderr,
    )
    return 1
