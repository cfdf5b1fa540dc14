"""`python -m prime_hpc.inference.router --config <run>/configs/inference.yaml`: the run's
router, on the head node (where losing it ends the attempt anyway), in front of every
server of the run.

It waits (at most `inference.startup_timeout_s`) until every server of the job has
published `endpoints/inference_<node>.json`, binds this node's address on a port the kernel picks,
and serves that socket from a child process (`Router`, below), which it starts again on
the same socket if it dies, at most `MAX_RESTARTS` times per attempt (connections made
meanwhile wait in the socket's queue); after that it exits with the child's code and the
job ends naming `router`. It publishes `endpoints/router.json` once the router answers
and lives as long as the child does (SIGTERM/SIGINT are passed on).

The router is proven to its own clients as it proves the servers: `router.json` names an
`instance` (a random id the supervisor draws once, kept by every restarted child: the
listening socket is the supervisor's) and the supervisor's pid (`supervisor_pid`), and
the router answers `GET /identity?nonce=<hex>` with its proof for them (`gate.
answer_identity`). Its clients (the orchestrator's generation and weight relay, a teacher
client, a leaving server, `scale`: `client.RouterLink`) prove it before their first request
and after a broken connection, then sign each request for that instance instead of sending
the key (`gate.ApiKey.admit`), and take an answer only with the router's proof. So a
`router.json` that a killed supervisor left behind leads no client to give the key, or
anything it could replay, to whoever binds that port next.

The router is small and checks everything itself: every route but `/health` and
`/identity` needs the job's key (`INFERENCE_SERVER_API_KEY`; without it the router does not
start) or a signature for the router's instance, a request
goes round robin to a server that is up (on a connection error, to the next one), servers
are health-checked every `HEALTH_EVERY_S` and taken out of rotation after
`HEALTH_FAILURES` failures in a row, and requests are forwarded only to servers this run
published in `endpoints/` (`/add_worker` refuses any other address) that proved they hold
the key as the instance they published (`client.challenge`: an HMAC of a fresh nonce, the
key never sent), at admission and at every health check; after a broken connection a
server is proven again before anything more is sent to it. The key itself never leaves
the router: each request it forwards carries a signature for the instance of the server
it goes to instead of the caller's `Authorization` header (`gate.Proofs`), and an answer
is relayed only when it carries that server's proof for the signature (`PROOF_HEADER`):
a listener that took a dead server's port gets no key, proves nothing, and no answer of
its reaches a caller (the request goes to the next server, and it is out of rotation).
Membership is the orchestrator's weight relay's (it adds a server once it loaded the
current policy, and removes one that left); the router also drops a server whose endpoint
file is gone, and a restarted router serves the servers the relay lists as serving
(`fleet/membership.json`). A request that finds no server waits for one (at most
`NO_SERVER_WAIT_S`): while the fleet is being restarted, requests queue here.

Admin routes (key required): `GET /workers` (each server and whether it is up),
`POST /add_worker?url=`, `POST /remove_worker?url=`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Optional
from urllib.parse import parse_qs

from prime_hpc.core import jobenv
from prime_hpc.core.net import IDLE_CONNECTION_S, node_address, url
from prime_hpc.inference.client import NotProven, api_key, challenge, wait_for_servers
from prime_hpc.inference.gate import (
    IDENTITY_PATH,
    PROOF_HEADER,
    ApiKey,
    answer_identity,
    is_preflight,
    send_json,
    signature_header,
)
from prime_hpc.rundir import RunDir, WaitTimeout, atomic_write_json, wait_for
from prime_hpc.rundir.fleet import serving_urls
from prime_hpc.runtime.limits import raise_open_files
from prime_hpc.runtime.stopping import die_with_parent

POLICY = "round_robin"
MAX_RESTARTS = 3  # a router that dies is started again at most this often per attempt
HEALTH_EVERY_S = 5.0  # how often each server's /health is asked
HEALTH_FAILURES = 2  # failed checks in a row that take a server out of rotation
CHECK_TIMEOUT_S = 5.0  # a health check's or an identity challenge's answer
READY_TIMEOUT_S = 120.0  # a (re)started router must answer within this
NO_SERVER_WAIT_S = 600.0  # a request that finds no server waits this long for one to join
# Tries of one request on one server before the next: a connection that breaks once (the
# server closed it as the request went out) is no sign the server is gone; twice is.
TRIES_PER_SERVER = 2
HOP_HEADERS = (b"host", b"content-length", b"transfer-encoding", b"connection", b"keep-alive")
# never relayed from a server: its proof is for the router's signature, not the caller's
ANSWER_DROPPED = (*HOP_HEADERS, PROOF_HEADER.encode())


def published_urls(run: RunDir) -> set[str]:
    """The server URLs this run published (`endpoints/<slot>.json`)."""
    return set(published(run))


def published(run: RunDir) -> dict[str, dict]:
    """The endpoint record of each server URL this run published."""
    return {str(r["url"]): r for r in run.server_endpoints().values() if isinstance(r, dict) and r.get("url")}


class Router:
    """ASGI app: the key (or a signature for `identity`'s instance) on every route but
    liveness and the identity challenge, the admin routes, and every other request
    forwarded as it came (method, path, query, headers, body) to one server that is up,
    its answer streamed back. `identity`: the `url`, `instance` and `pid` it proves to be
    (None: it answers no challenge and takes no signature)."""

    def __init__(
        self,
        workers: list[str],
        key: Optional[str],
        run: Optional[RunDir] = None,
        no_server_wait_s: float = NO_SERVER_WAIT_S,
        identity: Optional[dict] = None,
    ) -> None:
        self.key = ApiKey(key)
        self.identity = identity
        self.no_server_wait_s = no_server_wait_s
        self.workers = list(dict.fromkeys(workers))  # in rotation order
        self.failures = {w: 0 for w in self.workers}  # failed health checks (or connections) in a row
        self.run = run  # where the run's servers are published (None: any address may be added)
        self.verified: dict[str, str] = {}  # server URL -> the instance it proved it is
        self.unproven: set[str] = set()  # server URLs whose listener failed the challenge (said once)
        self._turn = itertools.count()
        self.client: Any = None
        self.checker: Any = None  # health checks and identity challenges (no key, no signature)

    # ------------------------------------------------------------------ membership
    def up(self) -> list[str]:
        return [w for w in self.workers if w in self.verified and self.failures.get(w, 0) < HEALTH_FAILURES]

    def pick(self, tried: set[str]) -> Optional[str]:
        """The next server in turn that is up and not tried yet for this request (if every
        server is down, one not tried yet that proved itself: a health check may just be
        behind). A server that has not proven itself is never picked."""
        for pool in (self.up(), [w for w in self.workers if w in self.verified]):
            candidates = [w for w in pool if w not in tried]
            if candidates:
                return candidates[next(self._turn) % len(candidates)]
        return None

    def add(self, worker: str) -> Optional[str]:
        """Add a server; the reason it is refused, or None."""
        worker = worker.rstrip("/")
        if not worker.startswith(("http://", "https://")):
            return f"{worker!r} is not an http(s) URL"
        if self.run is not None and worker not in published_urls(self.run):
            return f"{worker} is not a server of this run (endpoints/<slot>.json)"
        if worker not in self.workers:
            self.workers.append(worker)
        self.failures[worker] = 0
        return None

    def remove(self, worker: str) -> bool:
        worker = worker.rstrip("/")
        if worker not in self.workers:
            return False
        self.workers.remove(worker)
        self.failures.pop(worker, None)
        self.verified.pop(worker, None)
        return True

    def check_client(self) -> Any:
        import httpx

        if self.checker is None:
            self.checker = httpx.AsyncClient(timeout=CHECK_TIMEOUT_S)
        return self.checker

    async def verify(self, worker: str, records: Optional[dict[str, dict]] = None) -> Optional[str]:
        """`worker` proves it holds the key as the server the run published at its URL
        (`client.challenge`; `records`: the run's endpoints, read now if not given); the
        reason it did not (it is out of rotation until it does), or None."""
        import httpx

        if records is None and self.run is not None:
            records = published(self.run)
        record = records.get(worker) if records is not None else None
        try:
            if self.run is not None and record is None:
                raise NotProven(f"{worker} is not a server of this run (endpoints/<slot>.json)")
            instance = await challenge(self.check_client(), worker, self.key.proofs, record)
        except (NotProven, httpx.HTTPError, ValueError) as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            was = self.verified.pop(worker, None)
            if was is not None or (isinstance(e, NotProven) and worker not in self.unproven):
                print(f"prime-hpc router: {worker} is not routed to: {why}", file=sys.stderr, flush=True)
            if isinstance(e, NotProven):
                self.unproven.add(worker)
            return why
        self.verified[worker] = instance
        self.unproven.discard(worker)
        return None

    def drop_unpublished(self, records: Optional[dict[str, dict]] = None) -> None:
        """Forget the servers whose endpoint file is gone (they left the run; `records`: the
        run's endpoints, read now if not given)."""
        if self.run is None or not self.workers:
            return
        urls = set(records) if records is not None else published_urls(self.run)
        for w in [w for w in self.workers if w not in urls]:
            self.remove(w)

    async def check_health(self) -> None:
        """Ask every server's /health every `HEALTH_EVERY_S` (it needs no key), and have it
        prove who it is (`verify`): a server is up only while it does both."""
        import httpx

        client = self.check_client()
        while True:
            records = published(self.run) if self.run is not None else None
            self.drop_unpublished(records)

            async def one(w: str, records: Optional[dict[str, dict]]) -> None:
                try:
                    ok = (await client.get(w + "/health")).status_code == 200
                except httpx.HTTPError:
                    ok = False
                ok = ok and await self.verify(w, records) is None
                if w in self.failures:
                    self.failures[w] = 0 if ok else self.failures[w] + 1

            await asyncio.gather(*(one(w, records) for w in list(self.workers)))
            await asyncio.sleep(HEALTH_EVERY_S)

    # ------------------------------------------------------------------ requests
    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await self.lifespan(receive, send)
        if scope["type"] != "http":
            return None
        path, method = scope.get("path", ""), scope.get("method", "GET")
        if path == "/health":
            return await send_json(send, 200, {"status": "ok", "workers_up": len(self.up())})
        if path == IDENTITY_PATH:  # open: its proof, for the instance router.json names
            return await answer_identity(self.key, scope, send, self.identity)
        if is_preflight(scope):  # answered here, never forwarded; no cross-origin use is allowed
            await send({"type": "http.response.start", "status": 204, "headers": [(b"content-length", b"0")]})
            return await send({"type": "http.response.body", "body": b""})
        admitted = await self.key.admit(scope, receive, send, self.identity)
        if admitted is None:
            return await self.key.refuse(send)
        receive, send = admitted
        if path in ("/workers", "/list_workers") and method == "GET":
            return await send_json(
                send, 200, {"workers": [{"url": w, "up": w in self.up()} for w in self.workers], "policy": POLICY}
            )
        if path in ("/add_worker", "/remove_worker") and method == "POST":
            return await self.admin(path, scope, send)
        return await self.forward(scope, receive, send)

    async def admin(self, path: str, scope: dict, send: Any) -> None:
        worker = (parse_qs(scope.get("query_string", b"").decode("latin-1")).get("url") or [""])[0]
        if not worker:
            return await send_json(send, 400, {"error": "give the server as ?url=http://host:port"})
        if path == "/add_worker":
            why = self.add(worker)
            if not why and (why := await self.verify(worker.rstrip("/"))):
                self.remove(worker)
            if why:
                return await send_json(send, 403, {"error": f"not added: {why}"})
            return await send_json(send, 200, {"status": "ok", "workers": self.workers})
        if not self.remove(worker):
            return await send_json(send, 404, {"error": f"{worker} is not a server of this router"})
        return await send_json(send, 200, {"status": "ok", "workers": self.workers})

    async def forward(self, scope: dict, receive: Any, send: Any) -> None:
        import httpx

        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        if self.client is None:  # no pool limit: the run's own concurrency bounds it
            self.client = httpx.AsyncClient(
                timeout=None,
                limits=httpx.Limits(
                    max_connections=None, max_keepalive_connections=256, keepalive_expiry=IDLE_CONNECTION_S
                ),
            )
        query = scope.get("query_string", b"").decode("latin-1")
        target = scope["path"] + (f"?{query}" if query else "")
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() not in (*HOP_HEADERS, b"authorization")]
        tried: set[str] = set()
        tries: dict[str, int] = {}
        errors: list[str] = []
        while (worker := await self.next_worker(tried)) is not None:
            tries[worker] = tries.get(worker, 0) + 1
            if (instance := self.verified.get(worker)) is None:  # it failed a challenge meanwhile
                self.out(worker, tried)
                continue
            signature = self.key.proofs.signature(instance, scope["method"], scope["path"], query, body)
            request = self.client.build_request(
                scope["method"],
                worker + target,
                headers=[*headers, (b"authorization", signature_header(signature).encode())],
                content=body,
            )
            try:
                response = await self.client.send(request, stream=True)
            except httpx.TransportError as e:  # nothing was answered: proven again, then again, else the next
                errors.append(f"{worker}: {type(e).__name__}")
                await self.unanswered(worker, tries[worker], tried)
                continue
            if not self.key.proofs.answered(signature, response.headers):  # not the instance signed for
                await response.aclose()
                errors.append(f"{worker}: answered without the proof of the server it was sent to")
                if self.verified.pop(worker, None) is not None:
                    print(f"prime-hpc router: {worker} answered without its proof; not routed to", file=sys.stderr)
                self.out(worker, tried)
                continue
            try:
                aborted = await self.aborted(response)
            except httpx.TransportError as e:  # it died under its answer (SIGKILL): nothing was answered
                await response.aclose()
                errors.append(f"{worker}: {type(e).__name__} in its answer")
                await self.unanswered(worker, tries[worker], tried)
                continue
            if aborted:  # its engine stopped under the request: the next server
                errors.append(f"{worker}: aborted the generation (the server is stopping)")
                print(f"prime-hpc router: {worker} aborted a generation (it is stopping); sent on", file=sys.stderr)
                self.out(worker, tried)
                continue
            return await self.relay(response, send)
        return await send_json(send, 503, {"error": "no inference server answered: " + ("; ".join(errors) or "none")})

    async def unanswered(self, worker: str, tries: int, tried: set[str]) -> None:
        """`worker` did not answer its `tries`-th try of a request (a connection that failed,
        an answer cut short): it gets the request again once proven again, else `out`."""
        if tries >= TRIES_PER_SERVER or await self.verify(worker) is not None:
            self.out(worker, tried)

    def out(self, worker: str, tried: set[str]) -> None:
        """`worker` takes no more of this request, nor any other until a health check finds
        it back (and proven again)."""
        tried.add(worker)
        if worker in self.failures:
            self.failures[worker] = HEALTH_FAILURES

    async def next_worker(self, tried: set[str]) -> Optional[str]:
        """`pick`, waiting (at most `no_server_wait_s`) while no server is left to try: one
        that joins (a restarted server) takes the request."""
        deadline = time.monotonic() + self.no_server_wait_s
        while (worker := self.pick(tried)) is None and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        return worker

    @staticmethod
    async def aborted(response: Any) -> bool:
        """Is the server's answer a generation it aborted (a choice's `finish_reason` is
        "abort": vLLM's engine stopped under the request, as SLURM's SIGTERM to a server's
        step does)? Such an answer is no answer: the request goes to the next server. A
        whole JSON answer is read for it (and kept for `relay`); any other is not read."""
        import json

        kind, encoded = response.headers.get("content-type", ""), response.headers.get("content-encoding")
        if response.status_code != 200 or not kind.startswith("application/json") or encoded:
            return False
        body = await response.aread()
        if b'"abort"' not in body:
            return False
        try:
            choices = json.loads(body).get("choices")
        except (ValueError, AttributeError):
            return False
        if not isinstance(choices, list) or not any(
            isinstance(c, dict) and c.get("finish_reason") == "abort" for c in choices
        ):
            return False
        await response.aclose()
        return True

    @staticmethod
    async def relay(response: Any, send: Any) -> None:
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status_code,
                    "headers": [(k, v) for k, v in response.headers.raw if k.lower() not in ANSWER_DROPPED],
                }
            )
            if response.is_stream_consumed:  # read whole already (`aborted`)
                await send({"type": "http.response.body", "body": response.content})
                return
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await response.aclose()

    async def lifespan(self, receive: Any, send: Any) -> None:
        checker = None
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                checker = asyncio.get_running_loop().create_task(self.check_health())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if checker is not None:
                    checker.cancel()
                for client in (self.client, self.checker):
                    if client is not None:
                        await client.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return


