"""The RL trainer for real: torchrun with 2 gloo ranks, FSDP2, the tiny model, and rollout
files written by a stand-in orchestrator with `prime_hpc.rundir.batch` (sampled from the policy
the trainer just wrote, so the trainer and "inference" policies agree)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from prime_hpc.model import resolve_model
from prime_hpc.rundir import STABLE, RunDir, atomic_write_json
from tests.trainer_support import StandInOrchestrator, explain, run_trainer, trainer_yaml

RL = "prime_hpc.trainer.rl"
TEXTS = ["abc", "hello", "xyzzy", "qwerty"]
RL_METRICS = {
    "loss/mean",
    "entropy/mean",
    "mismatch_kl/mean",
    "masked_advantage_positive/mean",
    "masked_advantage_negative/mean",
    "optim/grad_norm",
    "optim/lr",
    "perf/throughput",
    "perf/throughput_per_gpu",
    "time/step",
    "time/wait_for_batch",
    "time/save_ckpt",
    "time/rollout_handoff",
    "time/read_batch",
}


def _safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _train(tmp_path: Path, steps: int, overrides: list[str]) -> tuple[RunDir, StandInOrchestrator]:
    run = RunDir(tmp_path / "run")
    config = trainer_yaml(
        run.root,
        [
            f"max_steps={steps}",
            "async_level=1",
            "seq_len=128",
            "trainer.micro_batch_size=2",
            "trainer.optim.lr=3e-3",
            *overrides,
        ],
    )
    orch = StandInOrchestrator(run, Path(resolve_model("tiny")), steps, ranks=2, micro_batch_size=2, texts=TEXTS)
    orch.start()
    proc = run_trainer(RL, config, nproc=2)
    orch.join(timeout=60)
    assert proc.returncode == 0, explain(proc)
    assert orch.error is None, orch.error
    return run, orch


def test_rl_trainer_two_ranks(tmp_path):
    steps = 4
    run, orch = _train(tmp_path, steps, ["ckpt.interval=2"])
    base_dir = Path(resolve_model("tiny"))
    base = _safetensors(base_dir / "model.safetensors")

    # weights: a HF directory per step, STABLE written last; retention after step 4 with
    # async_level=1 drops steps < 4 - 1 - 1 = 2 unless checkpointed (step 2 is)
    assert run.weight_steps() == [2, 3, 4]
    for n in run.weight_steps():
        d = run.weights_step(n)
        files = [p for p in d.rglob("*") if p.is_file()]
        assert max(p.stat().st_mtime_ns for p in files) == (d / STABLE).stat().st_mtime_ns
        assert {
            "model.safetensors",
            "config.json",
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
        } <= {p.name for p in files}
        assert json.loads((d / STABLE).read_text())["step"] == n
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = run.weights_step(steps)
    model, info = AutoModelForCausalLM.from_pretrained(final, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert AutoTokenizer.from_pretrained(final).eos_token == "<|im_end|>"
    trained = _safetensors(final / "model.safetensors")
    assert trained.keys() == base.keys()
    assert all(trained[k].dtype == base[k].dtype for k in base)
    assert any(not torch.equal(trained[k], base[k]) for k in base)
    assert not torch.equal(
        _safetensors(run.weights_step(3) / "model.safetensors")["lm_head.weight"], trained["lm_head.weight"]
    )

    # consumed rollouts are gone; every rank's heartbeat says it finished
    assert orch.written == [1, 2, 3, 4] and run.rollout_steps() == []
    assert not any(run.rollout_step(n).exists() for n in range(1, steps + 1))
    for rank in (0, 1):
        assert json.loads(run.heartbeat("trainer", rank).read_text())["step"] == steps
        assert json.loads(run.heartbeat("trainer", rank).read_text())["done"] is True

    # checkpoints at the interval, trainer part only (the orchestrator writes its own)
    assert run.checkpoint_steps("trainer") == [2, 4]
    assert run.complete_checkpoint_steps(("trainer",)) == [2, 4]

    # metrics: one line per step with the reference names; rollouts came from the policy
    # the trainer had, so the importance ratio is 1 up to float error
    rows = [json.loads(line) for line in run.metrics("trainer").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert RL_METRICS <= r.keys(), RL_METRICS - r.keys()
        assert r["time/read_batch"] > 0
        assert "perf/mfu" not in r  # no known peak FLOPs on CPU
        assert 0.1 < r["perf/peak_memory"] < 64  # the rank's peak resident memory, GiB
        assert 0 <= r["mismatch_kl/mean"] < 1e-6
        assert r["masked_advantage_positive/mean"] == 0 and r["masked_advantage_negative/mean"] == 0
        assert r["optim/grad_norm"] > 0 and r["entropy/mean"] > 0 and r["off_policy_steps/mean"] == 0
    assert rows[1]["time/save_ckpt"] > 0 and rows[0]["time/save_ckpt"] == 0


def test_rl_lora_trains_only_the_adapter(tmp_path):
    run, _ = _train(
        tmp_path,
        2,
        [
            "trainer.model.lora.enabled=true",
            "trainer.model.lora.rank=4",
            "trainer.model.lora.alpha=8",
            "trainer.model.lora.target_modules=[q_proj,v_proj]",
            "trainer.model.ac.freq=2",
            "trainer.model.optimization_dtype=bfloat16",
            "trainer.loss.type=cispo",
            "ckpt.weights.save_adapter_separately=true",
            "trainer.loss.ref_kl_coef=0.5",
        ],
    )
    # the KL to the frozen base: 0 while the adapter is still zero (step 1), then > 0
    rows = [json.loads(line) for line in run.metrics("trainer").read_text().splitlines()]
    assert rows[0]["ref_kl/mean"] < 1e-9 < rows[1]["ref_kl/mean"], rows
    base = _safetensors(Path(resolve_model("tiny")) / "model.safetensors")
    d = run.weights_step(2)
    merged = _safetensors(d / "model.safetensors")
    changed = {k for k in base if not torch.equal(base[k], merged[k])}
    assert changed and all(k.endswith(("q_proj.weight", "v_proj.weight")) for k in changed)
    meta = json.loads((d / STABLE).read_text())  # both written; the servers are to load the adapter
    assert meta["merged"] is True and meta["adapter"] == "adapter" and meta["serve"] == "adapter"
    adapter = run.weights_adapter(2)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 8
    assert cfg["target_modules"] == ["q_proj", "v_proj"]
    lora = _safetensors(adapter / "adapter_model.safetensors")
    assert len(lora) == 4 * 2 * 2  # layers x modules x (A, B)
    # the merged weights are exactly base + alpha/r * B @ A
    key = "model.layers.1.self_attn.q_proj.weight"
    a = lora["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"]
    b = lora["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"]
    assert torch.allclose(merged[key], base[key] + 2.0 * b @ a, atol=1e-6)
    assert b.abs().sum() > 0


def test_rl_stops_at_rollouts_done(tmp_path):
    run = RunDir(tmp_path / "run")
    config = trainer_yaml(run.root, ["max_steps=5", "seq_len=128"])
    atomic_write_json(run.rollouts_done, {"last_step": 0})
    proc = run_trainer(RL, config, nproc=1)
    assert proc.returncode == 0, explain(proc)
    beat = json.loads(run.heartbeat("trainer", 0).read_text())
    assert beat["step"] == 0 and beat["done"] is True and beat["progress_at"] <= beat["time"]
    assert run.weight_steps() == []


def test_rl_rollouts_that_never_come_fail_in_one_line_naming_the_orchestrator_log(tmp_path):
    run = RunDir(tmp_path / "run")
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "orchestrator.log").write_text("Traceback ...\nRuntimeError: env crashed\n")
    config = trainer_yaml(run.root, ["max_steps=2", "seq_len=128", "trainer.rollout_timeout_s=1"])
    proc = run_trainer(RL, config, nproc=1, env={"PRIME_HPC_LOGS": str(logs)})
    assert proc.returncode == 1, explain(proc)
    last = proc.stderr.strip().splitlines()[-1]
    assert "rollouts of step 1" in last and str(logs / "orchestrator.log") in last and "orchestrator" in last


def test_rl_bad_resume_step_names_what_exists(tmp_path):
    run = RunDir(tmp_path / "run")
    for part in ("trainer", "orchestrator"):
        run.checkpoint_part(3, part).mkdir(parents=True)
        (run.checkpoint_part(3, part) / STABLE).write_text("{}")
    config = trainer_yaml(run.root, ["max_steps=9", "seq_len=128", "ckpt.step=5"])
    proc = run_trainer(RL, config, nproc=1)
    assert proc.returncode == 2, explain(proc)
    [line] = proc.stderr.strip().splitlines()
    assert "ckpt.step=5" in line and "complete checkpoints: [3]" in line


def test_rl_unknown_model_fails_in_one_line(tmp_path):
    run = RunDir(tmp_path / "run")
    name = str(tmp_path / "no-such-model")
    config = trainer_yaml(run.root, ["max_steps=1", "seq_len=128", f"model.name={name}"])
    proc = run_trainer(RL, config, nproc=1)
    assert proc.returncode == 2, explain(proc)
    [line] = proc.stderr.strip().splitlines()
    assert name in line and "no such directory" in line


def test_rl_a_diverged_step_fails_in_one_line_and_applies_nothing(tmp_path):
    """A batch no loss can be finite on (NaN advantages, as a diverged run or a NaN reward
    gives): the trainer fails in one line naming the step, instead of training on NaN, and
    writes no weights of that step."""
    run = RunDir(tmp_path / "run")
    config = trainer_yaml(run.root, ["max_steps=2", "seq_len=128", "trainer.micro_batch_size=2"])
    orch = StandInOrchestrator(
        run, Path(resolve_model("tiny")), 1, ranks=1, micro_batch_size=2, texts=TEXTS, nan_advantages=True
    )
    orch.start()
    proc = run_trainer(RL, config, nproc=1)
    orch.join(timeout=60)
    assert orch.error is None, orch.error
    assert proc.returncode == 1, explain(proc)
    last = proc.stderr.strip().splitlines()[-1]
    assert "step 1: the gradient norm is nan" in last and "was not applied" in last, last
    assert "Traceback" not in proc.stderr
    assert run.weight_steps() == []
