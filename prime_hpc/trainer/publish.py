"""How the RL trainer hands each new policy to inference (`weights.transport`).

- `filesystem`: rank 0 writes the full weights to `weights/step_<n>` every step; the
  orchestrator's relay loads them into every server.
- `broadcast`: rank 0 sends them to every server itself (`prime_hpc.trainer.sender`, in
  the background while the next step trains) and writes only a marker,
  `sent/step_<n>.json` (`model.write_marker`: it tells the orchestrator that policy n is on
  its way), with the full weights in `weights/step_<n>` at the checkpointed steps, the
  weights-only snapshot steps (`ckpt.weights_only`, `ckpt.weights.interval`) and the last one
  (`rundir.checkpoints.full_weights_due`), and at any step a checkpoint is saved at
  otherwise (`ensure_full`: a stop on request, an early end), so eval, a resume and uploads
  always find weights on disk next to a checkpoint.

Every rank calls `publish` (gathering the full state dict is a collective); the decision
of what to write depends only on the config and the step, so the ranks agree.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Optional

from prime_hpc.rundir.checkpoints import full_weights_due

if TYPE_CHECKING:
    from prime_hpc.trainer.runner import Session
    from prime_hpc.trainer.sender import WeightSender

BROADCAST_INFO = {"transport": "broadcast"}
FINAL_SEND_S = 120.0  # longest the trainer's end waits for its last policy to reach the servers


def refusal(transport: str, device: str, hf_config: Any) -> Optional[str]:
    """Why this run cannot send its policies by broadcast (one line), or None. A model that
    ties its input and output embeddings cannot be updated in place by CPU vLLM: its
    servers refuse every policy, and the run would go on with none of them serving."""
    if transport == "broadcast" and device == "cpu" and getattr(hf_config, "tie_word_embeddings", False):
        return (
            "weights.transport=broadcast: this model ties its input and output embeddings, which CPU vLLM "
            "cannot update in place; use a model with tie_word_embeddings=false"
        )
    return None


class Publisher:
    def __init__(self, s: "Session") -> None:
        self.transport = s.cfg.weights.transport
        why = refusal(self.transport, s.cfg.device, s.policy.hf_config)
        if why is not None:
            from prime_hpc.core.errors import UserError

            raise UserError(why)
        self.start = s.start_step
        self.full: set[int] = set()  # steps whose full weights this run wrote
        self.sender: Optional[WeightSender] = None
        if self.transport == "broadcast" and s.env.is_main:
            from prime_hpc.core.errors import UserError
            from prime_hpc.inference.broadcast import broadcaster_for
            from prime_hpc.inference.client import API_KEY_VAR, api_key
            from prime_hpc.trainer.sender import WeightSender

            if not api_key():
                raise UserError(
                    f"weights.transport=broadcast: {API_KEY_VAR} is not set: the servers take weights only with it"
                )

            self.sender = WeightSender(
                s.run,
                make=broadcaster_for(s.cfg.device, s.env.device, store_dir=s.run.rendezvous_dir),
                write=lambda step, hf: write_refused(s, step, hf),
            )

    def publish(self, s: "Session", step: int, final: bool) -> dict[str, float]:
        """Hand policy `step` on; the step's timers (`time/save_weights`: the gather and
        what was written; with broadcast also the wait for the previous send and its
        numbers)."""
        from prime_hpc.trainer import runner

        full = full_weights_due(step, final, s.cfg.ckpt, self.transport)
        if self.transport != "broadcast":
            self.full.add(step)
            return {"time/save_weights": runner.save_weights(s, step)}
        from prime_hpc.trainer.model import full_state_dict, hf_weights, write_marker, write_weights

        t0 = time.perf_counter()
        sd = full_state_dict(s.policy.model)
        timers: dict[str, float] = {}
        if self.sender is not None:
            hf = hf_weights(s.policy, sd, own=True)
            timers.update(send_metrics(self.sender.stats()))
            timers["weights/broadcast_behind"] = float(len(self.sender.behind()))
            if full:
                serve_adapter = bool(s.cfg.ckpt.weights.save_adapter_separately)
                write_weights(s.run, step, s.policy, sd, serve_adapter=serve_adapter, info=BROADCAST_INFO, hf=hf)
            else:
                write_marker(s.run, step)
            del sd
            self.sender.publish(step, hf)
        if full:
            self.full.add(step)
        timers["time/save_weights"] = time.perf_counter() - t0
        return timers

    def ensure_full(self, s: "Session", step: int) -> None:
        """A checkpoint is (being) saved at `step`: its full weights must be on disk too."""
        if self.transport == "broadcast" and step > self.start and step not in self.full:
            from prime_hpc.trainer import runner

            runner.save_weights(s, step, info=BROADCAST_INFO)
            self.full.add(step)

    def wait(self) -> None:
        """Before the trainer ends: the newest policy reaches every server it can, for at
        most `FINAL_SEND_S` (a server whose sender vanishes midway has half its weights,
        and restarts)."""
        if self.sender is not None and not self.sender.wait(FINAL_SEND_S):
            from loguru import logger

            logger.warning(
                f"weights: the last policy had not reached {', '.join(self.sender.behind())} after "
                f"{FINAL_SEND_S:g}s; the trainer ends without waiting longer"
            )

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()


def write_refused(s: "Session", step: int, hf: dict) -> None:
    """`weights/step_<step>` from the policy as it was sent (the merged HF tensors), for a
    server that refused it by broadcast (what arrived differed from its digests): it loads
    them in its place. Runs in the sender's thread: the config is a copy of its own."""
    import copy
    import dataclasses

    from prime_hpc.trainer.model import write_weights

    pol = dataclasses.replace(s.policy, hf_config=copy.deepcopy(s.policy.hf_config), lora_config=None)
    write_weights(s.run, step, pol, {}, info=BROADCAST_INFO, hf=hf)


def send_metrics(last: dict) -> dict[str, float]:
    """The newest delivery's numbers as metrics (of a policy before the step's own:
    seconds from its publish to the last server that got it, and how many did)."""
    if not last:
        return {}
    return {
        "time/weight_broadcast": float(last.get("seconds", 0.0)),
        "time/weight_broadcast_drain": float(last.get("drain", 0.0)),
        "time/weight_broadcast_load": float(last.get("load", 0.0)),
        "weights/broadcast_servers": float(last.get("servers", 0)),
    }
