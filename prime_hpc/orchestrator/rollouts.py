"""From verifiers rollout outputs to training samples: tokens, masks, inference logprobs,
the policy steps that produced each turn, group-relative advantages, filtering and the
policy-lag rules. Pure functions (no I/O), unit-tested with hand-computed values.

Trajectories (`orchestrator.trajectory_strategy`): a multi-turn rollout's turns each carry
their prompt and completion tokens. `interleaved` concatenates them into one sample, which
needs every turn's prompt to extend the tokens so far (the chat template re-renders earlier
turns token for token); a turn that does not is an error. `branching` starts a new sample
there instead (templates that drop earlier reasoning, such as Qwen3's): a rollout becomes
one sample per branch, each with its first turn's full prompt as context, all with the
rollout's advantage.

Policy-lag rules (step n, `async_level` k, `max_off_policy_steps` m):
- a rollout is *stale* for step n when the oldest policy that produced any of its turns
  is older than n - k: its group is dropped;
- a rollout *spans* max - min + 1 policies (the policies its turns came from and every
  one in between); it is dropped when that exceeds m.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import mean
from typing import Any, Optional

from prime_hpc.config.schema import ADVANTAGES, TRAJECTORY_STRATEGIES
from prime_hpc.orchestrator.envs import REWARD_ERROR
from prime_hpc.rundir import window
from prime_hpc.rundir.batch import Sample
from prime_hpc.rundir.drops import Drop


def _get(obj: Any, key: str, default: Any = None) -> Any:
    if isinstance(obj, dict):
        return obj.get(key, default)
    return getattr(obj, key, default)


@dataclass
class Branch:
    """One further sample of a branched rollout (token-aligned lists)."""

    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    teacher_logprobs: Optional[list[float]] = None
    token_advantages: Optional[list[float]] = None


@dataclass
class Rollout:
    env: str
    example_id: Any
    reward: float
    input_ids: list[int]
    loss_mask: list[bool]
    logprobs: list[float]
    policy_steps: list[int]  # per model turn the policy it started under, and the one it ended under if later
    num_turns: int
    is_truncated: bool
    error: Optional[str] = None
    empty: bool = False
    advantage: float = 0.0
    token_advantages: Optional[list[float]] = None  # per token (opd)
    teacher_logprobs: Optional[list[float]] = None
    prompt_text: str = ""  # the last prompt message (for sample tables)
    completion_text: str = ""  # what the model answered, every turn
    metrics: dict = field(default_factory=dict)  # the environment's own per-rollout metrics (its reward functions)
    messages: list = field(default_factory=list)  # the whole conversation, prompt then completion, as chat messages
    branches: list[Branch] = field(default_factory=list)  # samples after the first (branching)
    # (start, end), monotonic seconds: its group's generation, from the first request to the
    # last answer (`generate.Generator.group`); None where it was not generated (never written)
    generated: Optional[tuple[float, float]] = None

    @property
    def oldest_policy(self) -> int:
        return min(self.policy_steps) if self.policy_steps else 0

    @property
    def policies_spanned(self) -> int:
        return (max(self.policy_steps) - min(self.policy_steps) + 1) if self.policy_steps else 1

    @property
    def completion_tokens(self) -> int:
        return sum(self.loss_mask) + sum(sum(b.loss_mask) for b in self.branches)

    def sequences(self) -> list["Rollout | Branch"]:
        """This rollout's token sequences: itself (the first), then its further branches."""
        return [self, *self.branches]

    def to_sample(self) -> Sample:
        return Sample(
            input_ids=self.input_ids,
            loss_mask=self.loss_mask,
            inference_logprobs=self.logprobs,
            advantage=self.advantage,
            policy_step=self.oldest_policy,
            policies=self.policies_spanned,
            env=self.env,
            reward=self.reward,
            token_advantages=self.token_advantages,
        )

    def to_samples(self) -> list[Sample]:
        """One sample per branch (one in all unless branched), each with the rollout's advantage."""
        return [self.to_sample()] + [
            Sample(
                input_ids=b.input_ids,
                loss_mask=b.loss_mask,
                inference_logprobs=b.logprobs,
                advantage=self.advantage,
                policy_step=self.oldest_policy,
                policies=self.policies_spanned,
                env=self.env,
                reward=self.reward,
                token_advantages=b.token_advantages,
            )
            for b in self.branches
        ]


