"""Orchestrator: environments, sampling by ratio, advantages and filtering, the policy-lag
rules, and the real loop against the session's vLLM servers (tiny model)."""
from __future__ import annotations

import asyncio
import json
import shutil
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from prime_hpc.rundir import batch
from prime_hpc.config.compose import component_config, compose
from prime_hpc.core.errors import UserError
from prime_hpc.config.schema import EnvEntry
from prime_hpc.config.component import OrchestratorRunConfig, typed
from prime_hpc.orchestrator.envs import EnvSampler, EnvSlot, dataset_rows, load_env
from prime_hpc.rundir.checkpoints import is_due
from prime_hpc.orchestrator.loop import Orchestrator
from prime_hpc.orchestrator.rollouts import Rollout, from_output, judge_group, pass_at_k
from prime_hpc.rundir import RunDir, mark_stable

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS / "envs"))


def _r(reward, policy=(0,), error=None, n=3, env="e"):
    return Rollout(env=env, example_id=0, reward=reward, input_ids=[1] * n, loss_mask=[False] + [True] * (n - 1),
                   logprobs=[0.0] * n, policy_steps=list(policy), num_turns=len(policy), is_truncated=False,
                   error=error)


# --------------------------------------------------------------------------- pure rules


def test_advantages_are_reward_minus_group_mean():
    g = [_r(1.0), _r(0.0), _r(0.5), _r(0.5)]
    v = judge_group(g, step=1, async_level=2, max_off_policy_steps=8, filter_zero_variance=True)
    assert v.reason is None
    assert [r.advantage for r in v.kept] == [0.5, -0.5, 0.0, 0.0]


def test_errored_rollouts_leave_the_group_and_the_baseline():
    g = [_r(1.0), _r(0.0, error="boom"), _r(0.0), _r(0.5)]
    v = judge_group(g, step=1, async_level=2, max_off_policy_steps=8, filter_zero_variance=False)
    assert v.errored == 1 and len(v.kept) == 3
    assert [round(r.advantage, 6) for r in v.kept] == [0.5, -0.5, 0.0]  # mean of 1, 0, 0.5


def test_zero_variance_groups_are_filtered_only_when_asked():
    g = [_r(1.0) for _ in range(4)]
    assert judge_group(g, 1, 2, 8, True).reason == "no reward variance"
    v = judge_group(g, 1, 2, 8, False)
    assert v.reason is None and all(r.advantage == 0.0 for r in v.kept)


def test_difficulty_filter_by_mean_reward_and_variance():
    from types import SimpleNamespace

    def verdict(rewards, lo=None, hi=None, var=0.0):
        f = SimpleNamespace(min_reward=lo, max_reward=hi, min_reward_variance=var)
        return judge_group([_r(x) for x in rewards], 1, 2, 8, False, "mean", f).reason

    assert verdict([0.0, 0.0, 0.1, 0.0], lo=0.05) == "too hard"  # mean 0.025
    assert verdict([0.0, 0.0, 0.2, 0.0], lo=0.05) is None  # mean 0.05: not below
    assert verdict([1.0, 1.0, 0.9, 1.0], hi=0.95) == "too easy"  # mean 0.975
    assert verdict([1.0, 0.9, 0.9, 1.0], hi=0.95) is None  # mean 0.95: not above
    # population variance of 0, 0, 1, 1 is 0.25; of 0.4, 0.6, 0.4, 0.6 it is 0.01
    assert verdict([0.0, 0.0, 1.0, 1.0], var=0.1) is None
    assert verdict([0.4, 0.6, 0.4, 0.6], var=0.1) == "low reward variance"
    assert verdict([0.4, 0.6, 0.4, 0.6]) is None  # the defaults keep everything


def test_policy_lag_bound_and_spanning_rollouts():
    # step 5, async_level 2: policies 3.. are fine, 2 is stale
    assert judge_group([_r(1, (3,)), _r(0, (4,))], 5, 2, 8, False).reason is None
    assert judge_group([_r(1, (2,)), _r(0, (4,))], 5, 2, 8, False).reason == "stale"
    # a rollout whose turns came from policies 3 and 6 spans 4 policies: dropped when m=3
    v = judge_group([_r(1, (3, 6)), _r(0, (4,)), _r(0.5, (4,))], 6, 3, 3, False)
    assert v.dropped_spanning == 1 and len(v.kept) == 2


