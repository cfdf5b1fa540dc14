"""The async window: which policies a step may train on, and which weights no step can
use any more. One rule, read by the orchestrator (what to generate, what is stale) and
the trainer (which `weights/step_k` to prune).

With `async_level` k, step n trains on rollouts whose every turn came from a policy no
older than n - k (policy m = the weights after trainer step m; 0 = the initial model).
"""

from __future__ import annotations


def oldest_usable(step: int, async_level: int) -> int:
    """The oldest policy whose rollouts step `step` may train on."""
    return step - async_level


def last_trainable(policy: int, async_level: int) -> int:
    """The last step that rollouts generated now, under `policy`, can still train."""
    return policy + async_level


def is_stale(policy: int, step: int, async_level: int) -> bool:
    """Rollouts from `policy` are too old for step `step`."""
    return policy < oldest_usable(step, async_level)


def prunable(policy: int, latest: int, async_level: int) -> bool:
    """Whether `weights/step_<policy>` can go once the trainer wrote `weights/step_<latest>`:
    older, by more than one step, than what step `latest` itself could use (the margin
    covers a relay still loading it into a server); checkpointed steps are kept by the
    caller."""
    return policy < oldest_usable(latest, async_level) - 1
