"""Submit a run (or its preflight): validate, write the run directory's launch files,
render, hand to the backend, record the job. Shared by both backends."""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from omegaconf import DictConfig

from prime_hpc.config.cluster import cache_root
from prime_hpc.config.component import write_component_config
from prime_hpc.config.dump import to_yaml
from prime_hpc.config.pipeline import model_overrides, warmup_overrides
from prime_hpc.config.validate import minutes, validate
from prime_hpc.core.errors import ConfigError, LaunchError
from prime_hpc.core.jobenv import API_KEY_VAR, job_api_key
from prime_hpc.job.head import HeadTask
from prime_hpc.launcher.plan import After, Plan, make_plan
from prime_hpc.launcher.render import render_local, render_sbatch

# re-exported: what a job is doing, light for the read-only commands
from prime_hpc.launcher.state import cancel, group_states, job_state, pipeline_refs  # noqa: F401
from prime_hpc.rundir import CHECKPOINT_PARTS, RunDir, atomic_write_text, jobs, with_umask
from prime_hpc.sched.base import JobSpec
from prime_hpc.sched.registry import choose


@dataclass
class Submitted:
    ref: jobs.JobRef
    plan: Plan
    resume_step: Optional[int] = None  # resume: the checkpoint step it continues from


def active_job(run: RunDir) -> Optional[str]:
    """The id of a job of this run directory that is still alive (queued, running, or
    still stopping after a cancel), asked of its backend."""
    job = jobs.read_job(run)
    ids = [str(i) for i in job.get("job_ids", [])]
    if not ids:
        return None
    return ids[-1] if choose(job.get("backend")).alive(run, ids[-1]) else None


def check_fresh(cfg: DictConfig, resume: bool = False, dry_run: bool = False) -> None:
    """A fresh run needs an empty output_dir (or clean_output_dir=true, or a resume).
    Only a run directory is ever wiped, and never while one of its jobs is alive."""
    run = RunDir(cfg.output_dir)
    check_owner(run)
    if resume or run.is_fresh():
        return
    if dry_run:
        raise ConfigError(
            "output_dir", f"{run.root} holds a run; a dry run never overwrites one; choose another output_dir"
        )
    if cfg.clean_output_dir:
        if not (run.job_json.exists() or run.config_yaml.exists()):
            raise ConfigError(
                "clean_output_dir",
                f"{run.root} is not a prime-hpc run directory (no job.json or "
                "config.yaml); refusing to wipe it; choose another output_dir",
            )
        job_id = active_job(run)
        if job_id:
            raise ConfigError(
                "clean_output_dir",
                f"{run.root} belongs to job {job_id}, which is still alive; "
                f"cancel it (prime-hpc cancel {job_id}) and let it stop first",
            )
        return
    job = jobs.read_job(run)
    owner = f" (run {job.get('name')!r}, job {', '.join(map(str, job.get('job_ids', [])))})" if job else ""
    raise ConfigError(
        "output_dir",
        f"{run.root} is not empty{owner}; set clean_output_dir=true to wipe it or choose another output_dir",
    )


def check_owner(run: RunDir) -> None:
    """A run directory (or the first existing directory above it) must be this user's."""
    path = run.root
    while not path.exists() and path != path.parent:
        path = path.parent
    uid = path.stat().st_uid
    if uid != os.getuid():
        try:
            import pwd

            who = pwd.getpwuid(uid).pw_name
        except (ImportError, KeyError):
            who = f"uid {uid}"
        raise ConfigError("output_dir", f"{path} belongs to {who}, not to you; choose an output_dir of your own")


def keep_job_key(run: RunDir) -> str:
    """The key every server of the job demands (`$INFERENCE_SERVER_API_KEY`): the user's,
    else the one kept for the run by an earlier submit (a resume), else one made at random
    for this job; kept for its owner in `private/api_key` (0600, in a 0700 directory:
    `prime_hpc.core.keyfile`), which `scale`, `eval serve=` and `synthesize serve=` read.
    No other file of the run holds it. `KeyFileError` (one line) when the kept one is not
    the user's alone."""
    from prime_hpc.core import keyfile

    check_chosen_key()
    key = os.environ.get(API_KEY_VAR) or keyfile.read(run.private_dir)
    if not key:
        import secrets

        key = secrets.token_urlsafe(32)
    keyfile.write(run.private_dir, key)
    return key


