"""`prime-hpc eval <job | run dir | weights dir> [steps=N,M,...] [overrides]`: score the
base model and saved `weights/step_N` on the run's eval environments; `prime-hpc eval
model=<name|path> env=<id>[,<id>...]` (or `serve=<job>`, or `client.base_url=<endpoint>`
instead of a model) any model or running endpoint on any env ids, without a run
(`run_standalone`); and what `prime-hpc synthesize` is given (`model_words`).

On a SLURM cluster it is a job (`eval_job_config`, `submit_and_follow`): the run's
inference group with the eval runner (`prime_hpc.orchestrator.evaluate.run_job`) in the
orchestrator's place, its files in `<run>/eval/job/`. With `cluster=local` or `--here` it
starts one inference server on this machine instead
(`prime_hpc.orchestrator.evaluate.eval_server`; its files under `<run>/eval/`: configs,
endpoints, logs); `out=DIR` (or `output_dir=DIR`) puts all of it in DIR. Either way each step is loaded into every server (`/update_weights`; the
base model by `/reload_weights`), every eval env runs (`orchestrator.eval.*`:
`num_examples`, `rollouts_per_example`), and `<run>/eval/step_<N>.json`
(`eval/<env>/avg@k`, `eval/<env>/pass@k`) and `step_<N>.samples.jsonl` (every rollout) are
written. Overrides (`orchestrator.eval.num_examples=20`, `inference.dtype=float32`, ...)
apply on top of the run's `config.yaml`, typed as `resume` applies them (a misspelt key or
a wrong type fails in one line naming the key).

The server demands a key (the job's, or one made for the local server and given to it
only through its environment); eval's own calls carry it. A serve job's router
(`serve=<job>`, for eval and synthesize) is never sent its key: it is proven against the
job's `endpoints/router.json` first and asked with requests signed for it
(`proven_router`); a listener there that does not prove itself fails in one line naming
the file and the address. An endpoint given as `client.base_url=` is the user's: it gets
`$ENDPOINT_API_KEY` as a bearer token. Everything eval writes gets the
run's `cluster.umask`. A run that belongs to someone else (its config.yaml or its
directory another user's) is scored with the user's own code only: its eval env ids that
are paths, `model.trust_remote_code=true` and `inference.extra_args` are refused unless
the user restates them as overrides or passes `--trust-run-code`; its config is read once
(`recorded_config` refuses one holding an interpolation); everything eval writes goes to
a directory of the user's alone (`foreign_results`), never into their tree; and the
cluster settings are the user's (`callers_cluster`).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from prime_hpc.core.errors import UserError
from prime_hpc.orchestrator import evaluate as scoring
from prime_hpc.rundir import RunDir, atomic_write_json, jobs, read_json, with_umask


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
    whose run it is: the uid owning the file, read from the descriptor the config was read
    from, or the run directory's owner where that is not the user (a file of the user's in
    someone else's directory is not the user's run)."""
    from prime_hpc.config.compose import recorded_config

    with open(run.config_yaml) as f:
        owner = os.fstat(f.fileno()).st_uid
        cfg = recorded_config(f, overrides)
    if owner == os.getuid():
        owner = os.lstat(run.root).st_uid
    return cfg, owner


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


def run_eval(target: str, args: list[str], trust_run_code: bool = False, base: bool = True, here: bool = False) -> int:
    run, one_step = target_run(target)
    steps_arg = [a for a in args if a.startswith("steps=")]
    out, overrides = results_word([a for a in args if not a.startswith("steps=")])
    if not run.config_yaml.exists():
        raise UserError(f"{run.config_yaml} is missing: not a prime-hpc run directory")
    steps = scoring.eval_steps(run, parse_steps(steps_arg[-1][6:]) if steps_arg else None, one_step, base)
    cfg, owner = recorded_run(run, overrides)
    if not cfg.orchestrator.eval.env:
        raise UserError("the run has no eval environments (orchestrator.eval.env is empty)")
    check_foreign_run(run, owner, cfg, overrides, trust_run_code)
    results = out or run.eval_dir if owner == os.getuid() else foreign_results(run, cfg, out, overrides, trust_run_code)
    if not (here or runs_here(cfg)):
        rc = submit_and_follow(eval_job_config(cfg, steps, results, run), overrides)
        if rc == 0:
            for step in steps:
                row = read_json(Path(results) / f"step_{int(step)}.json")
                scoring.print_row(step, {k: v for k, v in row.items() if k.startswith("eval/")})
            print(f"prime-hpc eval: wrote {results}/step_<n>.json (and .samples.jsonl) for steps {steps}")
        return rc
    from prime_hpc.config.cluster import cache_root
    from prime_hpc.core import usercache

    cache = cache_root(cfg)  # the run's (your own for a run of someone else's): built models are reused
    usercache.compile_dir(cache, create=False)
    with with_umask(cfg.cluster.umask), scoring.eval_server(cfg, RunDir(results), cache) as (url, key):
        scoring.score_steps(run, cfg, steps, url, key, Path(results))
    print(f"prime-hpc eval: wrote {results}/step_<n>.json (and .samples.jsonl) for steps {steps}")
    return 0


