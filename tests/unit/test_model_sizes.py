"""The offline builder's size ladder (`prime_hpc.model.tiny.SIZES`): each name makes the
Qwen3 its shape says, counted without building weights (on the meta device)."""

from __future__ import annotations

import pytest

from prime_hpc.model.tiny import SIZES, _params, _vocab, num_parameters, params_hash, qwen3_config


@pytest.mark.parametrize(
    "name, about", [("tiny", 0.8e6), ("tiny-35m", 35e6), ("tiny-150m", 150e6), ("tiny-0.6b", 750e6)]
)
def test_each_size_is_the_model_its_name_says(name, about):
    import torch
    from transformers import Qwen3ForCausalLM

    config = qwen3_config(len(_vocab()), _vocab(), _params(SIZES[name]))
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    n = sum(p.numel() for p in model.parameters())
    assert n == num_parameters(name) and abs(n - about) / about < 0.05, n
    assert not config.tie_word_embeddings  # in-place reloads stay right on CPU vLLM


def test_the_largest_has_the_shape_of_qwen3_0_6b():
    c = qwen3_config(len(_vocab()), _vocab(), _params(SIZES["tiny-0.6b"]))
    shape = (
        c.hidden_size,
        c.num_hidden_layers,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
        c.intermediate_size,
        c.vocab_size,
        c.max_position_embeddings,
    )
    assert shape == (1024, 28, 16, 8, 128, 3072, 151936, 40960)
    assert c.rope_parameters["rope_theta"] == 1e6 and str(c.dtype).endswith("bfloat16")


def test_the_default_tiny_model_keeps_its_cache_key():
    """Adding the ladder did not move the tiny model's cache directory (no rebuild)."""
    assert params_hash(0) == params_hash(0, vocab_size=0) != params_hash(0, **SIZES["tiny-35m"])


def test_a_vocabulary_wider_than_the_tokenizer_samples_only_real_ids(tmp_path):
    """A rung with a real model's vocabulary (tiny-0.6b's 151,936 ids) and the char-level
    tokenizer's ~100: at random init the next token is one the tokenizer has (an unused id
    decodes to nothing, and every answer would be empty), still drawn at random among them,
    and the built model has its own cache key.

    The unused ids' share of the mass depends on the seed's draw (the largest real logit at
    each position). Measured on this shape and prompt over seeds 0-29: a seed's mean share
    0.0004-0.029 (median 0.003, the mean of all 0.0055), at one position up to 0.22; the
    default seed 0 gives 0.0004 (at most 0.005). The bounds: seed 0's as it was first set,
    and every position of seeds 0-4 together (0.004 on average, at most 0.22)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from prime_hpc.model.tiny import build_tiny_model

    small = dict(hidden_size=64, num_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    shares = {}
    for seed in range(5):
        out = build_tiny_model(tmp_path / f"wide{seed}", seed=seed, intermediate_size=128, vocab_size=151936, **small)
        model = AutoModelForCausalLM.from_pretrained(out)
        tokenizer = AutoTokenizer.from_pretrained(out)
        real = len(tokenizer)
        assert model.config.vocab_size == 151936 > real
        ids = tokenizer("reverse this text please", return_tensors="pt").input_ids
        with torch.no_grad():
            probs = model(ids).logits[0].float().softmax(-1)
        shares[seed] = probs[:, real:].sum(-1)  # the unused ids' share of the mass, at each position
        assert len(set(probs[:, :real].argmax(-1).tolist())) > 1  # not one token everywhere
    assert shares[0].mean() < 0.01 and shares[0].max() < 0.2, shares[0]
    every = torch.cat(list(shares.values()))
    assert every.mean() < 0.01 and every.max() < 0.3, shares
    assert params_hash(0, vocab_size=151936) != params_hash(0, vocab_size=0)
    torch.manual_seed(123)  # whatever the caller's RNG: the same files
    again = build_tiny_model(tmp_path / "again", seed=0, intermediate_size=128, vocab_size=151936, **small)
    assert (again / "model.safetensors").read_bytes() == (tmp_path / "wide0" / "model.safetensors").read_bytes()
