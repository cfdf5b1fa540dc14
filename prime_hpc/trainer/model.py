"""The policy model: loading (HF id, local path or the built tiny model), LoRA, activation
checkpointing, FSDP2 sharding, and export of step-tagged HF weights.

Sharding: `fully_shard` on every decoder layer, on the input embeddings and on the output
layer when they are not tied (each is gathered only while it is used: at Qwen3's 151,936
ids each is as large as several decoder layers), then on the root (the final norm, and
tied embeddings), with `MixedPrecisionPolicy(param_dtype=optimization_dtype,
reduce_dtype=reduce_dtype)`. With a single rank there is nothing to shard: the model stays
a plain module (FSDP's bookkeeping would only cost time) and `optimization_dtype` is
applied with autocast instead. Master weights and optimizer state stay float32. The same
code runs on CPU (gloo) and GPU (NCCL); only `prime_hpc.core.device` knows the difference.

Weights layout (`weights/step_<n>/`, `STABLE` last), loadable with
`AutoModelForCausalLM.from_pretrained` and by vLLM:

    model.safetensors, config.json, generation_config.json, tokenizer files
    adapter/adapter_config.json, adapter/adapter_model.safetensors      (LoRA runs)

A LoRA run writes the adapter next to the merged full weights every time. With
`ckpt.weights.save_adapter_separately=true` the servers keep the base model and load the
adapter (`/v1/load_lora_adapter`) instead of the merged weights. The `STABLE` marker says
what is there and what to serve: `{"step": n, "merged": true, "adapter": "adapter" | null,
"serve": "merged" | "adapter"}`.

With `weights.transport=broadcast` most steps get no directory here, only a marker
`sent/step_<n>.json` (`write_marker`): the policy went to the servers over the network
(`prime_hpc.trainer.publish`).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, cast

import torch
from torch import nn

from prime_hpc.config.component import TrainerRunConfig
from prime_hpc.core.errors import UserError
from prime_hpc.rundir import RunDir, atomic_write_json, publish_dir, staging_dir
from prime_hpc.trainer import lora as lora_mod

WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)


@dataclass
class Policy:
    model: nn.Module  # sharded (FSDP2) causal LM
    tokenizer: Any
    source: str  # what from_pretrained loaded (HF id or directory)
    hf_config: Any  # the model's config, as it should be written next to the weights
    generation_config: Any
    save_dtype: torch.dtype  # dtype of the exported weights (the source checkpoint's)
    lora_scaling: Optional[float] = None
    lora_config: Optional[dict] = None
    lora_modules: list[str] = field(default_factory=list)
    sharded: bool = True  # FSDP2 (several ranks); a single rank trains the plain module
    autocast_dtype: Optional[torch.dtype] = None  # unsharded: the forward/backward dtype when not float32
    grad_sync: str = "last"  # sharded: reduce-scatter after the step's last micro-batch, or after `every` one
    chunked_logprobs: str = "auto"  # the output layer in chunks: auto | true | false (`loss.head_chunk_rows`)
    ac_freq: Optional[int] = None  # trainer.model.ac.freq, for the out-of-memory line
    micro_batch_tokens: Optional[int] = None  # the token budget of a micro-batch, for the out-of-memory line
    compiled: bool = False  # trainer.model.compile: decoder layers, output layer's log-probabilities and the loss

    @property
    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def optimization_dtype(cfg: TrainerRunConfig) -> torch.dtype:
    """`trainer.model.optimization_dtype`; `auto`: bfloat16 on CUDA, float32 on CPU (where
    bfloat16 matmuls are no faster without hardware for them)."""
    name = cfg.trainer.model.optimization_dtype
    if name == "auto":
        name = "bfloat16" if cfg.device == "cuda" else "float32"
    return _dtype(name)


def chunk_mode(value: object) -> str:
    """`trainer.model.chunked_logprobs` as auto | true | false (a config of an earlier
    version says true or false as a boolean)."""
    return str(value).lower()


def load_tokenizer(cfg: TrainerRunConfig) -> Any:
    """The run's tokenizer (`trainer.tokenizer.name`); one-line UserError if not found."""
    from transformers import AutoTokenizer

    from prime_hpc.model import resolve_model

    name = cfg.trainer.tokenizer.name
    try:
        return AutoTokenizer.from_pretrained(
            resolve_model(name, seed=cfg.model.seed), trust_remote_code=cfg.model.trust_remote_code
        )
    except (OSError, ValueError) as e:
        raise UserError(f"tokenizer {name!r} not found: {str(e).splitlines()[0]}") from None