def test_multi_turn_output_becomes_one_sample_with_masks_and_policies():
    out = {"example_id": 7, "reward": 0.75, "is_truncated": False, "trajectory": [
        {"tokens": {"prompt_ids": [1, 2], "completion_ids": [3, 4], "completion_logprobs": [-0.1, -0.2]},
         "response": {"policy_step": 4}},
        {"tokens": {"prompt_ids": [1, 2, 3, 4, 5], "completion_ids": [6], "completion_logprobs": [-0.3]},
         "response": {"policy_step": 5}},
    ]}
    r = from_output(out, "env", seq_len=100)
    assert r.input_ids == [1, 2, 3, 4, 5, 6]
    assert r.loss_mask == [False, False, True, True, False, True]
    assert r.logprobs == [0.0, 0.0, -0.1, -0.2, 0.0, -0.3]
    assert r.policy_steps == [4, 5] and r.num_turns == 2 and r.error is None
    cut = from_output(out, "env", seq_len=4)
    assert cut.input_ids == [1, 2, 3, 4] and cut.is_truncated


def test_an_empty_answer_is_an_empty_rollout_not_an_error():
    r = from_output({"reward": 0.0, "error": {"error_chain_repr": "EmptyModelResponseError('no content')"},
                     "trajectory": []}, "e", 10)
    assert r.empty and r.error is None


def test_reward_errors_and_missing_tokens_are_errors():
    r = from_output({"reward": 0.0, "reward_error": "reward: ValueError: x", "trajectory": []}, "e", 10)
    assert r.error.startswith("reward: ValueError")
    r = from_output({"reward": 0.0, "trajectory": [{"tokens": None}]}, "e", 10)
    assert "no token ids" in r.error


def test_pass_at_k_and_checkpoint_steps():
    assert pass_at_k([0.2, 1.0]) == 1.0 and pass_at_k([0.99, 0.5]) == 0.0
    ck = {"enabled": True, "interval": 5}
    assert [s for s in range(1, 13) if is_due(s, s == 12, ck)] == [5, 10, 12]
    assert not any(is_due(s, s == 12, {"enabled": False, "interval": None}) for s in range(1, 13))


# --------------------------------------------------------------------------- envs


def test_unknown_env_fails_with_one_line_naming_it():
    with pytest.raises(UserError) as e:
        load_env(EnvEntry(id="no_such_env_module", args={}))
    msg = str(e.value)
    assert "no_such_env_module" in msg and "\n" not in msg and "cannot be imported" in msg
    with pytest.raises(UserError) as e:
        load_env(EnvEntry(id="flaky_reverse", args={"fail_load": True}))
    assert str(e.value) == ("train env 'flaky_reverse': load_environment() failed: "
                            "RuntimeError: cannot reach the task server")


def test_several_envs_are_sampled_by_ratio_and_the_sampler_resumes():
    slots = []
    for name, ratio in (("a", 3.0), ("b", 1.0)):
        env = load_env(EnvEntry(id="reverse_text", args={"num_train_examples": 50, "num_eval_examples": 4}))
        slots.append(EnvSlot(name=name, entry=EnvEntry(id="reverse_text", ratio=ratio), env=env,
                             rows=dataset_rows(env.get_dataset())))
    s = EnvSampler(slots, seed=3)
    picks = Counter(s.next()[0].name for _ in range(4000))
    assert abs(picks["a"] / 4000 - 0.75) < 0.03, picks
    state = json.loads(json.dumps(s.state()))  # JSON round trip, as in a checkpoint
    expected = [(sl.name, row["example_id"]) for sl, row in (s.next() for _ in range(60))]
    s2 = EnvSampler(slots, seed=3)
    s2.load_state(state)
    assert [(sl.name, row["example_id"]) for sl, row in (s2.next() for _ in range(60))] == expected
    # every example of an env is used once per epoch
    s3 = EnvSampler(slots[1:], seed=0)
    assert sorted(row["example_id"] for _, row in (s3.next() for _ in range(50))) == list(range(50))


# --------------------------------------------------------------------------- real loop


def _orch_cfg(root: Path, inference, overrides: list[str]) -> dict:
    cfg = compose(["+experiment=reverse_text", f"output_dir={root}", "orchestrator.batch_size=16",
                   "orchestrator.group_size=4", "orchestrator.max_concurrent=16", "orchestrator.eval.interval=0",
                   "orchestrator.eval.at_start=false", "async_level=2", "orchestrator.sampling.max_tokens=12",
                   *overrides])
    c = component_config(cfg, "orchestrator")
    c["inference_nodes"] = len(inference.endpoints.servers)
    root.mkdir(parents=True, exist_ok=True)
    shutil.copytree(inference.run.endpoints_dir, RunDir(root).endpoints_dir)  # the same servers
    return c


