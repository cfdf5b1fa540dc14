"""Train tasks whose prompt is longer than `orchestrator.max_prompt_len` tokens: never sent.

`PromptTokens` counts a task's prompt as the server will see it: the model's tokenizer
(`model.name`) with its chat template, the generation prompt added and the env's tools
(the task's `info.tool_defs`, else the env's); a plain-text prompt is encoded as it is.
`LimitedSampler` is the run's `EnvSampler` that skips a task whose prompt is longer,
before any request is made for it: each skip is counted (`dropped`, reported per step as
`filter/long_prompts` by `step_metrics`), the first one said in one line, an env all of
whose prompts are too long said once. Each task is measured once (its length kept), so a
task picked again in a later epoch is skipped without tokenizing it again. When every
task of every train env is known to be too long, the run cannot fill a step: `next`
raises a `UserError` naming the key (the orchestrator exits with that line) instead of
skipping for ever.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from loguru import logger

from prime_hpc.core.errors import UserError
from prime_hpc.orchestrator.envs import EnvSampler, EnvSlot
from prime_hpc.orchestrator.rollouts import chat_messages

KEY = "orchestrator.max_prompt_len"


class PromptTokens:
    """The number of tokens of a task's prompt, by the run's model's tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @classmethod
    def of_model(cls, name: str, seed: int = 0, trust_remote_code: bool = False) -> "PromptTokens":
        """With `model.name`'s tokenizer (loaded here: one line naming the key when it cannot be)."""
        try:
            from transformers import AutoTokenizer

            from prime_hpc.model import resolve_model

            tok = AutoTokenizer.from_pretrained(resolve_model(name, seed), trust_remote_code=trust_remote_code)
        except Exception as e:
            first = str(e).splitlines()[0] if str(e) else ""
            raise UserError(
                f"{KEY} needs the tokenizer of model.name={name!r}, which cannot be loaded: {type(e).__name__}: {first}"
            ) from None
        return cls(tok)

    def __call__(self, slot: EnvSlot, row: dict) -> int:
        prompt = row.get("prompt")
        if isinstance(prompt, str):
            return len(self.tokenizer.encode(prompt, add_special_tokens=True))
        info = row.get("info")
        tools = _openai_tools(
            (info.get("tool_defs") if isinstance(info, dict) else None) or getattr(slot.env, "tool_defs", None)
        )
        ids = self.tokenizer.apply_chat_template(
            chat_messages(prompt), tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        if isinstance(ids, dict):  # a tokenizer that answers with its encoding
            ids = ids["input_ids"]
        return len(ids)


def _openai_tools(defs: Any) -> Optional[list[dict]]:
    """verifiers' tool definitions (or ones in the OpenAI shape) as a chat template reads them,
    converted as the SFT trainer converts a `tool_defs` column."""
    from prime_hpc.trainer.sft_data import openai_tool

    if not defs:
        return None
    return [
        openai_tool(t.model_dump(exclude_none=True) if hasattr(t, "model_dump") else dict(t), j, "the env's tool_defs")
        for j, t in enumerate(defs)
    ]


class LimitedSampler(EnvSampler):
    """An `EnvSampler` whose `next` skips the tasks whose prompt is longer than
    `max_prompt_len` tokens (`length(slot, row)`); `dropped`: the tasks skipped so far."""

    def __init__(
        self,
        slots: list[EnvSlot],
        seed: int,
        epochs: Optional[int],
        max_prompt_len: int,
        length: Callable[[EnvSlot, dict], int],
    ) -> None:
        super().__init__(slots, seed, epochs)
        self.max_prompt_len = max_prompt_len
        self.length = length
        self.dropped = 0
        self.lengths: dict[int, int] = {}  # by the row's id: its rows live as long as the slot
        self.too_long: dict[str, set[int]] = {s.name: set() for s in slots}
        self.shortest: Optional[int] = None  # of the prompts found too long

    def next(self) -> Optional[tuple[EnvSlot, dict]]:
        while True:
            picked = super().next()
            if picked is None:
                return None
            slot, row = picked
            if self.fits(slot, row):
                return picked
            self.dropped += 1
            if all(len(self.too_long[s.name]) == len(s.rows) for s in self.slots):
                raise UserError(
                    f"every train prompt is longer than {KEY}={self.max_prompt_len} tokens (the shortest has "
                    f"{self.shortest}): no step can be filled; raise it, or set it to null for no limit"
                )

    def fits(self, slot: EnvSlot, row: dict) -> bool:
        """Whether the task's prompt fits; measured once per task (a new long one is noted)."""
        n = self.lengths.get(id(row))
        if n is None:
            try:
                n = self.length(slot, row)
            except Exception as e:
                first = str(e).splitlines()[0] if str(e) else ""
                raise UserError(
                    f"{KEY}: the prompt of train env {slot.name!r} example {row.get('example_id')!r} cannot be "
                    f"measured with the model's chat template: {type(e).__name__}: {first}"
                ) from None
            self.lengths[id(row)] = n
            if n > self.max_prompt_len:
                self._noted(slot, row, n)
        return n <= self.max_prompt_len

    def _noted(self, slot: EnvSlot, row: dict, n: int) -> None:
        long = self.too_long[slot.name]
        if not any(self.too_long.values()):
            logger.info(
                f"train env {slot.name} example {row.get('example_id')!r}: its prompt has {n} tokens, more than "
                f"{KEY}={self.max_prompt_len}: not sent (such tasks are counted per step as filter/long_prompts)"
            )
        long.add(id(row))
        self.shortest = n if self.shortest is None else min(self.shortest, n)
        if len(long) == len(slot.rows) and len(self.slots) > 1:
            logger.warning(f"train env {slot.name}: every prompt is longer than {KEY}={self.max_prompt_len}")
