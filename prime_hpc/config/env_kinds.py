"""Which kind of environment an entry names, and which Python runs it.

Two kinds: a classic verifiers environment (`load_environment(**args)`, the verifiers
release the run's own venv has) and a verifiers v1 taskset (a module whose `__all__`
exports one `Taskset`, verifiers >= 0.4). One venv cannot hold both releases, so a v1
taskset always runs in an env server (`prime_hpc.envserver`) whose workers run under
another interpreter:

- `env[i].python` when given (any interpreter with the env and its verifiers installed);
- else, for an id the run's own Python cannot run: `$PRIME_HPC_ENVS_PYTHON`, else the
  `.venv-envs` that `tools/setup` builds beside the run's venv (verifiers 0.4 and the
  v1 examples).

`detect(entry)` decides in this order: with `python` given, that interpreter is asked
(`probe.py`); else an id the run's Python resolves whose module has `load_environment` is
classic (loaded as before, in process or in a server of the run's Python); anything else
is asked of the envs' Python. The answer says why an id is neither, in one line.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from prime_hpc.core.errors import UserError

CLASSIC, V1 = "classic", "v1"
ENVS_PYTHON_VAR = "PRIME_HPC_ENVS_PYTHON"
PROBE_TIMEOUT_S = 120.0  # importing an env and verifiers on a busy login node


@dataclass(frozen=True)
class EnvKind:
    kind: str  # CLASSIC or V1
    python: Optional[str]  # the interpreter of its server's workers; None: the run's own
    module: str = ""
    taskset: str = ""  # a v1 taskset's class name


def envs_python() -> Optional[str]:
    """The interpreter of v1 tasksets without `python`: `$PRIME_HPC_ENVS_PYTHON`, else
    `.venv-envs/bin/python` beside the run's venv when it exists."""
    given = os.environ.get(ENVS_PYTHON_VAR)
    if given:
        return given
    beside = Path(sys.prefix).parent / ".venv-envs" / "bin" / "python"
    return str(beside) if beside.exists() else None


def package_path(where: Path) -> Path:
    """A directory holding only a link to this package (`<where>/pylib/prime_hpc`): the
    path another interpreter gets, so it imports prime-hpc's own modules and nothing else
    of the run's venv."""
    return package_link(where / "pylib")


def package_link(pylib: Path) -> Path:
    """`pylib` holding only the link to this package (`usercache.private_tree`)."""
    import prime_hpc
    from prime_hpc.core.usercache import private_tree

    pylib = private_tree(pylib)
    link = pylib / "prime_hpc"
    target = Path(prime_hpc.__file__).resolve().parent
    if not (link.is_symlink() and Path(os.readlink(link)) == target):
        tmp = pylib / f".prime_hpc.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(target)
        os.replace(tmp, link)
    return pylib


def python_env(pylib: Path, base: Optional[dict] = None) -> dict:
    """The environment another interpreter runs prime-hpc's modules in: `pylib` first on
    its path, nothing of the run's venv (`PYTHONHOME`, its `PYTHONPATH`)."""
    env = dict(os.environ if base is None else base)
    env.pop("PYTHONHOME", None)
    env["PYTHONPATH"] = str(pylib)
    env.pop("VIRTUAL_ENV", None)
    return env


def probe(env_id: str, python: str, pylib: Path, timeout_s: float = PROBE_TIMEOUT_S) -> dict:
    """`probe.py`'s answer for `env_id` under `python` (`{"kind": None, "error"}` when the
    interpreter cannot be run or answers nothing)."""
    if not os.access(python, os.X_OK):
        return {"kind": None, "error": f"{python}: no such interpreter (not an executable file)"}
    pylib = package_link(pylib)  # made here, when some env needs asking, not by every caller
    try:
        r = subprocess.run(
            [python, "-P", "-m", "prime_hpc.envserver.probe", env_id],  # -P: nothing from the working directory
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=python_env(pylib),
        )
    except subprocess.TimeoutExpired:
        return {"kind": None, "error": f"{python} did not answer within {timeout_s:.0f} s importing it"}
    lines = [x for x in r.stdout.splitlines() if x.strip()]
    try:
        answer = json.loads(lines[-1])
    except (IndexError, ValueError):
        tail = [x for x in r.stderr.splitlines() if x.strip()]
        return {"kind": None, "error": f"{python} failed (exit {r.returncode}): {tail[-1] if tail else 'no output'}"}
    return answer if isinstance(answer, dict) else {"kind": None, "error": f"{python} answered {answer!r}"}


