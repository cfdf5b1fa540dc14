"""Multi-turn rollouts to samples: the interleaved and branching trajectory strategies (on
turns rendered by a real chat template that drops earlier reasoning, as Qwen3's does), and
a full context ending a rollout as truncated instead of as an error."""

from __future__ import annotations

import asyncio

import pytest

from prime_hpc.orchestrator.client import context_used, make_client
from prime_hpc.orchestrator.rollouts import from_output, judge_group

# ChatML that keeps only the answer of earlier assistant turns: `<think>...</think>` is
# dropped from every assistant message before the last user/tool message (Qwen3's rule).
THINK_DROPPING_TEMPLATE = (
    "{%- set ns = namespace(last_query=0) -%}"
    "{%- for m in messages -%}{%- if m['role'] != 'assistant' -%}{%- set ns.last_query = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- set content = m['content'] -%}"
    "{%- if m['role'] == 'assistant' and loop.index0 < ns.last_query and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' }}{%- endif -%}"
)


@pytest.fixture(scope="module")
def tokenizer():
    from prime_hpc.model.tiny import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = THINK_DROPPING_TEMPLATE
    return tok


def _ids(tok, messages, gen=True):
    return tok.apply_chat_template(messages, tokenize=True, return_dict=False, add_generation_prompt=gen)


