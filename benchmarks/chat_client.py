"""A v1 worker's chat turn: the CPU a turn's HTTP call costs the worker with an HTTP client
made for the turn (as the in-worker chat harness once did), with one httpx client kept
for every turn (httpx's own pool, as it did next, and as verifiers' train client does), and
with the worker's one client on aiohttp's pool (`prime_hpc.envserver.chat.client`, on
`envserver.transport`), side by side in one run.

Run with the envs' Python (verifiers >= 0.4, where the harness runs):

    .venv-envs/bin/python benchmarks/chat_client.py [--turns 400] [--concurrency 64]

A step's 64 episodes are in flight at once in a worker: httpcore's pool walks every
connection it holds on each request it takes and gives back, so its cost grows with them.

The endpoint is an aiohttp server in the same process and loop, as verifiers' interception
server is in a worker, answering each chat completion at once with a small reply: what is
measured is the call's own cost (the client, the connection, the request and the answer
on both sides), the part of an episode's CPU the client choice decides. Printed: CPU
seconds of the process per turn and turns per second for each, and their ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
from aiohttp import web  # noqa: E402

from prime_hpc.envserver.chat import client  # noqa: E402

REPLY = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "olleh"}, "finish_reason": "stop"}]}
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "Reverse: hello"}]}


async def answer(request: web.Request) -> web.Response:
    await request.json()
    return web.json_response(REPLY)


async def turn_new(url: str) -> None:
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), trust_env=False) as c:
        r = await c.post(url, json=BODY, headers={"Authorization": "Bearer s"})
    assert r.status_code == 200


_httpx_pool: list[httpx.AsyncClient] = []


async def turn_httpx_pool(url: str) -> None:
    if not _httpx_pool:
        _httpx_pool.append(
            httpx.AsyncClient(timeout=httpx.Timeout(None), limits=httpx.Limits(max_connections=None), trust_env=False)
        )
    r = await _httpx_pool[0].post(url, json=BODY, headers={"Authorization": "Bearer s"})
    assert r.status_code == 200


async def turn_shared(url: str) -> None:
    r = await client().post(url, json=BODY, headers={"Authorization": "Bearer s"})
    assert r.status_code == 200


async def measure(turn, url: str, turns: int, concurrency: int) -> tuple[float, float]:
    """(CPU seconds per turn, turns per second) of `turns` turns, `concurrency` at a time."""
    gate = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with gate:
            await turn(url)

    await asyncio.gather(*(one() for _ in range(concurrency)))  # warm: imports, the first connections
    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(one() for _ in range(turns)))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return cpu / turns, turns / wall


async def main(turns: int, concurrency: int, rounds: int) -> None:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    turns_of = {
        "a client per turn": turn_new,
        "one httpx client": turn_httpx_pool,
        "one client on aiohttp": turn_shared,
    }
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in turns_of}
    for _ in range(rounds):  # alternated against drift on a shared machine
        for name, turn in turns_of.items():
            results[name].append(await measure(turn, url, turns, concurrency))
    await client().aclose()
    await _httpx_pool[0].aclose()
    await runner.cleanup()
    print(f"{turns} turns x {rounds} rounds, {concurrency} at a time, endpoint in the same loop")
    print(f"{'':28}{'CPU ms / turn':>15}{'turns / s':>12}")
    best = {k: (min(c for c, _ in v), max(t for _, t in v)) for k, v in results.items()}
    for k, (cpu, rate) in best.items():
        print(f"{k:28}{cpu * 1000:15.2f}{rate:12.0f}")
    one_cpu, one_rate = best["one client on aiohttp"]
    for k in ("a client per turn", "one httpx client"):
        cpu, rate = best[k]
        print(f"on aiohttp vs {k}: {cpu / one_cpu:.2f}x less CPU a turn, {one_rate / rate:.2f}x the turns a second")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--turns", type=int, default=400)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    asyncio.run(main(a.turns, a.concurrency, a.rounds))