def load_hf(cfg: TrainerRunConfig) -> tuple[nn.Module, Any, str, Any]:
    """(model in float32 on CPU, tokenizer, source, source dtype). One-line UserError when
    the model or tokenizer cannot be found."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from prime_hpc.model import resolve_model

    hf_logging.disable_progress_bar()  # one progress bar per rank only garbles the logs
    name = cfg.trainer.model.name
    source = resolve_model(name, seed=cfg.model.seed)
    trust = cfg.model.trust_remote_code
    try:
        hf_config = AutoConfig.from_pretrained(source, trust_remote_code=trust)
    except (OSError, ValueError) as e:
        raise UserError(
            f"model {name!r} not found: {str(e).splitlines()[0]} (model.name takes a HF id, a local "
            f"directory with config.json, or 'tiny'; no download happens when HF_HUB_OFFLINE=1)"
        ) from None
    src_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.float32
    if isinstance(src_dtype, str):
        src_dtype = getattr(torch, src_dtype)
    tokenizer = load_tokenizer(cfg)
    model = AutoModelForCausalLM.from_pretrained(
        source, dtype=torch.float32, trust_remote_code=trust, attn_implementation="sdpa"
    )
    model.config.use_cache = False
    return model, tokenizer, source, src_dtype


def micro_batch_tokens(cfg: TrainerRunConfig) -> int:
    """Tokens one forward pass computes at most (rows x longest row): `trainer.micro_batch_tokens`,
    or `micro_batch_size` rows of `seq_len` (SFT: `trainer.data.seq_len`)."""
    t = cfg.trainer
    if t.micro_batch_tokens:
        return int(t.micro_batch_tokens)
    seq = t.data.seq_len if t.type == "sft" else cfg.seq_len
    return int(t.micro_batch_size) * int(seq)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks (`model.model.layers` for Llama/Qwen-style models)."""
    for path in ("model.layers", "model.decoder.layers", "transformer.h", "gpt_neox.layers"):
        try:
            mod = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(mod, nn.ModuleList):
            return mod
    raise UserError(f"{type(model).__name__}: cannot find its decoder layers (tried model.layers and similar)")


def apply_activation_checkpointing(layers: nn.ModuleList, freq: Optional[int]) -> list[int]:
    """Wrap every `freq`-th layer (1-based: layers freq, 2*freq, ...) so its activations are
    recomputed in the backward pass. Returns the wrapped layer indices."""
    if not freq:  # its range (>= 1) is the field's own rule, checked at submit
        return []
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    wrapped = []
    for i in range(len(layers)):
        if (i + 1) % freq == 0:
            layers[i] = checkpoint_wrapper(layers[i], preserve_rng_state=True)
            wrapped.append(i)
    return wrapped


def compiles(cfg: TrainerRunConfig) -> bool:
    """`trainer.model.compile`: true, false, or auto = where the benchmark measured it faster
    (`CPU_COMPILE`; on CUDA always)."""
    mode = str(cfg.trainer.model.compile).lower()
    return mode == "true" or (mode == "auto" and (cfg.device == "cuda" or CPU_COMPILE))


# on CPU (docs/trainer.md#speed) compiled steps measured 3-4% faster at tiny-35m and tiny-150m
# after 1-3 minutes of compiling at every start: a loss for runs of less than several hundred steps
CPU_COMPILE = False


def compile_cache() -> Path:
    """Where inductor keeps the compiled code this process loads: the user's private
    directory of the run's shared cache (`usercache.compile_dir`: `<cache>/compile-<uid>`,
    refused in one line if it is not the user's alone), else of the user's own cache
    (`~/.cache/prime-hpc/compile`), never a directory of /tmp that others can write into.
    Set for this process as `TORCHINDUCTOR_CACHE_DIR` (Triton's goes inside)."""
    import os

    from prime_hpc.core import jobenv, usercache

    shared = jobenv.cache_dir()
    base = usercache.compile_dir(shared) if shared else usercache.directory("compile")
    if base is None:
        raise UserError(
            f"trainer.model.compile: cannot make a private compile cache at {usercache.path('compile')}; "
            "set cluster.cache_dir to a directory of your own, or trainer.model.compile=false"
        )
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(base / "inductor")
    return base / "inductor"


