"""`prime-hpc synthesize`: what it is given, and where it runs (a job of the model's
servers with the synthesize runner beside them, or this machine); the work itself is
`prime_hpc.orchestrator.synthesize`'s."""

from __future__ import annotations

from pathlib import Path

KEYS = ("model", "env", "rollouts", "examples", "min_reward", "out", "serve", "client.base_url", "client.model")


def run_command(args: list[str], here: bool = False) -> int:
    """`prime-hpc synthesize model=<name|path> env=<id>[,<id>...] [args.<id>.<arg>=V ...]
    [rollouts=K] [examples=N] [min_reward=R] [out=DIR] [--here] [overrides]` (or
    `serve=<job>` / `client.base_url=<endpoint>` instead of a model: nothing is started).
    On a SLURM cluster (the one the overrides name) a job: the model's inference group
    with the synthesize runner beside it, its files in `<out>/job/`; with `cluster=local`
    or `--here`, one server on this machine."""
    from prime_hpc.core.errors import UserError
    from prime_hpc.inference.client import endpoint_key
    from prime_hpc.launcher import evaluate
    from prime_hpc.orchestrator.synthesize import DATA, SUMMARY, synthesize_here
    from prime_hpc.rundir import with_umask

    w = evaluate.model_words(args, KEYS, "synthesize")
    opts, envs, name, out, k, n = w.opts, w.envs, w.name, w.out, w.rollouts, w.examples
    try:
        min_reward = float(opts["min_reward"]) if "min_reward" in opts else None
    except ValueError:
        raise UserError(f"min_reward={opts['min_reward']}: expected a number") from None
    if (out / DATA).exists():
        raise UserError(f"{out / DATA} exists; choose another out=DIR (nothing is overwritten)")
    cfg = w.compose()
    cfg.orchestrator.env = w.entries()
    cfg.orchestrator.eval.env = []
    with with_umask(cfg.cluster.umask):
        if "client.base_url" in opts or here or evaluate.runs_here(cfg):
            summary = synthesize_here(cfg, opts, name, out, k, n, min_reward, endpoint_key(opts))
        else:
            cfg.synthesize.out, cfg.synthesize.rollouts = str(out), k
            cfg.synthesize.examples, cfg.synthesize.min_reward = n, min_reward
            job_cfg = evaluate.model_job_config(cfg, out, f"{Path(name).name}-synthesize")
            rc = evaluate.submit_and_follow(
                job_cfg, w.overrides, f"{', '.join(envs)}, {k} rollout(s) per example", str(out / DATA)
            )
            if rc:
                return rc
            from prime_hpc.rundir import read_json

            summary = read_json(out / SUMMARY)
    print(
        f"prime-hpc synthesize: {summary['kept']} of {summary['rollouts']} rollouts kept "
        f"(mean reward {summary['mean_reward']:.3f}, {summary['failed']} failed); wrote {summary['data']} "
        f"(SFT on it: trainer.data.name={summary['data']})"
    )
    return 0
