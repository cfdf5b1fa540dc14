"""The model calls of a v1 env server's workers, sent on to the run's policy.

A v1 taskset's harness asks for completions through verifiers' train client, which renders
the chat itself and posts token ids to `<base>/inference/v1/generate`. Its base is this
relay (the env server's own listener): the workers never hold the job's key, only the
relay's token (`token`, a bearer good for these routes of this one server); the relay
proves and signs for the run's router as the orchestrator does (`RouterLink`), or sends
the policy endpoint's own key (an SFT teacher). On the way it

- asks vLLM for what verifiers' renderers read (`"output_mode": "text"`: logprobs per
  sampled token) and names each entry by its token id (`token_id:N`: `token_ids_as_tokens`), and
- keeps, per session (`X-Session-ID`, one per trace), the oldest and newest policy the
  answers were stamped with (`policy_step`, `policy_step_end`): the span an episode was
  generated under, which the server stamps into the episode before it becomes rollouts
  (`span`).

Answers go back as they came (status and body); a policy endpoint that cannot be reached
answers 502 with one line.
"""

from __future__ import annotations

import hmac
import json
import secrets
from typing import Any, Optional

from prime_hpc.inference.gate import authorization, read_body, send_json

PATHS = ("/inference/v1/generate", "/v1/chat/completions", "/v1/completions")  # POST
READ_PATHS = ("/v1/models",)  # GET: renderers reads the model's context length
SESSION_HEADER = b"x-session-id"
JSON_HEADERS = {"content-type": "application/json"}
TOKEN_VAR = "PRIME_HPC_RELAY_API_KEY"  # the workers' bearer for the relay (verifiers keeps *API_KEY* from programs)


class PolicyRelay:
    def __init__(self, client: dict, policy_key: Optional[str] = None) -> None:
        self.url = str(client["url"]).rstrip("/")
        self.root = self.url.removesuffix("/v1")
        self.router_json = client.get("router_json")
        self.timeout_s = float(client["timeout_s"])
        self.policy_key = policy_key
        self.token = secrets.token_hex(32)
        self.spans: dict[str, list[int]] = {}  # session -> [oldest policy, newest policy]
        self.http: Any = None

    def allows(self, scope: dict) -> bool:
        scheme, token = authorization(scope)
        return scheme == "bearer" and hmac.compare_digest(token.encode(), self.token.encode())

    def client(self) -> Any:
        import httpx

        from prime_hpc.envserver.transport import async_client

        if self.http is None:
            # a worker's episodes in flight are as many calls here: aiohttp's pool, not
            # httpcore's, which walks all its connections for each (envserver/transport.py)
            timeout = httpx.Timeout(self.timeout_s, connect=10.0)
            if self.router_json:
                from prime_hpc.inference.client import RouterLink

                self.http = async_client(timeout, auth=RouterLink(self.router_json).auth())
            else:
                from prime_hpc.inference.client import api_key

                key = self.policy_key or api_key() or ""
                self.http = async_client(timeout, headers={"authorization": f"Bearer {key}"})
        return self.http

    async def forward(self, scope: dict, receive: Any, send: Any) -> None:
        import httpx

        from prime_hpc.inference.client import InferenceError

        path = scope.get("path", "")
        session = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k.lower() == SESSION_HEADER), None)
        try:
            if scope.get("method") == "GET":
                r = await self.client().get(self.root + path)
            else:
                _, body = await read_body(receive)
                if body is None:
                    return await send_json(send, 400, {"error": "send a JSON object"})
                if path == "/inference/v1/generate":
                    body.setdefault("output_mode", "text")
                r = await self.client().post(self.root + path, content=json.dumps(body).encode(), headers=JSON_HEADERS)
        except (httpx.HTTPError, OSError, InferenceError) as e:  # InferenceError: the router not proven
            return await send_json(send, 502, {"error": f"the policy at {self.root} cannot be reached: {e}"})
        content = r.content
        if r.status_code == 200 and scope.get("method") == "POST":
            try:
                answer = r.json()
            except ValueError:
                answer = None
            if isinstance(answer, dict):
                if session:
                    self.note(session, answer)
                if path == "/inference/v1/generate" and token_ids_as_tokens(answer):
                    content = json.dumps(answer).encode()
        await send(
            {
                "type": "http.response.start",
                "status": r.status_code,
                "headers": [
                    (b"content-type", r.headers.get("content-type", "application/json").encode()),
                    (b"content-length", str(len(content)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": content})

    def note(self, session: str, answer: dict) -> None:
        if not isinstance(answer.get("policy_step"), int):
            return
        start = int(answer["policy_step"])
        end = answer.get("policy_step_end")
        end = int(end) if isinstance(end, int) else start
        span = self.spans.get(session)
        self.spans[session] = [min(span[0], start), max(span[1], end)] if span else [start, end]

    def span(self, sessions: list[str]) -> Optional[tuple[int, int]]:
        """The policy span of the calls of `sessions` (forgotten here), None when none was seen."""
        got = [s for s in (self.spans.pop(x, None) for x in sessions) if s]
        if not got:
            return None
        return min(s[0] for s in got), max(s[1] for s in got)

    async def aclose(self) -> None:
        if self.http is not None:
            await self.http.aclose()
            self.http = None


def token_ids_as_tokens(answer: dict) -> bool:
    """Name each sampled token's logprob entry by its id (`token_id:N`, what verifiers'
    renderers check against the answer's token ids, and what vLLM writes itself only when
    started with `--return-tokens-as-token-ids`); whether anything changed."""
    changed = False
    for choice in answer.get("choices") or []:
        ids = choice.get("token_ids") if isinstance(choice, dict) else None
        content = ((choice.get("logprobs") or {}).get("content") if isinstance(choice, dict) else None) or []
        if not isinstance(ids, list) or not isinstance(content, list):
            continue
        for tid, entry in zip(ids, content):
            if isinstance(entry, dict) and entry.get("token") != f"token_id:{tid}":
                entry["token"] = f"token_id:{tid}"
                changed = True
    return changed
