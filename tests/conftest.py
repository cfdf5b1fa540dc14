"""Shared fixtures. Every test that starts a process or a job cleans it up itself."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Things tests must never reach for at run time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
# One shared cache for the whole session (built tiny models, vLLM's compile cache), as runs
# on a cluster share theirs: a server's later starts reuse what the first one compiled.
os.environ.setdefault("PRIME_HPC_CACHE", str(Path.home() / ".cache" / "prime-hpc"))
# The user's own cache (compiled job templates, composed configs) is private to this test
# session: tests neither read nor leave anything in the real one.
_XDG = tempfile.mkdtemp(prefix="prime-hpc-tests-xdg-")
os.environ["XDG_CACHE_HOME"] = _XDG
atexit.register(shutil.rmtree, _XDG, ignore_errors=True)
# Every "node" is this machine: everything stays on loopback.
os.environ.setdefault("PRIME_HPC_NODE_ADDRESS", "127.0.0.1")
# The tests' own environments (tests/envs), and the bundled ones from the source tree when
# they are not installed (`tools/setup` installs them with -e).
sys.path.insert(0, str(REPO / "tests" / "envs"))
# the classic examples, importable here as the run's Python has them; a v1 task set lives in
# .venv-envs only (verifiers 0.4), never on the run's path
V1_EXAMPLES = {"reverse_text_v1", "word_lookup_v1"}
sys.path += [str(p) for p in sorted((REPO / "examples").iterdir()) if p.is_dir() and p.name not in V1_EXAMPLES]

# Shell-hostile path fragments (spaces, quotes, command separators, substitutions).
HOSTILE = "we ird 'q\" ; echo PWNED $(touch PWNED) `x` & y"


# ----------------------------------------------------------------------------- the dev cluster
_STARTED = pytest.StashKey[bool]()


def _cluster_answers() -> bool:
    if shutil.which("sinfo") is None:
        return False
    try:
        return subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, timeout=20).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def pytest_collection_finish(session: pytest.Session) -> None:
    """Integration tests need the dev cluster: when it is not running, start it for this
    session (and stop it at the end); a cluster that was already up is left alone."""
    if not any(Path(str(item.fspath)).parent.name == "integration" for item in session.items):
        return
    if _cluster_answers():
        return
    print("\n[tests] the dev cluster is not running: starting it (tools/dev-cluster start)", flush=True)
    r = subprocess.run([str(REPO / "tools" / "dev-cluster"), "start"], capture_output=True, text=True)
    if r.returncode != 0:
        print(
            f"[tests] could not start the dev cluster (exit {r.returncode}): {(r.stderr or r.stdout).strip()}",
            flush=True,
        )
        return
    session.config.stash[_STARTED] = True


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(_XDG, ignore_errors=True)
    if session.config.stash.get(_STARTED, False):
        subprocess.run([str(REPO / "tools" / "dev-cluster"), "stop"], capture_output=True, text=True)


@pytest.fixture(autouse=True)
def _isolated_state(tmp_path_factory, monkeypatch):
    """Each test gets its own job index (the user's state dir)."""
    monkeypatch.setenv("PRIME_HPC_STATE_DIR", str(tmp_path_factory.mktemp("state")))


def cli(
    *args: str, cwd: Path | None = None, timeout: float = 600, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run the real `prime-hpc` entry point in a subprocess."""
    return subprocess.run(
        [sys.executable, "-m", "prime_hpc.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd or REPO,
        env={**os.environ, **(env or {})},
    )


def hydra_quote(value: str) -> str:
    """Quote a value for a Hydra override (double quotes, escaped)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


@pytest.fixture(scope="session")
def inference(tmp_path_factory):
    """Two of the run's real inference servers (node ranks 0, 1) and the router, with an
    API key, serving the tiny model (float32), started ready to receive weights by
    broadcast too (`weights.transport=broadcast`: they still load from disk). Shared by
    every test that generates; tests that change the policy put the base weights back."""
    from tests.inference_util import start_inference

    inf = start_inference(tmp_path_factory.mktemp("inference"), nodes=2, overrides=["weights.transport=broadcast"])
    try:
        yield inf
    finally:
        inf.stop_all()
