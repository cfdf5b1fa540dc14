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
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from prime_hpc.core.errors import UserError

PEFT_PREFIX = "base_model.model."


class LoRALinear(nn.Linear):
    """`nn.Linear` with a trainable low-rank update (see the module docstring)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        if base.bias is not None:
            self.bias = base.bias
        else:
            self.register_parameter("bias", None)
        kw = {"device": base.weight.device, "dtype": base.weight.dtype}
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


def apply_lora(model: nn.Module, rank: int, alpha: float, dropout: float, target_modules: Iterable[str]) -> list[str]:
    """Wrap the targeted linear layers of `model` in place and freeze all other parameters.
    Returns the qualified names of the wrapped modules. Seed torch first: the A matrices
    are random and every rank must start from the same ones."""
    targets = set(target_modules)
    found = [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear) and not isinstance(mod, LoRALinear) and name.rsplit(".", 1)[-1] in targets
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
        setattr(parent, attr, LoRALinear(mod, rank, alpha, dropout))
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
