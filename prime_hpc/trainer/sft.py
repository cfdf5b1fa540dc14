"""SFT trainer: `torchrun ... -m prime_hpc.trainer.sft --config <output_dir>/configs/trainer.yaml`.

Trains on `trainer.data` (see `prime_hpc.trainer.sft_data` for the accepted datasets,
loss masks and packing). A step takes `data.batch_size // data.seq_len` packed rows
(rounded up to a multiple of the number of ranks), split round robin over the ranks and
into micro-batches of `micro_batch_size` rows (`micro_batch_tokens // seq_len` when that is
set); the loss is the token-level NLL over the
trained tokens of all ranks. Validation loss (`val/loss`) runs before the first step and
every `val.interval` steps (and at the last one) on `val.data`.

The run ends at `max_steps`, or after one epoch when `max_steps` is null. Weights
(`weights/step_<n>`, the same layout as RL, so an RL run can start from them with
`model.name=<output_dir>/weights/step_<n>`) are written at every checkpoint and at the
last step; checkpoints additionally hold the dataloader position, so a resume continues
with the same samples in the same order.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from prime_hpc.config.component import TrainerRunConfig
from prime_hpc.rundir.checkpoints import snapshot_due
from prime_hpc.trainer import distributions, runner

if TYPE_CHECKING:
    from prime_hpc.config.schema import LossMaskConfig, SFTDataConfig
    from prime_hpc.trainer.dist import DistEnv
    from prime_hpc.trainer.runner import Session

PROG = "python -m prime_hpc.trainer.sft"
PARTS = ("trainer",)  # an SFT checkpoint step is complete without an orchestrator part


def load_samples(data_cfg: SFTDataConfig, tokenizer: Any, loss_mask: LossMaskConfig) -> tuple[list, Any]:
    """The dataset's samples and their `sft_data.Mix` (None unless several subsets/splits)."""
    from prime_hpc.core.errors import UserError
    from prime_hpc.trainer import sft_data

    if not data_cfg.name:
        raise UserError("trainer.data.name: an SFT run needs a dataset (a HF name, a local path or module:function)")
    return sft_data.load_parts(data_cfg, tokenizer, loss_mask)


def _pad_id(tokenizer: Any) -> int:
    for tok_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tok_id is not None:
            return int(tok_id)
    return 0


def validation_batches(samples: list, seq_len: int, env: DistEnv, micro_batch_size: int, pad_id: int) -> list[dict]:
    from prime_hpc.trainer import sft_data

    rows = sft_data.pack(samples, seq_len)
    per_rank = math.ceil(len(rows) / env.world_size)
    mine = sft_data.split_rows(rows, env.rank, env.world_size, per_rank)
    return sft_data.micro_batches(mine, micro_batch_size, pad_id)


