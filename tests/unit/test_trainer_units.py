"""Trainer pieces that need no process group: checkpoint rotation and resume rules, weights
retention, LoRA (merge, PEFT/vLLM layout), SFT tokenization, packing and datasets, the
metrics logger and the trainer's config file."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from prime_hpc.core.errors import UserError
from prime_hpc.rundir import RunDir, is_stable, mark_stable
from tests.trainer_support import trainer_yaml


# ----------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize(
    "steps, keep_last, keep_interval, deleted",
    [
        ([1, 2, 3, 4, 5], None, None, []),  # no rotation configured: keep everything
        ([1, 2, 3, 4, 5], 2, None, [1, 2, 3]),
        ([1, 2, 3, 4, 5], 2, 2, [1, 3]),  # newest two (4, 5) plus the multiples of 2 (2, 4)
        ([10, 20, 30, 40, 50], 1, 25, [10, 20, 30, 40]),
        ([5, 10, 15, 20], 1, 10, [5, 15]),
        ([3], 3, None, []),
        ([], 2, 2, []),
    ],
)
def test_rotation_keeps_exactly_the_expected_steps(steps, keep_last, keep_interval, deleted):
    from prime_hpc.rundir.checkpoints import rotation

    assert rotation(steps, keep_last, keep_interval) == deleted


def test_checkpoint_schedule():
    from types import SimpleNamespace as NS

    from prime_hpc.rundir.checkpoints import is_due

    off = NS(enabled=False, interval=None)
    assert not any(is_due(s, s == 5, off) for s in range(1, 6))
    end_only = NS(enabled=True, interval=None)
    assert [s for s in range(1, 6) if is_due(s, s == 5, end_only)] == [5]
    every2 = NS(enabled=False, interval=2)
    assert [s for s in range(1, 6) if is_due(s, s == 5, every2)] == [2, 4, 5]


def _ckpt(run: RunDir, step: int, parts=("trainer", "orchestrator"), stable=True):
    for part in parts:
        run.checkpoint_part(step, part).mkdir(parents=True, exist_ok=True)
        if stable:
            mark_stable(run.checkpoint_part(step, part))


def test_resume_step_resolution(tmp_path):
    from prime_hpc.rundir.checkpoints import resolve_resume_step

    run = RunDir(tmp_path)
    rl, sft = ("trainer", "orchestrator"), ("trainer",)
    assert resolve_resume_step(run, None, rl) is None and resolve_resume_step(run, 0, rl) is None
    with pytest.raises(UserError, match=r"ckpt.step=-1: no complete checkpoint in .*complete checkpoints: none"):
        resolve_resume_step(run, -1, rl)
    _ckpt(run, 2)
    _ckpt(run, 4, parts=("trainer",))  # the orchestrator's part is missing
    _ckpt(run, 6, stable=False)
    assert resolve_resume_step(run, -1, rl) == 2
    assert resolve_resume_step(run, -1, sft) == 4  # SFT has no orchestrator part
    assert resolve_resume_step(run, 4, sft) == 4
    with pytest.raises(UserError) as e:
        resolve_resume_step(run, 4, rl)
    msg = str(e.value)
    assert "\n" not in msg and "ckpt.step=4" in msg and "complete checkpoints: [2]" in msg
    assert "incomplete: [4, 6]" in msg and "orchestrator/STABLE" in msg
    with pytest.raises(UserError, match=r"ckpt.step=7: no complete checkpoint at step 7"):
        resolve_resume_step(run, 7, sft)


def test_rotation_also_removes_what_a_kill_left_halfway(tmp_path):
    """An unmarked part older than the newest complete one (a write or a deletion that was
    killed) goes at the next rotation; another component's part and newer steps stay."""
    from prime_hpc.rundir.checkpoints import rotate

    run = RunDir(tmp_path)
    for s in (1, 3, 4):
        _ckpt(run, s)
    _ckpt(run, 2, stable=False)  # torn: trainer and orchestrator part, no marker
    _ckpt(run, 5, parts=("trainer",), stable=False)  # newer than the newest complete one
    assert rotate(run, "trainer", 2, None) == [1, 2]
    assert run.checkpoint_steps("trainer") == [3, 4, 5]
    assert run.checkpoint_steps("orchestrator") == [1, 2, 3, 4]