def check_chosen_key() -> None:
    """A key the user exported for the job (`$INFERENCE_SERVER_API_KEY`) is at least
    `keyfile.MIN_BYTES` bytes long: anyone who can reach a server may guess a short one."""
    from prime_hpc.core import keyfile

    key = os.environ.get(API_KEY_VAR)
    if key and keyfile.too_short(key):
        raise ConfigError(
            API_KEY_VAR,
            f"the exported key is {len(key.encode())} bytes, shorter than {keyfile.MIN_BYTES}: export a longer one "
            "(python -c 'import secrets; print(secrets.token_urlsafe(32))') or unset it and the job makes its own",
        )


def config_components(plan: Plan) -> list[str]:
    """The components that get configs/<component>.yaml: those the job runs (an SFT
    preflight's head is no orchestrator), and the servers of its own inference job."""
    names = [c for c in plan.group_names if c != "orchestrator" or plan.kind in ("rl", "eval", "serve", "synthesize")]
    return [*names, "inference"] if plan.fleet_nodes else names  # the servers' own job and the router read it


def launch_files(run: RunDir, plan: Plan) -> list[Path]:
    """What `write_launch_files` writes, in that order."""
    return [run.config_yaml, *(run.component_config(c) for c in config_components(plan)), run.sbatch_script(plan.kind)]


def write_launch_files(cfg: DictConfig, run: RunDir, plan: Plan, runs: Sequence[DictConfig] = ()) -> None:
    """config.yaml, configs/<component>.yaml (the components the job runs) and
    submit/<kind>.sbatch; `runs`: a job of several runs, each one's files in runs/<name>/
    (`prime_hpc.launcher.together`)."""
    atomic_write_text(run.config_yaml, to_yaml(cfg))
    for component in config_components(plan):
        write_component_config(cfg, component)
    if runs:
        from prime_hpc.launcher.together import write_runs

        write_runs(runs)
    atomic_write_text(run.sbatch_script(plan.kind), render_sbatch(plan))


def prepare(
    cfg: DictConfig,
    mode: str = "run",
    resume: bool = False,
    extra_env: Optional[dict[str, str]] = None,
    dry_run: bool = False,
    after: Sequence[After] = (),
    validated: bool = False,
    runs: Sequence[DictConfig] = (),
) -> tuple[RunDir, Plan]:
    """Validate (unless the caller just did) and write everything a launch needs; returns
    the run dir used by the job (the run's own, or `<output_dir>/doctor/` for a preflight)."""
    if not validated:
        validate(cfg)
    check_chosen_key()
    run = RunDir(cfg.output_dir)
    with with_umask(cfg.cluster.umask):  # as submit: a dry run's files are the run's
        if mode == "run":
            check_fresh(cfg, resume, dry_run)
            if cfg.orchestrator.teacher.get("serve"):  # the serve job validated now, named by its directory
                from prime_hpc.rundir.jobs import serve_job

                cfg = cfg.copy()
                cfg.orchestrator.teacher.serve = str(serve_job(str(cfg.orchestrator.teacher.serve)).root)
            if cfg.clean_output_dir and not resume and not dry_run:
                run.wipe()
        else:
            run = run.doctor_run
            reset_doctor_dir(run)
            cfg = cfg.copy()
            cfg.cluster.cache_dir = cache_root(cfg)  # the run's, not one next to doctor/
            cfg.output_dir = str(run.root)
        plan = make_plan(cfg, mode)
        plan.after = list(after)
        plan.env.update(extra_env or {})
        write_launch_files(cfg, run, plan, runs)
    return run, plan