def rows_per_micro_batch(cfg: TrainerRunConfig) -> int:
    """Packed rows per forward pass: `trainer.micro_batch_tokens // data.seq_len` when set
    (at least one), else `trainer.micro_batch_size`."""
    t = cfg.trainer
    if t.micro_batch_tokens:
        return max(1, int(t.micro_batch_tokens) // int(t.data.seq_len))
    return int(t.micro_batch_size)


def _nll(lp, mb, normalizer):
    from prime_hpc.trainer.loss import sft_loss

    return sft_loss(lp, mb["loss_mask"], normalizer)


def load_data(cfg: TrainerRunConfig, tokenizer: Any) -> tuple[list, Any, Optional[list]]:
    """The training samples, their mix (None unless several subsets/splits) and the
    validation samples (None without `val.interval`), tokenized: a bad dataset fails
    before any heavy setup."""
    from loguru import logger

    from prime_hpc.core.errors import UserError

    t = cfg.trainer
    samples, mix = load_samples(t.data, tokenizer, t.loss_mask)
    val_samples = None
    if t.val.interval:
        if not t.val.data.name:
            raise UserError("trainer.val.interval is set but trainer.val.data.name is not; name a validation dataset")
        val_samples, _ = load_samples(t.val.data, tokenizer, t.loss_mask)
    logger.info(
        f"{len(samples)} training samples from {t.data.name}"
        + (f", {len(val_samples)} validation samples from {t.val.data.name}" if val_samples else "")
    )
    return samples, mix, val_samples


@dataclass
class Epochs:
    """Where the run is in its data: the packed stream, the validation batches, the
    rows each rank takes per step and the counts a checkpoint keeps."""

    stream: Any  # sft_data.SFTStream
    val: Optional[list[dict]]
    rows_per_rank: int
    pad_id: int
    progress: dict[str, int]

    def state(self) -> dict[str, Any]:
        return {"progress": self.progress, "dataloader": self.stream.state()}


def start(
    s: Session, cfg: TrainerRunConfig, tokenizer: Any, samples: list, val_samples: Optional[list], mix: Any = None
) -> Epochs:
    """The data position of a new run, or of a resumed one (its checkpoint's); `mix`: the
    samples' `sft_data.Mix`."""
    from prime_hpc.trainer import sft_data

    t, env, pad_id = cfg.trainer, s.env, _pad_id(tokenizer)
    stream = sft_data.SFTStream(samples, t.data.seq_len, cfg.seed, epochs=None if cfg.max_steps else 1, mix=mix)
    if s.resumed:
        stream.load_state(s.resumed["dataloader"])
    return Epochs(
        stream=stream,
        val=validation_batches(val_samples, t.val.data.seq_len, env, rows_per_micro_batch(cfg), pad_id)
        if val_samples
        else None,
        rows_per_rank=math.ceil(max(1, t.data.batch_size // t.data.seq_len) / env.world_size),
        pad_id=pad_id,
        progress=dict((s.resumed or {}).get("progress", {"num_tokens": 0, "num_samples": 0})),
    )


def train_step(
    s: Session, cfg: TrainerRunConfig, data: Epochs, step: int, rows: list, used: int, t0: float
) -> tuple[dict, bool]:
    """Train on this step's `rows` (`used` samples), validate when due, save what is due;
    returns the step's metrics and whether the run ends here (the data ends, `max_steps`,
    or the validation loss fell below `val.stop_below`). `t0`: when the step began (its
    rows were taken then)."""
    from prime_hpc.trainer import sft_data

    t, env = cfg.trainer, s.env
    mbs = sft_data.micro_batches(
        sft_data.split_rows(rows, env.rank, env.world_size, data.rows_per_rank), rows_per_micro_batch(cfg), data.pad_id
    )
    t_data = time.perf_counter() - t0
    result = distributions.logged(s, step, lambda: s.engine.train_step(mbs, _nll, step=step))
    data.progress["num_tokens"] += int(result.sums["num_tokens"])
    data.progress["num_samples"] += used
    last = step == cfg.max_steps or data.stream.exhausted()
    due = last or (t.val.interval is not None and step % t.val.interval == 0)
    val_m = _validate(s, step, data.val, log=False) if data.val is not None and due else {}
    early = bool(val_m) and t.val.stop_below is not None and val_m["val/loss"] < t.val.stop_below
    saved, t_ckpt = runner.checkpoint_if_due(s, step, last or early, data.state())
    t_weights = 0.0
    if saved or last or early or snapshot_due(step, last or early, cfg.ckpt):
        t_weights = runner.save_weights(s, step)
        if env.is_main:
            runner.prune_weights(s.run, step, 0, s.cfg.ckpt)
    m = runner.step_metrics(s, result, time.perf_counter() - t0, t_data)
    m.update(
        {
            "progress/epoch": data.stream.progress_epochs,
            "progress/num_samples": data.progress["num_samples"],
            "progress/num_tokens": data.progress["num_tokens"],
            **data.stream.ratios(),
            "time/save_ckpt": t_ckpt,
            "time/save_weights": t_weights,
            **val_m,
        }
    )
    return m, early


def log_step(s: Session, step: int, m: dict) -> None:
    from loguru import logger

    if s.metrics is not None:
        s.metrics.log(step, m)
    logger.info(
        f"step {step} | loss {m['loss/mean']:.4f}"
        + (f" | val/loss {m['val/loss']:.4f}" if "val/loss" in m else "")
        + f" | grad_norm {m['optim/grad_norm']:.3f} | lr {m['optim/lr']:.2e} | "
        f"epoch {m['progress/epoch']:.2f} | {m['perf/throughput']:.0f} tok/s"
    )


def train(cfg: TrainerRunConfig) -> None:
    """Steps until `max_steps`, the end of the data or an early stop; a stop request
    (time limit, preemption) checkpoints the step it is at and ends the process."""
    from loguru import logger

    from prime_hpc.runtime.stopping import CONTINUE, Stop
    from prime_hpc.trainer.model import load_tokenizer

    tokenizer = load_tokenizer(cfg)
    samples, mix, val_samples = load_data(cfg, tokenizer)
    with runner.session(cfg, PARTS) as s:
        data = start(s, cfg, tokenizer, samples, val_samples, mix)
        step = s.start_step
        if data.val is not None and step == 0:
            _validate(s, 0, data.val)
        runner.beat(s, step)
        stop = Stop(s.run)
        while (cfg.max_steps is None or step < cfg.max_steps) and not data.stream.exhausted():
            code, _ = runner.agreed_stop(s, stop)
            if code != CONTINUE:
                runner.stop_here(s, step, code, data.state())
                return
            t0 = time.perf_counter()
            rows, used = data.stream.next_rows(data.rows_per_rank * s.env.world_size)
            if not rows:
                break
            step += 1
            m, early = train_step(s, cfg, data, step, rows, used, t0)
            log_step(s, step, m)
            runner.beat(s, step)
            if early:
                logger.info(
                    f"val/loss {m['val/loss']:.4f} < trainer.val.stop_below={cfg.trainer.val.stop_below}: "
                    f"stopping at step {step}"
                )
                break
        s.ckpt.wait()
        if s.env.is_main:  # a background save may have rotated a checkpoint away just now
            runner.prune_weights(s.run, step, 0, s.cfg.ckpt)
        runner.beat(s, step, done=True)
        logger.info(f"done at step {step}")


def _validate(s: Session, step: int, val: list[dict], log: bool = True) -> dict[str, float]:
    sums = s.engine.evaluate(val, _nll)
    out = {"val/loss": sums["loss"] / max(sums["tokens"], 1.0)}
    if log and s.metrics is not None:
        s.metrics.log(step, out)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    return runner.main(train, PROG, "SFT trainer: trains on trainer.data, writes weights/step_<n>.", argv)


if __name__ == "__main__":
    raise SystemExit(main())
