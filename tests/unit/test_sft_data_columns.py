"""SFT rows' optional columns: `tools` / `tool_defs` reach the chat template's `tools=` in
the OpenAI shape, `chat_template_kwargs` reach `apply_chat_template`; bad values are one
line naming the dataset, the sample and the column."""

from __future__ import annotations

import json

import pytest

from prime_hpc.core.errors import UserError

# the project's tiny model's template ignores tools and kwargs; this one shows both
TEMPLATE = (
    "{%- if enable_thinking is defined and not enable_thinking -%}{{ '/no_think\n' }}{%- endif -%}"
    "{%- if tools -%}<|im_start|>system\ntools:"
    "{%- for t in tools %} {{ t['type'] }}/{{ t['function']['name'] }}"
    "({{ t['function']['parameters']['properties'] | list | join(',') }})"
    "{%- if t['function']['strict'] is defined %} strict{% endif %}{%- endfor -%}{{ '<|im_end|>\n' }}{%- endif -%}"
    "{%- for message in messages -%}{{- '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['content'] is string -%}{{- message['content'] }}{%- endif -%}{{- '<|im_end|>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' }}{%- endif -%}"
)
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}}
CHAT = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "sunny"}]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from prime_hpc.model import resolve_model

    t = AutoTokenizer.from_pretrained(resolve_model("tiny"))
    t.chat_template = TEMPLATE
    return t


def _tokenize(tok, rows: list[dict], **cols):
    from datasets import Dataset

    from prime_hpc.config.schema import LossMaskConfig
    from prime_hpc.trainer.sft_data import tokenize_dataset

    ds = Dataset.from_list(rows)
    return tokenize_dataset(ds, "chats", tok, LossMaskConfig(), seq_len=256)


def test_tool_defs_and_tools_reach_the_template_as_openai_functions(tok):
    defs = [{"name": "get_weather", "description": "d", "parameters": PARAMS, "strict": True}]
    oai = [{"type": "function", "function": {"name": "get_weather", "description": "d", "parameters": PARAMS}}]
    want = "<|im_start|>system\ntools: function/get_weather(city,unit){}<|im_end|>\n"
    for rows, strict in (
        ([{"messages": CHAT, "tool_defs": defs}], " strict"),  # a list of dicts
        ([{"messages": CHAT, "tool_defs": json.dumps(defs)}], " strict"),  # a JSON string of one
        ([{"messages": CHAT, "tools": oai}], ""),
        ([{"messages": CHAT, "tools": json.dumps(oai)}], ""),
        ([{"messages": CHAT, "tools": json.dumps(oai), "tool_defs": "[]"}], ""),  # tools wins
    ):
        [(ids, mask)] = _tokenize(tok, rows)
        text = tok.decode(ids)
        assert text.startswith(want.format(strict)), (rows, text)
        # the tools preamble is context, never trained
        assert tok.decode([i for i, m in zip(ids, mask) if m]) == "sunny<|im_end|>\n"
    # rows without tools (null, empty string) render none
    [(ids, _), (ids2, _)] = _tokenize(tok, [{"messages": CHAT, "tool_defs": None}, {"messages": CHAT, "tool_defs": ""}])
    assert (
        tok.decode(ids)
        == tok.decode(ids2)
        == "<|im_start|>user\nweather?<|im_end|>\n<|im_start|>assistant\nsunny<|im_end|>\n"
    )


def test_chat_template_kwargs_are_passed_on(tok):
    row = {"prompt": "q", "completion": "a"}
    [(a, ma), (c, _)] = _tokenize(
        tok, [{**row, "chat_template_kwargs": {"enable_thinking": False}}, {**row, "chat_template_kwargs": None}]
    )
    [(b, _)] = _tokenize(tok, [{**row, "chat_template_kwargs": json.dumps({"enable_thinking": False})}])
    assert (
        tok.decode(a)
        == tok.decode(b)
        == "/no_think\n<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\na<|im_end|>\n"
    )
    assert tok.decode([i for i, m in zip(a, ma) if m]) == "a<|im_end|>\n"
    assert tok.decode(c) == "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\na<|im_end|>\n"


@pytest.mark.parametrize(
    "column, value, said",
    [
        ("tool_defs", "[{not json", "column 'tool_defs': not valid JSON"),
        ("tool_defs", json.dumps({"name": "f"}), "column 'tool_defs': expected a list"),
        ("tool_defs", json.dumps([{"description": "no name"}]), "column 'tool_defs' entry 0: expected {name"),
        ("tools", json.dumps(["f"]), "column 'tools' entry 0: expected a dict"),
        ("chat_template_kwargs", "[1]", "column 'chat_template_kwargs': expected a dict"),
        ("chat_template_kwargs", json.dumps({"add_generation_prompt": True}), "'add_generation_prompt' cannot be set"),
    ],
)
def test_bad_column_values_are_one_line_naming_sample_and_column(tok, column, value, said):
    rows = [{"messages": CHAT, column: None}, {"messages": CHAT, column: value}]
    with pytest.raises(UserError) as e:
        _tokenize(tok, rows)
    msg = str(e.value)
    assert "\n" not in msg and "dataset 'chats' sample 1" in msg and said in msg, msg
