"""One optimizer step over a list of micro-batches, shared by the RL and SFT trainers.

A micro-batch is a dict of [B, T] tensors: `input_ids`, `loss_mask`, and either
`attention_mask` (right-padded rows, RL) or `position_ids` (packed rows whose positions
restart at every sample, SFT: the model then masks attention across samples), plus
whatever the loss function reads. Every rank must pass the same number of micro-batches
(FSDP runs collectives in every forward and backward).

Normalisation: the step's loss-token count is summed over all ranks first, and each
micro-batch's loss is its token-loss sum divided by that count. FSDP averages gradients
over ranks, so the loss is scaled by the world size to make the gradient exactly
`sum over all tokens / all tokens`.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, cast

import torch

from prime_hpc.core import device as devices
from prime_hpc.trainer.dist import DistEnv, all_reduce_sum
from prime_hpc.trainer.loss import LossOutput, head_logprobs, token_logprobs
from prime_hpc.trainer.model import Policy

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

LossFn = Callable[[torch.Tensor, dict, float], LossOutput]  # (logprobs, micro_batch, normalizer)

# architectures whose forward returns the output layer's result as the logits, unchanged
# (no soft-capping or scaling after it): their log-probabilities come from the hidden
# states in chunks (`loss.head_logprobs`); any other model's from its whole logits
HEAD_AS_LOGITS = frozenset({"qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "llama", "mistral"})


def output_layer(model: Any) -> Optional[torch.nn.Linear]:
    """The model's output layer when its logits are that layer's output as it is (a plain
    `nn.Linear`, not a LoRA one, of an architecture in `HEAD_AS_LOGITS`), else None."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in HEAD_AS_LOGITS or not hasattr(model, "get_output_embeddings"):
        return None
    from prime_hpc.trainer.lora import LoRALinear, SlotLoRALinear

    head = model.get_output_embeddings()
    # FSDP makes its units instances of a subclass (`FSDPLinear`); an adapter's layer is one too
    plain = isinstance(head, torch.nn.Linear) and not isinstance(head, (LoRALinear, SlotLoRALinear))
    return head if plain else None


@contextlib.contextmanager
def logprobs_head(head: torch.nn.Linear, input_ids: torch.Tensor, temperature: float, with_entropy: bool):
    """While inside, `head` (the output layer) answers with each position's log-probability
    of its token and entropy, stacked ([B, T, 2]), instead of the logits: they are computed
    in chunks where the model's forward computes the logits, so that the layer's weight is
    the gathered one (FSDP) and the gradient flows back through the model as before."""

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        lp, ent = head_logprobs(hidden, head.weight, input_ids, temperature, with_entropy, head.bias)
        return torch.stack([lp, torch.zeros_like(lp) if ent is None else ent], -1)

    head.forward = forward  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        del head.forward


class Diverged(Exception):
    """A step whose gradient is not finite (its loss diverged, or its batch held a NaN):
    the optimizer did not apply it, so the weights are still the last step's. Every rank
    raises it together (the norm is the global one)."""


def lr_factor(warmup_steps: int, schedule: str, total_steps: Optional[int], min_ratio: float) -> Callable[[int], float]:
    """LR multiplier for the (i+1)-th optimizer step: linear warm-up to 1 over
    `warmup_steps`, then `constant`, or a `linear` / `cosine` decay reaching `min_ratio` at
    step `total_steps` (needs max_steps; constant without it)."""

    def f(i: int) -> float:
        step = i + 1
        if warmup_steps > 0 and step <= warmup_steps:
            return step / warmup_steps
        if schedule == "constant" or not total_steps or total_steps <= warmup_steps:
            return 1.0
        frac = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
        shape = 1.0 - frac if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * frac))
        return min_ratio + (1.0 - min_ratio) * shape

    return f


@dataclass
class StepResult:
    sums: dict[str, float]  # summed over micro-batches and ranks
    grad_norm: float
    lr: float
    time_forward_backward_s: float


