"""RL trainer: `torchrun ... -m prime_hpc.trainer.rl --config <output_dir>/configs/trainer.yaml`.

Step n (n = 1, 2, ...; policy 0 is the base model, resume from N continues at N+1):

1. wait for `rollouts/step_n/STABLE` and read this rank's `rank_<r>.pt` (`prime_hpc.rundir.batch`);
   give up after `trainer.rollout_timeout_s` naming the orchestrator's log; stop cleanly
   when `rollouts/DONE` says the orchestrator wrote its last step before n;
2. pack this rank's samples into rows of up to `seq_len` tokens and micro-batches of at
   most `trainer.micro_batch_tokens` (`prime_hpc.rundir.batch.pack`; every rank runs as
   many as the rank with the most); forward/backward every micro-batch with the objective
   of `trainer.loss`
   (`prime_hpc.trainer.loss`; NLL when the step's info says `mode: sft`), normalised by
   the step's loss tokens over all ranks; clip the gradient norm; optimizer and LR-schedule
   step. Logits are divided by `temperature` from the step's info (default 1: vLLM
   returns raw, untempered logprobs unless asked for processed ones);
3. rank 0 writes `weights/step_n` (HF safetensors + config + tokenizer, `STABLE` last;
   with `weights.transport=broadcast` it sends the policy to every server in the
   background instead and writes `sent/step_n.json`, the weights only at checkpoints and
   the last step: `prime_hpc.trainer.publish`), then, once every rank has read its file, removes
   `rollouts/step_n`;
4. with `trainer.loss.target_kl`, the reference KL's weight for the next step
   (`loss.KLController`, kept in the checkpoint's state); checkpoint when due
   (`prime_hpc.trainer.ckpt`); drop weights the orchestrator no longer needs
   (`runner.prune_weights`); one metrics line; heartbeat.

It ends after step `max_steps` (or at `rollouts/DONE`); the last step's weights stay, and
the heartbeat of every rank says `{"step": n, "done": true}`.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Sequence

from prime_hpc.config.component import TrainerRunConfig
from prime_hpc.rundir import BEAT_S, CHECKPOINT_PARTS, RunDir, is_stable, read_json, stable_time, wait_for
from prime_hpc.trainer import distributions, runner
from prime_hpc.trainer.publish import Publisher
from prime_hpc.trainer.runner import Session

if TYPE_CHECKING:
    import torch.nn as nn

    from prime_hpc.config.schema import LossConfig
    from prime_hpc.rundir.batch import RolloutBatch
    from prime_hpc.runtime.stopping import Stop
    from prime_hpc.trainer.dist import DistEnv
    from prime_hpc.trainer.engine import StepResult
    from prime_hpc.trainer.loss import KLController


PROG = "python -m prime_hpc.trainer.rl"


def rollouts_done_before(run: RunDir, step: int) -> bool:
    """True when the orchestrator declared that its last step is before `step`."""
    try:
        return int(read_json(run.rollouts_done)["last_step"]) < step
    except (OSError, ValueError, KeyError, TypeError):
        return False


def wait_for_rollouts(
    run: RunDir,
    step: int,
    timeout_s: float,
    producer_log: Optional[os.PathLike | str],
    on_wait: Optional[Callable[[], None]] = None,
    beat_every_s: float = 30.0,
    stop: Optional[Stop] = None,
) -> str:
    """Block until step `step`'s rollouts are complete ("ready"), the orchestrator is done
    before it ("done"), or something asks this trainer to stop ("stop"). `on_wait` is
    called every `beat_every_s` while waiting (heartbeat)."""
    last = [time.monotonic()]

    def ready() -> Optional[str]:
        if is_stable(run.rollout_step(step)):
            return "ready"
        if stop is not None and stop.pending():
            return "stop"
        if on_wait is not None and time.monotonic() - last[0] >= beat_every_s:
            on_wait()
            last[0] = time.monotonic()
        return "done" if rollouts_done_before(run, step) else None

    # polled at most every 0.02 s: at async_level 1 the trainer waits for every batch, and
    # each poll of its wait is latency of the step (a few stat calls per poll)
    return wait_for(
        ready,
        what=f"rollouts of step {step} ({run.rollout_step(step)}/STABLE)",
        timeout_s=timeout_s,
        producer="orchestrator",
        producer_log=producer_log,
        poll_max_s=0.02,
    )


def samples_of(mb) -> tuple:
    """(sample_index, samples) of a micro-batch for `loss.sample_sums`: packed rows say
    each token's sample; right-padded rows are a sample each (index None)."""
    return mb.get("sample_index"), int(mb["policy_steps"].shape[0])


