"""The rollout batch format: what the orchestrator writes to `rollouts/step_<n>/rank_<r>.pt`
and what the trainer reads. One writer and one reader, used by both sides (and by tests).

A step directory holds one file per trainer data-parallel rank and a `STABLE` marker
written after all of them; readers wait for the marker, never for the files. Each file
is written atomically (temp name, fsync, rename), so a `kill -9` of the orchestrator leaves
either a complete file or none.

Per rank, a file holds a list of micro-batches of right-padded tensors (shape [B, T]):

    input_ids           int64    prompt + completion token ids (pad = 0)
    attention_mask      bool     True on real tokens
    loss_mask           bool     True on tokens the loss trains (completion tokens)
    advantages          float32  the sample's advantage on every token, or its per-token
                                 advantages (distillation); 0 on pads
    inference_logprobs  float32  log p_inference(input_ids[t] | input_ids[:t]); 0 where unknown
    policy_steps        int64    [B] the oldest policy step that generated each sample
    policy_spans        int64    [B] how many policies it spans (> 1: an update came while
                                 it was generated; absent in batches of older runs: 1)

Position t of every per-token tensor refers to token `input_ids[t]`: the trainer compares
the log-probability its logits at t-1 assign to token t with `inference_logprobs[t]`.
Every rank gets the same number of micro-batches (FSDP ranks must run the same number of
forward passes); missing ones are empty (B=1, all masks False).
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from prime_hpc.rundir import RunDir, atomic_write_bytes, mark_stable, remove_marked, wait_stable

FORMAT = 1
TENSOR_KEYS = ("input_ids", "attention_mask", "loss_mask", "advantages", "inference_logprobs")


@dataclass
class Sample:
    """One rollout, ready for training (token-aligned lists of equal length)."""

    input_ids: list[int]
    loss_mask: list[bool]
    inference_logprobs: list[float]
    advantage: float
    policy_step: int = 0  # the oldest policy that generated it
    policies: int = 1  # how many policies it spans (newest - oldest + 1)
    env: str = ""
    reward: float = 0.0
    token_advantages: Optional[list[float]] = None  # per token (e.g. distillation); overrides `advantage`

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        lens = {len(self.loss_mask), len(self.inference_logprobs)}
        if self.token_advantages is not None:
            lens.add(len(self.token_advantages))
        if lens != {n}:
            raise ValueError(f"sample fields have different lengths: input_ids {n}, others {sorted(lens)}")

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class RolloutBatch:
    step: int
    rank: int
    micro_batches: list[dict[str, Any]]
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def num_loss_tokens(self) -> int:
        return int(sum(int(mb["loss_mask"].sum()) for mb in self.micro_batches))


def _empty_micro_batch() -> dict[str, Any]:
    import torch

    mb = {
        "input_ids": torch.zeros(1, 1, dtype=torch.long),
        "attention_mask": torch.ones(1, 1, dtype=torch.bool),
        "loss_mask": torch.zeros(1, 1, dtype=torch.bool),
        "advantages": torch.zeros(1, 1),
        "inference_logprobs": torch.zeros(1, 1),
        "policy_steps": torch.zeros(1, dtype=torch.long),
        "policy_spans": torch.ones(1, dtype=torch.long),
    }
    return mb


def collate(samples: list[Sample]) -> dict[str, Any]:
    """Right-pad `samples` into one micro-batch."""
    import torch

    if not samples:
        raise ValueError("collate needs at least one sample")
    b, t = len(samples), max(len(s) for s in samples)
    mb = {
        "input_ids": torch.zeros(b, t, dtype=torch.long),
        "attention_mask": torch.zeros(b, t, dtype=torch.bool),
        "loss_mask": torch.zeros(b, t, dtype=torch.bool),
        "advantages": torch.zeros(b, t),
        "inference_logprobs": torch.zeros(b, t),
        "policy_steps": torch.tensor([s.policy_step for s in samples], dtype=torch.long),
        "policy_spans": torch.tensor([s.policies for s in samples], dtype=torch.long),
    }
    for i, s in enumerate(samples):
        n = len(s)
        mb["input_ids"][i, :n] = torch.tensor(s.input_ids, dtype=torch.long)
        mb["attention_mask"][i, :n] = True
        mb["loss_mask"][i, :n] = torch.tensor(s.loss_mask, dtype=torch.bool)
        if s.token_advantages is not None:
            mb["advantages"][i, :n] = torch.tensor(s.token_advantages, dtype=torch.float32)
        else:
            mb["advantages"][i, :n] = float(s.advantage)
        mb["inference_logprobs"][i, :n] = torch.tensor(s.inference_logprobs, dtype=torch.float32)
    return mb


def shard(samples: list[Sample], ranks: int, micro_batch_size: int) -> list[list[dict[str, Any]]]:
    """Split one step's samples over `ranks` trainer ranks, balancing tokens (longest first
    to the lightest rank), and collate each rank's share into micro-batches of at most
    `micro_batch_size` samples of similar length. Every rank gets the same number of
    micro-batches."""
    if ranks < 1 or micro_batch_size < 1:
        raise ValueError("ranks and micro_batch_size must be >= 1")
    per_rank: list[list[Sample]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for s in sorted(samples, key=len, reverse=True):
        r = min(range(ranks), key=lambda i: (load[i], len(per_rank[i])))
        per_rank[r].append(s)
        load[r] += len(s)
    out = []
    for share in per_rank:
        mbs = [collate(share[i : i + micro_batch_size]) for i in range(0, len(share), micro_batch_size)]
        out.append(mbs)
    n = max(len(m) for m in out)
    for mbs in out:
        mbs.extend(_empty_micro_batch() for _ in range(n - len(mbs)))
    return out


def write_step(run: RunDir, step: int, per_rank: list[list[dict[str, Any]]], info: Optional[dict] = None) -> Path:
    """Write `rollouts/step_<step>/rank_<r>.pt` for every rank, then the `STABLE` marker."""
    import torch

    d = run.rollout_step(step)
    d.mkdir(parents=True, exist_ok=True)
    for rank, mbs in enumerate(per_rank):
        buf = io.BytesIO()
        torch.save({"format": FORMAT, "step": step, "rank": rank, "micro_batches": mbs, "info": info or {}}, buf)
        atomic_write_bytes(run.rollout_file(step, rank), buf.getvalue())
    mark_stable(d, {"step": step, "ranks": len(per_rank), **(info or {})})
    return d


def read_rank(run: RunDir, step: int, rank: int, timeout_s: float, **wait_kwargs: Any) -> RolloutBatch:
    """Wait for `rollouts/step_<step>` to be complete (at most `timeout_s`: the trainer's
    `trainer.rollout_timeout_s`) and load this rank's file.
    `wait_kwargs` go to `rundir.wait_for` (producer, producer_log, alive)."""
    import torch

    wait_kwargs.setdefault("producer", "orchestrator")
    wait_stable(run.rollout_step(step), timeout_s=timeout_s, **wait_kwargs)
    path = run.rollout_file(step, rank)
    if not path.exists():
        ranks = sorted(p.name for p in path.parent.glob("rank_*"))
        raise RuntimeError(f"{path} is missing (the step has {ranks}): trainer ranks and orchestrator disagree")
    data = torch.load(path, map_location="cpu", weights_only=True)
    if data.get("format") != FORMAT:
        raise RuntimeError(f"{path}: rollout format {data.get('format')!r}, expected {FORMAT}")
    return RolloutBatch(
        step=int(data["step"]), rank=int(data["rank"]), micro_batches=data["micro_batches"], info=data["info"]
    )


def remove_step(run: RunDir, step: int) -> None:
    """Consumed rollouts can go (the trainer's rank 0 does it after the step)."""
    remove_marked(run.rollout_step(step))
