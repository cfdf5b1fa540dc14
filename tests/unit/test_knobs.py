"""Three knobs of a run: the generation request's timeout (`orchestrator.generation_timeout_s`),
the longest train prompt sent (`orchestrator.max_prompt_len`), and the open files limit every
component raises when it starts (`runtime.limits`)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest

from prime_hpc.config.validate import validate
from prime_hpc.core.errors import ConfigError
from tests.conftest import REPO
from tests.unit.test_config import make


# ----------------------------------------------------------------------------- config
def test_the_defaults(tmp_path):
    o = make(tmp_path).orchestrator
    assert o.generation_timeout_s == 3600.0 and o.max_prompt_len is None


@pytest.mark.parametrize(
    "override, key, fix",
    [
        ("orchestrator.generation_timeout_s=0", "orchestrator.generation_timeout_s", "must be > 0"),
        ("orchestrator.generation_timeout_s=-5", "orchestrator.generation_timeout_s", "must be > 0"),
        ("orchestrator.max_prompt_len=0", "orchestrator.max_prompt_len", "must be >= 1"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_key(tmp_path, override, key, fix):
    with pytest.raises(ConfigError) as e:
        validate(make(tmp_path, override))
    assert e.value.key == key and fix in str(e.value) and "\n" not in str(e.value)


# ----------------------------------------------------------------------------- the request timeout
def test_both_http_clients_of_the_policy_client_time_out_after_generation_timeout_s(tmp_path):
    """The OpenAI SDK's own client (a plain endpoint) and the router's signing HTTP client."""
    from prime_hpc.inference.client import RouterLink, RouterURL
    from prime_hpc.orchestrator.client import make_client

    plain = make_client("http://127.0.0.1:9/v1", "k", timeout_s=7.5)
    assert plain._client.timeout == 7.5
    signed = make_client(RouterURL("http://127.0.0.1:9/v1", RouterLink(tmp_path / "router.json")), "k", timeout_s=7.5)
    assert signed._client.timeout == 7.5
    http = signed._client._client  # the httpx client that signs for the router
    assert http.timeout.read == 7.5 and http.timeout.connect == 7.5


def test_the_orchestrator_makes_its_policy_client_with_the_configured_timeout(tmp_path):
    from types import SimpleNamespace

    from prime_hpc.config.component import component_config
    from prime_hpc.orchestrator.loop import Orchestrator

    cfg = component_config(make(tmp_path, "orchestrator.generation_timeout_s=42"), "orchestrator")
    client, model = Orchestrator(cfg).policy_client(SimpleNamespace(openai_base_url="http://127.0.0.1:9/v1"))
    assert client._client.timeout == 42 and model is None


# ----------------------------------------------------------------------------- the open files limit
LOW = 256


def _lowered() -> None:
    """In the child: a soft limit of LOW, the hard limit as it is."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (LOW, hard))


def _hard() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[1]


