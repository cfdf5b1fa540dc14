"""RL trainer: `torchrun ... -m prime_hpc.trainer.rl --config <output_dir>/configs/trainer.yaml`.

Step n (n = 1, 2, ...; policy 0 is the base model, resume from N continues at N+1):

1. wait for `rollouts/step_n/STABLE` and read this rank's `rank_<r>.pt` (`prime_hpc.batch`);
   give up after `trainer.rollout_timeout_s` naming the orchestrator's log; stop cleanly
   when `rollouts/DONE` says the orchestrator wrote its last step before n;
2. forward/backward every micro-batch with the objective of `trainer.loss`
   (`prime_hpc.trainer.loss`), normalised by the step's loss tokens over all ranks; clip
   the gradient norm; optimizer and LR-schedule step. Logits are divided by the sampling
   temperature the orchestrator records in the step's info (`temperature`, default 1);
3. rank 0 writes `weights/step_n` (HF safetensors + config + tokenizer, `STABLE` last),
   then, once every rank has read its file, removes `rollouts/step_n`;
4. checkpoint when due (`prime_hpc.trainer.ckpt`); drop weights the orchestrator no
   longer needs (`runner.prune_weights`); one metrics line; heartbeat.

It ends after step `max_steps` (or at `rollouts/DONE`); the last step's weights stay, and
the heartbeat of every rank says `{"step": n, "done": true}`.
"""
from __future__ import annotations

import time
from typing import Any, Optional

from prime_hpc.rundir import CHECKPOINT_PARTS, RunDir, is_stable, read_json, wait_for
from prime_hpc.trainer import runner
from prime_hpc.trainer.config import TrainerRunConfig

PROG = "python -m prime_hpc.trainer.rl"


def rollouts_done_before(run: RunDir, step: int) -> bool:
    """True when the orchestrator declared that its last step is before `step`."""
    try:
        return int(read_json(run.rollouts_done)["last_step"]) < step
    except (OSError, ValueError, KeyError, TypeError):
        return False


def wait_for_rollouts(run: RunDir, step: int, timeout_s: float, producer_log: Any) -> bool:
    """Block until step `step`'s rollouts are complete (True) or the orchestrator is done
    before it (False)."""
    def ready() -> Optional[str]:
        if is_stable(run.rollout_step(step)):
            return "ready"
        return "done" if rollouts_done_before(run, step) else None

    found = wait_for(ready, what=f"rollouts of step {step} ({run.rollout_step(step)}/STABLE)", timeout_s=timeout_s,
                     producer="orchestrator", producer_log=producer_log)
    return found == "ready"


def make_loss_fn(loss_cfg: Any, step: int):
    from prime_hpc.trainer.loss import rl_loss

    def loss_fn(lp, mb, normalizer):
        out = rl_loss(lp, mb["inference_logprobs"], mb["advantages"], mb["loss_mask"], loss_cfg, normalizer)
        rows = mb["loss_mask"].any(-1)
        lag = (step - 1 - mb["policy_steps"]).clamp(min=0)
        out.sums["off_policy_steps"] = (lag * rows).sum().float()
        return out

    return loss_fn


def train(cfg: TrainerRunConfig) -> None:
    from loguru import logger

    from prime_hpc import batch as rollout_batch
    from prime_hpc.trainer.dist import all_reduce_min, barrier

    with runner.session(cfg, CHECKPOINT_PARTS) as s:
        run, env = s.run, s.env
        step = s.start_step
        progress = dict((s.resumed or {}).get("progress", {"num_tokens": 0, "num_samples": 0}))
        producer_log = runner.orchestrator_log()
        runner.beat(s, step)
        while cfg.max_steps is None or step < cfg.max_steps:
            t0 = time.perf_counter()
            got = wait_for_rollouts(run, step + 1, cfg.trainer.rollout_timeout_s, producer_log)
            if not all_reduce_min(int(got), env):
                logger.info(f"the orchestrator wrote its last rollouts before step {step + 1} ({run.rollouts_done})")
                break
            step += 1
            data = rollout_batch.read_rank(run, step, env.rank, timeout_s=cfg.trainer.rollout_timeout_s,
                                           producer_log=producer_log)
            t_wait = time.perf_counter() - t0
            result = s.engine.train_step(data.micro_batches, make_loss_fn(cfg.trainer.loss, step),
                                         temperature=float(data.info.get("temperature", 1.0)))
            t_weights = runner.save_weights(s, step)
            barrier()  # every rank has read its rollout file
            if env.is_main:
                rollout_batch.remove_step(run, step)
            progress["num_tokens"] += int(result.sums["num_tokens"])
            progress["num_samples"] += int(result.sums["num_samples"])
            final = cfg.max_steps is not None and step == cfg.max_steps
            _, t_ckpt = runner.checkpoint_if_due(s, step, final, {"progress": progress})
            if env.is_main:
                runner.prune_weights(run, step, cfg.async_level)
            _log_step(s, step, result, time.perf_counter() - t0, t_wait, t_weights, t_ckpt, progress)
            runner.beat(s, step)
        if step > s.start_step and cfg.ckpt.enabled and step not in s.ckpt.saved:
            s.ckpt.save(step, s.engine, {"progress": progress})  # stopped early at rollouts/DONE
        s.ckpt.wait()
        if env.is_main:  # a background save may have rotated a checkpoint away just now
            runner.prune_weights(s.run, step, cfg.async_level)
        runner.beat(s, step, done=True)
        logger.info(f"done at step {step}")


def _log_step(s: Any, step: int, result: Any, t_step: float, t_wait: float, t_weights: float, t_ckpt: float,
              progress: dict) -> None:
    from loguru import logger

    sums = result.sums
    tok = max(sums["tokens"], 1.0)
    m = runner.step_metrics(s, result, t_step, t_wait)
    m.update({
        "mismatch_kl/mean": sums["mismatch_kl"] / tok,
        "masked_advantage_positive/mean": sums["masked_positive"] / tok,
        "masked_advantage_negative/mean": sums["masked_negative"] / tok,
        "off_policy_steps/mean": sums["off_policy_steps"] / max(sums["num_samples"], 1.0),
        "time/save_weights": t_weights,
        "time/save_ckpt": t_ckpt,
        "progress/num_tokens": progress["num_tokens"],
        "progress/num_samples": progress["num_samples"],
    })
    if s.metrics is not None:
        s.metrics.log(step, m)
    logger.info(f"step {step} | loss {m['loss/mean']:.4f} | mismatch_kl {m['mismatch_kl/mean']:.2e} | "
                f"grad_norm {m['optim/grad_norm']:.3f} | lr {m['optim/lr']:.2e} | {t_step:.2f}s "
                f"(waited {t_wait:.2f}s) | {m['perf/throughput']:.0f} tok/s")


def main(argv: Optional[list[str]] = None) -> int:
    return runner.main(train, PROG, "RL trainer: trains on rollouts/step_<n>, writes weights/step_<n>.", argv)


if __name__ == "__main__":
    raise SystemExit(main())