def results_word(args: list[str]) -> tuple[Optional[Path], list[str]]:
    """`out=DIR` (or `output_dir=DIR`, the same: where eval writes its results and its
    server's files) and the other words; one line when both are given and differ."""
    given = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in args if a.split("=", 1)[0] in RESULT_WORDS}
    rest = [a for a in args if a.split("=", 1)[0] not in RESULT_WORDS]
    paths = {Path(v).expanduser().absolute() for v in given.values()}
    if len(paths) > 1:
        raise UserError(f"out={given['out']} and output_dir={given['output_dir']}: give one, where eval writes")
    if any(not v.strip() for v in given.values()):
        raise UserError(f"{next(iter(given))}= is empty: give the directory eval writes to")
    return (paths.pop() if paths else None), rest


RESULT_WORDS = ("out", "output_dir")


def foreign_results(run: RunDir, cfg: Any, out: Optional[Path], overrides: list[str], trust: bool) -> Path:
    """A run of someone else's: nothing of theirs is read again after the check (their
    config was read once, from one descriptor) and nothing eval writes goes into their
    tree: it goes to a directory of the user's alone (`private_results`), with the user's
    cluster settings (`callers_cluster`). Says so in a line; the directory."""
    results = private_results(run, out)
    theirs = str(cfg.cluster.device)
    callers_cluster(cfg, overrides, results, keep=trust)
    settings = "its cluster settings but your umask and cache" if trust else "your cluster settings, not its"
    device = f" (it ran on {theirs}: cluster.device={theirs} for that)" if theirs != cfg.cluster.device else ""
    print(
        f"prime-hpc eval: {run.root} is not yours: scored with {settings}{device}; eval writes to {results}", flush=True
    )
    return results


def private_results(run: RunDir, out: Optional[Path]) -> Path:
    """Where eval writes for a run of someone else's: `out` or `outputs/eval/<run>-<time>`,
    a directory of the user's alone (0700 when made; `usercache.private_dir`), its real
    path; one line when it is not."""
    from prime_hpc.core import usercache

    slug = re.sub(r"[^A-Za-z0-9._-]", "_", run.root.name) or "run"
    path = out or Path("outputs") / "eval" / f"{slug}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        return usercache.private_dir(path)
    except (usercache.Untrusted, OSError) as e:
        raise UserError(
            f"out={path}: {e}; a run that is not yours is scored into a directory of your own that nobody "
            "else can change: give out=DIR"
        ) from None


def callers_cluster(cfg: Any, overrides: list[str], results: Path, keep: bool) -> None:
    """A run of someone else's is scored with the user's cluster settings: those a submit of
    the user's gets by default (`cluster=local`) with the user's `cluster.*` overrides,
    the cache next to `results` unless `cluster.cache_dir` is given (their umask would
    decide who may write the user's files, their cache what the user loads). `keep`
    (`--trust-run-code`: a job on their cluster, their `env_setup` and all): only their
    umask and cache are replaced."""
    from prime_hpc.config.cluster import cache_root
    from prime_hpc.config.compose import compose

    mine = compose([o for o in overrides if o.lstrip("+~").startswith("cluster.")])
    mine.output_dir = str(results)
    if keep:
        cfg.cluster.umask = mine.cluster.umask
    else:
        cfg.cluster = mine.cluster
    cfg.cluster.cache_dir = cache_root(mine)


EVAL_JOB_DIR = "job"  # an eval job's own files (configs, logs, job.json) under its results directory


def runs_here(cfg: Any) -> bool:
    """Eval serves and scores on this machine when the run's cluster is this machine
    (`cluster=local`); on a SLURM cluster it is a job (`--here` forces this machine)."""
    from prime_hpc.sched.registry import choose

    return bool(choose(cfg.cluster.backend).one_machine)