def from_output(out: dict, env: str, seq_len: int, strategy: str) -> Rollout:
    """One verifiers RolloutOutput (with the `trajectory` state column) → a Rollout.

    Each turn's new prompt tokens are context (no loss), its completion tokens are trained.
    A turn whose prompt extends the tokens so far continues the current sample; one that
    does not is an error (`interleaved`) or starts a new sample with its whole prompt
    (`branching`). A sample longer than `seq_len` is cut and the rollout marked truncated
    (so is one that ended because the context was full: verifiers' `is_truncated`)."""
    if strategy not in TRAJECTORY_STRATEGIES:
        raise ValueError(f"unknown trajectory strategy {strategy!r}; choose from {', '.join(TRAJECTORY_STRATEGIES)}")
    error = out.get("error")
    error_text = None
    if error:
        error_text = str(_get(error, "error_chain_repr") or _get(error, "message") or error)
    if out.get(REWARD_ERROR):
        error_text = error_text or str(out[REWARD_ERROR])
    seqs: list[Branch] = []
    steps: list[int] = []
    turns = 0
    truncated = bool(out.get("is_truncated"))
    for t in out.get("trajectory") or []:
        tokens = _get(t, "tokens")
        if not tokens:
            continue
        prompt, completion = list(_get(tokens, "prompt_ids") or []), list(_get(tokens, "completion_ids") or [])
        comp_lps = list(_get(tokens, "completion_logprobs") or [])
        cur = seqs[-1] if seqs else None
        if cur is not None and prompt[: len(cur.input_ids)] == cur.input_ids:
            new_prompt = prompt[len(cur.input_ids) :]
        elif cur is None or strategy == "branching":
            cur, new_prompt = Branch(), prompt
            seqs.append(cur)
        else:
            error_text = error_text or (
                "turn tokens do not extend the previous turns (the chat template rewrites "
                "history; orchestrator.trajectory_strategy=branching trains such rollouts)"
            )
            break
        cur.input_ids += new_prompt + completion
        cur.loss_mask += [False] * len(new_prompt) + [True] * len(completion)
        cur.logprobs += [0.0] * len(new_prompt) + (comp_lps + [0.0] * len(completion))[: len(completion)]
        response = _get(t, "response")
        step = _get(response, "policy_step")
        steps.append(int(step) if step is not None else 0)
        end = _get(response, "policy_step_end")
        if end is not None and int(end) != steps[-1]:  # an update in flight came mid-turn
            steps.append(int(end))
        turns += 1
        truncated = truncated or bool(_get(tokens, "is_truncated"))
    empty_response = error_text is not None and "EmptyModelResponseError" in error_text
    if empty_response:  # the model answered nothing: an empty rollout, not an error
        error_text = None
    for b in seqs:
        if len(b.input_ids) > seq_len:
            b.input_ids, b.loss_mask, b.logprobs = b.input_ids[:seq_len], b.loss_mask[:seq_len], b.logprobs[:seq_len]
            truncated = True
    if not seqs and not error_text and not empty_response and out.get("trajectory") != []:
        # turns without tokens (an empty trajectory is a rollout that ended before any model turn: empty)
        error_text = "no token ids in the rollout (the server must return token ids and logprobs)"
    first = seqs[0] if seqs else Branch()
    reward = float(out.get("reward") or 0.0)
    if not math.isfinite(reward) and not error_text:  # never into an advantage: it would make the loss NaN
        error_text, reward = f"the environment's reward is {reward} (its rubric must return a finite number)", 0.0
    r = Rollout(
        env=env,
        example_id=out.get("example_id"),
        reward=reward,
        input_ids=first.input_ids,
        loss_mask=first.loss_mask,
        logprobs=first.logprobs,
        policy_steps=steps,
        num_turns=turns,
        is_truncated=truncated,
        error=error_text,
        branches=seqs[1:],
        prompt_text=_text(out.get("prompt"), last_only=True),
        completion_text=_text(out.get("completion")),
        metrics=_numbers(out.get("metrics")),
        messages=chat_messages(out.get("prompt")) + chat_messages(out.get("completion"), "assistant"),
    )
    r.empty = r.completion_tokens == 0
    return r


