"""A bench (`submit --bench [all|trainer|inference]`): the composed run itself (config,
placement, model) on synthetic data for `bench.steps` steps, in `<output_dir>-bench` so
the run's own directory stays free; its results are `bench.json`."""

from __future__ import annotations

from typing import Any, Optional

from prime_hpc.config.schema import BENCH_MODES
from prime_hpc.core.errors import LaunchError, UserError
from prime_hpc.rundir import jobs

BENCH_SUFFIX = "-bench"  # a bench runs in <output_dir>-bench, named <name>-bench: the run's own stays free


def check_request(part: Optional[str], multirun: bool, max_parallel: Optional[int]) -> None:
    """One line refusing what a bench cannot be: an unknown part, a sweep."""
    if part is not None and part not in BENCH_MODES:
        raise UserError(
            f"--bench {part}: unknown part; choose from {', '.join(BENCH_MODES)} (or --bench alone: all of them)"
        )
    if multirun or max_parallel:
        raise UserError(
            "--bench measures one run; drop -m / --max-parallel (or sweep with bench.mode=... and read "
            "each run's bench.json)"
        )


def bench_config(overrides: list[str], mode: Optional[str]) -> Any:
    """The run a bench measures: the composed run itself (config, placement, model), with
    `bench.mode` set, in `<output_dir>-bench`; no warm-up (the shape is what is measured,
    not the weights), no checkpoints, no W&B. A previous bench in that directory is
    replaced."""
    import yaml

    from prime_hpc.config.compose import compose
    from prime_hpc.config.validate import validate
    from prime_hpc.rundir import RunDir

    extra = [f"bench.mode={mode}"] if mode else []
    cfg = compose(
        [
            *overrides,
            *extra,
            "warmup.experiment=null",
            "wandb.enabled=false",
            "ckpt.enabled=false",
            "ckpt.interval=null",
            "ckpt.step=null",
        ]
    )
    if cfg.trainer.type == "sft" and cfg.bench.mode == "all":
        cfg.bench.mode = "trainer"  # an SFT run is only a trainer
    cfg.name = f"{cfg.name}{BENCH_SUFFIX}"
    cfg.output_dir = f"{cfg.output_dir}{BENCH_SUFFIX}"
    run = RunDir(cfg.output_dir)
    try:
        earlier = yaml.safe_load(run.config_yaml.read_text()) or {}
    except (OSError, yaml.YAMLError):
        earlier = {}
    if (earlier.get("bench") or {}).get("mode"):
        cfg.clean_output_dir = True
    validate(cfg)
    return cfg


def results(ref: jobs.JobRef, state: str) -> dict:
    """The ended bench's results (bench.json); a one-line error naming where to look
    when it ended without them."""
    from prime_hpc.rundir import read_json

    try:
        found = read_json(ref.run.bench_json)
    except (OSError, ValueError):
        found = None
    if state != jobs.COMPLETED or found is None:
        raise LaunchError(
            f"bench job {ref.job_id} ended {state} without results; see prime-hpc tail {ref.job_id} "
            f"--no-follow (logs: {ref.run.latest_logs})"
        )
    return found
