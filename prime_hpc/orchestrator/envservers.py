"""The orchestrator's side of env servers (`prime_hpc.envserver.server`).

`EnvServerProcess.start` starts the server of one env entry as a child of the orchestrator
(its stdin a pipe only the orchestrator holds: the server ends when the orchestrator does),
logging to `logs/<attempt>/envs/<kind>/<env>/env_server.log`, and waits until it publishes
its endpoint (`private/envservers/<kind>-<env>.json`, 0600). `group` asks it for one group,
signed for its instance with the job's key (`inference.gate.Proofs`) and taking the answer
only with its proof. `RemoteGenerator` is a `Generator` whose slots with a server
(`EnvSlot.server`) generate there: the same groups, spans and errored groups as in process.
A server that is gone, or whose workers died past its restarts, fails the run:
`EnvFailed`, one line naming the env and its log.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Optional

from prime_hpc.config.schema import EnvEntry
from prime_hpc.core.jobenv import ENV_POLICY_KEY_VAR as POLICY_KEY_VAR
from prime_hpc.orchestrator.envs import EnvFailed, EnvSlot, env_name
from prime_hpc.orchestrator.generate import Generator, errored_group, sampling_args
from prime_hpc.orchestrator.rollouts import Rollout
from prime_hpc.orchestrator.wire import group_from_json
from prime_hpc.rundir import RunDir, last_line, logtree

START_TIMEOUT_S = 600.0  # a server's env load and first worker
STOP_GRACE_S = 10.0


def client_spec(base_url: Any, max_context: Optional[int], timeout_s: float) -> dict:
    """What a worker needs to rebuild the orchestrator's policy client toward `base_url`."""
    link = getattr(base_url, "link", None)
    return {
        "url": str(base_url),
        "router_json": str(link.path) if link is not None else None,
        "max_context": max_context,
        "timeout_s": timeout_s,
    }


def server_log(logs: Path, kind: str, env: str) -> Path:
    return logtree.env_log_dir(logs, kind, env) / "env_server.log"


