"""`prime-hpc eval TARGET [steps=N,M] [overrides]`: score saved weights on the eval envs;
`prime-hpc eval @ rl.toml [overrides]`: the recipe's model on its eval envs (`@ FILE` and the
`PRIME_` variables taken as `submit` takes them)."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any) -> argparse.ArgumentParser:
    e = sub.add_parser(
        "eval",
        help="score saved weights/step_N on the run's eval envs, or any model or endpoint on "
        "any envs (starts an inference server unless given one)",
    )
    e.add_argument(
        "target",
        help="job id, run name, output dir, or <run>/weights/step_N; or model=<name|path> "
        "(or client.base_url=<endpoint>) followed by env=<id>[,<id>...]; or @ FILE (a recipe in the reference's "
        "TOML layout: its model on its [[orchestrator.eval.env]])",
    )
    e.add_argument(
        "--trust-run-code",
        action="store_true",
        help="a run of someone else's: also load what its config names that would run their code (eval "
        "env ids that are paths, model.trust_remote_code=true, inference.extra_args)",
    )
    e.add_argument(
        "--here",
        action="store_true",
        help="serve and score on this machine (the default with cluster=local); on a SLURM cluster eval "
        "is otherwise a job: the run's inference nodes with the eval runner beside them",
    )
    e.add_argument(
        "--no-base",
        action="store_true",
        help="a run: score only its saved steps, not the base model too (step 0, by default scored first)",
    )
    e.add_argument(
        "args",
        nargs="*",
        help="steps=N,M (default: the base model, 0, and every saved step), out=DIR (or output_dir=DIR: "
        "where eval writes; a run's eval/ by default) and overrides of the run config; without a run: env=, "
        "args.<env>.<arg>=VALUE, rollouts=K, examples=N, client.model=",
    )
    return e


def run(a: argparse.Namespace) -> int:
    from prime_hpc.cli import model_recipe, split_recipes
    from prime_hpc.core.errors import UserError
    from prime_hpc.launcher.evaluate import STANDALONE_KEYS, is_standalone, run_eval, run_standalone

    if a.target.startswith("@") or is_standalone(a.target):  # a config composed as submit composes it
        return run_standalone(model_recipe([a.target, *a.args], STANDALONE_KEYS, "orchestrator.eval.env"), a.here)
    files, _ = split_recipes(a.args)
    if files:
        raise UserError(
            f"eval {a.target} takes overrides of the run's recorded config, not a recipe ({' '.join(files)}); "
            "prime-hpc eval @ FILE scores the recipe's model on its eval envs"
        )
    return run_eval(a.target, a.args, trust_run_code=a.trust_run_code, base=not a.no_base, here=a.here)
