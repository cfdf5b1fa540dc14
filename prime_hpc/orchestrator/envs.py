"""Environments of a run: load each `{id, args, ratio}` entry into a verifiers Environment,
sample tasks by ratio, route each env's log records to its own file, and notice reward
functions that raise (verifiers scores them 0 and logs; we also count them as errors).
"""

from __future__ import annotations

import contextvars
import inspect
import logging
import random
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from prime_hpc.config.env_ids import import_env_module
from prime_hpc.config.schema import EnvEntry
from prime_hpc.core.errors import UserError
from prime_hpc.rundir import logtree

REWARD_ERROR = "reward_error"  # state key set when a reward function raised
CURRENT_ENV: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("prime_hpc_env", default=None)
ENV_LOG = logging.getLogger("prime_hpc.envs")  # our own records about an env's groups, into its worker log
ENV_LOG.addHandler(logging.NullHandler())  # nowhere else (outside a job there are no worker logs)
ENV_LOG.propagate = False


def env_name(entry: EnvEntry) -> str:
    return entry.name or str(entry.id).rstrip("/").split("/")[-1].removesuffix(".py")


def load_env(entry: EnvEntry, kind: str = "train") -> Any:
    """`load_environment(**args)` of the entry's module; one-line UserError on failure."""
    env_id = entry.id
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            module = import_env_module(env_id)
        except Exception as e:
            raise UserError(f"{kind} env {env_id!r} cannot be imported: {type(e).__name__}: {e}") from None
        load = getattr(module, "load_environment", None)
        if load is None:
            raise UserError(f"{kind} env {env_id!r}: module {module.__name__} has no load_environment()")
        try:
            env = load(**dict(entry.args))
        except Exception as e:
            first = str(e).splitlines()[0] if str(e) else ""
            raise UserError(f"{kind} env {env_id!r}: load_environment() failed: {type(e).__name__}: {first}") from None
    finally:
        for s, h in handlers.items():  # verifiers installs its own SIGINT/SIGTERM handlers
            if h is not None:
                signal.signal(s, h)
    watch_reward_errors(env.rubric)
    return env


class EnvFailed(UserError):
    """A train environment whose groups keep erroring: the run cannot learn from it.
    `log`: that env's worker log, where its exceptions are."""

    def __init__(self, message: str, log: Optional[Path] = None) -> None:
        super().__init__(message)
        self.log = log


# ----------------------------------------------------------------------------- reward errors
def _individual_funcs(rubric: Any) -> list[tuple[Any, int]]:
    out = []
    for sub in getattr(rubric, "rubrics", None) or []:
        out += _individual_funcs(sub)
    funcs = getattr(rubric, "funcs", None)
    if isinstance(funcs, list):
        for i, f in enumerate(funcs):
            if not rubric._is_group_func(f):
                out.append((rubric, i))
    return out


def watch_reward_errors(rubric: Any) -> None:
    """Wrap each per-rollout reward function so an exception is recorded in the rollout's
    state (`reward_error`) before verifiers swallows it (reward 0)."""
    for owner, i in _individual_funcs(rubric):
        func = owner.funcs[i]
        if getattr(func, "_prime_hpc_watched", False):
            continue
        params = inspect.signature(func).parameters
        takes_all = any(p.kind == p.VAR_KEYWORD for p in params.values())

        async def watched(__f=func, __all=takes_all, __params=params, **kwargs):
            args = kwargs if __all else {k: v for k, v in kwargs.items() if k in __params}
            try:
                value = __f(**args)
                if inspect.isawaitable(value):
                    value = await value
                return value
            except Exception as e:
                state = kwargs.get("state")
                if isinstance(state, dict):
                    state[REWARD_ERROR] = f"{getattr(__f, '__name__', 'reward')}: {type(e).__name__}: {e}"
                raise

        watched.__name__ = getattr(func, "__name__", "reward")
        watched._prime_hpc_watched = True  # type: ignore[attr-defined]
        owner.funcs[i] = watched


# ----------------------------------------------------------------------------- logs
class EnvLogRouter(logging.Handler):
    """Writes each log record to the file of the env whose rollout emitted it (the
    current task's `CURRENT_ENV`); records outside any env go to the orchestrator log.
    `attach()` routes verifiers' records and our own (`ENV_LOG`)."""

    def __init__(self, files: dict[str, Path]) -> None:
        super().__init__()
        self.handlers: dict[str, logging.Handler] = {}
        for key, path in files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            h = logging.FileHandler(path)
            h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
            self.handlers[key] = h

    def attach(self, vf_level: str) -> None:
        logging.getLogger("verifiers").addHandler(self)
        logging.getLogger("verifiers").setLevel(vf_level.upper())
        ENV_LOG.addHandler(self)
        ENV_LOG.setLevel(logging.INFO)

    def emit(self, record: logging.LogRecord) -> None:
        h = self.handlers.get(CURRENT_ENV.get() or "")
        if h is not None:
            h.emit(record)

    def close(self) -> None:
        for h in self.handlers.values():
            h.close()
        for name in ("verifiers", ENV_LOG.name):
            logging.getLogger(name).removeHandler(self)
        super().close()


def route_env_logs(logs: Path, slots: dict[str, list["EnvSlot"]], vf_level: str) -> EnvLogRouter:
    """An attached router of each env's records (`slots` by kind) into its worker log under
    the attempt's `logs`; close it at the end."""
    router = EnvLogRouter(
        {
            f"{kind}/{s.name}": logtree.env_worker_log(logs, kind, s.name)
            for kind, of_kind in slots.items()
            for s in of_kind
        }
    )
    router.attach(vf_level)
    return router


