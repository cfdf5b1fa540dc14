"""`prime-hpc eval <job | run dir | weights dir> [steps=N,M,...] [overrides]`: score saved
`weights/step_N` on the run's eval environments.

It starts one inference server for the run's model on this machine (its files under
`<run>/eval/`: configs, endpoints, logs), loads each requested step into it with
`/update_weights`, runs every eval env (`orchestrator.eval.*`: `num_examples`,
`rollouts_per_example`) and writes `<run>/eval/step_<N>.json` with
`eval/<env>/avg@k` and `eval/<env>/pass@k`. Overrides (`orchestrator.eval.num_examples=20`,
`inference.dtype=float32`, ...) apply on top of the run's `config.yaml`, typed as `resume`
applies them (a misspelt key or a wrong type fails in one line naming the key).

The server demands a key made for it (`INFERENCE_SERVER_API_KEY` in its environment only);
eval's own calls carry it. Everything eval writes gets the run's `cluster.umask`. A run
that belongs to someone else is scored with the user's own code only: its eval env ids
that are paths, `model.trust_remote_code=true` and `inference.extra_args` are refused
unless the user restates them as overrides or passes `--trust-run-code`.

`prime-hpc eval model=<name|path> env=<id>[,<id>...]` (or `client.base_url=<endpoint>`
instead of a model) scores any model or running endpoint on any env ids, without a run:
see `run_standalone`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Optional

from prime_hpc.core import jobenv
from prime_hpc.core.errors import UserError
from prime_hpc.rundir import RunDir, atomic_write_json, with_umask


def target_run(target: str) -> tuple[RunDir, Optional[int]]:
    """The run a target names, and the step when it names one weights dir."""
    path = Path(target).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        found = RunDir.of_weights_step(path)
        if found is None:
            raise UserError(
                f"{path}: a weights dir must be <run>/weights/step_<n> (the run's config names the eval envs)"
            )
        return found
    if path.is_dir() and RunDir(path).config_yaml.exists():  # a run directory (submitted or not)
        return RunDir(path), None
    from prime_hpc.rundir import jobs

    return jobs.resolve(target).run, None


def parse_steps(value: str) -> list[int]:
    try:
        return [int(x) for x in value.strip("[]").split(",") if x.strip()]
    except ValueError:
        raise UserError(f"steps={value}: expected comma-separated step numbers, e.g. steps=10,20") from None


def recorded_run(run: RunDir, overrides: list[str]) -> tuple[Any, int]:
    """The run's `config.yaml` on the typed schema with `overrides` applied as `resume`
    applies them (an unknown key or a wrong type fails in one line naming the key), and
    the uid owning the file, read from the descriptor the config was read from."""
    from prime_hpc.config.compose import recorded_config

    with open(run.config_yaml) as f:
        owner = os.fstat(f.fileno()).st_uid
        return recorded_config(f, overrides), owner


def _restated(key: str, overrides: list[str]) -> bool:
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    return any(key == k or key.startswith(k + ".") for k in given)


def foreign_code(cfg: Any, overrides: list[str]) -> list[str]:
    """What in a run's config would make eval run code other than the user's installed
    packages: eval env ids that are paths, `model.trust_remote_code=true` and
    `inference.extra_args` (vLLM options can load plugins); what the user's own
    overrides restate or replace is theirs."""
    from prime_hpc.config.env_ids import UnknownEnv, resolve

    found = []
    for i, entry in enumerate(cfg.orchestrator.eval.env):
        key = f"orchestrator.eval.env.{i}.id"
        try:
            is_path = resolve(str(entry.id)).path is not None
        except UnknownEnv:
            is_path = False  # not loadable at all: eval fails on it anyway
        if is_path and not _restated(key, overrides):
            found.append(f"{key}={entry.id} (a path)")
    if cfg.model.trust_remote_code and not _restated("model.trust_remote_code", overrides):
        found.append("model.trust_remote_code=true")
    if cfg.inference.extra_args and not _restated("inference.extra_args", overrides):
        found.append(f"inference.extra_args={list(cfg.inference.extra_args)}")
    return found


def check_foreign_run(run: RunDir, owner: int, cfg: Any, overrides: list[str], trust: bool) -> None:
    """A run of someone else's is scored with the user's code only, unless the user says
    otherwise: `--trust-run-code`, or restating those keys as overrides."""
    from prime_hpc.core.usercache import owner_name

    if owner == os.getuid() or trust:
        return
    found = foreign_code(cfg, overrides)
    if found:
        raise UserError(
            f"{run.config_yaml} belongs to {owner_name(owner)}: refusing what would run code of theirs: "
            f"{', '.join(found)}; to allow it pass --trust-run-code, or restate it as an override "
            f"(e.g. {found[0].split(' ')[0]})"
        )


@contextlib.contextmanager
def eval_server(cfg: Any, edir: RunDir, cache: str) -> Iterator[tuple[str, str]]:
    """One inference server for `cfg.model.name` on this machine, its files under `edir`
    (configs, endpoints, logs); yields its URL and the key it demands (made for this
    server, given to it only through its environment), then stops it (and its process
    group)."""
    import secrets

    from prime_hpc.config.component import write_component_config
    from prime_hpc.core.jobenv import CACHE_VAR
    from prime_hpc.core.net import address_env
    from prime_hpc.inference.client import wait_for_servers

    key = secrets.token_urlsafe(32)
    cfg.output_dir = str(edir.root)
    cfg.cluster.inference.nodes = 1
    inference_yaml = write_component_config(cfg, "inference")
    log = RunDir.node_log(edir.logs_root, "inference", 0)
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


def run_eval(target: str, args: list[str], trust_run_code: bool = False) -> int:
    from prime_hpc.config.cluster import cache_root
    from prime_hpc.core import usercache

    run, one_step = target_run(target)
    steps_arg = [a for a in args if a.startswith("steps=")]
    overrides = [a for a in args if not a.startswith("steps=")]
    if not run.config_yaml.exists():
        raise UserError(f"{run.config_yaml} is missing: not a prime-hpc run directory")
    available = run.weight_steps()
    steps = parse_steps(steps_arg[-1][6:]) if steps_arg else ([one_step] if one_step is not None else available)
    missing = [s for s in steps if s not in available]
    if missing or not steps:
        raise UserError(
            f"no complete weights for step(s) {missing or steps} in {run.weights_dir}; available: {available or 'none'}"
        )
    cfg, owner = recorded_run(run, overrides)
    if not cfg.orchestrator.eval.env:
        raise UserError("the run has no eval environments (orchestrator.eval.env is empty)")
    check_foreign_run(run, owner, cfg, overrides, trust_run_code)
    cache = cache_root(cfg)  # the run's cache: its built models (and the user's compile cache there) are reused
    usercache.compile_dir(cache, create=False)
    with with_umask(cfg.cluster.umask), eval_server(cfg, RunDir(run.eval_dir), cache) as (url, key):
        score_steps(run, cfg, steps, url, key)
    print(f"prime-hpc eval: wrote {run.eval_dir}/step_<n>.json for steps {steps}")
    return 0


def score_steps(run: RunDir, cfg: Any, steps: list[int], url: str, key: str) -> None:
    """Load each step's weights into the server at `url`, run the eval envs, write
    `<run>/eval/step_<n>.json` and print a row."""
    from prime_hpc.inference.client import Admin
    from prime_hpc.orchestrator.client import make_client

    evaluator = run_evaluator(cfg, make_client(url + "/v1", key), cfg.model.name)
    admin = Admin([url], key=key)

    async def all_steps() -> None:
        for step in steps:
            await admin.update_weights(run.weights_step(step), step)
            t0 = time.monotonic()
            metrics = await evaluator.evaluate(step)
            row = {"step": step, **metrics, "time/eval": time.monotonic() - t0}
            atomic_write_json(run.eval_result(step), row)
            print("  ".join([f"step {step:>5}"] + [f"{k}={v:.4f}" for k, v in metrics.items()]), flush=True)
        await admin.aclose()

    asyncio.run(all_steps())


def run_evaluator(cfg: Any, client: Any, model: str) -> Any:
    """The orchestrator's evaluator (`orchestrator.evaluator`) of the eval envs of `cfg` (a
    run's composed config), generating through `client` as `model`."""
    from prime_hpc.config.component import OrchestratorRunConfig, component_config, typed
    from prime_hpc.orchestrator.envs import load_slots
    from prime_hpc.orchestrator.evaluator import Evaluator
    from prime_hpc.orchestrator.generate import Generator

    rcfg = typed(OrchestratorRunConfig, component_config(cfg, "orchestrator"), "orchestrator config")
    o = rcfg.orchestrator
    return Evaluator(
        o.eval, load_slots(o.eval.env, "eval", o.eval.num_examples), Generator(o, rcfg.seq_len, client, lambda: model)
    )


