"""The teacher of `training_mode` opd and sft: where it answers (`locate`), and in opd its
log-probability of every token the student generated (`Teacher`).

Where: one of three (validation allows exactly one). `orchestrator.teacher.client.base_url`,
a server anyone runs, its key in the variable `client.api_key_var`; `orchestrator.teacher.
serve`, a `prime-hpc serve` job, its URL and model from its `serve.json` (read when the
orchestrator starts), its key in `client.api_key_var` too; `orchestrator.teacher.model`,
servers the run starts itself (a group of its job, slots `teacher_<n>`, a router of their
own at `endpoints/teacher_router.json`), asked with the job's own key: the orchestrator
waits for them like for the inference servers and keeps their membership (`fleet.
keep_fixed`: a teacher restarted in its slot rejoins its router). A router of the run's
own, or of a serve job (its `endpoints/router.json`), is never sent the key: it is proven
against its router.json before the first request and after a broken connection, and each
request is signed for it (`inference.client.RouterLink`); a listener there that does not
prove itself ends the run in one line naming the file and the address.

Consumes: an accepted group of rollouts; the teacher's endpoint and its model name (without
one, the name the student is served under). Produces, on each
sequence of each rollout (a branched rollout has several): `teacher_logprobs` (0 for the
first token) and the per-token advantages log p_teacher - log p_student
(`rollouts.opd_token_advantages`). One `/completions` request per sequence, with the
sequence as the prompt, `max_tokens` 1 and `prompt_logprobs` 0, through one HTTP client
kept for the run (opened on first use, closed by `aclose`). A request whose connection
broke before its answer was whole (a teacher server that died mid-answer, a router
restarting) is sent again after `RETRY_DELAYS_S` (~15 s in all, as the policy's client): the
run's own teacher router then waits for the restarted server. A request that still fails, or
that timed out or was answered with an error or without the sequence's logprobs, raises
(`UserError`: one line naming the teacher's URL).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from loguru import logger

from prime_hpc.config.schema import ClientConfig, TeacherConfig
from prime_hpc.core.errors import UserError
from prime_hpc.inference.client import (
    Endpoints,
    NotProven,
    RouterLink,
    RouterURL,
    api_key,
    discover,
    error_detail,
    headers,
)
from prime_hpc.orchestrator.rollouts import Rollout, opd_token_advantages
from prime_hpc.rundir import RunDir, jobs

TIMEOUT_S = 600.0  # one prompt_logprobs request
CONCURRENCY = 32  # prompt_logprobs requests of one group in flight at once
RETRY_DELAYS_S = (1.0, 2.0, 4.0, 8.0)  # before each new try of a request whose connection broke


def teacher_url(client: ClientConfig) -> str:
    """The teacher's base URL, which the `opd` and `sft` modes require (validation refuses
    a run without one; a component config written by hand is refused here)."""
    if not client.base_url:
        raise UserError("orchestrator.teacher.client.base_url is not set; the opd and sft modes need the teacher's URL")
    return client.base_url


@dataclass
class TeacherAt:
    """Where the teacher answers: its OpenAI base URL (`.../v1`), its key, the model name
    to ask for (None: the one the student is served under) and, for the run's own teacher,
    its servers and router."""

    url: str
    key: Optional[str]
    model: Optional[str]
    fleet: Optional[Endpoints] = None


def locate(t: TeacherConfig, run: RunDir, nodes: int, timeout_s: float, logs: Optional[Path] = None) -> TeacherAt:
    """The teacher of `t` (see the module's doc); the run's own (`t.model`: `nodes`
    servers) once its servers and router have published their endpoints (at most
    `timeout_s`). One line when a serve job does not serve."""
    if t.model:
        ep = discover(run.of_group("teacher"), nodes, timeout_s, logs)
        return TeacherAt(ep.openai_base_url, api_key(), t.client.model or t.model, ep)
    if t.serve:
        serving = jobs.serve_job(t.serve)
        found = jobs.served(serving)
        if found is None:
            raise UserError(
                f"orchestrator.teacher.serve={t.serve}: the serve job does not serve now; see prime-hpc status {t.serve}"
            )
        key = api_key(t.client.api_key_var)
        url = RouterURL(str(found["url"]), RouterLink(serving.router_endpoint, key))
        return TeacherAt(url, key, t.client.model or found.get("model"))
    return TeacherAt(teacher_url(t.client), api_key(t.client.api_key_var), t.client.model)


class Teacher:
    def __init__(self, at: TeacherAt, default_model: Callable[[], str]) -> None:
        self.url = at.url.rstrip("/") + "/completions"
        self.key = at.key
        link = getattr(at.url, "link", None)  # a router of a run's: proven, sent no key
        self.link: Optional[RouterLink] = link.using(at.key) if isinstance(link, RouterLink) else None
        self.model = at.model
        self.default_model = default_model
        self.retry_delays_s = RETRY_DELAYS_S
        self._http: Optional[Any] = None

    def http(self) -> Any:
        if self._http is None:
            import httpx

            if self.link is not None:
                self._http = httpx.AsyncClient(timeout=TIMEOUT_S, auth=self.link.auth())
            else:
                self._http = httpx.AsyncClient(timeout=TIMEOUT_S, headers=headers(self.key or ""))
        return self._http

    async def add_logprobs(self, group: list[Rollout]) -> None:
        """Every sequence of the group at once (at most `CONCURRENCY` in flight: a teacher
        of several servers behind its router answers them side by side)."""
        import asyncio

        gate = asyncio.Semaphore(CONCURRENCY)

        async def one(r: Any) -> None:
            async with gate:
                await self.score(r)

        await asyncio.gather(*(one(seq) for rollout in group for seq in rollout.sequences()))

    async def score(self, r: Any) -> None:
        """One sequence's teacher logprobs and per-token advantages."""
        import asyncio

        import httpx

        body = {
            "model": self.model or self.default_model(),
            "prompt": r.input_ids,
            "max_tokens": 1,
            "prompt_logprobs": 0,
            "temperature": 1.0,
        }
        for delay in (*self.retry_delays_s, None):
            try:
                resp = await self.http().post(self.url, json=body)
                break
            except NotProven as e:
                raise UserError(f"the teacher at {self.url} is not asked: {e}") from None
            except httpx.HTTPError as e:
                why = f"{type(e).__name__}: {e}"
                if delay is None or not isinstance(e, httpx.TransportError) or isinstance(e, httpx.TimeoutException):
                    tries = len(self.retry_delays_s) + 1 if delay is None else 1
                    raise UserError(
                        f"the teacher at {self.url} did not answer: {why}" + (f" ({tries} tries)" if tries > 1 else "")
                    ) from None
                logger.warning(f"the teacher at {self.url} did not answer ({why}); again in {delay:g} s")
                await asyncio.sleep(delay)
        if resp.status_code != 200:
            raise UserError(
                f"the teacher at {self.url} answered HTTP {resp.status_code} for a sequence of "
                f"{len(r.input_ids)} tokens: {error_detail(resp)}"
            )
        r.teacher_logprobs = [0.0] + self.logprobs(resp, r.input_ids)
        r.token_advantages = opd_token_advantages(r)

    def logprobs(self, resp: Any, ids: list[int]) -> list[float]:
        """The teacher's log-probability of each token of `ids` after the first, from its
        answer's `prompt_logprobs` (vLLM's: one `{token id: {"logprob": x}}` per token). An
        answer without them for exactly these tokens (a server that does not give them, not
        JSON) raises in one line naming the teacher."""
        try:
            body = resp.json()
            plp = body["choices"][0].get("prompt_logprobs") or body.get("prompt_logprobs")
            return [float(entry[str(tok)]["logprob"]) for tok, entry in zip(ids[1:], plp[1:], strict=True)]
        except (ValueError, LookupError, TypeError, AttributeError) as e:
            raise UserError(
                f"the teacher at {self.url} answered without the logprobs of a sequence of {len(ids)} tokens "
                f"(vLLM's prompt_logprobs; {type(e).__name__}: {e}): {resp.text[:200]}"
            ) from None

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None