def trained_samples(mb):
    """[S] bool: the samples with at least one loss token."""
    from prime_hpc.trainer.loss import sample_sums

    index, n = samples_of(mb)
    return sample_sums(mb["loss_mask"].float(), index, n) > 0


def spanning_sums(logprobs, mb) -> dict:
    """Of the samples generated across a weight update (`policy_spans` > 1): how many, their
    loss tokens and the sum of their tokens' mismatch KL."""
    import torch

    from prime_hpc.trainer.loss import k3, to_tokens

    spans = mb.get("policy_spans")
    if spans is None:  # a batch of an older run
        spans = torch.ones_like(mb["policy_steps"])
    rows = (spans > 1) & trained_samples(mb)
    mask = mb["loss_mask"] & to_tokens(rows, samples_of(mb)[0])
    kl = torch.where(mask, k3(logprobs.detach(), mb["inference_logprobs"]), torch.zeros_like(logprobs))
    return {
        "spanning_samples": rows.sum().float(),
        "spanning_tokens": mask.sum().to(logprobs.dtype),
        "spanning_mismatch_kl": kl.sum(),
    }


def add_env_index(micro_batches: list[dict], envs: Sequence[str]) -> None:
    """Give each micro-batch `env_index` ([S] int64): the position of each sample's
    environment (its `envs`) in the step's `envs`, len(envs) for one not among them; made
    on the host before the step, so that the step reads nothing back for it."""
    import torch

    at = {name: i for i, name in enumerate(envs)}
    for mb in micro_batches:
        names = mb.get("envs", [])
        mb["env_index"] = torch.tensor([at.get(str(e), len(envs)) for e in names], dtype=torch.long)


def kl_sums(logprobs, mb) -> dict:
    """Of the mismatch KL over the loss tokens, beside its sum (the loss's `mismatch_kl`):
    the sum of its squares and its largest value (`mismatch_kl/max`, kept as the largest
    by the engine)."""
    import torch

    from prime_hpc.trainer.loss import k3

    kl = torch.where(mb["loss_mask"], k3(logprobs.detach(), mb["inference_logprobs"]), torch.zeros_like(logprobs))
    return {"mismatch_kl_sq": (kl * kl).sum(), "mismatch_kl/max": kl.max()}


def env_sums(logprobs, mb, envs: Sequence[str], kl: bool) -> dict:
    """Per environment of the step (`envs`; the samples' `env_index`): its loss tokens
    (`env/<name>/tokens`), the sum of their entropies (`env/<name>/entropy`, from the
    engine's `entropy`) and, with `kl`, of their mismatch KL, its squares and its largest
    value (`env/<name>/mismatch_kl`, `.../mismatch_kl_sq`, `.../mismatch_kl/max`). Every
    micro-batch gives every key (the engine sums them over ranks by name)."""
    import torch

    from prime_hpc.trainer.loss import k3, to_tokens

    if not envs:
        return {}
    loss_mask = mb["loss_mask"]
    zeros = torch.zeros_like(logprobs.detach())
    ent = mb.get("entropy")
    ent = zeros if ent is None else ent.detach()
    token_env = to_tokens(mb["env_index"], samples_of(mb)[0])
    per_token = torch.where(loss_mask, k3(logprobs.detach(), mb["inference_logprobs"]), zeros) if kl else None
    out = {}
    for e, name in enumerate(envs):
        mask = loss_mask & (token_env == e)
        out[f"env/{name}/tokens"] = mask.sum().to(torch.float64)
        out[f"env/{name}/entropy"] = torch.where(mask, ent, zeros).sum()
        if per_token is not None:
            kle = torch.where(mask, per_token, zeros)
            out[f"env/{name}/mismatch_kl"] = kle.sum()
            out[f"env/{name}/mismatch_kl_sq"] = (kle * kle).sum()
            out[f"env/{name}/mismatch_kl/max"] = kle.max()
    return out


