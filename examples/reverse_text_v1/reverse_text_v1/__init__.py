"""reverse_text_v1: the reverse_text example as a verifiers v1 task set (verifiers 0.4).

The same tasks as the classic `reverse_text` environment, drawn from the same seed: the
user message is a random lowercase string, the model answers with it reversed, the
reward is the LCS ratio of the answer (the last reply, stripped) and the reversal, and
exact reversals are counted as a metric. `split` picks the train or the held-out eval
strings (`num_train_examples`, `num_eval_examples`), as the classic env's two datasets.

    prime-hpc submit +experiment=reverse_text env=reverse_text_v1
"""

from __future__ import annotations

import verifiers.v1 as vf
from reverse_text import DEFAULT_SYSTEM_PROMPT, _split_texts, lcs_ratio

__all__ = ["ReverseTextTaskset"]


class ReverseTextData(vf.TaskData):
    answer: str
    """The text reversed."""


class ReverseTextTask(vf.Task[ReverseTextData]):
    @vf.reward(weight=1.0)
    async def lcs_reward(self, trace: vf.Trace) -> float:
        return lcs_ratio((trace.last_reply or "").strip(), self.data.answer)

    @vf.metric
    async def exact_match(self, trace: vf.Trace) -> float:
        return float((trace.last_reply or "").strip() == self.data.answer)


class ReverseTextConfig(vf.TasksetConfig):
    split: str = "train"
    """train or eval: the classic env's train strings or its held-out eval strings"""
    num_train_examples: int = 1000
    num_eval_examples: int = 100
    min_len: int = 3
    max_len: int = 12
    seed: int = 0
    system: str | None = DEFAULT_SYSTEM_PROMPT
    """the system prompt (None: none)"""


class ReverseTextTaskset(vf.Taskset[ReverseTextTask, ReverseTextConfig]):
    def load(self) -> list[ReverseTextTask]:
        c = self.config
        if c.split not in ("train", "eval"):
            raise ValueError(f"split must be train or eval, not {c.split!r}")
        train, evals = _split_texts(c.num_train_examples, c.num_eval_examples, c.min_len, c.max_len, c.seed)
        texts = train if c.split == "train" else evals
        return [
            ReverseTextTask(
                ReverseTextData(id=f"{c.split}-{i}", prompt=t, system_prompt=c.system, answer=t[::-1]), c.task
            )
            for i, t in enumerate(texts)
        ]