def eval_job_config(cfg: Any, steps: list[int], results: Path, run: Optional[RunDir]) -> Any:
    """The config of the job that scores `steps` of `run` (None: the model as it is):
    the run's own (model, eval envs, sampling, inference, cluster) with `eval_job` set,
    a `model_job_config` in `<results>/job`, named `<name>-eval`."""
    cfg.eval_job.steps = [int(s) for s in steps]
    cfg.eval_job.run = str(run.root) if run is not None else None
    cfg.eval_job.results = str(Path(results).resolve())
    return model_job_config(cfg, results, f"{cfg.name}-eval")


def model_job_config(cfg: Any, results: Path, name: str) -> Any:
    """`cfg` as the config of a job that trains nothing (eval, synthesize): in
    `<results>/job` (an earlier such job's files there are replaced, the results beside
    them kept), named `name`, without warm-up, checkpoints, W&B or requeues (it keeps no
    checkpoint: a requeue would start it over)."""
    cfg.output_dir = str(Path(results).resolve() / EVAL_JOB_DIR)
    cfg.name = name
    cfg.warmup.experiment = None
    cfg.wandb.enabled = False
    cfg.ckpt.enabled = False
    cfg.ckpt.interval = None
    cfg.ckpt.step = None
    cfg.bench.mode = None
    cfg.cluster.max_requeues = 0
    job = RunDir(cfg.output_dir)
    cfg.clean_output_dir = job.job_json.exists() or job.config_yaml.exists()  # an earlier job's
    return cfg


def submit_and_follow(cfg: Any, overrides: list[str], what: Optional[str] = None, results: Optional[str] = None) -> int:
    """Submit the job (an eval job, or any of `kind` like it), follow its logs until it
    ends (as `submit -f`); 0 when it completed, else one line naming its state and where
    to look. `what`: said of the job on submission; `results`: where it writes."""
    from prime_hpc.launcher import launch
    from prime_hpc.launcher.state import follow_ref

    sub = launch.submit(cfg, overrides)
    ref = sub.ref
    kind = sub.plan.kind
    if what is None:
        what = "step(s) " + ", ".join("base" if s == 0 else str(s) for s in cfg.eval_job.steps)
    results = results or str(cfg.eval_job.results)
    print(f"submitted {kind} job {ref.job_id} ({ref.name}: {', '.join(sub.plan.group_names)}, {ref.backend}): {what}")
    print(f"  output dir: {ref.output_dir}    results: {results}", flush=True)
    try:
        rc = follow_ref(ref)
    except KeyboardInterrupt:
        print(
            f"\nstopped following; the {kind} job goes on (prime-hpc status {ref.job_id}); results: {results}",
            file=sys.stderr,
        )
        return 130
    if rc != 0:
        state = jobs.read_job(ref.run).get("state", "UNKNOWN")
        raise UserError(
            f"{kind} job {ref.job_id} ended {state}; see prime-hpc tail {ref.job_id} --no-follow "
            f"(logs: {ref.run.latest_logs})"
        )
    return 0


def serving_endpoint(job: str) -> dict[str, str]:
    """`serve=<job>`: the `client.base_url` and `client.model` of a serve job that serves
    now, and its directory (`client.SERVE_DIR`: its key, when the job is the user's own,
    is the one it kept, `client.endpoint_key`). The base URL is the job's router, proven
    against its `endpoints/router.json` with that key (`proven_router`), and carries the
    link that proved it: the client made with it signs each request, never sends the key.
    One line when the job does not serve, when there is no key to prove it with, or when
    the router there does not prove itself."""
    from prime_hpc.inference.client import ENDPOINT_KEY_VAR, SERVE_DIR, endpoint_key
    from prime_hpc.rundir.jobs import served

    ref = jobs.resolve(job)
    found = served(ref.run)
    if found is None:
        raise UserError(
            f"serve job {ref.job_id} ({ref.output_dir}) does not serve now; see prime-hpc status {ref.job_id}"
        )
    words = {"client.base_url": found["url"], "client.model": found["model"], SERVE_DIR: str(ref.run.root)}
    key = endpoint_key(words)
    if not key:
        raise UserError(f"serve job {ref.job_id} answers only with its key: set ${ENDPOINT_KEY_VAR} to it here")
    words["client.base_url"] = proven_router(ref, key)
    return words


