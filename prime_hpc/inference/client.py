"""Talking to a run's inference: find the servers and the router in `endpoints/`, and send
admin calls (weight updates) to every server directly. Generation goes through the router
(`Endpoints.openai_base_url`, with `orchestrator.client.make_client`).

Light imports (httpx only); the API key comes from `$INFERENCE_SERVER_API_KEY`. It is sent
to no listener of the run: a server gets nothing until it has proven it holds the key
(`challenge`, or `challenge_sync` for a synchronous client: an HMAC of a nonce, without
the key being sent), and then requests signed for that server's instance (`signed`), never
the key itself (`prime_hpc.inference.gate.Proofs`). So do the orchestrator's weight relay
(`Admin`) and the trainer's weight sender (`prime_hpc.inference.broadcast.Broadcaster`).
The router is proven the same way against its `endpoints/router.json` (`RouterLink`: its
`instance` and supervisor's pid) before a client's first request and after a broken
connection, and sent only requests signed for it (`RouterLink.auth`); the URLs `discover`
gives (`Endpoints.router`, `.openai_base_url`) carry that link (`RouterURL`), so every
client made from them (generation, the relay's `add_worker`, a teacher client) signs.

An endpoint a user names (`eval`/`synthesize` `client.base_url=`) is asked with a key of
its own, `$ENDPOINT_API_KEY` (`endpoint_key`), never the job's variable. `serve=<job>` is
asked through that job's router, proven against its router.json like the run's own and sent
signed requests: the key that job kept (its key file, or `$ENDPOINT_API_KEY` for a job of
someone else's) proves it and signs, and is never sent.
"""

from __future__ import annotations

import asyncio
import functools
import os
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from prime_hpc.core.jobenv import API_KEY_VAR
from prime_hpc.core.net import IDLE_CONNECTION_S
from prime_hpc.inference.gate import IDENTITY_PATH, Proofs, signature_header
from prime_hpc.rundir import RunDir, WaitTimeout, logtree, read_json, wait_for

POLICY_TIMEOUT_S = 10.0  # a `GET /policy` answers at once, even while the server loads weights
CHALLENGE_TIMEOUT_S = 10.0  # a server answers its identity challenge at once
ENDPOINT_KEY_VAR = "ENDPOINT_API_KEY"  # the key of an endpoint eval/synthesize are given (client.base_url=)
SERVE_DIR = "serve.dir"  # in eval's/synthesize's words once serve=<job> is resolved: that job's directory


class InferenceError(RuntimeError):
    """An admin call failed; the message names the server and what it answered."""


class NotProven(InferenceError):
    """A listener at a server's address did not prove it holds the job's key: nothing is
    sent to it."""


def api_key(var: str = API_KEY_VAR) -> Optional[str]:
    return os.environ.get(var) or None


def endpoint_key(opts: dict) -> Optional[str]:
    """The key of the endpoint `eval`/`synthesize` were given: for `serve=<job>` of the
    user's own serve job, the key it was submitted with (its key file, checked as
    `prime_hpc.core.keyfile` says), which proves that job's router and signs what it is sent;
    for any other endpoint, `$ENDPOINT_API_KEY` (sent as a bearer to a `client.base_url=`).
    Never the job's own variable: a base URL someone gave is not the job's."""
    served = opts.get(SERVE_DIR)
    if served and _owned(served):
        from prime_hpc.core import keyfile

        stored = keyfile.read(RunDir(served).private_dir)
        if stored:
            return stored
    return os.environ.get(ENDPOINT_KEY_VAR) or None


def _owned(path: str) -> bool:
    try:
        return os.stat(path).st_uid == os.getuid()
    except OSError:
        return False