def _run(cfg) -> dict:
    return asyncio.run(Orchestrator(cfg).main())


@pytest.fixture
def keyed(inference, monkeypatch):
    monkeypatch.setenv("INFERENCE_SERVER_API_KEY", inference.key)
    return inference


@pytest.mark.vllm
def test_one_step_of_rollouts_is_read_back_by_the_trainer_reader(keyed, tmp_path):
    cfg = _orch_cfg(tmp_path / "run", keyed, ["max_steps=1", "cluster.trainer.nodes=1",
                                              "cluster.trainer.nproc_per_node=2", "trainer.micro_batch_size=3"])
    summary = _run(cfg)
    run = RunDir(cfg["output_dir"])
    assert summary["last_step"] == 1 and summary["samples"] >= 14
    shards = [batch.read_rank(run, 1, r, timeout_s=5) for r in (0, 1)]
    assert len(shards[0].micro_batches) == len(shards[1].micro_batches)
    total = 0
    for b in shards:
        for mb in b.micro_batches:
            assert mb["input_ids"].shape == mb["loss_mask"].shape == mb["inference_logprobs"].shape
            assert mb["input_ids"].shape[0] <= 3
            real = mb["loss_mask"]
            assert (mb["inference_logprobs"][real] <= 0).all()
            assert (mb["policy_steps"] == 0).all()
            total += int(mb["attention_mask"].any(dim=1).sum()) if real.any() else 0
    assert total == summary["samples"]
    rows = [json.loads(line) for line in run.metrics("orchestrator").read_text().splitlines()]
    assert rows[0]["step"] == 1
    for key in ("reward/all/mean", "reward/reverse_text/mean", "seq_len/all/mean", "is_truncated/all/mean",
                "num_turns/all/mean", "empty_rollouts/all", "errored_rollouts/all", "time/wait_for_ckpt",
                "off_policy/lag/mean"):
        assert key in rows[0], key
    # single-turn env: one turn per rollout, except empty answers (no turn recorded)
    assert rows[0]["num_turns/all/mean"] == pytest.approx(1.0 - rows[0]["empty_rollouts/all"])
    assert rows[0]["errored_rollouts/all"] == 0.0


@pytest.mark.vllm
def test_a_groups_identical_requests_reach_the_server_as_one(keyed):
    """8 rollouts asking the same prompt at once: one request with n=8 to the servers, and
    each rollout gets a completion of its own with its tokens, logprobs and policy step."""
    from prime_hpc.orchestrator.client import make_client

    from verifiers.legacy.types import UserMessage

    client = make_client(keyed.endpoints.openai_base_url, keyed.key)
    prompt = [UserMessage(content="abcdef")]
    args = {"temperature": 1.0, "max_tokens": 8, "logprobs": True, "extra_body": {"return_token_ids": True}}

    async def group():
        return await asyncio.gather(*(client.get_response(prompt, "tiny", args, state={"i": i}) for i in range(8)))

    before = sum(p["served"] for p in asyncio.run(keyed.admin().policies()))
    responses = asyncio.run(group())
    after = sum(p["served"] for p in asyncio.run(keyed.admin().policies()))
    assert after - before == 1
    tokens = [tuple(r.message.tokens.completion_ids) for r in responses]
    assert all(tokens) and len(set(tokens)) > 1  # sampled separately, not one answer copied
    for r in responses:
        assert len(r.message.tokens.completion_logprobs) == len(r.message.tokens.completion_ids)
        assert r.policy_step == 0


@pytest.mark.vllm
def test_without_max_steps_the_data_is_used_once_and_the_end_is_written(keyed, tmp_path):
    """max_steps=null: every train task is used once, the last full step is written, then
    rollouts/DONE names it (the trainer stops there)."""
    cfg = _orch_cfg(tmp_path / "run", keyed, ["max_steps=null", "orchestrator.eval.env=[]"])
    cfg["orchestrator"]["env"] = [{"id": "reverse_text", "args": {"num_train_examples": 10}, "ratio": 1.0,
                                   "name": None}]
    summary = _run(cfg)
    run = RunDir(cfg["output_dir"])
    rows = [json.loads(line) for line in run.metrics("orchestrator").read_text().splitlines()]
    done = json.loads(run.rollouts_done.read_text())
    # 10 tasks, 4 groups a step: at most 2 full steps; the 2 tasks left cannot fill a third, so
    # the run ends there without waiting for newer weights
    assert 1 <= done["last_step"] == summary["last_step"] == len(rows) <= 2
    assert 4 * len(rows) <= summary["problems"] <= 10
    assert rows and run.rollout_steps() == list(range(1, len(rows) + 1))


