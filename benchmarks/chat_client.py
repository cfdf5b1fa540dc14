"""A v1 worker's chat turn: the CPU a turn's HTTP call costs the worker with an HTTP client
made for the turn (as the in-worker chat harness did) against the worker's one client
(`prime_hpc.envserver.chat.client`), side by side in one run.

Run with the envs' Python (verifiers >= 0.4, where the harness runs):

    .venv-envs/bin/python benchmarks/chat_client.py [--turns 400] [--concurrency 16]

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
    results: dict[str, list[tuple[float, float]]] = {"a client per turn": [], "the worker's one client": []}
    for _ in range(rounds):  # ABBA-like alternation against drift on a shared machine
        results["a client per turn"].append(await measure(turn_new, url, turns, concurrency))
        results["the worker's one client"].append(await measure(turn_shared, url, turns, concurrency))
    await runner.cleanup()
    print(f"{turns} turns x {rounds} rounds, {concurrency} at a time, endpoint in the same loop")
    print(f"{'':28}{'CPU ms / turn':>15}{'turns / s':>12}")
    best = {k: (min(c for c, _ in v), max(t for _, t in v)) for k, v in results.items()}
    for k, (cpu, rate) in best.items():
        print(f"{k:28}{cpu * 1000:15.2f}{rate:12.0f}")
    (new_cpu, new_rate), (one_cpu, one_rate) = best.values()
    print(
        f"one client vs per turn: {new_cpu / one_cpu:.2f}x less CPU a turn, {one_rate / new_rate:.2f}x the turns a second"
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--turns", type=int, default=400)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    asyncio.run(main(a.turns, a.concurrency, a.rounds))