MESSAGE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name")


def chat_messages(messages: Any, role: str = "user") -> list[dict]:
    """Chat messages (dicts or message objects; a plain string is one message of `role`) as
    plain dicts of what a chat template reads: role, content, and for tool use
    `tool_calls` (each {id, type, function: {name, arguments}}), `tool_call_id`, `name`."""
    if isinstance(messages, str):
        return [{"role": role, "content": messages}]
    out = []
    for m in list(messages or []):
        msg: dict = {}
        for key in MESSAGE_KEYS:
            value = _get(m, key)
            if value is None:
                continue
            if key == "tool_calls":
                value = [_plain(c) for c in value] if value else None
                if not value:
                    continue
            msg[key] = value if key != "content" or isinstance(value, (str, list)) else str(value)
        if "role" in msg:
            msg.setdefault("content", "")
            out.append(msg)
    return out


def _plain(obj: Any) -> Any:
    """A pydantic model, dataclass-like object or dict, as plain JSON-able data."""
    if hasattr(obj, "model_dump"):
        return obj.model_dump(exclude_none=True)
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def _numbers(metrics: Any) -> dict:
    """An environment's per-rollout metrics, as plain floats (what is not a number is left out)."""
    out = {}
    for k, v in dict(metrics or {}).items():
        try:
            out[str(k)] = float(v)
        except (TypeError, ValueError):
            continue
    return out


def _text(messages: Any, last_only: bool = False) -> str:
    """The text of chat messages (dicts or message objects), or of a plain string."""
    if isinstance(messages, str):
        return messages
    items = list(messages or [])[-1:] if last_only else list(messages or [])
    parts = []
    for m in items:
        content = _get(m, "content")
        parts.append(content if isinstance(content, str) else str(content or ""))
    return "\n".join(parts)


@dataclass
class GroupVerdict:
    kept: list[Rollout] = field(default_factory=list)
    reason: Optional[Drop] = None  # why the whole group was dropped
    dropped_spanning: int = 0
    errored: int = 0


EMPTY_GROUP = "every completion was empty (no rollout of the group produced a token to train)"


def group_error(group: list[Rollout]) -> Optional[str]:
    """Why nothing of a finished group can train, when the environment is to blame: the
    first error among its rollouts (the rollout raised, a reward function raised, the
    group crashed), or `EMPTY_GROUP` when every rollout produced no completion; None as
    soon as one rollout finished without an error and with tokens to train (a group that
    is only stale, or whose rewards are all equal, is not errored)."""
    if not group or any(not r.error and not r.empty for r in group):
        return None
    return next((r.error for r in group if r.error), EMPTY_GROUP)


@dataclass
class ErrorStreak:
    """Errored groups (`group_error`) in a row, in the order groups are judged; any other
    group ends the streak. `add` says when `limit` groups in a row errored (limit 0: never)."""

    limit: int
    count: int = 0
    error: Optional[str] = None  # the last errored group's error
    env: Optional[str] = None  # ... and its env

    def add(self, group: list[Rollout]) -> bool:
        error = group_error(group)
        if error is None:
            self.count, self.error, self.env = 0, None, None
            return False
        self.count, self.error, self.env = self.count + 1, error, group[0].env
        return 0 < self.limit <= self.count


