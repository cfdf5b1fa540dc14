"""The bundled reverse_text verifiers environment (examples/reverse_text)."""

from __future__ import annotations

import asyncio
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import reverse_text  # noqa: E402
import verifiers as vf  # noqa: E402
from reverse_text import lcs_length, lcs_ratio, lcs_reward  # noqa: E402


def _assistant(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


# --- reward -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "a, b, lcs",
    [
        ("olleh", "olleh", 5),
        ("oleh", "olleh", 4),
        ("abcde", "ace", 3),
        ("ab", "ba", 1),
        ("abc", "xyz", 0),
        ("", "abc", 0),
        ("", "", 0),
        # difflib's SequenceMatcher finds only 2 matching chars here; the true LCS is 3
        ("abxcd", "acbcd", 4),
    ],
)
def test_lcs_length(a, b, lcs):
    assert lcs_length(a, b) == lcs
    assert lcs_length(b, a) == lcs


def test_lcs_ratio_values():
    assert lcs_ratio("olleh", "olleh") == 1.0
    assert lcs_ratio("oleh", "olleh") == pytest.approx(8 / 9)  # 2*4 / (4+5)
    assert lcs_ratio("abcde", "ace") == pytest.approx(6 / 8)
    assert lcs_ratio("ab", "ba") == pytest.approx(0.5)
    assert lcs_ratio("abc", "xyz") == 0.0
    assert lcs_ratio("", "abc") == 0.0
    assert lcs_ratio("", "") == 1.0
    # the un-reversed input scores below the reversal
    assert lcs_ratio("hello", "olleh") == pytest.approx(2 * 2 / 10)  # LCS "ll"


def test_reward_function_uses_parser():
    env = reverse_text.load_environment(num_train_examples=4, num_eval_examples=2)
    p = env.parser
    assert lcs_reward(_assistant("olleh"), "olleh", parser=p) == 1.0
    assert lcs_reward(_assistant("  olleh\n"), "olleh", parser=p) == 1.0  # stripped
    assert lcs_reward(_assistant("olle"), "olleh", parser=p) == pytest.approx(8 / 9)
    assert lcs_reward(_assistant("hello"), "olleh", parser=p) == pytest.approx(0.4)
    assert lcs_reward(_assistant(""), "olleh", parser=p) == 0.0
    assert lcs_reward([], "olleh", parser=p) == 0.0  # no assistant message
    # the last assistant message counts
    convo = _assistant("xxxxx") + [{"role": "user", "content": "?"}] + _assistant("olleh")
    assert lcs_reward(convo, "olleh", parser=p) == 1.0


def _score(env, completion, answer: str):
    """Run the env's rubric the way verifiers does for one rollout."""
    prompt = reverse_text.build_prompt(answer[::-1])
    state = vf.State(input={"prompt": prompt, "answer": answer, "example_id": 0})
    state["prompt"] = prompt
    state["completion"] = completion
    state["trajectory"] = []
    asyncio.run(env.rubric.score_group([state]))
    return state["reward"], state["metrics"]


def test_rubric_scores_through_verifiers():
    env = reverse_text.load_environment(num_train_examples=4, num_eval_examples=2)
    reward, metrics = _score(env, _assistant(" dlrow "), "dlrow")
    assert reward == 1.0
    assert metrics["lcs_reward"] == 1.0 and metrics["exact_match"] == 1.0
    reward, metrics = _score(env, _assistant("dlow"), "dlrow")
    assert reward == pytest.approx(8 / 9)  # exact_match has weight 0
    assert metrics["exact_match"] == 0.0


# --- datasets -----------------------------------------------------------------------


def test_load_environment_type_and_columns():
    env = reverse_text.load_environment(num_train_examples=50, num_eval_examples=10)
    assert isinstance(env, vf.Environment)
    assert isinstance(env, vf.SingleTurnEnv)
    ds, ev = env.get_dataset(), env.get_eval_dataset()
    assert len(ds) == 50 and len(ev) == 10
    for d in (ds, ev):
        assert {"question", "answer", "prompt", "example_id"} <= set(d.column_names)
        assert list(d["example_id"]) == list(range(len(d)))
    for row in ds:
        q = row["question"]
        assert 3 <= len(q) <= 12 and q.isalpha() and q.islower()
        assert row["answer"] == q[::-1]
        assert row["prompt"] == [
            {"role": "system", "content": reverse_text.DEFAULT_SYSTEM_PROMPT},
            {"role": "user", "content": q},
        ]
    assert not set(ev["question"]) & set(ds["question"])  # eval disjoint from train


def test_dataset_lengths_and_options():
    env = reverse_text.load_environment(
        num_train_examples=30, num_eval_examples=5, min_len=5, max_len=5, system_prompt=None
    )
    ds = env.get_dataset()
    assert all(len(q) == 5 for q in ds["question"])
    assert all(p == [{"role": "user", "content": q}] for p, q in zip(ds["prompt"], ds["question"]))
    with pytest.raises(ValueError):
        reverse_text.load_environment(min_len=4, max_len=3)


def test_dataset_is_deterministic():
    def questions(seed):
        env = reverse_text.load_environment(num_train_examples=20, num_eval_examples=5, seed=seed)
        return env.get_dataset()["question"], env.get_eval_dataset()["question"]

    assert questions(0) == questions(0)
    assert questions(0) != questions(1)
    # train strings do not depend on the eval size, and vice versa for a fixed train
    a = reverse_text.load_environment(num_train_examples=20, num_eval_examples=5)
    b = reverse_text.load_environment(num_train_examples=20, num_eval_examples=8)
    assert a.get_dataset()["question"] == b.get_dataset()["question"]
    assert b.get_eval_dataset()["question"][:5] == a.get_eval_dataset()["question"]


def test_sft_dataset_matches_env_prompt_format():
    env = reverse_text.load_environment(num_train_examples=20, num_eval_examples=2, seed=5)
    sft = reverse_text.make_sft_dataset(num_examples=20, seed=5)
    assert set(sft.column_names) == {"prompt", "completion"}
    ds = env.get_dataset()
    for row, env_row in zip(sft, ds):
        assert row["prompt"] == env_row["prompt"]
        assert row["completion"] == [{"role": "assistant", "content": env_row["answer"]}]
        # a perfect SFT target earns reward 1.0 under the env's rubric
        assert lcs_reward(row["completion"], env_row["answer"], parser=env.parser) == 1.0
    msgs = reverse_text.make_sft_dataset(num_examples=20, seed=5, messages=True)
    assert msgs.column_names == ["messages"]
    assert msgs[3]["messages"] == sft[3]["prompt"] + sft[3]["completion"]
    assert reverse_text.make_sft_dataset(num_examples=20, seed=5)["prompt"] == sft["prompt"]
    assert reverse_text.make_sft_dataset(num_examples=20, seed=6)["prompt"] != sft["prompt"]


def test_sft_dataset_renders_with_tiny_model_template(tmp_path):
    """The SFT rows tokenize with the tiny model's ChatML template, answer last."""
    from transformers import AutoTokenizer

    from prime_hpc.model import build_tiny_model

    tok = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "m"), local_files_only=True)
    row = reverse_text.make_sft_dataset(num_examples=1, messages=True)[0]
    text = tok.apply_chat_template(row["messages"], tokenize=False)
    answer = row["messages"][-1]["content"]
    assert text.endswith(f"<|im_start|>assistant\n{answer}<|im_end|>\n")
    assert text.startswith(f"<|im_start|>system\n{reverse_text.DEFAULT_SYSTEM_PROMPT}<|im_end|>\n")
