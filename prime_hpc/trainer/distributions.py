"""The trainer's distributions for W&B (`wandb.log_extras.trainer`): histograms of a step's
trained tokens, over every rank: `distributions/trainer/entropy` (the policy's entropy at
each trained token) and, in RL, `distributions/trainer/advantage` (each trained token's
advantage: a rollout's, or its own under on-policy distillation).

Consumes: the micro-batches of a due step as the engine runs them (`Collector.add`, on
the device, nothing copied to the host); produces `{name: {"counts": [...], "edges":
[...]}}` (`Collector.histograms`: every rank calls it, since the bins are agreed in
collectives; the numbers come to the host once). Which steps are due is `due`: every
`interval` steps of the trainer's own (null: the orchestrator's `wandb.log_extras.interval`),
only with W&B on. The histograms are written by `runtime.metrics.MetricsLogger.log_histograms`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, TypeVar

import torch

BINS = 64
T = TypeVar("T")
PREFIX = "distributions/trainer/"


def due(wandb_cfg: Any, step: int) -> bool:
    """Whether `step` logs the trainer's distributions (`wandb_cfg`: the run's `wandb`)."""
    if wandb_cfg is None or not getattr(wandb_cfg, "enabled", False):
        return False
    extras = wandb_cfg.log_extras
    if not extras.trainer.distributions:
        return False
    every = extras.interval if extras.trainer.interval is None else extras.trainer.interval
    return bool(every) and step % every == 0


class Collector:
    """The values of one step's trained tokens, kept on the device until `histograms`."""

    def __init__(self) -> None:
        self.values: dict[str, list[torch.Tensor]] = {"entropy": [], "advantage": []}

    def add(self, mb: dict, entropy: Optional[torch.Tensor]) -> None:
        """A micro-batch's trained tokens (`loss_mask`): their entropy and advantages."""
        mask = mb["loss_mask"].bool()
        if entropy is not None:
            self.values["entropy"].append(entropy[mask].detach().float())
        if "advantages" in mb:
            self.values["advantage"].append(mb["advantages"][mask].detach().float())

    def histograms(self, env: Any, bins: int = BINS) -> dict[str, dict[str, list[float]]]:
        """Every rank: `bins` equal bins between the smallest and largest value over all
        ranks (one all-reduce for the ranges, one for the counts); a distribution no rank
        has a value of is left out."""
        names = [n for n, v in self.values.items() if v] if env.world_size == 1 else list(self.values)
        if not names:
            return {}
        device = env.device
        flat = {n: torch.cat(self.values[n]) if self.values[n] else torch.zeros(0, device=device) for n in names}
        inf = torch.tensor(float("inf"), dtype=torch.float64, device=device)
        # [-min, max] of each, so that one MAX reduction gives both
        ranges = torch.stack(
            [
                torch.stack([-v.min().double(), v.max().double()]) if v.numel() else torch.stack([-inf, -inf])
                for v in flat.values()
            ]
        )
        if env.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(ranges, op=dist.ReduceOp.MAX)
        lows, highs = (-ranges[:, 0]).tolist(), ranges[:, 1].tolist()
        counts = []
        for (name, v), lo, hi in zip(flat.items(), lows, highs):
            if hi < lo:  # no rank had a value
                lo, hi = 0.0, 0.0
            if hi == lo:
                lo, hi = lo - 0.5, hi + 0.5
            counts.append(
                torch.histc(v.double(), bins=bins, min=lo, max=hi) if v.numel() else v.new_zeros(bins).double()
            )
            flat[name] = torch.tensor([lo, hi], dtype=torch.float64)  # the agreed range, kept for the edges
        table = torch.stack(counts)
        if env.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(table, op=dist.ReduceOp.SUM)
        out = {}
        for (name, span), row in zip(flat.items(), table.cpu().tolist()):
            if sum(row) == 0:
                continue
            edges = torch.linspace(float(span[0]), float(span[1]), bins + 1, dtype=torch.float64).tolist()
            out[PREFIX + name] = {"counts": [int(c) for c in row], "edges": edges}
        return out


def logged(s: Any, step: int, train: Callable[[], T]) -> T:
    """`train()` (one optimizer step of session `s`), collecting its trained tokens'
    distributions when the step is `due`, then logged by rank 0's metrics logger (every
    rank takes part in the reductions)."""
    if not due(s.cfg.wandb, step):
        return train()
    s.engine.collector = collector = Collector()
    try:
        result = train()
    finally:
        s.engine.collector = None
    hist = collector.histograms(s.env)
    if s.metrics is not None and hist:
        s.metrics.log_histograms(step, hist)
    return result
