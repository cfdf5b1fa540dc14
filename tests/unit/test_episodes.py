"""episode_rollouts over real verifiers 0.4 episodes (tests/fixtures/v1_episodes, made by its
make.py under verifiers 0.4), checked against what verifiers itself derives from each
(`<name>.expected.json`: its `Trace.branches` token ids, sampled masks and logprobs, reward,
truncation), and the properties the trainer relies on. Runs without verifiers 0.4."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from prime_hpc.core.errors import UserError
from prime_hpc.orchestrator.episodes import NOT_EXTENDING, episode_rollouts
from prime_hpc.orchestrator.rollouts import judge_group

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "v1_episodes"
NAMES = sorted(p.name.removesuffix(".json") for p in FIXTURES.glob("*.json") if not p.name.endswith(".expected.json"))


def load(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def expected(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.expected.json").read_text())


def test_every_case_has_a_fixture():
    assert {"single_turn", "tool_call", "truncated", "errored_trace", "errored_env", "branching"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_sequences_match_verifiers_branches(name):
    """Each rollout's sequences are verifiers' trainable branches: same tokens, the loss
    mask is its sampled mask, logprobs where sampled and 0 elsewhere."""
    ep, want = load(name), expected(name)
    rollouts = episode_rollouts(ep, "arithmetic", 1 << 16, "branching")
    traces = [t for t in want["traces"] if t["trainable"]]
    assert len(rollouts) == max(1, len(traces))
    for r, t in zip(rollouts, traces):
        branches = [b for b in t["branches"] if b["trainable"]]
        assert len(r.sequences()) == max(1, len(branches))
        for seq, b in zip(r.sequences(), branches):
            assert len(seq.input_ids) == len(seq.loss_mask) == len(seq.logprobs)
            assert seq.input_ids == b["token_ids"]
            assert seq.loss_mask == b["sampled_mask"]
            assert seq.logprobs == pytest.approx(b["logprobs"])
            assert all(lp == 0.0 for lp, m in zip(seq.logprobs, seq.loss_mask) if not m)
            assert all(lp < 0.0 for lp, m in zip(seq.logprobs, seq.loss_mask) if m)  # stand-ins: never 0
        assert r.reward == pytest.approx(t["reward"])
        assert r.is_truncated == t["is_truncated"]
        assert r.num_turns == t["num_turns"]
        assert (r.error is not None) == (not t["ok"] or not want["ok"])


@pytest.mark.parametrize("name", NAMES)
def test_loss_only_on_model_tokens(name):
    """Every trained token lies in a node a model call produced; tool, user and system
    tokens (and each answer's generation-prompt scaffold) are context."""
    ep = load(name)
    for trace in ep["traces"]:
        for node in trace["nodes"]:
            if not node["sampled"]:
                assert not any(node["mask"]), node["message"]["role"]
    trained = [b for t in expected(name)["traces"] if t["trainable"] for b in t["branches"] if b["trainable"]]
    rollouts = episode_rollouts(ep, "arithmetic", 1 << 16, "branching")
    assert sum(r.completion_tokens for r in rollouts) == sum(sum(b["sampled_mask"]) for b in trained)


@pytest.mark.parametrize("name", NAMES)
def test_record_form_reads_the_same(name):
    """verifiers' JSON record (`to_record`) drops None fields (a root node's parent):
    the same rollouts."""

    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if v is not None}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x

    ep = load(name)
    assert episode_rollouts(strip(ep), "e", 1 << 16, "branching") == episode_rollouts(ep, "e", 1 << 16, "branching")


