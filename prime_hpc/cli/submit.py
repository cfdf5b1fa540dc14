"""`prime-hpc submit [@ recipe.toml]... [overrides] [-m] [--dry-run] [-f] [--max-parallel K] [--bench [PART]]`."""

from __future__ import annotations

import argparse
import copy
import sys
from typing import Any

from prime_hpc.config.schema import BENCH_MODES
from prime_hpc.core.errors import UserError


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


class _Bench(argparse.Action):
    """`--bench [all|trainer|inference]`: the part is optional, so an override right after
    the flag (`--bench +experiment=x`) is an override, not a part."""

    def __init__(self, option_strings: list[str], dest: str, **kw: Any) -> None:
        super().__init__(option_strings, dest=dest, nargs="?", const="all", default=None, **kw)

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, value: Any, option_string: Any = None
    ) -> None:
        if value is not None and value not in BENCH_MODES:
            if "=" in value or value.startswith(("+", "~", "@")):
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
        "--together",
        action="store_true",
        help="sweep of LoRA runs: every point a run of one job, sharing its inference servers and one "
        "trainer (trainer.max_concurrent_runs; docs/launcher.md)",
    )
    s.add_argument(
        "--into",
        metavar="JOB",
        default=None,
        help="add the run (each point with -m) to a running job submitted --together; it takes an "
        "adapter slot of its trainer when one is free",
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
    s.add_argument(
        "overrides",
        nargs="*",
        help="Hydra overrides, e.g. +experiment=reverse_text max_steps=50; '@ rl.toml' reads a recipe in the "
        "reference's TOML layout (files in order, then the overrides; docs/configuration.md)",
    )
    return s


def show(a: argparse.Namespace) -> int:
    """--cfg / --info: what the overrides compose to, printed; nothing written or submitted."""
    from prime_hpc.config.compose import compose, finish
    from prime_hpc.config.dump import to_yaml
    from prime_hpc.config.pipeline import compose_stages, model_overrides, warmup_config

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
            warm = warmup_config(finish(copy.deepcopy(run_cfg)), model_overrides(a.overrides))
            stages = ([warm] if warm is not None else []) + stages
    if a.cfg == "job":
        stages = stages[-1:]
    for i, cfg in enumerate(stages):
        if len(stages) > 1:
            print(f"# {'warm-up' if i < len(stages) - 1 else 'run'}: {cfg.output_dir}")
        print(to_yaml(cfg, resolve=a.resolve), end="")
    return 0


def run(a: argparse.Namespace) -> int:
    if a.cfg or a.info:
        return show(a)
    a.overrides = [*getattr(a, "bench_overrides", []), *a.overrides]
    if a.bench or any(o.lstrip("+").startswith("bench.mode=") for o in a.overrides):
        return run_bench(a)
    from prime_hpc.launcher import sweep

    if getattr(a, "into", None):
        return run_into(a)
    if getattr(a, "together", False):
        return run_together(a)
    if a.max_parallel is not None and a.max_parallel < 1:
        raise UserError(f"--max-parallel {a.max_parallel}: give at least 1")
    points = sweep.compose_points(a.overrides, a.multirun)
    if a.follow and len(points) > 1:
        raise UserError("--follow follows one run; for a sweep, follow a point with prime-hpc tail <job>")
    sweep.check_fresh(points, dry_run=a.dry_run)  # refuse before writing or submitting anything
    if a.dry_run:
        for files in sweep.write_launch_files(points):
            print("dry run: nothing submitted; wrote " + ", ".join(map(str, files)))
        return 0
    sweep_id = sweep.new_sweep_id(points)
    submitted = []
    for subs, record in sweep.submit_points(points, a.overrides, sweep_id, a.max_parallel):
        submitted.append(subs)
        _report(subs, record)
    if sweep_id:
        print(
            f"sweep {sweep_id}: {len(points)} runs"
            + (f", at most {a.max_parallel} at a time" if a.max_parallel else "")
            + f"    state: prime-hpc status {sweep_id}    curves: prime-hpc plot {sweep_id}"
        )
    if a.follow:
        from prime_hpc.launcher.state import follow_ref

        rc = 0
        for sub in submitted[0]:  # the warm-up first, then the run
            rc = follow_ref(sub.ref)
            if rc:
                break
        return rc
    return 0


def run_together(a: argparse.Namespace) -> int:
    """`-m ... --together`: the sweep's points as the runs of one job."""
    from prime_hpc.launcher import launch, together

    if not a.multirun:
        raise UserError("--together puts the points of a sweep in one job: give -m and a sweep (a=x,y)")
    if a.max_parallel is not None:
        raise UserError(
            "--together runs every point in one job (trainer.max_concurrent_runs at once); drop --max-parallel"
        )
    job, runs = together.compose_together(a.overrides)
    launch.check_fresh(job, dry_run=a.dry_run)
    if a.dry_run:
        run, plan = launch.prepare(job, "run", dry_run=True, validated=True, runs=runs)
        files = [*launch.launch_files(run, plan), *(f for r in runs for f in together.run_files(r))]
        print("dry run: nothing submitted; wrote " + ", ".join(map(str, files)))
        return 0
    sub = launch.submit(job, a.overrides, runs=runs)
    ref = sub.ref
    names = [str(r.name) for r in runs]
    print(
        f"submitted job {ref.job_id} ({ref.name}, {ref.kind}, {ref.backend}): {len(runs)} runs together "
        f"({', '.join(names)}), {job.trainer.max_concurrent_runs} at a time on one trainer"
    )
    print(f"  output dir: {ref.output_dir}  (runs: {ref.output_dir}/runs/<name>/)")
    print(f"  follow:     prime-hpc tail {ref.job_id}    state: prime-hpc status {ref.job_id}")
    if a.follow:
        from prime_hpc.launcher.state import follow_ref

        return follow_ref(ref)
    return 0


def run_into(a: argparse.Namespace) -> int:
    """`... --into <job>`: new runs of a running job that trains several."""
    from prime_hpc.launcher import together
    from prime_hpc.rundir import jobs

    if a.together or a.max_parallel is not None or a.follow:
        raise UserError("--into adds runs to a running job: drop --together, --max-parallel and --follow")
    ref = jobs.resolve(a.into)
    runs = together.compose_into(a.overrides, a.multirun, ref)
    if a.dry_run:
        files = [f for r in runs for f in together.run_files(r)]
        print("dry run: nothing added; would write " + ", ".join(files))
        return 0
    together.write_runs(runs)
    names = [str(r.name) for r in runs]
    with jobs.editing_job(ref.run) as job:  # read and written under the lock the supervisor takes too
        job["runs"] = [*(job.get("runs") or []), *names]
    print(
        f"added {len(names)} run(s) to job {ref.job_id} ({ref.name}): {', '.join(names)}; each takes an adapter "
        f"slot of its trainer when one is free"
    )
    print(f"  output dir: {ref.output_dir}/runs/<name>/    state: prime-hpc status {ref.job_id}")
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


def run_bench(a: argparse.Namespace) -> int:
    """Submit a bench run, wait for it (or follow it with -f), print its table."""
    from prime_hpc.launcher import bench, launch

    bench.check_request(a.bench, a.multirun, a.max_parallel)
    cfg = bench.bench_config(a.overrides, a.bench)
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
    from prime_hpc.rundir.bench import table

    print(table(bench.results(ref, state)))
    print(f"results: {ref.run.bench_json}")
    return 0


def _follow_bench(ref: Any, follow: bool) -> str:
    """Until the bench job ends; its final state."""
    import time

    from prime_hpc.launcher.state import follow_ref, state_fn
    from prime_hpc.rundir import jobs

    if follow:
        follow_ref(ref)
    state = state_fn(ref)
    while True:
        st, _ = state()
        if st in jobs.FINAL_STATES:
            return st
        time.sleep(1.0)