async def challenge(client: Any, base: str, proofs: Proofs, record: Optional[dict] = None) -> str:
    """Ask the listener at `base` to prove it holds the job's key (`GET /identity` with a
    fresh nonce; no key is sent) as the server `record` the run published there (its
    `instance` and `pid`; None: as whatever instance it names). Its instance, or
    `NotProven` naming `base` and why; `httpx.HTTPError` when it does not answer."""
    nonce = secrets.token_hex(16)
    r = await client.get(base + IDENTITY_PATH, params={"nonce": nonce}, timeout=CHALLENGE_TIMEOUT_S, auth=None)
    return _proven(r, nonce, base, proofs, record)


def challenge_sync(client: Any, base: str, proofs: Proofs, record: Optional[dict] = None) -> str:
    """`challenge` with a synchronous httpx client (the trainer's weight sender, whose
    exchanges run in threads of their own)."""
    nonce = secrets.token_hex(16)
    r = client.get(base + IDENTITY_PATH, params={"nonce": nonce}, timeout=CHALLENGE_TIMEOUT_S, auth=None)
    return _proven(r, nonce, base, proofs, record)


def _proven(r: Any, nonce: str, base: str, proofs: Proofs, record: Optional[dict]) -> str:
    """The instance whose proof for `nonce` the answer `r` of the listener at `base`
    carries (as `record` names it, when given), or `NotProven`."""
    claimed = record if record is not None else _answer(r) or {}
    instance, pid = str(claimed.get("instance") or ""), claimed.get("pid")
    why = _disproof(r, nonce, base, proofs, instance, pid)
    if why == "http":
        raise NotProven(f"{base} answered the identity challenge with HTTP {r.status_code}: not a server of this run")
    if why == "instance":
        raise NotProven(f"{base}: its endpoint names no instance to prove")
    if why:
        raise NotProven(
            f"{base} did not prove it holds the job's key as the server the run published there "
            f"(instance {instance}, pid {pid}): nothing is sent to it"
        )
    return instance


def _answer(r: Any) -> Optional[dict]:
    """An identity challenge's answer as a JSON object (None: not one, or not HTTP 200)."""
    try:
        answer = r.json() if r.status_code == 200 else None
    except ValueError:
        answer = None
    return answer if isinstance(answer, dict) else None


def _disproof(r: Any, nonce: str, base: str, proofs: Proofs, instance: str, pid: Any) -> str:
    """Why the answer `r` is not the proof of `instance` and `pid` at `base` for `nonce`:
    "http" (no JSON answer), "instance" (none to prove), "proof" (a wrong one); "" when it
    is."""
    answer = _answer(r)
    if answer is None:
        return "http"
    if not instance:
        return "instance"
    expected = proofs.identity(nonce, base, instance, pid)
    return "" if secrets.compare_digest(str(answer.get("proof", "")), expected) else "proof"


def signed(proofs: Proofs, instances: dict[str, str]) -> Any:
    """httpx auth: each request signed for the instance its server proved it is
    (`instances`, base URL -> instance) in place of the key, and its answer taken only with
    that instance's proof (`gate.PROOF_HEADER`); a request to a server that has not proven
    itself is not sent, an answer without the proof not taken (`NotProven`)."""
    return _signed_class()(proofs, instances)


@functools.cache
def _signed_class() -> Any:
    import httpx

    class Signed(httpx.Auth):
        requires_request_body = True

        def __init__(self, proofs: Proofs, instances: dict[str, str]) -> None:
            self.proofs = proofs
            self.instances = instances

        def auth_flow(self, request: httpx.Request) -> Any:
            base = f"{request.url.scheme}://{request.url.netloc.decode('ascii')}"
            instance = self.instances.get(base)
            if instance is None:
                raise NotProven(f"{base} has not proven it holds the job's key: nothing is sent to it")
            token = self.proofs.signature(
                instance, request.method, request.url.path, request.url.query.decode("latin-1"), request.content
            )
            request.headers["Authorization"] = signature_header(token)
            response = yield request
            if not self.proofs.answered(token, response.headers):
                raise NotProven(f"{base} answered without the proof of the server it was sent to: not taken")

    return Signed


