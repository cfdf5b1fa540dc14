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
    envs                list     [B] the name of each sample's environment ("" for none;
                                 absent in batches of older runs)

Beside them the file holds `envs`, the sorted names of the environments of the step's
samples on every rank (the same list in each rank's file, so that every rank reports the
same per-environment metrics; absent, or empty, in batches of older runs).

Position t of every per-token tensor refers to token `input_ids[t]`: the trainer compares
the log-probability its logits at t-1 assign to token t with `inference_logprobs[t]`.
Every rank gets the same number of micro-batches (FSDP ranks must run the same number of
forward passes); missing ones are empty (B=1, all masks False).

The trainer does not compute on these right-padded rows: it takes a rank's samples back
out of them (`unpack`) and packs them (`pack`) into rows of up to `seq_len` tokens, several
samples per row, positions restarting at 0 at each sample (the model then keeps samples
from attending to each other), a row's unused tail padding of its own, and the rows into
micro-batches of at most a token budget (rows x longest row). A packed micro-batch holds
`input_ids`, `position_ids`, `loss_mask` (never on a sample's first token), `advantages`,
`inference_logprobs` ([R, T] as above), `sample_index` ([R, T]: each token's sample, 0 ..
S - 1 in the micro-batch, S on the padding), `policy_steps`, `policy_spans` and `envs` ([S]), and
`num_tokens` / `num_samples` (its real tokens and samples). Samples without a loss token
are left out (nothing of them reaches the loss).
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
    envs: list[str] = field(default_factory=list)  # the step's environments, on every rank

    @property
    def num_loss_tokens(self) -> int:
        return int(sum(int(mb["loss_mask"].sum()) for mb in self.micro_batches))


def _empty_micro_batch() -> dict[str, Any]:
    import torch

    mb: dict[str, Any] = {
        "input_ids": torch.zeros(1, 1, dtype=torch.long),
        "attention_mask": torch.ones(1, 1, dtype=torch.bool),
        "loss_mask": torch.zeros(1, 1, dtype=torch.bool),
        "advantages": torch.zeros(1, 1),
        "inference_logprobs": torch.zeros(1, 1),
        "policy_steps": torch.zeros(1, dtype=torch.long),
        "policy_spans": torch.ones(1, dtype=torch.long),
        "envs": [""],
    }
    return mb


def collate(samples: list[Sample]) -> dict[str, Any]:
    """Right-pad `samples` into one micro-batch."""
    import torch

    if not samples:
        raise ValueError("collate needs at least one sample")
    b, t = len(samples), max(len(s) for s in samples)
    mb: dict[str, Any] = {
        "input_ids": torch.zeros(b, t, dtype=torch.long),
        "attention_mask": torch.zeros(b, t, dtype=torch.bool),
        "loss_mask": torch.zeros(b, t, dtype=torch.bool),
        "advantages": torch.zeros(b, t),
        "inference_logprobs": torch.zeros(b, t),
        "policy_steps": torch.tensor([s.policy_step for s in samples], dtype=torch.long),
        "policy_spans": torch.tensor([s.policies for s in samples], dtype=torch.long),
        "envs": [s.env for s in samples],
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


def unpack(micro_batches: list[dict[str, Any]]) -> list[Sample]:
    """The samples of right-padded (`collate`) or packed (`pack`) micro-batches, in order,
    each with its per-token advantages and its environment ("" in batches of older runs);
    samples without a loss token are left out."""
    out = []
    for mb in micro_batches:
        for r, lo, hi, k in _segments(mb):
            mask = mb["loss_mask"][r, lo:hi]
            if not bool(mask.any()):
                continue
            out.append(
                Sample(
                    input_ids=mb["input_ids"][r, lo:hi].tolist(),
                    loss_mask=mask.tolist(),
                    inference_logprobs=mb["inference_logprobs"][r, lo:hi].tolist(),
                    advantage=0.0,
                    token_advantages=mb["advantages"][r, lo:hi].tolist(),
                    policy_step=int(mb["policy_steps"][k]),
                    policies=int(mb["policy_spans"][k]) if "policy_spans" in mb else 1,
                    env=str(mb["envs"][k]) if "envs" in mb else "",
                )
            )
    return out


def _segments(mb: dict[str, Any]) -> list[tuple[int, int, int, int]]:
    """(row, start, end, sample) of every sample of a micro-batch."""
    if "sample_index" not in mb:  # right-padded: a sample per row
        lengths = mb["attention_mask"].sum(-1).tolist()
        return [(r, 0, int(n), r) for r, n in enumerate(lengths)]
    out = []
    n = mb["policy_steps"].shape[0]
    for r, row in enumerate(mb["sample_index"].tolist()):
        t = 0
        while t < len(row) and row[t] < n:
            end = t
            while end < len(row) and row[end] == row[t]:
                end += 1
            out.append((r, t, end, row[t]))
            t = end
    return out


def pack(samples: list[Sample], seq_len: int, micro_batch_tokens: int) -> list[dict[str, Any]]:
    """`samples` packed into rows of up to min(seq_len, micro_batch_tokens) tokens (first
    fit, longest first; a longer sample has a row of its own), the rows into micro-batches
    of at most `micro_batch_tokens` computed tokens (rows x the longest row; at least one
    row each). See the module docstring for the tensors."""
    if seq_len < 1 or micro_batch_tokens < 1:
        raise ValueError("seq_len and micro_batch_tokens must be >= 1")
    cap = min(seq_len, micro_batch_tokens)
    rows: list[list[Sample]] = []
    room: list[int] = []
    for s in sorted((s for s in samples if any(s.loss_mask)), key=len, reverse=True):
        i = next((i for i, free in enumerate(room) if free >= len(s)), None)
        if i is None:
            rows.append([s])
            room.append(cap - len(s))
        else:
            rows[i].append(s)
            room[i] -= len(s)
    rows.sort(key=lambda r: sum(len(s) for s in r), reverse=True)
    mbs: list[dict[str, Any]] = []
    group: list[list[Sample]] = []
    width = 0
    for row in rows:
        n = sum(len(s) for s in row)
        if group and (len(group) + 1) * max(width, n) > micro_batch_tokens:
            mbs.append(collate_packed(group))
            group, width = [], 0
        group.append(row)
        width = max(width, n)
    if group:
        mbs.append(collate_packed(group))
    return mbs


def collate_packed(rows: list[list[Sample]]) -> dict[str, Any]:
    """One micro-batch of packed rows (each a list of samples); see the module docstring."""
    import torch

    samples = [s for row in rows for s in row]
    b, t, n = len(rows), max(1, max(sum(len(s) for s in row) for row in rows)), len(samples)
    mb: dict[str, Any] = {
        "input_ids": torch.zeros(b, t, dtype=torch.long),
        "position_ids": torch.zeros(b, t, dtype=torch.long),
        "loss_mask": torch.zeros(b, t, dtype=torch.bool),
        "advantages": torch.zeros(b, t),
        "inference_logprobs": torch.zeros(b, t),
        "sample_index": torch.full((b, t), n, dtype=torch.long),
        "policy_steps": torch.tensor([s.policy_step for s in samples], dtype=torch.long),
        "policy_spans": torch.tensor([s.policies for s in samples], dtype=torch.long),
        "envs": [s.env for s in samples],
        "num_tokens": torch.tensor(sum(len(s) for s in samples)),
        "num_samples": torch.tensor(n),
    }
    k = 0
    for i, row in enumerate(rows):
        at = 0
        for s in row:
            end = at + len(s)
            mb["input_ids"][i, at:end] = torch.tensor(s.input_ids, dtype=torch.long)
            mb["position_ids"][i, at:end] = torch.arange(len(s))
            mb["loss_mask"][i, at:end] = torch.tensor(s.loss_mask, dtype=torch.bool)
            mb["loss_mask"][i, at] = False  # nothing of this sample predicts its first token
            adv = s.token_advantages if s.token_advantages is not None else [float(s.advantage)] * len(s)
            mb["advantages"][i, at:end] = torch.tensor(adv, dtype=torch.float32)
            mb["inference_logprobs"][i, at:end] = torch.tensor(s.inference_logprobs, dtype=torch.float32)
            mb["sample_index"][i, at:end] = k
            at, k = end, k + 1
        mb["position_ids"][i, at:] = torch.arange(t - at)  # the padding: a segment of its own
    return mb


def empty_packed() -> dict[str, Any]:
    """A packed micro-batch with nothing to train (a rank with fewer micro-batches than
    another runs these: FSDP needs the same number of forward passes on every rank)."""
    mb = collate_packed([[]])
    return mb


def padding_share(micro_batches: list[dict[str, Any]]) -> float:
    """The share of the positions computed that are padding (right-padded or packed)."""
    computed = sum(mb["input_ids"].numel() for mb in micro_batches)
    real = sum(int(mb["num_tokens"]) if "num_tokens" in mb else int(mb["attention_mask"].sum()) for mb in micro_batches)
    return 1.0 - real / computed if computed else 0.0


def write_step(run: RunDir, step: int, per_rank: list[list[dict[str, Any]]], info: Optional[dict] = None) -> Path:
    """Write `rollouts/step_<step>/rank_<r>.pt` for every rank, then the `STABLE` marker."""
    import torch

    d = run.rollout_step(step)
    d.mkdir(parents=True, exist_ok=True)
    envs = step_envs(per_rank)
    for rank, mbs in enumerate(per_rank):
        buf = io.BytesIO()
        data = {"format": FORMAT, "step": step, "rank": rank, "micro_batches": mbs, "info": info or {}, "envs": envs}
        torch.save(data, buf)
        atomic_write_bytes(run.rollout_file(step, rank), buf.getvalue())
    mark_stable(d, {"step": step, "ranks": len(per_rank), **(info or {})})
    return d


def step_envs(per_rank: list[list[dict[str, Any]]]) -> list[str]:
    """The sorted names of the environments of a step's samples on every rank ("" left out)."""
    return sorted({str(e) for mbs in per_rank for mb in mbs for e in mb.get("envs", ()) if e})


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
    envs = data.get("envs") or []
    if not isinstance(envs, list) or not all(isinstance(e, str) for e in envs):
        raise RuntimeError(f"{path}: 'envs' must be a list of environment names, got {envs!r}")
    return RolloutBatch(
        step=int(data["step"]),
        rank=int(data["rank"]),
        micro_batches=data["micro_batches"],
        info=data["info"],
        envs=envs,
    )


def remove_step(run: RunDir, step: int) -> None:
    """Consumed rollouts can go (the trainer's rank 0 does it after the step)."""
    remove_marked(run.rollout_step(step))
