"""An env server: one env entry of a run, in a process of its own, its groups run by
`workers` worker processes (`worker.py`).

Consumes a spec (JSON, `--spec`): the entry, its kind ("train"/"eval"), the attempt's logs
directory, where to publish its endpoint, the worker count, the policy client's base URL
(`worker.policy_client`). The job's key comes from `$INFERENCE_SERVER_API_KEY`.
Produces: an HTTP/JSON listener on 127.0.0.1 (a port the OS picks), published with its
`url`, `pid` and `instance` in the endpoint file (0600, in a directory only its owner can
change); every route but `/health` and `/identity` takes the job's key as a bearer or a
request signed for this instance (`inference.gate.ApiKey`), else 401:

- `GET /info`: `{"env", "kind": "classic", "rows", "example_ids", "workers"}`;
- `POST /group` `{"row" | "index", "kind", "n", "model", "sampling", "seq_len",
  "strategy"}`: `{"rollouts": [...]}` (`orchestrator.wire`); 502 `{"error"}` when the
  worker running it died (the group is lost, the worker restarted); 503 `{"error",
  "fatal": true}` once workers died more than `MAX_RESTARTS` times: the env is done.

A request goes to the ready worker with the fewest groups in flight. A worker that dies is
restarted, at most `MAX_RESTARTS` times in all, each said in the server's log. The server
ends when its stdin closes (the orchestrator is gone) or on SIGTERM, and ends its
workers by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

from loguru import logger

from prime_hpc.core.jobenv import ENV_POLICY_KEY_VAR as POLICY_KEY_VAR
from prime_hpc.envserver.relay import PATHS as RELAY_PATHS
from prime_hpc.envserver.relay import READ_PATHS as RELAY_READ_PATHS
from prime_hpc.envserver.relay import TOKEN_VAR, PolicyRelay
from prime_hpc.inference.gate import ApiKey, answer_identity, read_body, send_json
from prime_hpc.rundir import last_line, logtree

MAX_RESTARTS = 3  # worker restarts an env server makes in all before its env fails the run
STOP_GRACE_S = 5.0  # a worker asked to stop (SIGTERM) has this long before SIGKILL


CANNOT_RUN = 2  # a worker's exit status when it cannot run the env at all (said in its log): not restarted


class WorkerDied(Exception):
    pass


class EnvError(Exception):
    """A worker could not run a group at all (its env failed before any rollout)."""


class Worker:
    """One worker process and the groups it runs (`pending`, by request id)."""

    def __init__(self, wid: int) -> None:
        self.wid = wid
        self.proc: Optional[asyncio.subprocess.Process] = None
        self.pending: dict[int, asyncio.Future] = {}
        self.ready = False

    @property
    def busy(self) -> int:
        return len(self.pending)


class EnvServer:
    def __init__(self, spec: dict) -> None:
        self.spec = spec
        self.name = spec["name"]
        self.kind = spec["kind"]
        self.logs = Path(spec["logs"])
        self.workers = [Worker(i) for i in range(int(spec["workers"]))]
        self.restarts = 0
        self.fatal: Optional[str] = None
        self.changed = asyncio.Event()  # a worker became ready, or the server failed
        self.ids = 0
        self.rows: list[dict] = []
        self.closing = False
        self.served = 0  # groups answered
        self.v1 = spec.get("env_kind") == "v1"
        self.python = spec.get("python") or sys.executable
        self.relay = PolicyRelay(spec["client"], os.environ.get(POLICY_KEY_VAR)) if self.v1 else None

    # ------------------------------------------------------------------ workers
    def worker_log(self, w: Worker) -> Path:
        return logtree.env_worker_log(self.logs, self.kind, self.name, w.wid)

    async def start_worker(self, w: Worker) -> None:
        log = open(self.worker_log(w), "ab")
        try:
            w.proc = await asyncio.create_subprocess_exec(
                self.python,
                "-u",
                *(["-P"] if self.spec.get("pylib") else []),  # another Python: nothing from the working directory
                "-m",
                "prime_hpc.envserver.v1worker" if self.v1 else "prime_hpc.envserver.worker",
                "--spec",
                json.dumps(self.spec),
                "--id",
                str(w.wid),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                limit=1 << 26,
                env=self.worker_env(),
            )
        finally:
            log.close()
        w.ready = False
        logger.info(f"env {self.name}: worker {w.wid} started (pid {w.proc.pid}), log {self.worker_log(w)}")
        asyncio.create_task(self.read_worker(w, w.proc))

    def worker_env(self) -> Optional[dict]:
        """A worker's environment: the run's, for a worker of the run's own Python; under
        another interpreter only prime-hpc's own modules on its path (`config.env_kinds.python_env`),
        and a v1 worker holds the relay's token instead of the job's key."""
        if self.spec.get("python") is None and not self.v1:
            return None
        from prime_hpc.config.env_kinds import python_env
        from prime_hpc.inference.client import API_KEY_VAR

        env = python_env(Path(self.spec["pylib"]))
        if self.relay is not None:
            env.pop(API_KEY_VAR, None)
            env.pop(POLICY_KEY_VAR, None)
            env[TOKEN_VAR] = self.relay.token
        return env

    async def read_worker(self, w: Worker, proc: asyncio.subprocess.Process) -> None:
        """Answers of `w` to their requests, until it dies; then restart it (bounded)."""
        assert proc.stdout is not None
        while line := await proc.stdout.readline():
            msg = json.loads(line)
            if msg.get("ready"):
                w.ready = True
                if "rows" in msg and not self.rows:  # the env's tasks, as the worker loaded them
                    self.rows = list(msg["rows"])
                logger.info(f"env {self.name}: worker {w.wid} ready")
                self.changed.set()
                continue
            fut = w.pending.pop(int(msg["id"]), None)
            if fut is not None and not fut.done():
                if "error" in msg:
                    fut.set_exception(EnvError(str(msg["error"])))
                else:
                    fut.set_result(msg.get("rollouts", msg.get("episodes")))
        rc = await proc.wait()
        was_ready, w.ready = w.ready, False
        if self.closing:
            return
        said = last_line(self.worker_log(w))
        why = f"worker {w.wid} (pid {proc.pid}) died (exit {rc}; see {self.worker_log(w)}){': ' + said if said else ''}"
        for fut in w.pending.values():
            if not fut.done():
                fut.set_exception(WorkerDied(why))
        w.pending.clear()
        if rc == CANNOT_RUN and not was_ready:  # it said why it cannot run the env: another try would too
            self.fatal = why
            logger.error(f"env {self.name}: {why}")
            self.changed.set()
            return
        if self.restarts >= MAX_RESTARTS:
            self.fatal = f"{why}, after {MAX_RESTARTS} restarts"
            logger.error(f"env {self.name}: {self.fatal}: no more restarts")
            self.changed.set()
            return
        self.restarts += 1
        logger.warning(f"env {self.name}: {why}; restarting it ({self.restarts} of {MAX_RESTARTS} restarts)")
        await self.start_worker(w)

    async def run_group(self, req: dict) -> list[dict]:
        """The rollouts (JSON) of the request, by the least busy ready worker."""
        while True:
            if self.fatal:
                raise RuntimeError(self.fatal)
            ready = [w for w in self.workers if w.ready]
            if ready:
                break
            self.changed.clear()
            await self.changed.wait()
        w = min(ready, key=lambda x: x.busy)
        self.ids += 1
        fut = asyncio.get_running_loop().create_future()
        w.pending[self.ids] = fut
        assert w.proc is not None and w.proc.stdin is not None
        w.proc.stdin.write((json.dumps({**req, "id": self.ids}) + "\n").encode())
        await w.proc.stdin.drain()
        return await fut

    async def stop_workers(self) -> None:
        """End every worker by its PID: SIGTERM, SIGKILL after `STOP_GRACE_S`."""
        self.closing = True
        for w in self.workers:
            p = w.proc
            if p is None or p.returncode is not None:
                continue
            try:
                p.send_signal(signal.SIGTERM)
                await asyncio.wait_for(p.wait(), STOP_GRACE_S)
            except (ProcessLookupError, asyncio.TimeoutError):
                if p.returncode is None:
                    p.kill()
                    await p.wait()

    # ------------------------------------------------------------------ HTTP
    async def app(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        path = scope.get("path", "")
        if path == "/identity":
            return await answer_identity(self.key, scope, send, self.me)
        if self.relay is not None and (
            (path in RELAY_PATHS and scope.get("method") == "POST")
            or (path in RELAY_READ_PATHS and scope.get("method") == "GET")
        ):
            if not self.relay.allows(scope):  # the workers' token, nobody else's
                return await self.key.refuse(send)
            return await self.relay.forward(scope, receive, send)
        admitted = await self.key.admit(scope, receive, send, self.me)
        if admitted is None:
            return await self.key.refuse(send)
        receive, send = admitted
        if path == "/health":
            return await send_json(send, 200, {"ok": self.fatal is None})
        if path == "/info" and scope.get("method") == "GET":
            return await send_json(send, 200, self.info())
        if path == "/rows" and scope.get("method") == "GET":
            return await send_json(send, 200, {"rows": self.rows})
        if path == "/group" and scope.get("method") == "POST":
            _, req = await read_body(receive)
            return await self.answer_group(send, req)
        return await send_json(send, 404, {"error": f"no route {scope.get('method')} {path}"})

    def info(self) -> dict:
        return {
            "env": self.name,
            "kind": "v1" if self.v1 else "classic",
            "split": self.kind,
            "rows": len(self.rows),
            "example_ids": [r.get("example_id") for r in self.rows],
            "workers": len(self.workers),
            "restarts": self.restarts,
        }

    async def answer_group(self, send: Any, req: Optional[dict]) -> None:
        if not isinstance(req, dict) or ("row" not in req and "index" not in req):
            return await send_json(send, 400, {"error": "send a JSON object with `row` or `index`"})
        if "row" not in req:
            i = req.pop("index")
            if not isinstance(i, int) or not 0 <= i < len(self.rows):
                return await send_json(send, 400, {"error": f"index {i!r} is not one of 0..{len(self.rows) - 1}"})
            req["row"] = self.rows[i]
        if self.v1:
            req["index"] = req["row"].get("index")
        try:
            rollouts = await self.run_group(req)
        except WorkerDied as e:
            return await send_json(send, 502, {"error": str(e)})
        except EnvError as e:
            return await send_json(send, 422, {"error": str(e)})
        except RuntimeError as e:
            return await send_json(send, 503, {"error": str(e), "fatal": True})
        if self.v1:
            rollouts = self.episodes_to_rollouts(rollouts, req)
        self.served += 1
        await send_json(send, 200, {"rollouts": rollouts})

    def episodes_to_rollouts(self, episodes: list[dict], req: dict) -> list[dict]:
        """A v1 group's episodes as rollouts (JSON), each stamped first with the policy span
        its model calls were answered under (`PolicyRelay.span`, by its traces' sessions)."""
        from prime_hpc.orchestrator.episodes import episode_rollouts, episode_sessions, stamp_policy
        from prime_hpc.orchestrator.wire import group_to_json

        assert self.relay is not None
        out = []
        for ep in episodes:
            span = self.relay.span(episode_sessions(ep))
            if span is not None:
                stamp_policy(ep, *span)
            out += episode_rollouts(ep, self.name, int(req["seq_len"]), str(req["strategy"]))
        return group_to_json(out)

    # ------------------------------------------------------------------ life
    async def main(self) -> None:
        import uvicorn

        from prime_hpc.config.schema import EnvEntry
        from prime_hpc.inference.client import api_key
        from prime_hpc.orchestrator.envs import dataset_rows, load_env

        self.key = ApiKey(api_key())
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        self.me = {"url": f"http://127.0.0.1:{port}", "instance": secrets.token_hex(16), "pid": os.getpid()}
        self.spec["relay_url"] = self.me["url"]  # a v1 worker's policy base (`relay.PolicyRelay`)
        if self.spec.get("python") is None and not self.v1:  # the env in this Python: its rows from here
            env = load_env(EnvEntry(**self.spec["entry"]), self.kind)
            n = self.spec.get("num_examples")
            ds = env.get_dataset() if self.kind == "train" else env.get_eval_dataset(n=n or -1)
            self.rows = dataset_rows(ds)
        for w in self.workers:
            await self.start_worker(w)
        if not self.rows:  # the first worker's, once it loaded the env
            await self.until_rows()
        config = uvicorn.Config(self.app, interface="asgi3", log_level="warning", lifespan="off", timeout_keep_alive=60)
        server = uvicorn.Server(config)
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not serving.done():
            await asyncio.sleep(0.01)
        publish(Path(self.spec["endpoint"]), self.me)
        logger.info(
            f"env {self.name}: serving {len(self.rows)} rows at {self.me['url']} with {len(self.workers)} workers"
        )
        try:  # its own signal handlers, in place of uvicorn's (installed once it started)
            await self.until_told_to_stop()
        finally:
            server.should_exit = True
            await self.stop_workers()
            if self.relay is not None:
                await self.relay.aclose()
            await asyncio.gather(serving, return_exceptions=True)
            Path(self.spec["endpoint"]).unlink(missing_ok=True)
            logger.info(f"env {self.name}: stopped after {self.served} groups")

    async def until_rows(self) -> None:
        """Until a worker said it is ready with the env's rows; `UserError` when the workers
        died past their restarts first (the last worker log names why)."""
        from prime_hpc.core.errors import UserError

        while not self.rows:
            if self.fatal:
                raise UserError(f"env {self.name}: no worker loaded the env: {self.fatal}")
            if any(w.ready for w in self.workers):
                raise UserError(f"env {self.name}: its worker loaded no tasks (an empty dataset?)")
            self.changed.clear()
            await self.changed.wait()

    async def until_told_to_stop(self) -> None:
        """Until stdin closes (the orchestrator is gone) or SIGTERM/SIGINT comes."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for s in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(s, stop.set)
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

        async def parent_gone() -> None:
            await reader.read()
            logger.info(f"env {self.name}: the orchestrator is gone")
            stop.set()

        watch = asyncio.create_task(parent_gone())
        await stop.wait()
        watch.cancel()


def publish(path: Path, me: dict) -> None:
    """`me` into `path` (0600), in a directory only this user can change (else `Untrusted`)."""
    from prime_hpc.core.usercache import private_dir
    from prime_hpc.rundir.files import atomic_write_bytes

    private_dir(path.parent)
    atomic_write_bytes(path, json.dumps(me).encode(), durable=False, mode=0o600)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m prime_hpc.envserver")
    p.add_argument("--spec", required=True, help="the env server's spec (JSON)")
    a = p.parse_args(argv)
    spec = json.loads(a.spec)
    logger.remove()
    logger.add(sys.stderr, format="{time:YYYY-MM-DD HH:mm:ss} {level} env_server: {message}", level="INFO")
    from prime_hpc.core.errors import UserError

    try:
        asyncio.run(EnvServer(spec).main())
    except UserError as e:
        logger.error(str(e))
        sys.exit(2)
