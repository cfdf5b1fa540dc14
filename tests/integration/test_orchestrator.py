"""The orchestrator's real loop against the session's vLLM servers (tiny model): rollouts
read back by the trainer, coalesced requests, the end of the data, errors, filtering, the
policy lag under a slow trainer, eval, distillation, resume."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from pathlib import Path

import pytest

from prime_hpc.config.component import component_config
from prime_hpc.config.compose import compose
from prime_hpc.core.errors import UserError
from prime_hpc.orchestrator.loop import Orchestrator
from prime_hpc.rundir import RunDir, batch, mark_stable

# --------------------------------------------------------------------------- real loop


def _orch_cfg(root: Path, inference, overrides: list[str]) -> dict:
    cfg = compose(
        [
            "+experiment=reverse_text",
            f"output_dir={root}",
            "orchestrator.batch_size=16",
            "orchestrator.group_size=4",
            "orchestrator.max_concurrent=16",
            "orchestrator.eval.interval=0",
            "orchestrator.eval.at_start=false",
            "async_level=2",
            "orchestrator.sampling.max_tokens=12",
            *overrides,
        ]
    )
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
    cfg = _orch_cfg(
        tmp_path / "run",
        keyed,
        ["max_steps=1", "cluster.trainer.nodes=1", "cluster.trainer.nproc_per_node=2", "trainer.micro_batch_size=3"],
    )
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
    for key in (
        "reward/all/mean",
        "reward/reverse_text/mean",
        "seq_len/all/mean",
        "is_truncated/all/mean",
        "num_turns/all/mean",
        "empty_rollouts/all",
        "errored_rollouts/all",
        "time/wait_for_ckpt",
        "off_policy/lag/mean",
    ):
        assert key in rows[0], key
    # single-turn env: one turn per rollout, except empty answers (no turn recorded)
    assert rows[0]["num_turns/all/mean"] == pytest.approx(1.0 - rows[0]["empty_rollouts/all"])
    assert rows[0]["errored_rollouts/all"] == 0.0


@pytest.mark.vllm
def test_a_groups_identical_requests_reach_the_server_as_one(keyed):
    """8 rollouts asking the same prompt at once: one request with n=8 to the servers, and
    each rollout gets a completion of its own with its tokens, logprobs and policy step."""
    from verifiers.legacy.types import UserMessage

    from prime_hpc.orchestrator.client import make_client

    client = make_client(keyed.endpoints.openai_base_url, keyed.key)
    prompt = [UserMessage(content="abcdef")]
    # at least 2 tokens each: a random tiny model may otherwise stop at once, an empty answer
    args = {
        "temperature": 1.0,
        "max_tokens": 8,
        "logprobs": True,
        "extra_body": {"return_token_ids": True, "min_tokens": 2},
    }

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
    cfg["orchestrator"]["env"] = [
        {"id": "reverse_text", "args": {"num_train_examples": 10}, "ratio": 1.0, "name": None}
    ]
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
    cfg["orchestrator"]["env"] = [
        {"id": "flaky_reverse", "args": {"raise_every": 2, "num_train_examples": 40}, "ratio": 1.0, "name": None}
    ]
    summary = _run(cfg)
    run = RunDir(cfg["output_dir"])
    rows = [json.loads(line) for line in run.metrics("orchestrator").read_text().splitlines()]
    assert summary["last_step"] == 2
    assert sum(r["errored_rollouts/all"] for r in rows) > 0
    assert all(r["errored_rollouts/flaky_reverse"] < 1.0 for r in rows)


@pytest.mark.vllm
def test_difficulty_filtering_drops_groups_without_reward_variance(keyed, tmp_path):
    cfg = _orch_cfg(
        tmp_path / "run",
        keyed,
        ["max_steps=1", "orchestrator.online_difficulty_filtering=true", "orchestrator.eval.env=[]"],
    )
    cfg["orchestrator"]["env"] = [
        {"id": "flaky_reverse", "args": {"constant_every": 2, "num_train_examples": 40}, "ratio": 1.0, "name": None}
    ]
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
    assert [u["step"] for u in orch.relay.updates] == sorted(u["step"] for u in orch.relay.updates)
    assert orch.relay.updates and orch.relay.updates[-1]["step"] >= 3
    rows = [json.loads(line) for line in run.metrics("orchestrator").read_text().splitlines()]
    assert max(r["time/wait_for_ckpt"] for r in rows) > 0


def _run_with_weights(root: Path, steps: dict[int, int], *overrides: str) -> RunDir:
    from omegaconf import OmegaConf

    from prime_hpc.model import build_tiny_model

    cfg = compose(
        [
            "+experiment=reverse_text",
            f"output_dir={root}",
            "orchestrator.eval.num_examples=4",
            "orchestrator.eval.rollouts_per_example=1",
            "inference.dtype=float32",
            *overrides,
        ]
    )
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
def test_eval_scores_saved_weights_of_a_run(tmp_path, monkeypatch, capsys):
    """Here the run is someone else's (its directory belongs to another uid) and names its
    eval env by path: refused, nothing started or written, until the user says
    --trust-run-code. Then everything eval writes (the server's config, its endpoint and
    log, the results) goes to a directory of the user's alone, never into their tree (a
    config planted in their eval/configs/ that would stop vLLM from starting is never
    read). The server eval starts demands a key of its own, which eval's calls carry and
    no file holds; what eval writes gets the user's umask."""
    import contextlib
    import os

    import httpx
    import yaml

    from prime_hpc.cli import main
    from prime_hpc.orchestrator import evaluate
    from tests.conftest import REPO

    env_path = REPO / "examples" / "reverse_text" / "reverse_text"
    run = _run_with_weights(tmp_path / "run", {1: 5, 2: 6}, f"orchestrator.eval.env=[{{id: '{env_path}'}}]")
    planted = run.eval_dir / "configs" / "inference.yaml"  # the config eval once wrote there
    planted.parent.mkdir(parents=True)
    data = yaml.safe_load(run.config_yaml.read_text())
    data["inference"]["extra_args"] = ["--no-such-option"]  # vLLM would refuse to start with it
    planted.write_text(yaml.safe_dump(data))
    for p in [run.root, *run.root.rglob("*")]:
        os.chown(p, 65534, 65534)
    theirs = {p: p.read_bytes() for p in run.root.rglob("*") if p.is_file()}
    mine = tmp_path / "mine"
    capsys.readouterr()
    assert main(["eval", str(run.root), "steps=1,2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "orchestrator.eval.env.0.id" in err and "--trust-run-code" in err, err
    real, seen = evaluate.eval_server, {}

    @contextlib.contextmanager
    def probed(*a, **k):
        with real(*a, **k) as (url, key):
            for name, auth in (("none", None), ("wrong", "not-the-key"), ("key", key)):
                headers = {"Authorization": f"Bearer {auth}"} if auth else {}
                seen[name] = httpx.get(url + "/v1/models", headers=headers, timeout=60).status_code
            seen["the key"] = key
            yield url, key

    monkeypatch.setattr(evaluate, "eval_server", probed)
    monkeypatch.delenv("INFERENCE_SERVER_API_KEY", raising=False)  # eval needs none of the user's
    previous = os.umask(0o022)
    try:
        code = main(["eval", str(run.root), "steps=1,2", f"out={mine}", "--trust-run-code"])
    finally:
        os.umask(previous)
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    assert {p: p.read_bytes() for p in run.root.rglob("*") if p.is_file()} == theirs  # nothing of theirs changed
    assert mine.stat().st_mode & 0o777 == 0o700 and (mine / "configs" / "inference.yaml").exists()
    for step in (1, 2):
        row = json.loads((mine / f"step_{step}.json").read_text())
        assert row["step"] == step
        assert 0.0 <= row["eval/reverse_text/avg@1"] <= 1.0 and row["eval/reverse_text/pass@1"] in (
            0.0,
            0.25,
            0.5,
            0.75,
            1.0,
        )
        assert f"    step {step}  eval/reverse_text/avg@1=" in out, out
        samples = [json.loads(line) for line in (mine / f"step_{step}.samples.jsonl").read_text().splitlines()]
        assert len(samples) == 4 and {s["step"] for s in samples} == {step}  # orchestrator.eval.num_examples=4
    assert not (mine / "endpoints" / "inference_0.json").exists()  # its server is gone
    key = seen.pop("the key")
    assert seen == {"none": 401, "wrong": 401, "key": 200} and "INFERENCE_SERVER_API_KEY" not in os.environ
    written = [p for p in mine.rglob("*")]
    assert all(key.encode() not in p.read_bytes() for p in written if p.is_file())
    assert written and all(p.stat().st_mode & 0o007 == 0 for p in written), [oct(p.stat().st_mode) for p in written]


@pytest.mark.vllm
def test_eval_of_any_endpoint_on_any_env_writes_a_result_and_a_table(keyed, tmp_path):
    from tests.conftest import cli

    out = tmp_path / "ev"
    r = cli(
        "eval",
        f"client.base_url={keyed.endpoints.router}",
        "client.model=tiny",
        "env=reverse-text",
        "rollouts=2",
        "examples=3",
        f"out={out}",
        timeout=300,
        env={"ENDPOINT_API_KEY": keyed.key, "INFERENCE_SERVER_API_KEY": ""},  # an endpoint's key is its own
    )  # a distribution name, as users write it
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
def test_opd_takes_teacher_logprobs_and_sft_trains_on_teacher_completions(keyed, tmp_path, monkeypatch):
    """The session's servers double as the teacher (same tiny model): in opd the per-token
    advantages are log p_teacher - log p_student, ~0 here; in sft the teacher generates.
    The teacher's key comes from its own variable (`teacher.client.api_key_var`)."""
    monkeypatch.setenv("TEACHER_API_KEY", keyed.key)
    teacher = keyed.endpoints.servers[1] + "/v1"
    common = [
        "max_steps=1",
        "orchestrator.eval.env=[]",
        f"orchestrator.teacher.client.base_url={teacher}",
        "orchestrator.teacher.client.model=tiny",
    ]
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
    step3 = sum(
        int(mb["loss_mask"].any(-1).sum())
        for r in range(int(cfg["trainer_ranks"]))
        for mb in batch.read_rank(run, 3, r, timeout_s=5).micro_batches
    )
    # the totals continue from the checkpoint (not from 0)
    assert rows[2]["progress/total_samples"] == summary["samples"] == saved["totals"]["samples"] + step3
    assert orch.relay.policy >= 2  # the servers were given the checkpoint's weights
    bad = dict(cfg, ckpt={**cfg["ckpt"], "step": 7})
    with pytest.raises(
        UserError, match=r"ckpt.step=7: no complete checkpoint at step 7 .* complete checkpoints: \[1, 2\]"
    ):
        asyncio.run(Orchestrator(bad).main())
