"""`prime-hpc`: submit, resume, doctor, status, list, cancel, tail, eval.

Heavy modules are imported inside the commands that need them; `--help`, `status`,
`list`, `tail` and `submit --dry-run` never import torch or vllm.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Optional

USAGE_EXAMPLES = """examples:
  prime-hpc submit +experiment=reverse_text                 compose with Hydra, submit (here: SFT warm-up, then RL)
  prime-hpc submit +experiment=reverse_text --dry-run       write configs and job scripts, submit nothing
  prime-hpc submit -m +experiment=reverse_text trainer.optim.lr=1e-6,3e-6   a sweep: one run per point
  prime-hpc resume JOB ckpt.step=-1 max_steps=200           continue a run from its latest checkpoint
  prime-hpc doctor +experiment=reverse_text cluster=dev     preflight the job layout on the cluster
  prime-hpc eval JOB steps=10,20                            score saved weights on the run's eval envs
  prime-hpc status [JOB]      prime-hpc list      prime-hpc cancel JOB      prime-hpc tail JOB
JOB is a SLURM job id, a run name or an output dir."""


def _print_err(msg: str) -> None:
    print(f"prime-hpc: error: {msg}", file=sys.stderr)


# ----------------------------------------------------------------------------- submit
def _compose_all(overrides: list[str], multirun: bool) -> list[list]:
    """Compose and validate every point (of a sweep) before submitting any: nothing is
    submitted if one of them is wrong. Sweep points get `<output_dir>/<i>` and `<name>_<i>`.
    Each point is a list of runs: [run], or [warm-up, run] when the run has a warm-up."""
    from prime_hpc.config import compose, expand_sweep
    from prime_hpc.config.compose import override
    from prime_hpc.config.pipeline import compose_stages
    from prime_hpc.config.validate import validate
    from prime_hpc.errors import UserError

    points = expand_sweep(overrides) if multirun else [overrides]
    # each point gets <output_dir>/<i>, unless the sweep varies output_dir itself
    sweeps_dir = len(points) > 1 and len({o for p in points for o in p if o.lstrip("+~").startswith("output_dir=")}) <= 1
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
                swept = " ".join(o for o in point if o not in overrides)
                raise UserError(f"sweep point {i} ({swept}): {e}") from None
            raise
        composed.append((point, stages))
    return composed


def cmd_submit(a: argparse.Namespace) -> int:
    from prime_hpc.launcher import launch

    composed = _compose_all(a.overrides, a.multirun)
    for _, stages in composed:  # refuse before writing or submitting anything
        launch.check_fresh(stages[-1], dry_run=a.dry_run)
    if a.dry_run:
        for _, stages in composed:
            for cfg in stages:
                run, plan = launch.prepare(cfg, "run", dry_run=True)
                print(f"dry run: nothing submitted; wrote {run.config_yaml}, "
                      + ", ".join(str(run.component_config(g)) for g in plan.group_names
                                  if g != "orchestrator" or plan.kind == "rl")
                      + f", {run.sbatch_script(plan.kind)}")
        return 0
    for point, stages in composed:
        subs = launch.submit_stages(stages, point)
        for sub in subs:
            ref = sub.ref
            what = "warm-up" if len(subs) > 1 and sub is subs[0] else "run"
            print(f"submitted {what} job {ref.job_id} ({ref.name}, {ref.kind}, {ref.backend})"
                  + (f", starts after job {subs[0].ref.job_id} completes" if what == "run" and len(subs) > 1 else ""))
            print(f"  output dir: {ref.output_dir}")
        ref = subs[-1].ref
        print(f"  follow:     prime-hpc tail {ref.job_id}    state: prime-hpc status {ref.job_id}")
    return 0


def cmd_resume(a: argparse.Namespace) -> int:
    from prime_hpc import jobs
    from prime_hpc.launcher import launch

    ref = jobs.resolve(a.job)
    sub = launch.resume(ref, a.overrides)
    print(f"resumed {ref.name} as job {sub.ref.job_id} ({sub.ref.backend}) from checkpoint step "
          f"{sub.resume_step}; output dir {ref.output_dir}")
    print(f"  follow:     prime-hpc tail {sub.ref.job_id}    state: prime-hpc status {sub.ref.job_id}")
    return 0


# ----------------------------------------------------------------------------- doctor
def cmd_doctor(a: argparse.Namespace) -> int:
    from prime_hpc.config import compose
    from prime_hpc.doctor import format_table
    from prime_hpc.launcher import launch
    from prime_hpc.rundir import read_json

    cfg = compose(a.overrides)
    # every node must import the run's environments too, and whatever the user names
    envs = [e.id for e in list(cfg.orchestrator.env) + list(cfg.orchestrator.eval.env)]
    require = ",".join(dict.fromkeys([*envs, *a.require]))
    sub = launch.submit(cfg, a.overrides, mode="doctor", extra_env={"PRIME_HPC_PREFLIGHT_REQUIRE": require})
    run = sub.ref.run
    print(f"preflight job {sub.ref.job_id} submitted ({sub.ref.backend}); waiting (up to {a.timeout:g}s)...",
          file=sys.stderr)
    try:
        state = launch.wait_done(sub, a.timeout)
    except KeyboardInterrupt:
        launch.cancel(sub.ref)
        raise
    except Exception:
        launch.cancel(sub.ref)
        raise
    if not run.preflight_summary.exists():
        from prime_hpc.doctor import collect
        from prime_hpc.jobs import read_job

        failure = read_job(run).get("failure") or {}
        log = failure.get("log") or (run.latest_logs if run.latest_logs.exists() else run.batch_log(sub.ref.job_id))
        if run.preflight_dir.exists():
            print(format_table(collect(run, launch.expected_reports(sub.plan), f"no report; see {log}")))
        print(f"preflight job {sub.ref.job_id} ended {state} without a full report; see {log}")
        return 1
    summary = read_json(run.preflight_summary)
    print(format_table(summary))
    verdict = "PASS" if summary["ok"] and state == "COMPLETED" else "FAIL"
    print(f"preflight {verdict} (job {sub.ref.job_id} {state}); report: {run.preflight_summary}")
    return 0 if verdict == "PASS" else 1


# ----------------------------------------------------------------------------- status / list
def _ago(t: Optional[float]) -> str:
    if not t:
        return "-"
    d = max(0.0, time.time() - t)
    return f"{d:.0f}s ago" if d < 120 else f"{d / 60:.0f}m ago" if d < 7200 else f"{d / 3600:.1f}h ago"


def _heartbeat(run, component: str) -> str:
    import json
    import os

    best = None
    try:
        names = [n for n in os.listdir(run.heartbeats_dir) if n.startswith(component + "_")]
    except FileNotFoundError:
        names = []
    for n in names:
        try:
            info = json.loads((run.heartbeats_dir / n).read_text())
        except (OSError, ValueError):
            continue
        if best is None or info.get("time", 0) > best.get("time", 0):
            best = info
    if not best:
        return "-"
    step = f" step {best['step']}" if "step" in best else ""
    return f"{_ago(best.get('time'))}{step}"


def _status_lines(ref) -> list[str]:
    """The state of one job: overall, per group (with heartbeats), attempts, failure."""
    from prime_hpc import jobs
    from prime_hpc.launcher import launch
    from prime_hpc.launcher.slurm import aggregate

    job = jobs.read_job(ref.run)
    groups = launch.group_states(ref)
    overall = aggregate(list(groups.values())) if ref.backend == "slurm" else next(iter(groups.values()))
    attempts = job.get("attempts", [])
    requeues = f", {job['requeues']} requeue(s)" if job.get("requeues") else ""
    out = [f"job {ref.job_id}  {ref.name}  {overall}  ({ref.backend}, {job.get('kind', ref.kind)}"
           f"{', preflight' if ref.mode == 'doctor' else ''}, attempt {len(attempts) or '-'}{requeues})",
           f"output dir: {ref.output_dir}"]
    rows = [("GROUP", "STATE", "HEARTBEAT")] + [(g, st, _heartbeat(ref.run, g)) for g, st in groups.items()]
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    out += ["  " + "  ".join(c.ljust(x) for c, x in zip(r, w)).rstrip() for r in rows]
    for i, a in enumerate(attempts[:-1] if len(attempts) > 1 else []):
        out.append(f"  attempt {i + 1} (job {a['job_id']}, logs/attempt_{a['attempt']}) ended {a.get('end', '?')}"
                   + (f", resumed from step {a['resumed_from']}" if a.get("resumed_from") else ""))
    failure = job.get("failure")
    if failure:
        who = failure.get("component") or "job"
        out.append(f"failed: {who} {failure.get('reason', '')}; see {failure.get('log')}")
    return out


def cmd_status(a: argparse.Namespace) -> int:
    from prime_hpc import jobs
    from prime_hpc.launcher import launch

    if a.job:
        ref = jobs.resolve(a.job)
    else:
        refs = jobs.recent(1)
        if not refs:
            print("no jobs submitted yet (prime-hpc submit ...)")
            return 0
        ref = refs[0]
    refs = launch.pipeline_refs(ref)
    if len(refs) > 1:
        print(f"pipeline: {refs[0].name} (warm-up, job {refs[0].job_id}) -> {refs[1].name} (job {refs[1].job_id})")
    for i, r in enumerate(refs):
        if i:
            print()
        print("\n".join(_status_lines(r)))
    return 0


def cmd_list(a: argparse.Namespace) -> int:
    from prime_hpc import jobs

    refs = jobs.recent(a.n)
    if not refs:
        print("no jobs submitted yet (prime-hpc submit ...)")
        return 0
    rows = [("JOB", "NAME", "STATE", "KIND", "SUBMITTED", "OUTPUT DIR")]
    live = _live_states([r for r in refs if r.backend == "slurm"])
    records = {r.output_dir: jobs.read_job(r.run) for r in refs}
    shown = set()
    for r in refs:
        if r.output_dir in shown:
            continue
        pipe = records[r.output_dir].get("pipeline") or {}
        if "run" in pipe and any(x.output_dir == pipe["run"] for x in refs):
            continue  # a warm-up: listed under its run
        rows.append(_list_row(r, records[r.output_dir], live))
        shown.add(r.output_dir)
        warm = (pipe.get("warmup") or {}).get("output_dir")
        for w in refs:
            if w.output_dir == warm and w.output_dir not in shown:
                row = _list_row(w, records[w.output_dir], live)
                rows.append((" └ " + row[0], *row[1:]))
                shown.add(w.output_dir)
    w = [max(len(r[i]) for r in rows) for i in range(5)]
    for row in rows:
        print("  ".join(c.ljust(x) for c, x in zip(row[:5], w)) + "  " + row[5])
    return 0


def _list_row(r, job: dict, live: dict) -> tuple:
    from prime_hpc import jobs

    state = live.get(r.job_id) or job.get("state", "?")
    if r.backend == "local" and state not in jobs.FINAL_STATES:
        from prime_hpc.launcher import local

        state = local.state(r.run)
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.submitted_at))
    kind = f"{job.get('kind', r.kind)}/{r.backend}" + ("/doctor" if r.mode == "doctor" else "")
    return (r.job_id, r.name, state, kind, when, r.output_dir)


def _live_states(refs) -> dict[str, str]:
    import shutil

    if not refs or not shutil.which("squeue"):
        return {}
    from prime_hpc import jobs
    from prime_hpc.launcher.slurm import live_states

    return live_states({r.job_id: len(jobs.job_groups(jobs.read_job(r.run))) for r in refs})


# ----------------------------------------------------------------------------- cancel / tail
def cmd_cancel(a: argparse.Namespace) -> int:
    from prime_hpc import jobs
    from prime_hpc.launcher import launch

    for ref in launch.pipeline_refs(jobs.resolve(a.job))[::-1]:
        if launch.cancel(ref):
            print(f"cancelled job {ref.job_id} ({ref.name})")
        else:
            print(f"job {ref.job_id} ({ref.name}) already ended: {launch.job_state(ref)}")
    return 0


def cmd_tail(a: argparse.Namespace) -> int:
    from prime_hpc import jobs
    from prime_hpc.tail import follow

    ref = jobs.resolve(a.job)
    return follow(ref.run, components=a.component, once=a.no_follow, lines=a.lines)


def cmd_eval(a: argparse.Namespace) -> int:
    from prime_hpc.orchestrator.evaluate import run_eval

    return run_eval(a.target, a.args)


# ----------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prime-hpc", description="SLURM-native asynchronous RL and SFT for LLMs.",
                                epilog=USAGE_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    s = sub.add_parser("submit", help="compose a run from Hydra overrides and submit it (with its warm-up, if any)")
    s.add_argument("-m", "--multirun", action="store_true", help="sweep: one job per combination of a=x,y values")
    s.add_argument("--dry-run", action="store_true",
                   help="write config.yaml, configs/ and submit/<rl|sft>.sbatch only (for a warm-up too)")
    s.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. +experiment=reverse_text max_steps=50")
    s.set_defaults(fn=cmd_submit)
    d = sub.add_parser("doctor", help="preflight the run's het layout on the cluster and print a pass/fail table")
    d.add_argument("--timeout", type=float, default=900, help="seconds to wait for the preflight job")
    d.add_argument("--require", action="append", default=[], metavar="MODULE",
                   help="also check that every node can import MODULE (repeatable)")
    d.add_argument("overrides", nargs="*")
    d.set_defaults(fn=cmd_doctor)
    st = sub.add_parser("status", help="state of each het group and the last heartbeat of each component")
    st.add_argument("job", nargs="?")
    st.set_defaults(fn=cmd_status)
    ls = sub.add_parser("list", help="recently submitted jobs")
    ls.add_argument("-n", type=int, default=20)
    ls.set_defaults(fn=cmd_list)
    c = sub.add_parser("cancel", help="cancel a job (every het group)")
    c.add_argument("job")
    c.set_defaults(fn=cmd_cancel)
    t = sub.add_parser("tail", help="follow every component's log of a job")
    t.add_argument("job")
    t.add_argument("--component", action="append", choices=("orchestrator", "inference", "trainer"))
    t.add_argument("--no-follow", action="store_true", help="print the last lines and exit")
    t.add_argument("-n", "--lines", type=int, default=10)
    t.set_defaults(fn=cmd_tail)
    r = sub.add_parser("resume", help="continue a run from a checkpoint, in its directory, as a new attempt")
    r.add_argument("job", help="job id, run name or output dir")
    r.add_argument("overrides", nargs="*", help="ckpt.step=-1 (default: the latest complete checkpoint) or N, and "
                                                "key=value changes of the recorded config, e.g. max_steps=40")
    r.set_defaults(fn=cmd_resume)
    e = sub.add_parser("eval", help="score saved weights/step_N on the run's eval envs (starts an inference server)")
    e.add_argument("target", help="job id, run name, output dir, or <run>/weights/step_N")
    e.add_argument("args", nargs="*", help="steps=N,M (default: every saved step) and overrides of the run config")
    e.set_defaults(fn=cmd_eval)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    from prime_hpc.errors import LaunchError, UserError

    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if unknown:
        if args.command in ("submit", "doctor", "resume"):  # e.g. "~key" or options after overrides
            bad = [u for u in unknown if u.startswith("-") and not u.startswith("~")]
            if bad:
                _print_err(f"unknown option {bad[0]!r} (see prime-hpc {args.command} --help)")
                return 2
            args.overrides += unknown
        else:
            _print_err(f"unexpected argument {unknown[0]!r} (see prime-hpc {args.command} --help)")
            return 2
    try:
        return args.fn(args)
    except UserError as e:
        _print_err(str(e))
        return e.exit_code
    except LaunchError as e:
        _print_err(str(e))
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `prime-hpc list | head`
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