class RouterLink:
    """The run's router as its clients reach it, found through `path` (`endpoints/router.json`,
    the teacher's `teacher_router.json`: its `url`, `instance` and `supervisor_pid`). It is
    proven (`GET /identity` with a fresh nonce, answered with an HMAC under a key derived
    from the job's `key`, default `$INFERENCE_SERVER_API_KEY`) before the first request and
    again after a broken connection or an answer without its proof; every request then goes
    signed for its instance instead of carrying the key (`auth`), and its answer is taken
    only with the router's proof for that signature. A listener at the address that cannot
    prove it (a `router.json` left by a supervisor killed outright, its port someone
    else's) gets a nonce and nothing else: `NotProven`, one line naming the file and the
    address."""

    def __init__(self, path: os.PathLike | str, key: Optional[str] = None) -> None:
        self.path = Path(path)
        self.key = key
        self.url: Optional[str] = None  # the router proven, at this URL ...
        self.instance: Optional[str] = None  # ... as this instance (None: prove it first)
        self.record: dict = {}  # router.json as it was when proven

    @functools.cached_property
    def proofs(self) -> Proofs:
        return Proofs(self.key or api_key() or "")

    def using(self, key: Optional[str]) -> RouterLink:
        """This link, proving with `key` (None: its own)."""
        return self if key is None or key == self.key else RouterLink(self.path, key)

    def forget(self) -> None:
        """Prove the router again before the next request."""
        self.instance = None

    def read(self) -> dict:
        """`router.json` as it is now; `NotProven` naming it when it names no router."""
        try:
            record = read_json(self.path)
        except (OSError, ValueError) as e:
            raise NotProven(f"{self.path} names no router ({type(e).__name__}): nothing is sent") from None
        if not isinstance(record, dict) or not record.get("url"):
            raise NotProven(f"{self.path} names no router URL: nothing is sent")
        return record

    def probe(self) -> tuple[str, dict, Any]:
        """(nonce, router.json, the identity challenge to send to the router it names)."""
        import httpx

        record, nonce = self.read(), secrets.token_hex(16)
        request = httpx.Request(
            "GET",
            str(record["url"]) + IDENTITY_PATH,
            params={"nonce": nonce},
            extensions={"timeout": httpx.Timeout(CHALLENGE_TIMEOUT_S).as_dict()},
        )
        return nonce, record, request

    def take(self, answer: Any, nonce: str, record: dict) -> str:
        """The router's instance, once `answer` (to `probe`'s challenge) proves it as
        `record` names it; else `NotProven` naming the file and the address."""
        base, instance, pid = str(record["url"]), str(record.get("instance") or ""), record.get("supervisor_pid")
        why = _disproof(answer, nonce, base, self.proofs, instance, pid)
        if why:
            detail = {
                "http": f"it answered the identity challenge with HTTP {answer.status_code}",
                "instance": "the file names no instance to prove",
                "proof": f"not as the instance {instance} of pid {pid}",
            }[why]
            raise NotProven(
                f"{self.path} names the router at {base}, which did not prove it holds the job's key ({detail}): "
                "nothing is sent to it (a router that is gone left the file?)"
            )
        self.url, self.instance, self.record = base, instance, record
        return instance

    def prove(self, client: Any) -> str:
        """Prove the router with the synchronous httpx `client`; its instance."""
        nonce, record, request = self.probe()
        return self.take(client.send(request), nonce, record)

    def proven_for(self, request: Any) -> bool:
        """Is the router `request` goes to proven? (Not yet, not since a broken connection,
        or another than router.json named then: it is proven again first.)"""
        return self.instance is not None and _base(request) == self.url

    def sign(self, request: Any) -> str:
        """Sign `request` for the proven router; the signature."""
        base = _base(request)
        if base != self.url or self.instance is None:
            raise NotProven(f"{self.path} names the router at {self.url}, not {base}: nothing is sent there")
        token = self.proofs.signature(
            self.instance, request.method, request.url.path, request.url.query.decode("latin-1"), request.content
        )
        request.headers["Authorization"] = signature_header(token)
        return token

    def check(self, token: str, response: Any) -> None:
        """`response` carries the router's proof for the request signed `token`; else the
        router is proven again before the next request and `NotProven`."""
        if not self.proofs.answered(token, response.headers):
            self.forget()
            raise NotProven(
                f"{self.path}: the answer from {self.url} does not carry the router's proof "
                f"(HTTP {response.status_code}): not taken"
            )

    def auth(self) -> Any:
        """httpx auth (sync or async clients) that proves, signs and checks as above."""
        return _router_auth_class()(self)


