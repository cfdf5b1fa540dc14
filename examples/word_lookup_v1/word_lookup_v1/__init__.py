"""word_lookup_v1: the word_lookup example as a verifiers v1 task set (verifiers 0.4).

The same words, numbers and tool as the classic `word_lookup` environment, drawn from the
same seed: the user message is a word; each reply that is not `answer: N` is a lookup (its
text the word, an optional `lookup:` prefix dropped), which the env answers with
`<word> = <number>` or `not found`; the episode ends at an answer or after `max_turns`
replies. The protocol is plain text, as the classic one, so a model without a tool-call
parser (the offline tiny model) plays it: the env (`WordLookupEnv`, exported beside the
task set, which verifiers then plays it with) answers each lookup as the next user turn
of the one agent's interaction, where the classic env answers with a `tool` message.
`split` picks the train or the held-out eval words (`num_words`, `num_eval_words`).

With `tools=true` the lookups are tool calls instead: the task set serves a `lookup`
tool (`tools.LookupTools`, an MCP server verifiers starts once for the task set), the
model calls it, and the tool's answer comes back as a `tool` message; the episode is one
segment of the harness's tool loop, ending at a reply with no tool call (the answer) or
after `max_turns` replies. A model reads the tool from the prompt and calls it in its
own format, which its renderer's tool parser reads; the tiny model has none, so a run
names `tools.LookupCallParser` (the plain-text protocol above, read as tool calls).

Reward: 1.0 for the right number in the last reply, plus 0.2 when the task's word was
looked up (as text or with the tool). Metrics: `lookups` (lookups made) and `answered`.

    prime-hpc submit +experiment=word_lookup env=word_lookup_v1
"""

from __future__ import annotations

import functools

import verifiers.v1 as vf
from word_lookup import DEFAULT_SYSTEM_PROMPT, is_answer, lookup, make_dictionary, parse_answer, parse_query

from word_lookup_v1.tools import LookupTools, LookupToolsConfig, tool_queries

__all__ = ["WordLookupEnv", "WordLookupTaskset"]


def replies(trace: vf.Trace) -> list[str]:
    """What the model said, turn by turn."""
    return [(m.content or "").strip() for m in trace.assistant_messages]


def queries(trace: vf.Trace) -> list[str]:
    """The words the model looked up: with the tool, or as a reply that is no answer."""
    words = []
    for m in trace.assistant_messages:
        text = (m.content or "").strip()
        if m.tool_calls:
            words += tool_queries(m)
        elif text and not is_answer(text):
            words.append(parse_query(text))
    return words


class WordLookupData(vf.TaskData):
    word: str
    number: int
    max_turns: int = 4


class WordLookupTask(vf.Task[WordLookupData]):
    @vf.reward(weight=1.0)
    async def correct_answer(self, trace: vf.Trace) -> float:
        said = replies(trace)
        return float(bool(said) and parse_answer(said[-1]) == self.data.number)

    @vf.reward(weight=0.2)
    async def looked_up(self, trace: vf.Trace) -> float:
        return float(self.data.word in queries(trace))

    @vf.metric
    async def lookups(self, trace: vf.Trace) -> float:
        return float(len(queries(trace)))

    @vf.stop
    async def out_of_turns(self, trace: vf.Trace) -> bool:
        """The tool loop's bound (`max_turns` replies); the text protocol's is the env's."""
        return trace.num_turns >= self.data.max_turns

    @vf.metric
    async def answered(self, trace: vf.Trace) -> float:
        said = replies(trace)
        return float(bool(said) and is_answer(said[-1]))


class WordLookupConfig(vf.TasksetConfig):
    split: str = "train"
    """train or eval: the classic env's train words or its held-out eval words"""
    num_words: int = 1000
    num_eval_words: int = 100
    min_len: int = 3
    max_len: int = 5
    max_turns: int = 4
    """replies per episode, the answer included"""
    seed: int = 0
    system: str | None = DEFAULT_SYSTEM_PROMPT
    tools: bool = False
    """the lookups as calls of a `lookup` tool (an MCP server of the task set), not as replies"""


class WordLookupTaskset(vf.Taskset[WordLookupTask, WordLookupConfig]):
    @functools.cached_property
    def dictionary(self) -> dict[str, int]:
        """Every word (train and eval) and its number: what the tool knows."""
        c = self.config
        return make_dictionary(c.num_words + c.num_eval_words, c.min_len, c.max_len, c.seed)

    @classmethod
    def toolsets(cls, config: WordLookupConfig) -> list[vf.Toolset]:
        if not config.tools:
            return []
        c = config
        return [
            LookupTools(
                LookupToolsConfig(
                    num_words=c.num_words,
                    num_eval_words=c.num_eval_words,
                    min_len=c.min_len,
                    max_len=c.max_len,
                    seed=c.seed,
                )
            )
        ]

    def load(self) -> list[WordLookupTask]:
        c = self.config
        if c.split not in ("train", "eval"):
            raise ValueError(f"split must be train or eval, not {c.split!r}")
        words = list(self.dictionary)
        chosen = words[: c.num_words] if c.split == "train" else words[c.num_words :]
        return [
            WordLookupTask(
                WordLookupData(
                    id=f"{c.split}-{i}",
                    prompt=w,
                    system_prompt=c.system,
                    word=w,
                    number=self.dictionary[w],
                    max_turns=c.max_turns,
                ),
                c.task,
            )
            for i, w in enumerate(chosen)
        ]


class WordLookupEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()
    """The one seat: the policy, which looks words up and answers."""


class WordLookupEnv(vf.Env[WordLookupEnvConfig]):
    """One agent's interaction, the env as the user: each reply that is no answer is
    looked up and the result is the next turn."""

    async def run(self, task: WordLookupTask, agents: vf.Agents) -> None:
        taskset = self.taskset
        async with agents.agent.interaction(task) as chat:
            segment = await chat.turn()  # the task speaks first: its word
            if taskset.config.tools:
                return  # the lookups were the segment's tool calls; it ended at the answer
            turns = 1
            while not segment.terminated and not is_answer(segment.last_reply) and turns < taskset.config.max_turns:
                segment = await chat.turn(lookup(taskset.dictionary, parse_query(segment.last_reply)))
                turns += 1