@pytest.mark.vllm
def test_a_raising_reward_is_counted_and_the_run_goes_on(keyed, tmp_path):
    cfg = _orch_cfg(tmp_path / "run", keyed, ["max_steps=2", "orchestrator.eval.env=[]"])
    cfg["orchestrator"]["env"] = [{"id": "flaky_reverse", "args": {"raise_every": 2, "num_train_examples": 40},
                                   "ratio": 1.0, "name": None}]
    summary = _run(cfg)
    run = RunDir(cfg["output_dir"])
    rows = [json.loads(line) for line in run.metrics("orchestrator").read_text().splitlines()]
    assert summary["last_step"] == 2
    assert sum(r["errored_rollouts/all"] for r in rows) > 0
    assert all(r["errored_rollouts/flaky_reverse"] < 1.0 for r in rows)


@pytest.mark.vllm
def test_difficulty_filtering_drops_groups_without_reward_variance(keyed, tmp_path):
    cfg = _orch_cfg(tmp_path / "run", keyed, ["max_steps=1", "orchestrator.online_difficulty_filtering=true",
                                              "orchestrator.eval.env=[]"])
    cfg["orchestrator"]["env"] = [{"id": "flaky_reverse", "args": {"constant_every": 2, "num_train_examples": 40},
                                   "ratio": 1.0, "name": None}]
    _run(cfg)
    run = RunDir(cfg["output_dir"])
    row = json.loads(run.metrics("orchestrator").read_text().splitlines()[0])
    assert row["filter/zero_variance_groups"] > 0
    assert batch.read_rank(run, 1, 0, timeout_s=5).num_loss_tokens > 0  # the step still filled up


@pytest.mark.vllm
def test_policy_lag_is_bounded_while_a_slow_trainer_publishes_weights(keyed, tmp_path):
    """A stand-in trainer publishes weights/step_n only after rollouts/step_n appear (and
    holds step 2 back a while). With async_level=1 the rollouts of step n must come from
    policy >= n-1: assert on the recorded policy steps."""
    from prime_hpc.model import resolve_model

    cfg = _orch_cfg(tmp_path / "run", keyed, ["max_steps=4", "async_level=1", "orchestrator.eval.env=[]"])
    run = RunDir(cfg["output_dir"])
    base = Path(resolve_model("tiny"))
    stop = threading.Event()

    def trainer():
        for n in range(1, 5):
            while not (run.rollout_step(n) / "STABLE").exists():
                if stop.is_set():
                    return
                time.sleep(0.05)
            if n == 2:
                time.sleep(3)  # a slow step: the orchestrator must wait, not run ahead
            d = run.weights_step(n)
            shutil.copytree(base, d)
            mark_stable(d)

    t = threading.Thread(target=trainer, daemon=True)
    t.start()
    try:
        orch = Orchestrator(cfg)
        asyncio.run(orch.main())
    finally:
        stop.set()
        t.join(timeout=30)
        asyncio.run(keyed.admin().reload_base())
    for n in range(1, 5):
        steps = set()
        for r in range(int(cfg["trainer_ranks"])):
            b = batch.read_rank(run, n, r, timeout_s=5)
            for mb in b.micro_batches:
                if mb["loss_mask"].any():
                    steps |= set(mb["policy_steps"].tolist())
        assert steps and min(steps) >= n - 1, (n, steps)
    assert [u["step"] for u in orch.update_log] == sorted(u["step"] for u in orch.update_log)
    assert orch.update_log and orch.update_log[-1]["step"] >= 3
    rows = [json.loads(line) for line in run.metrics("orchestrator").read_text().splitlines()]
    assert max(r["time/wait_for_ckpt"] for r in rows) > 0


def _run_with_weights(root: Path, steps: dict[int, int]) -> RunDir:
    from omegaconf import OmegaConf

    from prime_hpc.model import build_tiny_model

    cfg = compose(["+experiment=reverse_text", f"output_dir={root}", "orchestrator.eval.num_examples=4",
                   "orchestrator.eval.rollouts_per_example=1", "inference.dtype=float32"])
    root.mkdir(parents=True)
    OmegaConf.save(cfg, root / "config.yaml", resolve=True)
    run = RunDir(root)
    for step, seed in steps.items():
        build_tiny_model(run.weights_step(step), seed=seed)
        mark_stable(run.weights_step(step))
    return run