class EnvServerProcess:
    """One running env server, started by `start`; `close` ends it (by PID)."""

    def __init__(self, name: str, kind: str, proc: subprocess.Popen, log: Path, endpoint: Path, key: str) -> None:
        from prime_hpc.inference.gate import Proofs

        self.name, self.kind, self.proc, self.log, self.endpoint = name, kind, proc, log, endpoint
        self.proofs = Proofs(key)
        self.me: dict = {}
        self.http: Any = None
        self.http_loop: Optional[asyncio.AbstractEventLoop] = None
        self.sent: dict[object, float] = {}  # the groups asked for and not answered: when each was sent

    @classmethod
    def start(
        cls,
        entry: EnvEntry,
        kind: str,
        run: RunDir,
        logs: Path,
        client: dict,
        vf_level: str = "warning",
        num_examples: Optional[int] = None,
        policy_key: Optional[str] = None,
        timeout_s: float = START_TIMEOUT_S,
        env_kind: str = "classic",
        python: Optional[str] = None,
        tokenizer: Optional[str] = None,
    ) -> "EnvServerProcess":
        """The server of `entry`, once it serves (`EnvFailed` naming its log when it dies
        first); `policy_key`: the policy endpoint's key where it is not the job's;
        `env_kind` "v1" (a verifiers v1 taskset) or `python` (another interpreter): its
        workers run under that interpreter, a v1 taskset's rendering with `tokenizer`."""
        import os
        import secrets
        from dataclasses import asdict

        from prime_hpc.core import usercache
        from prime_hpc.inference.client import API_KEY_VAR, api_key

        # the job's key in a job; outside one (`prime-hpc eval`/`synthesize` from a login
        # node) one made for this server alone, which only it and this process hold
        key = api_key() or secrets.token_urlsafe(32)
        name = env_name(entry)
        log = server_log(logs, kind, name)
        log.parent.mkdir(parents=True, exist_ok=True)
        # a run's private/, or that of an eval's or synthesize's own directory
        endpoint = usercache.private_tree(run.private_dir / "envservers") / f"{kind}-{name}.json"
        endpoint.unlink(missing_ok=True)
        spec = {
            "entry": asdict(entry),
            "name": name,
            "kind": kind,
            "logs": str(logs),
            "endpoint": str(endpoint),
            "workers": max(1, entry.workers),
            "client": client,
            "vf_level": vf_level,
            "num_examples": num_examples,
            "env_kind": env_kind,
            "python": python,
            "tokenizer": tokenizer,
        }
        if env_kind != "classic" or python is not None:
            from prime_hpc.config.env_kinds import package_path

            spec["python"] = python
            spec["pylib"] = str(package_path(run.private_dir / "envservers"))
        env = {**os.environ, API_KEY_VAR: key}
        if policy_key:
            env[POLICY_KEY_VAR] = policy_key
        with open(log, "ab") as f:
            proc = subprocess.Popen(
                [sys.executable, "-u", "-m", "prime_hpc.envserver", "--spec", json.dumps(spec)],
                stdin=subprocess.PIPE,
                stdout=f,
                stderr=subprocess.STDOUT,
                env=env,
            )
        server = cls(name, kind, proc, log, endpoint, key)
        try:
            server.wait_published(timeout_s)
        except BaseException:
            server.close()
            raise
        return server

    def wait_published(self, timeout_s: float) -> None:
        """Until the server publishes its endpoint (its own pid in it)."""
        from prime_hpc.rundir.files import read_json

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise self.failed(
                    f"its env server exited ({self.proc.returncode}) before serving: {last_line(self.log, 16384, cut=None)}"
                )
            try:
                me = read_json(self.endpoint)
            except (OSError, ValueError):
                me = None
            if isinstance(me, dict) and me.get("pid") == self.proc.pid:
                self.me = me
                return
            time.sleep(0.05)
        raise self.failed(f"its env server did not serve within {timeout_s:.0f} s")

    # ------------------------------------------------------------------ requests
    def failed(self, why: str) -> EnvFailed:
        return EnvFailed(f"{self.kind} env {self.name}: {why}; see {self.log}", self.log)

    async def info(self) -> dict:
        return await self._call("GET", "/info", b"")

    async def rows(self) -> list[dict]:
        """The env's tasks as its server loaded them (`example_id`, `index`, `prompt`, ...)."""
        return list((await self._call("GET", "/rows", b""))["rows"])

    async def group(self, body: dict) -> tuple[int, dict]:
        """(status, answer) of `POST /group` with `body`."""
        token = object()
        self.sent[token] = time.time()
        try:
            return await self._call_status("POST", "/group", json.dumps(body).encode())
        finally:
            del self.sent[token]

    def waited(self) -> Optional[dict]:
        """What the orchestrator waits for here, for its heartbeat (the watchdog names the
        server of a stall): this env's groups asked for and not answered, since when the
        oldest was sent, and the server's log; None when none is out."""
        if not self.sent:
            return None
        return {
            "env": self.name,
            "kind": self.kind,
            "since": min(self.sent.values()),
            "groups": len(self.sent),
            "log": str(self.log),
        }

    async def _call(self, method: str, path: str, body: bytes) -> dict:
        status, answer = await self._call_status(method, path, body)
        if status != 200:
            raise self.failed(f"{path} answered {status}: {answer.get('error')}")
        return answer

    async def _call_status(self, method: str, path: str, body: bytes) -> tuple[int, dict]:
        import httpx

        if self.proc.poll() is not None:
            raise self.failed(f"its env server died (exit {self.proc.returncode})")
        loop = asyncio.get_running_loop()
        if self.http is None or self.http_loop is not loop:  # a client serves the loop it was made on
            self.http, self.http_loop = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0)), loop
        signature = self.proofs.signature(self.me["instance"], method, path, "", body)
        try:
            r = await self.http.request(
                method,
                self.me["url"] + path,
                content=body,
                headers={"authorization": f"prime-hpc-signature {signature}", "content-type": "application/json"},
            )
        except httpx.HTTPError as e:
            rc = self.proc.poll()
            why = f"its env server died (exit {rc})" if rc is not None else f"its env server does not answer ({e})"
            raise self.failed(why) from None
        if not self.proofs.answered(signature, r.headers):
            raise self.failed(f"{self.me['url']} answered without the env server's proof")
        return r.status_code, r.json()

    async def aclose(self) -> None:
        if self.http is not None:
            await self.http.aclose()
            self.http = None
        self.close()

    def close(self) -> None:
        """End the server by its PID (its workers with it): stdin closed, SIGTERM, SIGKILL."""
        p = self.proc
        if p.poll() is None:
            try:
                if p.stdin is not None:
                    p.stdin.close()
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        elif p.stdin is not None:
            p.stdin.close()