def test_a_checkpoint_write_error_names_the_os_error_behind_it():
    from prime_hpc.rundir.checkpoints import CheckpointWriteError

    try:
        try:
            raise OSError(28, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")  # noqa: B904 (torch chains implicitly)
    except RuntimeError as e:
        wrapped = e

    class CheckpointException(BaseException):  # DCP's shape: each rank's (error, traceback)
        failures = {0: (wrapped, None)}

    msg = str(CheckpointWriteError(2, "/ck/step_2/trainer", CheckpointException()))
    assert msg == (
        "the checkpoint of step 2 could not be written to /ck/step_2/trainer: OSError: [Errno 28] No "
        "space left on device; the earlier checkpoints are kept"
    )
    other = str(CheckpointWriteError(2, "/d", ValueError("bad\nmore")))
    assert (
        other
        == "the checkpoint of step 2 could not be written to /d: ValueError: bad; the earlier checkpoints are kept"
    )


def test_teacher_completions_train_with_nll():
    from types import SimpleNamespace as NS

    from prime_hpc.trainer.loss import sft_loss
    from prime_hpc.trainer.rl import make_loss_fn

    lp = torch.log(torch.tensor([[0.5, 0.25, 0.8]]))
    mb = {
        "inference_logprobs": torch.zeros(1, 3),
        "advantages": torch.tensor([[0.0, 1.0, 1.0]]),
        "loss_mask": torch.tensor([[False, True, True]]),
        "policy_steps": torch.tensor([0]),
    }
    cfg = NS(type="dppo", mask_low=0.2, mask_high=0.2, clip_low=0.2, clip_high=0.28, kl_coef=0.0)
    out = make_loss_fn(cfg, 1, "sft")(lp, mb, 2.0)
    assert out.loss.item() == pytest.approx(sft_loss(lp, mb["loss_mask"], 2.0).loss.item())
    assert out.loss.item() == pytest.approx(-(math.log(0.25) + math.log(0.8)) / 2)
    assert "mismatch_kl" in make_loss_fn(cfg, 1, "opd")(lp, mb, 2.0).sums


def test_the_mismatch_kl_of_samples_spanning_an_update_is_summed_apart():
    from types import SimpleNamespace as NS

    from prime_hpc.rundir.batch import Sample, collate
    from prime_hpc.trainer.loss import k3
    from prime_hpc.trainer.rl import make_loss_fn

    samples = [
        Sample([1, 2, 3], [False, True, True], [0.0, -0.5, -1.0], 1.0, policy_step=2, policies=1),
        Sample([1, 2, 3], [False, True, True], [0.0, -0.7, -0.2], -1.0, policy_step=2, policies=2),
    ]
    mb = collate(samples)
    assert mb["policy_spans"].tolist() == [1, 2]
    lp = torch.tensor([[0.0, -0.6, -0.9], [0.0, -0.4, -0.3]])
    cfg = NS(type="dppo", mask_low=0.2, mask_high=0.2, clip_low=0.2, clip_high=0.28, kl_coef=0.0)
    sums = make_loss_fn(cfg, 3, "rl")(lp, mb, 4.0).sums
    want = k3(lp[1, 1:], torch.tensor([-0.7, -0.2])).sum()  # the second sample's two loss tokens
    assert sums["spanning_samples"] == 1 and sums["spanning_tokens"] == 2
    assert sums["spanning_mismatch_kl"].item() == pytest.approx(want.item())
    assert sums["mismatch_kl"].item() > want.item()  # the whole batch's, as before
    old = dict(mb)
    del old["policy_spans"]  # a batch an older run wrote: no sample spans
    assert make_loss_fn(cfg, 3, "rl")(lp, old, 4.0).sums["spanning_samples"] == 0


def test_complete_checkpoint_steps_by_parts(tmp_path):
    run = RunDir(tmp_path)
    _ckpt(run, 1)
    _ckpt(run, 3, parts=("trainer",))
    assert run.complete_checkpoint_steps() == [1]  # default: an RL step needs both parts
    assert run.complete_checkpoint_steps(("trainer",)) == [1, 3]
    assert run.latest_checkpoint_step(("trainer",)) == 3
    assert run.checkpoint_steps("orchestrator") == [1]


def test_weights_retention_keeps_recent_and_checkpointed_steps(tmp_path):
    from prime_hpc.trainer.runner import prune_weights

    run = RunDir(tmp_path)
    for k in range(1, 9):
        run.weights_step(k).mkdir(parents=True)
        mark_stable(run.weights_step(k))
    _ckpt(run, 3, parts=("trainer",))
    # after step 8 with async_level 2: the orchestrator may still load policies >= 5
    assert prune_weights(run, 8, async_level=2) == [1, 2, 4]
    assert run.weight_steps() == [3, 5, 6, 7, 8]


def test_publish_dir_replaces_and_marks_last(tmp_path):
    from prime_hpc.rundir import publish_dir, staging_dir

    final = tmp_path / "weights" / "step_1"
    for content in ("old", "new"):
        tmp = staging_dir(final)
        assert tmp.parent == final.parent and tmp.name.startswith(".tmp.")
        (tmp / "f").write_text(content)
        publish_dir(tmp, final, {"step": 1})
    assert (final / "f").read_text() == "new" and is_stable(final)
    assert [p.name for p in final.parent.iterdir()] == ["step_1"]
    assert (final / "f").stat().st_mode & 0o044  # readable by the team


def test_rng_state_loads_with_weights_only_and_nothing_else_runs(tmp_path):
    """A checkpoint's RNG file holds tensors and plain values only: it round-trips through
    torch.load(weights_only=True); a file that would run code when unpickled is refused
    in one line, and its code never runs."""
    import os
    import random

    from prime_hpc.trainer.ckpt import load_rng, save_rng

    path = tmp_path / "rng_rank_0.pt"
    random.seed(1)
    torch.manual_seed(1)
    save_rng(path, "cpu")
    expected = random.random(), torch.rand(3)
    random.seed(2)
    torch.manual_seed(2)
    load_rng(path, "cpu")
    assert random.random() == expected[0] and torch.equal(torch.rand(3), expected[1])
    ran = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.mkdir, (str(ran),))

    torch.save({"python": Payload(), "torch": torch.get_rng_state()}, path)
    with pytest.raises(UserError, match="not an RNG state") as e:
        load_rng(path, "cpu")
    assert not ran.exists() and "\n" not in str(e.value)


