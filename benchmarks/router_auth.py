"""What proving the job's key without sending it costs, per request and per admission.

The router sends a server nothing until it has answered an identity challenge (an HMAC of
a nonce: per admission, and at each health check every 5 s), then signs every request it
forwards for that server's instance and takes the answer only with the server's proof
(`prime_hpc.inference.gate.Proofs`). This measures, side by side in one run, on loopback:

* a request straight to a gated server with the bearer key (no router);
* the same request through the router, the caller sending the bearer key (the user's own
  tools), the router signing it for the server and checking the answer's proof;
* the same request through the router, signed by the caller for the router's instance and
  its answer's proof checked (`client.RouterLink`: the run's own clients, which prove the
  router once per connection and never send it the key);
* the signing work alone, per request (the router's signature and answer check, the
  server's verification and proof), in this process;
* one identity challenge (what an admission, or a health check, adds).

with a small chat request (~1 KB) and a large one (~64 KB of prompt). The signing work's
share of a routed request is the figure: the challenge is paid per admission, never per
request. A real generation (milliseconds to seconds) dwarfs both.

From the repository root:

    .venv/bin/python benchmarks/router_auth.py [--requests 400]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

KEY = secrets.token_urlsafe(32)


async def answer(scope, receive, send) -> None:
    """A server's app that answers at once (what is measured is everything around it)."""
    if scope["type"] != "http":
        return
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    body = json.dumps({"choices": [{"text": "ok"}]}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


def serve(app) -> str:
    import uvicorn

    from prime_hpc.core.net import LOOPBACK, bound_socket, url

    sock = bound_socket(LOOPBACK)
    sock.listen(256)
    server = uvicorn.Server(uvicorn.Config(app, fd=sock.fileno(), log_level="error", access_log=False))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    return url(LOOPBACK, sock.getsockname()[1])


def timed(fn, n: int) -> float:
    """Median seconds of `fn()` over `n` calls (after 20 to warm up)."""
    for _ in range(20):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(client, signer, server: str, front: str, body: bytes, proofs, instance: str, n: int) -> tuple:
    """Median seconds of the request straight to the server, through the router (bearer
    key, then signed by `signer`), and of the signing work alone."""
    headers = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    direct = timed(lambda: client.post(server + "/v1/completions", content=body, headers=headers), n)
    routed = timed(lambda: client.post(front + "/v1/completions", content=body, headers=headers), n)
    json_only = {"content-type": "application/json"}
    signed = timed(lambda: signer.post(front + "/v1/completions", content=body, headers=json_only), n)

    def signing() -> None:
        token = proofs.signature(instance, "POST", "/v1/completions", "", body)  # the router
        assert proofs.signature(instance, "POST", "/v1/completions", "", body) == token  # the server
        proof = proofs.answer(token)  # the server's answer
        assert proofs.answered(token, {"x-prime-hpc-proof": proof})  # the router's check

    return direct, routed, signed, timed(signing, n * 5)


def main() -> int:
    import httpx

    from prime_hpc.inference.client import RouterLink, challenge
    from prime_hpc.inference.gate import GateMiddleware, PolicyGate, Proofs
    from prime_hpc.inference.router import Router
    from prime_hpc.rundir import RunDir, atomic_write_json

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=400)
    a = p.parse_args()
    me: dict = {}
    server = serve(GateMiddleware(answer, PolicyGate(), KEY, identity=lambda: me or None))
    me.update(url=server, instance=secrets.token_hex(16), pid=os.getpid(), slot="inference_0")
    run = RunDir(Path(os.environ.get("TMPDIR", "/tmp")) / f"router-auth-{os.getpid()}")
    atomic_write_json(run.inference_endpoint(0), {**me, "node": 0})
    router = Router([server], KEY, run)
    front = serve(router)
    router.identity = {"url": front, "instance": secrets.token_hex(16), "pid": os.getpid()}
    atomic_write_json(
        run.router_endpoint, {"url": front, "instance": router.identity["instance"], "supervisor_pid": os.getpid()}
    )
    while not router.up():
        time.sleep(0.05)
    proofs = Proofs(KEY)
    print(f"prime-hpc router auth: {a.requests} requests each, loopback, median; python {sys.version.split()[0]}")
    print(
        f"{'request':>10} {'direct ms':>10} {'router ms':>10} {'signed ms':>10} {'x bearer':>9} "
        f"{'signing us':>11} {'share':>7}"
    )
    nodelay = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]  # no 40 ms of Nagle against delayed ACKs
    link = RouterLink(run.router_endpoint, KEY)
    with (
        httpx.Client(timeout=30, transport=httpx.HTTPTransport(socket_options=nodelay)) as client,
        httpx.Client(timeout=30, auth=link.auth(), transport=httpx.HTTPTransport(socket_options=nodelay)) as signer,
    ):
        for label, size in (("~1 KB", 1000), ("~64 KB", 64_000)):
            body = json.dumps({"model": "m", "prompt": "x" * size, "max_tokens": 8}).encode()
            direct, routed, signed, work = measure(
                client, signer, server, front, body, proofs, me["instance"], a.requests
            )
            print(
                f"{label:>10} {direct * 1e3:10.3f} {routed * 1e3:10.3f} {signed * 1e3:10.3f} {signed / routed:9.3f} "
                f"{work * 1e6:11.1f} {work / routed:7.2%}"
            )

    async def challenges() -> float:
        async with httpx.AsyncClient() as c:
            times = []
            for _ in range(50):
                t0 = time.perf_counter()
                await challenge(c, server, proofs, {**me})
                times.append(time.perf_counter() - t0)
            return statistics.median(times)

    once = asyncio.run(challenges())
    print(f"one identity challenge (per admission, and per health check every 5 s): {once * 1e3:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
