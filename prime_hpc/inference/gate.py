"""What the inference server adds in front of vLLM's app: the API key on every route (a
server without a key does not start), and the policy gate that keeps a weight update from
overlapping any generation.

`PolicyGate` counts the generation requests in flight, each held for its whole life
(queueing and decoding included), and serializes weight updates. An update applies in one
of two ways (`inference.weight_update`):

- in flight (`updating`): the requests in flight stay; the server pauses the engine
  (keeping them and their KV cache), loads and resumes, so a request may be produced by two
  (or more) policies;
- drain (`exclusive`, a writer-preferring lock): the update waits until the requests in
  flight have finished and new requests wait until it is done, so every completion was
  produced by exactly one policy.

Prefix caching stays right across updates in flight: each generation request is salted
with the policy it is admitted under (vLLM's `cache_salt`, `SALTED_PATHS`), so a request
never reuses KV blocks another policy computed, while the requests in flight keep theirs.

A server of a job that trains several runs (`trainer.max_concurrent_runs`) serves each run's
policy as a LoRA adapter named after the run, and keeps each one's step apart
(`PolicyGate.adapters`): a request is admitted, salted and stamped under the step of the
model it names (`step_for`); one naming the base model, under `step`.
The server stamps on each response the policy it started under and the one it ended under:
`policy_step` (the oldest, what the off-policy bound counts) and `policy_step_end` in the
JSON body, and the `x-policy-step` header (the start: streams get only the header).

The job's key is proven without being sent where a listener may not be the run's (`Proofs`):
a server answers `GET /identity?nonce=<hex>` (open, like `/health`) with an HMAC of the
nonce, its URL, its instance (a random id it publishes in its endpoint) and its pid; the
router and the weight relay send a server anything only once it has answered that for the
endpoint it published, and then sign each request for that instance
(`Authorization: prime-hpc-signature <hmac>` over the instance, the method, the path, the
query and the body's digest) instead of sending the key. A listener that took a dead
server's port can neither answer the challenge nor use a signature: it is bound to an
instance that no longer runs. A server answers a signed request with its own proof
(`x-prime-hpc-proof`: an HMAC of that signature), so a caller takes an answer only from the
instance it signed for: whatever answers at a dead server's address in the seconds before
anyone noticed is not taken for the server. The run's router answers the same challenge for
the instance its `endpoints/router.json` names, and takes signed requests the same way
(`ApiKey.admit`, `answer_identity`), so its clients never send it the key either. The
bearer key is still accepted from the user's own tools.

Pure ASGI, no vLLM import: unit-testable with any ASGI app.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import re
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

POLICY_HEADER = b"x-policy-step"
POLICY_FIELD = "policy_step"  # the policy a response started under (the oldest)
POLICY_END_FIELD = "policy_step_end"  # the policy it ended under
# Generation routes: a response produced by the model (incl. prompt logprobs for OPD).
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/inference/v1/generate")
# Generation routes whose request takes vLLM's `cache_salt`
SALTED_PATHS = ("/v1/chat/completions", "/v1/completions", "/inference/v1/generate")
SALT_MAX = 128  # vLLM's longest salt
# Open without a key: liveness only (the router and load balancers probe it).
OPEN_PATHS = ("/health", "/ping")
IDENTITY_PATH = "/identity"  # open: a server proves it holds the key without it being sent
SIGNATURE_SCHEME = "prime-hpc-signature"  # a request signed for one server instance, in place of the key
PROOF_HEADER = "x-prime-hpc-proof"  # a server's answer to a signed request: it is the instance signed for
NONCE = re.compile(r"[0-9a-f]{32,128}")  # a challenge's nonce: 16 to 64 random bytes, in hex

Scope = dict
Message = dict
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class UpdateTimeout(Exception):
    pass


class PolicyGate:
    def __init__(self, step: int = 0, weight_dir: Optional[str] = None) -> None:
        self.step = step
        self.weight_dir = weight_dir
        self.adapters: dict[str, int] = {}  # several runs' adapters: served name -> its policy step
        self.active = 0  # generation requests holding the gate
        self.served = 0  # generation requests completed
        # the last time the server was idle or finished a generation: with requests in flight
        # and this old, the engine is not getting anywhere (the watchdog's `progress_at`)
        self.progress_at = time.time()
        self._writer = False
        self._writers_waiting = 0
        self._updating = False  # an in-flight update is under way
        self._cond: Optional[asyncio.Condition] = None
        self._update_lock: Optional[asyncio.Lock] = None

    def step_for(self, model: Any) -> int:
        """The policy step of the served `model` (an adapter of a run of several, or the
        base model / the run's policy)."""
        return self.adapters.get(model, self.step) if isinstance(model, str) else self.step

    @property
    def cond(self) -> asyncio.Condition:
        if self._cond is None:  # bound to the serving loop on first use
            self._cond = asyncio.Condition()
        return self._cond

    @asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        async with self.cond:
            await self.cond.wait_for(lambda: not self._writer and not self._writers_waiting)
            if self.active == 0:
                self.progress_at = time.time()  # idle until now
            self.active += 1
        try:
            yield
        finally:
            async with self.cond:
                self.active -= 1
                self.served += 1
                self.progress_at = time.time()
                self.cond.notify_all()

    @asynccontextmanager
    async def exclusive(self, timeout_s: float) -> AsyncIterator[None]:
        """Wait (at most `timeout_s`) for in-flight generations to finish; block new ones."""
        async with self.cond:
            self._writers_waiting += 1
            try:
                await asyncio.wait_for(self.cond.wait_for(lambda: not self._writer and self.active == 0), timeout_s)
            except asyncio.TimeoutError:
                raise UpdateTimeout(f"{self.active} generation request(s) still running after {timeout_s:g}s") from None
            finally:
                self._writers_waiting -= 1
                self.cond.notify_all()
            self._writer = True
            self.progress_at = time.time()  # an update is work: its own progress is its end
        try:
            yield
        finally:
            async with self.cond:
                self._writer = False
                self.progress_at = time.time()
                self.cond.notify_all()

    @asynccontextmanager
    async def updating(self) -> AsyncIterator[None]:
        """One in-flight update at a time: generations go on being admitted (the engine,
        paused, keeps them until the update is done)."""
        if self._update_lock is None:
            self._update_lock = asyncio.Lock()
        async with self._update_lock:
            self._updating = True
            self.progress_at = time.time()
            try:
                yield
            finally:
                self._updating = False
                self.progress_at = time.time()  # an update is work: its own progress is its end

    @property
    def update_under_way(self) -> bool:
        """A weight update is under way (loading, or waiting to load)."""
        return self._writer or self._updating

    @property
    def busy(self) -> bool:
        """Generations in flight or an update under way: work that must make progress (an
        engine that hangs holds them)."""
        return self.active > 0 or self._writer or self._updating


class MissingKey(RuntimeError):
    """A listener was asked to serve without a key: prime-hpc never does."""


def is_preflight(scope: Scope) -> bool:
    """A real CORS preflight: OPTIONS with the `Origin` and `Access-Control-Request-Method`
    headers a browser sends (it carries no credentials by design); any other OPTIONS is a
    request like the rest and needs the key."""
    if scope.get("method") != "OPTIONS":
        return False
    names = {name.lower() for name, _ in scope.get("headers", [])}
    return b"origin" in names and b"access-control-request-method" in names


def _mac(key: bytes, *parts: str) -> str:
    return hmac.new(key, json.dumps(parts).encode(), hashlib.sha256).hexdigest()


class Proofs:
    """What the job's key proves without being sent, each an HMAC under a key derived from
    it for that purpose alone: a server's identity (its answer to a nonce) and a request's
    signature for one server instance."""

    def __init__(self, key: str) -> None:
        if not key:
            raise MissingKey("no API key: nothing can be proven without one")
        self._identity = hmac.new(key.encode(), b"prime-hpc: a server's identity", hashlib.sha256).digest()
        self._request = hmac.new(key.encode(), b"prime-hpc: a request to one server", hashlib.sha256).digest()
        self._answer = hmac.new(key.encode(), b"prime-hpc: a server's answer", hashlib.sha256).digest()

    def identity(self, nonce: str, url: str, instance: str, pid: Any) -> str:
        """A server's answer to `nonce`: bound to the URL it serves at, its instance and pid."""
        return _mac(self._identity, nonce, url, instance, str(pid))

    def signature(self, instance: str, method: str, path: str, query: str, body: bytes) -> str:
        """A request to the server `instance`, in place of the key."""
        return _mac(self._request, instance, method.upper(), path, query, hashlib.sha256(body).hexdigest())

    def answer(self, signature: str) -> str:
        """A server's proof, on its answer, that it is the instance a request was signed for."""
        return _mac(self._answer, signature)

    def answered(self, signature: str, headers: Any) -> bool:
        """`headers` (an answer's) carry the proof for the request signed `signature`."""
        return hmac.compare_digest(str(headers.get(PROOF_HEADER, "")).encode(), self.answer(signature).encode())


class ApiKey:
    """The API key a listener demands on every route but liveness (`OPEN_PATHS`) and a
    real CORS preflight. There is no open mode: a missing key is refused when the listener
    is built (`MissingKey`). Only its hash and the keys derived from it (`Proofs`) are kept."""

    def __init__(self, key: Optional[str]) -> None:
        if not key:
            raise MissingKey("no API key: a prime-hpc listener never serves without one")
        self.key_hash = hashlib.sha256(key.encode()).digest()
        self.proofs = Proofs(key)

    def allows(self, scope: Scope) -> bool:
        if scope.get("path", "") in OPEN_PATHS or is_preflight(scope):
            return True
        scheme, token = authorization(scope)
        return scheme == "bearer" and hmac.compare_digest(hashlib.sha256(token.encode()).digest(), self.key_hash)

    def signed(self, scope: Scope, instance: str, body: bytes) -> Optional[str]:
        """The request's signature when it is valid for this server `instance`
        (`Proofs.signature`), else None."""
        scheme, token = authorization(scope)
        if scheme != SIGNATURE_SCHEME:
            return None
        query = scope.get("query_string", b"").decode("latin-1")
        expected = self.proofs.signature(instance, scope.get("method", ""), scope.get("path", ""), query, body)
        return token if hmac.compare_digest(token.encode(), expected.encode()) else None

    async def admit(
        self, scope: Scope, receive: Receive, send: Send, me: Optional[dict]
    ) -> Optional[tuple[Receive, Send]]:
        """An HTTP request this listener takes: (`receive`, `send`) to serve it with, or
        None to refuse it (`refuse`). A request signed for this listener's instance
        (`me["instance"]`; its body read whole to check the signature and given back) is
        answered with the listener's proof for it (`PROOF_HEADER`); else the bearer key, or
        an open route, as `allows` says. `me` None: signatures are not taken."""
        if me is not None and authorization(scope)[0] == SIGNATURE_SCHEME:
            got, _ = await read_body(receive)
            body = got[0].get("body", b"") if got[0]["type"] == "http.request" else None
            signature = self.signed(scope, str(me["instance"]), body) if body is not None else None
            if signature is not None:
                return _replay(got, receive), _proving(send, self.proofs.answer(signature))
            receive = _replay(got, receive)
        return (receive, send) if self.allows(scope) else None

    @staticmethod
    async def refuse(send: Send) -> None:
        await send_json(send, 401, {"error": "Unauthorized: missing or wrong API key"})


async def answer_identity(key: ApiKey, scope: Scope, send: Send, me: Optional[dict]) -> None:
    """`GET /identity?nonce=<hex>`: who this listener is (`me`: its `url`, `instance` and
    `pid`, and what else it tells) and its proof for the nonce (`Proofs.identity`), which
    only a holder of the job's key can give."""
    from urllib.parse import parse_qs

    nonce = (parse_qs(scope.get("query_string", b"").decode("latin-1")).get("nonce") or [""])[0]
    if scope.get("method") != "GET" or not NONCE.fullmatch(nonce):
        return await send_json(send, 400, {"error": "ask GET /identity?nonce=<32 to 128 hex digits>"})
    if me is None:
        return await send_json(send, 503, {"error": "this listener does not know its address yet"})
    proof = key.proofs.identity(nonce, str(me["url"]), str(me["instance"]), me["pid"])
    return await send_json(send, 200, {**me, "nonce": nonce, "proof": proof})


def authorization(scope: Scope) -> tuple[str, str]:
    """The request's `Authorization` header as (scheme in lower case, credentials)."""
    for name, value in scope.get("headers", []):
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return scheme.lower(), token.strip()
    return "", ""


def signature_header(token: str) -> str:
    return f"{SIGNATURE_SCHEME} {token}"


async def send_json(send: Send, status: int, obj: Any) -> None:
    body = json.dumps(obj).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


class GateMiddleware:
    """API key (or a signature for this server) on everything but liveness and the identity
    challenge; the policy gate and stamp on generation routes. `identity()`: this server's
    `url`, `instance`, `pid` and `slot` (None until it knows its port); without it the
    server answers no challenge and takes no signature."""

    def __init__(
        self,
        app: Callable,
        gate: PolicyGate,
        api_key: Optional[str],
        identity: Optional[Callable[[], Optional[dict]]] = None,
    ) -> None:
        self.app = app
        self.gate = gate
        self.key = ApiKey(api_key)
        self.identity = identity

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        if scope["type"] == "http" and path == IDENTITY_PATH:
            me = self.identity() if self.identity is not None else None
            return await answer_identity(self.key, scope, send, me)
        if scope["type"] != "http" and not self.key.allows(scope):
            return None  # websocket: close without accepting
        if scope["type"] == "http" and (authorization(scope)[0] == SIGNATURE_SCHEME or not self.key.allows(scope)):
            admitted = await self.key.admit(scope, receive, send, self.identity() if self.identity else None)
            if admitted is None:
                return await self.key.refuse(send)
            receive, send = admitted
        if scope["type"] == "http" and scope.get("method") == "POST" and path in GENERATION_PATHS:
            async with self.gate.shared():
                got, obj = await read_body(receive)
                stamper = _Stamper(send, self.gate, obj.get("model") if obj is not None else None)
                if path in SALTED_PATHS and obj is not None:
                    obj["cache_salt"] = policy_salt(stamper.step, obj.get("cache_salt"))
                    scope, got = with_body(scope, json.dumps(obj).encode())
                return await self.app(scope, _replay(got, receive), stamper)
        return await self.app(scope, receive, send)


def policy_salt(step: int, salt: Any = None) -> str:
    """The cache salt of a request admitted under policy `step` (the client's own salt, if
    any, kept in front of it)."""
    mine = f"policy-{step}"
    if isinstance(salt, str) and salt:
        return salt[: SALT_MAX - len(mine) - 1] + "-" + mine
    return mine


async def read_body(receive: Receive) -> tuple[list[Message], Optional[dict]]:
    """The request's body read whole: (the messages read, to give to the app again; the
    body as a JSON object, or None when it is something else or the client left before
    sending it all)."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client left before sending it all
            return [message], None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    body = b"".join(chunks)
    try:
        obj = json.loads(body)
    except ValueError:
        obj = None
    return [{"type": "http.request", "body": body, "more_body": False}], obj if isinstance(obj, dict) else None


def with_body(scope: Scope, body: bytes) -> tuple[Scope, list[Message]]:
    """The request with `body` instead of the one it came with (its length header too)."""
    headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
    scope = {**scope, "headers": headers + [(b"content-length", str(len(body)).encode())]}
    return scope, [{"type": "http.request", "body": body, "more_body": False}]


def _proving(send: Send, proof: str) -> Send:
    """`send` with this server's proof (`PROOF_HEADER`) on the answer's start."""

    async def proving(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (PROOF_HEADER.encode(), proof.encode())]}
        await send(message)

    return proving


def _replay(first: list[Message], receive: Receive) -> Receive:
    """`receive` that gives `first` back, then goes on with the client's own (a disconnect)."""
    pending = list(first)

    async def replay() -> Message:
        return pending.pop(0) if pending else await receive()

    return replay


class _Stamper:
    """Adds the policy steps to a response: the one it started under in the header, always;
    that one and the one it ended under as JSON body fields when the body is a JSON object
    (buffered; streams pass through untouched)."""

    def __init__(self, send: Send, gate: PolicyGate, model: Any = None) -> None:
        self.send = send
        self.gate = gate
        self.model = model
        self.step = gate.step_for(model)
        self.start: Optional[Message] = None
        self.chunks: list[bytes] = []

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [(k, v) for k, v in message.get("headers", [])]
            headers.append((POLICY_HEADER, str(self.step).encode()))
            message = {**message, "headers": headers}
            ctype = dict((k.lower(), v) for k, v in headers).get(b"content-type", b"")
            if ctype.startswith(b"application/json"):
                self.start = message  # hold until the body is complete
                return
            return await self.send(message)
        if message["type"] == "http.response.body" and self.start is not None:
            self.chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = b"".join(self.chunks)
            try:
                obj = json.loads(body)
                if isinstance(obj, dict):
                    obj[POLICY_FIELD] = self.step
                    obj[POLICY_END_FIELD] = max(self.step, self.gate.step_for(self.model))
                    body = json.dumps(obj).encode()
            except ValueError:
                pass
            headers = [(k, v) for k, v in self.start["headers"] if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            await self.send({**self.start, "headers": headers})
            self.start = None
            return await self.send({"type": "http.response.body", "body": body})
        return await self.send(message)
