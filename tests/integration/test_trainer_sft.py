"""The SFT trainer for real (torchrun, 2 gloo ranks, the tiny model, generated reverse-text
data): it learns, its checkpoints resume bit for bit, rotation keeps exactly the expected
steps, and a bad dataset fails in one line."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

from prime_hpc.rundir import RunDir
from tests.trainer_support import explain, run_trainer, trainer_yaml

SFT = "prime_hpc.trainer.sft"
DATA = [
    "trainer=sft",
    "seq_len=128",
    "trainer.data.name=reverse_text:make_sft_dataset",
    "+trainer.data.args={num_examples: 400}",
    "trainer.data.batch_size=1024",
    "trainer.micro_batch_size=2",
]
SFT_METRICS = {
    "loss/mean",
    "optim/grad_norm",
    "optim/lr",
    "progress/epoch",
    "progress/num_samples",
    "progress/num_tokens",
    "perf/throughput",
    "perf/throughput_per_gpu",
    "time/step",
    "time/save_ckpt",
}


def _rows(run: RunDir) -> list[dict]:
    return [json.loads(line) for line in run.metrics("trainer").read_text().splitlines()]


def test_sft_on_reverse_text_lowers_validation_loss(tmp_path):
    run = RunDir(tmp_path / "run")
    config = trainer_yaml(
        run.root,
        [
            *DATA,
            "max_steps=30",
            "trainer.optim.lr=3e-3",
            "trainer.val.interval=10",
            "trainer.val.data.name=reverse_text:make_sft_dataset",
            "+trainer.val.data.args={num_examples: 32, seed: 1}",
            "wandb.enabled=true",
            "wandb.offline=true",
        ],
    )
    proc = run_trainer(SFT, config, nproc=2)
    assert proc.returncode == 0, explain(proc)
    rows = _rows(run)
    val = {r["step"]: r["val/loss"] for r in rows if "val/loss" in r}
    assert sorted(val) == [0, 10, 20, 30]
    assert val[30] < val[0] - 0.5, val
    train = [r for r in rows if "loss/mean" in r]
    assert [r["step"] for r in train] == list(range(1, 31))
    for r in train:
        assert SFT_METRICS <= r.keys(), SFT_METRICS - r.keys()
    assert train[-1]["progress/num_samples"] > train[0]["progress/num_samples"] > 0
    assert 0 < train[-1]["progress/epoch"] < 1
    # the last step's weights are a plain HF model (what an RL run can start from)
    assert run.weight_steps() == [30]
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(run.weights_step(30))
    # W&B offline: a local run inside the run directory, nothing in the home directory
    offline = list(run.wandb_dir.rglob("offline-run-*"))  # the run's one W&B run, written by the trainer
    assert len(offline) == 1 and any(offline[0].rglob("*.wandb"))


def _dcp(path: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as d:
        dcp_to_torch_save(path, Path(d) / "ckpt.pt")
        return torch.load(Path(d) / "ckpt.pt", weights_only=False)


def _flat(obj, prefix=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _flat(v, f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _flat(v, f"{prefix}[{i}]")
    else:
        yield prefix, obj


def _assert_identical(a: dict, b: dict) -> None:
    fa, fb = dict(_flat(a)), dict(_flat(b))
    assert fa.keys() == fb.keys()
    assert any(k.startswith("/optim/state") for k in fa) and any(k.startswith("/model/") for k in fa)
    for k, v in fa.items():
        if torch.is_tensor(v):
            assert v.dtype == fb[k].dtype and torch.equal(v, fb[k]), k
        else:
            assert v == fb[k], k


def test_checkpoint_resume_is_bit_identical_and_rotation_keeps_expected_steps(tmp_path):
    """Run A: 5 steps, a checkpoint every step (async), keep the newest 2 plus every 2nd.
    Run B: a copy of A's directory cut back to step 2, resumed from there to step 5 (sync
    saves). Model, optimizer, schedule, RNG and data position all have to come back
    exactly for B's step-5 checkpoint and weights to equal A's bit for bit."""
    ckpt = [
        "max_steps=5",
        "ckpt.interval=1",
        "ckpt.keep_last=2",
        "ckpt.keep_interval=2",
        "trainer.optim.weight_decay=0.01",
        "trainer.optim.warmup_steps=3",
    ]
    a = RunDir(tmp_path / "a")
    proc = run_trainer(SFT, trainer_yaml(a.root, [*DATA, *ckpt, "ckpt.save_async=true"]), nproc=2)
    assert proc.returncode == 0, explain(proc)
    assert a.complete_checkpoint_steps(("trainer",)) == [2, 4, 5]
    assert a.checkpoint_steps("trainer") == [2, 4, 5]
    assert a.weight_steps() == [2, 4, 5]  # weights of rotated checkpoints go with them

    b = RunDir(tmp_path / "b")
    shutil.copytree(a.root, b.root)
    b.clear_after(2)
    shutil.rmtree(b.metrics_dir)
    proc = run_trainer(SFT, trainer_yaml(b.root, [*DATA, *ckpt, "ckpt.step=-1"]), nproc=2)
    assert proc.returncode == 0, explain(proc)
    assert [r["step"] for r in _rows(b)] == [3, 4, 5]
    # the first step after the resume says what loading the checkpoint took; the others do not
    assert [("time/load_ckpt" in r) for r in _rows(b)] == [True, False, False] and _rows(b)[0]["time/load_ckpt"] > 0
    assert not any("time/load_ckpt" in r for r in _rows(a))
    assert b.complete_checkpoint_steps(("trainer",)) == [2, 4, 5]

    _assert_identical(_dcp(a.checkpoint_part(5, "trainer")), _dcp(b.checkpoint_part(5, "trainer")))
    for name in ("model.safetensors",):
        assert (a.weights_step(5) / name).read_bytes() == (b.weights_step(5) / name).read_bytes()
    sa = json.loads((a.checkpoint_part(5, "trainer") / "state.json").read_text())
    sb = json.loads((b.checkpoint_part(5, "trainer") / "state.json").read_text())
    assert sa == sb and sa["dataloader"]["position"] > 0 and sa["scheduler"]["last_epoch"] == 5
    la = {r["step"]: r["loss/mean"] for r in _rows(a)}
    assert {r["step"]: r["loss/mean"] for r in _rows(b)} == {s: la[s] for s in (3, 4, 5)}


def test_bad_dataset_fails_in_one_line_naming_dataset_and_columns(tmp_path):
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"question": f"q{i}", "answer": f"a{i}"}) + "\n" for i in range(3)))
    run = RunDir(tmp_path / "run")
    config = trainer_yaml(run.root, ["trainer=sft", "seq_len=128", f"trainer.data.name={data}"])
    proc = run_trainer(SFT, config, nproc=1)
    assert proc.returncode == 2, explain(proc)
    [line] = proc.stderr.strip().splitlines()
    assert str(data) in line and "columns found: question, answer" in line