def reset_doctor_dir(run: RunDir) -> None:
    """Make a preflight's directory (`<output_dir>/doctor/`) empty and mark it as doctor's.
    What an earlier `doctor` wrote there (a directory holding this user's marker) is
    removed; a directory holding anything else, or that is not a plain directory, is
    refused and nothing is deleted."""
    import stat

    root = run.root
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        st = None
    if st is not None:
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            raise ConfigError(
                "output_dir",
                f"{root} is not a directory prime-hpc doctor made (a symlink, a file or "
                "someone else's); move it away or choose another output_dir",
            )
        try:
            mark = os.lstat(run.doctor_marker)
            ours = stat.S_ISREG(mark.st_mode) and mark.st_uid == os.getuid()
        except FileNotFoundError:
            ours = False
        if not ours and any(os.scandir(root)):
            raise ConfigError(
                "output_dir",
                f"{root} holds files prime-hpc doctor did not write; move them away or choose another output_dir",
            )
        run.wipe()
    atomic_write_text(run.doctor_marker, "written by prime-hpc doctor: this directory is emptied at each doctor run\n")


def expected_reports(plan: Plan) -> dict[str, int]:
    """The preflight reports the head waits for, per group."""
    out: dict[str, int] = {}
    inf, tr, tea = plan.group("inference"), plan.group("trainer"), plan.group("teacher")
    if inf is not None:
        out.update(inference=inf.nodes, router=1)
    if tr is not None:
        out["trainer"] = tr.nodes * plan.trainer.nproc_per_node
    if tea is not None:  # its router runs the router's probe's code on the same head node
        out["teacher"] = tea.nodes
    return out


def submit(
    cfg: DictConfig,
    overrides: Sequence[str],
    mode: str = "run",
    resume: bool = False,
    extra_env: Optional[dict[str, str]] = None,
    after: Sequence[After] = (),
    pipeline: Optional[dict] = None,
    sweep: Optional[dict] = None,
    runs: Sequence[DictConfig] = (),
) -> Submitted:
    """Submit one job. `after`: jobs it starts after (a pipeline's warm-up, an earlier
    point of a sweep); `pipeline`, `sweep`: recorded in job.json to tie the jobs together;
    `runs`: the runs of a job that trains several (`--together`)."""
    with with_umask(cfg.cluster.umask):  # the run dir, and sbatch's output files
        return _submit(cfg, overrides, mode, resume, extra_env, after, pipeline, sweep, runs)


def _submit(
    cfg: DictConfig,
    overrides: Sequence[str],
    mode: str,
    resume: bool,
    extra_env: Optional[dict[str, str]],
    after: Sequence[After],
    pipeline: Optional[dict],
    sweep: Optional[dict],
    runs: Sequence[DictConfig] = (),
) -> Submitted:
    run, plan = prepare(cfg, mode, resume, extra_env, after=after, runs=runs)
    key = keep_job_key(run)
    task = HeadTask(mode, str(run.root), expected_reports(plan) if mode == "doctor" else {})
    prior = jobs.read_job(run) if resume else {}
    now = time.time()
    # job.json before the job exists: the job itself only ever moves the state forward
    jobs.update_job(
        run,
        name=plan.name,
        mode=mode,
        kind=plan.kind,
        groups=plan.group_names,
        pipeline=pipeline if pipeline is not None else prior.get("pipeline"),
        sweep=sweep if sweep is not None else prior.get("sweep"),
        backend=plan.backend,
        output_dir=str(run.root),
        overrides=[*prior.get("overrides", []), list(overrides)],
        git_sha=jobs.git_sha(Path(__file__).resolve().parent),
        cluster={k: cfg.cluster[k] for k in ("backend", "device", "partition", "account", "qos")},
        **({"fleet_nodes": plan.fleet_nodes} if plan.fleet_nodes else {}),  # inference_job=own: its servers' job
        **({"runs": [Path(str(r.output_dir)).name for r in runs]} if runs else {}),  # --together: runs/<name>/
        submitted_at=now,
        state=jobs.PENDING,
    )
    with job_api_key(key):  # the run's job and its servers' own job (inference_job=own) demand the same key
        try:
            job_id, record = choose(plan.backend).submit(job_spec(run, plan, task))
        except BaseException:
            # nothing was submitted: leave the directory as fresh as it was
            if prior:
                jobs.update_job(run, **{k: prior.get(k) for k in ("state", "overrides", "submitted_at")})
            else:
                run.job_json.unlink(missing_ok=True)
            raise
        jobs.update_job(run, job_ids=[*prior.get("job_ids", []), job_id], **record)
        ref = jobs.JobRef(
            job_id=job_id,
            name=plan.name,
            output_dir=str(run.root),
            backend=plan.backend,
            submitted_at=now,
            mode=mode,
            kind=plan.kind,
            sweep=(sweep or prior.get("sweep") or {}).get("id"),
        )
        jobs.record(ref)
        if plan.fleet_nodes:
            submit_fleet(ref, plan, after)
    return Submitted(ref=ref, plan=plan)


