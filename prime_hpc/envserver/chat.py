"""The chat harness of a v1 worker: verifiers' plain chat loop (the `null` harness), run
in the worker itself when the task gives the model no tools.

verifiers' `null` harness runs its chat program as a subprocess of the runtime, one per
episode (a Python start and the openai/mcp imports: ~1-2 CPU-s each, more than the tiny
model's whole turn). A task without tool servers needs none of that: this harness posts
the conversation to the episode's interception endpoint itself (non-streaming, the
endpoint's bearer secret) and stops at the reply, as the chat program does when a reply
calls no tool, or cleanly at a full context, as it does without compaction. The
interception server records the trace as for the program, so the episode is the same;
verifiers allows a harness its loop in-process on that condition (`Harness.launch`). A
task with tool servers runs verifiers' program as before (`NullHarness.launch`, which
prepares it from the wheelhouse on its first use).

Runs under the env's interpreter (verifiers >= 0.4), imported only by `v1worker.py`,
which names it to verifiers by the top-level id `HARNESS_ID`.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

import httpx
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.errors import MODEL_TRANSPORT_ERROR_EXIT_CODE
from verifiers.v1.harnesses.null import NullHarness
from verifiers.v1.harnesses.utils.compaction import CONTEXT_OVERFLOW_MARKERS
from verifiers.v1.runtimes import ProgramResult

from prime_hpc.envserver.transport import async_client

HARNESS_ID = "prime_hpc_chat"

__all__ = ["InWorkerChat"]


_client: Optional[tuple[asyncio.AbstractEventLoop, httpx.AsyncClient]] = None


def client() -> httpx.AsyncClient:
    """One HTTP client for every episode of this worker (a client serves the event loop it
    was made on: the worker's one), its connections to the interception endpoint kept
    alive: not a client per turn, whose making (a TLS context loaded from the CA bundle,
    for a plain-HTTP endpoint too) and connect cost more than the turn's own work
    (docs/benchmarks.md). No deadline and no bound on connections: the endpoint is this
    process's own loop, busy with every episode of the worker (the chat program's 5 s
    connect deadline failed whole groups under a full queue), and every episode in flight
    holds one request."""
    global _client
    loop = asyncio.get_running_loop()
    if _client is None or _client[0] is not loop:
        made = async_client(httpx.Timeout(None), trust_env=False)
        _client = (loop, made)
    return _client[1]


def overflowed(status: int, body: str) -> bool:
    """Whether an answer says the conversation outgrew the model's context (verifiers' own
    test of it, `compaction.is_context_overflow`, on an HTTP answer)."""
    return status in (400, 413) and any(m in body.casefold() for m in CONTEXT_OVERFLOW_MARKERS)


def opening(system: Optional[str], prompt: Any) -> list[dict]:
    """The conversation the chat program would open with."""
    messages = [{"role": "system", "content": system}] if system else []
    if isinstance(prompt, str):
        messages.append({"role": "user", "content": prompt})
    elif prompt is not None:
        messages.extend(message_to_wire(m) for m in prompt)
    return messages


class InWorkerChat(NullHarness):
    async def setup(self, runtime: Any) -> None:
        """Nothing to prepare for a task without tools; a task with tools prepares the
        chat program in its launch (`launch_chat_program`)."""

    async def launch(
        self,
        ctx: Any,
        trace: Any,
        runtime: Any,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: Any,
        tool_interception_url: Optional[str] = None,
    ) -> Any:
        if mcp_urls:
            return await super().launch(ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url)
        system, prompt = self.resolve_prompt(data)
        body = {"model": ctx.model, "messages": opening(system, prompt)}
        try:
            r = await client().post(
                f"{endpoint.rstrip('/')}/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {secret}"},
            )
        except httpx.TransportError as e:  # verifiers reads this exit as the interception failing
            return ProgramResult(MODEL_TRANSPORT_ERROR_EXIT_CODE, "", f"{type(e).__name__}: {e}")
        if overflowed(r.status_code, r.text):
            # a full context ends the episode as the chat program ends it, cleanly, the
            # transcript so far its record (the call's failure stays on the trace): a
            # truncated episode, not an error
            return ProgramResult(0, "", "")
        if r.status_code >= 400:
            return ProgramResult(1, "", f"chat completion answered {r.status_code}: {r.text[:2000]}")
        # no tool was offered, so the reply ends the segment, as the program's loop ends on a
        # reply without tool calls; the interception server has recorded the turn
        return ProgramResult(0, "", "")