STANDALONE_KEYS = ("model", "env", "rollouts", "examples", "out", "client.base_url", "client.model")


def is_standalone(target: str) -> bool:
    """`prime-hpc eval model=... env=...` rather than a job, run or weights dir."""
    return "=" in target and target.split("=", 1)[0] in STANDALONE_KEYS and not Path(target).exists()


def run_standalone(args: list[str]) -> int:
    """`prime-hpc eval model=<name|path> env=<id>[,<id>...] [rollouts=K] [examples=N]
    [client.base_url=URL [client.model=NAME]] [out=DIR] [overrides]`: any model (a server
    is started for it) or any running OpenAI-compatible endpoint, on any env ids. Writes
    `<out>/eval.json` and prints one row per env: avg@k and pass@k."""
    from prime_hpc.config.cluster import cache_root
    from prime_hpc.config.compose import compose
    from prime_hpc.config.schema import EnvEntry
    from prime_hpc.core import usercache
    from prime_hpc.inference.client import api_key
    from prime_hpc.orchestrator.client import make_client
    from prime_hpc.orchestrator.envs import env_name

    opts = dict(a.split("=", 1) for a in args if "=" in a and a.split("=", 1)[0] in STANDALONE_KEYS)
    overrides = [a for a in args if a.split("=", 1)[0] not in STANDALONE_KEYS]
    envs = [e for e in opts.get("env", "").split(",") if e]
    if not envs:
        raise UserError("env=<id>[,<id>...] is required: the environments to evaluate on")
    if "model" not in opts and "client.base_url" not in opts:
        raise UserError("give model=<name|path> (a server is started for it) or client.base_url=<endpoint>")
    try:
        k, n = int(opts.get("rollouts", 1)), int(opts.get("examples", 0)) or None
    except ValueError:
        raise UserError("rollouts=K and examples=N take whole numbers") from None
    if k < 1 or (n is not None and n < 1):
        raise UserError("rollouts=K and examples=N must be >= 1")
    name = opts.get("model") or opts.get("client.model") or "served"
    out = Path(opts.get("out") or Path("outputs") / "eval" / f"{Path(name).name}-{time.strftime('%Y%m%d-%H%M%S')}")
    cfg = compose([f"model.name={name}" if "model" in opts else "model.name=tiny", f"output_dir={out}", *overrides])
    cfg.orchestrator.eval.env = [EnvEntry(id=e) for e in envs]
    cfg.orchestrator.eval.rollouts_per_example, cfg.orchestrator.eval.num_examples = k, n
    edir = RunDir(out)
    t0 = time.monotonic()

    def evaluate(url: str, model: str, key: Optional[str]) -> dict:
        return asyncio.run(run_evaluator(cfg, make_client(url, key), model).evaluate(0))

    with with_umask(cfg.cluster.umask):
        if "client.base_url" in opts:
            base = opts["client.base_url"].rstrip("/")
            metrics = evaluate(
                base if base.endswith("/v1") else base + "/v1", opts.get("client.model") or name, api_key()
            )
            where = base
        else:
            usercache.compile_dir(cache_root(cfg), create=False)
            edir.root.mkdir(parents=True, exist_ok=True)
            with eval_server(cfg, edir, cache_root(cfg)) as (url, key):
                metrics = evaluate(url + "/v1", cfg.model.name, key)
            where = "a server started for it"
        result = {
            "model": name,
            "endpoint": where,
            "envs": envs,
            "rollouts_per_example": k,
            "num_examples": n,
            "metrics": metrics,
            "time_s": round(time.monotonic() - t0, 1),
            "at": time.time(),
        }
        path = atomic_write_json(out / "eval.json", result)
    print(f"{'ENV':24} {f'AVG@{k}':>8} {f'PASS@{k}':>8}")
    for e in (env_name(EnvEntry(id=e)) for e in envs):
        print(
            f"{e:24} {metrics.get(f'eval/{e}/avg@{k}', float('nan')):8.3f} "
            f"{metrics.get(f'eval/{e}/pass@{k}', float('nan')):8.3f}"
        )
    print(f"prime-hpc eval: {name} on {', '.join(envs)} ({where}); wrote {path}")
    return 0