def make_loss_fn(
    loss_cfg: LossConfig,
    step: int,
    mode: str,
    compile: bool = False,
    envs: Sequence[str] = (),
    ref_kl_coef: Optional[float] = None,
):
    """The step's objective. `mode` is the orchestrator's training mode recorded in the
    step's info: `rl` and `opd` (per-token advantages log p_teacher - log p_student) use
    the RL objective; `sft` (completions generated by a teacher, so there is no sampling
    policy of ours to correct for) uses the token-level NLL of the completions. `compile`:
    the RL objective's arithmetic compiled (`trainer.model.compile`). `envs`: the step's
    environments (`RolloutBatch.envs`), whose figures come apart (`env_sums`; the
    micro-batches need their `env_index`: `add_env_index`). `ref_kl_coef`: the step's
    weight of the reference KL (`loss.KLController`); None: `loss_cfg.ref_kl_coef`."""
    from prime_hpc.trainer.loss import rl_loss, sft_loss

    def loss_fn(lp, mb, normalizer):
        if mode == "sft":
            out = sft_loss(lp, mb["loss_mask"], normalizer)
        else:
            index, n = samples_of(mb)
            out = rl_loss(
                lp,
                mb["inference_logprobs"],
                mb["advantages"],
                mb["loss_mask"],
                loss_cfg,
                normalizer,
                ref_logprobs=mb.get("ref_logprobs"),
                sample_index=index,
                num_samples=n,
                compile=compile,
                ref_kl_coef=ref_kl_coef,
            )
        lag = (step - 1 - mb["policy_steps"]).clamp(min=0)
        out.sums["off_policy_steps"] = (lag * trained_samples(mb)).sum().float()
        if mode != "sft":  # the mismatch KL of samples an update came in the middle of, apart
            out.sums.update(spanning_sums(lp, mb))
            out.sums.update(kl_sums(lp, mb))
        out.sums.update(env_sums(lp, mb, envs, kl=mode != "sft"))
        return out

    return loss_fn


def train(cfg: TrainerRunConfig) -> None:
    """Steps start+1 .. max_steps (or until `rollouts/DONE`), each read top to bottom:
    wait for the batch, read it, train on it, publish the weights, checkpoint, log."""
    from loguru import logger

    from prime_hpc.runtime.stopping import CHECKPOINT, CONTINUE, Stop

    with runner.session(cfg, CHECKPOINT_PARTS) as s, _publisher(s) as pub:
        stop = Stop(s.run)
        step = s.start_step
        progress = dict((s.resumed or {}).get("progress", {"num_tokens": 0, "num_samples": 0}))
        producer_log = runner.orchestrator_log()
        reference = _reference_policy(cfg, s.env)
        kl = _kl_controller(s)
        runner.beat(s, step)
        while cfg.max_steps is None or step < cfg.max_steps:
            t0, waiting_since = time.perf_counter(), time.time()
            got = _wait_for_batch(s, stop, step + 1, producer_log)
            code, finished = runner.agreed_stop(s, stop, not_ready=got != "ready")
            if code != CONTINUE:
                if code == CHECKPOINT:
                    pub.ensure_full(s, step)
                runner.stop_here(s, step, code, {"progress": progress, **kl.state()})
                return
            if finished:
                logger.info(f"the orchestrator wrote its last rollouts before step {step + 1} ({s.run.rollouts_done})")
                break
            step += 1
            data, timers = _read_batch(s, step, producer_log, waiting_since)
            t_wait = time.perf_counter() - t0
            coef = kl.coef  # this step's; the next one's once its reference KL is known
            result = _train_on(s, data, step, reference, coef)
            kl.update(ref_kl_mean(result.sums))
            timers.update(_publish(s, pub, step))
            t_ckpt = _checkpoint_and_prune(s, step, result, progress, kl.state())
            log_step(
                s,
                step,
                result,
                time.perf_counter() - t0,
                t_wait,
                t_ckpt,
                progress,
                timers,
                ref_kl_coef=coef if "ref_kl" in result.sums else None,  # the penalty was in the step's loss
            )
            runner.beat(s, step)
        _finish(s, pub, step, progress, kl.state())
        logger.info(f"done at step {step}")


@contextlib.contextmanager
def _publisher(s: Session) -> Iterator[Publisher]:
    """How each policy reaches inference (`weights.transport`); its sender stopped on every path."""
    pub = Publisher(s)
    try:
        yield pub
    finally:
        pub.close()


def _reference_policy(cfg: TrainerRunConfig, env: DistEnv) -> Optional[nn.Module]:
    """The frozen initial policy for the KL penalty (`trainer.loss.ref_kl_coef` > 0), else None."""
    if cfg.trainer.loss.ref_kl_coef <= 0:
        return None
    from prime_hpc.trainer.model import build_reference

    return build_reference(cfg, env.mesh)


