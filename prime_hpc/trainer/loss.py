"""Training objectives as pure functions of per-token tensors (no model, no process group).

All tensors are [B, T] and aligned to `input_ids` (position t is about token t, see
`prime_hpc.rundir.batch`). Per token: trainer log-probability `lp`, inference log-probability
`ilp`, advantage `A`, loss mask `m`; importance ratio `r = exp(lp - ilp)`; probabilities
`p = exp(lp)`, `p_inf = exp(ilp)`.

RL loss (per token, on tokens with m = 1), a policy gradient with a stop-gradient
token weight `w` (so d loss / d lp = -w * A):

    loss_t = -(sg(w_t) * A_t * lp_t) + kl_coef * k3_t

- `dppo`: w = r * keep. A token is masked (keep = 0) when its probability already moved
  past a threshold in the direction the update would push it further:
  A > 0 and p - p_inf > mask_high (already more likely than when sampled), or
  A < 0 and p - p_inf < -mask_low (already less likely). Moves against the advantage
  are never masked: they are what the gradient corrects.
- `cispo`: w = clip(r, 1 - clip_low, 1 + clip_high); every token keeps a gradient
  through lp, only its weight is clipped.
- `gspo`: a sequence-level ratio. Each sample (row) gets s = exp(mean over its loss tokens
  of (lp - ilp)), the geometric mean of its token ratios, and every one of its tokens
  w = s * keep, where keep = 0 when s is already past the clip range in the advantage's
  direction (A > 0 and s > 1 + seq_clip_high, or A < 0 and s < 1 - seq_clip_low), as
  PPO's min() does for a whole sequence. Tokens are normalized like every loss here (by
  the step's token count), not averaged per sequence first.
- `k3_t = exp(lp - ilp) - (lp - ilp) - 1 >= 0`, the k3 estimator of KL(pi_inf || pi_trainer)
  on samples from pi_inf; it is also the `mismatch_kl` metric (always reported, added to
  the loss only with kl_coef > 0, and then with its gradient, pulling lp toward ilp).
- with `ref_kl_coef` > 0 and the frozen initial policy's log-probabilities `ref`:
  `+ ref_kl_coef * (exp(ref - lp) - (ref - lp) - 1)`, the k3 estimator of
  KL(pi_trainer || pi_ref) on the (near on-policy) samples, with its gradient; reported as
  `ref_kl`.

Every sum is divided by `normalizer`, the step's loss-token count over all ranks (the
caller all-reduces it), so micro-batches and ranks weigh each token equally.

`masked_positive` / `masked_negative` count loss tokens masked (dppo) or whose ratio was
clipped (cispo), split by the sign of the advantage; divided by the token count they are
the `masked_advantage_{positive,negative}/mean` metrics.

SFT loss: `-sum(m * lp) / normalizer` (token-level cross-entropy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from prime_hpc.config.schema import LOSS_TYPES

MAX_LOG_RATIO = 20.0  # |lp - ilp| is clamped before exp() so the weight stays finite


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, differentiable: sum of per-token losses / normalizer
    sums: dict[str, torch.Tensor]  # detached sums over loss tokens (for metrics)


def token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0, with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of each token given the ones before it, and the entropy of that
    next-token distribution: `lp[:, t] = log softmax(logits[:, t-1] / temperature)[input_ids[:, t]]`.
    Position 0 has no prediction and gets 0 in both."""
    scaled = logits[:, :-1].float()
    if temperature != 1.0:
        scaled = scaled / temperature
    logp = torch.log_softmax(scaled, dim=-1)
    lp = torch.gather(logp, -1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    lp = torch.nn.functional.pad(lp, (1, 0))
    ent = None
    if with_entropy:
        with torch.no_grad():
            ent = -(logp.exp() * logp).sum(-1)
            ent = torch.nn.functional.pad(ent, (1, 0))
    return lp, ent


def k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """exp(d) - d - 1 with d = logprobs - ref_logprobs: per-token estimate of
    KL(ref || policy) on samples drawn from ref."""
    d = (logprobs - ref_logprobs).double().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return (torch.expm1(d) - d).to(logprobs.dtype)  # float64: no cancellation to 0 for tiny d


def rl_loss(
    logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: Any,
    normalizer: float,
    ref_logprobs: torch.Tensor | None = None,
) -> LossOutput:
    """The RL objective of `cfg.type` (dppo | cispo | gspo); see the module docstring."""
    if cfg.type not in LOSS_TYPES:
        raise ValueError(f"unknown loss type {cfg.type!r}; choose from {', '.join(LOSS_TYPES)}")
    m = loss_mask.to(logprobs.dtype)
    log_ratio = torch.where(loss_mask, logprobs - inference_logprobs, torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio.detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    pos, neg = (advantages > 0) & loss_mask, (advantages < 0) & loss_mask
    if cfg.type == "dppo":
        delta = torch.exp(logprobs.detach()) - torch.exp(inference_logprobs)
        masked_pos = pos & (delta > cfg.mask_high)
        masked_neg = neg & (delta < -cfg.mask_low)
        weight = ratio * (~(masked_pos | masked_neg)).to(ratio.dtype)
    elif cfg.type == "gspo":
        tokens = m.sum(-1, keepdim=True).clamp(min=1)
        seq_log_ratio = (log_ratio.detach() * m).sum(-1, keepdim=True) / tokens
        seq_ratio = torch.exp(seq_log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)).expand_as(ratio)
        masked_pos = pos & (seq_ratio > 1 + cfg.seq_clip_high)
        masked_neg = neg & (seq_ratio < 1 - cfg.seq_clip_low)
        weight = seq_ratio * (~(masked_pos | masked_neg)).to(ratio.dtype)
    else:
        weight = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
        clipped = weight != ratio
        masked_pos, masked_neg = pos & clipped, neg & clipped
    kl = torch.where(loss_mask, k3(logprobs, inference_logprobs), torch.zeros_like(logprobs))
    per_token = -(weight * advantages * logprobs)
    if cfg.kl_coef:
        per_token = per_token + cfg.kl_coef * kl
    ref_kl = None
    if ref_logprobs is not None and cfg.ref_kl_coef:
        ref_kl = torch.where(loss_mask, k3(ref_logprobs, logprobs), torch.zeros_like(logprobs))
        per_token = per_token + cfg.ref_kl_coef * ref_kl
    total = (per_token * m).sum()
    sums = {
        "tokens": m.sum().detach(),
        "loss": total.detach(),
        "mismatch_kl": kl.detach().sum(),
        "masked_positive": masked_pos.sum().to(logprobs.dtype),
        "masked_negative": masked_neg.sum().to(logprobs.dtype),
    }
    if ref_kl is not None:
        sums["ref_kl"] = ref_kl.detach().sum()
    return LossOutput(loss=total / normalizer, sums=sums)


def sft_loss(logprobs: torch.Tensor, loss_mask: torch.Tensor, normalizer: float) -> LossOutput:
    """Token-level negative log-likelihood over the loss tokens."""
    m = loss_mask.to(logprobs.dtype)
    total = -(logprobs * m).sum()
    return LossOutput(loss=total / normalizer, sums={"tokens": m.sum().detach(), "loss": total.detach()})
