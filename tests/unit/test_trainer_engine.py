"""The trainer's step on the tiny model, on one process: only the trained positions go
through the output layer (in one pass or in chunks, the same numbers), RL samples packed
into rows get the log-probabilities they have alone, a step's figures are those of the
right-padded rows and whole logits it replaced, the host waits for the device once per
step whatever the number of micro-batches, and an out-of-memory error is one line."""

from __future__ import annotations

import copy
import re
from types import SimpleNamespace as NS

import pytest
import torch

from prime_hpc.rundir import batch
from prime_hpc.trainer import loss

OPTIM = NS(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, warmup_steps=0, schedule="constant", min_lr_ratio=0.0)
LOSS = dict(mask_low=0.2, mask_high=0.2, clip_low=0.2, clip_high=0.28, kl_coef=0.0, ref_kl_coef=0.0)
SYNCS = {"__float__", "__int__", "__bool__", "__index__", "item", "tolist", "equal"}  # a tensor read on the host


def _tiny():
    from transformers import AutoModelForCausalLM

    from prime_hpc.model import resolve_model

    return AutoModelForCausalLM.from_pretrained(resolve_model("tiny"), dtype=torch.float32)


def _engine(model, chunked: object = "auto", max_norm: float = 1.0):
    from prime_hpc.trainer.engine import Engine
    from prime_hpc.trainer.model import Policy

    policy = Policy(
        model=model,
        tokenizer=None,
        source="",
        hf_config=model.config,
        generation_config=None,
        save_dtype=torch.float32,
        sharded=False,
        chunked_logprobs=str(chunked).lower(),
    )
    env = NS(device=torch.device("cpu"), device_kind="cpu", world_size=1)
    return Engine(policy, env, NS(**vars(OPTIM), max_norm=max_norm))  # type: ignore[arg-type]


ENVS = ("count", "math/easy", "")  # the samples' environments in turn ("": none, as older batches)


