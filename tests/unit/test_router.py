"""The run's router (prime_hpc.inference.router) in front of small real HTTP servers on
loopback, each behind the inference server's own gate: the key on every route but
liveness, round robin, failover, membership limited to the run's published servers that
prove they hold the key, the key never forwarded (each request signed for its server),
preflights answered without forwarding. The router proves itself to its own clients the
same way (its router.json's instance), and none of them sends it the key: neither does any
to a listener that holds a router.json's port after its router is gone."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from prime_hpc.core.net import LOOPBACK, url
from prime_hpc.inference import router as router_mod
from prime_hpc.inference.gate import SIGNATURE_SCHEME, GateMiddleware, MissingKey, PolicyGate
from prime_hpc.inference.router import Router
from prime_hpc.rundir import RunDir, atomic_write_json
from tests.inference_util import request_body

KEY = "router-unit-key-0123456789abcdef0123"
AUTH = {"Authorization": f"Bearer {KEY}"}
# what a worker answers besides its name: a chat completion (the OpenAI SDK reads it) with
# the prompt logprobs a teacher asks for (of the sequence [1, 2, 3])
ANSWER = {
    "id": "c",
    "object": "chat.completion",
    "created": 0,
    "model": "m",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "ok"},
            "finish_reason": "stop",
            "prompt_logprobs": [None, {"2": {"logprob": -0.5}}, {"3": {"logprob": -0.25}}],
        }
    ],
}


class Worker:
    """An ASGI app standing in for a server: answers every request with its name and
    records what it saw (method, path, Authorization header)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.seen: list[tuple[str, str, str]] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        more = True
        while more:
            more = (await receive()).get("more_body", False)
        auth = dict(scope["headers"]).get(b"authorization", b"").decode()
        if scope["path"] != "/health":  # the router's own health checks (they carry no key)
            self.seen.append((scope["method"], scope["path"], auth))
        body = json.dumps({"worker": self.name, **ANSWER}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})


class Recorder:
    """ASGI app in front of `app` that records every HTTP request it gets: (method, path,
    query, headers, body)."""

    def __init__(self, app) -> None:
        self.app = app
        self.seen: list[tuple[str, str, str, dict, bytes]] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        body = await request_body(receive)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        self.seen.append((scope["method"], scope["path"], scope["query_string"].decode(), headers, body))
        given = [{"type": "http.request", "body": body, "more_body": False}]

        async def replay():
            return given.pop(0) if given else {"type": "http.disconnect"}

        return await self.app(scope, replay, send)

    def heard(self) -> bytes:
        """Everything it was sent (headers and bodies) as bytes, to look for the key in."""
        return b"".join(f"{m} {p}?{q} {h}".encode() + b for m, p, q, h, b in self.seen)


class Stranger:
    """ASGI app: someone else's listener on a freed port. It answers every request 200 with
    JSON that looks like what the run's router would say (its instance and a made-up proof,
    an empty list of workers, a completion) and keeps nothing but what `Recorder` records."""

    def __init__(self, instance: str = "") -> None:
        self.instance = instance

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        body = json.dumps(
            {
                **ANSWER,
                "url": "http://x",
                "instance": self.instance,
                "pid": os.getpid(),
                "proof": "0" * 64,
                "workers": [],
            }
        ).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})


