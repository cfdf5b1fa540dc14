"""Orchestrator rules without a server: advantages and filtering, the policy-lag rules,
environments and sampling by ratio, sampling arguments, environment ids."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from prime_hpc.config.component import OrchestratorRunConfig, component_config, typed
from prime_hpc.config.compose import compose
from prime_hpc.config.schema import EnvEntry
from prime_hpc.core.errors import UserError
from prime_hpc.orchestrator.envs import EnvSampler, EnvSlot, dataset_rows, load_env
from prime_hpc.orchestrator.rollouts import (
    EMPTY_GROUP,
    ErrorStreak,
    Rollout,
    from_output,
    group_error,
    judge_group,
    pass_at_k,
)
from prime_hpc.rundir import logtree
from prime_hpc.rundir.checkpoints import is_due
from prime_hpc.rundir.drops import Drop


def _r(reward, policy=(0,), error=None, n=3, env="e"):
    return Rollout(
        env=env,
        example_id=0,
        reward=reward,
        input_ids=[1] * n,
        loss_mask=[False] + [True] * (n - 1),
        logprobs=[0.0] * n,
        policy_steps=list(policy),
        num_turns=len(policy),
        is_truncated=False,
        error=error,
    )


# --------------------------------------------------------------------------- pure rules


def test_advantages_are_reward_minus_group_mean():
    g = [_r(1.0), _r(0.0), _r(0.5), _r(0.5)]
    v = judge_group(g, step=1, async_level=2, max_off_policy_steps=8, filter_zero_variance=True, advantage="mean")
    assert v.reason is None
    assert [r.advantage for r in v.kept] == [0.5, -0.5, 0.0, 0.0]


def test_errored_rollouts_leave_the_group_and_the_baseline():
    g = [_r(1.0), _r(0.0, error="boom"), _r(0.0), _r(0.5)]
    v = judge_group(g, step=1, async_level=2, max_off_policy_steps=8, filter_zero_variance=False, advantage="mean")
    assert v.errored == 1 and len(v.kept) == 3
    assert [round(r.advantage, 6) for r in v.kept] == [0.5, -0.5, 0.0]  # mean of 1, 0, 0.5


def test_zero_variance_groups_are_filtered_only_when_asked():
    g = [_r(1.0) for _ in range(4)]
    assert judge_group(g, 1, 2, 8, True, "mean").reason == "no reward variance"
    v = judge_group(g, 1, 2, 8, False, "mean")
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
    assert judge_group([_r(1, (3,)), _r(0, (4,))], 5, 2, 8, False, "mean").reason is None
    assert judge_group([_r(1, (2,)), _r(0, (4,))], 5, 2, 8, False, "mean").reason == "stale"
    # a rollout whose turns came from policies 3 and 6 spans 4 policies: dropped when m=3
    v = judge_group([_r(1, (3, 6)), _r(0, (4,)), _r(0.5, (4,))], 6, 3, 3, False, "mean")
    assert v.dropped_spanning == 1 and len(v.kept) == 2


def test_multi_turn_output_becomes_one_sample_with_masks_and_policies():
    out = {
        "example_id": 7,
        "reward": 0.75,
        "is_truncated": False,
        "trajectory": [
            {
                "tokens": {"prompt_ids": [1, 2], "completion_ids": [3, 4], "completion_logprobs": [-0.1, -0.2]},
                "response": {"policy_step": 4},
            },
            {
                "tokens": {"prompt_ids": [1, 2, 3, 4, 5], "completion_ids": [6], "completion_logprobs": [-0.3]},
                "response": {"policy_step": 5},
            },
        ],
    }
    r = from_output(out, "env", seq_len=100, strategy="interleaved")
    assert r.input_ids == [1, 2, 3, 4, 5, 6]
    assert r.loss_mask == [False, False, True, True, False, True]
    assert r.logprobs == [0.0, 0.0, -0.1, -0.2, 0.0, -0.3]
    assert r.policy_steps == [4, 5] and r.num_turns == 2 and r.error is None
    cut = from_output(out, "env", seq_len=4, strategy="interleaved")
    assert cut.input_ids == [1, 2, 3, 4] and cut.is_truncated
    # a reward that is not a number is the environment's error, never an advantage
    for bad in (float("nan"), float("inf")):
        nan = from_output({**out, "reward": bad}, "env", seq_len=100, strategy="interleaved")
        assert nan.error == f"the environment's reward is {bad} (its rubric must return a finite number)"
        assert nan.reward == 0.0 and judge_group([nan, r], 5, 2, 8, False, "mean").reason == Drop.INVALID


def test_a_turn_an_update_came_in_the_middle_of_records_both_policies():
    """Updates in flight: a turn that started under policy 3 and ended under 5 spans 3
    policies; its sample carries the oldest (the off-policy bound's) and the span."""
    out = {
        "reward": 1.0,
        "trajectory": [
            {
                "tokens": {"prompt_ids": [1, 2], "completion_ids": [3, 4], "completion_logprobs": [-0.1, -0.2]},
                "response": {"policy_step": 3, "policy_step_end": 5},
            },
        ],
    }
    r = from_output(out, "env", seq_len=100, strategy="interleaved")
    assert r.policy_steps == [3, 5] and r.num_turns == 1 and r.oldest_policy == 3 and r.policies_spanned == 3
    (sample,) = r.to_samples()
    assert (sample.policy_step, sample.policies) == (3, 3)
    # one that ended under the policy it began with spans one; more than max_off_policy_steps is dropped
    same = from_output(
        {**out, "trajectory": [{**out["trajectory"][0], "response": {"policy_step": 5, "policy_step_end": 5}}]},
        "env",
        100,
        "interleaved",
    )
    assert same.policy_steps == [5] and same.to_samples()[0].policies == 1
    assert judge_group([r, same], 6, 3, 2, False, "mean").dropped_spanning == 1


def test_an_empty_answer_is_an_empty_rollout_not_an_error():
    r = from_output(
        {"reward": 0.0, "error": {"error_chain_repr": "EmptyModelResponseError('no content')"}, "trajectory": []},
        "e",
        10,
        "interleaved",
    )
    assert r.empty and r.error is None


def test_reward_errors_and_missing_tokens_are_errors():
    r = from_output({"reward": 0.0, "reward_error": "reward: ValueError: x", "trajectory": []}, "e", 10, "interleaved")
    assert r.error.startswith("reward: ValueError")
    r = from_output({"reward": 0.0, "trajectory": [{"tokens": None}]}, "e", 10, "interleaved")
    assert "no token ids" in r.error


def test_a_rollout_that_ended_before_any_model_turn_is_empty_not_an_error():
    r = from_output({"reward": 0.0, "trajectory": [], "completion": []}, "e", 10, "interleaved")
    assert r.empty and r.error is None


def _empty(env="e"):
    return Rollout(
        env=env,
        example_id=0,
        reward=0.0,
        input_ids=[],
        loss_mask=[],
        logprobs=[],
        policy_steps=[],
        num_turns=0,
        is_truncated=False,
        empty=True,
    )


def test_a_group_errors_when_none_of_its_rollouts_can_train():
    boom = _r(0.0, error="reward: ValueError: x")
    assert group_error([boom, boom]) == "reward: ValueError: x"
    assert group_error([_empty(), boom, _empty()]) == "reward: ValueError: x"  # the error, not the emptiness
    assert group_error([_empty(), _empty()]) == EMPTY_GROUP
    assert group_error([boom, boom, _r(0.0)]) is None  # one rollout trains: a flaky env, not a broken one
    assert group_error([_r(0.0) for _ in range(4)]) is None  # a hard task (every reward 0) is not an error
    assert group_error([_r(1.0, policy=(0,)) for _ in range(4)]) is None  # nor a stale or uniform group


def test_errored_groups_are_counted_in_a_row_and_any_other_group_ends_the_streak():
    bad, empty, good = [_r(0.0, error="boom")] * 2, [_empty("f")] * 2, [_r(0.0), _r(0.0)]
    s = ErrorStreak(3)
    assert [s.add(g) for g in (bad, bad, good, bad, empty)] == [False] * 5
    assert s.count == 2 and s.error == EMPTY_GROUP and s.env == "f"
    assert s.add(bad) and (s.count, s.error, s.env) == (3, "boom", "e")
    assert not s.add(good) and (s.count, s.error) == (0, None)
    never = ErrorStreak(0)
    assert not any(never.add(bad) for _ in range(1000))


def test_the_default_tolerates_a_flaky_env():
    """By default a run survives an outage that fails every group in flight at once (at the
    default max_concurrent), several times, and a run of a few errored groups."""
    from prime_hpc.config.schema import OrchestratorConfig

    cfg = OrchestratorConfig()
    in_flight = cfg.max_concurrent // cfg.group_size
    s = ErrorStreak(cfg.max_errored_groups)
    for burst in (3, in_flight, 2 * in_flight, in_flight):
        assert not any(s.add([_r(0.0, error="boom")] * cfg.group_size) for _ in range(burst))
        assert not s.add([_r(0.0), _r(1.0)] * (cfg.group_size // 2))


def _orchestrator(root: Path, *overrides: str):
    """An orchestrator of the reverse_text recipe that judges groups handed to it (no server)."""
    from prime_hpc.orchestrator.envs import load_slots
    from prime_hpc.orchestrator.loop import Orchestrator
    from prime_hpc.runtime.metrics import MetricsLogger

    cfg = compose(["+experiment=reverse_text", f"output_dir={root}", *overrides])
    o = Orchestrator(component_config(cfg, "orchestrator"))
    o.wire(None, None, None, MetricsLogger(o.run, "orchestrator"), load_slots(o.ocfg.env, "train"), [])
    return o


def test_the_orchestrator_gives_up_on_errored_groups_in_a_row_in_one_line_and_a_metrics_row(tmp_path, monkeypatch):
    import asyncio
    import time

    from prime_hpc.orchestrator.envs import EnvFailed, EnvLogRouter
    from prime_hpc.orchestrator.sink import StepFill

    logs = tmp_path / "logs"
    monkeypatch.setenv("PRIME_HPC_LOGS", str(logs))
    o = _orchestrator(
        tmp_path / "run", "orchestrator.max_errored_groups=3", "orchestrator.online_difficulty_filtering=true"
    )
    env_log = logtree.env_worker_log(logs, "train", "reverse_text")
    o.log_router = EnvLogRouter({"train/reverse_text": env_log})
    o.log_router.attach("warning")
    fill = StepFill(t0=time.monotonic())
    error = "reward: ValueError: reward exploded on\n'abc'"
    bad = [_r(0.0, error=error, env="reverse_text") for _ in range(8)]
    uniform = [_r(0.0, env="reverse_text") for _ in range(8)]  # healthy, all rewards 0: dropped, not errored
    for g in (bad, bad, uniform, bad, bad):
        asyncio.run(o.sink.judge(1, list(g), fill))
    assert {k: n for k, n in {"judged": fill.judged, **fill.dropped}.items() if n} == {
        "judged": 5,
        "errored": 4,
        "no reward variance": 1,
    }
    assert not fill.accepted
    with pytest.raises(EnvFailed) as e:
        asyncio.run(o.sink.judge(1, list(bad), fill))
    assert str(e.value) == (
        "train env 'reverse_text': 3 groups in a row errored (orchestrator.max_errored_groups=3); "
        "the last: reward: ValueError: reward exploded on 'abc'"
    )
    assert e.value.log == env_log
    o.log_router.close()
    noted = [line.split(" prime_hpc.envs: ")[1] for line in env_log.read_text().splitlines()]
    assert noted == ["example 0: nothing of the group can train: reward: ValueError: reward exploded on 'abc'"] * 5
    row = json.loads(o.run.metrics("orchestrator").read_text().splitlines()[-1])
    assert row["step"] == 1 and row["filter/unfilled"] == 1 and row["filter/accepted_groups"] == 0
    assert (row["filter/judged_groups"], row["filter/errored_groups"], row["filter/zero_variance_groups"]) == (6, 5, 1)
    assert row["errored_rollouts/all"] == pytest.approx(5 / 6) and not any(k.startswith("reward/") for k in row)


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
    assert str(e.value) == (
        "train env 'flaky_reverse': load_environment() failed: RuntimeError: cannot reach the task server"
    )


def test_several_envs_are_sampled_by_ratio_and_the_sampler_resumes():
    slots = []
    for name, ratio in (("a", 3.0), ("b", 1.0)):
        env = load_env(EnvEntry(id="reverse_text", args={"num_train_examples": 50, "num_eval_examples": 4}))
        slots.append(
            EnvSlot(
                name=name, entry=EnvEntry(id="reverse_text", ratio=ratio), env=env, rows=dataset_rows(env.get_dataset())
            )
        )
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


# --------------------------------------------------------------------------- sampling
def test_sampling_config_becomes_the_request_arguments(tmp_path):
    from prime_hpc.orchestrator.generate import sampling_args

    def args(*overrides: str) -> dict:
        cfg = compose(["+experiment=reverse_text", f"output_dir={tmp_path}", *overrides])
        return sampling_args(
            typed(OrchestratorRunConfig, component_config(cfg, "orchestrator"), "test").orchestrator.sampling
        )

    plain = args()
    assert plain == {
        "temperature": 1.0,
        "top_p": 1.0,
        "logprobs": True,
        "max_tokens": 32,
        "extra_body": {"return_token_ids": True},
    }
    full = args(
        "orchestrator.sampling.top_k=5",
        "orchestrator.sampling.min_p=0.05",
        "orchestrator.sampling.repetition_penalty=1.1",
        "orchestrator.sampling.stop=[zz,'</a>']",
        "orchestrator.sampling.seed=7",
        "+orchestrator.sampling.extra_body.presence_penalty=0.5",
        "+orchestrator.sampling.extra_body.return_token_ids=false",
    )
    assert full["stop"] == ["zz", "</a>"] and full["seed"] == 7
    assert full["extra_body"] == {
        "presence_penalty": 0.5,
        "top_k": 5,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "return_token_ids": True,
    }  # the trainer's token ids are never turned off


# --------------------------------------------------------------------------- environment ids
def test_env_ids_as_users_write_them_pass_submit_and_load_alike(tmp_path):
    """One resolver: what the submit-time check accepts, the orchestrator loads."""
    from prime_hpc.config.validate import env_import_error

    pkg = Path(__file__).resolve().parents[2] / "examples" / "reverse_text" / "reverse_text"
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


ECHO_ENV = '''"""An offline verifiers environment: answer with the word you are given."""
import verifiers as vf
from datasets import Dataset


def load_environment(num_examples: int = 6):
    rows = [{"question": f"word{i}", "answer": f"word{i}"} for i in range(num_examples)]
    parser = vf.Parser(extract_fn=str.strip)

    def same(completion, answer, parser=parser, **kw) -> float:
        return float((parser.parse_answer(completion) or "").strip() == answer)

    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), system_prompt="Repeat the word.", parser=parser,
                            rubric=vf.Rubric(funcs=[same], parser=parser))
'''


def _env_project(root: Path, name: str, layout: str) -> Path:
    """An environment project directory as verifiers environments are published:
    pyproject.toml beside `<module>.py` ("flat") or `<module>/__init__.py` ("package")."""
    module = name.replace("-", "_")
    root.mkdir(parents=True)
    (root / "pyproject.toml").write_text(
        f'[project]\nname = "{name}"\nversion = "0.1.0"\ndependencies = ["verifiers>=0.3.1,<0.4"]\n'
    )
    if layout == "flat":
        (root / f"{module}.py").write_text(ECHO_ENV)
    else:
        (root / module).mkdir()
        (root / module / "__init__.py").write_text(ECHO_ENV)
    return root


@pytest.mark.parametrize("layout", ["flat", "package"])
def test_an_env_project_directory_loads_by_its_path_and_submit_records_it_absolute(
    layout, tmp_path, monkeypatch, capsys
):
    import sys

    import yaml

    from prime_hpc.cli import main
    from prime_hpc.config.validate import env_import_error

    name = f"echo-word-{layout}"  # a directory name that is no module name
    module = name.replace("-", "_")
    work = tmp_path / "work"
    project = _env_project(work / "envs" / name, name, layout)
    monkeypatch.chdir(work)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the loader appends the project's directory
    try:
        rel = f"./envs/{name}"
        assert env_import_error(rel) is None
        env = load_env(EnvEntry(id=rel, args={"num_examples": 5}))
        assert len(dataset_rows(env.get_dataset())) == 5 and env.__class__.__name__ == "SingleTurnEnv"
        out = tmp_path / "run"
        assert (
            main(
                [
                    "submit",
                    "+experiment=reverse_text",
                    "warmup.experiment=null",
                    f"output_dir={out}",
                    f"orchestrator.env=[{{id: {rel}}}]",
                    "orchestrator.eval.env=[{id: ../work/envs/" + name + "}]",
                    "--dry-run",
                ]
            )
            == 0
        ), capsys.readouterr().err
        recorded = yaml.safe_load((out / "config.yaml").read_text())["orchestrator"]
        given = yaml.safe_load((out / "configs" / "orchestrator.yaml").read_text())["orchestrator"]
        for o in (recorded, given):
            assert o["env"][0]["id"] == o["eval"]["env"][0]["id"] == str(project.resolve()), o
        monkeypatch.chdir(tmp_path)  # a job starts elsewhere: the recorded id still names the project
        sys.modules.pop(module, None)
        env = load_env(EnvEntry(id=given["env"][0]["id"], args={"num_examples": 3}))
        assert len(dataset_rows(env.get_dataset())) == 3
    finally:
        sys.modules.pop(module, None)


def test_env_ids_that_are_no_path_and_no_module_are_refused_at_submit_naming_what_was_tried(
    tmp_path, monkeypatch, capsys
):
    from prime_hpc.cli import main

    monkeypatch.chdir(tmp_path)
    _env_project(tmp_path / "echo_word_here", "echo-word-here", "flat")
    broken = tmp_path / "broken_project"  # a pyproject.toml, no module beside it
    broken.mkdir()
    (broken / "pyproject.toml").write_text('[project]\nname = "broken-thing"\n')
    (broken / "README.md").write_text("x")
    cases = [
        ("echo_word_here", ["module 'echo_word_here'", "installed distribution", "give it as ./echo_word_here"]),
        ("./no_such_dir", ["no such file or directory", "./, ../, / or ~"]),
        ("./broken_project", ["broken_project.py", "broken_project/__init__.py", "broken_thing.py"]),
    ]
    for env_id, needles in cases:
        out = tmp_path / "run"
        code = main(
            [
                "submit",
                "+experiment=reverse_text",
                "warmup.experiment=null",
                f"output_dir={out}",
                f"orchestrator.env=[{{id: {env_id}}}]",
                "--dry-run",
            ]
        )
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and "orchestrator.env.0.id" in err, err
        assert all(n in err for n in needles), (needles, err)
        assert not out.exists()


def test_doctor_imports_env_ids_as_the_orchestrator_loads_them(tmp_path, monkeypatch):
    """`prime-hpc doctor` checks on every node what the run records: an absolute path to a
    project directory and a distribution name import there as they load in the run."""
    import sys

    from prime_hpc.job import preflight

    project = _env_project(tmp_path / "envs" / "echo-word-doctor", "echo-word-doctor", "flat")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setitem(preflight.IMPORTS, "router", ())
    try:
        monkeypatch.setenv("PRIME_HPC_PREFLIGHT_REQUIRE", f"{project},reverse-text")
        assert preflight._imports("router") == f"{project} ?, reverse-text ?"
        monkeypatch.setenv("PRIME_HPC_PREFLIGHT_REQUIRE", f"{tmp_path}/envs/missing")
        with pytest.raises(ImportError, match="no such file or directory"):
            preflight._imports("router")
    finally:
        sys.modules.pop("echo_word_doctor", None)


def test_the_orchestrator_only_waits_for_inference_while_its_groups_generate_and_none_finishes():
    """The heartbeat's `waiting_on="inference"`: groups in flight and none finished for
    `QUIET_S` (an engine that hangs holds them); never with nothing in flight."""
    import time
    from types import SimpleNamespace

    from prime_hpc.orchestrator.source import QUIET_S, GroupSource

    ocfg = SimpleNamespace(batch_size=16, group_size=8, oversampling_factor=1.0)
    src = GroupSource(
        sampler=None, generator=SimpleNamespace(max_groups=4), policy=lambda: 0, ocfg=ocfg, async_level=1, max_steps=10
    )
    src.finished_at = time.time() - QUIET_S - 1
    assert not src.waiting_for_inference()  # nothing generating
    src.inflight = {"a group"}
    assert src.waiting_for_inference()
    src.finished_at = time.time()  # one just finished
    assert not src.waiting_for_inference()
