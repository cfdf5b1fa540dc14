"""The orchestrator's model client: verifiers' OpenAI chat client, plus two things RL needs.

- Every response keeps the policies the server stamped on it (`policy_step`, the one it
  started under, and `policy_step_end`: an update in flight can come mid-turn), so the
  policy-lag rules can be applied per turn.
- Identical requests issued together are sent as one request with `n` completions. A
  group's rollouts start from the same prompt at the same moment (verifiers sends one
  request per rollout); the server's per-request work (chat template, tokenization,
  response encoding) then happens once per group instead of once per rollout, which
  halves generation time on small models (docs/benchmarks.md). Each rollout still gets
  its own choice, as if it had asked alone. Later turns of multi-turn rollouts differ
  and go alone.
- A full context ends a rollout as truncated, never as an error. Before a later turn is
  requested, a rollout whose last turn already reached `max_context` tokens (the run's
  seq_len) stops there; and a turn whose prompt leaves no room for a single token (vLLM
  answers 400 "max_tokens must be at least 1") counts like any other over-long prompt.
  Both raise verifiers' OverlongPromptError, which ends the rollout with `is_truncated`.

The run's router (a base URL `discover` gave: `inference.client.RouterURL`) is sent no key:
the client proves it against its `router.json` before the first request and after a broken
connection, signs every request for its instance and takes an answer only with its proof
(`RouterLink.auth`, on the SDK's HTTP client); a listener there that does not prove itself
fails the request with `NotProven`, one line naming the file and the address (not retried).
Any other endpoint (a teacher of `client.base_url=`, an endpoint eval is given) gets `key`
as a bearer token.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Optional

from prime_hpc.config.schema import OrchestratorConfig

SERVERS_WAIT_S = 3600.0  # at the start: how long to wait for the inference servers and the router to publish
# a generation request's timeout where the caller gives none: the schema's default
GENERATION_TIMEOUT_S: float = OrchestratorConfig.generation_timeout_s
COALESCE_WINDOW_S = 0.002  # how long the first of identical requests waits for its twins
# vLLM's answer when the prompt fills the context exactly (it clamps max_tokens to what is left: 0)
NO_ROOM_PHRASES = ("max_tokens must be at least 1", "max_completion_tokens must be at least 1")


def context_used(state: Any) -> int:
    """Tokens of the rollout's last turn (prompt + completion); 0 before the first."""
    trajectory = (state or {}).get("trajectory") if isinstance(state, dict) else None
    if not trajectory:
        return 0
    tokens = trajectory[-1].get("tokens") if isinstance(trajectory[-1], dict) else None
    if not tokens:
        return 0
    get = tokens.get if isinstance(tokens, dict) else (lambda k: getattr(tokens, k, None))
    return len(get("prompt_ids") or []) + len(get("completion_ids") or [])


def make_client(
    base_url: str,
    key: Optional[str],
    coalesce: bool = True,
    max_context: Optional[int] = None,
    timeout_s: float = GENERATION_TIMEOUT_S,
) -> Any:
    """The policy client of `base_url`; a request fails after `timeout_s`
    (`orchestrator.generation_timeout_s`), the router's signing HTTP client's as well."""
    from openai import AsyncOpenAI, BadRequestError
    from verifiers.clients import OpenAIChatCompletionsClient
    from verifiers.errors import OverlongPromptError

    class PolicyClient(OpenAIChatCompletionsClient):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._waiting: dict[str, list[asyncio.Future]] = {}

        async def from_native_response(self, response: Any) -> Any:
            r = await super().from_native_response(response)
            extra = getattr(response, "model_extra", None) or {}
            if "policy_step" in extra:
                r.policy_step = extra["policy_step"]
                r.policy_step_end = extra.get("policy_step_end", extra["policy_step"])
            return r

        async def get_native_response(
            self, prompt: Any, model: str, sampling_args: Any, tools: Any = None, **kwargs: Any
        ) -> Any:
            state = kwargs.pop("state", None)  # the rollout's state: not part of the request
            used = context_used(state)
            if max_context is not None and used >= max_context:
                raise OverlongPromptError(f"the context is full: the last turn used {used} of {max_context} tokens")
            try:
                return await self._request(prompt, model, sampling_args, tools, **kwargs)
            except BadRequestError as e:
                text = (getattr(e.response, "text", "") or str(e)).lower()
                if any(p in text for p in NO_ROOM_PHRASES):
                    raise OverlongPromptError(f"the prompt fills the context: {text[:200]}") from e
                raise

        async def _request(self, prompt: Any, model: str, sampling_args: Any, tools: Any, **kwargs: Any) -> Any:
            args = dict(sampling_args or {})
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
                    prompt, model, {**args, "n": len(twins)} if len(twins) > 1 else args, tools
                )
            except BaseException as e:  # every twin sees the failure
                for f in twins:
                    if not f.done():
                        f.set_exception(e)
                return
            for i, f in enumerate(twins):
                if not f.done():
                    f.set_result(_one_choice(response, i) if len(twins) > 1 else response)

    # retried with backoff (~15 s in all): a restarting router or a server that just died
    return PolicyClient(AsyncOpenAI(max_retries=5, timeout=timeout_s, **_sdk_auth(base_url, key, timeout_s)))


SIGNED = "prime-hpc-signed"  # the SDK's api_key for the run's router: replaced by each request's signature


def _sdk_auth(base_url: str, key: Optional[str], timeout_s: float) -> dict:
    """The OpenAI SDK's `base_url`, `api_key` and, for the run's router, the HTTP client
    that proves it and signs for it (`key`: the job's, to prove and sign with)."""
    link = getattr(base_url, "link", None)
    if link is None:
        return {"base_url": base_url, "api_key": key or "EMPTY"}
    import httpx

    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)  # the SDK's own
    http = httpx.AsyncClient(auth=link.using(key).auth(), limits=limits, timeout=timeout_s)
    return {"base_url": str(base_url), "api_key": SIGNED, "http_client": http}


def _one_choice(response: Any, i: int) -> Any:
    """The response as the i-th of n requests would have got it alone."""
    choice = response.choices[i].model_copy(update={"index": 0})
    return response.model_copy(update={"choices": [choice]})