def note_errored(kind: str, env: str, example_id: Any, error: str) -> None:
    """One line in `env`'s worker log about a group none of whose rollouts can train."""
    token = CURRENT_ENV.set(f"{kind}/{env}")
    try:
        ENV_LOG.warning(f"example {example_id}: nothing of the group can train: {' '.join(error.split())}")
    finally:
        CURRENT_ENV.reset(token)


# ----------------------------------------------------------------------------- sampling
@dataclass
class EnvSlot:
    name: str
    entry: EnvEntry
    env: Any
    rows: list[dict]  # the env's formatted dataset (prompt, answer, example_id, info, task)
    order: list[int] = field(default_factory=list)
    cursor: int = 0
    epoch: int = 0
    server: Any = None  # its env server (`orchestrator.envservers.EnvServerProcess`) when it runs in one
    kind: str = "classic"  # or "v1": a verifiers v1 taskset (`config.env_kinds`)
    python: Optional[str] = None  # its server's interpreter (None: the run's own)

    @property
    def in_server_only(self) -> bool:
        """Loaded only in its server (a v1 taskset, an env of another Python): its rows come
        from there (`orchestrator.envservers.fill_rows`), `env` is None."""
        return self.kind != "classic" or self.python is not None


class EnvSampler:
    """Picks an env by `ratio`, then the env's next task (a seeded shuffle per epoch).
    With `epochs`, an env stops being picked once it has served every task that many
    times, and `next()` returns None when all have. Its state is plain JSON
    (checkpointed with the orchestrator)."""

    def __init__(self, slots: list[EnvSlot], seed: int, epochs: Optional[int] = None) -> None:
        if not slots:
            raise UserError("orchestrator.env is empty: list at least one environment")
        self.slots = slots
        self.seed = seed
        self.epochs = epochs
        self.rng = random.Random(seed)
        self.weights = [float(s.entry.ratio) for s in slots]
        for s in slots:
            if not s.rows:
                raise UserError(f"env {s.entry.id!r} has an empty dataset")
            self._shuffle(s)

    def _shuffle(self, s: EnvSlot) -> None:
        s.order = list(range(len(s.rows)))
        random.Random(f"{self.seed}:{s.name}:{s.epoch}").shuffle(s.order)
        s.cursor = 0

    def _used_up(self, s: EnvSlot) -> bool:
        return self.epochs is not None and s.epoch + 1 >= self.epochs and s.cursor >= len(s.order)

    def exhausted(self) -> bool:
        return all(self._used_up(s) for s in self.slots)

    def remaining(self) -> Optional[int]:
        """Tasks still to serve (None: no end, `epochs` unset)."""
        if self.epochs is None:
            return None
        return sum((self.epochs - s.epoch - 1) * len(s.order) + len(s.order) - s.cursor for s in self.slots)

    def next(self) -> Optional[tuple[EnvSlot, dict]]:
        live = [(s, w) for s, w in zip(self.slots, self.weights) if not self._used_up(s)]
        if not live:
            return None
        s = self.rng.choices([x for x, _ in live], weights=[w for _, w in live], k=1)[0]
        if s.cursor >= len(s.order):
            s.epoch += 1
            self._shuffle(s)
        row = s.rows[s.order[s.cursor]]
        s.cursor += 1
        return s, row

    def state(self) -> dict:
        st = self.rng.getstate()
        return {
            "rng": [st[0], list(st[1]), st[2]],
            "envs": {s.name: {"epoch": s.epoch, "cursor": s.cursor} for s in self.slots},
        }

    def load_state(self, state: dict) -> None:
        v, internal, gauss = state["rng"]
        self.rng.setstate((v, tuple(internal), gauss))
        for s in self.slots:
            e = state["envs"].get(s.name)
            if e:
                s.epoch = int(e["epoch"])
                self._shuffle(s)
                s.cursor = int(e["cursor"])


def dataset_rows(dataset: Any, limit: Optional[int] = None) -> list[dict]:
    n = len(dataset) if limit is None else min(limit, len(dataset))
    return [dict(dataset[i]) for i in range(n)]


def load_slots(
    entries: list[EnvEntry],
    kind: str,
    num_examples: Optional[int] = None,
    pylib: Optional[Path] = None,
    where: str = "orchestrator.env",
) -> list[EnvSlot]:
    """Each entry of `kind` ("train" or "eval") loaded, with its formatted dataset (of an
    eval env its eval set, the first `num_examples` of it when given); two entries of one
    name are refused. With `pylib` (`config.env_kinds.package_path`) an entry may also be
    a v1 taskset or name another Python (`config.env_kinds.detect`): such a slot is only
    named here, its env loaded by its server (`EnvSlot.in_server_only`)."""
    slots: list[EnvSlot] = []
    for i, entry in enumerate(entries):
        name = env_name(entry)
        if any(s.name == name for s in slots):
            raise UserError(f"two {kind} envs are named {name!r}: give one a `name`")
        if pylib is not None:
            from prime_hpc.config.env_kinds import CLASSIC, CLASSIC_RENDERER, detect

            found = detect(entry.id, entry.python, pylib, f"{where}.{i}")
            if found.kind == CLASSIC and entry.renderer is not None:
                raise UserError(f"{where}.{i}.renderer: {CLASSIC_RENDERER}")
            if found.kind != CLASSIC or found.python is not None:
                slots.append(EnvSlot(name=name, entry=entry, env=None, rows=[], kind=found.kind, python=found.python))
                continue
        env = load_env(entry, kind)
        ds = env.get_dataset() if kind == "train" else env.get_eval_dataset(n=num_examples or -1)
        slots.append(EnvSlot(name=name, entry=entry, env=env, rows=dataset_rows(ds)))
    return slots
