"""How each run of a job that trains several (`trainer.max_concurrent_runs`, `runs/<name>/`)
ended: `runs/<name>/run.json`, its `job.json`-equivalent, written by the job's trainer (a run
ENDED, REFUSED for a base model or LoRA shape that is not the job's, FAILED when its loss
diverged), by the job's
head (a run whose orchestrator FAILED) and by `prime-hpc cancel <job> --run <name>`
(CANCELLED). Light: read by the trainer, the head and the CLI."""

from __future__ import annotations

import time
from typing import Optional

from prime_hpc.rundir.files import atomic_write_json, read_json
from prime_hpc.rundir.layout import RunDir

ENDED, REFUSED, FAILED, CANCELLED = "ENDED", "REFUSED", "FAILED", "CANCELLED"


def config_mtime(run: RunDir) -> Optional[int]:
    """When the run's trainer config was written (a resume rewrites it)."""
    try:
        return run.component_config("trainer").stat().st_mtime_ns
    except OSError:
        return None


def record(run: RunDir, state: str, step: Optional[int] = None, reason: Optional[str] = None) -> None:
    """How the run ended, under the trainer config it has now."""
    body = {"state": state, "step": step, "reason": reason, "at": time.time(), "config_mtime_ns": config_mtime(run)}
    atomic_write_json(run.run_json, body)


def state(run: RunDir) -> Optional[dict]:
    """The run's record, if it has one that holds for its current config (None: it is to
    run, or to run again after a resume rewrote its config)."""
    try:
        rec = read_json(run.run_json)
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and rec.get("config_mtime_ns") == config_mtime(run) else None


def is_over(run: RunDir) -> bool:
    """The run ended, was refused or failed under the config it has now."""
    return state(run) is not None


def is_stopped(run: RunDir) -> bool:
    """Its orchestrator failed, or it was cancelled: its trainer stops training it."""
    rec = state(run)
    return rec is not None and rec.get("state") in (FAILED, CANCELLED)