class RemoteGenerator(Generator):
    """A `Generator` whose slots with an env server (`EnvSlot.server`) generate there."""

    async def _generate(self, slot: EnvSlot, row: dict, kind: str, n: int) -> list[Rollout]:
        server: Optional[EnvServerProcess] = getattr(slot, "server", None)
        if server is None:
            return await super()._generate(slot, row, kind, n)
        body = {
            "row": row,
            "kind": kind,
            "n": n,
            "model": self.model(),
            "sampling": sampling_args(self.sampling),
            "seq_len": self.seq_len,
            "strategy": self.strategy,
        }
        status, answer = await server.group(body)
        if status == 200:
            return group_from_json(answer["rollouts"])
        if status == 502:  # its worker died mid-group: lost, like a group that raised
            return errored_group(slot.name, row, n, f"WorkerDied: {answer.get('error')}")
        if status == 422:  # the env failed before any rollout of the group
            return errored_group(slot.name, row, n, str(answer.get("error")))
        raise server.failed(str(answer.get("error") or f"/group answered {status}"))


def start_servers(
    slots: dict[str, list[EnvSlot]],
    run: RunDir,
    logs: Path,
    client: dict,
    vf_level: str = "warning",
    num_examples: Optional[int] = None,
    policy_key: Optional[str] = None,
    tokenizer: Optional[str] = None,
) -> list[EnvServerProcess]:
    """A server for each slot (`slots` by kind) whose entry has `workers` >= 1 or that is
    loaded only in its server (`EnvSlot.in_server_only`), set as its `server`; on a
    failure the ones started are ended before it propagates."""
    started: list[EnvServerProcess] = []
    try:
        for kind, of_kind in slots.items():
            for slot in of_kind:
                if slot.entry.workers < 1 and not slot.in_server_only:
                    continue
                n = num_examples if kind == "eval" else None
                slot.server = EnvServerProcess.start(
                    slot.entry,
                    kind,
                    run,
                    logs,
                    client,
                    vf_level,
                    n,
                    policy_key=policy_key,
                    env_kind=slot.kind,
                    python=slot.python,
                    tokenizer=tokenizer,
                )
                started.append(slot.server)
    except BaseException:
        close_servers(started)
        raise
    return started


def start_for(
    slots: dict[str, list[EnvSlot]], run: RunDir, logs: Path, cfg: Any, base_url: Any, policy_key: Optional[str] = None
) -> list[EnvServerProcess]:
    """`start_servers` for a run config `cfg` (`OrchestratorRunConfig`): its workers ask
    the policy at `base_url` (with `policy_key` where that is not the job's key) within the
    run's context and timeout, a v1 task set's rendering with the run's tokenizer."""
    o = cfg.orchestrator
    spec = client_spec(base_url, cfg.seq_len, o.generation_timeout_s)
    tokenizer = None
    if any(s.kind != "classic" for of_kind in slots.values() for s in of_kind):  # v1 renders client-side
        from prime_hpc.model import resolve_model

        tokenizer = str(resolve_model(cfg.model.name, cfg.model.seed))
    return start_servers(
        slots, run, logs, spec, o.log.vf_level, o.eval.num_examples, policy_key=policy_key, tokenizer=tokenizer
    )


@contextlib.contextmanager
def served(
    slots: dict[str, list[EnvSlot]], run: RunDir, logs: Path, cfg: Any, base_url: Any, policy_key: Optional[str] = None
) -> Iterator[list[EnvServerProcess]]:
    """The slots' env servers (`start_for`) with their rows filled, for a job that only
    generates (`eval`, `synthesize`); ended on leaving."""
    servers = start_for(slots, run, logs, cfg, base_url, policy_key)
    try:
        asyncio.run(fill_rows(slots))
        yield servers
    finally:
        close_servers(servers)


async def fill_rows(slots: dict[str, list[EnvSlot]]) -> None:
    """The rows of every slot loaded only in its server, from that server."""
    for of_kind in slots.values():
        for slot in of_kind:
            if slot.in_server_only and slot.server is not None:
                slot.rows = await slot.server.rows()


def close_servers(servers: list[EnvServerProcess]) -> None:
    for s in servers:
        s.close()
