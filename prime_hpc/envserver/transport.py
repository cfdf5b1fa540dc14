"""HTTP for a v1 worker's own calls: httpx's API, aiohttp's connection pool.

A worker runs every episode of its groups in one event loop, each with a model call in
flight: its chat harness's turn to the interception endpoint (`chat.py`) and the train
client's call from there to the policy (verifiers' `TrainClient`, an OpenAI SDK client on
httpx). httpcore's pool, under both, walks every connection it holds on each request it
takes and each it gives back, and for each idle one counts all of them again and asks its
socket whether it is readable: with a group's episodes in flight that was half the worker's
loop (docs/benchmarks.md). `AiohttpTransport` keeps httpx's requests and answers, and so the
SDK's and verifiers' handling of them (timeouts, errors, retries), and sends them through an
aiohttp session, whose pool takes a free connection without walking the others. aiohttp is
verifiers' own dependency (its interception server).

Imported by `v1worker.py` and `chat.py` under the env's interpreter (verifiers >= 0.4),
and by the env server's relay (`relay.py`: as many calls from a worker's episodes to the
router) under the run's: httpx and aiohttp alone, nothing of prime-hpc's stack.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Optional

import aiohttp
import httpx

__all__ = ["AiohttpTransport", "async_client"]

KEEPALIVE_S = 15.0
# what aiohttp sets itself from the request it sends
_OWN_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection"})


def _timeout(request: httpx.Request) -> aiohttp.ClientTimeout:
    t = request.extensions.get("timeout") or {}
    return aiohttp.ClientTimeout(total=None, sock_connect=t.get("connect"), sock_read=t.get("read"))


class _Body(httpx.AsyncByteStream):
    """An answer's body as aiohttp reads it; the connection goes back at close."""

    def __init__(self, response: aiohttp.ClientResponse, request: httpx.Request) -> None:
        self.response, self.request = response, request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.response.content.iter_any():
                yield chunk
        except asyncio.TimeoutError as e:
            raise httpx.ReadTimeout(f"no answer within the read timeout: {e}", request=self.request) from e
        except aiohttp.ClientError as e:
            raise httpx.RemoteProtocolError(f"{type(e).__name__}: {e}", request=self.request) from e

    async def aclose(self) -> None:
        self.response.release()


class AiohttpTransport(httpx.AsyncBaseTransport):
    """An httpx transport that sends through one aiohttp session (made on first use, in the
    loop that uses it). Failures are httpx's: a connection refused or reset is
    `httpx.ConnectError`, a read past its timeout `httpx.ReadTimeout`, an answer cut short
    `httpx.RemoteProtocolError`: what the SDK and verifiers already read as the transport
    failing."""

    def __init__(self) -> None:
        self._session: Optional[aiohttp.ClientSession] = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                # no bound: every episode in flight holds one; an idle connection closed by
                # this side first (the router keeps one 30 s, the env server 60 s, an
                # interception server 75 s), never reused as its server closes it
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
                auto_decompress=False,  # httpx decodes the body by its headers, as its own transport's
                trust_env=False,
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            )
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        headers = [(k, v) for k, v in request.headers.multi_items() if k.lower() not in _OWN_HEADERS]
        body = await request.aread()
        try:
            response = await self.session().request(
                request.method,
                str(request.url),
                headers=headers,
                data=body or None,
                allow_redirects=False,
                timeout=_timeout(request),
            )
        except aiohttp.ConnectionTimeoutError as e:
            raise httpx.ConnectTimeout(f"no connection within the timeout: {e}", request=request) from e
        except asyncio.TimeoutError as e:  # aiohttp's SocketTimeoutError: no answer in time
            raise httpx.ReadTimeout(f"no answer within the read timeout: {e}", request=request) from e
        except aiohttp.ClientConnectionError as e:
            raise httpx.ConnectError(f"{type(e).__name__}: {e}", request=request) from e
        except aiohttp.ClientError as e:
            raise httpx.RemoteProtocolError(f"{type(e).__name__}: {e}", request=request) from e
        return httpx.Response(
            response.status,
            headers=list(response.raw_headers),
            stream=_Body(response, request),
            request=request,
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": (response.reason or "").encode()},
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


def async_client(timeout: Any = None, **kwargs: Any) -> httpx.AsyncClient:
    """An httpx client on an `AiohttpTransport` (`kwargs`: httpx's own, `auth`, `headers`,
    `trust_env`)."""
    return httpx.AsyncClient(timeout=timeout, transport=AiohttpTransport(), **kwargs)


def train_client_on_aiohttp() -> None:
    """verifiers' train client (the interception server's, one per worker) builds its SDK
    client here: verifiers' own construction (`clients.base.build_async_openai`: the
    config's base URL, key, headers and timeout, no retries) on an `AiohttpTransport`.
    Only the train client's: a judge's or an eval client's calls keep verifiers' own."""
    from openai import AsyncOpenAI
    from verifiers.v1.clients import base, train
    from verifiers.v1.configs.client import resolve_api_key, resolve_headers

    def build(config: Any) -> AsyncOpenAI:
        return AsyncOpenAI(
            base_url=config.base_url,
            api_key=resolve_api_key(config),
            default_headers=resolve_headers(config) or None,
            max_retries=base.MAX_RETRIES,
            # the envs' openai (verifiers' pin) takes an httpx client; the run's own is typed for its successor
            http_client=async_client(httpx.Timeout(**config.timeout.model_dump())),  # type: ignore[arg-type]
        )

    train.build_async_openai = build