def _trajectory(tok, answers, tool_results, system="S"):
    """What verifiers records for a conversation: each turn's prompt rendered by the
    template from the messages so far, and the model's completion tokens (text + eos)."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "q"}]
    turns = []
    for i, answer in enumerate(answers):
        prompt = _ids(tok, messages)
        completion = tok.encode(answer, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
        turns.append(
            {
                "tokens": {
                    "prompt_ids": prompt,
                    "completion_ids": completion,
                    "completion_logprobs": [-0.5] * len(completion),
                },
                "response": {"policy_step": 3},
            }
        )
        messages.append({"role": "assistant", "content": answer})
        if i < len(tool_results):
            messages.append({"role": "tool", "content": tool_results[i]})
    return {"example_id": 1, "reward": 1.0, "is_truncated": False, "trajectory": turns}


def _trained_text(tok, ids, mask):
    """The trained tokens as runs of text."""
    runs, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


def test_a_template_that_keeps_history_gives_one_sample_under_both_strategies(tokenizer):
    out = _trajectory(tokenizer, ["abc", "answer: 12"], ["abc = 12"])
    for strategy in ("interleaved", "branching"):
        r = from_output(out, "e", seq_len=1000, strategy=strategy)
        assert r.error is None and r.branches == [] and r.num_turns == 2
        last = out["trajectory"][-1]["tokens"]
        assert r.input_ids == last["prompt_ids"] + last["completion_ids"]
        assert _trained_text(tokenizer, r.input_ids, r.loss_mask) == ["abc<|im_end|>", "answer: 12<|im_end|>"]
        text = tokenizer.decode(r.input_ids)
        assert "<|im_start|>tool\nabc = 12<|im_end|>" in text  # the tool's answer is context, never trained


def test_dropped_reasoning_is_an_error_interleaved_and_branches_when_branching(tokenizer):
    answers = ["<think>hm</think>abc", "<think>so</think>answer: 12"]
    out = _trajectory(tokenizer, answers, ["abc = 12"])
    # the second prompt renders the first answer without its reasoning: not an extension
    first, second = (t["tokens"] for t in out["trajectory"])
    assert (
        second["prompt_ids"][: len(first["prompt_ids"]) + len(first["completion_ids"])]
        != first["prompt_ids"] + first["completion_ids"]
    )

    inter = from_output(out, "e", seq_len=1000, strategy="interleaved")
    assert inter.error and "do not extend" in inter.error and "branching" in inter.error

    r = from_output(out, "e", seq_len=1000, strategy="branching")
    assert r.error is None and r.num_turns == 2 and r.policy_steps == [3, 3] and len(r.branches) == 1
    samples = r.to_samples()
    assert len(samples) == 2
    for s, turn in zip(samples, (first, second)):  # each: the turn's whole prompt as context + its completion
        assert s.input_ids == turn["prompt_ids"] + turn["completion_ids"]
        assert s.loss_mask == [False] * len(turn["prompt_ids"]) + [True] * len(turn["completion_ids"])
        assert s.inference_logprobs == [0.0] * len(turn["prompt_ids"]) + [-0.5] * len(turn["completion_ids"])
    assert _trained_text(tokenizer, samples[0].input_ids, samples[0].loss_mask) == ["<think>hm</think>abc<|im_end|>"]
    assert _trained_text(tokenizer, samples[1].input_ids, samples[1].loss_mask) == [
        "<think>so</think>answer: 12<|im_end|>"
    ]
    # the second branch's context holds the first answer without its reasoning, and the tool result
    ctx = tokenizer.decode(samples[1].input_ids)
    assert "<|im_start|>assistant\nabc<|im_end|>\n<|im_start|>tool\nabc = 12<|im_end|>" in ctx and "hm" not in ctx
    assert r.completion_tokens == sum(sum(s.loss_mask) for s in samples)


def test_branches_share_the_rollouts_advantage_and_count_once_in_the_group(tokenizer):
    branched = from_output(
        _trajectory(tokenizer, ["<think>a</think>x", "<think>b</think>y", "z"], ["r1", "r2"]), "e", 1000, "branching"
    )
    plain = from_output(_trajectory(tokenizer, ["x"], []), "e", 1000, "branching")
    plain.reward = 0.0
    # the prompts of turns 2 and 3 each drop reasoning of an earlier answer: three samples
    assert len(branched.branches) == 2
    v = judge_group(
        [branched, plain], step=3, async_level=2, max_off_policy_steps=8, filter_zero_variance=False, advantage="mean"
    )
    assert [r.advantage for r in v.kept] == [0.5, -0.5]  # one reward per rollout, not per sample
    assert {s.advantage for s in branched.to_samples()} == {0.5}
    assert [s.policy_step for s in branched.to_samples()] == [3] * (1 + len(branched.branches))


def test_each_branch_is_cut_at_seq_len(tokenizer):
    out = _trajectory(tokenizer, ["<think>" + "x" * 40 + "</think>a", "b"], ["r"])
    r = from_output(out, "e", seq_len=30, strategy="branching")
    assert r.is_truncated and r.error is None
    assert all(len(s) <= 30 for s in r.to_samples())


def test_a_rollout_ended_by_a_full_context_is_a_truncated_sample(tokenizer):
    """verifiers ends a rollout whose next prompt does not fit with `is_truncated` and no
    error: it trains like any other, on what the model generated."""
    out = _trajectory(tokenizer, ["abc"], [])
    out["is_truncated"] = True
    r = from_output(out, "e", seq_len=1000, strategy="interleaved")
    assert r.is_truncated and r.error is None and not r.empty
    assert _trained_text(tokenizer, r.input_ids, r.loss_mask) == ["abc<|im_end|>"]


def test_unknown_strategy_is_refused():
    with pytest.raises(ValueError, match="interleaved, branching"):
        from_output({"trajectory": []}, "e", 10, strategy="tree")


def test_the_client_stops_a_rollout_whose_context_is_full_without_a_request():
    from verifiers.errors import OverlongPromptError

    full = {"trajectory": [{"tokens": {"prompt_ids": [1] * 40, "completion_ids": [2] * 24}}]}
    assert context_used(full) == 64 and context_used({"trajectory": []}) == 0 and context_used(None) == 0
    # nothing listens on this port: a request would fail with a connection error, not this
    client = make_client("http://127.0.0.1:9/v1", "k", max_context=64)
    with pytest.raises(OverlongPromptError, match="context is full"):
        asyncio.run(
            client.get_native_response([{"role": "user", "content": "x"}], "m", {"max_tokens": 8}, None, state=full)
        )
