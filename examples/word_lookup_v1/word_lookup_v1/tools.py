"""word_lookup_v1's lookup as a tool (the task set's `tools=true`): an MCP tool server
(`LookupTools`, one for the whole task set, started by verifiers in the worker's local
runtime as `python -m word_lookup_v1.tools`) and a tool-call parser (`LookupCallParser`)
for a model with no tool-call format of its own.

`LookupCallParser` reads the classic env's plain-text protocol as tool calls: a reply
that is not `answer: N` is one call of `lookup`, its text the word (an optional
`lookup:` prefix dropped). A model that writes tool calls in its own format (Qwen3's
`<tool_call>` JSON, ...) uses its renderer's parser instead; this one is how the tiny
char-level model, which has no such format, plays the task set with real tool calls.
Named to a run as `orchestrator.env[i].renderer={name: default, tool_parser:
word_lookup_v1.tools:LookupCallParser}`.
"""

from __future__ import annotations

import json

import verifiers.v1 as vf
from word_lookup import is_answer, lookup, make_dictionary, parse_query

__all__ = ["LookupCallParser", "LookupTools", "LookupToolsConfig", "tool_queries"]


class LookupToolsConfig(vf.SharedToolsetConfig):
    num_words: int = 1000
    num_eval_words: int = 100
    min_len: int = 3
    max_len: int = 5
    seed: int = 0


class LookupTools(vf.Toolset[LookupToolsConfig]):
    TOOL_PREFIX = None  # the tool is `lookup`, not `lookup_tools_lookup`

    async def setup(self) -> None:
        c = self.config
        self.dictionary = make_dictionary(c.num_words + c.num_eval_words, c.min_len, c.max_len, c.seed)

    @vf.tool
    async def lookup(self, word: str) -> str:
        """The number of a word: `<word> = <number>`, or `not found`."""
        return lookup(self.dictionary, word)


def tool_queries(message: vf.AssistantMessage) -> list[str]:
    """The words a reply looked up with the `lookup` tool."""
    words = []
    for call in message.tool_calls or []:
        if call.name != "lookup":
            continue
        try:
            args = json.loads(call.arguments or "{}")
        except json.JSONDecodeError:
            continue
        if isinstance(args, dict) and isinstance(args.get("word"), str):
            words.append(args["word"])
    return words


class LookupCallParser:
    """renderers' tool-parser protocol: `extract(token_ids) -> (content_ids, tool_calls)`."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    def extract(self, ids: list[int]) -> tuple[list[int], list]:
        from renderers.base import ParsedToolCall

        text = self._tokenizer.decode(ids, skip_special_tokens=True).strip()
        if not text or is_answer(text):
            return ids, []
        call = ParsedToolCall(raw=text, name="lookup", arguments={"word": parse_query(text)}, token_span=(0, len(ids)))
        return [], [call]


if __name__ == "__main__":
    LookupTools.run()
