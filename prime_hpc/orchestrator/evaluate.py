"""Scoring policies on the eval environments, where `prime-hpc eval` runs it
(`prime_hpc.launcher.evaluate` says what it is given and where it runs): one inference
server on this machine (`eval_server`: its files under the directory given; the key it
demands made for it and given to it only through its environment), each step loaded into
every server (`/update_weights`; the base model by `/reload_weights`) and scored
(`score_step`: `step_<N>.json` with `eval/<env>/avg@k`, `eval/<env>/pass@k`, and every
rollout in `step_<N>.samples.jsonl`), and the head of an eval job (`run_job`: in the
orchestrator's place, beside the job's servers).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Optional

from prime_hpc.core import jobenv
from prime_hpc.core.errors import UserError
from prime_hpc.rundir import RunDir, atomic_write_json, logtree


@contextlib.contextmanager
def eval_server(cfg: Any, edir: RunDir, cache: str) -> Iterator[tuple[str, str]]:
    """One inference server for `cfg.model.name` on this machine, its files under `edir`
    (configs, endpoints, logs); yields its URL and the key it demands (made for this
    server, given to it only through its environment), then stops it (and its process
    group). The config the server reads is the copy written here, in `edir` (for a run
    of someone else's, a directory of the user's alone), never a file of the run's; and
    the umask in force must keep others from writing it (the server refuses a config
    others can write: refused here first, in one line)."""
    import secrets

    from prime_hpc.config.component import write_component_config
    from prime_hpc.core import umask
    from prime_hpc.core.errors import ConfigError
    from prime_hpc.core.jobenv import CACHE_VAR
    from prime_hpc.core.net import address_env
    from prime_hpc.inference.client import wait_for_servers

    why = umask.others_write(f"{umask.current():03o}")
    if why:
        raise ConfigError("cluster.umask", why)
    key = secrets.token_urlsafe(32)
    cfg.output_dir = str(edir.root)
    cfg.cluster.inference.nodes = 1
    inference_yaml = write_component_config(cfg, "inference")
    log = logtree.node_log(edir.logs_root, "inference", 0)
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.unlink(edir.inference_endpoint(0))
    except OSError:
        pass
    with open(log, "ab") as f:
        server = subprocess.Popen(
            [sys.executable, "-u", "-m", "prime_hpc.inference", "--config", str(inference_yaml)],
            stdout=f,
            stderr=subprocess.STDOUT,
            env={
                **os.environ,
                jobenv.LOGS_VAR: str(edir.logs_root),
                jobenv.NODE_RANK_VAR: "0",
                CACHE_VAR: cache,
                jobenv.API_KEY_VAR: key,
                **address_env(cfg.cluster.address),
            },
            start_new_session=True,
        )
    try:
        print(f"prime-hpc eval: starting an inference server for {cfg.model.name} (log: {log})", flush=True)
        yield (
            wait_for_servers(
                edir,
                1,
                float(cfg.inference.startup_timeout_s),
                logs=edir.logs_root,
                alive=lambda: server.poll() is None,
            )[0]["url"],
            key,
        )
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        try:
            os.killpg(server.pid, 9)
        except (ProcessLookupError, PermissionError):
            pass


def endpoint_url(given: str) -> str:
    """The OpenAI base URL of an endpoint `eval`/`synthesize` were given: a serve job's
    router (`launcher.evaluate.serving_endpoint`: a `RouterURL`, proven against its
    router.json) as it is, keeping the link the client made with it signs with and sends
    no key; any other (`client.base_url=`, the user's) with `/v1` added when it lacks it."""
    from prime_hpc.inference.client import RouterURL

    if isinstance(given, RouterURL):
        return given
    base = given.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


def eval_steps(run: RunDir, asked: Optional[list[int]], one_step: Optional[int], base: bool) -> list[int]:
    """The steps to score, ascending: those asked (`steps=`; 0 is the base model), else the
    one a weights dir names, else every saved one; the base model first unless `base` is
    off or steps were asked. A step without complete weights fails in one line."""
    available = run.weight_steps()
    if asked is not None:
        steps = asked
    elif one_step is not None:
        steps = [one_step]
    else:
        steps = ([0] if base else []) + available
    missing = [s for s in steps if s != 0 and s not in available]
    if missing or not steps:
        raise UserError(
            f"no complete weights for step(s) {missing or steps} in {run.weights_dir}; available: "
            f"{available or 'none'} (and 0, the base model)"
        )
    return sorted(set(steps))


def score_steps(run: RunDir, cfg: Any, steps: list[int], url: str, key: str, results: Path) -> None:
    """Load each step's weights into the server at `url` (step 0: the base model, what it
    started with), run the eval envs, write `<results>/step_<n>.json` (`<run>/eval`, or
    the user's `out`) and every rollout to `step_<n>.samples.jsonl`, and print a row."""
    from prime_hpc.inference.client import Admin

    here = RunDir(results)  # the eval's own directory (the server's files): its env servers' too

    async def all_steps(evaluator: Any) -> None:
        admin = Admin([url], key=key)
        try:
            for step in steps:
                await score_step(admin, evaluator, run, step, results)
        finally:
            await admin.aclose()

    with run_evaluator(cfg, url + "/v1", key, cfg.model.name, here, here.logs_root) as evaluator:
        asyncio.run(all_steps(evaluator))


async def score_step(admin: Any, evaluator: Any, run: Optional[RunDir], step: int, results: Path) -> dict:
    """Make every server of `admin` serve policy `step` of `run` (0: the base model, unless
    the run saved weights for step 0; no run: the model as it is), evaluate, write
    `<results>/step_<n>.json` and `step_<n>.samples.jsonl`, print a row; the row."""
    if run is not None:
        if step == 0 and 0 not in run.weight_steps():
            await admin.reload_base()
        else:
            await admin.update_weights(run.weights_step(step), step)
    t0 = time.monotonic()
    samples: list[dict] = []
    metrics = await evaluator.evaluate(step, samples)
    row = {"step": step, **metrics, "time/eval": time.monotonic() - t0}
    write_samples(results / f"step_{int(step)}.samples.jsonl", samples)
    atomic_write_json(results / f"step_{int(step)}.json", row)
    print_row(step, metrics)
    return row


def print_row(step: int, metrics: dict) -> None:
    label = "base" if step == 0 else f"step {step}"
    print("  ".join([f"{label:>10}"] + [f"{k}={v:.4f}" for k, v in metrics.items()]), flush=True)


async def beating(job_dir: RunDir, state: dict, work: Any) -> Any:
    """Await `work` while the orchestrator's heartbeat beats with `state` every `BEAT_S`
    (the head of a job that trains nothing: eval, synthesize)."""
    from prime_hpc.rundir import BEAT_S

    async def beat() -> None:
        while True:
            job_dir.beat("orchestrator", 0, **state)
            await asyncio.sleep(BEAT_S)

    task = asyncio.create_task(beat())
    try:
        return await work
    finally:
        task.cancel()


def run_job(cfg: Any) -> dict:
    """The head of an eval job (`eval_job.steps`): waits for the job's servers, then scores
    each step through the router (every server loads it first) and writes its results to
    `eval_job.results`; beats the orchestrator's heartbeat while it works (each finished
    group is progress)."""
    from prime_hpc.inference.client import Admin, api_key, discover
    from prime_hpc.orchestrator.client import SERVERS_WAIT_S

    job_dir = RunDir(cfg.output_dir)
    ej = cfg.eval_job
    results = Path(ej.results or cfg.output_dir)
    source = RunDir(ej.run) if ej.run else None
    ep = discover(job_dir, cfg.inference_nodes, timeout_s=SERVERS_WAIT_S, logs=jobenv.logs_dir())
    key = api_key()
    # it only waits on the servers (loads, generations): the watchdog excuses it while they work
    state: dict = {"step": int(ej.steps[0]), "progress_at": time.time(), "waiting_on": "inference"}

    def progressed() -> None:
        state["progress_at"] = time.time()

    async def all_steps(evaluator: Any) -> list[dict]:
        admin = Admin(ep.servers, key=key)
        rows = []
        try:
            for step in ej.steps:
                state["step"] = int(step)
                progressed()
                rows.append(await score_step(admin, evaluator, source, int(step), results))
        finally:
            await admin.aclose()
        return rows

    results.mkdir(parents=True, exist_ok=True)
    logs = jobenv.logs_dir() or job_dir.logs_root
    with run_evaluator(cfg, ep.openai_base_url, key, cfg.model.name, job_dir, logs, on_group=progressed) as evaluator:
        rows = asyncio.run(beating(job_dir, state, all_steps(evaluator)))
    print(f"prime-hpc eval: wrote {results}/step_<n>.json (and .samples.jsonl) for steps {list(ej.steps)}", flush=True)
    return {"steps": rows}


def write_samples(path: Path, samples: list[dict]) -> Path:
    """Per-sample results, one JSON object a line (written whole, then renamed)."""
    from prime_hpc.rundir import atomic_write_text

    return atomic_write_text(path, "".join(json.dumps(s, default=str) + "\n" for s in samples))


@contextlib.contextmanager
def run_evaluator(
    cfg: Any, url: Any, key: Optional[str], model: str, where: RunDir, logs: Path, on_group: Any = None
) -> Iterator[Any]:
    """The orchestrator's evaluator (`orchestrator.evaluator`) of the eval envs of `cfg` (a
    run's composed config, or the orchestrator's own), generating through the OpenAI base
    `url` (asked with `key`) as `model`; `on_group`: called after each group. An env that
    runs in a server of its own (a v1 task set, `workers`, `python`) gets one for as long
    as the evaluator is used, its endpoint and pylib under `where`, its logs under `logs`."""
    from prime_hpc.config.component import OrchestratorRunConfig, component_config, typed
    from prime_hpc.orchestrator.client import make_client
    from prime_hpc.orchestrator.envs import load_slots
    from prime_hpc.orchestrator.envservers import RemoteGenerator, served
    from prime_hpc.orchestrator.evaluator import Evaluator

    rcfg = (
        cfg
        if isinstance(cfg, OrchestratorRunConfig)
        else typed(OrchestratorRunConfig, component_config(cfg, "orchestrator"), "orchestrator config")
    )
    o = rcfg.orchestrator
    where.root.mkdir(parents=True, exist_ok=True)
    pylib = where.private_dir / "envservers" / "pylib"  # made when an env needs asking (`env_kinds.probe`)
    slots = load_slots(o.eval.env, "eval", o.eval.num_examples, pylib=pylib, where="orchestrator.eval.env")
    client = make_client(url, key, timeout_s=o.generation_timeout_s)
    with served({"eval": slots}, where, logs, rcfg, url, policy_key=key):
        yield Evaluator(
            o.eval,
            slots,
            RemoteGenerator(o, rcfg.seq_len, client, lambda: model),
            on_group=on_group or (lambda: None),
        )
