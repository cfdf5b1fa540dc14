"""Several runs on one trainer (`trainer.max_concurrent_runs`) for real: torchrun with 2 gloo
ranks, FSDP2, the tiny model with two LoRA adapter slots, and the job's `runs/<name>/`
directories, each fed by a stand-in orchestrator (`tests.trainer_support`: rollouts sampled
from the run's own newest policy, the base model with its adapter)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from prime_hpc.model import resolve_model
from prime_hpc.rundir import STABLE, RunDir, mark_stable
from tests.trainer_support import StandInOrchestrator, explain, run_trainer, trainer_yaml

MULTI = "prime_hpc.trainer.multirun"
TEXTS = ["abc", "hello", "xyzzy", "qwerty"]
LORA = [
    "trainer.model.lora.enabled=true",
    "trainer.model.lora.rank=4",
    "trainer.model.lora.alpha=8",
    "trainer.model.lora.target_modules=[q_proj,v_proj]",
]
COMMON = ["async_level=1", "seq_len=128", "trainer.micro_batch_size=2", *LORA]
# run -> (learning rate, steps, checkpoint interval)
RUNS = {"a": (3e-3, 3, 2), "b": (3e-2, 3, 2), "c": (1e-2, 2, 1)}


def _load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _run_config(job: RunDir, name: str, lr: float, steps: int, every: int, extra: list[str] = ()) -> RunDir:
    run = job.sub_run(name)
    trainer_yaml(run.root, [*COMMON, f"trainer.optim.lr={lr}", f"max_steps={steps}", f"ckpt.interval={every}", *extra])
    return run


def _stand_in(run: RunDir, steps: int, start: int = 1, nan: bool = False) -> StandInOrchestrator:
    orch = StandInOrchestrator(
        run,
        Path(resolve_model("tiny")),
        steps,
        ranks=2,
        micro_batch_size=2,
        texts=TEXTS,
        start=start,
        nan_advantages=nan,
    )
    orch.start()
    return orch


def test_three_runs_share_two_adapter_slots_and_one_resumes_alone(tmp_path):
    """Runs a and b take the two slots, c waits for the first one freed; d asks for another
    LoRA shape and is refused in one line while the others go on. Each run trains with its
    own learning rate into its own directory: adapter weights every step (the merged model
    at its last), its own metrics and checkpoints under a one-adapter model's names. Then a
    alone is resumed from its checkpoint for one more step, and b and c stay ended. Run e's
    first batch makes its loss diverge (NaN advantages): e alone fails, recorded with the
    cause, nothing of its step written, and its slot goes back."""
    job = RunDir(tmp_path / "job")
    config = trainer_yaml(job.root, [*COMMON, "trainer.max_concurrent_runs=2"])
    runs = {name: _run_config(job, name, *spec) for name, spec in RUNS.items()}
    _run_config(job, "d", 1e-3, 2, 1, ["trainer.model.lora.rank=8"])
    diverging = _run_config(job, "e", 1e-3, 3, 1)
    orchs = {name: _stand_in(run, RUNS[name][1]) for name, run in runs.items()}
    orchs["e"] = _stand_in(diverging, 1, nan=True)
    proc = run_trainer(MULTI, config, nproc=2)
    for orch in orchs.values():
        orch.join(timeout=60)
        assert orch.error is None, orch.error
    assert proc.returncode == 0, explain(proc)

    out = proc.stdout
    assert "run d refused: its LoRA shape differs" in out and "trainer.model.lora.rank=8 (the job's: 4)" in out
    assert json.loads(runs["a"].root.joinpath("..", "d", "run.json").read_text())["state"] == "REFUSED"
    # c got the slot the first run to end gave back
    assert "run a: adapter slot 0" in out and "run b: adapter slot 1" in out
    assert "run c: adapter slot" in out and out.index("run c: adapter slot") > out.index("ended at step 3")
    failed = json.loads(diverging.run_json.read_text())
    assert failed["state"] == "FAILED" and failed["step"] == 0, failed
    assert failed["reason"].startswith("trainer: step 1: the gradient norm is nan"), failed
    assert "run e failed: step 1" in out and "the other runs go on" in out
    assert diverging.weight_steps() == [] and diverging.checkpoint_steps("trainer") == []

    adapters = {}
    for name, (lr, steps, _every) in RUNS.items():
        run = runs[name]
        rows = [json.loads(line) for line in run.metrics("trainer").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(1, steps + 1)), (name, rows)
        assert abs(rows[0]["optim/lr"] - lr) / lr < 1e-6 or rows[0]["optim/lr"] < lr  # its own schedule
        assert all(r["loss/mean"] == r["loss/mean"] for r in rows)  # no NaN
        assert json.loads(run.run_json.read_text())["state"] == "ENDED"
        last = run.weights_step(steps)
        meta = json.loads((last / STABLE).read_text())
        assert meta["serve"] == "adapter" and meta["merged"] is True  # the last: the merged model too
        assert (last / "model.safetensors").is_file()
        adapter = _load(run.weights_adapter(steps) / "adapter_model.safetensors")
        assert len(adapter) == 4 * 2 * 2 and all(".lora_A.weight" in k or ".lora_B.weight" in k for k in adapter)
        adapters[name] = adapter
        # its checkpoints: its own adapter and optimizer, named as a run trained alone
        ckpts = run.checkpoint_steps("trainer")
        assert steps in ckpts, (name, ckpts)
        from torch.distributed.checkpoint import FileSystemReader

        keys = set(FileSystemReader(str(run.checkpoint_part(steps, "trainer"))).read_metadata().state_dict_metadata)
        model_keys = {k for k in keys if k.startswith("model.")}
        assert model_keys and all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in model_keys), model_keys
        assert any(k.startswith("optim.state.") for k in keys)
    # between checkpoints and the end a step holds the adapter alone
    mid = runs["a"].weights_step(2)
    assert json.loads((mid / STABLE).read_text())["merged"] is False and not (mid / "model.safetensors").exists()
    # the adapters trained apart: different learning rates, different adapters, none still zero
    key = next(k for k in adapters["a"] if ".lora_B." in k)
    assert all(adapters[n][key].abs().sum() > 0 for n in RUNS)
    assert not torch.equal(adapters["a"][key], adapters["b"][key])
    # the merged model of a is its base plus its own adapter
    base = _load(Path(resolve_model("tiny")) / "model.safetensors")
    merged = _load(runs["a"].weights_step(3) / "model.safetensors")
    w = "model.layers.1.self_attn.q_proj.weight"
    a_ = adapters["a"]["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"]
    b_ = adapters["a"]["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"]
    assert torch.allclose(merged[w], base[w] + 2.0 * b_ @ a_, atol=1e-6)

    # resume a alone for one more step (its orchestrator's part of step 3 marked as the
    # orchestrator would): b and c ended under their configs, d was refused under its own
    mark_stable(runs["a"].checkpoint_part(3, "orchestrator"), {"step": 3})
    _run_config(job, "a", 3e-3, 4, 2, ["ckpt.step=-1"])
    orch = _stand_in(runs["a"], 4, start=4)
    proc = run_trainer(MULTI, config, nproc=2)
    orch.join(timeout=60)
    assert orch.error is None, orch.error
    assert proc.returncode == 0, explain(proc)
    assert "run a: resumed from" in proc.stdout and "run b:" not in proc.stdout and "run c:" not in proc.stdout
    rows = [json.loads(line) for line in runs["a"].metrics("trainer").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and "time/load_ckpt" in rows[-1]
    resumed = _load(runs["a"].weights_adapter(4) / "adapter_model.safetensors")
    assert not torch.equal(resumed[key], adapters["a"][key])  # it trained on from its own adapter
