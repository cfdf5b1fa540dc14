"""Extra inference jobs of a running run (`prime-hpc scale JOB inference=+N|-N`).

`+N` submits one plain job of N nodes, one inference server on each, with the run's
`configs/inference.yaml` (`sbatch_templates/inference.sbatch.j2`, `submit/inference_<k>.sbatch`),
where the scale's cluster overrides say (partition, time, qos, GPUs ...); its servers join
the run through `endpoints/` and leave when the job ends. `-N` cancels the run's live extra
jobs, newest first, that make exactly N nodes. Each extra job is recorded in the run's
job.json (`extra_jobs`, see `prime_hpc.rundir.jobs`); its logs go to `logs/extra/<id>/`.

The light part (what `status`, `list`, `tail` and `cancel` need: which extra jobs are
alive, cancelling them) is `prime_hpc.launcher.state`'s; submitting one composes the
recorded config.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

from prime_hpc.core.errors import UserError
from prime_hpc.core.jobenv import API_KEY_VAR
from prime_hpc.launcher.state import cancel_extra, live_extras
from prime_hpc.rundir import RunDir, jobs
from prime_hpc.sched.registry import choose

# `scale` overrides: short names for the keys an extra job most often changes
ALIASES = {
    "partition": "cluster.partition",
    "time": "cluster.time",
    "qos": "cluster.qos",
    "account": "cluster.account",
    "constraint": "cluster.constraint",
    "exclude": "cluster.exclude",
    "signal_delay_s": "cluster.signal_delay_s",
    "gpus": "cluster.inference.gpus_per_node",
    "cpus": "cluster.inference.cpus_per_task",
    "mem_gb": "cluster.inference.mem_gb",
}
# what an extra job may change: where and how long it runs, never what its servers serve
CHANGEABLE = (
    "cluster.partition",
    "cluster.time",
    "cluster.qos",
    "cluster.account",
    "cluster.constraint",
    "cluster.exclude",
    "cluster.signal_delay_s",
    "cluster.sbatch_extra",
    "cluster.env_setup",
    "cluster.inference.",
)


class ScaleError(UserError):
    """A scale that cannot be done as asked; one line, prefixed `scale: `."""

    def __init__(self, message: str) -> None:
        super().__init__(f"scale: {message}")


# ----------------------------------------------------------------------------- what was asked
def parse_delta(word: str) -> int:
    """`inference=+N` -> N, `inference=-N` -> -N (N >= 1)."""
    key, eq, value = word.partition("=")
    sign, digits = value[:1], value[1:]
    if key != "inference" or not eq or sign not in "+-" or not sign or not digits.isdigit() or int(digits) < 1:
        raise ScaleError(f"{word!r}: say how many inference nodes to add or remove, e.g. inference=+2 or inference=-1")
    return int(digits) * (1 if sign == "+" else -1)


def cluster_overrides(words: Sequence[str]) -> list[str]:
    """The scale's overrides as keys of the run's config (`partition=x` ->
    `cluster.partition=x`); anything but where the extra job runs is refused."""
    out = []
    for word in words:
        key, eq, value = word.partition("=")
        if not eq:
            raise ScaleError(f"{word!r} is not key=value (e.g. partition=scavenger time=01:00:00 gpus=4)")
        key = ALIASES.get(key, key)
        if key == "cluster.inference.nodes":
            raise ScaleError(f"{word}: the extra job's nodes are the N of inference=+N")
        if not any(key == c or (c.endswith(".") and key.startswith(c)) for c in CHANGEABLE):
            raise ScaleError(
                f"{word.partition('=')[0]} cannot change for an extra inference job: its servers run the run's "
                f"configs/inference.yaml; change where it runs: {', '.join(ALIASES)} or "
                f"{', '.join(c + ('<key>' if c.endswith('.') else '') for c in CHANGEABLE)}"
            )
        out.append(f"{key}={value}")
    return out


def to_cancel(extras: list[dict[str, Any]], nodes: int) -> list[dict[str, Any]]:
    """Of the live extra jobs (oldest first), the newest ones that make exactly `nodes`
    nodes, newest first; a ScaleError listing them when no such run of whole jobs exists."""
    if not extras:
        raise ScaleError(f"inference=-{nodes}: the run has no live extra inference job")
    picked, total = [], 0
    for x in reversed(extras):
        if total >= nodes:
            break
        picked.append(x)
        total += int(x["nodes"])
    if total == nodes:
        return picked
    sums: list[int] = []
    for x in reversed(extras):
        sums.append((sums[-1] if sums else 0) + int(x["nodes"]))
    listed = ", ".join(f"job {x['job_id']} ({x['nodes']} node(s))" for x in reversed(extras))
    raise ScaleError(
        f"inference=-{nodes} does not match whole extra jobs taken newest first: {listed}; "
        f"remove one of: {', '.join(f'inference=-{n}' for n in sums)}"
    )


# ----------------------------------------------------------------------------- scale
def check_run(ref: jobs.JobRef) -> dict[str, Any]:
    """The run's job.json, when it can take (or lose) extra inference jobs: an RL run whose
    job is queued or running, on a backend that has extra jobs; else a ScaleError."""
    from prime_hpc.launcher.state import job_state

    job = check_kind(ref)
    state = job_state(ref)
    if state in jobs.FINAL_STATES or state == "UNKNOWN":
        raise ScaleError(
            f"{ref.name} (job {ref.job_id}) is not running ({state}); extra inference joins a running run "
            f"(continue it first: prime-hpc resume {ref.job_id} --scale inference=+N)"
        )
    return job


def check_kind(ref: jobs.JobRef) -> dict[str, Any]:
    """The run's job.json, when it is a run that can have extra inference jobs at all (an RL
    run, on a backend that has them); else a ScaleError."""
    job = jobs.read_job(ref.run)
    if not job:
        raise ScaleError(f"{ref.run.root} holds no run (no job.json)")
    has_servers = "inference" in jobs.job_groups(job) or job.get("fleet_nodes")
    if ref.mode != "run" or job.get("kind") != "rl" or not has_servers:
        kind = job.get("kind", "?")
        what = (
            "a preflight"
            if ref.mode != "run"
            else f"{'an' if kind[:1] in 'aeiou' else 'a'} {kind} job"
            if kind not in ("rl", "sft")
            else f"an {kind.upper()} run without inference"
        )
        raise ScaleError(f"{ref.name} (job {ref.job_id}) is {what}; only an RL run has inference servers to scale")
    backend = choose(job.get("backend"))
    if not backend.extra_jobs:
        raise ScaleError(
            f"{ref.name} runs on cluster.backend={backend.name}, which takes no extra inference jobs "
            "(they need a scheduler to give them nodes); use cluster=slurm (or cluster=dev)"
        )
    return job


def check_key(run: RunDir) -> str:
    """The run's own key, which its extra servers must demand (the router signs for them,
    the relay proves them with it): the one its submit kept for the user
    (`private/api_key`, read only when it is the user's alone: `prime_hpc.core.keyfile`),
    else, for a run submitted before keys were kept, `$INFERENCE_SERVER_API_KEY`; where the
    run's router answers, the one it proves to hold (`inference.client.RouterLink`: the
    router is asked signed, never sent the key; a listener at its address that does not
    prove it, a wrong key or a router.json left by a router that is gone, is one line)."""
    import os

    from prime_hpc.core import keyfile

    key = keyfile.read(run.private_dir) or os.environ.get(API_KEY_VAR)
    if not key:
        raise ScaleError(
            f"{run.key_file} does not exist and {API_KEY_VAR} is not set: export the key the run was submitted "
            "with; its extra servers must demand the same key"
        )
    import httpx

    from prime_hpc.inference.client import NotProven, RouterLink

    link = RouterLink(run.router_endpoint, key)
    try:
        router = str(link.read()["url"])
    except NotProven:
        return key  # not started yet: the servers would find out
    try:
        with httpx.Client(timeout=5, auth=link.auth()) as client:
            answer = client.get(router + "/workers").status_code
    except NotProven as e:
        raise ScaleError(
            f"{e}; if the run's router runs, the key is not the run's: export the key the run was submitted with"
        ) from None
    except httpx.HTTPError:
        return key  # not reachable from here: the servers would find out
    if answer == 401:
        raise ScaleError(f"the run's router refuses this {API_KEY_VAR}: export the key the run was submitted with")
    return key


def scale_up(
    ref: jobs.JobRef, nodes: int, overrides: Sequence[str] = (), fleet: bool = False, after: Sequence[Any] = ()
) -> dict[str, Any]:
    """Submit one extra inference job of `nodes` nodes for the run; its record. `fleet`: the
    run's own servers (`cluster.inference_job=own`), submitted with the run's job (and after
    what it waits for, `after`), or again for a new attempt."""
    settings = cluster_overrides(overrides)
    job = check_run(ref)
    key = check_key(ref.run)
    from prime_hpc.config.compose import recorded_config
    from prime_hpc.config.validate import (
        check_cache_dir,
        check_fields,
        check_gpu_ids,
        check_gpus,
        check_memory,
        check_slurm,
        validate,
    )
    from prime_hpc.core.jobenv import job_api_key
    from prime_hpc.launcher.plan import inference_job_plan
    from prime_hpc.launcher.render import render_inference
    from prime_hpc.rundir import atomic_write_text, with_umask

    cfg = recorded_config(ref.run.config_yaml, settings)
    validate(cfg, (check_fields, check_gpu_ids, check_gpus, check_slurm, check_memory, check_cache_dir))
    run = ref.run
    backend = choose(job["backend"])
    with with_umask(cfg.cluster.umask):
        plan = inference_job_plan(cfg, nodes, after=after, fleet=fleet)
        index = len(jobs.extra_jobs(job))
        script = run.extra_script(index)
        atomic_write_text(script, render_inference(plan))
        run.extra_logs_root.mkdir(parents=True, exist_ok=True)
        with job_api_key(key):  # its servers get the run's key through their job's environment only
            job_id = backend.submit_script(script)
    record = {
        "job_id": job_id,
        "nodes": nodes,
        "backend": backend.name,
        "submitted_at": time.time(),
        "state": jobs.PENDING,
        "started_at": None,
        "ended_at": None,
        "script": str(script),
        "logs": str(run.extra_job_logs(job_id)),
        "batch_log": str(run.extra_batch_log(job_id)),
        "overrides": list(overrides),
        "partition": cfg.cluster.partition,
        "time": cfg.cluster.time,
        **({"fleet": True} if fleet else {}),
    }
    try:
        jobs.add_extra_job(run, record)
    except BaseException:  # unrecorded, it would start nothing (its start refuses): cancel it
        backend.cancel(run, job_id)
        raise
    return record


def live_fleet(run: RunDir, job: Optional[dict[str, Any]] = None) -> list[dict[str, Any]]:
    """The run's own inference jobs (`cluster.inference_job=own`) that are queued or running."""
    return [x for x in live_extras(run, job) if x.get("fleet")]


