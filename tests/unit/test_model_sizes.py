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
