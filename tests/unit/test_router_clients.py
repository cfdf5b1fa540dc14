"""The run's router proves itself to its own clients, and none of them sends it the key.

Against the real router (prime_hpc.inference.router) in front of small servers behind the
inference server's gate (`tests.unit.test_router`'s fleet): each client of the router (the
orchestrator's generation client, the relay's `add_worker`/`forget_worker`, a leaving
server's `/workers` wait, `scale`'s `check_key`, the teacher's client, `discover`) proves it
against `router.json` and sends it only requests signed for its instance. Then the router
is gone and someone else's listener holds its port while `router.json` still names it (a
supervisor killed outright): that listener gets a nonce from each client and nothing else,
no key and nothing replayable, and each client fails in one line naming `router.json` and
the address (`discover` waits for a router that proves itself). A client that had proven
the router before sends the listener at most a request signed for the dead instance, which
neither a new router of the run nor a server takes."""

from __future__ import annotations

import asyncio
import re
import time
from types import SimpleNamespace

import httpx
import pytest

from prime_hpc.core import keyfile
from prime_hpc.inference.client import (
    InferenceError,
    NotProven,
    RouterLink,
    RouterURL,
    add_worker,
    discover,
    forget_worker,
)
from prime_hpc.inference.gate import IDENTITY_PATH, PROOF_HEADER, SIGNATURE_SCHEME
from prime_hpc.inference.router import Router
from prime_hpc.rundir import RunDir, WaitTimeout, atomic_write_json
from tests.unit import test_router
from tests.unit.test_router import KEY, Recorder, Served, Stranger, Worker, publish_router

router_fleet = test_router.fleet  # its fixture: the real router in front of two servers, published

MESSAGES = [{"role": "user", "content": "abc"}]


async def _ask(client) -> str:
    """One generation through the orchestrator's client; the answer's content."""
    response = await client.get_native_response(MESSAGES, "m", {})
    return response.choices[0].message.content


def _generate(client, times: int = 1) -> list[str]:
    """`times` generations, one after the other, then the client closed."""

    async def go() -> list[str]:
        try:
            return [await _ask(client) for _ in range(times)]
        finally:
            await client._client.close()

    return asyncio.run(go())


def _policy_client(base: str, key: str = KEY):
    from prime_hpc.orchestrator.client import make_client

    return make_client(base, key, coalesce=False)


