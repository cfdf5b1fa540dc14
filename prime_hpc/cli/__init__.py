"""`prime-hpc`: one module per command (`prime_hpc/cli/<command>.py`), each a thin layer over
the library: it adds its arguments to the parser (`add_parser`) and runs (`run`).

Heavy modules are imported inside the commands that need them; `--help`, `status`,
`list`, `tail` and `submit --dry-run` never import torch or vllm.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, cast

COMMANDS = (
    "submit",
    "resume",
    "scale",
    "status",
    "list",
    "tail",
    "cancel",
    "plot",
    "eval",
    "serve",
    "synthesize",
    "doctor",
    "completion",
    "config",
)
TAKES_OVERRIDES = ("submit", "doctor", "resume", "scale", "serve")  # extra words are overrides

USAGE_EXAMPLES = """examples:
  prime-hpc submit +experiment=reverse_text                 compose with Hydra, submit (here: SFT warm-up, then RL)
  prime-hpc submit +experiment=reverse_text -f              ... and follow it until it ends
  prime-hpc submit +experiment=reverse_text --dry-run       write configs and job scripts, submit nothing
  prime-hpc submit @ rl.toml @ more.toml max_steps=50       a recipe in the reference's TOML layout (later wins)
  prime-hpc submit -m +experiment=reverse_text trainer.optim.lr=1e-6,3e-6   a sweep: one run per point
  prime-hpc resume JOB ckpt.step=-1 max_steps=200           continue a run from its latest checkpoint
  prime-hpc scale JOB inference=+2 partition=preempt        two more inference nodes for a running run (-2: remove them)
  prime-hpc status JOB --watch        prime-hpc plot JOB... -o curves.png       prime-hpc tail JOB
  prime-hpc list      prime-hpc cancel JOB      prime-hpc eval JOB steps=10,20
  prime-hpc serve model=tiny cluster=dev                    serve a model as a job (eval serve=JOB env=...)
  prime-hpc synthesize model=M env=reverse-text rollouts=4 min_reward=1 out=DIR   an SFT dataset from an env
  prime-hpc eval @ rl.toml                                   a recipe's model on its eval envs (synthesize @ too)
  prime-hpc config export JOB -o rl.toml                  the run's config as a recipe in the reference's TOML layout
  prime-hpc doctor +experiment=reverse_text cluster=dev     preflight the job layout on the cluster
  prime-hpc submit +experiment=reverse_text --bench         benchmark the run's trainer and inference (bench.json)
  eval "$(prime-hpc completion bash)"                        TAB-complete commands, options, groups and keys