def submit_fleet(ref: jobs.JobRef, plan: Plan, after: Sequence[After]) -> None:
    """The jobs of the run's inference servers (`cluster.inference_job=own`), one node each,
    right after the run's own (and after what it waits for), with the same key (in this
    environment: see `job_api_key`). When one cannot be submitted, the run's job and those
    submitted are cancelled."""
    from prime_hpc.launcher import scale

    done: list[dict] = []
    try:
        for _ in range(plan.fleet_nodes):
            done.append(scale.scale_up(ref, 1, fleet=True, after=after))
    except BaseException:
        for x in done:
            choose(plan.backend).cancel(ref.run, str(x["job_id"]))
        choose(plan.backend).cancel(ref.run, ref.job_id)
        raise


def job_spec(run: RunDir, plan: Plan, task: HeadTask) -> JobSpec:
    """What a backend needs to start the job: `submit/<kind>.sbatch` (written by
    `prepare`), and the same job as a script of this machine, whose head runs the task
    as `python -m prime_hpc.job.head` instead of under submitit."""
    local = dataclasses.replace(plan, head_argv=task.argv(plan.python))
    return JobSpec(
        run=run,
        kind=plan.kind,
        task=task,
        time_min=minutes(plan.time) or 60 * 24 * 365,
        shell_script=lambda job_id: render_local(local, job_id),
    )


def submit_stages(
    stages: Sequence[DictConfig], overrides: Sequence[str], after: Sequence[After] = (), sweep: Optional[dict] = None
) -> list[Submitted]:
    """Submit a run, or a pipeline [warm-up, run]: the run starts only once the warm-up
    completed (SLURM afterok; locally it waits), and both job.json record the pipeline.
    `after`: what the first job waits for; `sweep`: the sweep this point belongs to."""
    if len(stages) == 1:
        return [submit(stages[0], overrides, after=after, sweep=sweep)]
    warm_cfg, cfg = stages
    run = RunDir(cfg.output_dir)
    if cfg.clean_output_dir:  # wiped before anything of the pipeline is written (check_fresh allowed it)
        run.wipe()
        cfg = cfg.copy()
        cfg.clean_output_dir = False
    warm = submit(
        warm_cfg, warmup_overrides(cfg, model_overrides(overrides)), after=after, pipeline={"run": str(run.root)}
    )
    try:
        main = submit(
            cfg,
            overrides,
            after=[After(job_id=warm.ref.job_id, output_dir=warm.ref.output_dir)],
            sweep=sweep,
            pipeline={"warmup": {"job_id": warm.ref.job_id, "name": warm.ref.name, "output_dir": warm.ref.output_dir}},
        )
    except BaseException:
        cancel(warm.ref)
        raise
    jobs.update_job(warm.ref.run, pipeline={"run": main.ref.output_dir, "run_job_id": main.ref.job_id})
    return [warm, main]