@functools.cache
def _router_auth_class() -> Any:
    import httpx

    class RouterAuth(httpx.Auth):
        def __init__(self, link: RouterLink) -> None:
            self.link = link

        def sync_auth_flow(self, request: httpx.Request) -> Any:
            request.read()
            if not self.link.proven_for(request):
                nonce, record, probe = self.link.probe()
                answer = yield probe
                answer.read()
                self.link.take(answer, nonce, record)
            token = self.link.sign(request)
            try:
                response = yield request
            except GeneratorExit:  # no answer (a broken connection): proven again before the next
                self.link.forget()
                raise
            self.link.check(token, response)

        async def async_auth_flow(self, request: httpx.Request) -> Any:
            await request.aread()
            if not self.link.proven_for(request):
                nonce, record, probe = self.link.probe()
                answer = yield probe
                await answer.aread()
                self.link.take(answer, nonce, record)
            token = self.link.sign(request)
            try:
                response = yield request
            except GeneratorExit:  # no answer (a broken connection): proven again before the next
                self.link.forget()
                raise
            self.link.check(token, response)

    return RouterAuth


def _base(request: Any) -> str:
    """The scheme and address an httpx request goes to (`http://host:port`)."""
    return f"{request.url.scheme}://{request.url.netloc.decode('ascii')}"


class RouterURL(str):
    """A URL of the run's router (its base, or its OpenAI base `.../v1`) that carries the
    `RouterLink` to prove it and sign for it: a client made with it sends no key."""

    link: RouterLink

    def __new__(cls, value: str, link: RouterLink) -> RouterURL:
        made = super().__new__(cls, value)
        made.link = link
        return made


def router_link(router: str) -> RouterLink:
    """The link a router URL carries (`RouterURL`); a plain URL has none: `NotProven`."""
    link = getattr(router, "link", None)
    if not isinstance(link, RouterLink):
        raise NotProven(f"{router}: no router.json to prove this router against: nothing is sent to it")
    return link


def headers(key: Optional[str] = None) -> dict[str, str]:
    key = key if key is not None else api_key()
    return {"Authorization": f"Bearer {key}"} if key else {}


def error_detail(r: Any) -> str:
    """What a server's error answer says (its JSON `error`, or vLLM's `error.message`, or
    the body), cut to 300 characters for a one-line message."""
    try:
        body = r.json()
    except ValueError:
        body = None
    detail = body.get("error", r.text) if isinstance(body, dict) else r.text
    if isinstance(detail, dict):
        detail = detail.get("message", detail)
    return str(detail)[:300]


@dataclass
class Endpoints:
    router: str  # base URL (no /v1); from `discover`, a `RouterURL`
    servers: list[str]  # base URLs, node order
    server_records: list[dict]

    @property
    def openai_base_url(self) -> str:
        link = getattr(self.router, "link", None)
        return RouterURL(self.router + "/v1", link) if isinstance(link, RouterLink) else self.router + "/v1"


LEAVING_STATUS = 410  # a server's answer to an update once it is on its way out (the run drops it: it left)
OWN_SETTLE_S = 20.0  # the run's own inference job: how long its first server waits for the others