def test_eval_of_missing_steps_is_a_one_line_error(tmp_path):
    from tests.conftest import cli

    run = _run_with_weights(tmp_path / "run", {1: 5})
    r = cli("eval", str(run.root), "steps=1,7")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
    assert "no complete weights for step(s) [7]" in r.stderr and "available: [1]" in r.stderr


@pytest.mark.vllm
def test_eval_scores_saved_weights_of_a_run(tmp_path):
    from tests.conftest import cli

    run = _run_with_weights(tmp_path / "run", {1: 5, 2: 6})
    r = cli("eval", str(run.root), "steps=1,2", timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    for step in (1, 2):
        row = json.loads(run.eval_result(step).read_text())
        assert row["step"] == step
        assert 0.0 <= row["eval/reverse_text/avg@1"] <= 1.0 and row["eval/reverse_text/pass@1"] in (0.0, 0.25, 0.5, 0.75, 1.0)
        assert f"step     {step}" in r.stdout
    assert not (run.eval_dir / "endpoints" / "inference_0.json").exists()  # its server is gone


@pytest.mark.vllm
def test_eval_of_any_endpoint_on_any_env_writes_a_result_and_a_table(keyed, tmp_path):
    from tests.conftest import cli

    out = tmp_path / "ev"
    r = cli("eval", f"client.base_url={keyed.endpoints.router}", "client.model=tiny", "env=reverse-text",
            "rollouts=2", "examples=3", f"out={out}", timeout=300)  # a distribution name, as users write it
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((out / "eval.json").read_text())
    assert set(result["metrics"]) == {"eval/reverse-text/avg@2", "eval/reverse-text/pass@2"}  # named as given
    assert result["envs"] == ["reverse-text"] and result["rollouts_per_example"] == 2 and result["num_examples"] == 3
    avg = result["metrics"]["eval/reverse-text/avg@2"]
    assert 0.0 <= avg <= 1.0 and result["metrics"]["eval/reverse-text/pass@2"] in (0.0, 1 / 3, 2 / 3, 1.0)
    header, row = r.stdout.splitlines()[:2]
    assert header.split() == ["ENV", "AVG@2", "PASS@2"] and row.split()[:2] == ["reverse-text", f"{avg:.3f}"]
    bad = cli("eval", "model=tiny")  # no env: one line, nothing started
    assert bad.returncode == 2 and "env=<id>" in bad.stderr and bad.stderr.strip().count("\n") == 0


@pytest.mark.vllm
def test_opd_takes_teacher_logprobs_and_sft_trains_on_teacher_completions(keyed, tmp_path):
    """The session's servers double as the teacher (same tiny model): in opd the per-token
    advantages are log p_teacher - log p_student, ~0 here; in sft the teacher generates."""
    teacher = keyed.endpoints.servers[1] + "/v1"
    common = ["max_steps=1", "orchestrator.eval.env=[]", f"orchestrator.teacher.client.base_url={teacher}",
              "orchestrator.teacher.client.model=tiny"]
    cfg = _orch_cfg(tmp_path / "opd", keyed, [*common, "orchestrator.training_mode=opd"])
    _run(cfg)
    b = batch.read_rank(RunDir(cfg["output_dir"]), 1, 0, timeout_s=5)
    assert b.info["mode"] == "opd"
    for mb in b.micro_batches:
        adv, mask = mb["advantages"], mb["loss_mask"]
        if mask.any():
            assert (adv[~mask] == 0).all()
            assert adv[mask].abs().max() < 0.01  # same weights: teacher and student agree per token
    cfg = _orch_cfg(tmp_path / "sft", keyed, [*common, "orchestrator.training_mode=sft"])
    summary = _run(cfg)
    b = batch.read_rank(RunDir(cfg["output_dir"]), 1, 0, timeout_s=5)
    assert b.info["mode"] == "sft" and summary["samples"] >= 14 and b.num_loss_tokens > 0


@pytest.mark.vllm
def test_resume_continues_from_the_checkpoint_step_with_the_sampler_state(keyed, tmp_path):
    """Steps 1-2 with checkpoints; a resume from ckpt.step=-1 writes step 3 only, starting
    from the saved totals and sampler position (the same tasks as an uninterrupted run)."""
    from prime_hpc.model import resolve_model

    cfg = _orch_cfg(tmp_path / "run", keyed, ["max_steps=2", "ckpt.interval=1", "orchestrator.eval.env=[]"])
    run = RunDir(cfg["output_dir"])
    first = _run(cfg)
    assert first["last_step"] == 2
    for step in (1, 2):  # the trainer's parts of the checkpoints and its weights
        assert (run.checkpoint_part(step, "orchestrator") / "STABLE").exists()
        run.checkpoint_part(step, "trainer").mkdir(parents=True)
        mark_stable(run.checkpoint_part(step, "trainer"))
    shutil.copytree(resolve_model("tiny"), run.weights_step(2))
    mark_stable(run.weights_step(2))
    saved = json.loads((run.checkpoint_part(2, "orchestrator") / "state.json").read_text())
    shutil.rmtree(run.rollout_step(1))
    shutil.rmtree(run.rollout_step(2))
    cfg2 = dict(cfg, max_steps=3, ckpt={**cfg["ckpt"], "step": -1})
    orch = Orchestrator(cfg2)
    try:
        summary = asyncio.run(orch.main())
    finally:
        asyncio.run(keyed.admin().reload_base())
    assert summary["last_step"] == 3 and summary["problems"] > saved["totals"]["problems"]
    assert [s for s in range(1, 4) if run.rollout_step(s).exists()] == [3]
    rows = [json.loads(line) for line in run.metrics("orchestrator").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    step3 = sum(int(mb["loss_mask"].any(-1).sum()) for r in range(int(cfg["trainer_ranks"]))
                for mb in batch.read_rank(run, 3, r, timeout_s=5).micro_batches)
    # the totals continue from the checkpoint (not from 0)
    assert rows[2]["progress/total_samples"] == summary["samples"] == saved["totals"]["samples"] + step3
    assert orch.policy >= 2  # the servers were given the checkpoint's weights
    bad = dict(cfg, ckpt={**cfg["ckpt"], "step": 7})
    with pytest.raises(UserError, match=r"ckpt.step=7: no complete checkpoint at step 7 .* complete checkpoints: \[1, 2\]"):
        asyncio.run(Orchestrator(bad).main())


# --------------------------------------------------------------------------- sampling
def test_sampling_config_becomes_the_request_arguments(tmp_path):
    from prime_hpc.orchestrator.loop import sampling_args

    def args(*overrides: str) -> dict:
        cfg = compose(["+experiment=reverse_text", f"output_dir={tmp_path}", *overrides])
        return sampling_args(typed(OrchestratorRunConfig, component_config(cfg, "orchestrator"), "test")
                             .orchestrator.sampling)

    plain = args()
    assert plain == {"temperature": 1.0, "top_p": 1.0, "logprobs": True, "max_tokens": 32,
                     "extra_body": {"return_token_ids": True}}
    full = args("orchestrator.sampling.top_k=5", "orchestrator.sampling.min_p=0.05",
                "orchestrator.sampling.repetition_penalty=1.1", "orchestrator.sampling.stop=[zz,'</a>']",
                "orchestrator.sampling.seed=7", "+orchestrator.sampling.extra_body.presence_penalty=0.5",
                "+orchestrator.sampling.extra_body.return_token_ids=false")
    assert full["stop"] == ["zz", "</a>"] and full["seed"] == 7
    assert full["extra_body"] == {"presence_penalty": 0.5, "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1,
                                  "return_token_ids": True}  # the trainer's token ids are never turned off


# --------------------------------------------------------------------------- environment ids
def test_env_ids_as_users_write_them_pass_submit_and_load_alike(tmp_path):
    """One resolver: what the submit-time check accepts, the orchestrator loads."""
    from prime_hpc.config.validate import env_import_error

    pkg = Path(__file__).resolve().parents[1] / "examples" / "reverse_text" / "reverse_text"
    single = tmp_path / "my_reverse.py"  # a module file
    single.write_text((pkg / "__init__.py").read_text())
    for env_id in ("reverse_text", "reverse-text", "someone/reverse-text", str(pkg), str(single)):
        assert env_import_error(env_id) is None, env_id
        env = load_env(EnvEntry(id=env_id, args={"num_train_examples": 20, "num_eval_examples": 4}))
        assert len(dataset_rows(env.get_dataset())) == 20, env_id
    for env_id in ("no-such-env", "someone/no_such_env", str(tmp_path)):
        err = env_import_error(env_id)
        assert err and ("tried" in err or "package directory" in err), err
        with pytest.raises(UserError, match="cannot be imported"):
            load_env(EnvEntry(id=env_id, args={}))
