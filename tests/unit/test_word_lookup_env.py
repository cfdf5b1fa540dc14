"""The bundled multi-turn tool environment (examples/word_lookup): its tool, its turns and
its reward, without a model."""

from __future__ import annotations

import asyncio
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import word_lookup
from word_lookup import NOT_FOUND, correct_answer, looked_up, lookup, make_dictionary, parse_answer, parse_query  # noqa: E402


def _conv(*assistant: str, word: str = "owl") -> tuple[list[dict], list[dict]]:
    prompt = [{"role": "system", "content": "s"}, {"role": "user", "content": word}]
    completion = []
    for text in assistant:
        completion.append({"role": "assistant", "content": text})
        completion.append({"role": "tool", "content": "x", "tool_call_id": "1"})
    return prompt, completion[:-1]


def test_the_dictionary_is_offline_deterministic_and_distinct():
    a, b = make_dictionary(200, seed=3), make_dictionary(200, seed=3)
    assert a == b and len(a) == 200 and a != make_dictionary(200, seed=4)
    assert all(3 <= len(w) <= 5 and w.isalpha() and 10 <= n <= 99 for w, n in a.items())


def test_the_tool_and_the_parsers():
    d = {"owl": 42}
    assert lookup(d, "owl") == "owl = 42" and lookup(d, "cat") == NOT_FOUND
    assert parse_query(" lookup: OWL ") == "owl" == parse_query("lookup(owl)") == parse_query("'owl'")
    assert parse_answer("answer: 42") == 42 and parse_answer("Answer:7 ok") == 7
    assert parse_answer("owl") is None and parse_answer("answer: none") is None


def test_reward_is_the_right_number_plus_a_bonus_for_looking_the_word_up():
    prompt, completion = _conv("owl", "answer: 42")
    assert correct_answer(completion, "42") == 1.0 and looked_up(completion, prompt) == 1.0
    prompt, completion = _conv("cat", "answer: 41")
    assert correct_answer(completion, "42") == 0.0 and looked_up(completion, prompt) == 0.0
    prompt, completion = _conv("owl", "owl")  # ran out of turns without an answer
    assert correct_answer(completion, "42") == 0.0 and looked_up(completion, prompt) == 1.0


def test_each_turn_without_an_answer_calls_the_tool_and_an_answer_ends_the_rollout():
    env = word_lookup.load_environment(num_words=8, num_eval_words=2, max_turns=3)
    row = env.get_dataset()[0]
    word, number = row["question"], int(row["answer"])
    assert row["prompt"][-1] == {"role": "user", "content": word}
    assert len(env.get_eval_dataset()) == 2 and env.max_turns == 3

    from verifiers.types import AssistantMessage

    async def turn(text: str, state: dict):
        messages = [*row["prompt"], {"role": "assistant", "content": text}]
        state["trajectory"].append({"completion": [AssistantMessage(role="assistant", content=text)]})
        return await env.env_response(messages, state), await env.answer_given(state)

    state: dict = {"trajectory": []}
    (hit,), done = asyncio.run(turn(f"lookup: {word}", state))
    assert hit.role == "tool" and hit.content == f"{word} = {number}" and not done
    (miss,), done = asyncio.run(turn("zzzzzz", state))
    assert miss.content == NOT_FOUND and not done
    _, done = asyncio.run(turn(f"answer: {number}", state))
    assert done