def wait_for_servers(
    run: RunDir,
    nodes: int,
    timeout_s: float,
    logs: Optional[Path] = None,
    alive: Any = None,
    own_job: bool = False,
) -> list[dict]:
    """Every server's endpoint record, in node order, once all have published one. With
    `own_job` the servers are another job's (cluster.inference_job=own), whose nodes may be
    fewer by now (a node lost): once one of them, of any slot, has published one, and then
    `nodes` of them or `OWN_SETTLE_S` more (the relay takes in later ones as they come)."""
    if own_job:
        wait_for(
            run.server_slots,
            what=f"an endpoint of an inference server in {run.endpoints_dir}",
            timeout_s=timeout_s,
            producer="the run's inference job (prime-hpc status: its extra jobs)",
            producer_log=None,
            alive=alive,
        )
        deadline = time.monotonic() + OWN_SETTLE_S
        while len(run.server_slots()) < nodes and time.monotonic() < deadline:
            time.sleep(0.5)
        return list(run.server_endpoints().values())
    records = []
    for node in range(nodes):
        path = run.inference_endpoint(node)
        wait_for(
            path.exists,
            what=str(path),
            timeout_s=timeout_s,
            producer=f"{run.group} server on node {node}",
            producer_log=logtree.node_log(logs, run.group, node) if logs else None,
            alive=alive,
        )
        records.append(read_json(path))
    return records


def discover(
    run: RunDir,
    nodes: int,
    timeout_s: float = 900.0,
    logs: Optional[Path] = None,
    alive: Any = None,
    own_job: bool = False,
    key: Optional[str] = None,
) -> Endpoints:
    """Wait until every server has published its endpoint and the router its own, and
    (with a key: `key`, else `$INFERENCE_SERVER_API_KEY`) proved itself against it
    (`RouterLink`): a `router.json` whose router does not prove itself is waited past,
    named in one line, until a router publishes one again (a process without a key sends
    none: it only waits for the file)."""
    records = wait_for_servers(run, nodes, timeout_s, logs, alive, own_job)
    link = RouterLink(run.router_endpoint, key)
    said: set[str] = set()  # why the router named was not taken, each said once
    latest: list[str] = []  # the last of them

    def proven() -> Optional[dict]:
        import httpx

        if not link.path.exists():
            return None
        if not (link.key or api_key()):
            return read_json(link.path)
        try:
            with httpx.Client() as client:
                link.prove(client)
            return link.record
        except (NotProven, httpx.HTTPError) as e:
            why = str(e) if isinstance(e, NotProven) else f"{link.path}: its router does not answer ({e})"
            if why not in said:
                print(f"prime-hpc: {why}; waiting for a router that proves itself", file=sys.stderr, flush=True)
            said.add(why)
            latest[:] = [why]
            link.forget()
            return None

    what = f"{link.path}, naming a router that proves it holds the job's key"
    try:
        router = wait_for(
            proven,
            what=what,
            timeout_s=timeout_s,
            producer="router" if run.group == "inference" else f"{run.group} router",
            producer_log=logtree.router_log(logs, 0, run.group) if logs else None,
            alive=alive,
        )
    except WaitTimeout as e:
        raise WaitTimeout(str(e).replace(what, f"{what} (last: {latest[0]})" if latest else what, 1)) from None
    return Endpoints(
        router=RouterURL(str(router["url"]), link), servers=[r["url"] for r in records], server_records=records
    )


