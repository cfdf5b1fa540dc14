"""SFT rows' optional columns: `tools` / `tool_defs` reach the chat template's `tools=` in
the OpenAI shape, `chat_template_kwargs` reach `apply_chat_template`; bad values are one
line naming the dataset, the sample and the column. A template that rewrites earlier turns
trains each assistant turn after its own prefix. Subsets/splits mixed by weight, with the
realized ratios per step."""

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
        # a row with both: tools wins
        ([{"messages": CHAT, "tools": json.dumps(oai), "tool_defs": json.dumps([{**defs[0], "name": "x"}])}], ""),
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


# a template that drops the <think> block of every assistant turn before the last user turn
THINKING = (
    "{%- set ns = namespace(last=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{%- if m['role'] == 'assistant' and loop.index0 < ns.last -%}{{ m['content'].split('</think>')[-1] }}"
    "{%- else -%}{{ m['content'] }}{%- endif -%}{{ '<|im_end|>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)
TWO_TURNS = [
    {"role": "user", "content": "q1"},
    {"role": "assistant", "content": "<think>a</think>A"},
    {"role": "user", "content": "q2"},
    {"role": "assistant", "content": "<think>b</think>B"},
]


@pytest.fixture
def thinking_tok(tok):
    tok.chat_template = THINKING
    yield tok
    tok.chat_template = TEMPLATE


def test_a_template_rewriting_earlier_turns_trains_each_assistant_turn_after_its_own_prefix(thinking_tok):
    tok = thinking_tok
    (a, ma), (b, mb) = _tokenize(tok, [{"messages": TWO_TURNS}])
    turn = "<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(a) == turn + "<think>a</think>A<|im_end|>\n"
    assert tok.decode([i for i, m in zip(a, ma) if m]) == "<think>a</think>A<|im_end|>\n"
    # the second turn sees the first as the template renders it then: without its thinking
    assert (
        tok.decode(b)
        == turn + "A<|im_end|>\n<|im_start|>user\nq2<|im_end|>\n<|im_start|>assistant\n<think>b</think>B<|im_end|>\n"
    )
    assert tok.decode([i for i, m in zip(b, mb) if m]) == "<think>b</think>B<|im_end|>\n"
    # a one-turn conversation is prefix-stable: one sample, as before
    [(c, _)] = _tokenize(tok, [{"messages": TWO_TURNS[:2]}])
    assert c == a


def test_a_template_rewriting_earlier_turns_with_users_trained_is_refused_in_one_line(thinking_tok):
    from datasets import Dataset

    from prime_hpc.config.schema import LossMaskConfig
    from prime_hpc.trainer.sft_data import tokenize_dataset

    with pytest.raises(UserError) as e:
        tokenize_dataset(
            Dataset.from_list([{"messages": TWO_TURNS}]), "chats", thinking_tok, LossMaskConfig(user=True), 256
        )
    msg = str(e.value)
    assert "\n" not in msg and "dataset 'chats' sample 0" in msg and "trainer.loss_mask.user=false" in msg, msg


# ----------------------------------------------------------------------------- mixed parts
def _parts(sizes: list[int]):

    samples, part = [], []
    for k, n in enumerate(sizes):
        samples += [([k] * (2 + k), [False] + [True] * (1 + k)) for _ in range(n)]
        part += [k] * n
    return samples, part


def test_a_weighted_mix_draws_the_parts_at_their_weights_and_logs_the_realized_ratios():
    from prime_hpc.trainer.sft_data import Mix, SFTStream

    samples, part = _parts([10, 90])
    mix = Mix(part, ["small", "big"], [1.0, 1.0])
    a = SFTStream(samples, seq_len=8, seed=3, mix=mix)
    drawn = [part[i] for i in a._order]
    assert len(drawn) == 100 and 40 <= drawn.count(0) <= 60  # the small part drawn about half the time
    rows, used = a.next_rows(4)
    r = a.ratios()
    small = sum(1 for row in rows for ids, _ in row.samples if ids[0] == 0)
    assert r["progress/small/ratio_samples"] == small / used
    tokens = [len(ids) for row in rows for ids, _ in row.samples]
    assert r["progress/small/ratio_tokens"] == 2 * small / sum(tokens)
    assert r["progress/small/ratio_samples"] + r["progress/big/ratio_samples"] == 1.0
    # resuming at a position continues the same mixed order
    b = SFTStream(samples, seq_len=8, seed=3, mix=mix)
    b.load_state(a.state())
    assert [x.samples for x in b.next_rows(4)[0]] == [x.samples for x in a.next_rows(4)[0]]


def test_without_weights_the_parts_are_one_shuffle_and_only_the_ratios_are_added():
    from prime_hpc.trainer.sft_data import Mix, SFTStream

    samples, part = _parts([3, 5])
    plain = SFTStream(samples, seq_len=8, seed=1)
    mixed = SFTStream(samples, seq_len=8, seed=1, mix=Mix(part, ["a", "b"]))
    assert mixed._order == plain._order and plain.ratios() == {}
    mixed.next_rows(2)
    assert set(mixed.ratios()) == {f"progress/{p}/ratio_{w}" for p in "ab" for w in ("samples", "tokens")}


def test_splits_of_a_saved_dataset_load_as_parts(tok, tmp_path):
    from datasets import Dataset, DatasetDict
    from omegaconf import OmegaConf

    from prime_hpc.config.schema import LossMaskConfig, SFTDataConfig
    from prime_hpc.trainer.sft_data import load_parts

    rows = lambda n: Dataset.from_list([{"prompt": "q", "completion": "a" * (i + 1)} for i in range(n)])  # noqa: E731
    DatasetDict({"easy": rows(2), "hard": rows(3)}).save_to_disk(str(tmp_path / "d"))
    cfg = OmegaConf.structured(SFTDataConfig(name=str(tmp_path / "d"), seq_len=64, splits=["easy", "hard"]))
    samples, mix = load_parts(cfg, tok, LossMaskConfig())
    assert len(samples) == 5 and mix is not None and mix.labels == ["easy", "hard"] and mix.part == [0, 0, 1, 1, 1]
    cfg.probabilities = [1, 3]
    assert load_parts(cfg, tok, LossMaskConfig())[1].weights == [1.0, 3.0]
    cfg.splits, cfg.subsets = None, ["x", "y"]
    with pytest.raises(UserError) as e:
        load_parts(cfg, tok, LossMaskConfig())
    assert "\n" not in str(e.value) and "trainer.data.subsets" in str(e.value)


@pytest.mark.parametrize(
    "overrides, key, said",
    [
        (["trainer.data.subsets=[a,b]", "trainer.data.splits=[train]"], "trainer.data.splits", "1 splits for 2"),
        (["trainer.data.splits=[a,a]"], "trainer.data.splits", "'a' is named twice"),
        (["trainer.data.subsets=[a,b]", "trainer.data.probabilities=[1]"], "trainer.data.probabilities", "1 weights"),
        (["trainer.data.probabilities=[1]"], "trainer.data.probabilities", "two or more"),
        (["trainer.data.splits=[a,b]", "trainer.data.probabilities=[1,0]"], "trainer.data.probabilities", "positive"),
    ],
)
def test_bad_mixes_are_refused_naming_the_key(overrides, key, said):
    from prime_hpc.config.compose import compose
    from prime_hpc.config.validate import validate
    from prime_hpc.core.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        validate(compose(["trainer=sft", "trainer.data.name=d", *overrides]))
    assert e.value.key == key and said in str(e.value) and "\n" not in str(e.value), str(e.value)
