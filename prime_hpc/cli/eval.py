"""`prime-hpc eval TARGET [steps=N,M] [overrides]`: score saved weights on the eval envs."""
from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any) -> argparse.ArgumentParser:
    e = sub.add_parser("eval", help="score saved weights/step_N on the run's eval envs (starts an inference server)")
    e.add_argument("target", help="job id, run name, output dir, or <run>/weights/step_N")
    e.add_argument("args", nargs="*", help="steps=N,M (default: every saved step) and overrides of the run config")
    return e


def run(a: argparse.Namespace) -> int:
    from prime_hpc.orchestrator.evaluate import run_eval

    return run_eval(a.target, a.args)
