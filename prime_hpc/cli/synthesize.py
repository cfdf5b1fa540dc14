"""`prime-hpc synthesize model=... env=... [rollouts=K] [min_reward=R] out=DIR`: an SFT
dataset from an environment played against a model; `@ rl.toml` (taken as `submit` takes
it) names the model and the envs (its `[[orchestrator.env]]`) the command line does not."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any) -> argparse.ArgumentParser:
    s = sub.add_parser(
        "synthesize",
        help="play envs against a model (a job on SLURM) and write the rollouts that pass as an SFT "
        "dataset (<out>/data.jsonl, the messages layout)",
    )
    s.add_argument(
        "--here",
        action="store_true",
        help="serve and play on this machine (the default with cluster=local)",
    )
    s.add_argument(
        "args",
        nargs="*",
        help="model=<name|path> (or serve=<job>, client.base_url=), env=<id>[,<id>...], args.<env>.<arg>=V, "
        "rollouts=K (per example), examples=N (of each env's training set), min_reward=R, out=DIR, overrides; "
        "@ FILE: a recipe in the reference's TOML layout (its model and [[orchestrator.env]] where not given)",
    )
    return s


def run(a: argparse.Namespace) -> int:
    from prime_hpc.cli import model_recipe
    from prime_hpc.launcher.synthesize import KEYS, run_command

    return run_command(model_recipe(a.args, KEYS, "orchestrator.env"), here=a.here)
