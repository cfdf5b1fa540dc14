"""Rollouts as JSON (`orchestrator.wire`): what an env server sends back is the rollout."""

from __future__ import annotations

import json

import pytest

from prime_hpc.orchestrator.generate import errored_group
from prime_hpc.orchestrator.rollouts import Branch, Rollout, from_output
from prime_hpc.orchestrator.wire import group_from_json, group_to_json, rollout_from_json, rollout_to_json


def _through_json(r: Rollout) -> Rollout:
    return rollout_from_json(json.loads(json.dumps(rollout_to_json(r))))


def _branched() -> Rollout:
    return Rollout(
        env="reverse_text",
        example_id=7,
        reward=0.625,
        input_ids=[1, 2, 3, 4],
        loss_mask=[False, False, True, True],
        logprobs=[0.0, 0.0, -0.5, -1.25],
        policy_steps=[3, 4],
        num_turns=2,
        is_truncated=True,
        advantage=-0.1,
        token_advantages=[0.0, 0.0, 0.5, 0.25],
        teacher_logprobs=[0.0, 0.0, -0.75, -1.0],
        prompt_text="abc",
        completion_text="cba",
        metrics={"lcs": 0.625},
        messages=[{"role": "user", "content": "abc"}, {"role": "assistant", "content": "cba"}],
        branches=[Branch(input_ids=[9, 8], loss_mask=[False, True], logprobs=[0.0, -2.0], token_advantages=[0.0, 1.0])],
        generated=(1234.5, 1240.25),
    )


def test_a_branched_rollout_with_every_field_set_comes_back_equal():
    r = _branched()
    back = _through_json(r)
    assert back == r
    assert isinstance(back.branches[0], Branch) and back.generated == (1234.5, 1240.25)
    assert back.oldest_policy == 3 and back.completion_tokens == 3


def test_errored_and_empty_rollouts_and_no_span_come_back_equal():
    group = errored_group("reverse_text", {"example_id": "x-1"}, 3, "ValueError: boom")
    group[0].empty = True
    back = group_from_json(json.loads(json.dumps(group_to_json(group))))
    assert back == group
    assert [r.error for r in back] == ["ValueError: boom"] * 3 and back[0].generated is None


def test_a_rollout_from_a_verifiers_output_comes_back_equal():
    out = {
        "example_id": 2,
        "reward": 1.0,
        "prompt": [{"role": "user", "content": "hi"}],
        "completion": [{"role": "assistant", "content": "ih"}],
        "metrics": {"m": 1},
        "trajectory": [
            {
                "tokens": {"prompt_ids": [5, 6], "completion_ids": [7], "completion_logprobs": [-0.3]},
                "response": {"policy_step": 2},
            }
        ],
    }
    r = from_output(out, "e", 64, "interleaved")
    assert _through_json(r) == r


def test_an_unknown_field_is_refused_by_name():
    obj = rollout_to_json(_branched())
    obj["surprise"] = 1
    with pytest.raises(ValueError, match="surprise"):
        rollout_from_json(obj)