CLASSIC_RENDERER = (
    "a classic env's turns are rendered by the model's chat template (vLLM's chat endpoint, "
    "inference.model.tool_call_parser for its tool calls); renderer is for a verifiers v1 task set"
)


def classic_here(env_id: str) -> Optional[str]:
    """The module name when the run's own Python resolves `env_id` to a module with
    `load_environment` (imported to look), else None."""
    from prime_hpc.config.env_ids import UnknownEnv, import_env_module, resolve

    try:
        resolve(env_id)
    except UnknownEnv:
        return None
    try:
        module = import_env_module(env_id)
    except Exception:
        return None
    return module.__name__ if callable(getattr(module, "load_environment", None)) else None


def detect(env_id: str, python: Optional[str], pylib: Path, where: str = "env") -> EnvKind:
    """The kind of `env_id` and the interpreter that runs it (see the module's doc);
    `UserError` naming `where` (`orchestrator.env.0`, ...) when it is neither kind."""
    if python is None:
        module = classic_here(env_id)
        if module is not None:
            return EnvKind(CLASSIC, None, module)
        python = envs_python()
        if python is None:
            from prime_hpc.config.env_ids import import_error

            why = import_error(env_id) or f"{env_id!r} has no load_environment()"
            raise UserError(
                f"{where}: {why}; for a verifiers v1 taskset set {where}.python (or ${ENVS_PYTHON_VAR}) to a "
                "Python with verifiers >= 0.4 and the taskset installed (tools/setup builds .venv-envs)"
            )
    answer = probe(env_id, python, pylib)
    if answer.get("kind") in (CLASSIC, V1):
        return EnvKind(str(answer["kind"]), python, str(answer.get("module") or ""), str(answer.get("taskset") or ""))
    raise UserError(f"{where}: {env_id!r} under {python}: {answer.get('error')}")


def ask(env_id: str, python: Optional[str] = None) -> tuple[Optional[str], dict]:
    """(the interpreter asked, `probe`'s answer) about `env_id` outside a run (submit,
    doctor, eval and synthesize jobs): `python`, else the envs' Python, with prime-hpc's
    path in the user's own cache; (None, {}) when there is no such interpreter."""
    interpreter = python or envs_python()
    if interpreter is None:
        return None, {}
    return interpreter, dict(_asked(env_id, interpreter))


@functools.lru_cache(maxsize=64)
def _asked(env_id: str, interpreter: str) -> dict:
    """`probe`'s answer, once per id and interpreter in this process (a submit asks of a
    task set for its train and its eval entries: one interpreter start, seconds, not two)."""
    from prime_hpc.core import usercache

    return probe(env_id, interpreter, package_path(usercache.path("envs")))


def submit_error(env_id: str, python: Optional[str], where: str, here: Optional[str]) -> Optional[str]:
    """Why an entry cannot run (None if it can), checked at submit for an id the run's own
    Python does not resolve (`here`: why) or that names a `python`: the interpreter that
    would run it is asked (the one import it costs is paid by such entries only)."""
    interpreter, answer = ask(env_id, python)
    if interpreter is None:
        return (
            f"{here}; for a verifiers v1 task set set {where}.python (or ${ENVS_PYTHON_VAR}) to a Python with "
            "verifiers >= 0.4 and the task set installed (tools/setup builds .venv-envs)"
        )
    if answer.get("kind") in (CLASSIC, V1):
        return None
    if here is not None and str(answer.get("error", "")).startswith("UnknownEnv"):
        return f"{here}; nor is it installed for {interpreter}"
    return f"{env_id!r} under {interpreter}: {answer.get('error')}"
