"""Why the orchestrator drops a judged train group, and the key of
`metrics/orchestrator.jsonl` that counts each reason per step.

The orchestrator counts (`orchestrator/sink.py`), its fill-progress line and
`prime-hpc status` print the reasons by their text (`errored: 9, no reward variance: 3`),
and `status` reads the counts back from a step's metrics row (`watch/vitals.py`). A
member is its text (`Drop.STALE == "stale"`); `.metric` is its key.
"""

from __future__ import annotations

from enum import StrEnum


class Drop(StrEnum):
    """In the order `status` lists them."""

    ERRORED = "errored", "filter/errored_groups"  # nothing of the group can train (`rollouts.group_error`)
    ZERO_VARIANCE = "no reward variance", "filter/zero_variance_groups"  # online_difficulty_filtering
    INVALID = "too few valid rollouts", "filter/invalid_groups"  # fewer than 2 rollouts left to compare
    STALE = "stale", "off_policy/stale_groups"  # a rollout's oldest policy is outside the async window
    TOO_HARD = "too hard", "filter/too_hard_groups"  # difficulty_filter.min_reward
    TOO_EASY = "too easy", "filter/too_easy_groups"  # difficulty_filter.max_reward
    LOW_VARIANCE = "low reward variance", "filter/low_variance_groups"  # difficulty_filter.min_reward_variance

    metric: str

    def __new__(cls, reason: str, metric: str) -> "Drop":
        member = str.__new__(cls, reason)
        member._value_ = reason
        member.metric = metric
        return member
