"""`orchestrator.advantage=opo`: each rollout's reward minus its group's length-weighted
mean reward (the weights: each rollout's completion tokens, all its branches), values
written here by hand; the orchestrator's judging of a group gives them to the rollouts
it keeps, and the samples the trainer reads carry them."""

from __future__ import annotations

import pytest

from prime_hpc.config.compose import compose
from prime_hpc.config.validate import validate
from prime_hpc.core.errors import ConfigError
from prime_hpc.orchestrator.rollouts import Branch, Rollout, advantages, judge_group


def test_opo_subtracts_the_length_weighted_mean_reward():
    # b = (1*2 + 0*6 + 0.5*2) / (2 + 6 + 2) = 3 / 10 = 0.3
    got = advantages([1.0, 0.0, 0.5], "opo", [2, 6, 2])
    assert got == pytest.approx([0.7, -0.3, 0.2], abs=1e-12)
    assert advantages([1.0, 0.0, 0.5], "mean", [2, 6, 2]) == pytest.approx([0.5, -0.5, 0.0], abs=1e-12)
    # the length-weighted advantages sum to 0: the baseline is the weighted mean
    assert sum(k * a for k, a in zip([2, 6, 2], got)) == pytest.approx(0.0, abs=1e-12)
    # equal lengths: the plain mean; lengths all 0 (nothing to weigh): the plain mean too
    assert advantages([1.0, 0.0, 0.5, 0.5], "opo", [7, 7, 7, 7]) == pytest.approx([0.5, -0.5, 0.0, 0.0], abs=1e-12)
    assert advantages([1.0, 0.0], "opo", [0, 0]) == pytest.approx([0.5, -0.5], abs=1e-12)
    # a long rollout pulls the baseline toward its reward
    assert advantages([1.0, 0.0], "opo", [9, 1]) == pytest.approx([0.1, -0.9], abs=1e-12)
    for lengths in (None, [3]):
        with pytest.raises(ValueError, match="opo advantages need each rollout's length"):
            advantages([1.0, 0.0], "opo", lengths)


def _rollout(reward: float, completion: int, branch: int = 0, error: str | None = None) -> Rollout:
    r = Rollout(
        env="e",
        example_id=0,
        reward=reward,
        input_ids=list(range(3 + completion)),
        loss_mask=[False] * 3 + [True] * completion,
        logprobs=[0.0] * 3 + [-1.0] * completion,
        policy_steps=[0],
        num_turns=1,
        is_truncated=False,
        error=error,
    )
    if branch:
        r.branches = [Branch(list(range(2 + branch)), [False] * 2 + [True] * branch, [0.0] * (2 + branch))]
    return r


def test_the_orchestrator_gives_each_kept_rollout_its_opo_advantage():
    """The lengths are each rollout's completion tokens, a branched rollout's over all its
    samples; an errored rollout is not in its group's baseline; every sample of a rollout
    carries its advantage."""
    group = [_rollout(1.0, 2), _rollout(0.0, 2, branch=4), _rollout(0.5, 2), _rollout(1.0, 50, error="boom")]
    v = judge_group(group, step=1, async_level=2, max_off_policy_steps=8, filter_zero_variance=True, advantage="opo")
    assert v.reason is None and len(v.kept) == 3
    # lengths 2, 6, 2: b = 0.3
    assert [r.advantage for r in v.kept] == pytest.approx([0.7, -0.3, 0.2], abs=1e-12)
    assert [s.advantage for s in v.kept[1].to_samples()] == pytest.approx([-0.3, -0.3], abs=1e-12)


def test_opo_is_a_choice_of_orchestrator_advantage(tmp_path):
    cfg = compose(["+experiment=reverse_text", f"output_dir={tmp_path}/run", "orchestrator.advantage=opo"])
    validate(cfg)
    assert cfg.orchestrator.advantage == "opo"
    bad = compose(["+experiment=reverse_text", f"output_dir={tmp_path}/run", "orchestrator.advantage=opp"])
    with pytest.raises(ConfigError, match=r"^orchestrator.advantage: .*choose from mean, std, loo, opo"):
        validate(bad)