# ----------------------------------------------------------------------------- LoRA
def _tiny():
    from transformers import AutoModelForCausalLM

    from prime_hpc.model import resolve_model

    return AutoModelForCausalLM.from_pretrained(resolve_model("tiny"), dtype=torch.float32)


def test_lora_starts_at_the_base_model_and_merges_exactly():
    from prime_hpc.trainer.lora import LoRALinear, apply_lora, merge_lora

    base, model = _tiny(), _tiny()
    torch.manual_seed(0)
    wrapped = apply_lora(model, rank=4, alpha=8, dropout=0.0, target_modules=["q_proj", "down_proj"])
    assert len(wrapped) == 8 and all(isinstance(model.get_submodule(n), LoRALinear) for n in wrapped)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    assert torch.equal(base(ids).logits, model(ids).logits)  # B = 0 at init
    with torch.no_grad():
        for n in wrapped:
            model.get_submodule(n).lora_B.weight.normal_()
    sd = model.state_dict()
    merged = merge_lora(sd, scaling=8 / 4)
    assert set(merged) == set(base.state_dict())  # plain HF names
    base.load_state_dict(merged)
    assert torch.allclose(base(ids).logits, model(ids).logits, atol=1e-4)


def test_adapter_slots_each_act_alone_and_read_as_a_one_adapter_model():
    """K adapters side by side (several runs on one trainer): a slot starts at the base
    model, the active one alone changes the outputs, and a slot's tensors under a
    one-adapter model's names merge into exactly the model it computes."""
    from prime_hpc.trainer.lora import SlotLoRALinear, activate, apply_lora, merge_lora, reset_slot, slot_state, to_slot

    base, model = _tiny(), _tiny()
    torch.manual_seed(0)
    wrapped = apply_lora(model, 4, 8, 0.0, ["q_proj", "v_proj"], slots=3)
    assert all(isinstance(model.get_submodule(n), SlotLoRALinear) for n in wrapped)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        for n in wrapped:
            model.get_submodule(n).lora_B["1"].weight.normal_()
    activate(model, 0)
    assert torch.equal(base(ids).logits, model(ids).logits)  # slot 0 untouched: the base model
    activate(model, 1)
    one = model(ids).logits
    assert not torch.allclose(base(ids).logits, one)
    sd = slot_state(model.state_dict(), 1)
    assert sd and all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in sd)
    assert all(to_slot(k, 1) in model.state_dict() for k in sd)
    plain = {k: v for k, v in model.state_dict().items() if ".lora_" not in k}
    base.load_state_dict(merge_lora({**plain, **sd}, scaling=8 / 4))
    assert torch.allclose(base(ids).logits, one, atol=1e-4)
    reset_slot(model, 1)  # the next run in that slot starts at the base model again
    assert torch.allclose(_tiny()(ids).logits, model(ids).logits)


