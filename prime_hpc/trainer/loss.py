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

Log-probabilities from the output layer (`head_logprobs`): the logits of every position
are [positions, vocabulary] (151,936 ids for Qwen3: 0.6 MB per position in float32, and
log-softmax, its float copy and the entropy each hold as much again). They are computed
`chunk_rows(vocabulary)` positions at a time, and backward recomputes each chunk's
logits from the hidden states instead of keeping them (`torch.utils.checkpoint`), so no
more than one chunk's [rows, vocabulary] tensors exist at once. The results are those of
`token_logprobs` on the whole logits, position by position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from prime_hpc.config.schema import LOSS_TYPES

MAX_LOG_RATIO = 20.0  # |lp - ilp| is clamped before exp() so the weight stays finite
LOGITS_CHUNK_BYTES = 64 * 2**20  # one chunk's float32 logits in `head_logprobs`


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
    lp, ent = _next_token_logprobs(logits[:, :-1], input_ids[:, 1:], temperature, with_entropy)
    return torch.nn.functional.pad(lp, (1, 0)), None if ent is None else torch.nn.functional.pad(ent, (1, 0))


def _next_token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / temperature)[targets] and the entropy (no gradient) of each row."""
    scaled = logits.float()
    if temperature != 1.0:
        scaled = scaled / temperature
    logp = torch.log_softmax(scaled, dim=-1)
    lp = torch.gather(logp, -1, targets.unsqueeze(-1)).squeeze(-1)
    ent = None
    if with_entropy:
        with torch.no_grad():
            ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def chunk_rows(vocab_size: int, budget_bytes: int | None = None) -> int:
    """Positions per chunk of `head_logprobs`: float32 logits of `budget_bytes`
    (`LOGITS_CHUNK_BYTES`)."""
    return max(1, (budget_bytes or LOGITS_CHUNK_BYTES) // (4 * max(1, vocab_size)))


def _head_chunk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    return _next_token_logprobs(torch.nn.functional.linear(hidden, weight, bias), targets, temperature, with_entropy)


def head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    input_ids: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = True,
    bias: torch.Tensor | None = None,
    rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs` of the logits `linear(hidden, weight, bias)` ([B, T, H] hidden
    states, the output layer's [V, H] weight), `rows` positions at a time (default
    `chunk_rows(V)`), each chunk's logits recomputed in backward rather than kept."""
    from torch.utils.checkpoint import checkpoint

    b, t, h = hidden.shape
    x = hidden[:, :-1].reshape(-1, h)
    y = input_ids[:, 1:].reshape(-1)
    n = rows or chunk_rows(weight.shape[0])
    keep = torch.is_grad_enabled() and any(v is not None and v.requires_grad for v in (hidden, weight, bias))
    lps, ents = [], []
    for s in range(0, x.shape[0], n):
        args = (x[s : s + n], weight, bias, y[s : s + n], temperature, with_entropy)
        lp, ent = checkpoint(_head_chunk, *args, use_reentrant=False) if keep else _head_chunk(*args)
        lps.append(lp)
        ents.append(ent)
    lp = torch.cat(lps) if lps else x.new_zeros(0, dtype=torch.float32)
    out = torch.nn.functional.pad(lp.view(b, t - 1), (1, 0))
    if not with_entropy:
        return out, None
    ent_all = torch.cat(ents) if ents else x.new_zeros(0, dtype=torch.float32)  # type: ignore[arg-type]
    return out, torch.nn.functional.pad(ent_all.view(b, t - 1), (1, 0))


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
