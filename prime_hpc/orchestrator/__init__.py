"""The orchestrator: verifiers environments → group rollouts through the inference router
→ advantages and filtering → per-rank batches in `rollouts/step_n/`, plus the weight relay
to the inference servers and periodic eval. Runs on the head node (het group 0).

`main(["--config", "<run>/configs/orchestrator.yaml"])` returns a summary dict on success
and raises SystemExit with one line naming the cause (and where to look) on failure.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Optional


def main(argv: Optional[list[str]] = None) -> dict:
    from loguru import logger

    from prime_hpc.rundir.checkpoints import CheckpointWriteError
    from prime_hpc.config.component import OrchestratorRunConfig, load
    from prime_hpc.core.errors import UserError
    from prime_hpc.rundir import WaitTimeout

    p = argparse.ArgumentParser(prog="python -m prime_hpc.orchestrator")
    p.add_argument("--config", required=True, help="the run's configs/orchestrator.yaml")
    a = p.parse_args(argv)
    from prime_hpc.inference.client import API_KEY_VAR, api_key

    if not api_key():  # every server of the job demands it: nothing could be asked of them
        raise SystemExit(f"prime-hpc orchestrator: {API_KEY_VAR} is not set: the job's servers answer only with "
                         "the job's key (the job's environment must carry it)")
    try:
        cfg = load(a.config, OrchestratorRunConfig, "orchestrator")
    except UserError as e:
        raise SystemExit(f"prime-hpc orchestrator: {e}") from None
    logger.remove()
    logger.add(sys.stdout, level=cfg.orchestrator.log.level.upper(),
               format="{time:HH:mm:ss} {level} orchestrator: {message}")
    from prime_hpc.orchestrator.loop import Orchestrator

    try:
        if cfg.bench.mode is not None:  # a bench run: fixed prompts, no environment
            from prime_hpc.orchestrator import bench

            return asyncio.run(bench.run(cfg))
        return asyncio.run(Orchestrator(cfg).main())
    except (UserError, WaitTimeout, CheckpointWriteError) as e:
        lines = str(e).splitlines()
        if len(lines) > 1:  # a wait's log tail: keep it in our log, one line for the record
            print("\n".join(lines[1:]), file=sys.stderr)
        raise SystemExit(f"prime-hpc orchestrator: {lines[0]}") from None


if __name__ == "__main__":
    main()