def _samples(lengths, seed=0, prompt=3) -> list[batch.Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        ilp = (-torch.rand(n, generator=g) * 3).tolist()
        token_adv = torch.randn(n, generator=g).tolist() if i % 3 == 2 else None  # distillation's per-token
        out.append(
            batch.Sample(
                input_ids=torch.randint(0, 101, (n,), generator=g).tolist(),
                loss_mask=[False] * prompt + [True] * (n - prompt),
                inference_logprobs=ilp,
                advantage=float(torch.randn(1, generator=g)),
                policy_step=i % 3,
                policies=1 + (i % 4 == 1),
                token_advantages=token_adv,
                env=ENVS[i % len(ENVS)],
            )
        )
    return out


class Saved:
    """The rows of every [..., vocabulary] tensor autograd keeps (the output layer's weight aside)."""

    def __init__(self, model) -> None:
        self.vocab, self.weight = model.config.vocab_size, model.lm_head.weight.untyped_storage().data_ptr()
        self.rows: list[int] = []

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.dim() >= 2 and t.shape[-1] == self.vocab and t.untyped_storage().data_ptr() != self.weight:
            self.rows.append(t.numel() // self.vocab)
        return t

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)


# ----------------------------------------------------------------------------- the output layer
def test_only_the_trained_positions_go_through_the_output_layer(monkeypatch):
    """With 5 of 18 positions trained, autograd keeps no [positions, vocabulary] tensor of
    more than those 5 rows (one pass) or of a chunk's (chunked); the log-probabilities,
    entropies and gradients are the whole logits' at those positions (0 elsewhere); `auto`
    takes one pass unless the free memory says otherwise, and the engine says which."""
    from prime_hpc.core import device as devices
    from prime_hpc.trainer.engine import output_layer

    model = _tiny()
    ids = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(2, 9, dtype=torch.bool)
    mask[0, 6:] = True
    mask[1, [2, 5]] = True
    g = torch.randn(2, 9)
    lp_ref, ent_ref = loss.token_logprobs(model(input_ids=ids, use_cache=False).logits, ids)
    lp_ref, ent_ref = (lp_ref * mask).detach(), (ent_ref * mask).detach()
    model.zero_grad()
    (
        model(input_ids=ids, use_cache=False).logits.log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
        * g[:, 1:]
        * mask[:, 1:]
    ).sum().backward()
    grads_ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    monkeypatch.setattr(loss, "LOGITS_CHUNK_BYTES", 4 * 2 * model.config.vocab_size)  # 2 positions per chunk

    cases = [("false", None, 5, 1), ("true", None, 2, 3), ("auto", None, 5, 1), ("auto", 10**12, 5, 1)]
    small = int(2 * loss.HEAD_BYTES_PER_LOGIT * model.config.vocab_size / loss.ONE_PASS_SHARE)  # room for 2 rows
    cases.append(("auto", small, 2, 3))
    for mode, free, most_rows, chunks in cases:
        monkeypatch.setattr(devices, "free_memory_bytes", lambda device, free=free: free)
        engine = _engine(model, mode)
        model.zero_grad()
        with Saved(model) as saved:
            lp, ent = engine.forward({"input_ids": ids, "loss_mask": mask})
        # one pass keeps its 5 rows' log-softmax; chunks keep at most a chunk's (recomputed in backward)
        assert max(saved.rows, default=0) == most_rows if chunks == 1 else max(saved.rows, default=0) <= most_rows
        assert engine.logprob_chunks == chunks, (mode, free)
        assert torch.allclose(lp, lp_ref, atol=1e-5) and torch.allclose(ent, ent_ref, atol=1e-5)
        (lp * g).sum().backward()
        for n, p in model.named_parameters():
            assert torch.allclose(p.grad, grads_ref[n], atol=1e-5), (mode, n)
    assert "forward" not in vars(model.lm_head)  # the layer is itself again

    # a model whose logits are not the output layer's own (soft-capped): its logits there, the same numbers
    other = copy.deepcopy(model)
    other.config.model_type = "gemma2"
    assert output_layer(other) is None
    lp, ent = _engine(other).forward({"input_ids": ids, "loss_mask": mask})
    assert torch.allclose(lp, lp_ref, atol=1e-5) and torch.allclose(ent, ent_ref, atol=1e-5)


def test_chunked_logprobs_takes_auto_true_false_and_an_earlier_boolean():
    from prime_hpc.config.compose import compose

    assert compose([]).trainer.model.chunked_logprobs == "auto"
    for value in ("true", "false", "auto"):
        assert compose([f"trainer.model.chunked_logprobs={value}"]).trainer.model.chunked_logprobs in (
            value,
            value.capitalize(),
        )
    from prime_hpc.config.validate import check_fields
    from prime_hpc.core.errors import ConfigError

    check_fields(compose(["trainer.model.chunked_logprobs=false"]))
    with pytest.raises(ConfigError, match="trainer.model.chunked_logprobs.*auto, true or false"):
        check_fields(compose(["trainer.model.chunked_logprobs=sometimes"]))


# ----------------------------------------------------------------------------- packed rows
def test_packing_fills_rows_up_to_seq_len_and_micro_batches_up_to_the_budget():
    samples = _samples([7, 12, 5, 9, 4, 11, 20])
    samples.append(batch.Sample([1, 2, 3], [False] * 3, [0.0] * 3, 1.0))  # no loss token: left out
    mbs = batch.pack(samples, seq_len=16, micro_batch_tokens=32)
    for mb in mbs:
        rows, width = mb["input_ids"].shape
        assert rows * width <= 32 or rows == 1
        assert width <= 16 or rows == 1  # the 20-token sample has a row of its own
        n = mb["policy_steps"].shape[0]
        assert int(mb["num_samples"]) == n and int(mb["num_tokens"]) == int((mb["sample_index"] < n).sum())
        for r, lo, hi, _ in batch._segments(mb):
            assert mb["position_ids"][r, lo:hi].tolist() == list(range(hi - lo))
            assert not mb["loss_mask"][r, lo]  # nothing of its sample predicts a sample's first token
    back = batch.unpack(mbs)
    assert sorted(len(s) for s in back) == [4, 5, 7, 9, 11, 12, 20]
    by_ids = {tuple(s.input_ids): s for s in samples}
    for s in back:
        orig = by_ids[tuple(s.input_ids)]
        adv = orig.token_advantages or [orig.advantage] * len(orig)
        assert s.token_advantages == pytest.approx(adv) and s.inference_logprobs == pytest.approx(
            orig.inference_logprobs
        )
        assert (s.policy_step, s.policies, s.loss_mask) == (orig.policy_step, orig.policies, orig.loss_mask)
    padded = batch.shard(samples[:-1], 1, 4)[0]
    assert batch.padding_share(mbs) < batch.padding_share(padded)
    assert batch.unpack(padded) and len(batch.unpack(padded)) == 7


def test_a_packed_row_gives_each_sample_the_logprobs_and_gradient_it_has_alone():
    """Positions restarting per sample, with the engine's attention mask: no sample sees
    another (nor the padding), so each gets its log-probabilities alone, and the gradient of
    the packed batch is the sum of the samples' own."""
    model = _tiny()
    engine = _engine(model)
    samples = _samples([7, 12, 5, 9, 4, 11])
    mbs = batch.pack(samples, seq_len=16, micro_batch_tokens=32)
    assert any(int(mb["num_samples"]) > mb["input_ids"].shape[0] for mb in mbs)  # several samples in a row
    model.zero_grad()
    packed_lp = {}
    for mb in mbs:
        lp, _ = engine.forward(mb)
        lp.sum().backward()
        for r, lo, hi, _k in batch._segments(mb):
            packed_lp[tuple(mb["input_ids"][r, lo:hi].tolist())] = lp[r, lo:hi].detach()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    for s in samples:
        alone = batch.pack([s], 16, 32)[0]
        assert alone["input_ids"].shape[0] == 1
        lp, _ = engine.forward(alone)
        lp.sum().backward()
        assert torch.allclose(packed_lp[tuple(s.input_ids)], lp[0].detach(), atol=1e-5)
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, grads[n], atol=1e-5), n