def serve(fd: int, workers: list[str], run: Optional[RunDir], identity: Optional[dict] = None) -> None:
    """Serve the router on the listening socket `fd` until SIGTERM/SIGINT (the child), as
    `identity` (the supervisor's instance, URL and pid)."""
    import uvicorn

    app = Router(workers, api_key(), run, identity=identity)
    config = uvicorn.Config(app, fd=fd, log_level="warning", access_log=False, lifespan="on", timeout_keep_alive=30)
    uvicorn.Server(config).run()


# ----------------------------------------------------------------------------- the supervisor
def wait_ready(proc: subprocess.Popen, base: str, timeout_s: float) -> None:
    import httpx

    def ready() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"the router exited with code {proc.returncode} before it was ready")
        try:
            return httpx.get(base + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(ready, what=f"the router at {base}/health", timeout_s=timeout_s, producer="router")


def listening_socket(host: str) -> socket.socket:
    """A socket listening on `host`, on a port the kernel chose; kept open across restarts
    of the router (children inherit it), so clients keep one address."""
    from prime_hpc.core.net import bound_socket

    sock = bound_socket(host)
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def child_argv(config: str, fd: int, workers: list[str], base: str, instance: str) -> list[str]:
    """The child's command line: it serves `fd` as the router at `base`, `instance` (an
    id, no secret) of this supervisor."""
    return [
        sys.executable,
        "-u",
        "-m",
        "prime_hpc.inference.router",
        "--config",
        config,
        "--serve-fd",
        str(fd),
        "--url",
        base,
        "--instance",
        instance,
        "--workers",
        *workers,
    ]


def supervise(config: str, run: RunDir, sock: socket.socket, workers: list[str]) -> int:
    """Run the router child on `sock`, restarting it at most `MAX_RESTARTS` times."""
    host, port = sock.getsockname()[:2]
    instance = secrets.token_hex(16)  # what every child proves to be: the socket is this process's
    state: dict = {"proc": None, "stopping": False}

    def on_signal(sig: int, _frame: object) -> None:
        state["stopping"] = True
        if state["proc"] is not None:
            state["proc"].send_signal(sig)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    restarts, rc = 0, 0
    while True:
        proc = state["proc"] = subprocess.Popen(
            child_argv(config, sock.fileno(), workers, url(host, port), instance),
            pass_fds=[sock.fileno()],
            preexec_fn=die_with_parent,
        )  # never outlives this process
        try:
            wait_ready(proc, url(host, port), timeout_s=READY_TIMEOUT_S)
        except (WaitTimeout, RuntimeError) as e:
            proc.terminate()
            print(f"prime-hpc router: {str(e).splitlines()[0]}", file=sys.stderr, flush=True)
            return 1
        atomic_write_json(
            run.router_endpoint,
            {
                "url": url(host, port),
                "host": host,
                "port": port,
                "pid": proc.pid,
                "supervisor_pid": os.getpid(),
                "instance": instance,
                "policy": POLICY,
                "workers": workers,
                "restarts": restarts,
                "started_at": time.time(),
            },
        )
        print(f"prime-hpc router: serving at {url(host, port)} in front of {len(workers)} server(s)", flush=True)
        rc = proc.wait()
        if state["stopping"] or restarts >= MAX_RESTARTS:
            break
        restarts += 1
        workers = serving_urls(run) or live_workers(workers) or workers  # the relay's members first
        print(
            f"prime-hpc router: the router exited with code {rc}; restarting it on the same socket "
            f"(restart {restarts} of at most {MAX_RESTARTS})",
            file=sys.stderr,
            flush=True,
        )
    run.router_endpoint.unlink(missing_ok=True)
    if not state["stopping"]:
        print(
            f"prime-hpc router: the router exited with code {rc} after {restarts} restart(s); giving up",
            file=sys.stderr,
            flush=True,
        )
        return rc or 1
    return 0


def live_workers(urls: list[str]) -> list[str]:
    """The servers among `urls` that answer `/health` now."""
    import httpx

    out = []
    for u in urls:
        try:
            if httpx.get(u + "/health", timeout=3).status_code == 200:
                out.append(u)
        except httpx.HTTPError:
            pass
    return out


def main(argv: Optional[list[str]] = None) -> int:
    from prime_hpc.config.component import InferenceRunConfig, load
    from prime_hpc.core.errors import UserError

    p = argparse.ArgumentParser(prog="python -m prime_hpc.inference.router", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="the run's configs/inference.yaml")
    p.add_argument("--serve-fd", type=int, help=argparse.SUPPRESS)  # the child: serve this socket
    p.add_argument("--workers", nargs="*", default=[], help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)  # the child: the router's URL and instance
    p.add_argument("--instance", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.serve_fd is None:  # the router itself, not its serving child (which inherits the limit)
        raise_open_files("prime-hpc router")
    if not jobenv.require_key("prime-hpc router", "the router"):
        return 2
    try:
        cfg = load(a.config, InferenceRunConfig, "inference")
    except UserError as e:
        print(f"prime-hpc router: {e}", file=sys.stderr, flush=True)
        return 2
    run = RunDir(cfg.output_dir, cfg.group)
    if a.serve_fd is not None:
        me = {"url": a.url, "instance": a.instance, "pid": os.getppid(), "role": "router"} if a.instance else None
        serve(a.serve_fd, a.workers, run, me)
        return 0
    try:
        servers = wait_for_servers(
            run,
            cfg.nodes,
            float(cfg.inference.startup_timeout_s),
            jobenv.logs_dir(),
            own_job=cfg.inference_job == "own",
        )
        sock = listening_socket(node_address(cfg.address))
    except (WaitTimeout, OSError) as e:
        print(f"prime-hpc router: {str(e).splitlines()[0]}", file=sys.stderr, flush=True)
        return 1
    with sock:
        return supervise(a.config, run, sock, [s["url"] for s in servers])


if __name__ == "__main__":
    sys.exit(main())