def _kl_controller(s: Session) -> KLController:
    """The reference KL's weight (`trainer.loss.ref_kl_coef`, adapted toward
    `trainer.loss.target_kl` when set), a resumed run's from its checkpoint."""
    from prime_hpc.trainer.loss import KLController

    where = str(s.run.checkpoint_part(s.start_step, "trainer") / "state.json")
    return KLController.start(s.cfg.trainer.loss, s.resumed, where=where)


def ref_kl_mean(sums: dict[str, float]) -> Optional[float]:
    """The step's reference KL per loss token (all ranks), None when it was not measured."""
    if "ref_kl" not in sums:
        return None
    return sums["ref_kl"] / max(sums["tokens"], 1.0)


def _wait_for_batch(s: Session, stop: Stop, step: int, producer_log: Optional[os.PathLike | str]) -> str:
    """Wait for step `step`'s rollouts ("ready"), the orchestrator's end ("done") or a stop
    request ("stop"), beating as waiting on the orchestrator."""
    return wait_for_rollouts(
        s.run,
        step,
        s.cfg.trainer.rollout_timeout_s,
        producer_log,
        on_wait=lambda: runner.beat(s, step - 1, progress=False, waiting_for=step, waiting_on="orchestrator"),
        beat_every_s=BEAT_S,
        stop=stop,
    )


def _read_batch(
    s: Session, step: int, producer_log: Optional[os.PathLike | str], waiting_since: float
) -> tuple[RolloutBatch, dict]:
    """This rank's rollout file of `step`, and the hand-off timers. The hand-off is the
    time from the rollouts being marked complete to the trainer seeing them, counted only
    while the trainer was waiting for them (a batch that was ready before the trainer
    asked for it cost the step nothing)."""
    from prime_hpc.rundir import batch as rollout_batch

    handoff = max(0.0, time.time() - max(stable_time(s.run.rollout_step(step)), waiting_since))
    t_read = time.perf_counter()
    data = rollout_batch.read_rank(
        s.run, step, s.env.rank, timeout_s=s.cfg.trainer.rollout_timeout_s, producer_log=producer_log
    )
    return data, {"time/rollout_handoff": handoff, "time/read_batch": time.perf_counter() - t_read}


def _train_on(
    s: Session, data: RolloutBatch, step: int, reference: Optional[nn.Module], ref_kl_coef: float
) -> StepResult:
    """One optimizer step on the batch (its samples packed: `runner.packed`), with the
    objective its info asks for (the reference KL weighted by `ref_kl_coef`)."""
    mode = str(data.info.get("mode", "rl"))
    loss_fn = make_loss_fn(s.cfg.trainer.loss, step, mode, s.policy.compiled, envs=data.envs, ref_kl_coef=ref_kl_coef)
    temperature = float(data.info.get("temperature", 1.0))
    micro_batches = runner.packed(s, data.micro_batches)
    if data.envs:
        add_env_index(micro_batches, data.envs)
    if reference is not None:
        s.engine.add_reference_logprobs(reference, micro_batches, temperature)
    return distributions.logged(
        s, step, lambda: s.engine.train_step(micro_batches, loss_fn, temperature=temperature, step=step)
    )


def _publish(s: Session, pub: Publisher, step: int) -> dict[str, float]:
    """Write `weights/step_<step>` (or send the policy and write its marker); once every
    rank has read its rollouts, rank 0 removes them. The timers of the hand-off."""
    from prime_hpc.rundir import batch as rollout_batch
    from prime_hpc.trainer.dist import barrier

    timers = pub.publish(s, step, final=s.cfg.max_steps is not None and step == s.cfg.max_steps)
    barrier()  # every rank has read its rollout file
    if s.env.is_main:
        rollout_batch.remove_step(s.run, step)
    return timers


def _checkpoint_and_prune(s: Session, step: int, result: StepResult, progress: dict, extra: dict) -> float:
    """Count the step's progress, checkpoint when due (`extra`: more of the trainer's
    state to keep, the adaptive KL coefficient), drop weights no step can use any more.
    Seconds spent checkpointing."""
    progress["num_tokens"] += int(result.sums["num_tokens"])
    progress["num_samples"] += int(result.sums["num_samples"])
    final = s.cfg.max_steps is not None and step == s.cfg.max_steps
    _, t_ckpt = runner.checkpoint_if_due(s, step, final, {"progress": progress, **extra})
    if s.env.is_main:
        runner.prune_weights(s.run, step, s.cfg.async_level, s.cfg.ckpt)
    return t_ckpt