def _run(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        env=env,
        preexec_fn=_lowered,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.skipif(_hard() <= LOW, reason="the hard open files limit is too low to lower the soft one")
def test_raise_open_files_raises_the_soft_limit_to_the_hard_one_and_says_so():
    r = _run(
        [
            "-c",
            "import resource; from prime_hpc.runtime.limits import raise_open_files; raise_open_files('x'); "
            "print('now', *resource.getrlimit(resource.RLIMIT_NOFILE))",
        ]
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines == [f"x: open files limit {LOW} -> {_hard()} (the hard limit)", f"now {_hard()} {_hard()}"], r.stdout


def test_a_limit_that_cannot_be_raised_is_one_warning_line_not_a_failure(monkeypatch, capsys):
    from prime_hpc.runtime import limits

    monkeypatch.setattr(resource, "getrlimit", lambda which: (LOW, 4096))

    def refuse(which, limits_):
        raise ValueError("not allowed")

    monkeypatch.setattr(resource, "setrlimit", refuse)
    assert limits.raise_open_files("x") == (LOW, LOW)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("x: warning: the open files limit stays 256: ") and "4096" in out[0]


@pytest.mark.skipif(_hard() <= LOW, reason="the hard open files limit is too low to lower the soft one")
@pytest.mark.parametrize(
    "module, name",
    [
        ("prime_hpc.orchestrator", "prime-hpc orchestrator"),
        ("prime_hpc.inference", "prime-hpc inference"),
        ("prime_hpc.inference.router", "prime-hpc router"),
        ("prime_hpc.trainer.rl", "python -m prime_hpc.trainer.rl"),
        ("prime_hpc.trainer.sft", "python -m prime_hpc.trainer.sft"),
    ],
)
def test_every_component_raises_the_limit_first_thing(module, name, tmp_path):
    """Each component's main, before anything else can fail (here: no key, no config)."""
    env = {k: v for k, v in os.environ.items() if k != "INFERENCE_SERVER_API_KEY"}
    r = _run(["-m", module, "--config", str(tmp_path / "none.yaml")], env=env)
    assert r.returncode != 0
    assert f"{name}: open files limit {LOW} -> {_hard()} (the hard limit)" in r.stdout.splitlines(), (
        r.stdout,
        r.stderr,
    )


# ----------------------------------------------------------------------------- the longest prompt
def _slot(name: str, lengths: list[int]):
    from prime_hpc.config.schema import EnvEntry
    from prime_hpc.orchestrator.envs import EnvSlot

    rows = [{"example_id": i, "prompt": [{"role": "user", "content": "x" * n}]} for i, n in enumerate(lengths)]
    return EnvSlot(name=name, entry=EnvEntry(id=name), env=None, rows=rows)


class _Chars:
    """A prompt's length: its characters; counts the tasks it measured."""

    def __init__(self) -> None:
        self.measured = 0

    def __call__(self, slot, row) -> int:
        self.measured += 1
        return len(row["prompt"][0]["content"])


def test_the_sampler_never_hands_out_a_task_whose_prompt_is_too_long_and_counts_each_skip():
    from prime_hpc.orchestrator.prompts import LimitedSampler

    length = _Chars()
    s = LimitedSampler([_slot("a", [3, 9, 5, 12, 4])], seed=1, epochs=2, max_prompt_len=5, length=length)
    served = []
    while (picked := s.next()) is not None:
        served.append(len(picked[1]["prompt"][0]["content"]))
    assert sorted(served) == [3, 3, 4, 4, 5, 5]  # each epoch's fitting tasks, none longer than 5
    assert s.dropped == 4  # 9 and 12, in each of the two epochs
    assert length.measured == 5  # each task measured once: the second epoch's skips cost nothing


def test_an_env_whose_every_prompt_is_too_long_is_skipped_while_another_serves():
    from prime_hpc.orchestrator.prompts import LimitedSampler

    s = LimitedSampler([_slot("long", [20, 30]), _slot("short", [1, 2])], 0, None, 10, _Chars())
    picked = [s.next() for _ in range(50)]
    assert all(p is not None and p[0].name == "short" for p in picked)
    assert s.dropped > 0


def test_a_run_whose_every_prompt_is_too_long_ends_in_one_line_naming_the_key():
    from prime_hpc.core.errors import UserError
    from prime_hpc.orchestrator.prompts import LimitedSampler

    s = LimitedSampler([_slot("a", [20, 30, 25]), _slot("b", [40])], 0, None, 10, _Chars())  # no end: no max_steps
    with pytest.raises(UserError) as e:
        s.next()
    msg = str(e.value)
    assert "\n" not in msg and "orchestrator.max_prompt_len=10" in msg and "the shortest has 20" in msg, msg
    assert s.dropped >= 4 and s.length.measured == 4  # every task tried (some twice, by ratio), each measured once


def test_a_prompt_is_measured_with_the_models_chat_template_and_tools():
    from prime_hpc.orchestrator.prompts import PromptTokens

    p = PromptTokens.of_model("tiny")
    slot = _slot("a", [])
    messages = [{"role": "system", "content": "Reverse the text."}, {"role": "user", "content": "abcdef"}]
    expected = p.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert p(slot, {"prompt": messages}) == len(expected) > 6
    assert p(slot, {"prompt": "abcdef"}) == len(p.tokenizer.encode("abcdef"))
    # a template that renders the tools (the env's, as the server gets them) counts them too
    p.tokenizer.chat_template = "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    tool = {"name": "look_up", "description": "a word's meaning", "parameters": {"type": "object", "properties": {}}}
    plain = len(p.tokenizer.encode("Reverse the text.abcdef", add_special_tokens=False))
    assert p(slot, {"prompt": messages}) == plain
    with_tools = len(p.tokenizer.encode("[look_up]Reverse the text.abcdef", add_special_tokens=False))
    assert p(slot, {"prompt": messages, "info": {"tool_defs": [tool]}}) == with_tools > plain
    slot.env = type("Env", (), {"tool_defs": [tool]})()  # the env's own, when the task names none
    assert p(slot, {"prompt": messages}) == with_tools


class _Recording:
    """The orchestrator's generator without a server: records each task sent, answers a
    group of rollouts with rewards that vary."""

    max_groups = 8

    def __init__(self) -> None:
        self.sent: list[dict] = []

    async def group(self, slot, row, kind="train", n=None):
        from tests.unit.test_orchestrator import _r

        self.sent.append(row)
        return [_r(i / 8, env=slot.name) for i in range(8)]


def test_the_orchestrator_sends_no_prompt_longer_than_max_prompt_len_and_counts_them_per_step(tmp_path):
    """reverse_text's prompts have 49 to 58 tokens with the tiny model's template: with a
    limit of 53, about half its tasks are never sent, and each step's row counts those
    skipped while it filled."""
    import asyncio

    from prime_hpc.orchestrator.prompts import LimitedSampler
    from tests.unit.test_orchestrator import _orchestrator

    o = _orchestrator(tmp_path / "run", "orchestrator.max_prompt_len=53")
    sampler = o.source.sampler
    assert isinstance(sampler, LimitedSampler)
    o.source.generator = recording = _Recording()
    rows = []
    for step in (1, 2):
        fill = asyncio.run(o.sink.fill(step))
        assert fill is not None and len(fill.accepted) == 8
        o.step_metrics.log_step(step, fill, fill.kept)
        rows.append(json.loads(o.run.metrics("orchestrator").read_text().splitlines()[-1]))
    assert recording.sent and all(sampler.length(o.source.sampler.slots[0], r) <= 53 for r in recording.sent)
    counted = [row["filter/long_prompts"] for row in rows]
    assert counted[0] > 0 and sum(counted) == sampler.dropped  # each skip in the row of the step it happened in
    assert len(recording.sent) == o.source.started  # a task skipped is not started (progress/total_problems)


def test_without_max_prompt_len_every_task_is_sent_and_the_count_is_zero(tmp_path):
    import asyncio

    from prime_hpc.orchestrator.envs import EnvSampler
    from tests.unit.test_orchestrator import _orchestrator

    o = _orchestrator(tmp_path / "run")
    assert type(o.source.sampler) is EnvSampler
    o.source.generator = _Recording()
    fill = asyncio.run(o.sink.fill(1))
    assert fill is not None
    assert o.step_metrics.log_step(1, fill, fill.kept)["filter/long_prompts"] == 0


def test_an_orchestrator_whose_every_prompt_is_too_long_ends_naming_the_key(tmp_path):
    import asyncio

    from prime_hpc.core.errors import UserError
    from tests.unit.test_orchestrator import _orchestrator

    o = _orchestrator(tmp_path / "run", "orchestrator.max_prompt_len=10")
    o.source.generator = recording = _Recording()
    with pytest.raises(UserError) as e:
        asyncio.run(o.sink.fill(1))
    assert "every train prompt is longer than orchestrator.max_prompt_len=10 tokens" in str(e.value)
    assert not recording.sent
