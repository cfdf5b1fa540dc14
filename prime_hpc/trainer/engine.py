"""One optimizer step over a list of micro-batches, shared by the RL and SFT trainers.

A micro-batch is a dict of [B, T] tensors: `input_ids`, `loss_mask`, and either
`position_ids` (packed rows whose positions restart at every sample: `rundir.batch.pack`
for RL, `sft_data.collate_rows` for SFT) or `attention_mask` (right-padded rows), plus
whatever the loss function reads. Every rank must pass the same number of micro-batches
(FSDP runs collectives in every forward and backward).

Packed rows: attention never crosses samples. The engine gives the model the [B, 1, T, T]
mask of "same sample and not in the future" (made on the device from `position_ids`),
or no mask at all when every row is one sample from position 0 (causal attention as it
is); the model's own packed-sequence detection reads the positions back on the host.

Only the trained positions go through the output layer (`loss.trained_positions`: the
loss mask's; the KL terms and the entropy metric read no others): where the model's
logits are its output layer's output (`output_layer`), that layer answers with their
log-probabilities and entropies (`logprobs_head`), in one pass or in chunks as
`trainer.model.chunked_logprobs` and the device's free memory decide
(`loss.head_chunk_rows`); other models' logits are taken at those positions. The
log-probabilities come back as [B, T] tensors, 0 elsewhere.

Normalisation: the step's loss-token count is summed over all ranks first, and each
micro-batch's loss is its token-loss sum divided by that count. FSDP averages gradients
over ranks, so the loss is scaled by the world size to make the gradient exactly
`sum over all tokens / all tokens`.

The loss function reads the micro-batch with `entropy` beside its inputs: [B, T], the
entropy of the trained positions (0 elsewhere), without gradient. The figures it returns
are summed over micro-batches and ranks, except those whose name ends in `/max`
(`MAX_SUFFIX`), of which the largest is kept (figures >= 0: a rank without tokens gives 0).

The step also counts the trained parameters' elements whose gradient is exactly 0 (a
parameter without a gradient counts whole): `StepResult.zero_grad_ratio`, the share of
them over all ranks (their local shards when sharded).

Synchronisation: the step's inputs go to the device before its first forward; the
metrics stay tensors on the device until the step's end, where one all-reduce of the sums
(and one of the maxima, when there are some) and one copy to the host give them all with
the gradient norm (whose finiteness decides whether the optimizer steps), so the host
waits for the device once per step for them (and once more at the end for the step's time).
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
from prime_hpc.trainer.distributions import Collector
from prime_hpc.trainer.loss import (
    LossOutput,
    at_positions,
    head_chunk_rows,
    head_logprobs,
    next_token_logprobs,
    trained_positions,
)
from prime_hpc.trainer.model import Policy

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

LossFn = Callable[[torch.Tensor, dict, float], LossOutput]  # (logprobs, micro_batch, normalizer)

# architectures whose forward returns the output layer's result as the logits, unchanged
# (no soft-capping or scaling after it): their log-probabilities come from the hidden
# states of the trained positions (`loss.head_logprobs`); any other model's from its logits
HEAD_AS_LOGITS = frozenset({"qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "llama", "mistral"})
HOST_STATS = ("num_tokens", "num_samples", "computed_tokens")  # counted from the batch on the host
MAX_SUFFIX = "/max"  # a figure of a micro-batch whose largest value the step keeps (not the sum)
ZERO_GRADS = ("zero_grad_elements", "grad_elements")  # the step's figures of `zero_grad_ratio`


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
def logprobs_head(
    head: torch.nn.Linear,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    rows: Optional[int] = None,
    compile: bool = False,
):
    """While inside, `head` (the output layer) answers with the log-probability of the token
    at each of the flat `positions` (into [B * T]) and the entropy there, stacked ([N, 2]),
    instead of the logits: computed from the hidden state of the position before each, in
    one pass or `rows` at a time (`loss.head_logprobs`), where the model's forward computes
    the logits, so that the layer's weight is the gathered one (FSDP) and the gradient flows
    back through the model as before."""

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions - 1)
        y = input_ids.reshape(-1).index_select(0, positions)
        lp, ent = head_logprobs(h, head.weight, y, temperature, with_entropy, head.bias, rows, compile)
        return torch.stack([lp, torch.zeros_like(lp) if ent is None else ent], -1)

    head.forward = forward  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        del head.forward


def packed_attention_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] bool: query t attends key u when u <= t and both are in the same
    sample (a sample starts wherever the position does not follow the one before)."""
    start = torch.ones_like(position_ids, dtype=torch.bool)
    start[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    sample = start.cumsum(-1)
    t = position_ids.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=position_ids.device).tril()
    return ((sample[:, :, None] == sample[:, None, :]) & causal)[:, None]


