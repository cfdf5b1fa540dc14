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
  `ref_kl`. With `target_kl` the coefficient changes from step to step (`KLController`);
  the step's value is `rl_loss`'s `ref_kl_coef`, applied outside the compiled arithmetic.

Every sum is divided by `normalizer`, the step's loss-token count over all ranks (the
caller all-reduces it), so micro-batches and ranks weigh each token equally.

`masked_positive` / `masked_negative` count loss tokens masked (dppo) or whose ratio was
clipped (cispo), split by the sign of the advantage; divided by the token count they are
the `masked_advantage_{positive,negative}/mean` metrics.

SFT loss: `-sum(m * lp) / normalizer` (token-level cross-entropy).

Log-probabilities from the output layer (`head_logprobs`) are computed only where they are
used: at the trained positions (`trained_positions`: the loss mask, whose tokens are also
the only ones the KL terms and the entropy metric read), from the hidden state of the
position before each. The logits there are [positions, vocabulary] (151,936 ids for
Qwen3: 0.6 MB per position in float32; log-softmax, the entropy and backward hold about
`HEAD_BYTES_PER_LOGIT` bytes per logit at their peak). They are computed in one pass when
that fits in `ONE_PASS_SHARE` of the device's free memory (`head_chunk_rows`), else
`rows` positions at a time, backward recomputing each chunk's logits from the hidden
states instead of keeping them (`torch.utils.checkpoint`), so no more than one chunk's
[rows, vocabulary] tensors exist at once. The results are those of `token_logprobs` on
the whole logits, position by position.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

from prime_hpc.config.schema import LOSS_TYPES
from prime_hpc.core.errors import UserError

MAX_LOG_RATIO = 20.0  # |lp - ilp| is clamped before exp() so the weight stays finite
LOGITS_CHUNK_BYTES = 64 * 2**20  # one chunk's float32 logits in `head_logprobs` when chunking is forced
HEAD_BYTES_PER_LOGIT = 16  # the head's peak per logit: its output, the float32 log-softmax, entropy or gradients
ONE_PASS_SHARE = 0.5  # the share of the free memory one pass through the head may take
KL_ERROR_CLIP = 0.2  # `KLController`: the relative KL error a step acts on is clipped to +-this


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
    lp, ent = next_token_logprobs(logits[:, :-1], input_ids[:, 1:], temperature, with_entropy)
    return torch.nn.functional.pad(lp, (1, 0)), None if ent is None else torch.nn.functional.pad(ent, (1, 0))


