"""A small LoRA implementation (no `peft` dependency) that writes PEFT's on-disk layout.

`apply_lora` replaces every `nn.Linear` whose attribute name is in `target_modules` with
a `LoRALinear`, which keeps the replaced layer's parameters under the same names
(`<module>.weight`, `<module>.bias`) and adds `<module>.lora_A.weight` [rank, in] and
`<module>.lora_B.weight` [out, rank]; everything else is frozen. The forward pass is

    y = x W^T + b + (alpha / rank) * B(A(dropout(x)))

with A initialised like a linear layer (Kaiming uniform) and B at zero, so training
starts exactly at the base model.

On disk (what vLLM `/v1/load_lora_adapter` and `peft.PeftModel.from_pretrained` read):
`adapter_config.json` + `adapter_model.safetensors` with keys
`base_model.model.<module>.lora_{A,B}.weight`. `merge_lora` folds the adapter into the
base weights (W + alpha/rank * B @ A) for a plain HF checkpoint.

Several runs on one base model (`trainer.max_concurrent_runs` = K, `prime_hpc.trainer.multirun`):
`apply_lora(..., slots=K)` puts a `SlotLoRALinear` in each targeted place instead, with K
adapters side by side (`<module>.lora_A.<slot>.weight`, `<module>.lora_B.<slot>.weight`,
slots "0" .. "K-1") of which the forward pass uses the active one (`activate`); each run
holds one slot while it trains. `slot_state` and `to_slot` turn a slot's tensors into a
one-adapter model's names and back, so a run's adapter files and checkpoints are those of
a run trained alone.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, cast

import torch
from torch import nn

from prime_hpc.core.errors import UserError

PEFT_PREFIX = "base_model.model."


def _take_base(layer: nn.Linear, base: nn.Linear) -> dict[str, Any]:
    """Make `layer` (not yet initialised) hold `base`'s weight and bias as its own; the
    device and dtype its adapters are made with."""
    nn.Module.__init__(layer)
    layer.in_features, layer.out_features = base.in_features, base.out_features
    layer.weight = base.weight
    if base.bias is not None:
        layer.bias = base.bias
    else:
        layer.register_parameter("bias", None)
    return {"device": base.weight.device, "dtype": base.weight.dtype}


class LoRALinear(nn.Linear):
    """`nn.Linear` with a trainable low-rank update (see the module docstring)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0) -> None:
        kw = _take_base(self, base)
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, **kw)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, **kw)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = nn.functional.linear(x, self.weight, self.bias)
        return base + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha}"


class SlotLoRALinear(nn.Linear):
    """`nn.Linear` with K low-rank updates side by side, one used at a time (`active`)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float, slots: int) -> None:
        kw = _take_base(self, base)
        names = [str(i) for i in range(slots)]
        self.lora_A = nn.ModuleDict({s: nn.Linear(self.in_features, rank, bias=False, **kw) for s in names})
        self.lora_B = nn.ModuleDict({s: nn.Linear(rank, self.out_features, bias=False, **kw) for s in names})
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank
        self.active = names[0]
        for s in names:
            self.reset(s)

    @torch.no_grad()
    def reset(self, slot: str) -> None:
        """The slot's adapter as a new one starts: A random, B zero (the base model)."""
        a, b = cast(nn.Linear, self.lora_A[slot]), cast(nn.Linear, self.lora_B[slot])
        nn.init.kaiming_uniform_(a.weight, a=math.sqrt(5))
        nn.init.zeros_(b.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = nn.functional.linear(x, self.weight, self.bias)
        return base + self.lora_B[self.active](self.lora_A[self.active](self.lora_dropout(x))) * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha}, slots={len(self.lora_A)}"


def activate(model: nn.Module, slot: int) -> None:
    """Make every `SlotLoRALinear` of `model` use adapter `slot`."""
    for mod in model.modules():
        if isinstance(mod, SlotLoRALinear):
            mod.active = str(slot)