def ensure_fleet(ref: jobs.JobRef) -> list[dict[str, Any]]:
    """A new attempt of a run whose servers run in jobs of their own, one node each: submit
    as many again as are no longer queued or running (ended with the attempt before, at
    their time limit, by a preemption, or with their node); their records."""
    job = jobs.read_job(ref.run)
    nodes = int(job.get("fleet_nodes") or 0)
    missing = nodes - sum(int(x["nodes"]) for x in live_fleet(ref.run, job)) if nodes else 0
    return [scale_up(ref, 1, fleet=True) for _ in range(max(missing, 0))]


def scale_down(ref: jobs.JobRef, nodes: int) -> list[dict[str, Any]]:
    """Cancel the newest live extra jobs that make exactly `nodes` nodes; their records."""
    job = check_run(ref)
    picked = to_cancel(live_extras(ref.run, job), nodes)
    for x in picked:
        cancel_extra(ref.run, job["backend"], x)
    return picked


def scale(ref: jobs.JobRef, delta: int, overrides: Sequence[str] = ()) -> list[dict[str, Any]]:
    """`inference=+N` (one new job) or `inference=-N` (the jobs cancelled)."""
    if delta < 0 and overrides:
        raise ScaleError(f"inference={delta} takes no overrides (it only cancels extra jobs): {' '.join(overrides)}")
    if delta > 0:
        return [scale_up(ref, delta, overrides)]
    return scale_down(ref, -delta)