def one_sample_per_row(position_ids: torch.Tensor) -> bool:
    """Every row is a single sample from position 0 (no packing, no padding)."""
    return torch.equal(position_ids, torch.arange(position_ids.shape[1]).expand_as(position_ids))


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
    logprob_chunks: int = 1  # the most chunks the output layer took for a micro-batch (1: one pass)
    compile_s: float = 0.0  # of the step's time, compiling (`trainer.model.compile`: its first steps)
    zero_grad_ratio: float = 0.0  # the share of trained elements whose gradient was exactly 0


class OutOfMemory(Exception):
    """The device ran out of memory in a micro-batch's forward or backward; the message is
    `core.device.oom_message`'s one line."""


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
        self.logprob_chunks = 1  # of the forward passes since the last step's start
        # set for a step whose trained tokens' distributions are logged (`trainer.distributions`)
        self.collector: Optional[Collector] = None

    def to_device(self, mb: dict, packed: Optional[bool] = None) -> dict:
        """`mb` on the compute device, with what the forward needs: the trained positions
        (`_positions`, counted on the host: `_trained`) and whether its rows are packed
        (`_packed`: some row of a `position_ids` micro-batch holds more than one sample or
        padding; asked of its tensors when `packed` is not given)."""
        d = self.env.device
        cuda = d.type == "cuda"
        out = {
            k: (v.pin_memory().to(d, non_blocking=True) if cuda and v.device.type == "cpu" else v.to(d))
            if torch.is_tensor(v)
            else v
            for k, v in mb.items()
        }
        ids = mb["input_ids"]
        mask = mb["loss_mask"] if "loss_mask" in mb else torch.ones_like(ids, dtype=torch.bool)
        positions = trained_positions(mask.cpu())
        out["_trained"] = int(positions.shape[0])
        out["_positions"] = positions.to(d, non_blocking=cuda)
        if "position_ids" in mb and packed is None:
            packed = not one_sample_per_row(mb["position_ids"].cpu())
        out["_packed"] = bool("position_ids" in mb and packed)
        return out

    @staticmethod
    def attention_inputs(mb: dict) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(attention_mask, position_ids) for the model: packed rows' [B, 1, T, T] mask, made
        now on the device (it is the largest input: made per micro-batch, not held for all),
        and their positions; right-padded rows' [B, T] mask; else nothing (causal as it is)."""
        if mb.get("_packed"):
            return packed_attention_mask(mb["position_ids"]), mb["position_ids"]
        if "attention_mask" in mb and "position_ids" not in mb:
            return mb["attention_mask"].long(), None
        return None, None

    def prepare(self, micro_batches: list[dict]) -> tuple[list[dict], float, dict[str, float]]:
        """Everything of the step the host knows from its batch, read in one go before any
        compute: the micro-batches on the device (`to_device`), the step's loss-token count
        over all ranks (the normaliser) and the counts of `HOST_STATS`."""
        per_mb = torch.stack([_host_figures(mb) for mb in micro_batches]) if micro_batches else torch.zeros(0, 5)
        rows = per_mb.tolist()
        prepared = [self.to_device(mb, packed=bool(r[4])) for mb, r in zip(micro_batches, rows)]
        totals = [sum(col) for col in zip(*rows)] if rows else [0.0] * 5
        tokens = float(all_reduce_sum([totals[0]], self.env)[0]) if self.env.world_size > 1 else totals[0]
        normalizer = max(tokens, 1.0)
        return prepared, normalizer, dict(zip(HOST_STATS, totals[1:4]))

    def forward(self, mb: dict, temperature: float = 1.0, with_entropy: bool = True, model: Any = None):
        """Per-token log-probabilities (and entropies) of `mb` under the policy, or under
        `model` (the frozen reference) in the same precision: [B, T], at the trained
        positions (0 elsewhere). `mb` may come from `to_device` or be a plain micro-batch."""
        if "_positions" not in mb:
            mb = self.to_device(mb)
        d = self.env.device
        dtype = self.policy.autocast_dtype
        model = model or self.model
        input_ids, positions = mb["input_ids"], mb["_positions"]
        head = output_layer(model)
        rows = None
        if head is not None:
            vocab = head.weight.shape[0]
            mode = self.policy.chunked_logprobs
            free = devices.free_memory_bytes(self.env.device_kind) if mode == "auto" else None
            rows = head_chunk_rows(mb["_trained"], vocab, mode, free)
            chunks = 1 if rows is None else -(-mb["_trained"] // rows)
            self.logprob_chunks = max(self.logprob_chunks, chunks)
        hooked = (
            logprobs_head(head, input_ids, positions, temperature, with_entropy, rows, self.policy.compiled)
            if head
            else None
        )
        attention_mask, position_ids = self.attention_inputs(mb)
        with torch.autocast(device_type=d.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            with hooked or contextlib.nullcontext():
                out = model(
                    input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
                )
        shape = input_ids.shape
        if head is not None:
            lp, ent = out.logits[:, 0], out.logits[:, 1]
        else:
            logits = out.logits.reshape(-1, out.logits.shape[-1]).index_select(0, positions - 1)
            targets = input_ids.reshape(-1).index_select(0, positions)
            lp, ent = next_token_logprobs(logits, targets, temperature, with_entropy)
        return at_positions(lp, positions, shape), at_positions(ent, positions, shape) if with_entropy else None

    @torch.no_grad()
    def add_reference_logprobs(self, reference: Any, micro_batches: list[dict], temperature: float = 1.0) -> None:
        """`ref_logprobs` of every micro-batch under the frozen `reference` model (every
        rank calls it: a sharded reference runs collectives)."""
        for mb in micro_batches:
            mb["ref_logprobs"] = self.forward(mb, temperature, with_entropy=False, model=reference)[0]

    def _accumulate(
        self, micro_batches: list[dict], loss_fn: LossFn, temperature: float, train: bool
    ) -> dict[str, torch.Tensor]:
        """Forward (and backward when `train`) every micro-batch: the local sums of the
        stats (and those counted on the host, `HOST_STATS`), on the device."""
        prepared, normalizer, host = self.prepare(micro_batches)
        # on the device before any compute: a copy there later would wait for the queue
        counted = torch.tensor([host[k] for k in HOST_STATS], dtype=torch.float64).to(self.env.device)
        sums: dict[str, torch.Tensor] = dict(zip(HOST_STATS, counted.unbind()))
        n = len(prepared)
        for i, mb in enumerate(prepared):
            if train and self.policy.sharded:
                sync = self.policy.grad_sync == "every" or i == n - 1
                cast("FSDPModule", self.model).set_requires_gradient_sync(sync)
            with self._oom_said(mb):
                lp, ent = self.forward(mb, temperature)
                mb["entropy"] = ent
                if self.collector is not None:
                    self.collector.add(mb, ent)
                out = loss_fn(lp, mb, normalizer)
                if train:
                    (out.loss * self.env.world_size).backward()
            stats = dict(out.sums)
            stats["entropy"] = (ent * mb["loss_mask"]).sum()
            for k, v in stats.items():
                v = torch.as_tensor(v).detach().to(self.env.device, torch.float64)
                if k not in sums:
                    sums[k] = v
                else:
                    sums[k] = torch.maximum(sums[k], v) if k.endswith(MAX_SUFFIX) else sums[k] + v
        return sums

    @contextlib.contextmanager
    def _oom_said(self, mb: dict):
        """A CUDA out-of-memory error in a micro-batch becomes `OutOfMemory`, one line
        naming its shape, the memory in use and the knobs that lower it."""
        try:
            yield
        except torch.OutOfMemoryError:
            raise OutOfMemory(
                devices.oom_message(
                    self.env.device_kind,
                    tuple(mb["input_ids"].shape),
                    mb["_trained"],
                    ac_freq=self.policy.ac_freq,
                    micro_batch_tokens=self.policy.micro_batch_tokens,
                    chunked=self.policy.chunked_logprobs,
                )
            ) from None

    def _reduce(
        self, sums: dict[str, torch.Tensor], extra: Optional[torch.Tensor] = None
    ) -> tuple[dict[str, float], Optional[float]]:
        """Sum the stats over ranks in one all-reduce (the largest of the `MAX_SUFFIX` ones
        in another) and bring them to the host in one copy, with `extra` (the gradient norm,
        already global) alongside: the step's one wait for the device."""
        added = sorted(k for k in sums if not k.endswith(MAX_SUFFIX))
        largest = sorted(k for k in sums if k.endswith(MAX_SUFFIX))
        keys = added + largest
        vec = torch.stack([sums[k] for k in added])
        top = torch.stack([sums[k] for k in largest]) if largest else None
        if self.env.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(vec, op=dist.ReduceOp.SUM)
            if top is not None:
                dist.all_reduce(top, op=dist.ReduceOp.MAX)
        if top is not None:
            vec = torch.cat([vec, top])
        if extra is not None:
            vec = torch.cat([vec, extra.detach().to(vec.dtype).reshape(1)])
        values = vec.tolist()
        return dict(zip(keys, values)), (values[-1] if extra is not None else None)

    def train_step(
        self, micro_batches: list[dict], loss_fn: LossFn, temperature: float = 1.0, step: int = 0
    ) -> StepResult:
        """Forward/backward every micro-batch, clip, step the optimizer and the schedule.
        Raises `Diverged` (nothing applied) when the gradient norm is not finite."""
        devices.synchronize(self.env.device_kind)
        t0 = time.perf_counter()
        compiling = compile_seconds()
        self.logprob_chunks = 1
        self.optimizer.zero_grad(set_to_none=True)
        local = self._accumulate(micro_batches, loss_fn, temperature, train=True)
        local.update(zip(ZERO_GRADS, self.zero_grads().unbind()))
        total = self.grad_norm()
        if total is not None:
            torch.nn.utils.clip_grads_with_norm_(self.params, self.cfg.max_norm, total, foreach=True)
        sums, norm = self._reduce(local, total)
        grad_norm = 0.0 if norm is None else norm
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
        zero, elements = (sums.pop(k) for k in ZERO_GRADS)
        return StepResult(
            sums=sums,
            grad_norm=grad_norm,
            lr=lr,
            time_forward_backward_s=elapsed,
            logprob_chunks=self.logprob_chunks,
            compile_s=compile_seconds() - compiling,
            zero_grad_ratio=zero / elements if elements else 0.0,
        )

    @torch.no_grad()
    def evaluate(self, micro_batches: list[dict], loss_fn: LossFn) -> dict[str, float]:
        """Loss sums over `micro_batches` without touching gradients (e.g. validation)."""
        self.model.eval()
        try:
            return self._reduce(self._accumulate(micro_batches, loss_fn, 1.0, train=False))[0]
        finally:
            self.model.train()

    def grad_norm(self) -> Optional[torch.Tensor]:
        """The total gradient norm over all ranks, on the device (None without gradients)."""
        from torch.distributed.tensor import DTensor

        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return None
        total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, error_if_nonfinite=False, foreach=True)
        return total.full_tensor() if isinstance(total, DTensor) else total

    def zero_grads(self) -> torch.Tensor:
        """[2] float64 on the device: this rank's elements of the trained parameters whose
        gradient is exactly 0 (all of a parameter without a gradient), and all of them
        (their local shards when sharded). Read with the step's other figures."""
        from torch.distributed.tensor import DTensor

        d = self.env.device
        counts: list[torch.Tensor] = []
        elements = 0
        for p in self.params:
            local = p.to_local() if isinstance(p, DTensor) else p
            elements += local.numel()
            g = p.grad
            if g is None:
                counts.append(torch.full((), local.numel(), dtype=torch.float64, device=d))
            else:
                g = g.to_local() if isinstance(g, DTensor) else g
                counts.append((g == 0).sum().to(torch.float64))
        zero = torch.stack(counts).sum() if counts else torch.zeros((), dtype=torch.float64, device=d)
        return torch.stack([zero, torch.full((), elements, dtype=torch.float64, device=d)])

    def state_dicts(self) -> tuple[dict, dict]:
        """Sharded model and optimizer state dicts (for DCP)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        return get_state_dict(self.model, self.optimizer)

    def load_state_dicts(self, model_sd: dict, optim_sd: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)


def _host_figures(mb: dict) -> torch.Tensor:
    """A micro-batch's loss tokens, real tokens, samples, positions computed and whether it
    is packed (`one_sample_per_row` not true), from its host tensors, as one float64 vector."""
    ids = mb["input_ids"]
    mask = mb["loss_mask"].cpu()
    tokens = mb.get("num_tokens")
    if tokens is None:
        tokens = mb["attention_mask"].sum() if "attention_mask" in mb else torch.tensor(ids.numel())
    samples = mb.get("num_samples")
    if samples is None:
        samples = mask.any(-1).sum()
    if "position_ids" in mb:
        pos = mb["position_ids"].cpu()
        packed = (pos != torch.arange(pos.shape[1])).any()
    else:
        packed = torch.tensor(False)
    figures = (mask.sum(), tokens, samples, torch.tensor(ids.numel()), packed)
    return torch.stack([torch.as_tensor(v).cpu().to(torch.float64) for v in figures])


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far (`torch.compile`: dynamo's frames
    with their forward graphs, and backward graphs compiled at their first use)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:  # a torch without it: no figure
        return 0.0
    return float(sum(sum(compilation_time_metrics.get(k, ())) for k in COMPILE_METRICS))


COMPILE_METRICS = ("_compile.compile_inner", "backward._backward_impl")


def param_count(policy: Policy) -> int:
    """Parameters of the whole (un-sharded) model (a DTensor reports its global size)."""
    return sum(p.numel() for p in policy.model.parameters())


def mfu(tokens_per_s_per_device: float, params: int, peak: Optional[float]) -> Optional[float]:
    """Training MFU of a rank (`prime_hpc.core.device` holds the FLOPs estimate and the peaks)."""
    return devices.mfu(tokens_per_s_per_device, devices.train_flops_per_token(params), peak)