def advantages(rewards: list[float], kind: str, lengths: Optional[list[int]] = None) -> list[float]:
    """Group-relative advantages of one group's rewards:
    `mean`: r - mean(group); `std`: (r - mean) / (population std + 1e-6), so every group
    weighs the same whatever its reward spread; `loo`: r - mean(the others), the
    leave-one-out baseline (= n/(n-1) * (r - mean)); `opo`: r - sum(len_i * r_i) /
    sum(len_i), the on-policy optimal baseline with each rollout's squared gradient norm
    taken as proportional to its length (`lengths`: each rollout's completion tokens; a
    group whose lengths are all 0 gets the plain mean)."""
    n = len(rewards)
    base = mean(rewards)
    if kind == "mean":
        return [r - base for r in rewards]
    if kind == "std":
        std = (sum((r - base) ** 2 for r in rewards) / n) ** 0.5
        return [(r - base) / (std + 1e-6) for r in rewards]
    if kind == "loo":
        total = sum(rewards)
        return [r - (total - r) / (n - 1) for r in rewards]
    if kind == "opo":
        if lengths is None or len(lengths) != n:
            raise ValueError(f"opo advantages need each rollout's length (got {lengths!r} for {n} rewards)")
        weight = sum(lengths)
        if weight > 0:
            base = sum(k * r for k, r in zip(lengths, rewards)) / weight
        return [r - base for r in rewards]
    raise ValueError(f"unknown advantage {kind!r}; choose from {', '.join(ADVANTAGES)}")


def judge_group(
    group: list[Rollout],
    step: int,
    async_level: int,
    max_off_policy_steps: int,
    filter_zero_variance: bool,
    advantage: str,
    difficulty: Any = None,
) -> GroupVerdict:
    """Which rollouts of a finished group train step `step`, with their advantages
    (`advantages` over the group's valid rollouts). `difficulty` (`orchestrator.
    difficulty_filter`) drops groups by their valid rollouts' mean reward and variance."""
    v = GroupVerdict()
    valid = []
    for r in group:
        if r.error or r.empty:
            v.errored += bool(r.error)
            continue
        if r.policies_spanned > max_off_policy_steps:
            v.dropped_spanning += 1
            continue
        valid.append(r)
    if any(window.is_stale(r.oldest_policy, step, async_level) for r in valid):
        v.reason = Drop.STALE
        return v
    if len(valid) < 2:
        v.reason = Drop.INVALID
        return v
    rewards = [r.reward for r in valid]
    if filter_zero_variance and max(rewards) - min(rewards) == 0:
        v.reason = Drop.ZERO_VARIANCE
        return v
    if difficulty is not None:
        avg = sum(rewards) / len(rewards)
        var = sum((x - avg) ** 2 for x in rewards) / len(rewards)
        if difficulty.min_reward is not None and avg < difficulty.min_reward:
            v.reason = Drop.TOO_HARD
        elif difficulty.max_reward is not None and avg > difficulty.max_reward:
            v.reason = Drop.TOO_EASY
        elif var < difficulty.min_reward_variance:
            v.reason = Drop.LOW_VARIANCE
        if v.reason:
            return v
    lengths = [x.completion_tokens for x in valid]  # opo's weights
    for r, a in zip(valid, advantages(rewards, advantage, lengths)):
        r.advantage = a
    v.kept = valid
    return v


def opd_token_advantages(r: "Rollout | Branch") -> list[float]:
    """On-policy distillation: per completion token, log p_teacher - log p_student (the
    student's sampling logprob); 0 on context tokens (of one sequence of a rollout)."""
    assert r.teacher_logprobs is not None
    return [(t - s) if m else 0.0 for t, s, m in zip(r.teacher_logprobs, r.logprobs, r.loss_mask)]


def pass_at_k(rewards: list[float], threshold: float = 1.0) -> float:
    """1 if any of the k rollouts of an example reaches `threshold`, else 0."""
    return float(any(x >= threshold - 1e-9 for x in rewards))
