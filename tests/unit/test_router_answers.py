"""What the router takes for an answer (`Router.aborted`, `Router.relay`): a generation a
server aborted (vLLM's `finish_reason` "abort", what an engine stopping under SLURM's
SIGTERM answers with HTTP 200) is no answer, and the router sends the request to the next
server, as it does when a server dies under its answer (its body cut short); everything else is relayed byte for byte, a JSON answer read whole for the check,
any other as it streams; behind the router, a request that a stopping server aborted is
answered by another. The run that loses a server this way is
`tests/integration/test_node_loss.py` (no rollout errored)."""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import pytest

from prime_hpc.inference import router as router_mod
from prime_hpc.inference.router import Router
from prime_hpc.rundir import RunDir, atomic_write_json
from tests.unit.test_router import AUTH, KEY, Served, Worker, _until

JSON = {"content-type": "application/json"}


def _completion(*reasons: str) -> bytes:
    choices = [{"index": i, "message": {"content": "x"}, "finish_reason": r} for i, r in enumerate(reasons)]
    return json.dumps({"id": "c", "object": "chat.completion", "choices": choices}).encode()


def _answer(status: int, headers: dict, content: bytes) -> httpx.Response:
    """A server's answer as the router's client gets it (`send(stream=True)`): not read yet."""

    async def chunks():
        for i in range(0, len(content), 7):
            yield content[i : i + 7]

    return httpx.Response(status, headers=headers, content=chunks())


def _aborted(response: httpx.Response) -> bool:
    async def check() -> bool:
        return await Router.aborted(response)

    return asyncio.run(check())


@pytest.mark.parametrize("reasons", [("abort",), ("stop", "abort"), ("abort", "abort")])
def test_an_aborted_generation_is_no_answer(reasons):
    assert _aborted(_answer(200, headers=JSON, content=_completion(*reasons)))
    text = json.dumps({"choices": [{"text": "", "finish_reason": "abort"}]}).encode()  # /v1/completions
    assert _aborted(_answer(200, headers={"content-type": "application/json; charset=utf-8"}, content=text))


@pytest.mark.parametrize(
    "status, headers, body",
    [
        (200, JSON, _completion("stop", "length")),
        (200, JSON, json.dumps({"choices": [{"message": {"content": '"abort"'}, "finish_reason": "stop"}]}).encode()),
        (500, JSON, _completion("abort")),  # an error answer is the client's to retry
        (200, {"content-type": "text/event-stream"}, b'data: {"choices": [{"finish_reason": "abort"}]}\n\n'),
        (200, {**JSON, "content-encoding": "gzip"}, b"\x1f\x8b"),  # not read: relayed as it came
        (200, JSON, b'["abort"]'),
        (200, JSON, b'{"choices": "abort"}'),
        (200, JSON, b'{"choices": 5, "finish_reason": "abort"}'),
        (200, JSON, b'{"not json": "abort"'),
        (200, JSON, b'{"policy_step": 3}'),
    ],
)
def test_any_other_answer_is_an_answer(status, headers, body):
    assert not _aborted(_answer(status, headers=headers, content=body))


def _relayed(response: httpx.Response) -> tuple[int, bytes]:
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(Router.relay(response, send))
    assert sent[0]["type"] == "http.response.start" and not sent[-1].get("more_body"), sent
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def test_an_answer_read_for_the_check_or_not_is_relayed_byte_for_byte():
    body = _completion("stop")
    read = _answer(200, headers=JSON, content=body)
    assert not _aborted(read) and read.is_stream_consumed
    assert _relayed(read) == (200, body)
    stream = b'data: {"choices": []}\n\ndata: [DONE]\n\n'
    unread = _answer(200, headers={"content-type": "text/event-stream"}, content=stream)
    assert not _aborted(unread) and not unread.is_stream_consumed
    assert _relayed(unread) == (200, stream)


class Aborting(Worker):
    """A server whose engine stops under every generation: vLLM's answer, HTTP 200 with each
    choice's `finish_reason` "abort"."""

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/v1/chat/completions":
            return await super().__call__(scope, receive, send)
        more = True
        while more:
            more = (await receive()).get("more_body", False)
        self.seen.append((scope["method"], scope["path"], ""))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": _completion("abort", "abort")})


class CutShort:
    """A served app whose answers to generations are cut short: the headers (the gate's
    proof among them) and a few bytes of the body out, then the connection closed, as when
    the server is killed while it sends."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/v1/chat/completions":
            return await self.app(scope, receive, send)

        async def cut(message: dict) -> None:
            if message["type"] == "http.response.body":
                await send({"type": "http.response.body", "body": message.get("body", b"")[:5], "more_body": True})
                raise RuntimeError("killed")
            await send(message)

        await self.app(scope, receive, cut)


@contextlib.contextmanager
def _behind_router(tmp_path, monkeypatch, a: Worker, cut_a: bool = False):
    """The router in front of server a (`a`; `cut_a`: its answers to generations cut short,
    `CutShort`) and server b, once it has proven both: (router, its url, workers, served)."""
    monkeypatch.setattr(router_mod, "HEALTH_EVERY_S", 0.2)
    run = RunDir(tmp_path / "run")
    workers = {"a": a, "b": Worker("b")}
    served = {name: Served(w, gated=True) for name, w in workers.items()}
    if cut_a:  # before the router's first connection: each connection takes the app then
        config = served["a"].server.config
        config.loaded_app = CutShort(config.loaded_app)
    for node, s in enumerate(served.values()):
        atomic_write_json(run.inference_endpoint(node), s.endpoint(node))
    router = Router([s.url for s in served.values()], KEY, run)
    front = Served(router)
    try:
        _until(lambda: len(router.up()) == 2, what="the router to prove both servers")
        yield router, front.url, workers, served
    finally:
        for s in (front, *served.values()):
            s.stop()


@pytest.fixture
def stopping(tmp_path, monkeypatch):
    """The router in front of server a, whose engine aborts every generation, and server b."""
    with _behind_router(tmp_path, monkeypatch, Aborting("a")) as behind:
        yield behind


def _chat(base: str) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", json={"messages": []}, headers=AUTH, timeout=10)


def test_a_generation_aborted_by_a_stopping_server_is_answered_by_another(stopping, capfd):
    router, base, workers, served = stopping
    answers = [_chat(base) for _ in range(4)]
    assert [(r.status_code, r.json()["worker"]) for r in answers] == [(200, "b")] * 4
    assert workers["a"].seen, "server a was never tried"
    assert (
        f"prime-hpc router: {served['a'].url} aborted a generation (it is stopping); sent on" in capfd.readouterr().err
    )
    served["b"].stop()  # no server left that finishes it: 503 (the client tries again), never the aborted answer
    router.no_server_wait_s = 0.5
    last = _chat(base)
    assert last.status_code == 503 and "aborted the generation" in last.text, last.text


def test_an_answer_cut_short_by_a_dying_server_is_no_answer_and_another_answers(tmp_path, monkeypatch):
    with _behind_router(tmp_path, monkeypatch, Worker("a"), cut_a=True) as (router, base, workers, served):
        answers = [_chat(base) for _ in range(4)]
        assert [r.status_code for r in answers] == [200] * 4, [r.text for r in answers]  # never a 500
        assert [r.json()["worker"] for r in answers] == ["b"] * 4
        assert workers["a"].seen, "server a was never tried"
        served["b"].stop()  # none left that answers whole: 503 (the client tries again), never a 500
        router.no_server_wait_s = 0.5
        last = _chat(base)
        assert last.status_code == 503 and "no inference server answered" in last.text, last.text