class Served:
    """An ASGI app served by uvicorn on a loopback port (`port`: that one), in a thread of
    this process. `gated`: behind the inference server's gate with the job's key (it
    answers the identity challenge as `instance` and takes signed requests), as a server
    of the run is; else a plain listener that holds no key."""

    def __init__(self, app, port: int = 0, gated: bool = False) -> None:
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((LOOPBACK, port))
        self.sock.listen(64)
        self.instance = secrets.token_hex(16)
        self.port = self.sock.getsockname()[1]
        me = {"url": url(LOOPBACK, self.port), "instance": self.instance, "pid": os.getpid(), "slot": "x"}
        if gated:
            app = GateMiddleware(app, PolicyGate(), KEY, identity=lambda: me)
        self.app = app
        self.url = me["url"]
        self.server = uvicorn.Server(uvicorn.Config(app, fd=self.sock.fileno(), log_level="error", lifespan="auto"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "a test server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()

    def endpoint(self, node: int = 0, **more) -> dict:
        """Its endpoint record, as a server publishes it."""
        return {"url": self.url, "node": node, "instance": self.instance, "pid": os.getpid(), **more}


def _until(pred, timeout_s: float = 20.0, what: str = "a condition"):
    deadline = time.monotonic() + timeout_s
    while not (value := pred()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def publish_router(run: RunDir, router: Router, front: "Served") -> dict:
    """Give `router` (served by `front`) the identity a supervisor gives it and publish its
    `router.json` as the supervisor does; the record."""
    instance = secrets.token_hex(16)
    router.identity = {"url": front.url, "instance": instance, "pid": os.getpid(), "role": "router"}
    record = {"url": front.url, "pid": os.getpid(), "supervisor_pid": os.getpid(), "instance": instance}
    atomic_write_json(run.router_endpoint, record)
    return record


@pytest.fixture
def fleet(tmp_path, monkeypatch):
    """Two workers published as the run's servers, and the router in front of them (its
    health checks and challenges every 0.2 s) published in router.json, once it routes to
    both; `front.app` records what reaches the router."""
    monkeypatch.setattr(router_mod, "HEALTH_EVERY_S", 0.2)
    run = RunDir(tmp_path / "run")
    workers = {name: Worker(name) for name in ("a", "b")}
    served = {name: Served(w, gated=True) for name, w in workers.items()}
    for node, s in enumerate(served.values()):
        atomic_write_json(run.inference_endpoint(node), s.endpoint(node))
    router = Router([s.url for s in served.values()], KEY, run)
    front = Served(Recorder(router))
    publish_router(run, router, front)
    router.front = front  # the tests below stop it, or read what reached it
    try:
        _until(lambda: len(router.up()) == 2, what="the router to prove both servers")
        yield router, front.url, workers, served, run
    finally:
        for s in (front, *served.values()):
            s.stop()


def _generate(base: str, headers: dict = AUTH) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", json={"messages": []}, headers=headers, timeout=10)


def test_a_router_without_a_key_cannot_be_built():
    for key in (None, ""):
        with pytest.raises(MissingKey):
            Router(["http://127.0.0.1:9"], key)


def test_every_route_but_health_needs_the_key_and_nothing_unauthorised_reaches_a_server(fleet):
    router, base, workers, _, _ = fleet
    assert httpx.get(base + "/health", timeout=10).status_code == 200
    wrong = {"Authorization": "Bearer nope"}
    for headers in ({}, wrong):
        assert _generate(base, headers).status_code == 401
        assert httpx.get(base + "/workers", headers=headers, timeout=10).status_code == 401
        assert httpx.get(base + "/list_workers", headers=headers, timeout=10).status_code == 401
        assert (
            httpx.post(
                base + "/add_worker", params={"url": "http://127.0.0.1:1"}, headers=headers, timeout=10
            ).status_code
            == 401
        )
        assert (
            httpx.post(
                base + "/remove_worker", params={"url": router.workers[0]}, headers=headers, timeout=10
            ).status_code
            == 401
        )
        assert httpx.request("OPTIONS", base + "/v1/models", headers=headers, timeout=10).status_code == 401
    assert all(not w.seen for w in workers.values())
    assert len(router.workers) == 2


def test_requests_go_round_robin_signed_for_each_server_never_with_the_key(fleet):
    _, base, workers, _, _ = fleet
    answers = [_generate(base).json()["worker"] for _ in range(6)]
    assert sorted(answers) == ["a", "a", "a", "b", "b", "b"]
    seen = [auth for w in workers.values() for _, _, auth in w.seen]
    assert len(seen) == 6 and all(a.startswith(SIGNATURE_SCHEME + " ") and KEY not in a for a in seen), seen


def test_a_cors_preflight_is_answered_by_the_router_itself(fleet):
    _, base, workers, _, _ = fleet
    r = httpx.request(
        "OPTIONS",
        base + "/v1/chat/completions",
        timeout=10,
        headers={"Origin": "http://elsewhere", "Access-Control-Request-Method": "POST"},
    )
    assert r.status_code == 204 and "access-control-allow-origin" not in r.headers
    assert all(not w.seen for w in workers.values())


def test_only_servers_the_run_published_that_prove_the_key_can_be_added(fleet):
    router, base, workers, served, run = fleet
    plain_app = Worker("plain")
    own, plain = Served(Worker("own"), gated=True), Served(plain_app)
    try:
        r = httpx.post(base + "/add_worker", params={"url": own.url}, headers=AUTH, timeout=10)
        assert r.status_code == 403 and "not a server of this run" in r.json()["error"]
        assert own.url not in router.workers
        # once the run publishes it (a server of its own, which holds the key), it can join
        atomic_write_json(run.inference_endpoint(2), own.endpoint(2))
        assert httpx.post(base + "/add_worker", params={"url": own.url}, headers=AUTH, timeout=10).status_code == 200
        assert own.url in [w["url"] for w in httpx.get(base + "/workers", headers=AUTH, timeout=10).json()["workers"]]
        # a listener published in the run's name that cannot prove the key is refused
        atomic_write_json(run.inference_endpoint(3), plain.endpoint(3))
        r = httpx.post(base + "/add_worker", params={"url": plain.url}, headers=AUTH, timeout=10)
        assert r.status_code == 403 and "did not prove it holds the job's key" in r.json()["error"], r.text
        assert plain.url not in router.workers and plain_app.seen == [("GET", "/identity", "")]  # the challenge only
        # nor can a server of the run at an address another one published (the proof names its own)
        atomic_write_json(run.inference_endpoint(3), {**own.endpoint(3), "url": plain.url})
        assert httpx.post(base + "/add_worker", params={"url": plain.url}, headers=AUTH, timeout=10).status_code == 403
    finally:
        own.stop()
        plain.stop()


def test_a_stranger_never_receives_the_key(fleet):
    router, base, workers, served, run = fleet
    stranger_app = Worker("stranger")
    stranger = Served(stranger_app)
    try:
        httpx.post(base + "/add_worker", params={"url": stranger.url}, headers=AUTH, timeout=10)
        for _ in range(6):
            assert _generate(base).status_code == 200
        assert stranger_app.seen == []
    finally:
        stranger.stop()


def test_a_listener_on_a_dead_servers_port_gets_no_key_and_no_place_and_a_restarted_server_rejoins(fleet):
    """Server b dies and, before its endpoint file is removed, someone else binds its freed
    port (a plain HTTP server that records every Authorization header). No request it gets
    carries the key, no answer of its reaches a caller, and it is never routed to again. A
    server of the run that comes back at that address is routed to only once it published
    its endpoint (a new instance) and proved it; one that did not publish is not."""
    router, base, workers, served, run = fleet
    b = served["b"]
    b.stop()  # dead; endpoints/inference_1.json still names it
    stranger_app = Worker("stranger")
    stranger = Served(stranger_app, port=b.port)
    try:
        answers = [_generate(base).json()["worker"] for _ in range(20)]
        assert set(answers) == {"a"}, answers
        _until(lambda: b.url not in router.up(), what="b out of rotation")
        time.sleep(1.0)  # five more rounds of health checks and challenges
        assert [_generate(base).json()["worker"] for _ in range(6)] == ["a"] * 6
        assert b.url not in router.up() and b.url not in router.verified
        heard = [auth for _, _, auth in stranger_app.seen]
        assert all(KEY not in auth for auth in heard), heard  # at most signatures for b, dead
        # the relay's admin client does not send it the key either, and drops it as lost
        admin = _admin([s.url for s in served.values()], [s.endpoint(n) for n, s in enumerate(served.values())])
        assert admin.instances == {} and _update(admin) == [served["a"].url]
        assert list(admin.lost) == [b.url] and "did not prove" in admin.lost[b.url], admin.lost
        assert all(KEY not in auth for _, _, auth in stranger_app.seen), stranger_app.seen
    finally:
        stranger.stop()
    # a server of the run back at b's address: routed to only once its endpoint names it
    back_app = Worker("back")
    back = Served(back_app, port=b.port, gated=True)
    try:
        time.sleep(1.0)
        assert b.url not in router.up()  # it proves its own instance, not the one published
        atomic_write_json(run.inference_endpoint(1), back.endpoint(1))  # it publishes its endpoint
        _until(lambda: b.url in router.up(), what="the restarted server back in rotation")
        assert {_generate(base).json()["worker"] for _ in range(6)} == {"a", "back"}
        assert all(KEY not in auth for w in (*workers.values(), back_app) for _, _, auth in w.seen)
    finally:
        back.stop()


def _admin(servers: list, records: list):
    from prime_hpc.inference.client import Admin

    admin = Admin(servers, key=KEY)
    for r in records:
        admin.expect(r["url"], r)
    return admin


def _update(admin) -> list:
    """An update through the admin client: the servers that answered it."""
    import asyncio

    async def go() -> list:
        try:
            return [s for s, _ in await admin._call_all("POST", "/update_weights", {"weight_dir": "/w", "step": 1})]
        finally:
            await admin.aclose()

    return asyncio.run(go())


def test_a_removed_or_dead_server_gets_no_more_requests(fleet):
    router, base, workers, served, _ = fleet
    assert (
        httpx.post(base + "/remove_worker", params={"url": served["a"].url}, headers=AUTH, timeout=10).status_code
        == 200
    )
    before = len(workers["a"].seen)
    assert {_generate(base).json()["worker"] for _ in range(4)} == {"b"}
    assert len(workers["a"].seen) == before
    assert (
        httpx.post(base + "/remove_worker", params={"url": served["a"].url}, headers=AUTH, timeout=10).status_code
        == 404
    )
    # put a back, then let b die: every request is answered by a
    assert (
        httpx.post(base + "/add_worker", params={"url": served["a"].url}, headers=AUTH, timeout=10).status_code == 200
    )
    served["b"].stop()
    assert [_generate(base).json()["worker"] for _ in range(4)] == ["a"] * 4


def test_a_request_that_finds_no_server_waits_for_one_to_join_else_a_503_naming_what_was_tried(fleet):
    router, base, workers, served, run = fleet
    for s in served.values():
        s.stop()
    router.no_server_wait_s = 1.0
    t0 = time.monotonic()
    r = _generate(base)
    assert r.status_code == 503 and "no inference server answered" in r.json()["error"]
    assert time.monotonic() - t0 >= 1.0  # it waited for a server to join
    router.no_server_wait_s = 30.0
    late = Served(Worker("late"), gated=True)  # a restarted server: published, then added by the relay
    try:
        atomic_write_json(run.inference_endpoint("inference_7.0"), late.endpoint())

        def join() -> None:
            time.sleep(1.0)
            httpx.post(base + "/add_worker", params={"url": late.url}, headers=AUTH, timeout=10)

        threading.Thread(target=join, daemon=True).start()
        assert _generate(base).json()["worker"] == "late"
    finally:
        late.stop()


def test_a_connection_that_breaks_once_is_tried_again_on_the_same_server(fleet):
    """A pooled connection the server closes just as a request goes out on it breaks that
    request (httpx: ReadError); the router sends it once more before it counts the server
    as gone, so the only server of a run does not leave a request waiting for another."""
    router, base, workers, served, _ = fleet
    router.remove(served["b"].url)
    broken = []

    class BreaksOnce(httpx.AsyncHTTPTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            if not broken:
                broken.append(str(request.url))
                raise httpx.ReadError("the server closed the connection", request=request)
            return await super().handle_async_request(request)

    router.no_server_wait_s = 30.0
    router.client = httpx.AsyncClient(transport=BreaksOnce())
    r = _generate(base)
    assert r.status_code == 200 and r.json()["worker"] == "a", r.text
    assert broken == [served["a"].url + "/v1/chat/completions"] and router.up() == [served["a"].url]
    # idle pooled connections are dropped well before a server's own keep-alive (5 s) would
    from prime_hpc.core.net import IDLE_CONNECTION_S

    assert IDLE_CONNECTION_S < 5


def test_a_server_whose_endpoint_is_gone_is_dropped(fleet):
    router, base, workers, served, run = fleet
    run.inference_endpoint(1).unlink()  # it left the run (its supervisor removed the file)
    router.drop_unpublished()
    assert router.workers == [served["a"].url]
    assert [_generate(base).json()["worker"] for _ in range(3)] == ["a"] * 3


@pytest.mark.parametrize("module", ["prime_hpc.inference", "prime_hpc.inference.router", "prime_hpc.orchestrator"])
def test_a_listener_started_without_the_key_refuses_in_one_line(module, tmp_path):
    """The server, the router and the orchestrator (which talks only to keyed servers)
    exit at once, naming the variable, before reading anything else."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "INFERENCE_SERVER_API_KEY"}
    r = subprocess.run(
        [sys.executable, "-m", module, "--config", str(tmp_path / "none.yaml")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "INFERENCE_SERVER_API_KEY is not set" in lines[0], r.stderr


def test_the_relay_loads_a_joining_server_before_the_router_sends_it_anything_and_drops_one_that_left(
    fleet, monkeypatch, tmp_path
):
    """The membership the weight relay keeps (orchestrator/fleet.py), against this router:
    a server found in endpoints/ first gets the current policy (to it alone), then joins the
    router and every later update; its endpoint removed, it leaves both."""
    import asyncio

    from prime_hpc.inference.client import Admin
    from prime_hpc.orchestrator.relay import WeightRelay
    from prime_hpc.rundir.fleet import fleet as fleet_rows
    from prime_hpc.rundir.fleet import read_membership

    monkeypatch.setenv("INFERENCE_SERVER_API_KEY", KEY)
    router, base, workers, served, run = fleet
    joiner = Worker("late")
    late = Served(joiner, gated=True)
    try:

        async def go() -> None:
            admin = Admin([s.url for s in served.values()])
            relay = WeightRelay(run, admin, "m", router=base)
            relay.members.start_with([s.endpoint(n) for n, s in enumerate(served.values())], 0)
            relay.policy, relay.loaded = 3, ("full", str(tmp_path / "weights" / "step_3"))
            atomic_write_json(run.inference_endpoint("inference_7.0"), late.endpoint(policy_step=0))
            await relay.members.poll(force=True)
            assert joiner.seen[0][:2] == ("POST", "/update_weights")  # loaded before it joined
            assert late.url in router.workers and late.url in admin.live
            assert read_membership(run)["inference_7.0"]["state"] == "serving"
            assert relay.serving() == 3 and relay.gauges()["inference/servers"] == 3
            run.inference_endpoint(1).unlink()  # server b left (its supervisor removed the file)
            await relay.members.poll(force=True)
            await asyncio.gather(*relay.members.tasks)
            assert served["b"].url not in router.workers and served["b"].url not in admin.live
            assert {r["slot"]: r["state"] for r in fleet_rows(run)} == {
                "inference_0": "serving",
                "inference_1": "removed",
                "inference_7.0": "serving",
            }
            await admin.aclose()

        asyncio.run(go())
    finally:
        late.stop()
