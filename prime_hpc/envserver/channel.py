"""What every env-server worker shares (`worker.py`, `v1worker.py`): its command line, its
answer channel and its request loop. Standard library only: the v1 worker runs it under
another interpreter, with nothing of the run's stack.

A worker is started as `python -m <module> --spec <JSON> --id <N>` with stdin and stdout
pipes to its server: `open_worker` parses that, keeps the stdout it was started with as the
answers' channel and points fd 1 (and `sys.stdout`) at its log (stderr), so whatever an
env prints lands in the log; `serve_requests` says ready, then runs each request line
concurrently until stdin closes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from typing import Any, Callable, Coroutine


class Channel:
    """One JSON object a line to the server."""

    def __init__(self, out: Any) -> None:
        self.out = out

    def answer(self, obj: dict) -> None:
        self.out.write((json.dumps(obj) + "\n").encode())
        self.out.flush()


def open_worker(prog: str) -> tuple[dict, Channel]:
    """The worker's spec and answer channel, its log set up (`worker <id>` on each line,
    verifiers at the spec's `vf_level`)."""
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--spec", required=True, help="the env server's spec (JSON)")
    p.add_argument("--id", type=int, required=True)
    a = p.parse_args()
    out = os.fdopen(os.dup(1), "wb")  # the answers' channel; fd 1 becomes the log
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format=f"%(asctime)s %(levelname)s worker {a.id} %(name)s: %(message)s"
    )
    spec = json.loads(a.spec)
    logging.getLogger("verifiers").setLevel(str(spec.get("vf_level", "warning")).upper())
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return spec, Channel(out)


async def serve_requests(channel: Channel, ready: dict, one: Callable[[dict], Coroutine[Any, Any, None]]) -> None:
    """Say ready (`{"ready": true, "pid", **ready}`), then run `one` on each request line
    concurrently until stdin closes (the server is gone); the groups still running are
    cancelled."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 26)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    channel.answer({"ready": True, "pid": os.getpid(), **ready})
    running: set[asyncio.Task] = set()
    while line := await reader.readline():
        task = asyncio.create_task(one(json.loads(line)))
        running.add(task)
        task.add_done_callback(running.discard)
    for task in running:
        task.cancel()
