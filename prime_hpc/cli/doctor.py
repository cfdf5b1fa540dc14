"""`prime-hpc doctor [--require MODULE]... [--timeout S] [overrides]`: submit the run's job
layout with a preflight on every node and print a pass/fail row per node."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_parser(sub: Any) -> argparse.ArgumentParser:
    d = sub.add_parser("doctor", help="preflight the run's job layout on the cluster and print a pass/fail table")
    d.add_argument("--timeout", type=float, default=900, help="seconds to wait for the preflight job")
    d.add_argument(
        "--require",
        action="append",
        default=[],
        metavar="MODULE",
        help="also check that every node can import MODULE (repeatable)",
    )
    d.add_argument("overrides", nargs="*")
    return d


def run(a: argparse.Namespace) -> int:
    from prime_hpc.config.compose import compose
    from prime_hpc.job.preflight import format_table
    from prime_hpc.launcher import launch
    from prime_hpc.rundir import read_json

    cfg = compose(a.overrides)
    # every node must import the run's environments too, and whatever the user names
    envs = [e.id for e in list(cfg.orchestrator.env) + list(cfg.orchestrator.eval.env)]
    require = ",".join(dict.fromkeys([*envs, *a.require]))
    sub = launch.submit(cfg, a.overrides, mode="doctor", extra_env={"PRIME_HPC_PREFLIGHT_REQUIRE": require})
    run = sub.ref.run
    print(
        f"preflight job {sub.ref.job_id} submitted ({sub.ref.backend}); waiting (up to {a.timeout:g}s)...",
        file=sys.stderr,
    )
    try:
        state = launch.wait_done(sub, a.timeout)
    except KeyboardInterrupt:
        launch.cancel(sub.ref)
        raise
    except Exception:
        launch.cancel(sub.ref)
        raise
    if not run.preflight_summary.exists():
        from prime_hpc.job.preflight import collect
        from prime_hpc.launcher.state import batch_log
        from prime_hpc.rundir.jobs import read_job

        failure = read_job(run).get("failure") or {}
        log = failure.get("log") or (run.latest_logs if run.latest_logs.exists() else batch_log(sub.ref))
        if run.preflight_dir.exists():
            print(format_table(collect(run, launch.expected_reports(sub.plan), f"no report; see {log}")))
        print(f"preflight job {sub.ref.job_id} ended {state} without a full report; see {log}")
        return 1
    summary = read_json(run.preflight_summary)
    print(format_table(summary))
    verdict = "PASS" if summary["ok"] and state == "COMPLETED" else "FAIL"
    print(f"preflight {verdict} (job {sub.ref.job_id} {state}); report: {run.preflight_summary}")
    return 0 if verdict == "PASS" else 1