def reset_slot(model: nn.Module, slot: int) -> None:
    """Start adapter `slot` anew (A random, B zero) in every layer. Seed torch first: every
    rank must draw the same A."""
    for mod in model.modules():
        if isinstance(mod, SlotLoRALinear):
            mod.reset(str(slot))


def is_slot_key(key: str, slot: int) -> bool:
    return f".lora_A.{slot}." in key or f".lora_B.{slot}." in key


def slot_state(state_dict: Mapping[str, Any], slot: int) -> dict[str, Any]:
    """Adapter `slot`'s entries of a state dict (or of anything keyed by parameter name),
    under a one-adapter model's names (`<m>.lora_A.weight`)."""
    return {to_one_adapter(k, slot): v for k, v in state_dict.items() if is_slot_key(k, slot)}


def to_one_adapter(key: str, slot: int) -> str:
    """A parameter name of slot `slot` as a one-adapter model names it."""
    return key.replace(f".lora_A.{slot}.", ".lora_A.").replace(f".lora_B.{slot}.", ".lora_B.")


def to_slot(key: str, slot: int) -> str:
    """A one-adapter model's parameter name (`<m>.lora_A.weight`) in slot `slot`."""
    return key.replace(".lora_A.", f".lora_A.{slot}.").replace(".lora_B.", f".lora_B.{slot}.")


def apply_lora(
    model: nn.Module,
    rank: int,
    alpha: float,
    dropout: float,
    target_modules: Iterable[str],
    slots: Optional[int] = None,
) -> list[str]:
    """Wrap the targeted linear layers of `model` in place and freeze all other parameters.
    Returns the qualified names of the wrapped modules. Seed torch first: the A matrices
    are random and every rank must start from the same ones. `slots`: K adapters side by
    side (`SlotLoRALinear`) instead of one."""
    targets = set(target_modules)
    found = [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear)
        and not isinstance(mod, (LoRALinear, SlotLoRALinear))
        and name.rsplit(".", 1)[-1] in targets
    ]
    if not found:
        linears = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise UserError(
            f"trainer.model.lora.target_modules={sorted(targets)} matches no linear layer of the model; "
            f"its linear layers are named: {', '.join(linears)}"
        )
    for p in model.parameters():
        p.requires_grad_(False)
    for name, mod in found:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        wrapped = (
            LoRALinear(mod, rank, alpha, dropout) if slots is None else SlotLoRALinear(mod, rank, alpha, dropout, slots)
        )
        setattr(parent, attr, wrapped)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_A." in name or ".lora_B." in name)
    return [name for name, _ in found]


def is_lora_key(key: str) -> bool:
    return ".lora_A." in key or ".lora_B." in key


def merge_lora(state_dict: Mapping[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A plain HF state dict: every `<m>.weight` gets `scaling * B @ A` of its adapter added
    (computed in float32); the adapter tensors are dropped."""
    out = {k: v for k, v in state_dict.items() if not is_lora_key(k)}
    for key, a in state_dict.items():
        if key.endswith(".lora_A.weight"):
            prefix = key[: -len(".lora_A.weight")]
            b = state_dict[prefix + ".lora_B.weight"]
            w = out[prefix + ".weight"]
            out[prefix + ".weight"] = (w.float() + scaling * (b.float() @ a.float())).to(w.dtype)
    return out


def adapter_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors under PEFT's names."""
    return {PEFT_PREFIX + k: v for k, v in state_dict.items() if is_lora_key(k)}


def adapter_config(
    base_model: str, rank: int, alpha: float, dropout: float, target_modules: Iterable[str]
) -> dict[str, Any]:
    """PEFT's `adapter_config.json` for a plain LoRA adapter."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": int(rank),
        "lora_alpha": int(alpha) if float(alpha).is_integer() else float(alpha),
        "lora_dropout": float(dropout),
        "target_modules": sorted(set(target_modules)),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def write_adapter(directory: Path, state_dict: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> None:
    """`adapter_model.safetensors` + `adapter_config.json` into `directory`."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous() for k, v in adapter_state_dict(state_dict).items()}
    save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    (directory / "adapter_config.json").write_text(json.dumps(dict(config), indent=2, sort_keys=True) + "\n")