def test_lora_names_no_layer_fails_with_the_layer_names():
    from prime_hpc.trainer.lora import apply_lora

    with pytest.raises(UserError, match=r"matches no linear layer.*q_proj"):
        apply_lora(_tiny(), 4, 8, 0.0, ["query_key_value"])


def test_adapter_layout_is_what_vllm_reads(tmp_path):
    """adapter_config.json + adapter_model.safetensors, parsed with vLLM's own LoRA code."""
    from safetensors import safe_open

    from prime_hpc.trainer.lora import adapter_config, apply_lora, write_adapter

    model = _tiny()
    apply_lora(model, 4, 8, 0.0, ["q_proj", "v_proj"])
    write_adapter(tmp_path, model.state_dict(), adapter_config("tiny", 4, 8, 0.0, ["q_proj", "v_proj"]))
    from vllm.config.lora import LoRAConfig
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import parse_fine_tuned_lora_name

    helper = PEFTHelper.from_local_dir(str(tmp_path), max_position_embeddings=2048)
    helper.validate_legal(LoRAConfig(max_lora_rank=8))
    assert helper.r == 4 and helper.vllm_lora_scaling_factor == 2.0
    with safe_open(str(tmp_path / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
        shapes = {k: tuple(f.get_tensor(k).shape) for k in keys}
    modules = {parse_fine_tuned_lora_name(k) for k in keys}
    assert len(keys) == 16 and ("model.layers.0.self_attn.q_proj", True) in modules
    assert shapes["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"] == (4, 128)
    assert shapes["base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"] == (64, 4)


# ----------------------------------------------------------------------------- SFT data
@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from prime_hpc.model import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("tiny"))


def test_role_masks_from_incremental_chat_template(tok):
    from prime_hpc.trainer.sft_data import tokenize_messages

    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "ba"},
    ]
    only_assistant = {"system": False, "user": False, "assistant": True, "tool": False}
    ids, mask = tokenize_messages(tok, msgs, only_assistant)
    text = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\nba<|im_end|>\n"
    assert tok.decode(ids) == text
    # trained: the reply, its end-of-turn token and the newline after it, not the header
    trained = tok.decode([i for i, m in zip(ids, mask) if m])
    assert trained == "ba<|im_end|>\n"
    with_user = {**only_assistant, "user": True}
    _, mask_u = tokenize_messages(tok, msgs, with_user)
    assert tok.decode([i for i, m in zip(ids, mask_u) if m]) == "<|im_start|>user\nab<|im_end|>\nba<|im_end|>\n"
    # prompt/completion layout: nothing before `first_trainable` is trained, whatever the role
    _, mask_p = tokenize_messages(tok, msgs, with_user, first_trainable=2)
    assert tok.decode([i for i, m in zip(ids, mask_p) if m]) == "ba<|im_end|>\n"


