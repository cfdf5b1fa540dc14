"""reverse_text: a fully offline verifiers environment for prime-hpc smoke runs.

The task: the user message is a random lowercase string, the model must answer with
the string reversed. The reward is the LCS ratio between the model's answer (last
assistant message, whitespace-stripped) and the reversed string:

    lcs_ratio(a, b) = 2 * LCS(a, b) / (len(a) + len(b))      (1.0 when both empty)

where LCS is the length of the longest common *subsequence* (exact dynamic
programming, not difflib's Ratcliff/Obershelp heuristic, which can undercount).

Everything is generated from ``seed``: no download, same data on every machine.

Uses the classic verifiers API (verifiers 0.3.x): ``load_environment() ->
vf.SingleTurnEnv`` with a ``question``/``answer`` dataset and a ``vf.Rubric``.
``make_sft_dataset`` gives matching chat-format SFT data for a warm-up.
"""

from __future__ import annotations

import random
import string
from typing import Any

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "build_prompt",
    "exact_match",
    "generate_texts",
    "lcs_length",
    "lcs_ratio",
    "lcs_reward",
    "load_environment",
    "make_dataset",
    "make_sft_dataset",
]

DEFAULT_SYSTEM_PROMPT = "Reverse the text."  # short: the prompt is most of every sample
ALPHABET = string.ascii_lowercase


# --- reward ---------------------------------------------------------------------


def lcs_length(a: str, b: str) -> int:
    """Length of the longest common subsequence of ``a`` and ``b`` (O(len(a)*len(b)))."""
    if len(a) < len(b):
        a, b = b, a
    prev = [0] * (len(b) + 1)
    for ca in a:
        cur = [0]
        for j, cb in enumerate(b):
            cur.append(prev[j] + 1 if ca == cb else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def lcs_ratio(a: str, b: str) -> float:
    """``2 * LCS(a, b) / (len(a) + len(b))`` in [0, 1]; 1.0 iff ``a == b``."""
    total = len(a) + len(b)
    if total == 0:
        return 1.0
    return 2.0 * lcs_length(a, b) / total


def _answer_text(parser: Any, completion: Any) -> str:
    if isinstance(completion, str):
        return completion.strip()
    text = parser.parse_answer(completion) if parser is not None else None
    return (text or "").strip()


def lcs_reward(completion: Any, answer: str, parser: Any = None, **kwargs: Any) -> float:
    """Reward: LCS ratio between the stripped answer text and the reversed string."""
    return lcs_ratio(_answer_text(parser, completion), answer.strip())


def exact_match(completion: Any, answer: str, parser: Any = None, **kwargs: Any) -> float:
    """Metric (weight 0): 1.0 if the stripped answer is exactly the reversal."""
    return float(_answer_text(parser, completion) == answer.strip())


# --- data -----------------------------------------------------------------------


def _rng(split: str, seed: int) -> random.Random:
    # String seeds are hashed with SHA-512 by `random`: stable across runs/machines.
    return random.Random(f"reverse_text/{split}/{seed}")


def generate_texts(
    num: int,
    min_len: int = 3,
    max_len: int = 12,
    seed: int = 0,
    split: str = "train",
    exclude: set[str] | frozenset[str] = frozenset(),
) -> list[str]:
    """``num`` random lowercase strings with lengths uniform in [min_len, max_len]."""
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
    rng = _rng(split, seed)
    out: list[str] = []
    attempts = 0
    while len(out) < num:
        attempts += 1
        if attempts > 100 * num + 1000:
            raise ValueError("cannot draw enough strings outside `exclude`; widen the lengths")
        n = rng.randint(min_len, max_len)
        text = "".join(rng.choice(ALPHABET) for _ in range(n))
        if text not in exclude:
            out.append(text)
    return out


def _split_texts(num_train: int, num_eval: int, min_len: int, max_len: int, seed: int) -> tuple[list[str], list[str]]:
    train = generate_texts(num_train, min_len, max_len, seed, "train")
    evals = generate_texts(num_eval, min_len, max_len, seed, "eval", exclude=set(train))
    return train, evals


def make_dataset(texts: list[str]):
    """verifiers-style dataset: ``question`` (the text) and ``answer`` (reversed)."""
    from datasets import Dataset

    return Dataset.from_dict({"question": texts, "answer": [t[::-1] for t in texts]})


def build_prompt(text: str, system_prompt: str | None = DEFAULT_SYSTEM_PROMPT) -> list[dict]:
    """The chat prompt for ``text``, exactly as the environment builds it."""
    messages = []
    if system_prompt:
        messages.append({"role": "system", "content": system_prompt})
    messages.append({"role": "user", "content": text})
    return messages


# --- public entry points ----------------------------------------------------------


def load_environment(
    num_train_examples: int = 1000,
    num_eval_examples: int = 100,
    min_len: int = 3,
    max_len: int = 12,
    seed: int = 0,
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
    **kwargs: Any,
):
    """The reverse-text ``vf.SingleTurnEnv``.

    Train and eval strings come from independent streams of ``seed``; eval strings
    that also occur in train are skipped. Extra ``kwargs`` go to ``vf.SingleTurnEnv``
    (e.g. ``sampling_args``, ``max_seq_len``).
    """
    import verifiers as vf

    train, evals = _split_texts(num_train_examples, num_eval_examples, min_len, max_len, seed)
    parser = vf.Parser(extract_fn=str.strip)
    rubric = vf.Rubric(funcs=[lcs_reward, exact_match], weights=[1.0, 0.0], parser=parser)
    return vf.SingleTurnEnv(
        dataset=make_dataset(train) if train else None,
        eval_dataset=make_dataset(evals) if evals else None,
        system_prompt=system_prompt,
        parser=parser,
        rubric=rubric,
        **kwargs,
    )


def make_sft_dataset(
    num_examples: int = 1000,
    seed: int = 0,
    min_len: int = 3,
    max_len: int = 12,
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
    messages: bool = False,
    holdout_eval: int = 100,
):
    """Chat-format SFT data in the environment's prompt format.

    Columns ``prompt`` (system + user messages, as the env builds them) and
    ``completion`` (one assistant message with the reversal); with
    ``messages=True`` a single ``messages`` column (prompt + completion) instead.
    The strings are the environment's train strings for the same ``seed`` and
    lengths (example i here is train example i there, until a string is skipped),
    minus the environment's first ``holdout_eval`` eval strings (with its default
    ``num_train_examples``), so an eval after SFT scores strings it never saw.
    """
    from datasets import Dataset

    held_out = set(_split_texts(1000, holdout_eval, min_len, max_len, seed)[1]) if holdout_eval else set()
    texts = [
        t for t in generate_texts(num_examples + len(held_out), min_len, max_len, seed, "train") if t not in held_out
    ][:num_examples]
    prompts = [build_prompt(t, system_prompt) for t in texts]
    completions = [[{"role": "assistant", "content": t[::-1]}] for t in texts]
    if messages:
        return Dataset.from_dict({"messages": [p + c for p, c in zip(prompts, completions)]})
    return Dataset.from_dict({"prompt": prompts, "completion": completions})
