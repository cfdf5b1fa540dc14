"""A v1 worker's HTTP (`envserver.transport`): httpx's requests and answers sent through
aiohttp's pool. What the harness and verifiers' train client rely on: each concurrent call
gets its own answer, bodies and headers arrive as sent (a compressed body decoded), and a
failure is the httpx error the OpenAI SDK and verifiers read as the transport failing
(a refused connection, a read past its timeout, an answer cut short), against a real
aiohttp server on loopback."""

from __future__ import annotations

import asyncio
import gzip
from typing import Any, Awaitable, Callable

import httpx
import openai
import pytest
from aiohttp import web

from prime_hpc.envserver.transport import async_client


async def _echo(request: web.Request) -> web.Response:
    return web.json_response(
        {
            "body": (await request.read()).decode(),
            "authorization": request.headers.get("Authorization"),
            "content_type": request.headers.get("Content-Type"),
            "query": request.query_string,
        }
    )


async def _gzipped(request: web.Request) -> web.Response:
    return web.Response(body=gzip.compress(b"olleh" * 200), headers={"Content-Encoding": "gzip"})


async def _cut_short(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Length": "1000"})
    await response.prepare(request)
    await response.write(b"x" * 10)
    assert request.transport is not None
    request.transport.close()
    return response


async def _late(request: web.Request) -> web.Response:
    await asyncio.sleep(5)
    return web.Response(text="late")


async def _chat(request: web.Request) -> web.Response:
    body = await request.json()
    reply = body["messages"][-1]["content"][::-1]
    return web.json_response(
        {
            "id": "c",
            "object": "chat.completion",
            "created": 0,
            "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "stop"}],
        }
    )


def _served(test: Callable[[str], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        app = web.Application()
        app.router.add_post("/echo", _echo)
        app.router.add_get("/gzipped", _gzipped)
        app.router.add_get("/cut", _cut_short)
        app.router.add_get("/late", _late)
        app.router.add_post("/v1/chat/completions", _chat)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            return await test(f"http://127.0.0.1:{port}")
        finally:
            await runner.cleanup()

    return asyncio.run(main())


def test_concurrent_calls_each_get_their_own_answer_as_sent():
    async def test(base: str) -> None:
        async with async_client(httpx.Timeout(30.0)) as c:
            answers = await asyncio.gather(
                *(
                    c.post(f"{base}/echo?i={i}", json={"i": i}, headers={"Authorization": f"Bearer s{i}"})
                    for i in range(100)
                )
            )
            for i, r in enumerate(answers):
                assert r.status_code == 200 and r.http_version == "HTTP/1.1"
                assert r.json() == {
                    "body": f'{{"i":{i}}}',
                    "authorization": f"Bearer s{i}",
                    "content_type": "application/json",
                    "query": f"i={i}",
                }
            zipped = await c.get(f"{base}/gzipped")
            assert zipped.content == b"olleh" * 200  # decoded by its Content-Encoding, as httpx's own

    _served(test)


@pytest.mark.parametrize(
    "path, timeout, error",
    [
        ("/cut", 10.0, httpx.RemoteProtocolError),
        ("/late", 0.5, httpx.ReadTimeout),
        (None, 10.0, httpx.ConnectError),
    ],
    ids=["cut-short", "read-timeout", "refused"],
)
def test_a_failed_call_is_the_httpx_error_of_its_cause(path, timeout, error):
    async def test(base: str) -> None:
        url = f"{base}{path}" if path else "http://127.0.0.1:1/nothing"
        async with async_client(httpx.Timeout(timeout)) as c:
            with pytest.raises(error):
                r = await c.get(url)
                await r.aread()

    _served(test)


def test_the_openai_sdk_on_it_answers_and_reads_a_dead_endpoint_as_a_connection_error():
    """verifiers' train client is the SDK on this transport (`train_client_on_aiohttp`):
    an answer parses as the SDK's, and a refused connection is the SDK's
    APIConnectionError, which verifiers turns into the model-transport failure."""

    async def test(base: str) -> None:
        live = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0, http_client=async_client())
        out = await live.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}])
        assert out.choices[0].message.content == "olleh"
        dead = openai.AsyncOpenAI(
            base_url="http://127.0.0.1:1/v1", api_key="k", max_retries=0, http_client=async_client()
        )
        with pytest.raises(openai.APIConnectionError):
            await dead.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}])
        await live.close()
        await dead.close()

    _served(test)
