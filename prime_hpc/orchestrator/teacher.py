"""The teacher of on-policy distillation (`training_mode: opd`): its log-probability of
every token the student generated.

Consumes: an accepted group of rollouts; the teacher's endpoint (`orchestrator.teacher.
client`: a vLLM server's OpenAI-compatible URL, the name of the variable holding its key,
its model name; without one, the name the student is served under). Produces, on each
sequence of each rollout (a branched rollout has several): `teacher_logprobs` (0 for the
first token) and the per-token advantages log p_teacher - log p_student
(`rollouts.opd_token_advantages`). One `/completions` request per sequence, with the
sequence as the prompt, `max_tokens` 1 and `prompt_logprobs` 0, through one HTTP client
kept for the run (opened on first use, closed by `aclose`). A failed request raises.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from prime_hpc.config.schema import ClientConfig
from prime_hpc.core.errors import UserError
from prime_hpc.inference.client import api_key, headers
from prime_hpc.orchestrator.rollouts import Rollout, opd_token_advantages

TIMEOUT_S = 600.0  # one prompt_logprobs request


def teacher_url(client: ClientConfig) -> str:
    """The teacher's base URL, which the `opd` and `sft` modes require (validation refuses
    a run without one; a component config written by hand is refused here)."""
    if not client.base_url:
        raise UserError("orchestrator.teacher.client.base_url is not set; the opd and sft modes need the teacher's URL")
    return client.base_url


class Teacher:
    def __init__(self, client: ClientConfig, default_model: Callable[[], str]) -> None:
        self.url = teacher_url(client).rstrip("/") + "/completions"
        self.key_var = client.api_key_var
        self.model = client.model
        self.default_model = default_model
        self._http: Optional[Any] = None

    def http(self) -> Any:
        if self._http is None:
            import httpx

            self._http = httpx.AsyncClient(timeout=TIMEOUT_S, headers=headers(api_key(self.key_var) or ""))
        return self._http

    async def add_logprobs(self, group: list[Rollout]) -> None:
        for r in (seq for rollout in group for seq in rollout.sequences()):
            resp = await self.http().post(
                self.url,
                json={
                    "model": self.model or self.default_model(),
                    "prompt": r.input_ids,
                    "max_tokens": 1,
                    "prompt_logprobs": 0,
                    "temperature": 1.0,
                },
            )
            resp.raise_for_status()
            body = resp.json()
            plp = body["choices"][0].get("prompt_logprobs") or body.get("prompt_logprobs")
            r.teacher_logprobs = [0.0] + [
                float(entry[str(tok)]["logprob"]) for tok, entry in zip(r.input_ids[1:], plp[1:])
            ]
            r.token_advantages = opd_token_advantages(r)

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None