def test_dataset_layouts_messages_win_and_strings_are_messages(tok, tmp_path):
    from datasets import Dataset

    from prime_hpc.config.schema import LossMaskConfig
    from prime_hpc.trainer.sft_data import layout, load_dataset, tokenize_dataset

    both = Dataset.from_dict(
        {
            "messages": [[{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]],
            "prompt": ["p"],
            "completion": ["c"],
        }
    )
    assert layout(both, "both") == "messages"
    strings = tmp_path / "pc.jsonl"
    strings.write_text(json.dumps({"prompt": "abc", "completion": "cba"}) + "\n")
    ds = load_dataset(str(strings))
    [(ids, mask)] = tokenize_dataset(ds, str(strings), tok, LossMaskConfig(), seq_len=128)
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "cba<|im_end|>\n"
    both.save_to_disk(str(tmp_path / "saved"))
    assert layout(load_dataset(str(tmp_path / "saved")), "saved") == "messages"
    gen = load_dataset("reverse_text:make_sft_dataset", args={"num_examples": 3, "messages": True})
    assert len(gen) == 3 and layout(gen, "gen") == "messages"


def test_bad_datasets_fail_with_one_line_naming_dataset_and_columns(tok, tmp_path):
    from prime_hpc.trainer.sft_data import layout, load_dataset

    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text(json.dumps({"question": "a", "answer": "b"}) + "\n")
    with pytest.raises(UserError) as e:
        layout(load_dataset(str(wrong)), str(wrong))
    assert str(wrong) in str(e.value) and "columns found: question, answer" in str(e.value)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(UserError) as e:
        layout(load_dataset(str(empty)), str(empty))
    assert "\n" not in str(e.value) and str(empty) in str(e.value)
    for name in (
        "no_such_module_xyz:make",
        "reverse_text:no_such_function",
        str(tmp_path / "data.txt"),
        "org/no-such-dataset-offline",
    ):
        if name.endswith(".txt"):
            (tmp_path / "data.txt").write_text("x")
        with pytest.raises(UserError) as e:
            load_dataset(name)
        assert "\n" not in str(e.value) and name in str(e.value)


def test_packing_keeps_samples_apart_and_never_trains_a_first_token():
    from prime_hpc.trainer.sft_data import collate_rows, pack

    s1 = ([1, 2, 3], [False, True, True])
    s2 = ([4, 5], [False, True])
    s3 = ([6, 7, 8, 9], [False, False, True, True])
    rows = pack([s1, s2, s3], seq_len=6)
    assert [[len(s[0]) for s in r.samples] for r in rows] == [[3, 2], [4]]
    mb = collate_rows(rows, pad_id=0)
    assert mb["input_ids"].tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 0]]
    assert mb["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]]
    assert mb["loss_mask"].tolist() == [[False, True, True, False, True], [False, False, True, True, False]]
    assert int(mb["num_tokens"]) == 9 and int(mb["num_samples"]) == 3


def test_packed_rows_match_separate_samples():
    """Positions restarting per sample make the model mask attention across samples."""
    from prime_hpc.trainer.loss import token_logprobs
    from prime_hpc.trainer.sft_data import Row, collate_rows

    model = _tiny().eval()
    a, b = [5, 6, 7, 8], [9, 10, 11]
    mb = collate_rows([Row([(a, [True] * 4), (b, [True] * 3)])], pad_id=0)
    with torch.no_grad():
        # as the trainer calls it: no KV cache (with one, transformers skips packed-sequence masking)
        out = model(input_ids=mb["input_ids"], position_ids=mb["position_ids"], use_cache=False)
        packed, _ = token_logprobs(out.logits, mb["input_ids"])
        alone_b, _ = token_logprobs(model(torch.tensor([b])).logits, torch.tensor([b]))
        alone_a, _ = token_logprobs(model(torch.tensor([a])).logits, torch.tensor([a]))
    assert torch.allclose(packed[0, :4], alone_a[0], atol=1e-5)
    assert torch.allclose(packed[0, 5:], alone_b[0, 1:], atol=1e-5)


def test_stream_resumes_at_the_same_sample_and_reshuffles_per_epoch():
    from prime_hpc.trainer.sft_data import SFTStream

    samples = [([i] * (1 + i % 3), [False] + [True] * (i % 3)) for i in range(10)]
    a = SFTStream(samples, seq_len=4, seed=1)
    steps = [a.next_rows(2) for _ in range(6)]
    assert sum(used for _, used in steps) > 10  # crossed into the second epoch
    b = SFTStream(samples, seq_len=4, seed=1)
    b.next_rows(2), b.next_rows(2)
    c = SFTStream(samples, seq_len=4, seed=1)
    c.load_state(b.state())
    later = [c.next_rows(2) for _ in range(4)]
    assert [[r.samples for r in rows] for rows, _ in later] == [[r.samples for r in rows] for rows, _ in steps[2:]]
    once = SFTStream(samples, seq_len=4, seed=1, epochs=1)
    used = 0
    while not once.exhausted():
        used += once.next_rows(3)[1]
    assert used == 10 and math.isclose(once.progress_epochs, 1.0)


# ----------------------------------------------------------------------------- metrics, config
def test_metrics_logger_writes_one_json_line_per_step(tmp_path):
    from prime_hpc.runtime.metrics import MetricsLogger, run_id

    run = RunDir(tmp_path)
    with MetricsLogger(run, "trainer") as m:
        m.log(1, {"loss/mean": torch.tensor(0.5), "perf/mfu": float("nan")})
        m.log(2, {"loss/mean": 0.25})
    before = time.time()
    with MetricsLogger(run, "trainer") as m:
        m.log(3, {"loss/mean": 0.125})
    rows = [json.loads(line) for line in run.metrics("trainer").read_text().splitlines()]
    stamps = [r.pop("time") for r in rows]  # wall time of each row, for s/step and ETAs
    assert rows == [
        {"step": 1, "loss/mean": 0.5, "perf/mfu": None},
        {"step": 2, "loss/mean": 0.25},
        {"step": 3, "loss/mean": 0.125},
    ]
    assert stamps[0] <= stamps[1] <= before + 0.001 and before - 0.001 <= stamps[2] <= time.time() + 0.001
    assert run_id(run) == run_id(RunDir(str(tmp_path) + "/")) and len(run_id(run)) == 16


def test_trainer_config_round_trips_from_the_launcher_yaml(tmp_path):
    from prime_hpc.trainer.config import load_config

    path = trainer_yaml(
        tmp_path / "run",
        ["trainer=sft", "trainer.data.name=x", "trainer.model.lora.enabled=true", "ckpt.interval=3", "max_steps=7"],
    )
    cfg = load_config(path)
    assert cfg.trainer.type == "sft" and cfg.trainer.data.name == "x" and cfg.trainer.model.lora.enabled
    assert cfg.ckpt.interval == 3 and cfg.max_steps == 7 and cfg.trainer.data.seq_len == cfg.seq_len
    assert cfg.output_dir == str(tmp_path / "run")
    bad = tmp_path / "bad.yaml"
    bad.write_text(path.read_text().replace("micro_batch_size:", "micro_batch_sizes:"))
    with pytest.raises(UserError, match="micro_batch_sizes"):
        load_config(bad)


def test_orchestrator_logger_forwards_only_the_trainer_rows_w_and_b_lacks(tmp_path):
    """The RL run's one W&B run gets the trainer's rows through the orchestrator's logger:
    complete lines only, and after a resume only the rows past the resume step."""
    from prime_hpc.runtime.metrics import MetricsLogger

    run = RunDir(tmp_path)
    with MetricsLogger(run, "trainer", wandb_writer=False) as t:
        for step in (1, 2, 3):
            t.log(step, {"loss/mean": 0.1 * step})
    cfg = {"enabled": True, "project": "p", "offline": True}
    with MetricsLogger(run, "orchestrator", cfg) as o:
        o.follow("trainer", after_step=2)  # resumed at step 2: rows 1-2 are in W&B already
        assert o.forward() == 1
        with open(run.metrics("trainer"), "a") as f:
            f.write('{"step": 4, "loss/mean": 0.4}\n{"step": 5, "loss')  # a row still being written
        assert o.forward() == 1
        with open(run.metrics("trainer"), "a") as f:
            f.write('/mean": 0.5}\n')
        assert o.forward() == 1 and o.forward() == 0
