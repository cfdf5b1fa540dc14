"""The orchestrator's loop: builds the parts and runs steps through them; the parts do
not know it (each gets its config, the run directory, its clients and callbacks).

    GroupSource ──finished groups──► StepSink ──StepFill──► write: rollouts/step_n, StepMetrics row
     (sampler, admission,             (judge, carry over,          Checkpointer (snapshot; part when due)
      Generator)                        errored streak, Teacher)    Evaluator (every eval.interval steps)
          ▲ policy, model                  ▲ policy
    WeightRelay: weights/step_m ──► every server (in the background)
      └ Membership: endpoints/ ──► a joiner loaded with the policy, then in the router and the updates

For step n = start+1 .. max_steps: the sink fills step n from the source (which keeps
groups generating only while the served policy is recent enough for the steps to come:
>= n - async_level), the step is written, checkpointed when due and evaluated when due;
then `rollouts/DONE`. The relay loads every new `weights/step_m` into all servers
meanwhile, and keeps the fleet's membership (servers that join or leave). Between groups the loop is asked whether to stop (`runtime.stopping`; on a
checkpoint request the trainer's step is saved first) and whether the relay still runs.
The heartbeat's progress is a step written, a new policy served (a step trained) or an
eval group finished, never a train group judged: a loop that judges groups forever
without filling a step is a stall for the watchdog.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict
from typing import Any, Mapping, Optional

from loguru import logger

from prime_hpc.config.component import OrchestratorRunConfig, typed
from prime_hpc.config.env_kinds import package_path
from prime_hpc.core import jobenv
from prime_hpc.inference.client import Admin, api_key, discover
from prime_hpc.orchestrator.checkpointer import Checkpointer
from prime_hpc.orchestrator.client import SERVERS_WAIT_S, make_client
from prime_hpc.orchestrator.envs import EnvSampler, EnvSlot, load_slots, route_env_logs
from prime_hpc.orchestrator.envservers import RemoteGenerator, close_servers, fill_rows
from prime_hpc.orchestrator.evaluator import Evaluator
from prime_hpc.orchestrator.fleet import keep_fixed
from prime_hpc.orchestrator.relay import WeightRelay
from prime_hpc.orchestrator.sink import StepFill, StepSink
from prime_hpc.orchestrator.source import GroupSource
from prime_hpc.orchestrator.step_metrics import LoopLag, StepMetrics
from prime_hpc.orchestrator.teacher import Teacher, TeacherAt, locate
from prime_hpc.rundir import BEAT_S, CHECKPOINT_PARTS, RunDir, atomic_write_json
from prime_hpc.rundir.checkpoints import resolve_resume_step


class Orchestrator:
    def __init__(self, cfg: "OrchestratorRunConfig | Mapping[str, Any]") -> None:
        if not isinstance(cfg, OrchestratorRunConfig):
            cfg = typed(OrchestratorRunConfig, cfg, "orchestrator config")
        self.cfg = cfg
        self.ocfg = cfg.orchestrator
        self.run = RunDir(cfg.output_dir)
        self.logs = jobenv.logs_dir()
        self.max_steps = cfg.max_steps
        # sft mode: a teacher generates, the student's policy does not matter
        self.async_level = 10**9 if self.ocfg.training_mode == "sft" else cfg.async_level
        self.job = RunDir(cfg.job_dir) if cfg.job_dir else None  # a run of a job of several runs
        self.checkpoints = Checkpointer(self.run, cfg.ckpt, self.job)
        self.teacher: Optional[Teacher] = None  # opd: the teacher's prompt logprobs (one HTTP client, closed by main)
        self.teacher_at: Optional[TeacherAt] = None  # opd, sft: where the teacher answers (found by main)
        self.progress_at = time.time()  # a step written, a policy served, an eval group finished (heartbeat)
        self.served_envs: list = []  # the env servers started (`env_servers`): what the heartbeat says it waits for there
        self.stop: Any = None  # prime_hpc.runtime.stopping.Stop, installed by main()
        self.stop_code: Optional[int] = None

    def wire(
        self,
        client: Any,
        model: Optional[str],
        admin: Any,
        metrics: Any,
        train: list[EnvSlot],
        evals: list[EnvSlot],
        router: Optional[str] = None,
    ) -> None:
        """The parts, around the runtime handles: the policy `client` (asking for `model`,
        None: the run's), the servers' `admin`, the `metrics` logger, the env slots and the
        `router` whose membership the relay keeps (None: a fixed set of servers)."""
        o, cfg = self.ocfg, self.cfg
        self.relay = relay = WeightRelay(
            self.run,
            admin,
            model or cfg.model.name,
            on_policy=self.progress,
            router=router,
            transport=cfg.weights.transport,
            adapter=self.run.root.name if cfg.job_dir else None,
            job=self.job,
        )
        self.generator = RemoteGenerator(o, cfg.seq_len, client, lambda: relay.model)
        sampler = self.sampler(train)
        self.source = GroupSource(sampler, self.generator, lambda: relay.policy, o, self.async_level, self.max_steps)
        self.loop_lag = LoopLag()
        self.step_metrics = StepMetrics(
            metrics,
            cfg.wandb.log_extras,
            cfg.seed,
            lambda: {
                **relay.gauges(),
                **{f"progress/total_{k}": v for k, v in self.totals().items()},
                **self.loop_lag.take(),
            },
            long_prompts=lambda: getattr(sampler, "dropped", 0),
        )
        at = self.teacher_at
        self.teacher = Teacher(at, lambda: relay.model) if o.training_mode == "opd" and at is not None else None
        self.sink = StepSink(
            o,
            self.async_level,
            self.source,
            policy=lambda: relay.policy,
            teacher=self.teacher,
            stopping=self.stopping,
            unfilled=self.step_metrics.log_unfilled,
            run=self.run,
            logs=self.logs,
            ranks=cfg.trainer_ranks,
            micro_batch_size=cfg.micro_batch_size,
        )
        self.evaluator = Evaluator(o.eval, evals, self.generator, metrics.log if metrics else None, self.progress)

    def sampler(self, train: list[EnvSlot]) -> EnvSampler:
        """The train tasks, by env ratio: the data once when max_steps is null; with
        `max_prompt_len`, without the tasks whose prompt is longer (`prompts`)."""
        cfg, o = self.cfg, self.ocfg
        epochs = 1 if self.max_steps is None else None
        if o.max_prompt_len is None:
            return EnvSampler(train, cfg.seed, epochs)
        from prime_hpc.orchestrator.prompts import LimitedSampler, PromptTokens

        length = PromptTokens.of_model(cfg.model.name, cfg.model.seed, cfg.model.trust_remote_code)
        return LimitedSampler(train, cfg.seed, epochs, o.max_prompt_len, length)

    def restore(self, state: dict) -> None:
        """Continue from a checkpoint's state: its step, totals and sampler position."""
        self.sink.step = int(state["step"])
        self.sink.tokens, self.sink.samples = int(state["totals"]["tokens"]), int(state["totals"]["samples"])
        self.source.started = int(state["totals"]["problems"])
        self.source.sampler.load_state(state["sampler"])
        self.checkpoints.keep(self.sink.step, self.state())

    def state(self) -> dict:
        """What this component's checkpoint of the step just written holds."""
        return {
            "step": self.sink.step,
            "policy": self.relay.policy,
            "totals": self.totals(),
            "sampler": self.source.sampler.state(),
        }

    def totals(self) -> dict:
        """Over the run (a resumed run's include its checkpoint's): tokens and samples
        written, tasks started."""
        return {"tokens": self.sink.tokens, "samples": self.sink.samples, "problems": self.source.started}

    async def main(self) -> dict:
        """Load the envs, resume, find the servers, wire the parts, run; close on every path."""
        from prime_hpc.runtime.metrics import MetricsLogger
        from prime_hpc.runtime.stopping import Stop

        cfg, o = self.cfg, self.ocfg
        pylib = package_path(self.run.private_dir / "envservers")  # where another Python finds prime-hpc's modules
        train = load_slots(o.env, "train", pylib=pylib, where="orchestrator.env")
        evals = load_slots(o.eval.env, "eval", o.eval.num_examples, pylib=pylib, where="orchestrator.eval.env")
        start = resolve_resume_step(self.run, cfg.ckpt.step, CHECKPOINT_PARTS)
        saved = self.checkpoints.load(start) if start is not None else None
        env_logs = route_env_logs(self.logs, {"train": train, "eval": evals}, o.log.vf_level) if self.logs else None
        admin = metrics = teacher_fleet = None
        servers: list = []
        try:
            # one run of several: the job's servers (and its router), this run's adapter on them
            fleet = self.job or self.run
            ep = discover(fleet, cfg.inference_nodes, SERVERS_WAIT_S, self.logs, own_job=cfg.inference_job == "own")
            if o.training_mode in ("opd", "sft"):
                self.teacher_at = locate(o.teacher, self.run, cfg.teacher_nodes, SERVERS_WAIT_S, self.logs)
                if self.teacher_at.fleet is not None:  # the run's own: a restarted server rejoins its router
                    teacher_fleet = asyncio.create_task(
                        keep_fixed(self.run.of_group("teacher"), self.teacher_at.fleet, self.teacher_at.key)
                    )
            admin = Admin(ep.servers, on_lost=lambda server, why: self.relay.server_lost(server, why))
            metrics = MetricsLogger(self.run, "orchestrator", cfg.wandb, run_name=cfg.name, config=asdict(cfg))
            # the membership of a fleet several runs share is not one run's to keep: a fixed set for now
            client, model = self.policy_client(ep)
            servers = self.served_envs = self.env_servers({"train": train, "eval": evals}, ep)
            await fill_rows({"train": train, "eval": evals})
            self.wire(client, model, admin, metrics, train, evals, router=None if cfg.job_dir else ep.router)
            if saved is not None:
                self.restore(saved)
            if start is not None and self.run.has_weights(start):
                await self.relay.serve(start)
            if self.relay.members is not None:
                self.relay.members.start_with(ep.server_records, self.relay.policy)
            metrics.follow("trainer", start or 0)  # one W&B run: the trainer's rows go in through this logger
            logger.info(
                f"orchestrator: {len(train)} train env(s), {len(evals)} eval env(s), router {ep.router}, "
                f"{len(ep.servers)} server(s), steps {(start or 0) + 1}..{self.max_steps}"
                + (
                    f", teacher {self.teacher_at.model or 'the served model'} at {self.teacher_at.url}"
                    if self.teacher_at
                    else ""
                )
            )
            # from here on SIGTERM means: stop at a safe point (maybe checkpoint, when the job's supervisor asks)
            self.stop = Stop(self.run, control=self.job)
            await self.loop(start or 0, eval_first=start is None and o.eval.at_start and bool(self.evaluator.interval))
            if self.stop_code is None:
                await self.step_metrics.wait_for_trainer(self.run, self.sink.step)  # its last rows, into W&B
        finally:
            if metrics is not None:
                metrics.close()
            if admin is not None:
                await admin.aclose()
            if self.teacher is not None:
                await self.teacher.aclose()
            if teacher_fleet is not None:  # keeps the teacher's membership until the run ends
                teacher_fleet.cancel()
                await asyncio.gather(teacher_fleet, return_exceptions=True)
            close_servers(servers)
            if env_logs is not None:
                env_logs.close()
        return {"last_step": self.sink.step, "policy": self.relay.policy, **self.totals()}

    def policy_client(self, ep: Any) -> tuple[Any, Optional[str]]:
        """What generation goes through, and the model name to ask for (None: the run's):
        the router; in sft the teacher (it generates, the student trains on it)."""
        cfg, at, timeout_s = self.cfg, self.teacher_at, self.ocfg.generation_timeout_s
        if self.ocfg.training_mode == "sft" and at is not None:
            return make_client(at.url, at.key, max_context=cfg.seq_len, timeout_s=timeout_s), at.model
        return make_client(ep.openai_base_url, api_key(), max_context=cfg.seq_len, timeout_s=timeout_s), None

    def env_servers(self, slots: dict[str, list[EnvSlot]], ep: Any) -> list:
        """The env servers of the entries with `workers` >= 1 (`prime_hpc.envserver`), their
        workers asking the same endpoint as `policy_client`."""
        from prime_hpc.orchestrator.envservers import start_for

        at = self.teacher_at
        sft = self.ocfg.training_mode == "sft" and at is not None
        base, key = (at.url, at.key) if sft and at is not None else (ep.openai_base_url, None)
        return start_for(slots, self.run, self.logs or self.run.root / "logs", self.cfg, base, policy_key=key)

    async def loop(self, start: int, eval_first: bool = False) -> None:
        """Evaluate the starting policy as step 0 when `eval_first` (under the heartbeat,
        like the steps), then fill and write steps start+1 .. max_steps (or until the train
        data is used once when max_steps is null), then write `rollouts/DONE`. Stops early,
        without DONE, when asked to (`prime_hpc.runtime.stopping`): after checkpointing the
        trainer's step if the supervisor wants a checkpoint."""
        self.relay.start()
        self.progress()
        beats = asyncio.create_task(self.heartbeat())
        lag = asyncio.create_task(self.loop_lag.run())
        step = start + 1
        try:
            if eval_first:
                await self.evaluator.run(0)  # the base policy, before any update
            while self.max_steps is None or step <= self.max_steps:
                filled = await self.sink.fill(step)
                if filled is None:
                    break
                await self.write_step(step, filled)
                self.checkpoints.after_step(step, step == self.max_steps)
                await self.evaluator.start_if_due(step)
                step += 1
            if self.stop_code is not None:
                await self.stop_now()
                return
            await self.evaluator.wait()
            self.checkpoints.at_end(self.sink.step, start, self.max_steps)  # the data ran out: the final step
            atomic_write_json(self.run.rollouts_done, {"last_step": self.sink.step})
            logger.info(f"last step written: {self.sink.step} ({self.run.rollouts_done})")
        finally:
            beats.cancel()
            lag.cancel()
            await asyncio.gather(
                beats, lag, self.relay.aclose(), self.source.aclose(), self.evaluator.aclose(), return_exceptions=True
            )
            self.beat(done=True)

    async def write_step(self, step: int, fill: StepFill) -> None:
        """The step's batch and totals, the snapshot a checkpoint of it holds, its metrics
        row, the heartbeat. The batch is written off the event loop: its files (and, on the
        first step, importing torch) take seconds under load, which the heartbeat and the
        groups in flight must not wait for."""
        samples = await asyncio.to_thread(self.sink.write, step, fill)
        self.checkpoints.keep(step, self.state())
        row = self.step_metrics.log_step(step, fill, fill.kept)
        self.progress()
        self.beat()
        logger.info(
            f"step {step}: {samples} samples, reward {row.get('reward/all/mean', 0):.3f}, "
            f"policy {self.relay.policy}, waited {fill.t_wait:.2f}s for weights"
        )

    # ------------------------------------------------------------------ stopping
    async def stopping(self) -> Optional[int]:
        """Between groups: raises when the relay stopped; the stop code once a stop is
        decided (waits briefly after a SIGTERM for the supervisor's decision), else None."""
        from prime_hpc.runtime.stopping import CONTINUE

        self.relay.check()
        if self.stop is None or not self.stop.pending():
            return None
        code = await asyncio.to_thread(self.stop.decision)
        if code == CONTINUE:
            return None
        self.stop_code = code
        return code

    async def stop_now(self) -> None:
        """Asked to stop: on CHECKPOINT save this component's part of the step the trainer saves."""
        from prime_hpc.runtime.stopping import CHECKPOINT

        if self.stop_code == CHECKPOINT:
            await self.checkpoints.save_requested(self.stop.reason())
        else:
            logger.info(f"stopping at step {self.sink.step} (SIGTERM)")

    # ------------------------------------------------------------------ heartbeat
    def progress(self) -> None:
        self.progress_at = time.time()

    async def heartbeat(self) -> None:
        """`heartbeats/orchestrator_0` every `BEAT_S` from the event loop: the step, the
        last time it made progress (`progress_at`), whether it is only waiting for the
        trainer's weights, which the watchdog does not count as a stall of its own, and the
        groups out at env servers (`env_waits`: a stall while one has been out that long is
        the server's, and the watchdog names it and its log)."""
        while True:  # a loop held long enough to delay this is said by `LoopLag`
            self.beat()
            await asyncio.sleep(BEAT_S)

    def beat(self, **info: Any) -> None:
        self.run.beat(
            "orchestrator",
            0,
            step=self.sink.step,
            policy=self.relay.policy,
            progress_at=self.progress_at,
            waiting_on="trainer"
            if self.sink.waiting_for_trainer()
            else "inference"
            if self.source.waiting_for_inference()
            else None,
            env_waits=[w for s in self.served_envs if (w := s.waited()) is not None],
            **info,
        )

    # ------------------------------------------------------------------ checkpoints, by step (scripts and tests)
    @property
    def snapshots(self) -> dict[int, dict]:
        return self.checkpoints.snapshots

    def save_checkpoint(self, step: int) -> None:
        self.checkpoints.save(step)