def proven_router(ref: jobs.JobRef, key: str) -> str:
    """The OpenAI base URL of serve job `ref`'s router, once it proved it holds `key` as
    the instance its `endpoints/router.json` names (`inference.client.RouterLink`: a nonce
    sent, nothing else), as a `RouterURL` carrying that link. A listener there that does
    not prove it (a router.json left by a router killed outright, its port someone else's;
    or a key that is not the job's), or none at all: one line naming the file and the
    address."""
    import httpx

    from prime_hpc.inference.client import CHALLENGE_TIMEOUT_S, NotProven, RouterLink, RouterURL

    link = RouterLink(ref.run.router_endpoint, key)
    try:
        nonce, record, challenge = link.probe()
        with httpx.Client(timeout=CHALLENGE_TIMEOUT_S) as client:
            link.take(client.send(challenge), nonce, record)
    except NotProven as e:
        raise UserError(
            f"serve job {ref.job_id}: {e}; if its router runs, the key is not the one the job was submitted with"
        ) from None
    except httpx.HTTPError as e:
        raise UserError(
            f"serve job {ref.job_id}: {link.path} names the router at {record['url']}, which does not answer "
            f"({type(e).__name__}): nothing is sent to it; see prime-hpc status {ref.job_id}"
        ) from None
    return RouterURL(f"{link.url}/v1", link)


ENV_ARGS_PREFIX = "args."


def parse_env_args(given: list[str], envs: list[str]) -> dict[str, dict[str, Any]]:
    """`args.<env>.<arg>=<value>` (the value read as YAML: 5, true, [a, b], text) -> {env id:
    {arg: value}} for `load_environment`; an env not among `envs` fails in one line."""
    import yaml

    out: dict[str, dict[str, Any]] = {}
    for item in given:
        key, _, value = item.partition("=")
        env, _, arg = key[len(ENV_ARGS_PREFIX) :].rpartition(".")
        if not env or not arg:
            raise UserError(f"{item}: expected args.<env>.<arg>=<value>, e.g. args.{envs[0]}.num_examples=20")
        if env not in envs:
            raise UserError(f"{item}: {env!r} is not among env={','.join(envs)}")
        try:
            out.setdefault(env, {})[arg] = yaml.safe_load(value) if value else ""
        except yaml.YAMLError:
            out.setdefault(env, {})[arg] = value
    return out


STANDALONE_KEYS = (
    "model",
    "env",
    "rollouts",
    "examples",
    "out",
    "output_dir",
    "client.base_url",
    "client.model",
    "serve",
)


def is_standalone(target: str) -> bool:
    """`prime-hpc eval model=... env=...` rather than a job, run or weights dir."""
    return "=" in target and target.split("=", 1)[0] in STANDALONE_KEYS and not Path(target).exists()


@dataclass
class ModelWords:
    """What `eval model=...` and `synthesize model=...` are given: the model or endpoint,
    the envs with their arguments, k and n, the output directory, the overrides."""

    opts: dict[str, str]  # model= or client.base_url= (serve= resolved), client.model=, ...
    envs: list[str]
    env_args: dict[str, dict[str, Any]]
    rollouts: int
    examples: Optional[int]
    name: str  # the model, as asked of the server
    out: Path
    overrides: list[str]

    def compose(self) -> Any:
        """The default config with the overrides, for this model (`model=` over the overrides'
        model.name: a recipe's), in `out`."""
        from prime_hpc.config.compose import compose

        if "model" in self.opts:
            return compose([*self.overrides, f"model.name={self.name}", f"output_dir={self.out}"])
        return compose(["model.name=tiny", *self.overrides, f"output_dir={self.out}"])

    def entries(self) -> list:
        from prime_hpc.config.schema import EnvEntry

        return [EnvEntry(id=e, args=self.env_args.get(e, {})) for e in self.envs]


def model_words(args: list[str], keys: tuple[str, ...], verb: str) -> ModelWords:
    """Parse `args` of a command that runs envs against a model (`keys`: its own words;
    `verb`: "eval" or "synthesize", the default `outputs/<verb>/<model>-<time>`); one line
    for what is missing or wrong. `output_dir=DIR` is `out=DIR` (what every other command
    calls the directory it writes)."""
    given_out, args = results_word(args)
    opts = dict(a.split("=", 1) for a in args if "=" in a and a.split("=", 1)[0] in keys)
    given_args = [a for a in args if a.startswith(ENV_ARGS_PREFIX)]
    overrides = [a for a in args if a.split("=", 1)[0] not in keys and a not in given_args]
    envs = [e for e in opts.get("env", "").split(",") if e]
    if not envs:
        raise UserError("env=<id>[,<id>...] is required: the environments to run the model on")
    env_args = parse_env_args(given_args, envs)
    if "serve" in opts:
        opts.update(serving_endpoint(opts.pop("serve")))
    if "model" not in opts and "client.base_url" not in opts:
        raise UserError(
            "give model=<name|path> (a server is started for it), serve=<job> or client.base_url=<endpoint>"
        )
    try:
        k, n = int(opts.get("rollouts", 1)), int(opts.get("examples", 0)) or None
    except ValueError:
        raise UserError("rollouts=K and examples=N take whole numbers") from None
    if k < 1 or (n is not None and n < 1):
        raise UserError("rollouts=K and examples=N must be >= 1")
    name = opts.get("model") or opts.get("client.model") or "served"
    out = given_out or Path("outputs") / verb / f"{Path(name).name}-{time.strftime('%Y%m%d-%H%M%S')}"
    return ModelWords(opts, envs, env_args, k, n, name, out.expanduser().resolve(), overrides)