def resume(ref: jobs.JobRef, overrides: Sequence[str]) -> Submitted:
    """Submit the run of `ref` again, into its own directory, as a new attempt: its
    recorded config plus `overrides` (`ckpt.step` defaults to -1, the latest complete
    checkpoint). Refuses while a job of the run is alive or when the step is not a
    complete checkpoint (naming the complete ones)."""
    from prime_hpc.config.compose import recorded_config

    run = ref.run
    kind = jobs.read_job(run).get("kind", ref.kind)
    if kind not in ("rl", "sft"):
        raise ConfigError(
            "resume",
            f"{ref.name} (job {ref.job_id}) is {'an' if kind[:1] in 'aeiou' else 'a'} {kind} job, which keeps "
            "no checkpoint to resume from; "
            f"run prime-hpc {kind} again",
        )
    live = active_job(run)
    if live:
        raise ConfigError(
            "resume",
            f"job {live} of {run.root} is still alive; let it end or cancel it first (prime-hpc cancel {live})",
        )
    if jobs.read_job(run).get("runs"):  # a job of several runs: each resumes from its own checkpoint
        from prime_hpc.launcher.together import write_runs
        from prime_hpc.rundir import runs as run_records

        for name in jobs.read_job(run).get("runs") or []:
            sub_run = run.sub_run(name)
            if not run_records.is_over(sub_run):  # stopped midway: on from its latest checkpoint, if any
                cfg = recorded_config(sub_run.config_yaml)
                latest = sub_run.latest_checkpoint_step()
                cfg.ckpt.step = -1 if latest else None
                sub_run.clear_after(latest or 0)
                write_runs([cfg])
        sub = submit(recorded_config(run.config_yaml, overrides), overrides, resume=True)
        sub.resume_step = None
        return sub
    cfg, step = resume_config(run, overrides, "the run")
    sub = submit(cfg, overrides, resume=True)
    sub.resume_step = step
    return sub


def resume_config(run: RunDir, overrides: Sequence[str], who: str) -> tuple[DictConfig, Optional[int]]:
    """The recorded config of `run` plus `overrides` (`ckpt.step` -1 unless given) and the
    checkpoint step it resumes from; refused in one line when that step is not complete or
    already reached `max_steps`."""
    from prime_hpc.config.compose import recorded_config
    from prime_hpc.rundir.checkpoints import resolve_resume_step

    cfg = recorded_config(run.config_yaml, overrides)
    if cfg.ckpt.step is None or not any(o.split("=", 1)[0].lstrip("+") == "ckpt.step" for o in overrides):
        cfg.ckpt.step = -1
    parts = ("trainer",) if cfg.trainer.type == "sft" else CHECKPOINT_PARTS
    step = resolve_resume_step(run, int(cfg.ckpt.step), parts)
    if step is not None and cfg.max_steps is not None and step >= cfg.max_steps:
        raise ConfigError(
            "max_steps",
            f"{who} already reached step {step} (max_steps={cfg.max_steps}); "
            f"raise it to continue, e.g. max_steps={step + (cfg.max_steps or 10)}",
        )
    return cfg, step


def resume_run(ref: jobs.JobRef, name: str, overrides: Sequence[str]) -> tuple[Optional[int], Optional[Submitted]]:
    """Run `name` of a job that trains several again from its own checkpoint (`ckpt.step`
    defaults to -1), its recorded config plus `overrides`: (the step it resumes from, the
    job submitted again, or None when the job is still running: its head and trainer take
    the run up again). Refused in one line for an unknown run, a step that is not a complete
    checkpoint of it, or a max_steps it already reached."""
    from prime_hpc.launcher.together import write_runs

    known = jobs.read_job(ref.run).get("runs") or []
    if name not in known:
        raise ConfigError(
            "resume",
            f"--run {name}: job {ref.job_id} ({ref.name}) has "
            + (f"the runs {', '.join(known)}" if known else "no runs of its own (it was not submitted --together)"),
        )
    run = ref.run.sub_run(name)
    cfg, step = resume_config(run, overrides, f"run {name}")
    validate(cfg)
    live = active_job(ref.run)
    from prime_hpc.rundir import runs as run_records

    if live and not run_records.is_over(run):
        raise ConfigError("resume", f"--run {name}: it is still running in job {live}; let it end first")
    run.clear_after(step or 0)  # nothing of a later step (rollouts/DONE included) is taken for new
    write_runs([cfg])  # a new trainer config: the run is to run again
    if live:
        return step, None
    return step, resume(ref, [])


def wait_done(sub: Submitted, timeout_s: float, poll_s: float = 2.0) -> str:
    """Block until the job is finished; returns its final state."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = job_state(sub.ref)
        if st in jobs.FINAL_STATES:
            return st
        time.sleep(poll_s)
    raise LaunchError(
        f"job {sub.ref.job_id} still {job_state(sub.ref)} after {timeout_s:g}s; see {sub.ref.run.latest_logs}"
    )