class Admin:
    """Admin calls to every live server of a run, concurrently. A server that no longer
    answers at all (connection refused or cut, no `/health`) is lost: it is dropped from
    this and every later call (`lost` says which and why, `on_lost` is told) and the run
    goes on with the others (with none, a call reaches no server and returns []); so is one
    that answers it is on its way out (`LEAVING_STATUS`), and so is a listener at a
    server's address that does not prove it holds the key (`challenge`: asked before the
    first call to a server and again after any broken connection, against the endpoint it
    published when `expect` was told it). Any other failure (a server that answers with an
    error) raises one `InferenceError` naming it. Servers join (`add`, after they loaded
    the current policy: `to=[url]`) and leave (`remove`) while the run goes on. Requests
    are signed for the instance each server proved it is (`signed`); the key is never
    sent."""

    def __init__(
        self, servers: list[str], key: Optional[str] = None, timeout_s: float = 900.0, on_lost: Any = None
    ) -> None:
        self.servers = list(servers)
        self.key = key if key is not None else api_key()
        self.timeout_s = timeout_s
        self.lost: dict[str, str] = {}  # server URL -> why it was dropped
        self.on_lost = on_lost  # on_lost(url, why): called once per lost server
        self.instances: dict[str, str] = {}  # server URL -> the instance it proved it is
        self.published: dict[str, dict] = {}  # server URL -> the endpoint it published (`expect`)
        self._client: Any = None  # kept open: one connection per server, reused by every update
        self._loop: Any = None  # the event loop it belongs to

    def client(self) -> Any:
        import httpx

        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            self._client = httpx.AsyncClient(
                timeout=self.timeout_s,
                auth=signed(self.proofs, self.instances),
                limits=httpx.Limits(keepalive_expiry=IDLE_CONNECTION_S),
            )
            self._loop = loop
        return self._client

    @functools.cached_property
    def proofs(self) -> Proofs:
        return Proofs(self.key or "")

    def expect(self, server: str, record: dict) -> None:
        """`server` must prove it is the server `record` (its endpoint) names before it is
        sent anything more."""
        if self.published.get(server, {}).get("instance") != record.get("instance"):
            self.instances.pop(server, None)
        self.published[server] = record

    async def verify(self, server: str) -> None:
        """`server` proves it holds the key (`challenge`), as the endpoint it published when
        known; `NotProven` otherwise."""
        self.instances[server] = await challenge(self.client(), server, self.proofs, self.published.get(server))

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    @property
    def live(self) -> list[str]:
        return [s for s in self.servers if s not in self.lost]

    def add(self, server: str) -> None:
        """`server` takes part in every later call (it was lost before: not any more)."""
        self.lost.pop(server, None)
        if server not in self.servers:
            self.servers.append(server)

    def remove(self, server: str) -> None:
        """`server` takes no part in later calls (it left the run)."""
        if server in self.servers:
            self.servers.remove(server)
        self.lost.pop(server, None)
        self.instances.pop(server, None)
        self.published.pop(server, None)

    async def _gone(self, client: Any, base: str) -> bool:
        """Does the server no longer answer at all? (It may only have been slow.)"""
        import httpx

        try:
            await client.get(base + "/health", timeout=5, auth=None)  # liveness: open, nothing signed
            return False
        except httpx.HTTPError:
            return True

    async def _post_all(self, path: str, body: Optional[dict], to: Optional[list[str]] = None) -> list[dict]:
        """POST to every live server (`to`: only these, which need not be members yet)."""
        return [answer for _, answer in await self._call_all("POST", path, body or {}, to)]

    async def _call_all(
        self,
        method: str,
        path: str,
        body: Optional[dict],
        to: Optional[list[str]] = None,
        timeout_s: Optional[float] = None,
    ) -> list[tuple[str, dict]]:
        """`method` `path` on every live server (`to`: only these): (server, answer) of each
        that answered (a lost one is left out; see the class)."""
        import httpx

        client = self.client()

        async def one(base: str) -> dict:
            try:
                if base not in self.instances:
                    await self.verify(base)
                r = await client.request(method, base + path, json=body, timeout=timeout_s or self.timeout_s)
            except NotProven as e:
                return {"lost": str(e)}
            except httpx.HTTPError as e:
                self.instances.pop(base, None)  # proven again before anything more is sent
                why = f"{type(e).__name__}: {e}"
                if (
                    isinstance(e, httpx.TransportError)
                    and not isinstance(e, httpx.TimeoutException)
                    and await self._gone(client, base)
                ):
                    return {"lost": why}
                raise InferenceError(f"{base}{path}: {why}") from None
            if r.status_code == LEAVING_STATUS:  # on its way out: as good as lost, not a failed update
                return {"lost": error_detail(r)}
            if r.status_code == 401:  # not the instance it proved: another process answers at its address
                self.instances.pop(base, None)
                return {"lost": f"{base} refused the signature for the server it proved to be (HTTP 401)"}
            if r.status_code != 200:
                raise InferenceError(f"{base}{path}: HTTP {r.status_code}: {error_detail(r)}")
            return r.json()

        live = self.live if to is None else list(to)
        results = await asyncio.gather(*(one(s) for s in live), return_exceptions=True)
        for base, r in zip(live, results):
            if isinstance(r, dict) and set(r) == {"lost"}:
                if to is not None:  # not a member: the caller decides
                    raise InferenceError(f"{base}{path}: {r['lost']}")
                self.lost[base] = r["lost"]
                if self.on_lost is not None:
                    self.on_lost(base, r["lost"])
        errors = [str(r) for r in results if isinstance(r, BaseException)]
        if errors:
            raise InferenceError("; ".join(errors))
        return [(b, r) for b, r in zip(live, results) if not (isinstance(r, dict) and set(r) == {"lost"})]  # type: ignore[misc]

    async def update_weights(
        self, weight_dir: os.PathLike | str, step: int, to: Optional[list[str]] = None
    ) -> list[dict]:
        """Every server (`to`: these): load `weight_dir` (in flight or after draining, as
        `inference.weight_update` says) and serve `step`."""
        return await self._post_all("/update_weights", {"weight_dir": str(weight_dir), "step": int(step)}, to)

    async def reload_base(self, to: Optional[list[str]] = None) -> list[dict]:
        return await self._post_all("/reload_weights", None, to)

    async def load_lora(
        self, name: str, path: os.PathLike | str, step: int, to: Optional[list[str]] = None
    ) -> list[dict]:
        return await self._post_all(
            "/load_lora_adapter", {"lora_name": name, "lora_path": str(path), "step": int(step)}, to
        )

    async def policy_of(self, to: Optional[list[str]] = None) -> dict[str, dict]:
        """{server: its `GET /policy`} of every live server (`to`: these); a server that no
        longer answers is lost, as in any call."""
        return dict(await self._call_all("GET", "/policy", None, to, timeout_s=POLICY_TIMEOUT_S))

    async def policies(self) -> list[dict]:
        for s in self.live:
            if s not in self.instances:
                await self.verify(s)
        rs = await asyncio.gather(*(self.client().get(s + "/policy", timeout=30) for s in self.live))
        return [r.json() for r in rs]


async def add_worker(router: str, server: str) -> None:
    """Ask the router (a `RouterURL`: proven against its router.json, the request signed)
    to send requests to `server` too (it must be published in `endpoints/`); raises
    `InferenceError` when the router refuses, does not answer or does not prove itself
    (`NotProven`)."""
    import httpx

    link = router_link(router)
    try:
        async with httpx.AsyncClient(timeout=30, auth=link.auth()) as client:
            r = await client.post(router + "/add_worker", params={"url": server})
    except httpx.HTTPError as e:
        raise InferenceError(f"{router}/add_worker: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
        raise InferenceError(f"{router}/add_worker?url={server}: HTTP {r.status_code}: {r.text[:300]}")


async def forget_worker(router: str, server: str) -> None:
    """Ask the router (a `RouterURL`, as `add_worker`) to stop sending requests to
    `server` (best effort: a router that does not answer, or does not prove itself, finds
    the dead server by its own health checks, or is not the run's)."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=10, auth=router_link(router).auth()) as client:
            await client.post(router + "/remove_worker", params={"url": server})
    except (httpx.HTTPError, InferenceError):
        pass
