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
    from prime_hpc.launcher.sweep import swept

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
    runs = []
    for i, point in enumerate(points):
        name = f"{job.name}_{i}"
        extra = [
            override("name", name),
            override("output_dir", f"{job.output_dir}/runs/{name}"),
            override("job_dir", job.output_dir),
            override("trainer.max_concurrent_runs", k),
        ]
        try:
            cfg = compose([*point, *extra])
            validate(cfg)
            for key in SHARED:
                mine, theirs = _plain(job, key), _plain(cfg, key)
                if mine != theirs:
                    raise UserError(
                        f"{key} differs from the first point's: the runs of one job share its servers and its "
                        f"trainer ({', '.join(SHARED)}); sweep those as separate jobs (without --together)"
                    )
        except UserError as e:
            raise UserError(f"sweep point {i} ({swept(point, overrides)}): {e}") from None
        runs.append(cfg)
    return job, runs


def _plain(cfg: Any, key: str) -> Any:
    value = OmegaConf.select(cfg, key)
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def write_runs(runs: Sequence[Any]) -> list[str]:
    """Each run's config.yaml and component configs in `runs/<name>/`; the paths written."""
    from prime_hpc.config.component import write_component_config
    from prime_hpc.config.dump import to_yaml
    from prime_hpc.rundir import RunDir, atomic_write_text

    written = []
    for cfg in runs:
        run = RunDir(cfg.output_dir)
        run.root.mkdir(parents=True, exist_ok=True)
        atomic_write_text(run.config_yaml, to_yaml(cfg))
        written.append(str(run.config_yaml))
        for component in ("orchestrator", "trainer"):
            written.append(str(write_component_config(cfg, component)))
    return written
