"""The chat harness of a v1 worker: verifiers' plain chat loop (the `null` harness), run
in the worker itself.

verifiers' `null` harness runs its chat program as a subprocess of the runtime, one per
episode (a Python start and the openai/mcp imports: ~1-2 CPU-s each, more than the tiny
model's whole turn). This harness runs the same loop in the worker's event loop: it posts
the conversation to the episode's interception endpoint (non-streaming, the endpoint's
bearer secret) with the task's MCP tools, calls each tool the reply calls (`tools/call`
on the tool's server, its result a `tool` message, bounded as the program bounds it) and
posts again, until a reply calls no tool, the conversation outgrows the context (a clean
end, as the program's without compaction) or the interception refuses a turn (a limit or
a `@stop`: verifiers ends the episode there). The interception server records the trace as
for the program, so the episode is the same; verifiers allows a harness its loop
in-process on that condition (`Harness.launch`). An episode whose tool calls go through
verifiers' tool gate (`tool_interception_url`) runs verifiers' program as before
(`NullHarness.launch`, which prepares it from the wheelhouse on its first use).

Runs under the env's interpreter (verifiers >= 0.4), imported only by `v1worker.py`,
which names it to verifiers by the top-level id `HARNESS_ID`.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import AsyncExitStack
from typing import Any, Optional

import httpx
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.errors import MODEL_TRANSPORT_ERROR_EXIT_CODE
from verifiers.v1.harnesses.null import NullHarness
from verifiers.v1.harnesses.utils.compaction import CONTEXT_OVERFLOW_MARKERS, bound_tool_message
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


async def tool_message(call: dict, dispatch: dict, servers: dict) -> dict:
    """The `tool` message answering one tool call of a reply, as verifiers' chat program
    makes it: the tool's result, or one line saying why the call was not made."""
    from verifiers.v1.harnesses.utils.mcp import call_mcp

    function = call.get("function") or {}
    name = function.get("name") or ""
    try:
        args = json.loads(function.get("arguments") or "{}")
    except json.JSONDecodeError as e:
        content: Any = f"error: invalid JSON in tool arguments ({e}); resend the call with valid JSON"
    else:
        if not isinstance(args, dict):
            content = f"error: tool arguments must be a JSON object, got {type(args).__name__}; resend as an object"
        elif name in dispatch:
            content = await call_mcp(servers, dispatch, name, args)
        else:
            content = f"error: unknown tool {name!r}"
    return bound_tool_message({"role": "tool", "tool_call_id": call.get("id") or "", "content": content, "name": name})


class InWorkerChat(NullHarness):
    async def setup(self, runtime: Any) -> None:
        """Nothing to prepare: the loop is this process's; an episode with a tool gate
        prepares the chat program in its launch (`launch_chat_program`)."""

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
        if tool_interception_url:
            return await super().launch(ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url)
        from verifiers.v1.harnesses.utils.mcp import connect_mcp

        system, prompt = self.resolve_prompt(data)
        messages = opening(system, prompt)
        async with AsyncExitStack() as stack:
            tools: list = []
            dispatch: dict = {}
            servers: dict = {}
            if mcp_urls:
                spec = {n: {"url": u, "timeout": self.config.tool_timeout} for n, u in mcp_urls.items()}
                try:
                    tools, dispatch, servers = await asyncio.wait_for(connect_mcp({"mcpServers": spec}, stack), 60)
                except Exception as e:  # as the program exits when its tools cannot be listed
                    return ProgramResult(
                        1, "", f"listing the tools of {sorted(mcp_urls)} failed: {type(e).__name__}: {e}"
                    )
            while True:
                body: dict = {"model": ctx.model, "messages": messages}
                if tools:
                    body["tools"] = tools
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
                    # a refused turn (a limit, a @stop) has set the trace's stop condition,
                    # which verifiers reads as the episode's clean end whatever the exit
                    return ProgramResult(1, "", f"chat completion answered {r.status_code}: {r.text[:2000]}")
                message = r.json()["choices"][0]["message"]
                calls = message.get("tool_calls")
                if not tools or not calls:
                    # a reply that calls no tool ends the segment, as the program's loop
                    # ends; the interception server has recorded the turn
                    return ProgramResult(0, "", "")
                messages.append({k: v for k, v in message.items() if v is not None})
                try:
                    for call in calls:
                        messages.append(await tool_message(call, dispatch, servers))
                except Exception as e:  # a tool server failing after its retries, as the program exits
                    return ProgramResult(1, "", f"tool call failed: {type(e).__name__}: {e}")