def _finish(s: Session, pub: Publisher, step: int, progress: dict, extra: dict) -> None:
    """After the last step: its full weights and its checkpoint if the data ended early,
    the last policy sent, background saves done, weights pruned, the heartbeat says done."""
    pub.ensure_full(s, step)  # the last step's weights stay on disk whatever the transport
    if step > s.start_step and s.cfg.ckpt.enabled and not s.cfg.ckpt.weights_only and step not in s.ckpt.requested:
        s.ckpt.save(step, s.engine, {"progress": progress, **extra})  # stopped early at rollouts/DONE
    pub.wait()
    s.ckpt.wait()
    if s.env.is_main:  # a background save may have rotated a checkpoint away just now
        runner.prune_weights(s.run, step, s.cfg.async_level, s.cfg.ckpt)
    runner.beat(s, step, done=True)


def log_step(
    s: Session,
    step: int,
    result: StepResult,
    t_step: float,
    t_wait: float,
    t_ckpt: float,
    progress: dict,
    timers: dict,
    ref_kl_coef: Optional[float] = None,
) -> None:
    """The step's metrics row (rank 0's logger) and its one log line (every rank); a run of
    several on one trainer logs into its own `metrics/trainer.jsonl` through its session.
    `ref_kl_coef`: the reference KL's weight in the step (`loss/ref_kl_coef`), when on."""
    from loguru import logger

    sums = result.sums
    tok = max(sums["tokens"], 1.0)
    m = runner.step_metrics(s, result, t_step, t_wait)
    m.update(scoped_metrics(sums))
    if "ref_kl" in sums:
        m["ref_kl/mean"] = sums["ref_kl"] / tok
    if ref_kl_coef is not None:
        m["loss/ref_kl_coef"] = ref_kl_coef
    if "mismatch_kl" in sums:  # not in training_mode=sft (teacher completions, NLL)
        m.update(
            {
                "mismatch_kl/mean": sums["mismatch_kl"] / tok,
                "masked_advantage_positive/mean": sums["masked_positive"] / tok,
                "masked_advantage_negative/mean": sums["masked_negative"] / tok,
                # samples an update in flight came in the middle of: how many, and their mismatch KL apart
                "off_policy/spanning_samples": sums.get("spanning_samples", 0.0),
            }
        )
        if sums.get("spanning_tokens"):
            m["mismatch_kl/spanning/mean"] = sums["spanning_mismatch_kl"] / sums["spanning_tokens"]
    m.update(
        {
            "off_policy_steps/mean": sums["off_policy_steps"] / max(sums["num_samples"], 1.0),
            "time/save_ckpt": t_ckpt,
            "progress/num_tokens": progress["num_tokens"],
            "progress/num_samples": progress["num_samples"],
            **timers,
        }
    )
    if s.metrics is not None:
        s.metrics.log(step, m)
    logger.info(
        f"step {step} | loss {m['loss/mean']:.4f} | mismatch_kl {m.get('mismatch_kl/mean', 0.0):.2e} | "
        f"grad_norm {m['optim/grad_norm']:.3f} | lr {m['optim/lr']:.2e} | {t_step:.2f}s "
        f"(waited {t_wait:.2f}s) | {m['perf/throughput']:.0f} tok/s"
    )


def scoped_metrics(sums: dict[str, float]) -> dict[str, float]:
    """`entropy/<scope>/mean` and (RL) `mismatch_kl/<scope>/{mean,std,max}` over the loss
    tokens of the step (`all`) and of each environment with some (`env_sums`); the std is
    that of the tokens' values."""
    out: dict[str, float] = {}
    scopes = [("all", "")]
    scopes += [(k[4:-7], k[:-6]) for k in sorted(sums) if k.startswith("env/") and k.endswith("/tokens")]
    for scope, prefix in scopes:
        n = sums[prefix + "tokens"]
        if scope != "all" and not n:
            continue
        n = max(n, 1.0)
        out[f"entropy/{scope}/mean"] = sums[prefix + "entropy"] / n
        if prefix + "mismatch_kl" in sums:
            mean = sums[prefix + "mismatch_kl"] / n
            var = max(sums.get(prefix + "mismatch_kl_sq", 0.0) / n - mean * mean, 0.0)
            out[f"mismatch_kl/{scope}/mean"] = mean
            out[f"mismatch_kl/{scope}/std"] = math.sqrt(var)
            out[f"mismatch_kl/{scope}/max"] = sums.get(prefix + "mismatch_kl/max", 0.0)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    return runner.main(train, PROG, "RL trainer: trains on rollouts/step_<n>, writes weights/step_<n>.", argv)


if __name__ == "__main__":
    raise SystemExit(main())
