"""verifiers v1 task sets beside classic environments: which kind an id names and which
Python runs it (`config.env_kinds`, asked of the real .venv-envs that tools/setup builds),
what submit says of an id neither Python has, and the env server's relay (token ids named
as verifiers' renderers reads them, the policy span of each trace's calls) and its stamp on
a real v1 episode (tests/fixtures/v1_episodes)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from prime_hpc.config.env_kinds import CLASSIC, V1, detect, envs_python, package_path, probe
from prime_hpc.core.errors import UserError
from prime_hpc.envserver.relay import PolicyRelay, token_ids_as_tokens
from prime_hpc.orchestrator.episodes import episode_rollouts, episode_sessions, stamp_policy

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "v1_episodes"
ENVS_PYTHON = REPO / ".venv-envs" / "bin" / "python"


@pytest.fixture
def pylib(tmp_path) -> Path:
    return package_path(tmp_path / "envservers")


def test_the_envs_python_is_the_venv_beside_the_runs_unless_named(monkeypatch, tmp_path):
    monkeypatch.delenv("PRIME_HPC_ENVS_PYTHON", raising=False)
    beside = Path(sys.prefix).parent / ".venv-envs" / "bin" / "python"
    assert envs_python() == (str(beside) if beside.exists() else None)
    monkeypatch.setenv("PRIME_HPC_ENVS_PYTHON", str(tmp_path / "py"))
    assert envs_python() == str(tmp_path / "py")


def test_another_python_sees_only_prime_hpcs_own_modules(pylib):
    assert sorted(os.listdir(pylib)) == ["prime_hpc"]
    assert (pylib / "prime_hpc").resolve() == (REPO / "prime_hpc").resolve()
    assert package_path(pylib.parent) == pylib  # made once, kept


def test_a_classic_env_stays_in_the_runs_python_and_a_task_set_goes_to_the_envs_python(pylib, monkeypatch):
    monkeypatch.delenv("PRIME_HPC_ENVS_PYTHON", raising=False)
    classic = detect("reverse_text", None, pylib)
    assert (classic.kind, classic.python, classic.module) == (CLASSIC, None, "reverse_text")
    v1 = detect("reverse_text_v1", None, pylib)
    assert (v1.kind, v1.python, v1.taskset) == (V1, str(ENVS_PYTHON), "ReverseTextTaskset")
    # a path works from either Python: the classic example's package is classic there too
    there = detect(str(REPO / "examples" / "reverse_text" / "reverse_text"), str(ENVS_PYTHON), pylib)
    assert (there.kind, there.python) == (CLASSIC, str(ENVS_PYTHON))


def test_the_probe_answers_one_line_for_what_is_neither(pylib, tmp_path):
    (tmp_path / "plain_module.py").write_text("X = 1\n")
    answer = probe(str(tmp_path / "plain_module.py"), str(ENVS_PYTHON), pylib)
    assert answer["kind"] is None and "no load_environment() and exports no one v1 Taskset" in answer["error"]
    assert answer["verifiers"] == "0.4.0"
    gone = probe("no_such_env_anywhere", str(ENVS_PYTHON), pylib)
    assert gone["kind"] is None and "no environment 'no_such_env_anywhere'" in gone["error"]
    assert "nor is it a taskset verifiers ships" in gone["error"]
    missing = probe("reverse_text", str(tmp_path / "nopython"), pylib)
    assert missing["kind"] is None and "no such interpreter" in missing["error"]


def test_an_id_neither_python_has_is_one_line_naming_the_entry(pylib, monkeypatch):
    monkeypatch.delenv("PRIME_HPC_ENVS_PYTHON", raising=False)
    with pytest.raises(UserError) as e:
        detect("no_such_env_anywhere", None, pylib, "orchestrator.env.1")
    assert str(e.value).startswith("orchestrator.env.1: 'no_such_env_anywhere' under ")
    assert len(str(e.value).splitlines()) == 1


def _submit(capsys, *overrides: str) -> tuple[int, str]:
    from prime_hpc.cli import main

    code = main(["submit", "+experiment=reverse_text", "warmup.experiment=null", *overrides, "--dry-run"])
    return code, capsys.readouterr().err.strip()


def test_submit_takes_a_task_set_and_refuses_a_bad_python_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("PRIME_HPC_ENVS_PYTHON", raising=False)
    code, err = _submit(capsys, f"output_dir={tmp_path / 'a'}", "env=reverse_text_v1")
    assert code == 0, err
    code, err = _submit(
        capsys, f"output_dir={tmp_path / 'b'}", f"orchestrator.env=[{{id: reverse_text, python: {tmp_path}/py}}]"
    )
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "orchestrator.env.0.python" in err and "no such interpreter" in err, err
    assert not (tmp_path / "b").exists()


def test_a_renderer_is_refused_for_a_classic_env_and_without_a_name(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("PRIME_HPC_ENVS_PYTHON", raising=False)
    parser = "word_lookup_v1.tools:LookupCallParser"
    code, err = _submit(
        capsys, f"output_dir={tmp_path / 'a'}", "orchestrator.env=[{id: reverse_text, renderer: {name: qwen3}}]"
    )
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "orchestrator.env.0.renderer" in err and "classic env" in err, err
    code, err = _submit(
        capsys,
        f"output_dir={tmp_path / 'b'}",
        f"orchestrator.env=[{{id: word_lookup_v1, renderer: {{tool_parser: '{parser}'}}}}]",
    )
    assert code == 2 and "orchestrator.env.0.renderer" in err and "names no renderer" in err, err
    code, err = _submit(
        capsys,
        f"output_dir={tmp_path / 'c'}",
        f"orchestrator.env=[{{id: word_lookup_v1, args: {{tools: true}}, renderer: {{name: default, tool_parser: '{parser}'}}}}]",
    )
    assert code == 0, err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_the_lookup_parser_reads_a_reply_as_a_call_and_a_worker_registers_it(tmp_path):
    """Under the envs' Python: a run's `module:Class` tool parser is registered with
    renderers and a default renderer parses the tiny model's reply with it (the word
    looked up, nothing left as content), while an answer stays text."""
    python = envs_python()
    assert python, "no envs Python (tools/setup builds .venv-envs)"
    from prime_hpc.model.tiny import build_tokenizer

    tok_dir = tmp_path / "tokenizer"
    build_tokenizer().save_pretrained(tok_dir)
    code = f"""