class Engine:
    """Owns the policy, its optimizer and LR schedule on one rank."""

    def __init__(
        self,
        policy: Policy,
        env: DistEnv,
        optim_cfg: Any,
        total_steps: Optional[int] = None,
        params: Optional[list[torch.nn.Parameter]] = None,
    ) -> None:
        """`params`: what this engine trains (default: every trainable parameter of the
        policy; one run's adapter when several share the model)."""
        self.policy, self.env, self.cfg = policy, env, optim_cfg
        self.model = policy.model
        self.params = policy.trainable if params is None else params
        self.optimizer = torch.optim.AdamW(
            self.params, lr=optim_cfg.lr, betas=tuple(optim_cfg.betas), weight_decay=optim_cfg.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_factor(optim_cfg.warmup_steps, optim_cfg.schedule, total_steps, optim_cfg.min_lr_ratio)
        )

    def forward(self, mb: dict, temperature: float = 1.0, with_entropy: bool = True, model: Any = None):
        """Per-token log-probabilities (and entropies) of `mb` under the policy, or under
        `model` (the frozen reference) in the same precision."""
        d = self.env.device
        dtype = self.policy.autocast_dtype
        model = model or self.model
        input_ids = mb["input_ids"].to(d)
        head = output_layer(model) if self.policy.chunked_logprobs else None
        chunked = logprobs_head(head, input_ids, temperature, with_entropy) if head is not None else None
        with torch.autocast(device_type=d.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            with chunked or contextlib.nullcontext():
                out = model(
                    input_ids=input_ids,
                    attention_mask=mb["attention_mask"].to(d).long() if "attention_mask" in mb else None,
                    position_ids=mb["position_ids"].to(d) if "position_ids" in mb else None,
                    use_cache=False,
                )
        if head is None:
            return token_logprobs(out.logits, input_ids, temperature, with_entropy)
        return out.logits[..., 0], out.logits[..., 1] if with_entropy else None

    @torch.no_grad()
    def add_reference_logprobs(self, reference: Any, micro_batches: list[dict], temperature: float = 1.0) -> None:
        """`ref_logprobs` of every micro-batch under the frozen `reference` model (every
        rank calls it: a sharded reference runs collectives)."""
        for mb in micro_batches:
            mb["ref_logprobs"] = self.forward(mb, temperature, with_entropy=False, model=reference)[0].cpu()

    def _accumulate(self, micro_batches: list[dict], loss_fn: LossFn, temperature: float, train: bool) -> dict:
        """Forward (and backward when `train`) every micro-batch; local sums of the stats."""
        local_tokens = sum(float(mb["loss_mask"].sum()) for mb in micro_batches)
        total_tokens = float(all_reduce_sum([local_tokens], self.env)[0])
        normalizer = max(total_tokens, 1.0)
        sums: dict[str, float] = {}
        n = len(micro_batches)
        for i, mb in enumerate(micro_batches):
            mb = {k: v.to(self.env.device) if torch.is_tensor(v) else v for k, v in mb.items()}
            if train and self.policy.sharded:
                sync = self.policy.grad_sync == "every" or i == n - 1
                cast("FSDPModule", self.model).set_requires_gradient_sync(sync)
            lp, ent = self.forward(mb, temperature)
            out = loss_fn(lp, mb, normalizer)
            if train:
                (out.loss * self.env.world_size).backward()
            mask = mb["loss_mask"]
            stats = dict(out.sums)
            stats["entropy"] = (ent * mask).sum()
            stats["num_tokens"] = mb["num_tokens"] if "num_tokens" in mb else mb["attention_mask"].sum()
            stats["num_samples"] = mb["num_samples"] if "num_samples" in mb else mask.any(-1).sum()
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        return sums

    def _reduce(self, sums: dict[str, float]) -> dict[str, float]:
        keys = sorted(sums)
        total = all_reduce_sum([sums[k] for k in keys], self.env)
        return {k: float(v) for k, v in zip(keys, total.tolist())}

    def train_step(
        self, micro_batches: list[dict], loss_fn: LossFn, temperature: float = 1.0, step: int = 0
    ) -> StepResult:
        """Forward/backward every micro-batch, clip, step the optimizer and the schedule.
        Raises `Diverged` (nothing applied) when the gradient norm is not finite."""
        devices.synchronize(self.env.device_kind)
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        sums = self._accumulate(micro_batches, loss_fn, temperature, train=True)
        grad_norm = self.clip_grad_norm()
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise Diverged(
                f"step {step}: the gradient norm is {grad_norm} (loss {sums.get('loss', math.nan):g}): the loss diverged or the batch "
                "held a NaN; the step was not applied (resume from the newest checkpoint with a lower trainer.optim.lr)"
            )
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        devices.synchronize(self.env.device_kind)
        elapsed = time.perf_counter() - t0
        return StepResult(sums=self._reduce(sums), grad_norm=grad_norm, lr=lr, time_forward_backward_s=elapsed)

    @torch.no_grad()
    def evaluate(self, micro_batches: list[dict], loss_fn: LossFn) -> dict[str, float]:
        """Loss sums over `micro_batches` without touching gradients (e.g. validation)."""
        self.model.eval()
        try:
            return self._reduce(self._accumulate(micro_batches, loss_fn, 1.0, train=False))
        finally:
            self.model.train()

    def clip_grad_norm(self) -> float:
        """Clip to `optim.max_norm`; returns the total norm before clipping (over all ranks)."""
        from torch.distributed.tensor import DTensor

        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return 0.0
        total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, error_if_nonfinite=False, foreach=True)
        if isinstance(total, DTensor):
            total = total.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(self.params, self.cfg.max_norm, total, foreach=True)
        return float(total)

    def state_dicts(self) -> tuple[dict, dict]:
        """Sharded model and optimizer state dicts (for DCP)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        return get_state_dict(self.model, self.optimizer)

    def load_state_dicts(self, model_sd: dict, optim_sd: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)


def param_count(policy: Policy) -> int:
    """Parameters of the whole (un-sharded) model (a DTensor reports its global size)."""
    return sum(p.numel() for p in policy.model.parameters())


def mfu(tokens_per_s_per_device: float, params: int, peak: Optional[float]) -> Optional[float]:
    """Training MFU of a rank (`prime_hpc.core.device` holds the FLOPs estimate and the peaks)."""
    return devices.mfu(tokens_per_s_per_device, devices.train_flops_per_token(params), peak)