def test_single_turn():
    (r,) = episode_rollouts(load("single_turn"), "arithmetic", 1 << 16, "branching")
    assert (r.env, r.example_id, r.reward, r.num_turns, r.error, r.empty) == ("arithmetic", 0, 1.0, 1, None, False)
    assert r.metrics == {"correct": 1.0, "num_tool_calls": 0.0}
    assert r.policy_steps == [3] and not r.is_truncated and not r.branches
    # the answer "5" then the end-of-turn token were sampled, the rest is context
    assert r.completion_tokens == 2 and r.loss_mask[-2:] == [True, True] and sum(r.loss_mask) == 2
    assert r.completion_text == "5" and r.prompt_text == "What is 2 + 3?"
    assert [m["role"] for m in r.messages] == ["system", "user", "assistant"]


def test_tool_call_turns():
    ep = load("tool_call")
    (r,) = episode_rollouts(ep, "arithmetic", 1 << 16, "branching")
    nodes = ep["traces"][0]["nodes"]
    assert [n["message"]["role"] for n in nodes] == ["system", "user", "assistant", "tool", "assistant"]
    assert r.num_turns == 2 and r.reward == 1.0 and r.error is None
    assert r.policy_steps == [4, 5] and r.policies_spanned == 2  # an update landed mid-episode
    # the tool's result is context between the two answers: the mask is two sampled runs
    start = sum(len(n["token_ids"]) for n in nodes[:3])
    tool = range(start, start + len(nodes[3]["token_ids"]))
    assert not any(r.loss_mask[i] for i in tool) and all(r.logprobs[i] == 0.0 for i in tool)
    runs = sum(1 for i, m in enumerate(r.loss_mask) if m and (i == 0 or not r.loss_mask[i - 1]))
    assert runs == 2
    call = r.messages[2]["tool_calls"][0]
    assert call == {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": '{"a": 19, "b": 23}'}}
    assert r.messages[3] == {"role": "tool", "content": "42", "tool_call_id": "call_0", "name": "add"}


def test_truncated():
    (r,) = episode_rollouts(load("truncated"), "arithmetic", 1 << 16, "branching")
    assert r.is_truncated and r.error is None and r.completion_tokens == 12 and r.reward == 0.0


@pytest.mark.parametrize("stop", ["max_turns", "max_total_tokens", "compaction_failed"])
def test_a_limit_stop_is_truncated(stop):
    ep = load("single_turn")
    ep["traces"][0]["stop_condition"] = stop
    (r,) = episode_rollouts(ep, "arithmetic", 1 << 16, "branching")
    assert r.is_truncated and r.error is None


def test_seq_len_cuts_and_marks_truncated():
    full = episode_rollouts(load("tool_call"), "arithmetic", 1 << 16, "branching")[0]
    (r,) = episode_rollouts(load("tool_call"), "arithmetic", 100, "branching")
    assert len(r.input_ids) == len(r.loss_mask) == len(r.logprobs) == 100 and r.is_truncated
    assert r.input_ids == full.input_ids[:100] and r.loss_mask == full.loss_mask[:100]


def test_errored_trace():
    (r,) = episode_rollouts(load("errored_trace"), "arithmetic", 1 << 16, "branching")
    assert r.error == "ProviderError: Error code: 503 - engine is restarting"
    assert r.reward == 0.0 and r.metrics == {} and r.num_turns == 1
    assert judge_group([r, copy.deepcopy(r)], 3, 1, 2, False, "mean").errored == 2


def test_errored_env():
    (r,) = episode_rollouts(load("errored_env"), "arithmetic", 1 << 16, "branching")
    assert r.error == "EnvError: Arithmetic.run(): RuntimeError: sandbox pool exhausted"
    assert r.empty and r.example_id == 4 and r.input_ids == []


def test_env_error_marks_every_trace():
    ep = load("single_turn")
    ep["errors"] = [{"type": "EnvError", "message": "Arithmetic.finalize() raised\nTraceback ..."}]
    (r,) = episode_rollouts(ep, "arithmetic", 1 << 16, "branching")
    assert r.error == "EnvError: Arithmetic.finalize() raised"


def test_branching_trace():
    ep = load("branching")
    (r,) = episode_rollouts(ep, "arithmetic", 1 << 16, "branching")
    assert len(r.branches) == 1 and r.error is None and r.num_turns == 2
    a, b = r.sequences()
    system = ep["traces"][0]["nodes"][0]["token_ids"]
    assert a.input_ids[: len(system)] == b.input_ids[: len(system)] == system  # shared root
    assert a.input_ids != b.input_ids[: len(a.input_ids)]  # b does not extend a
    samples = r.to_samples()
    assert [s.input_ids for s in samples] == [a.input_ids, b.input_ids]
    (i,) = episode_rollouts(ep, "arithmetic", 1 << 16, "interleaved")
    assert i.error == NOT_EXTENDING and not i.branches


def test_untrained_branches_and_agents_are_left_out():
    ep = load("branching")
    nodes = ep["traces"][0]["nodes"]
    nodes[2]["semantic_parents"] = [{"node": 1, "type": "compaction_attempt"}]  # never resumed from
    (r,) = episode_rollouts(ep, "arithmetic", 1 << 16, "branching")
    assert not r.branches and r.input_ids[-1] == nodes[4]["token_ids"][-1]
    nodes[3]["semantic_parents"] = [{"node": 2, "type": "compaction"}]  # resumed: trains
    (r,) = episode_rollouts(ep, "arithmetic", 1 << 16, "branching")
    assert len(r.branches) == 1
    judge = load("single_turn")
    judge["traces"].append(copy.deepcopy(judge["traces"][0]) | {"agent": {"name": "judge", "trainable": False}})
    assert len(episode_rollouts(judge, "arithmetic", 1 << 16, "branching")) == 1


def test_no_token_ids_is_an_error():
    ep = load("single_turn")
    for n in ep["traces"][0]["nodes"]:
        n["token_ids"], n["mask"], n["logprobs"] = [], [], []
    (r,) = episode_rollouts(ep, "arithmetic", 1 << 16, "branching")
    assert r.error is not None and "no token ids" in r.error


def test_non_finite_reward_is_an_error():
    ep = load("single_turn")
    ep["traces"][0]["rewards"]["correct"]["score"] = float("nan")
    (r,) = episode_rollouts(ep, "arithmetic", 1 << 16, "branching")
    assert r.reward == 0.0 and "finite" in (r.error or "")


def _break(path: str, value):
    ep = load("tool_call")
    target, *keys = path.split("/")
    obj = ep
    for k in [target, *keys][:-1]:
        obj = obj[int(k)] if isinstance(obj, list) else obj[k]
    last = [target, *keys][-1]
    if value is KeyError:
        del obj[last]
    else:
        obj[int(last) if isinstance(obj, list) else last] = value
    return ep


@pytest.mark.parametrize(
    "ep, words",
    [
        ([], "must be an object"),
        (_break("traces", KeyError), "no 'traces'"),
        (_break("traces/0/nodes", KeyError), "traces[0] has no 'nodes'"),
        (_break("traces/0/nodes/2/token_ids", KeyError), "nodes[2] has no 'token_ids'"),
        (_break("traces/0/nodes/2/mask", [True]), "'mask' has 1 entries"),
        (_break("traces/0/nodes/2/logprobs", [-0.5]), "'logprobs' has 1 entries for 72 sampled"),
        (_break("traces/0/nodes/1/parent", 3), "'parent' must be the index of an earlier node"),
        (_break("traces/0/rewards/correct", 1.0), "rewards['correct'] must be {score, weight}"),
        (_break("run/work/policy", {"start": 2}), "run.work.policy must be {start, end}"),
    ],
)
def test_malformed_episode_is_refused_in_one_line(ep, words):
    with pytest.raises(UserError) as e:
        episode_rollouts(ep, "arithmetic", 1 << 16, "branching")
    assert words in str(e.value) and "\n" not in str(e.value)


def test_imports_no_verifiers():
    code = (
        "import sys, prime_hpc.orchestrator.episodes\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('verifiers', 'torch', 'vllm'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
