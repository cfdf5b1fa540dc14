"""`prime-hpc submit -m <overrides> --together`: the points of a sweep as the runs of one job.

One het job at the sweep's `output_dir` (the job's directory, named by the sweep's `name`):
its inference servers serve every run's LoRA adapter at once, its trainer trains them all
(`trainer.max_concurrent_runs`: the number of points, unless set), and its head runs one
orchestrator per run (`prime_hpc.job.runs`). Point i is the run `<name>_<i>` in
`runs/<name>_<i>/` of the job (`job_dir` set to the job's directory), with everything a run
has (config.yaml, configs/orchestrator.yaml, configs/trainer.yaml; then its rollouts,
adapter weights, checkpoints, metrics, `run.json`).

Every point is composed and validated before anything is written. The points may differ in
what is each run's own (optimizer, loss, sampling, environments, batch, async level,
steps, seed); what the job's parts share must be the same in all of them, or the submit
is refused in one line naming the point and the key.
"""

from __future__ import annotations

from typing import Any, Sequence

from omegaconf import OmegaConf

from prime_hpc.core.errors import UserError

# what one server fleet and one trainer hold for every run of the job
SHARED = (
    "model",
    "seq_len",
    "trainer.type",
    "trainer.model",
    "trainer.micro_batch_size",
    "inference",
    "weights",
    "cluster",
)


def compose_together(overrides: list[str]) -> tuple[Any, list[Any]]:
    """(the job's config, each run's config), all validated."""
    from prime_hpc.config.compose import compose
    from prime_hpc.config.overrides import override
    from prime_hpc.config.sweep import expand_sweep
    from prime_hpc.config.validate import validate

    points = expand_sweep(overrides)
    if len(points) < 2:
        raise UserError(
            "--together puts the points of a sweep in one job: give -m and a sweep (e.g. trainer.optim.lr=1e-4,3e-4)"
        )
    first = compose(points[0])
    if first.warmup.get("experiment"):
        raise UserError(
            f"--together: the experiment has a warm-up ({first.warmup.experiment}), a job of its own before each run; "
            "run it first and start the runs from its weights, or set warmup.experiment=null"
        )
    k = first.trainer.max_concurrent_runs if first.trainer.max_concurrent_runs > 1 else len(points)
    job_overrides = [*points[0], override("trainer.max_concurrent_runs", k)]
    job = compose(job_overrides)
    try:
        validate(job)
    except UserError as e:
        raise UserError(f"--together: {e}") from None
    names = [f"{job.name}_{i}" for i in range(len(points))]
    return job, compose_runs(job, points, names, overrides, "the first point's")


def compose_runs(job: Any, points: list[list[str]], names: list[str], overrides: list[str], whose: str) -> list[Any]:
    """Each point as run `names[i]` of `job` (runs/<name>/ of its directory), validated and
    checked against what the job's parts share."""
    from prime_hpc.config.compose import compose
    from prime_hpc.config.overrides import override
    from prime_hpc.config.sweep import swept
    from prime_hpc.config.validate import validate

    runs = []
    for i, (point, name) in enumerate(zip(points, names)):
        extra = [
            override("name", name),
            override("output_dir", f"{job.output_dir}/runs/{name}"),
            override("job_dir", job.output_dir),
            override("trainer.max_concurrent_runs", job.trainer.max_concurrent_runs),
        ]
        try:
            cfg = compose([*point, *extra])
            validate(cfg)
            for key in SHARED:
                if _plain(job, key) != _plain(cfg, key):
                    raise UserError(
                        f"{key} differs from {whose}: the runs of one job share its servers and its "
                        f"trainer ({', '.join(SHARED)}); run it as a job of its own"
                    )
        except UserError as e:
            raise UserError(
                f"sweep point {i} ({swept(point, overrides)}): {e}" if len(points) > 1 else str(e)
            ) from None
        runs.append(cfg)
    return runs


def compose_into(overrides: list[str], multirun: bool, ref: Any) -> list[Any]:
    """`submit [-m] ... --into <job>`: the run (or each point of the sweep) as a new run of
    the running job `ref`, which trains several (`--together`): named like a run (`name`,
    `<name>_<i>` for a sweep), refused in one line when the job is not running, trains one
    run at a time, already has a run of that name, or the run differs in what the job's
    parts share."""
    from prime_hpc.config.compose import compose, recorded_config
    from prime_hpc.config.sweep import expand_sweep
    from prime_hpc.rundir import jobs

    record = jobs.read_job(ref.run)
    if not record.get("runs"):
        raise UserError(
            f"--into {ref.name}: job {ref.job_id} trains one run; only a job submitted --together takes more"
        )
    if record.get("state") in jobs.FINAL_STATES:
        raise UserError(
            f"--into {ref.name}: job {ref.job_id} has ended ({record.get('state')}); submit the runs --together as a new job"
        )
    job = recorded_config(ref.run.config_yaml)
    points = expand_sweep(overrides) if multirun else [list(overrides)]
    base = compose(points[0]).name
    names = [f"{base}_{i}" for i in range(len(points))] if len(points) > 1 else [str(base)]
    taken = set(ref.run.sub_runs()) & set(names)
    if taken:
        raise UserError(
            f"--into {ref.name}: the job already has run(s) {', '.join(sorted(taken))}; give another name=..."
        )
    return compose_runs(job, points, names, overrides, f"job {ref.job_id}'s")


def _plain(cfg: Any, key: str) -> Any:
    value = OmegaConf.select(cfg, key)
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


RUN_COMPONENTS = ("orchestrator", "trainer")  # a run of several: its own processes' configs


def run_files(cfg: Any) -> list[str]:
    """What `write_runs` writes for the run `cfg`."""
    from prime_hpc.rundir import RunDir

    run = RunDir(cfg.output_dir)
    return [str(run.config_yaml), *(str(run.component_config(c)) for c in RUN_COMPONENTS)]


def write_runs(runs: Sequence[Any]) -> None:
    """Each run's config.yaml and component configs in `runs/<name>/` (`run_files`)."""
    from prime_hpc.config.component import write_component_config
    from prime_hpc.config.dump import to_yaml
    from prime_hpc.rundir import RunDir, atomic_write_text

    for cfg in runs:
        run = RunDir(cfg.output_dir)
        run.root.mkdir(parents=True, exist_ok=True)
        atomic_write_text(run.config_yaml, to_yaml(cfg))
        for component in RUN_COMPONENTS:
            write_component_config(cfg, component)
