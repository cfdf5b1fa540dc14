"""One group of rollouts: `n` rollouts of one task of an env, generated through the policy
client with the run's sampling arguments and scored by the env.

Consumes: an env slot and one of its dataset rows; the client (an OpenAI-compatible client
of the router, or of the teacher in sft, from `client.make_client`) and the model name to
ask for (it changes when the servers start serving the run's LoRA adapter). Produces: the
group's `Rollout`s (`rollouts.from_output`). A group whose run raises is never fatal: it
comes back as `n` errored rollouts carrying the exception, which the sink counts
(`Drop.ERRORED`). While a group runs, its env's log records go to the env's worker log
(`envs.CURRENT_ENV`). Each rollout of a group carries the group's generation span
(`Rollout.generated`: monotonic start before its first request, end after its last
answer; `clock`), which the step's row sums up as `time/generate`. No state of its own
beyond its arguments.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

from loguru import logger

from prime_hpc.config.schema import OrchestratorConfig, SamplingConfig
from prime_hpc.orchestrator.envs import CURRENT_ENV, REWARD_ERROR, EnvSlot
from prime_hpc.orchestrator.rollouts import Rollout, from_output


def sampling_args(s: SamplingConfig) -> dict:
    """The OpenAI request's sampling arguments from `orchestrator.sampling`: the standard
    ones at the top level, vLLM's own (`top_k`, `min_p`, `repetition_penalty`, then
    `extra_body` verbatim) in the body's extras; token ids are always asked for."""
    extra = dict(s.extra_body)
    if s.top_k:
        extra["top_k"] = s.top_k
    if s.min_p:
        extra["min_p"] = s.min_p
    if s.repetition_penalty != 1.0:
        extra["repetition_penalty"] = s.repetition_penalty
    extra["return_token_ids"] = True  # the trainer needs them
    args: dict = {"temperature": s.temperature, "top_p": s.top_p, "logprobs": True, "extra_body": extra}
    if s.max_tokens:
        args["max_tokens"] = s.max_tokens
    if s.stop:
        args["stop"] = list(s.stop)
    if s.seed is not None:
        args["seed"] = s.seed
    return args


class Generator:
    """Groups of `orchestrator.group_size` rollouts (or `n`) through `client`, asking for
    `model()`; `max_groups` is how many groups may generate at once
    (`max_concurrent / group_size`, at least 1)."""

    def __init__(self, ocfg: OrchestratorConfig, seq_len: int, client: Any, model: Callable[[], str]) -> None:
        self.sampling = ocfg.sampling
        self.group_size = ocfg.group_size
        self.max_groups = max(1, ocfg.max_concurrent // ocfg.group_size)
        self.strategy = ocfg.trajectory_strategy
        self.seq_len = seq_len
        self.client = client
        self.model = model
        self.clock: Callable[[], float] = time.monotonic  # of the groups' generation spans

    async def group(self, slot: EnvSlot, row: dict, kind: str = "train", n: Optional[int] = None) -> list[Rollout]:
        """The group's rollouts, each with the group's generation span (`Rollout.generated`)."""
        start = self.clock()
        rollouts = await self._generate(slot, row, kind, n or self.group_size)
        span = (start, self.clock())
        for r in rollouts:
            r.generated = span
        return rollouts

    async def _generate(self, slot: EnvSlot, row: dict, kind: str, n: int) -> list[Rollout]:
        return await generate_group(
            slot.env,
            slot.name,
            row,
            kind,
            n,
            self.client,
            self.model(),
            sampling_args(self.sampling),
            self.seq_len,
            self.strategy,
        )


async def generate_group(
    env: Any,
    name: str,
    row: dict,
    kind: str,
    n: int,
    client: Any,
    model: str,
    args: dict,
    seq_len: int,
    strategy: str,
) -> list[Rollout]:
    """`n` rollouts of `row` by the verifiers env `env` (named `name`), through `client`
    asking for `model` with the sampling arguments `args`; a group whose run raises comes
    back as `n` errored rollouts carrying the exception. (Also what an env server's worker
    runs: `prime_hpc.envserver`.)"""
    token = CURRENT_ENV.set(f"{kind}/{name}")
    try:
        outs = await env.run_group(
            [dict(row) for _ in range(n)], client, model, args, state_columns=["trajectory", REWARD_ERROR]
        )
        return [from_output(o, name, seq_len, strategy) for o in outs]
    except Exception as e:  # a crashed group is counted, never fatal
        logger.warning(f"{kind} env {name}: group failed: {type(e).__name__}: {e}")
        return errored_group(name, row, n, f"{type(e).__name__}: {e}")
    finally:
        CURRENT_ENV.reset(token)


def errored_group(name: str, row: dict, n: int, error: str) -> list[Rollout]:
    """`n` errored rollouts of `row` of env `name`, each carrying `error`."""
    return [
        Rollout(
            env=name,
            example_id=row.get("example_id"),
            reward=0.0,
            input_ids=[],
            loss_mask=[],
            logprobs=[],
            policy_steps=[],
            num_turns=0,
            is_truncated=False,
            error=error,
        )
        for _ in range(n)
    ]