def run_standalone(args: list[str], here: bool = False) -> int:
    """`prime-hpc eval model=<name|path> env=<id>[,<id>...] [args.<id>.<arg>=V ...]
    [rollouts=K] [examples=N] [client.base_url=URL [client.model=NAME]] [out=DIR]
    [overrides]`: any model (a server is started for it) or any running OpenAI-compatible
    endpoint (with the key in `$ENDPOINT_API_KEY`, when it wants one: `client.endpoint_key`), on any env
    ids, each with its own `load_environment` arguments. Writes `<out>/eval.json`, every
    rollout to `<out>/samples.jsonl`, and prints one row per env: avg@k and pass@k."""
    from prime_hpc.config.cluster import cache_root
    from prime_hpc.config.schema import EnvEntry
    from prime_hpc.core import usercache
    from prime_hpc.inference.client import endpoint_key
    from prime_hpc.orchestrator.envs import env_name

    w = model_words(args, STANDALONE_KEYS, "eval")
    opts, envs, name, out, k, n = w.opts, w.envs, w.name, w.out, w.rollouts, w.examples
    cfg = w.compose()
    cfg.orchestrator.eval.env = w.entries()
    cfg.orchestrator.eval.rollouts_per_example, cfg.orchestrator.eval.num_examples = k, n
    edir = RunDir(out)
    t0 = time.monotonic()

    samples: list[dict] = []

    def evaluate(url: str, model: str, key: Optional[str]) -> dict:
        with scoring.run_evaluator(cfg, url, key, model, edir, edir.logs_root) as evaluator:
            return asyncio.run(evaluator.evaluate(0, samples))

    with with_umask(cfg.cluster.umask):
        if "client.base_url" in opts:
            url = scoring.endpoint_url(opts["client.base_url"])
            metrics = evaluate(url, opts.get("client.model") or name, endpoint_key(opts))
            where = opts["client.base_url"].rstrip("/")
        elif here or runs_here(cfg):
            usercache.compile_dir(cache_root(cfg), create=False)
            edir.root.mkdir(parents=True, exist_ok=True)
            with scoring.eval_server(cfg, edir, cache_root(cfg)) as (url, key):
                metrics = evaluate(url + "/v1", cfg.model.name, key)
            where = "a server started for it"
        else:
            cfg.name = Path(name).name
            job_cfg = eval_job_config(cfg, [0], out, None)
            rc = submit_and_follow(job_cfg, w.overrides)
            if rc:
                return rc
            row = read_json(out / "step_0.json")
            metrics = {key: v for key, v in row.items() if key.startswith("eval/")}
            samples = [json.loads(line) for line in (out / "step_0.samples.jsonl").read_text().splitlines() if line]
            for done in ("step_0.json", "step_0.samples.jsonl"):  # the job's, as eval.json and samples.jsonl
                (out / done).unlink()
            where = f"eval job {jobs.read_job(RunDir(job_cfg.output_dir)).get('job_ids', ['?'])[-1]}"
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
        scoring.write_samples(out / "samples.jsonl", samples)
        path = atomic_write_json(out / "eval.json", result)
    print(f"{'ENV':24} {f'AVG@{k}':>8} {f'PASS@{k}':>8}")
    for e in (env_name(EnvEntry(id=e)) for e in envs):
        print(
            f"{e:24} {metrics.get(f'eval/{e}/avg@{k}', float('nan')):8.3f} "
            f"{metrics.get(f'eval/{e}/pass@{k}', float('nan')):8.3f}"
        )
    print(f"prime-hpc eval: {name} on {', '.join(envs)} ({where}); wrote {path} and {out / 'samples.jsonl'}")
    return 0