def compile_layers(layers: nn.ModuleList) -> None:
    """`torch.compile` each decoder layer's forward (under its activation checkpointing, if
    any; the parameters' names and so the checkpoints stay as they are). Shapes are dynamic
    from the first call (packed micro-batches differ in rows and length): the first steps
    compile (a graph shared by every layer; one more for a micro-batch of one row), later
    ones reuse."""
    compile_cache()
    for layer in layers:
        inner = getattr(layer, "_checkpoint_wrapped_module", layer)
        inner.forward = torch.compile(inner.forward, dynamic=True)


def vocabulary_units(model: nn.Module) -> list[nn.Module]:
    """The input embeddings and the output layer, when the model has both and they do not
    share their weight: FSDP units of their own (a tied pair stays in the root's unit)."""
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    inp, out = (get_in() if get_in else None), (get_out() if get_out else None)
    if not isinstance(inp, nn.Module) or not isinstance(out, nn.Module):
        return []
    w_in, w_out = getattr(inp, "weight", None), getattr(out, "weight", None)
    if w_in is None or w_out is None or w_in is w_out:
        return []
    return [inp, out]


def shard(model: nn.Module, layers: nn.ModuleList, mesh: Any, mp: Any) -> None:
    """FSDP2 units: every decoder layer, the untied vocabulary layers, then the root."""
    from torch.distributed.fsdp import fully_shard

    for unit in [*layers, *vocabulary_units(model)]:
        fully_shard(unit, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


def build_policy(cfg: TrainerRunConfig, mesh: Any) -> Policy:
    """Load, (optionally) add LoRA, checkpoint activations, shard. Every rank must call it
    with the same seed: un-sharded initial values must agree across ranks."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from prime_hpc.core import device as devices

    devices.train_matmul_precision(cfg.device)
    model, tokenizer, source, src_dtype = load_hf(cfg)
    mcfg = cfg.trainer.model
    pol = Policy(
        model=model,
        tokenizer=tokenizer,
        source=source,
        hf_config=model.config,
        generation_config=getattr(model, "generation_config", None),
        save_dtype=src_dtype,
        grad_sync=mcfg.grad_sync,
        chunked_logprobs=chunk_mode(mcfg.chunked_logprobs),
        ac_freq=mcfg.ac.freq,
        micro_batch_tokens=micro_batch_tokens(cfg),
    )
    if mcfg.lora.enabled:
        lc = mcfg.lora
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            # several runs (trainer.max_concurrent_runs): one adapter slot each (prime_hpc.trainer.multirun)
            slots = cfg.trainer.max_concurrent_runs if cfg.trainer.max_concurrent_runs > 1 else None
            pol.lora_modules = lora_mod.apply_lora(model, lc.rank, lc.alpha, lc.dropout, lc.target_modules, slots)
        pol.lora_scaling = lc.alpha / lc.rank
        hit = sorted({m.rsplit(".", 1)[-1] for m in pol.lora_modules})
        pol.lora_config = lora_mod.adapter_config(
            cfg.trainer.model.name if cfg.trainer.model.name != "tiny" else source, lc.rank, lc.alpha, lc.dropout, hit
        )
    layers = decoder_layers(model)
    apply_activation_checkpointing(layers, mcfg.ac.freq)
    if compiles(cfg):
        compile_layers(layers)
        pol.compiled = True
    model.to(mesh.device_type)
    if mesh.size() == 1:
        pol.sharded = False
        dtype = optimization_dtype(cfg)
        pol.autocast_dtype = None if dtype == torch.float32 else dtype
    else:
        mp = MixedPrecisionPolicy(param_dtype=optimization_dtype(cfg), reduce_dtype=_dtype(mcfg.reduce_dtype))
        shard(model, layers, mesh, mp)
    model.train()
    return pol


def build_reference(cfg: TrainerRunConfig, mesh: Any) -> nn.Module:
    """The frozen initial policy for `trainer.loss.ref_kl_coef`: the run's base weights
    (`model.name`, also on a resume; without LoRA), no gradients, in eval mode, sharded
    across ranks like the policy."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = load_hf(cfg)[0]
    model.requires_grad_(False)
    model.to(mesh.device_type)
    if mesh.size() > 1:
        shard(
            model,
            decoder_layers(model),
            mesh,
            MixedPrecisionPolicy(param_dtype=optimization_dtype(cfg)),
        )
    model.eval()
    return model


def clean_key(key: str) -> str:
    for p in WRAPPER_PREFIXES:
        key = key.replace(p, "")
    return key


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The un-sharded state dict on CPU, on rank 0 (empty elsewhere). A collective: every
    rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {clean_key(k): cast(torch.Tensor, v) for k, v in sd.items()}


def served_tensors(pol: Policy, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors the servers load, by HF name, in the trainer's dtype: LoRA merged, a
    tied `lm_head` left out."""
    if pol.lora_scaling is not None:
        sd = lora_mod.merge_lora(sd, pol.lora_scaling)
    if getattr(pol.hf_config, "tie_word_embeddings", False):
        sd = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    return sd


def hf_weights(pol: Policy, sd: dict[str, torch.Tensor], own: bool = False) -> dict[str, torch.Tensor]:
    """`served_tensors` in the exported dtype. `own`: none of them shares memory with the
    model (a single rank's state dict is its live parameters, which the next optimizer
    step changes; a sharded model's is gathered into new tensors)."""
    out = {k: v.detach().to(pol.save_dtype).contiguous() for k, v in served_tensors(pol, sd).items()}
    if own and not pol.sharded:
        live = {t.untyped_storage().data_ptr() for t in (*pol.model.parameters(), *pol.model.buffers())}
        out = {k: v.clone() if v.untyped_storage().data_ptr() in live else v for k, v in out.items()}
    return out


def _write_tokenizer(pol: Policy, out: Path) -> None:
    """The tokenizer files as the source has them (verbatim when it is a local dir)."""
    src = Path(pol.source)
    copied = False
    if src.is_dir():
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, out / name)
                copied = True
    if not copied:
        pol.tokenizer.save_pretrained(out)


def write_weights(
    run: RunDir,
    step: int,
    pol: Policy,
    sd: dict[str, torch.Tensor],
    serve_adapter: bool = False,
    info: Optional[dict] = None,
    hf: Optional[dict[str, torch.Tensor]] = None,
    merged: bool = True,
) -> Path:
    """Rank 0: write `weights/step_<step>/` from a full state dict (see the module
    docstring for the layout) in a staging dir, move it into place, `STABLE` last. A LoRA
    run writes the adapter next to the merged weights; `serve_adapter` records that the
    servers should load the adapter rather than the merged weights. `hf`: `hf_weights(pol,
    sd)` when the caller made them already. `merged=False` (a run of several on one trainer,
    between its last steps): the adapter alone, which the servers load."""
    from prime_hpc.trainer import safetensors_writer

    final = run.weights_step(step)
    tmp = staging_dir(final)
    try:
        if pol.lora_config is not None:
            lora_mod.write_adapter(tmp / run.weights_adapter(step).relative_to(final), sd, pol.lora_config)
        if merged:  # the merged (or full) weights; the serving path chooses which to load
            # cast as it is written: no second copy of the model in memory
            tensors = hf if hf is not None else served_tensors(pol, sd)
            safetensors_writer.write(
                tmp / "model.safetensors", tensors, dtype=pol.save_dtype, metadata={"format": "pt"}
            )
        cfg = pol.hf_config
        old_dtype, old_cache = getattr(cfg, "dtype", None), getattr(cfg, "use_cache", None)
        cfg.dtype, cfg.use_cache = pol.save_dtype, True
        try:
            cfg.save_pretrained(tmp)
        finally:
            cfg.dtype, cfg.use_cache = old_dtype, old_cache
        if pol.generation_config is not None:
            pol.generation_config.save_pretrained(tmp)
        _write_tokenizer(pol, tmp)
        lora = pol.lora_config is not None
        meta = {
            "step": step,
            "merged": merged,
            "adapter": "adapter" if lora else None,
            "serve": "adapter" if lora and serve_adapter else "merged",
            **(info or {}),
        }
        (tmp / "prime_hpc_weights.json").write_text(json.dumps(meta, indent=2) + "\n")
        return publish_dir(tmp, final, meta)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_marker(run: RunDir, step: int) -> Path:
    """Rank 0, `weights.transport=broadcast`: `sent/step_<step>.json` (`{"step", "sent_at"}`):
    the policy of `step` is on its way to the servers over the network, and nothing of it
    is on disk (the orchestrator's relay follows these as it follows `weights/`)."""
    path = run.sent_step(step)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {"step": int(step), "sent_at": time.time()})
    return path
