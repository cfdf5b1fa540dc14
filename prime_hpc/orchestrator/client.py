"""The orchestrator's model client: verifiers' OpenAI chat client, plus two things RL needs.

- Every response keeps the `policy_step` the server stamped on it (which policy produced
  the tokens), so the policy-lag rules can be applied per turn.
- Identical requests issued together are sent as one request with `n` completions. A
  group's rollouts start from the same prompt at the same moment (verifiers sends one
  request per rollout); the server's per-request work (chat template, tokenization,
  response encoding) then happens once per group instead of once per rollout, which
  halves generation time on small models (docs/benchmarks.md). Each rollout still gets
  its own choice, as if it had asked alone. Later turns of multi-turn rollouts differ
  and go alone.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, Optional

COALESCE_WINDOW_S = 0.002  # how long the first of identical requests waits for its twins


def make_client(base_url: str, key: Optional[str], coalesce: bool = True) -> Any:
    from openai import AsyncOpenAI
    from verifiers.clients import OpenAIChatCompletionsClient

    class PolicyClient(OpenAIChatCompletionsClient):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._waiting: dict[str, list[asyncio.Future]] = {}

        async def from_native_response(self, response: Any) -> Any:
            r = await super().from_native_response(response)
            extra = getattr(response, "model_extra", None) or {}
            if "policy_step" in extra:
                r.policy_step = extra["policy_step"]
            return r

        async def get_native_response(self, prompt: Any, model: str, sampling_args: Any, tools: Any = None,
                                      **kwargs: Any) -> Any:
            args = dict(sampling_args or {})
            kwargs.pop("state", None)  # the rollout's state: not part of the request
            if not coalesce or kwargs or args.get("n", 1) != 1:
                return await super().get_native_response(prompt, model, sampling_args, tools, **kwargs)
            key = json.dumps([prompt, model, args, tools], sort_keys=True, default=str)
            fut = asyncio.get_running_loop().create_future()
            twins = self._waiting.setdefault(key, [])
            twins.append(fut)
            if len(twins) == 1:
                asyncio.get_running_loop().create_task(self._send(key, prompt, model, args, tools))
            return await fut

        async def _send(self, key: str, prompt: Any, model: str, args: dict, tools: Any) -> None:
            await asyncio.sleep(COALESCE_WINDOW_S)
            twins = self._waiting.pop(key)
            try:
                response = await super().get_native_response(
                    prompt, model, {**args, "n": len(twins)} if len(twins) > 1 else args, tools)
            except BaseException as e:  # every twin sees the failure
                for f in twins:
                    if not f.done():
                        f.set_exception(e)
                return
            for i, f in enumerate(twins):
                if not f.done():
                    f.set_result(_one_choice(response, i) if len(twins) > 1 else response)

    # retried with backoff (~15 s in all): a restarting router or a server that just died
    return PolicyClient(AsyncOpenAI(base_url=base_url, api_key=key or "EMPTY", max_retries=5, timeout=3600))


def _one_choice(response: Any, i: int) -> Any:
    """The response as the i-th of n requests would have got it alone."""
    choice = response.choices[i].model_copy(update={"index": 0})
    return response.model_copy(update={"choices": [choice]})
