"""`prime-hpc synthesize` without a server: the conversation a rollout keeps (tool calls
and tool messages included), what passes into the dataset, that the SFT trainer's loader
reads the file as it is, that an env that only errors ends it in one line, and the job it
makes on a SLURM cluster. (On the dev cluster: tests/integration/test_sft_learns.py.)"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace as NS

import pytest
import yaml

from prime_hpc.core.errors import UserError
from prime_hpc.orchestrator.rollouts import Rollout, chat_messages
from prime_hpc.orchestrator.synthesize import DATA, SUMMARY, synthesize

TOOL_CALL = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"word": "apple"}'}}
CONVERSATION = [
    {"role": "system", "content": "find the number"},
    {"role": "user", "content": "apple"},
    {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
    {"role": "tool", "content": "apple = 7", "tool_call_id": "c1"},
    {"role": "assistant", "content": "answer: 7"},
]


def test_a_rollout_keeps_the_whole_conversation_with_its_tool_calls():
    class Msg:  # verifiers may hand message objects, not dicts
        def __init__(self, **kw):
            self.__dict__.update(kw)

    class Call:
        def model_dump(self, exclude_none=False):
            return dict(TOOL_CALL)

    prompt = [Msg(role="system", content="find the number", tool_calls=None), {"role": "user", "content": "apple"}]
    completion = [
        Msg(role="assistant", content=None, tool_calls=[Call()]),
        {"role": "tool", "content": "apple = 7", "tool_call_id": "c1", "name": None},
        {"role": "assistant", "content": "answer: 7"},
    ]
    assert chat_messages(prompt) + chat_messages(completion) == CONVERSATION
    assert chat_messages("a plain prompt") == [{"role": "user", "content": "a plain prompt"}]


def test_a_completion_env_s_answer_is_the_assistant_s_turn():
    """An env of plain-text prompts and completions: the prompt is the user's turn, the
    completion the assistant's (else the SFT data would hold nothing to train)."""
    from prime_hpc.orchestrator.rollouts import from_output

    out = {"prompt": "abc", "completion": "cba", "reward": 1.0, "trajectory": []}
    r = from_output(out, "completion-env", 80, "interleaved")
    assert r.messages == [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "cba"}]


def _rollout(example_id, reward, error=None, empty=False) -> Rollout:
    r = Rollout(
        env="lookup",
        example_id=example_id,
        reward=reward,
        input_ids=[1, 2],
        loss_mask=[False, True],
        logprobs=[0.0, -0.1],
        policy_steps=[0],
        num_turns=2,
        is_truncated=False,
        error=error,
        messages=[] if empty else list(CONVERSATION),
        metrics={"correct": reward},
    )
    r.empty = empty
    return r


class Generator:
    """Stands in for the servers: each example's rollouts have the rewards `plan` gives."""

    max_groups = 2

    def __init__(self, plan):
        self.plan = plan

    async def group(self, slot, row, kind, n):
        assert kind == "train"
        return [_rollout(row["example_id"], *spec) for spec in self.plan(row["example_id"])[:n]]


def test_what_passes_is_written_in_the_messages_layout_the_sft_loader_reads(tmp_path):
    from transformers import AutoTokenizer

    from prime_hpc.model import resolve_model
    from prime_hpc.trainer.sft_data import load_dataset, tokenize_dataset

    slot = NS(name="lookup", rows=[{"example_id": i} for i in range(5)])
    rewards = {0: [(1.0,), (0.4,)], 1: [(1.0,), (1.0, "boom")], 2: [(0.0,), (1.0, None, True)], 3: [(1.0,), (1.0,)]}
    out = tmp_path / "synth"
    summary = asyncio.run(
        synthesize([slot], Generator(lambda i: rewards[i]), out, rollouts=2, examples=4, min_reward=1.0, log=print)
    )
    rows = [json.loads(line) for line in (out / DATA).read_text().splitlines()]
    # kept: reward >= 1, no error, a completion; example 4 not played (examples=4)
    assert sorted(r["example_id"] for r in rows) == [0, 1, 3, 3]
    assert all(r["messages"] == CONVERSATION and r["reward"] == 1.0 and r["env"] == "lookup" for r in rows)
    assert summary == json.loads((out / SUMMARY).read_text())
    assert (summary["examples"], summary["rollouts"], summary["kept"], summary["failed"]) == (4, 8, 4, 1)
    assert not (out / f"{DATA}.partial").exists()

    tok = AutoTokenizer.from_pretrained(resolve_model("tiny"))
    ds = load_dataset(str(out / DATA))
    samples = tokenize_dataset(ds, str(out / DATA), tok, NS(system=False, user=False, assistant=True, tool=False), 512)
    assert len(samples) == 4 and all(any(mask) and not all(mask) for _, mask in samples)


def test_an_env_that_only_errors_ends_synthesis_in_one_line(tmp_path):
    slot = NS(name="lookup", rows=[{"example_id": i} for i in range(50)])
    failing = Generator(lambda i: [(0.0, "ValueError: the tool is down")] * 2)
    with pytest.raises(UserError) as e:
        asyncio.run(synthesize([slot], failing, tmp_path / "s", 2, None, None, log=print, max_errored=3))
    assert "'lookup': 3 groups in a row errored: ValueError: the tool is down" in str(e.value)
    assert "\n" not in str(e.value) and not (tmp_path / "s" / DATA).exists()


def test_on_a_slurm_cluster_synthesize_is_a_job_of_the_models_servers(tmp_path, monkeypatch, capsys):
    from prime_hpc.cli import main
    from prime_hpc.launcher import evaluate, launch

    submitted = []

    def prepare_only(cfg, overrides, what=None, results=None):
        job, plan = launch.prepare(cfg, "run", dry_run=True)
        submitted.append((job, plan, what, results))
        raise SystemExit(0)

    monkeypatch.setattr(evaluate, "submit_and_follow", prepare_only)
    out = tmp_path / "synth"
    with pytest.raises(SystemExit):
        main(
            [
                "synthesize",
                "model=tiny",
                "env=reverse-text",
                "args.reverse-text.max_len=5",
                "rollouts=4",
                "examples=20",
                "min_reward=0.9",
                "cluster=dev",
                f"out={out}",
            ]
        )
    job, plan, what, results = submitted[0]
    assert plan.kind == "synthesize" and plan.group_names == ["orchestrator", "inference"]
    assert job.root == out / "job" and results == str(out / DATA) and "4 rollout(s) per example" in what
    orch = yaml.safe_load(job.component_config("orchestrator").read_text())
    assert orch["synthesize"] == {"out": str(out), "rollouts": 4, "examples": 20, "min_reward": 0.9}
    assert orch["orchestrator"]["env"][0]["id"] == "reverse-text"
    assert orch["orchestrator"]["env"][0]["args"] == {"max_len": 5} and orch["eval_job"]["steps"] == []
    capsys.readouterr()
    assert main(["synthesize", "model=tiny", "cluster=dev"]) == 2
    assert "env=<id>" in capsys.readouterr().err