import json
from prime_hpc.envserver.v1worker import renderer_config
from renderers import create_renderer
from renderers.base import load_tokenizer
config = renderer_config({{"renderer": {{"name": "default", "tool_parser": "word_lookup_v1.tools:LookupCallParser"}}}})
from verifiers.v1 import TrainClientConfig
client = TrainClientConfig(base_url="http://127.0.0.1:1/v1", renderer=config)
tok = load_tokenizer({str(tok_dir)!r})
r = create_renderer(tok, client.renderer)
out = {{}}
for text in ("lookup: abc", "answer: 7"):
    p = r.parse_response(tok.encode(text, add_special_tokens=False))
    out[text] = [p.content, [(c.name, c.arguments) for c in p.tool_calls]]
print(json.dumps(out))
"""
    import subprocess

    from prime_hpc.config.env_kinds import python_env

    r = subprocess.run(
        [python, "-c", code], capture_output=True, text=True, timeout=120, env=python_env(package_path(tmp_path))
    )
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["lookup: abc"] == ["", [["lookup", {"word": "abc"}]]], out
    assert out["answer: 7"] == ["answer: 7", []], out


def test_the_worker_answers_a_bad_tool_call_with_a_tool_message_as_verifiers_program_does(tmp_path):
    """Under the envs' Python: arguments that are no JSON, JSON that is no object and a tool
    the task has not each get a `tool` message saying so (the model's next turn reads it),
    as verifiers' chat program answers them, never an exception that fails the episode."""
    python = envs_python()
    assert python, "no envs Python (tools/setup builds .venv-envs)"
    code = """
import asyncio, json
from prime_hpc.envserver.chat import tool_message
calls = [
    {"id": "a", "function": {"name": "lookup", "arguments": "{not json"}},
    {"id": "b", "function": {"name": "lookup", "arguments": "[1, 2]"}},
    {"id": "c", "function": {"name": "nope", "arguments": "{}"}},
]
print(json.dumps([asyncio.run(tool_message(c, {"lookup": ("", "lookup")}, {})) for c in calls]))
"""
    import subprocess

    from prime_hpc.config.env_kinds import python_env

    r = subprocess.run(
        [python, "-c", code], capture_output=True, text=True, timeout=120, env=python_env(package_path(tmp_path))
    )
    assert r.returncode == 0, r.stderr[-2000:]
    bad_json, not_object, unknown = json.loads(r.stdout.splitlines()[-1])
    assert bad_json["role"] == "tool" and bad_json["tool_call_id"] == "a" and bad_json["name"] == "lookup"
    assert bad_json["content"].startswith("error: invalid JSON in tool arguments"), bad_json
    assert not_object["content"] == "error: tool arguments must be a JSON object, got list; resend as an object"
    assert unknown["content"] == "error: unknown tool 'nope'" and unknown["tool_call_id"] == "c", unknown


# ----------------------------------------------------------------------------- the relay
def test_logprob_entries_are_named_by_their_token_ids():
    answer = {
        "choices": [
            {
                "token_ids": [7, 9],
                "logprobs": {"content": [{"token": "a", "logprob": -0.5}, {"token": "b", "logprob": -1.0}]},
            }
        ]
    }
    assert token_ids_as_tokens(answer)
    assert [e["token"] for e in answer["choices"][0]["logprobs"]["content"]] == ["token_id:7", "token_id:9"]
    assert [e["logprob"] for e in answer["choices"][0]["logprobs"]["content"]] == [-0.5, -1.0]
    assert not token_ids_as_tokens(answer)  # already so: nothing to change


def test_the_relay_keeps_each_sessions_policy_span_until_asked():
    relay = PolicyRelay({"url": "http://127.0.0.1:1/v1", "timeout_s": 5})
    relay.note("trace-a", {"policy_step": 4, "policy_step_end": 4})
    relay.note("trace-a", {"policy_step": 5, "policy_step_end": 6})
    relay.note("trace-b", {"policy_step": 3})
    relay.note("trace-c", {"no": "stamp"})
    assert relay.span(["trace-a"]) == (4, 6)
    assert relay.span(["trace-a"]) is None  # forgotten once taken
    assert relay.span(["trace-b", "trace-c", "unknown"]) == (3, 3)
    assert relay.token and relay.root == "http://127.0.0.1:1"


def test_a_stamped_episode_trains_as_generated_under_its_span():
    ep = json.loads((FIXTURES / "single_turn.json").read_text())
    sessions = episode_sessions(ep)
    assert sessions and all(isinstance(s, str) for s in sessions)
    ep.pop("run", None)
    stamp_policy(ep, 5, 7)
    (r,) = episode_rollouts(ep, "arithmetic", 4096, "interleaved")
    assert r.policy_steps == [5, 7]
    stamp_policy(ep, 6, 6)
    assert episode_rollouts(ep, "arithmetic", 4096, "interleaved")[0].policy_steps == [6]


def test_eval_and_synthesize_name_a_task_set_for_its_server_as_a_run_does(monkeypatch, tmp_path):
    """`prime-hpc eval` and `synthesize` load envs as a run does (`run_evaluator`,
    `synthesize.train_slots`): a task set is asked of the envs' Python and only named
    (its server loads it), its pylib made under the directory given only then; an id no
    Python has keeps its own line."""
    from prime_hpc.config.schema import EnvEntry
    from prime_hpc.orchestrator.envs import load_slots
    from prime_hpc.orchestrator.synthesize import train_slots
    from prime_hpc.rundir import RunDir

    monkeypatch.delenv("PRIME_HPC_ENVS_PYTHON", raising=False)
    here = RunDir(tmp_path / "synth")
    here.root.mkdir()
    (slot,) = train_slots(SimpleNamespace(env=[EnvEntry(id="reverse_text")]), here)
    assert slot.kind == "classic" and slot.env is not None and slot.rows
    assert not here.private_dir.exists()  # a classic env asks nobody: nothing made
    (slot,) = train_slots(SimpleNamespace(env=[EnvEntry(id="reverse_text_v1")]), here)
    assert (slot.kind, slot.env, slot.rows, slot.in_server_only) == ("v1", None, [], True)
    assert (here.private_dir / "envservers" / "pylib" / "prime_hpc").is_symlink()
    assert all(d.stat().st_mode & 0o777 == 0o700 for d in (here.private_dir, here.private_dir / "envservers"))
    with pytest.raises(UserError) as e:
        load_slots([EnvEntry(id="no_such_env_anywhere")], "eval", 4, pylib=here.private_dir / "pylib", where="x")
    line = str(e.value)
    assert len(line.splitlines()) == 1 and line.startswith("x.0: ") and "no_such_env_anywhere" in line, line


def test_doctor_checks_a_task_set_with_the_python_that_runs_it(monkeypatch):
    """`prime-hpc doctor` imports the run's env ids on every node: a task set is answered
    for by the envs' Python there; an id no Python has stays missing."""
    from prime_hpc.job import preflight

    monkeypatch.delenv("PRIME_HPC_ENVS_PYTHON", raising=False)
    monkeypatch.setenv("PRIME_HPC_PREFLIGHT_REQUIRE", "reverse_text,reverse_text_v1")
    line = preflight._imports("orchestrator")
    assert f"reverse_text_v1 (v1, verifiers 0.4.0, {ENVS_PYTHON})" in line, line
    monkeypatch.setenv("PRIME_HPC_PREFLIGHT_REQUIRE", "no_such_env_anywhere")
    with pytest.raises(ImportError, match="cannot import no_such_env_anywhere"):
        preflight._imports("orchestrator")