def next_token_logprobs(
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
    """Positions per chunk of `head_logprobs` when chunking is forced: float32 logits of
    `budget_bytes` (`LOGITS_CHUNK_BYTES`)."""
    return max(1, (budget_bytes or LOGITS_CHUNK_BYTES) // (4 * max(1, vocab_size)))


def head_chunk_rows(positions: int, vocab_size: int, mode: str, free_bytes: int | None) -> int | None:
    """How `head_logprobs` takes `positions` trained positions: None = in one pass, else
    the positions per chunk. `mode` (`trainer.model.chunked_logprobs`): `false` one pass,
    `true` chunks of `chunk_rows`, `auto` one pass when its `HEAD_BYTES_PER_LOGIT` bytes
    per logit fit in `ONE_PASS_SHARE` of `free_bytes` (the device's free memory; None:
    unknown, one pass), else chunks as large as that share allows."""
    mode = str(mode).lower()
    if mode == "false" or positions <= 0:
        return None
    if mode == "true":
        return chunk_rows(vocab_size)
    per_row = HEAD_BYTES_PER_LOGIT * max(1, vocab_size)
    if free_bytes is None or positions * per_row <= ONE_PASS_SHARE * free_bytes:
        return None
    return max(1, int(ONE_PASS_SHARE * free_bytes) // per_row)


def trained_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """The flat indices (into [B * T]) of the positions whose log-probability the loss,
    the KL terms and the metrics read: the loss mask's, without each row's position 0
    (nothing predicts it; it gets 0, as in `token_logprobs`). On the mask's device: a CPU
    mask gives them without touching the accelerator."""
    m = loss_mask.clone()
    m[:, 0] = False
    return m.reshape(-1).nonzero().squeeze(1)


def _head_chunk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    return next_token_logprobs(torch.nn.functional.linear(hidden, weight, bias), targets, temperature, with_entropy)


def head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = True,
    bias: torch.Tensor | None = None,
    rows: int | None = None,
    compile: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(linear(hidden, weight, bias) / temperature)[targets] and the entropy of
    each of the [N, H] hidden states (the output layer's [V, H] weight, [N] targets): in one
    pass (`rows` None, or at least N), else `rows` positions at a time, each chunk's logits
    recomputed in backward rather than kept. `compile`: through `torch.compile` (`compiled`:
    the log-softmax, gather and entropy fused)."""
    from torch.utils.checkpoint import checkpoint

    chunk = compiled(_head_chunk) if compile else _head_chunk
    if rows is None or rows >= hidden.shape[0]:
        return chunk(hidden, weight, bias, targets, temperature, with_entropy)
    keep = torch.is_grad_enabled() and any(v is not None and v.requires_grad for v in (hidden, weight, bias))
    lps, ents = [], []
    for s in range(0, hidden.shape[0], rows):
        args = (hidden[s : s + rows], weight, bias, targets[s : s + rows], temperature, with_entropy)
        lp, ent = checkpoint(chunk, *args, use_reentrant=False) if keep else chunk(*args)
        lps.append(lp)
        ents.append(ent)
    return torch.cat(lps), torch.cat(ents) if with_entropy else None  # type: ignore[arg-type]


def at_positions(values: torch.Tensor, positions: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """[N] values of the flat `positions` as a [B, T] tensor of `shape`, 0 elsewhere
    (differentiable in `values`)."""
    out = values.new_zeros(shape[0] * shape[1])
    return out.index_put((positions,), values).view(shape[0], shape[1])


def sample_sums(values: torch.Tensor, sample_index: torch.Tensor | None, num_samples: int) -> torch.Tensor:
    """[B, T] values summed per sample: per row when `sample_index` is None (right-padded
    rows, a sample each), else by `sample_index`, the sample of each token in packed rows
    (`prime_hpc.rundir.batch.pack`: 0 .. num_samples - 1, and num_samples on padding)."""
    if sample_index is None:
        return values.sum(-1)
    flat = values.new_zeros(num_samples + 1).index_add(0, sample_index.reshape(-1), values.reshape(-1))
    return flat[:num_samples]


def to_tokens(per_sample: torch.Tensor, sample_index: torch.Tensor | None) -> torch.Tensor:
    """Each token's value of its sample (the inverse of `sample_sums`): [B, 1] for rows, else
    [B, T] (padding gets 0)."""
    if sample_index is None:
        return per_sample.unsqueeze(-1)
    return torch.cat([per_sample, per_sample.new_zeros(1)])[sample_index]


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
    sample_index: torch.Tensor | None = None,
    num_samples: int = 0,
    compile: bool = False,
    ref_kl_coef: float | None = None,
) -> LossOutput:
    """The RL objective of `cfg.type` (dppo | cispo | gspo); see the module docstring.
    `sample_index` / `num_samples`: the sample of each token in packed rows (`sample_sums`);
    None: each row is one sample. `compile`: its per-token arithmetic through `torch.compile`
    (`compiled`), the same numbers. `ref_kl_coef`: the step's weight of the reference KL
    (`KLController.coef`); None: `cfg.ref_kl_coef`."""
    if cfg.type not in LOSS_TYPES:
        raise ValueError(f"unknown loss type {cfg.type!r}; choose from {', '.join(LOSS_TYPES)}")
    terms = compiled(_rl_terms) if compile else _rl_terms
    total, ref_total, sums = terms(
        logprobs, inference_logprobs, advantages, loss_mask, cfg, ref_logprobs, sample_index, num_samples
    )
    if ref_total is not None:  # a plain float here, so a coefficient that changes never recompiles
        total = total + (cfg.ref_kl_coef if ref_kl_coef is None else ref_kl_coef) * ref_total
        sums["loss"] = total.detach()
    return LossOutput(loss=total / normalizer, sums=sums)


def _rl_terms(
    logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cfg: Any,
    ref_logprobs: torch.Tensor | None,
    sample_index: torch.Tensor | None,
    num_samples: int,
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
    """`rl_loss`'s token-loss sum without the reference KL, the sum of the reference KL
    over the loss tokens (differentiable; None when that term is off) and the metric sums."""
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
        tokens = sample_sums(m, sample_index, num_samples).clamp(min=1)
        seq_log_ratio = sample_sums(log_ratio.detach() * m, sample_index, num_samples) / tokens
        seq_ratio = to_tokens(torch.exp(seq_log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)), sample_index)
        seq_ratio = seq_ratio.expand_as(ratio)
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
    ref_kl = ref_total = None
    if ref_logprobs is not None and cfg.ref_kl_coef:
        ref_kl = torch.where(loss_mask, k3(ref_logprobs, logprobs), torch.zeros_like(logprobs))
        ref_total = (ref_kl * m).sum()
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
    return total, ref_total, sums


@dataclass
class KLController:
    """The weight of the reference KL (`trainer.loss.ref_kl_coef`), step by step. Without
    `target` (`trainer.loss.target_kl` null) it stays as configured. With it, after each
    step whose reference KL per loss token was `kl`, a proportional controller:
    `coef *= 1 + clip(kl / target - 1, -KL_ERROR_CLIP, KL_ERROR_CLIP) / horizon`: the
    weight grows while the policy drifts further from the reference than `target`, and
    shrinks while it stays closer, by at most 20% / `horizon` per step (it never reaches 0)."""

    coef: float
    target: float | None = None
    horizon: int = 10

    @classmethod
    def start(cls, loss_cfg: Any, resumed: dict | None = None, where: str = "the checkpoint") -> KLController:
        """The controller of a run from its `trainer.loss`, continuing with the coefficient a
        resumed checkpoint's state (`state`) holds when adapting; a checkpoint without one
        (written with a fixed coefficient, or before there was a controller) starts from the
        configured value. A held value that is not a positive number is refused in one line
        naming `where`."""
        ctl = cls(float(loss_cfg.ref_kl_coef), loss_cfg.target_kl, int(loss_cfg.kl_horizon))
        held = (resumed or {}).get("ref_kl_coef")
        if ctl.target is None or held is None:
            return ctl
        ok = isinstance(held, (int, float)) and not isinstance(held, bool) and math.isfinite(held) and held > 0
        if not ok:
            raise UserError(
                f"{where}: ref_kl_coef {held!r} is not a positive number; resume from another checkpoint (ckpt.step=N)"
            )
        ctl.coef = float(held)
        return ctl

    def update(self, kl: float | None) -> float:
        """After a step whose reference KL per loss token was `kl` (None, or not finite:
        not measured, e.g. a step of teacher completions): the next step's coefficient."""
        if self.target is None or kl is None or not math.isfinite(kl):
            return self.coef
        error = min(max(kl / self.target - 1.0, -KL_ERROR_CLIP), KL_ERROR_CLIP)
        self.coef *= 1.0 + error / self.horizon
        return self.coef

    def state(self) -> dict[str, float]:
        """What a checkpoint keeps of it (state.json): the coefficient, when it adapts."""
        return {} if self.target is None else {"ref_kl_coef": self.coef}


@functools.cache
def compiled(fn: Any) -> Any:
    """`fn` through `torch.compile` (made once per function; shapes dynamic from the first
    call: micro-batches differ in rows, length and trained positions)."""
    return torch.compile(fn, dynamic=True)


def sft_loss(logprobs: torch.Tensor, loss_mask: torch.Tensor, normalizer: float) -> LossOutput:
    """Token-level negative log-likelihood over the loss tokens."""
    m = loss_mask.to(logprobs.dtype)
    total = -(logprobs * m).sum()
    return LossOutput(loss=total / normalizer, sums={"tokens": m.sum().detach(), "loss": total.detach()})