JOB is a SLURM job id, a run name, an output dir, or a sweep id."""


RECIPES = ("submit", "doctor", "serve")  # take `@ rl.toml` (the reference's TOML layout) and its PRIME_ variables
OWN_DIR = ("serve",)  # write a directory of their own: a recipe's output_dir (its training run's) is not it


def with_recipes(overrides: list[str], run_dir: bool = True) -> list[str]:
    """`overrides` with each `@ file` and the `PRIME_<SECTION>__<KEY>` variables as prime-hpc
    overrides (`prime_hpc.config.toml_recipes`, imported only when one is there); without
    `run_dir`, not the output_dir a file or variable names (the command line's stays)."""
    import os

    if not any(w.startswith("@") for w in overrides) and not any(
        k.startswith("PRIME_") and not k.startswith("PRIME_HPC_") for k in os.environ
    ):
        return overrides
    from prime_hpc.config import toml_recipes

    out = toml_recipes.expand(overrides, os.environ)
    if not run_dir and "output_dir" in toml_recipes.ORIGINS:  # only then are all output_dir words theirs
        out = [o for o in out if o.split("=", 1)[0].lstrip("+~") != "output_dir"]
    return out


def split_recipes(words: list[str]) -> tuple[list[str], list[str]]:
    """`words` as (each `@ FILE` / `@FILE`, the other words), in order."""
    files: list[str] = []
    rest: list[str] = []
    it = iter(words)
    for w in it:
        if w == "@":
            files += [w, *([nxt] if (nxt := next(it, None)) is not None else [])]
        elif w.startswith("@"):
            files.append(w)
        else:
            rest.append(w)
    return files, rest


def model_recipe(words: list[str], own: tuple[str, ...], envs: str) -> list[str]:
    """The words of a command that runs envs against a model (`eval`, `synthesize`; `own`:
    its own keys) with `@ FILE`s and `PRIME_` variables taken as `submit` takes them
    (`with_recipes`): their overrides (but the recipe's output_dir, its training run's: the
    command writes to out=), then the command line's words; with a file, the config they
    compose names what the command line does not: `model=` (model.name), `env=` and each
    env's `args.<id>.<arg>=` (the `envs` list: orchestrator.eval.env or orchestrator.env),
    and for eval `rollouts=`/`examples=` (orchestrator.eval.rollouts_per_example/num_examples)."""
    import json

    from prime_hpc.core.errors import UserError

    files, rest = split_recipes(words)
    recipe = with_recipes(files, run_dir=False)
    if not files:
        return [*recipe, *rest]
    given = {w.split("=", 1)[0] for w in rest if "=" in w}
    from prime_hpc.config.compose import compose

    cfg = compose([*recipe, *(w for w in rest if w.split("=", 1)[0] not in own and not w.startswith("args."))])
    derived: list[str] = []
    if not given & {"model", "serve", "client.base_url"}:
        derived.append(f"model={cfg.model.name}")
    if "env" not in given:
        from omegaconf import OmegaConf

        entries = OmegaConf.select(cfg, envs) or []
        if not entries:
            raise UserError(f"{' '.join(files)}: the recipe names no envs ({envs} is empty); give env=<id>[,<id>...]")
        derived.append("env=" + ",".join(str(e.id) for e in entries))
        for e in entries:
            args = cast(dict, OmegaConf.to_container(e.args))
            derived += [f"args.{e.id}.{k}={json.dumps(v)}" for k, v in args.items()]
    if envs == "orchestrator.eval.env":
        if "rollouts" not in given:
            derived.append(f"rollouts={cfg.orchestrator.eval.rollouts_per_example}")
        if "examples" not in given and cfg.orchestrator.eval.num_examples is not None:
            derived.append(f"examples={cfg.orchestrator.eval.num_examples}")
    return [*recipe, *rest, *derived]


def _origin(e: Exception) -> str:
    """` (from FILE: KEY)` when the key an error names was set by a recipe file or a PRIME_ variable."""
    recipes = sys.modules.get("prime_hpc.config.toml_recipes")
    key = getattr(e, "key", None)
    where = recipes.origin(key) if recipes is not None and isinstance(key, str) else None
    return f" (from {where})" if where else ""


def print_err(msg: str) -> None:
    print(f"prime-hpc: error: {msg}", file=sys.stderr)


def command(name: str):
    """The module of command `name` (imported on demand)."""
    return importlib.import_module(f"prime_hpc.cli.{name}")


def build_parser(only: Optional[str] = None) -> argparse.ArgumentParser:
    """The whole CLI, or with `only` just that command's sub-parser (what parsing its
    arguments needs: the other commands' modules are not imported)."""
    p = argparse.ArgumentParser(
        prog="prime-hpc",
        description="SLURM-native asynchronous RL and SFT for LLMs.",
        epilog=USAGE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name in [only] if only in COMMANDS else COMMANDS:
        mod = command(name)
        sp = mod.add_parser(sub)
        sp.set_defaults(fn=mod.run)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    from prime_hpc.core.errors import LaunchError, UserError

    words = sys.argv[1:] if argv is None else argv
    parser = build_parser(words[0] if words else None)
    args, unknown = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if unknown:
        if args.command in TAKES_OVERRIDES:  # e.g. "~key" or options after overrides
            bad = [u for u in unknown if u.startswith("-") and not u.startswith("~")]
            if bad:
                print_err(f"unknown option {bad[0]!r} (see prime-hpc {args.command} --help)")
                return 2
            args.overrides += unknown
        else:
            print_err(f"unexpected argument {unknown[0]!r} (see prime-hpc {args.command} --help)")
            return 2
    try:
        if args.command in RECIPES:  # with the words `--bench` took (`--bench @ rl.toml`)
            words = [*getattr(args, "bench_overrides", []), *args.overrides]
            args.overrides = with_recipes(words, run_dir=args.command not in OWN_DIR)
            args.bench_overrides = []
        return args.fn(args)
    except (UserError, LaunchError) as e:
        print_err(str(e) + _origin(e))
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `prime-hpc list | head`
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
