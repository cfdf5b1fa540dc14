"""The orchestrator: verifiers environments → group rollouts through the inference router
→ advantages and filtering → per-rank batches in `rollouts/step_n/`, plus the weight relay
to the inference servers and periodic eval. Runs on the head node (het group 0).

`main(["--config", "<run>/configs/orchestrator.yaml"])` returns a summary dict on success
and raises SystemExit with one line naming the cause (and where to look) on failure.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional


def main(argv: Optional[list[str]] = None) -> dict:
    import asyncio  # here, not at the top: `status` reads `orchestrator.serve` and stays light

    from loguru import logger

    from prime_hpc.config.component import OrchestratorRunConfig, load
    from prime_hpc.core.errors import UserError
    from prime_hpc.rundir import WaitTimeout
    from prime_hpc.rundir.checkpoints import CheckpointWriteError

    p = argparse.ArgumentParser(prog="python -m prime_hpc.orchestrator")
    p.add_argument("--config", required=True, help="the run's configs/orchestrator.yaml")
    a = p.parse_args(argv)
    from prime_hpc.runtime.limits import raise_open_files

    raise_open_files("prime-hpc orchestrator")
    from prime_hpc.inference.client import API_KEY_VAR, api_key

    if not api_key():  # every server of the job demands it: nothing could be asked of them
        raise SystemExit(
            f"prime-hpc orchestrator: {API_KEY_VAR} is not set: the job's servers answer only with "
            "the job's key (the job's environment must carry it)"
        )
    try:
        cfg = load(a.config, OrchestratorRunConfig, "orchestrator")
    except UserError as e:
        raise SystemExit(f"prime-hpc orchestrator: {e}") from None
    logger.remove()
    logger.add(
        sys.stdout, level=cfg.orchestrator.log.level.upper(), format="{time:HH:mm:ss} {level} orchestrator: {message}"
    )
    from prime_hpc.orchestrator.loop import Orchestrator

    try:
        if cfg.synthesize.out:  # a synthesize job: the envs played, the rollouts that pass written
            from prime_hpc.orchestrator.synthesize import run_job as synthesize

            return synthesize(cfg)
        if cfg.serve.enabled:  # a serve job: the servers' URL published until the job ends
            from prime_hpc.orchestrator.serve import run as serve

            return serve(cfg)
        if cfg.eval_job.steps:  # an eval job: the eval runner beside the job's servers
            from prime_hpc.orchestrator.evaluate import run_job

            return run_job(cfg)
        if cfg.bench.mode is not None:  # a bench run: fixed prompts, no environment
            from prime_hpc.orchestrator import bench

            return asyncio.run(bench.run(cfg))
        return asyncio.run(Orchestrator(cfg).main())
    except (UserError, WaitTimeout, CheckpointWriteError) as e:
        lines = str(e).splitlines()
        if len(lines) > 1:  # a wait's log tail: keep it in our log, one line for the record
            print("\n".join(lines[1:]), file=sys.stderr)
        log = getattr(e, "log", None)  # the log to read first, when it is not ours (an env's)
        record_failure(cfg.output_dir, lines[0], log)
        said = f"; see {log}" if log and str(log) not in lines[0] else ""
        raise SystemExit(f"prime-hpc orchestrator: {lines[0]}{said}") from None


def record_failure(output_dir: str, cause: str, log: object = None) -> None:
    """Leave the one-line cause of this exit (and the log it names) for the supervisor's
    record of the attempt (`RunDir.failure_record`); best effort."""
    from prime_hpc.rundir import RunDir, atomic_write_json

    try:
        atomic_write_json(
            RunDir(output_dir).failure_record("orchestrator"), {"reason": cause, "log": str(log) if log else None}
        )
    except OSError:
        pass


if __name__ == "__main__":
    main()