def _leaving_server(run: RunDir, url: str) -> SimpleNamespace:
    """What `Server._wait_unrouted` reads of a server of the run at `url`."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return SimpleNamespace(host=host, port=int(port), run=run, slot="inference_7.0")


def _wait_unrouted(server: SimpleNamespace, within_s: float) -> bool:
    from prime_hpc.inference.server import Server

    return asyncio.run(Server._wait_unrouted(server, time.monotonic() + within_s))  # type: ignore[arg-type]


def _teacher(url: str, key: str = KEY):
    from prime_hpc.orchestrator.rollouts import Rollout
    from prime_hpc.orchestrator.teacher import Teacher, TeacherAt

    teacher = Teacher(TeacherAt(url, key, "m"), lambda: "m")
    teacher.retry_delays_s = (0.01,)
    rollout = Rollout("e", 0, 0.0, [1, 2, 3], [False, True, True], [0.0, -1.0, -1.0], [0], 1, False)

    async def ask() -> None:
        try:
            await teacher.add_logprobs([rollout])
        finally:
            await teacher.aclose()

    asyncio.run(ask())
    return rollout


def _signed_or_probe(seen: list) -> None:
    """Every request the router got carries a signature, but its identity challenges (no
    credentials at all)."""
    for method, path, query, headers, body in seen:
        if path == IDENTITY_PATH:
            assert (method, body, "authorization" in headers) == ("GET", b"", False), (path, headers)
            assert re.fullmatch(r"nonce=[0-9a-f]{32}", query), query
        else:
            assert headers.get("authorization", "").startswith(SIGNATURE_SCHEME + " "), (method, path, headers)


def test_every_client_of_the_router_proves_it_and_sends_it_signatures_never_the_key(
    router_fleet, tmp_path, monkeypatch
):
    router, base, workers, served, run = router_fleet
    recorder: Recorder = router.front.app
    monkeypatch.setenv("INFERENCE_SERVER_API_KEY", KEY)  # a leaving server's and the relay's own
    ep = discover(run, 2, timeout_s=10, key=KEY)
    assert ep.router == base and ep.router.link.instance == router.identity["instance"]
    probes = sum(1 for _, path, *_ in recorder.seen if path == IDENTITY_PATH)
    assert probes == 1 and len(recorder.seen) == 1  # discover proved it, and sent nothing else
    # the orchestrator's generation: signed requests, no challenge per request
    client = _policy_client(ep.openai_base_url)
    assert _generate(client, 4) == ["ok"] * 4
    assert len(recorder.seen) == 5 and sum(1 for _, path, *_ in recorder.seen if path == IDENTITY_PATH) == 1
    assert {w for w in workers.values() if w.seen} == set(workers.values())  # through the router to both
    # the relay adds and removes a server; a leaving server waits until it is out
    late = Served(Worker("late"), gated=True)
    try:
        atomic_write_json(run.inference_endpoint("inference_7.0"), late.endpoint())
        asyncio.run(add_worker(ep.router, late.url))
        assert late.url in router.workers
        assert _wait_unrouted(_leaving_server(run, late.url), 0.5) is False  # listed: it waits
        asyncio.run(forget_worker(ep.router, late.url))
        assert late.url not in router.workers
        assert _wait_unrouted(_leaving_server(run, late.url), 5.0) is True
    finally:
        late.stop()
    # scale checks the kept key against the router; a wrong key is refused in one line
    from prime_hpc.launcher import scale

    keyfile.write(run.private_dir, KEY)
    assert scale.check_key(run) == KEY
    keyfile.write(run.private_dir, "another-key-" + "x" * 30)
    with pytest.raises(scale.ScaleError, match="did not prove it holds the job's key.*not the run's"):
        scale.check_key(run)
    # the teacher's client, through its router
    assert _teacher(ep.openai_base_url).teacher_logprobs == [0.0, -0.5, -0.25]
    assert KEY.encode() not in recorder.heard()
    _signed_or_probe(recorder.seen)


def test_the_router_answers_its_challenge_and_a_signed_request_with_its_own_proof_only(router_fleet):
    router, base, workers, served, run = router_fleet
    link = RouterLink(run.router_endpoint, KEY)
    with httpx.Client(timeout=10, auth=link.auth()) as client:
        r = client.post(base + "/v1/chat/completions", json={"messages": []})
        assert r.status_code == 200 and r.json()["worker"] in ("a", "b")
        # the server's proof (for the router's own signature) is not relayed: one proof, the router's
        assert len(r.headers.get_list(PROOF_HEADER)) == 1
        assert client.get(base + "/workers").status_code == 200
    with pytest.raises(NotProven, match="did not prove it holds the job's key"):
        with httpx.Client(timeout=10) as client:
            RouterLink(run.router_endpoint, KEY + "-not").prove(client)
    # it proves its own instance only: a router.json naming another is not proven
    atomic_write_json(run.router_endpoint, {**link.record, "instance": "f" * 32})
    with pytest.raises(NotProven, match=r"not as the instance f{32}"):
        with httpx.Client(timeout=10) as client:
            RouterLink(run.router_endpoint, KEY).prove(client)


def test_a_listener_on_a_stale_router_json_port_gets_no_key_and_nothing_replayable(router_fleet, tmp_path, monkeypatch):
    """The router's supervisor was killed outright: router.json stays, and someone else
    binds its port (a listener that records every request and answers as the router would,
    with a made-up proof). No client of the router sends it the key or anything a router or
    server of the run would take; each fails in one line naming router.json and the
    address, or waits for a router that proves itself."""
    from prime_hpc.core.errors import UserError
    from prime_hpc.launcher import scale

    router, base, workers, served, run = router_fleet
    monkeypatch.setenv("INFERENCE_SERVER_API_KEY", KEY)
    published = run.router_endpoint.read_text()
    router.front.stop()
    stranger = Recorder(Stranger(instance=router.identity["instance"]))
    held = Served(stranger, port=router.front.port)
    try:
        assert run.router_endpoint.read_text() == published  # stale: it names the dead router
        named = rf"{re.escape(str(run.router_endpoint))} names the router at {re.escape(base)}, which did not prove"
        # discover waits for a router that proves itself, and names this one when it gives up
        with pytest.raises(WaitTimeout, match=named):
            discover(run, 2, timeout_s=1.0, key=KEY)
        link = RouterLink(run.router_endpoint, KEY)
        with pytest.raises(NotProven, match=named):  # the orchestrator's generation
            _generate(_policy_client(RouterURL(base + "/v1", link)))
        with pytest.raises(InferenceError, match=named):  # the relay's add_worker
            asyncio.run(add_worker(RouterURL(base, link), served["a"].url))
        asyncio.run(forget_worker(RouterURL(base, link), served["a"].url))  # best effort: nothing sent
        t0 = time.monotonic()  # a leaving server does not wait for a router that is not the run's
        assert _wait_unrouted(_leaving_server(run, served["a"].url), 10.0) is True
        assert time.monotonic() - t0 < 5.0
        keyfile.write(run.private_dir, KEY)
        with pytest.raises(scale.ScaleError, match=named):  # scale's check of the key
            scale.check_key(run)
        with pytest.raises(UserError, match=named):  # the teacher's client
            _teacher(RouterURL(base + "/v1", link))
    finally:
        held.stop()
    assert stranger.seen and KEY.encode() not in stranger.heard()
    assert {(method, path) for method, path, *_ in stranger.seen} == {("GET", IDENTITY_PATH)}, stranger.seen
    _signed_or_probe(stranger.seen)  # challenges only: a nonce of the client's own, no credentials, no body


def test_a_client_that_proved_the_router_gives_a_listener_on_its_freed_port_nothing_it_can_use(router_fleet, tmp_path):
    """The orchestrator's generation client proved the router and used it; the router dies
    and someone else takes its port. The client's next requests fail (`NotProven`), never
    with the key; what the listener got, and every request the dead router had got, is
    refused by a new router of the run (another instance) and by a server."""
    router, base, workers, served, run = router_fleet
    client = _policy_client(discover(run, 2, timeout_s=10, key=KEY).openai_base_url)
    stranger = Recorder(Stranger(instance=router.identity["instance"]))
    held: list = []

    async def go() -> None:
        try:
            assert await _ask(client) == "ok"
            router.front.stop()
            held.append(Served(stranger, port=router.front.port))
            for _ in range(2):
                with pytest.raises(NotProven, match=re.escape(str(run.router_endpoint))):
                    await _ask(client)
        finally:
            await client._client.close()

    try:
        asyncio.run(go())
    finally:
        for s in held:
            s.stop()
    assert KEY.encode() not in stranger.heard()
    signed = [r for r in (*router.front.app.seen, *stranger.seen) if r[1] != IDENTITY_PATH]
    assert signed and all(h["authorization"].startswith(SIGNATURE_SCHEME) for _, _, _, h, _ in signed)
    # a new router of the run (a new instance, same key), and a server: neither takes any of them
    again = Router([s.url for s in served.values()], KEY, run)
    front = Served(again)
    publish_router(run, again, front)
    try:
        for method, path, query, headers, body in signed:
            kept = {k: v for k, v in headers.items() if k not in ("host", "content-length")}
            for target in (front.url, served["a"].url):
                r = httpx.request(method, f"{target}{path}?{query}", headers=kept, content=body, timeout=10)
                assert r.status_code == 401, (target, path, r.status_code)
    finally:
        front.stop()


def _serve_job(run: RunDir, base: str) -> None:
    """Make the fixture's run a serve job of the user's own that serves now, as
    `prime-hpc serve` leaves it: its job.json, `serve.json` naming the router's OpenAI
    URL, and the key it kept for its owner (nothing exported)."""
    atomic_write_json(
        run.job_json,
        {"name": "served", "kind": "serve", "backend": "slurm", "job_ids": ["41"], "state": "RUNNING", "mode": "run"},
    )
    atomic_write_json(run.serve_json, {"url": base + "/v1", "model": "m", "key_var": "INFERENCE_SERVER_API_KEY"})
    keyfile.write(run.private_dir, KEY)


def _given(command: str, run: RunDir, out) -> list[str]:
    """`prime-hpc eval|synthesize serve=<the serve job> ...`: one example of reverse-text."""
    return [command, f"serve={run.root}", "env=reverse-text", "examples=1", f"out={out}"]


@pytest.mark.parametrize("command", ["eval", "synthesize"])
def test_eval_and_synthesize_of_a_serve_job_prove_its_router_and_send_it_signatures_never_the_key(
    router_fleet, tmp_path, monkeypatch, command
):
    """`eval serve=<job>` and `synthesize serve=<job>` find the job's router from its
    serve.json, prove it against its router.json with the key the job kept, and send it
    only requests signed for its instance: one challenge, then signed generations."""
    from prime_hpc.cli import main

    router, base, workers, served, run = router_fleet
    _serve_job(run, base)
    for var in ("INFERENCE_SERVER_API_KEY", "ENDPOINT_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    out = tmp_path / "out"
    assert main(_given(command, run, out)) == 0
    recorder: Recorder = router.front.app
    asked = [path for _, path, *_ in recorder.seen]
    assert asked.count(IDENTITY_PATH) == 1 and asked.count("/v1/chat/completions") >= 1, asked
    assert {w for w in workers.values() if w.seen}  # through the router to its servers
    assert KEY.encode() not in recorder.heard()
    _signed_or_probe(recorder.seen)


@pytest.mark.parametrize("command", ["eval", "synthesize"])
def test_eval_and_synthesize_of_a_serve_job_send_a_listener_on_its_stale_router_port_nothing(
    router_fleet, tmp_path, monkeypatch, capsys, command
):
    """The serve job's router was killed outright: its serve.json and router.json stay, and
    someone else's listener (answering as the router would, with a made-up proof) holds
    the port. `eval serve=` and `synthesize serve=` send it an identity challenge and
    nothing else (no key, no signature, no body), and fail in one line naming router.json
    and the address, before anything is written."""
    from prime_hpc.cli import main

    router, base, workers, served, run = router_fleet
    _serve_job(run, base)
    for var in ("INFERENCE_SERVER_API_KEY", "ENDPOINT_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    router.front.stop()
    stranger = Recorder(Stranger(instance=router.identity["instance"]))
    held = Served(stranger, port=router.front.port)
    out = tmp_path / "out"
    capsys.readouterr()
    try:
        rc = main(_given(command, run, out))
    finally:
        held.stop()
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert f"{run.router_endpoint} names the router at {base}, which did not prove it holds the job's key" in err, err
    assert stranger.seen and KEY.encode() not in stranger.heard()
    assert {(method, path) for method, path, *_ in stranger.seen} == {("GET", IDENTITY_PATH)}, stranger.seen
    _signed_or_probe(stranger.seen)
    assert not out.exists()
