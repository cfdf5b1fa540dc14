"""`prime-hpc submit [overrides] [-m] [--dry-run] [-f] [--max-parallel K] [--bench [PART]]`."""

from __future__ import annotations

import argparse
import copy
import sys
from typing import Any, Optional

from prime_hpc.config.schema import BENCH_MODES
from prime_hpc.core.errors import LaunchError, UserError


class _HelpWithGroups(argparse.Action):
    """`submit --help`: the options, then the config groups and their options (read from
    `conf/` only when asked, so building the parser stays cheap)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kw: Any) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, **kw)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        parser.formatter_class = argparse.RawDescriptionHelpFormatter
        parser.epilog = groups_help()
        parser.print_help()
        parser.exit()


BENCH_SUFFIX = "-bench"  # a bench runs in <output_dir>-bench, named <name>-bench: the run's own stays free


class _Bench(argparse.Action):
    """`--bench [all|trainer|inference]`: the part is optional, so an override right after
    the flag (`--bench +experiment=x`) is an override, not a part."""

    def __init__(self, option_strings: list[str], dest: str, **kw: Any) -> None:
        super().__init__(option_strings, dest=dest, nargs="?", const="all", default=None, **kw)

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, value: Any, option_string: Any = None
    ) -> None:
        if value is not None and value not in BENCH_MODES:
            if "=" in value or value.startswith(("+", "~")):
                namespace.bench_overrides = [*getattr(namespace, "bench_overrides", []), value]
                value = "all"
        setattr(namespace, self.dest, value)  # an unknown part is refused by run_bench, in one line


def groups_help() -> str:
    from prime_hpc.config.compose import conf_dir

    root = conf_dir()
    lines = ["config groups (choose with group=option; +experiment=<name> for a recipe):"]
    for group in sorted(p for p in root.iterdir() if p.is_dir()):
        options = sorted(f.stem for f in group.glob("*.yaml"))
        if options:
            lines.append(f"  {group.name:<14}{', '.join(options)}")
    lines.append(
        "any key of the schema can be overridden: key=value, ~key (remove), +key=value (add); see docs/configuration.md"
    )
    return "\n".join(lines)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    s = sub.add_parser(
        "submit", help="compose a run from Hydra overrides and submit it (with its warm-up, if any)", add_help=False
    )
    s.add_argument("-h", "--help", action=_HelpWithGroups, help="show this help, with the config groups, and exit")
    s.add_argument(
        "--cfg",
        choices=["job", "all"],
        default=None,
        help="print the composed config and exit, writing nothing (job: the run; all: its warm-up too)",
    )
    s.add_argument("--resolve", action="store_true", help="with --cfg: resolve interpolations (as the run sees them)")
    s.add_argument(
        "--info",
        choices=["defaults"],
        default=None,
        help="defaults: the config group options the run is composed from, and exit",
    )
    s.add_argument("-m", "--multirun", action="store_true", help="sweep: one run per combination of a=x,y values")
    s.add_argument(
        "--dry-run",
        action="store_true",
        help="write config.yaml, configs/ and submit/<rl|sft>.sbatch only (for a warm-up too)",
    )
    s.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="then follow the run's logs until it ends (Ctrl-C stops following, not the run)",
    )
    s.add_argument(
        "--max-parallel",
        type=int,
        default=None,
        metavar="K",
        help="sweep: at most K points at a time (each point waits for the one K before it to end)",
    )
    s.add_argument(
        "--bench",
        action=_Bench,
        metavar="PART",
        help="benchmark instead of training: the run's config and placement on synthetic data for "
        "bench.steps steps, then a table (bench.json); PART: all (default), trainer (fake batches "
        "of the configured shape), inference (fixed prompts, no env)",
    )
    s.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. +experiment=reverse_text max_steps=50")
    return s


def compose_all(overrides: list[str], multirun: bool) -> list[tuple[list[str], list]]:
    """Compose and validate every point (of a sweep) before submitting any: nothing is
    submitted if one of them is wrong. Sweep points get `<output_dir>/<i>` and `<name>_<i>`.
    Each point is a list of runs: [run], or [warm-up, run] when the run has a warm-up."""
    from prime_hpc.config.compose import compose
    from prime_hpc.config.overrides import override
    from prime_hpc.config.pipeline import compose_stages
    from prime_hpc.config.sweep import expand_sweep
    from prime_hpc.config.validate import validate

    points = expand_sweep(overrides) if multirun else [overrides]
    # each point gets <output_dir>/<i>, unless the sweep varies output_dir itself
    sweeps_dir = (
        len(points) > 1 and len({o for p in points for o in p if o.lstrip("+~").startswith("output_dir=")}) <= 1
    )
    composed = []
    for i, point in enumerate(points):
        try:
            extra = []
            if len(points) > 1:
                base = compose(point)
                extra.append(override("name", f"{base.name}_{i}"))
                if sweeps_dir:
                    extra.append(override("output_dir", f"{base.output_dir}/{i}"))
            stages = compose_stages([*point, *extra])
            for cfg in stages:
                try:
                    validate(cfg)
                except UserError as e:
                    if cfg is not stages[-1]:
                        raise UserError(f"warm-up {cfg.output_dir}: {e}") from None
                    raise
        except UserError as e:
            if len(points) > 1:
                raise UserError(f"sweep point {i} ({swept(point, overrides)}): {e}") from None
            raise
        composed.append((point, stages))
    return composed


def swept(point: list[str], overrides: list[str]) -> str:
    """What a sweep point sets differently from the others (its legend)."""
    return " ".join(o for o in point if o not in overrides)


def show(a: argparse.Namespace) -> int:
    """--cfg / --info: what the overrides compose to, printed; nothing written or submitted."""
    from prime_hpc.config.compose import compose, finish
    from prime_hpc.config.dump import to_yaml
    from prime_hpc.config.pipeline import compose_stages, warmup_config

    if a.info == "defaults":
        from prime_hpc.config.compose import defaults_choices

        for group, option in defaults_choices(a.overrides):
            print(f"{group}: {option}")
        return 0
    if a.resolve:
        stages = compose_stages(a.overrides)
    else:
        run_cfg = compose(a.overrides, resolve=False)
        stages = [run_cfg]
        if a.cfg == "all":
            warm = warmup_config(finish(copy.deepcopy(run_cfg)))
            stages = ([warm] if warm is not None else []) + stages
    if a.cfg == "job":
        stages = stages[-1:]
    for i, cfg in enumerate(stages):
        if len(stages) > 1:
            print(f"# {'warm-up' if i < len(stages) - 1 else 'run'}: {cfg.output_dir}")
        print(to_yaml(cfg, resolve=a.resolve), end="")
    return 0


def run(a: argparse.Namespace) -> int:
    from prime_hpc.launcher import launch
    from prime_hpc.launcher.plan import After

    if a.cfg or a.info:
        return show(a)
    a.overrides = [*getattr(a, "bench_overrides", []), *a.overrides]
    if a.bench or any(o.lstrip("+").startswith("bench.mode=") for o in a.overrides):
        return run_bench(a)
    if a.max_parallel is not None and a.max_parallel < 1:
        raise UserError(f"--max-parallel {a.max_parallel}: give at least 1")
    composed = compose_all(a.overrides, a.multirun)
    if a.follow and len(composed) > 1:
        raise UserError("--follow follows one run; for a sweep, follow a point with prime-hpc tail <job>")
    for _, stages in composed:  # refuse before writing or submitting anything
        launch.check_fresh(stages[-1], dry_run=a.dry_run)
    if a.dry_run:
        for _, stages in composed:
            for cfg in stages:
                run_dir, plan = launch.prepare(cfg, "run", dry_run=True, validated=True)  # by compose_all
                files = [
                    run_dir.component_config(g) for g in plan.group_names if g != "orchestrator" or plan.kind == "rl"
                ]
                print(
                    f"dry run: nothing submitted; wrote {run_dir.config_yaml}, "
                    + ", ".join(map(str, files))
                    + f", {run_dir.sbatch_script(plan.kind)}"
                )
        return 0
    import secrets

    sweep_id = f"sweep-{secrets.token_hex(3)}" if len(composed) > 1 else None
    submitted: list[list] = []
    for i, (point, stages) in enumerate(composed):
        after = []
        if a.max_parallel and i >= a.max_parallel:
            prior = submitted[i - a.max_parallel][-1].ref
            after = [After(job_id=prior.job_id, output_dir=prior.output_dir, ok=False)]
        sweep = (
            {"id": sweep_id, "point": i, "points": len(composed), "swept": swept(point, a.overrides)}
            if sweep_id
            else None
        )
        subs = launch.submit_stages(stages, point, after=after, sweep=sweep)
        submitted.append(subs)
        _report(subs, sweep)
    if sweep_id:
        print(
            f"sweep {sweep_id}: {len(composed)} runs"
            + (f", at most {a.max_parallel} at a time" if a.max_parallel else "")
            + f"    state: prime-hpc status {sweep_id}    curves: prime-hpc plot {sweep_id}"
        )
    if a.follow:
        from prime_hpc.cli.tail import follow_ref

        rc = 0
        for sub in submitted[0]:  # the warm-up first, then the run
            rc = follow_ref(sub.ref)
            if rc:
                break
        return rc
    return 0


def _report(subs: list, sweep: Any) -> None:
    for sub in subs:
        ref = sub.ref
        what = "warm-up" if len(subs) > 1 and sub is subs[0] else "run"
        print(
            f"submitted {what} job {ref.job_id} ({ref.name}, {ref.kind}, {ref.backend})"
            + (f", starts after job {subs[0].ref.job_id} completes" if what == "run" and len(subs) > 1 else "")
            + (f" [{sweep['swept']}]" if sweep and sub is subs[-1] else "")
        )
        print(f"  output dir: {ref.output_dir}")
    ref = subs[-1].ref
    print(f"  follow:     prime-hpc tail {ref.job_id}    state: prime-hpc status {ref.job_id}", file=sys.stdout)


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


def run_bench(a: argparse.Namespace) -> int:
    """Submit a bench run, wait for it (or follow it with -f), print its table."""
    from prime_hpc.launcher import launch

    if a.bench is not None and a.bench not in BENCH_MODES:
        raise UserError(
            f"--bench {a.bench}: unknown part; choose from {', '.join(BENCH_MODES)} (or --bench alone: all of them)"
        )
    if a.multirun or a.max_parallel:
        raise UserError(
            "--bench measures one run; drop -m / --max-parallel (or sweep with bench.mode=... and read "
            "each run's bench.json)"
        )
    cfg = bench_config(a.overrides, a.bench)
    launch.check_fresh(cfg, dry_run=a.dry_run)
    if a.dry_run:
        run_dir, plan = launch.prepare(cfg, "run", dry_run=True)
        print(f"dry run: nothing submitted; wrote {run_dir.config_yaml} and {run_dir.sbatch_script(plan.kind)}")
        return 0
    sub = launch.submit(cfg, a.overrides)
    ref = sub.ref
    print(
        f"submitted bench job {ref.job_id} ({ref.name}, {cfg.bench.mode}: {', '.join(sub.plan.group_names)}, "
        f"{ref.backend}): {cfg.bench.warmup_steps} warm-up + {cfg.bench.steps} measured step(s)"
    )
    print(f"  output dir: {ref.output_dir}")
    try:
        state = _follow_bench(ref, a.follow)
    except KeyboardInterrupt:
        print(
            f"\nstopped waiting; the bench goes on (prime-hpc status {ref.job_id}); results: {ref.run.bench_json}",
            file=sys.stderr,
        )
        return 130
    return print_bench(ref, state)


def _follow_bench(ref: Any, follow: bool) -> str:
    """Until the bench job ends; its final state."""
    import time

    from prime_hpc.cli.tail import follow_ref, state_fn
    from prime_hpc.rundir import jobs

    if follow:
        follow_ref(ref)
    state = state_fn(ref)
    while True:
        st, _ = state()
        if st in jobs.FINAL_STATES:
            return st
        time.sleep(1.0)


def print_bench(ref: Any, state: str) -> int:
    from prime_hpc.rundir import bench, jobs, read_json

    try:
        results = read_json(ref.run.bench_json)
    except (OSError, ValueError):
        results = None
    if state != jobs.COMPLETED or results is None:
        raise LaunchError(
            f"bench job {ref.job_id} ended {state} without results; see prime-hpc tail {ref.job_id} "
            f"--no-follow (logs: {ref.run.latest_logs})"
        )
    print(bench.table(results))
    print(f"results: {ref.run.bench_json}")
    return 0