# ----------------------------------------------------------------------------- the step
@pytest.mark.parametrize("kind", ["dppo", "gspo"])
def test_a_step_s_figures_are_those_of_right_padded_rows_and_whole_logits(kind):
    """The step on packed rows (the trained positions alone through the output layer, the
    metrics kept on the device) gives the sums, largest values, gradient norm, zero-gradient
    share and updated weights of the same samples as right-padded micro-batches with the
    whole logits, every figure read per micro-batch (what the trainer did before); the
    step's mismatch KL and entropy, over all its loss tokens and each environment's, are
    those of the tokens' own values."""
    from prime_hpc.trainer.rl import add_env_index, make_loss_fn, scoped_metrics

    samples = _samples([7, 12, 5, 9, 4, 11, 14, 6], seed=3)
    padded = batch.shard(samples, 1, 3)[0]
    envs = batch.step_envs([padded])
    assert envs == ["count", "math/easy"]
    cfg = NS(type=kind, seq_clip_low=0.05, seq_clip_high=0.05, **LOSS)
    loss_fn = make_loss_fn(cfg, step=4, mode="rl", envs=envs)
    model = _tiny()
    ref = copy.deepcopy(model)
    add_env_index(padded, envs)
    normalizer = float(sum(mb["loss_mask"].sum() for mb in padded))
    want: dict[str, float] = {}
    values: dict[str, list[tuple[float, float]]] = {"all": []}  # (KL, entropy) of each loss token
    for mb in padded:
        lp, ent = loss.token_logprobs(
            ref(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"].long()).logits, mb["input_ids"]
        )
        out = loss_fn(lp, {**mb, "entropy": ent}, normalizer)
        out.loss.backward()
        stats = {**out.sums, "entropy": (ent * mb["loss_mask"]).sum(), "num_tokens": mb["attention_mask"].sum()}
        stats["num_samples"] = mb["loss_mask"].any(-1).sum()
        for k, v in stats.items():
            want[k] = max(want.get(k, 0.0), float(v)) if k.endswith("/max") else want.get(k, 0.0) + float(v)
        kl = loss.k3(lp.detach(), mb["inference_logprobs"])
        for r, env in enumerate(mb["envs"]):
            for t in mb["loss_mask"][r].nonzero().flatten().tolist():
                for scope in ("all", env) if env else ("all",):
                    values.setdefault(scope, []).append((float(kl[r, t]), float(ent[r, t])))
    norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0))
    want_grads = [p.grad.clone() for p in ref.parameters()]
    zero = sum(int((p.grad == 0).sum()) for p in ref.parameters())
    elements = sum(p.numel() for p in ref.parameters())

    engine = _engine(model)
    grads: list[torch.Tensor] = []  # the clipped gradient the optimizer applies
    engine.optimizer.register_step_pre_hook(lambda *_: grads.extend(p.grad.clone() for p in model.parameters()))
    packed = batch.pack(batch.unpack(padded), 16, 32)
    add_env_index(packed, envs)
    result = engine.train_step(packed, loss_fn, step=4)
    assert set(want) <= set(result.sums)
    for k, v in want.items():
        assert result.sums[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    assert want["spanning_samples"] > 0 and want["off_policy_steps"] > 0
    assert result.grad_norm == pytest.approx(norm, rel=1e-5)
    for (n, _), got, want_grad in zip(model.named_parameters(), grads, want_grads, strict=True):
        assert torch.allclose(got, want_grad, rtol=1e-4, atol=1e-7), n
    assert result.sums["computed_tokens"] >= result.sums["num_tokens"] == sum(len(s) for s in samples)
    # the embeddings of tokens the batch never holds get no gradient
    assert 0 < zero < elements and result.zero_grad_ratio == pytest.approx(zero / elements)

    got = scoped_metrics(result.sums)
    assert set(values) == {"all", *envs} and all(len(v) > 1 for v in values.values())
    for scope, pairs in values.items():
        kl_values, ent_values = torch.tensor(pairs, dtype=torch.float64).T
        assert got[f"mismatch_kl/{scope}/mean"] == pytest.approx(float(kl_values.mean()), rel=1e-5), scope
        assert got[f"mismatch_kl/{scope}/std"] == pytest.approx(float(kl_values.std(correction=0)), rel=1e-3), scope
        assert got[f"mismatch_kl/{scope}/max"] == pytest.approx(float(kl_values.max()), rel=1e-5), scope
        assert got[f"entropy/{scope}/mean"] == pytest.approx(float(ent_values.mean()), rel=1e-5), scope
    assert got["mismatch_kl/all/mean"] == pytest.approx(result.sums["mismatch_kl"] / result.sums["tokens"])


def test_the_host_waits_for_the_device_once_per_step_whatever_the_micro_batches():
    """No figure of a micro-batch is read on the host while the step runs: a step of one
    micro-batch and one of four read tensors on the host equally often (the batch's counts
    before the first forward, the normaliser, the step's figures with the gradient norm)."""
    from torch.overrides import TorchFunctionMode

    from prime_hpc.trainer.rl import add_env_index, make_loss_fn

    class Reads(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

            self.paused = False

        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name in SYNCS and not self.paused:
                self.names.append(name)
            return func(*args, **(kwargs or {}))

    envs = ["count", "math/easy"]
    loss_fn = make_loss_fn(NS(type="dppo", **LOSS), step=1, mode="rl", envs=envs)
    engine = _engine(_tiny())
    # AdamW reads its step counters, which live on the host (on a GPU too): not the device's
    engine.optimizer.register_step_pre_hook(lambda *_: setattr(reads, "paused", True))
    engine.optimizer.register_step_post_hook(lambda *_: setattr(reads, "paused", False))
    counts = []
    reads = Reads()
    for budget in (200, 16):
        reads.names = []
        mbs = batch.pack(_samples([7, 12, 5, 9, 4, 11]), 16, budget)
        add_env_index(mbs, envs)  # the per-environment figures: on the host, before the step
        with reads:
            engine.train_step(mbs, loss_fn)
        counts.append((len(mbs), sorted(reads.names)))
    (one, few), (many, more) = counts
    assert one == 1 and many >= 3
    # the batch's counts before the first forward; the step's figures with the gradient norm
    assert few == more == ["tolist", "tolist"], counts


# ----------------------------------------------------------------------------- out of memory
def test_out_of_memory_is_one_line_naming_the_shape_the_memory_and_the_knobs(monkeypatch):
    from prime_hpc.core import device as devices
    from prime_hpc.trainer.engine import OutOfMemory
    from prime_hpc.trainer.runner import _out_of_memory

    line = devices.oom_message("cuda", (8, 2048), 12000, None, 16384, "auto", in_use=(78 * 2**30, 80 * 2**30))
    assert "\n" not in line
    for part in (
        "8 x 2048 tokens",
        "12,000 trained positions",
        "78.0 of 80.0 GiB in use",
        "trainer.model.ac.freq=1",
        "now off",
        "trainer.micro_batch_tokens (now 16,384)",
        "trainer.model.chunked_logprobs=true",
    ):
        assert part in line, part
    assert "on every layer already" in devices.oom_message("cuda", (1, 4), 3, 1, None, "true", in_use=(1, 2))

    # the engine turns the device's error in a micro-batch into that line
    monkeypatch.setattr(devices, "oom_message", lambda device, shape, trained, **kw: f"{device} {shape} {trained} {kw}")
    engine = _engine(_tiny())

    def boom(lp, mb, normalizer):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    mbs = batch.pack(_samples([7, 12]), 16, 32)
    shape, trained = tuple(mbs[0]["input_ids"].shape), int(mbs[0]["loss_mask"].sum())
    with pytest.raises(OutOfMemory, match="^" + re.escape(f"cpu {shape} {trained} ") + ".*'chunked': 'auto'"):
        engine.train_step(mbs, boom)
    assert _out_of_memory(torch.OutOfMemoryError("x")) and not _out_of_memory(RuntimeError("x"))


# ----------------------------------------------------------------------------- device settings
def test_the_gpu_recipe_trains_in_bfloat16_with_tf32_and_the_cpu_in_float32(tmp_path):
    """`optimization_dtype=auto` is bfloat16 for `model=qwen3_0_6b cluster=slurm
    cluster.device=cuda` and float32 on CPU; a CUDA trainer's float32 matmuls use TF32, a
    CPU trainer's are left as they are; compiling is on where it measured faster."""
    from prime_hpc.core import device as devices
    from prime_hpc.trainer.config import load_config
    from prime_hpc.trainer.model import CPU_COMPILE, compiles, optimization_dtype
    from tests.trainer_support import trainer_yaml

    gpu = load_config(trainer_yaml(tmp_path / "gpu", ["model=qwen3_0_6b", "cluster=slurm", "cluster.device=cuda"]))
    cpu = load_config(trainer_yaml(tmp_path / "cpu", []))
    assert optimization_dtype(gpu) == torch.bfloat16 and optimization_dtype(cpu) == torch.float32
    assert compiles(gpu) and compiles(cpu) == CPU_COMPILE
    forced = load_config(trainer_yaml(tmp_path / "f", ["trainer.model.optimization_dtype=bfloat16"]))
    assert optimization_dtype(forced) == torch.bfloat16
    before = (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision())
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        devices.train_matmul_precision("cpu")
        assert (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision()) == (False, "highest")
        devices.train_matmul_precision("cuda")
        assert torch.backends.cuda.matmul.allow_tf32 and torch.get_float32_matmul_precision() == "high"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before[0]
        torch.set_float32_matmul_precision(before[1])


def test_compiled_layers_and_loss_give_the_same_step_and_keep_their_code_private(tmp_path, monkeypatch):
    """`trainer.model.compile` on CPU (inductor's C++): the decoder layers, the output
    layer's log-probabilities and the loss compiled give the eager step's figures and
    gradient; the first step's compile time is reported apart, a second step of the same
    shapes compiles nothing; the compiled code goes to the user's private cache
    directory (0700), and the parameters' names (what checkpoints hold) are unchanged."""
    import os
    import stat

    from prime_hpc.core import jobenv
    from prime_hpc.trainer.model import compile_layers, decoder_layers
    from prime_hpc.trainer.rl import make_loss_fn

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(jobenv.CACHE_VAR, raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    eager_model = _tiny()
    model = copy.deepcopy(eager_model)
    names = [n for n, _ in model.named_parameters()]
    compile_layers(decoder_layers(model))
    cache = tmp_path / "xdg" / "prime-hpc" / "compile"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(cache / "inductor")
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert [n for n, _ in model.named_parameters()] == names
    eager, engine = _engine(eager_model), _engine(model)
    engine.policy.compiled = True
    mbs = batch.pack(_samples([7, 12, 5, 9, 4, 11]), 16, 32)
    results = []
    for e, compiled in ((eager, False), (engine, True)):
        grads: list[torch.Tensor] = []
        e.optimizer.register_step_pre_hook(lambda *_, e=e, grads=grads: grads.extend(p.grad.clone() for p in e.params))
        loss_fn = make_loss_fn(NS(type="dppo", **LOSS), step=1, mode="rl", compile=compiled)
        results.append((e.train_step(mbs, loss_fn), grads))
    (want, want_grads), (got, got_grads) = results
    for k, v in want.sums.items():
        assert got.sums[k] == pytest.approx(v, rel=1e-4, abs=1e-5), k
    assert all(torch.allclose(a, b, rtol=1e-3, atol=1e-5) for a, b in zip(got_grads, want_grads))
    assert got.compile_s > 0 and want.compile_s == 0
    again = engine.train_step(mbs, make_loss_fn(NS(type="dppo", **LOSS), step=1, mode="rl", compile=True))
    assert again.compile_s == 0
    assert any((cache / "inductor").rglob("*.py")) or any((cache / "inductor").rglob("*.so"))


def test_a_trainer_config_written_before_packing_and_compiling_still_loads(tmp_path):
    """A run resumed from a config of an earlier version (chunked_logprobs a boolean, no
    compile or micro_batch_tokens keys) reads as it meant: chunks always or never, the
    token budget `micro_batch_size` x `seq_len`."""
    from prime_hpc.trainer.config import load_config
    from prime_hpc.trainer.model import chunk_mode, micro_batch_tokens
    from tests.trainer_support import trainer_yaml

    path = trainer_yaml(tmp_path, ["seq_len=128", "trainer.micro_batch_size=3"])
    lines = path.read_text().splitlines()
    old = [ln for ln in lines if not ln.strip().startswith(("compile:", "micro_batch_tokens:"))]
    for value, mode in (("true", "true"), ("false", "false")):
        text = "\n".join(old).replace("chunked_logprobs: auto", f"chunked_logprobs: {value}")
        path.write_text(text.replace("optimization_dtype: auto", "optimization_dtype: float32") + "\n")
        cfg = load_config(path)
        assert chunk_mode(cfg.trainer.model.chunked_logprobs) == mode
        assert micro_batch_tokens(cfg) == 3 * 128 and cfg.trainer.model.compile == "auto"
