"""word_lookup: a fully offline, multi-turn verifiers environment with a tool.

The task: every word of a dictionary (random lowercase strings, drawn from ``seed``) has a
number (10..99) that only the ``lookup`` tool knows. The user message is a word; the
model must find its number and reply ``answer: <number>``.

The turns: each assistant message that is not an answer is a call of the tool, its text
the word to look up (an optional ``lookup:`` prefix is dropped). The environment answers
with a ``tool`` message, ``<word> = <number>`` or ``not found``. The rollout ends at an
answer or after ``max_turns`` assistant messages. The protocol is plain text so that any
model can call the tool, one without a tool-call parser (the offline tiny model) included.

Reward: 1.0 for the right number in the answer, plus ``lookup_bonus`` (0.2) when the word
itself was looked up. Metrics (weight 0): ``lookups`` (tool calls) and ``answered``.

Uses the classic verifiers API (verifiers 0.3.x): ``load_environment() ->
vf.MultiTurnEnv`` with a ``question``/``answer`` dataset and a ``vf.Rubric``.
"""

from __future__ import annotations

import random
import re
import string
from typing import Any

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "NOT_FOUND",
    "correct_answer",
    "is_answer",
    "load_environment",
    "looked_up",
    "lookup",
    "make_dictionary",
    "parse_answer",
    "parse_query",
]

DEFAULT_SYSTEM_PROMPT = "Write a word to look it up. Reply answer: N with its number."
NOT_FOUND = "not found"
_ANSWER = re.compile(r"answer\s*:\s*(-?\d+)?", re.IGNORECASE)
_LOOKUP_PREFIX = re.compile(r"^\s*lookup\s*[:(]?", re.IGNORECASE)


# --- the tool -----------------------------------------------------------------------


def make_dictionary(num_words: int, min_len: int = 3, max_len: int = 5, seed: int = 0) -> dict[str, int]:
    """``num_words`` distinct random lowercase words -> numbers in [10, 99], from ``seed``."""
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
    if num_words > len(string.ascii_lowercase) ** min_len:
        raise ValueError(f"cannot draw {num_words} distinct words of length >= {min_len}")
    rng = random.Random(f"word_lookup/{seed}")  # string seeds: stable across machines
    words: dict[str, int] = {}
    while len(words) < num_words:
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(min_len, max_len)))
        words.setdefault(word, rng.randint(10, 99))
    return words


def parse_query(text: str) -> str:
    """The word a tool call asks for: the message text, without a ``lookup:`` prefix,
    quotes or brackets, lowercased."""
    return _LOOKUP_PREFIX.sub("", text or "").strip().strip("\"'()` ").lower()


def lookup(dictionary: dict[str, int], word: str) -> str:
    """The tool: ``<word> = <number>``, or ``not found``."""
    return f"{word} = {dictionary[word]}" if word in dictionary else NOT_FOUND


def parse_answer(text: str) -> int | None:
    """The number of an ``answer: N`` message; None if it is no answer (or has no number)."""
    m = _ANSWER.search(text or "")
    return int(m.group(1)) if m and m.group(1) else None


def is_answer(text: str) -> bool:
    """Whether a message is an answer (``answer:``, with or without a number)."""
    return bool(_ANSWER.search(text or ""))


def _content(message: Any) -> str:
    content = message.get("content") if isinstance(message, dict) else getattr(message, "content", None)
    return content if isinstance(content, str) else ""


def _role(message: Any) -> str:
    return (message.get("role") if isinstance(message, dict) else getattr(message, "role", None)) or ""


def _assistant_texts(completion: Any) -> list[str]:
    if isinstance(completion, str):
        return [completion]
    return [_content(m) for m in completion or [] if _role(m) == "assistant"]


# --- reward ---------------------------------------------------------------------------


def correct_answer(completion: Any, answer: str, **kwargs: Any) -> float:
    """1.0 if the last assistant message answers the word's number."""
    texts = _assistant_texts(completion)
    return float(bool(texts) and parse_answer(texts[-1]) == int(answer))


def looked_up(completion: Any, prompt: Any, **kwargs: Any) -> float:
    """1.0 if one of the tool calls asked for the word of the task."""
    word = parse_query(_content(prompt[-1]) if isinstance(prompt, list) and prompt else str(prompt))
    return float(any(parse_query(t) == word for t in _assistant_texts(completion) if not is_answer(t)))


def lookups(completion: Any, **kwargs: Any) -> float:
    """Metric: how many tool calls the rollout made."""
    return float(sum(not is_answer(t) for t in _assistant_texts(completion)))


def answered(completion: Any, **kwargs: Any) -> float:
    """Metric: 1.0 if the rollout ended with an answer."""
    texts = _assistant_texts(completion)
    return float(bool(texts) and is_answer(texts[-1]))


# --- the environment ----------------------------------------------------------------------


def _env_class():
    import verifiers as vf
    from verifiers.types import ToolMessage

    class WordLookupEnv(vf.MultiTurnEnv):
        """Each non-answer assistant message calls ``lookup``; an answer ends the rollout."""

        def __init__(self, dictionary: dict[str, int], **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.dictionary = dictionary

        @vf.stop
        async def answer_given(self, state: Any) -> bool:
            trajectory = state.get("trajectory") or []
            if not trajectory:
                return False
            last = trajectory[-1]["completion"]
            return bool(last) and is_answer(_content(last[-1]))

        async def env_response(self, messages: Any, state: Any, **kwargs: Any) -> Any:
            n = len(state.get("trajectory") or [])
            result = lookup(self.dictionary, parse_query(_content(messages[-1])))
            return [ToolMessage(role="tool", content=result, tool_call_id=f"lookup_{n}")]

    return WordLookupEnv


def _dataset(dictionary: dict[str, int], words: list[str]):
    from datasets import Dataset

    return Dataset.from_dict({"question": words, "answer": [str(dictionary[w]) for w in words]})


def load_environment(
    num_words: int = 1000,
    num_eval_words: int = 100,
    min_len: int = 3,
    max_len: int = 5,
    max_turns: int = 4,
    lookup_bonus: float = 0.2,
    seed: int = 0,
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
    **kwargs: Any,
):
    """The word-lookup ``vf.MultiTurnEnv``.

    The dictionary holds ``num_words + num_eval_words`` words; the first ``num_words`` are
    the train tasks, the rest the eval tasks. Extra ``kwargs`` go to ``vf.MultiTurnEnv``.
    """
    import verifiers as vf

    dictionary = make_dictionary(num_words + num_eval_words, min_len, max_len, seed)
    words = list(dictionary)
    train, evals = words[:num_words], words[num_words:]
    rubric = vf.Rubric(funcs=[correct_answer, looked_up, lookups, answered], weights=[1.0, lookup_bonus, 0.0, 0.0])
    return _env_class()(
        dictionary=dictionary,
        dataset=_dataset(dictionary, train) if train else None,
        eval_dataset=_dataset(dictionary, evals) if evals else None,
        system_prompt=system_prompt,
        rubric=rubric,
        max_turns=max_turns,
        **kwargs,
    )
