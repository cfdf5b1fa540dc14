"""Several RL runs on one trainer: `torchrun ... -m prime_hpc.trainer.multirun --config
<job>/configs/trainer.yaml` with `trainer.max_concurrent_runs` = K > 1.

The job's trainer config gives what the runs share: the base model, the LoRA shape (rank,
alpha, target modules), K, the device and the ranks. Each run is a directory of the job,
`runs/<name>/`, with the layout of a run directory (`RunDir.sub_run`) and its own
`configs/trainer.yaml` (optimizer, schedule, loss, `max_steps`, `async_level`, checkpoints,
resume step); a run is there once that file is (written atomically). The trainer holds one
LoRA adapter slot per run it trains (`lora.SlotLoRALinear`: K adapters side by side on the
one base model, sharded with it) and for each run its own optimizer and LR schedule over
its slot alone (`Engine(params=...)`), step counter, progress, checkpoints
(`runs/<name>/checkpoints/step_<n>/trainer/`, the layout and names of a run trained alone:
a run's adapter, optimizer and schedule, nothing of the others), metrics
(`runs/<name>/metrics/trainer.jsonl`) and heartbeat.

The loop, every rank in step (rank 0 decides, `broadcast_object_list` tells the others):

1. runs that appeared in `runs/` take a free slot (at most K at once), first come first
   served (by when their trainer config was written, then by name); a run whose base model or LoRA shape differs from the job's is refused
   in one line (its `control/failed_trainer.json`, the trainer's log) and the others go on;
   a run whose config says `ckpt.step` resumes from its own checkpoint;
2. among the runs holding a slot, the next (round robin) whose rollouts of its next step are
   complete (`rollouts/step_<n>/STABLE` in its directory) trains that step with its own
   adapter active, exactly as `prime_hpc.trainer.rl` trains a run's step; then its adapter
   goes to `runs/<name>/weights/step_<n>/adapter/` (`STABLE` says `serve: adapter`: the
   servers load it under the run's name), its rollouts are removed, its checkpoint saved
   when due;
3. a run that reached its `max_steps` (or its orchestrator's `rollouts/DONE`, or whose
   orchestrator failed: `run.json` FAILED, written by the job's head) writes its last weights (the adapter and the merged model, what eval and a later SFT or RL run
   load) and its checkpoint, and frees its slot for the next run;
4. the trainer ends once every run of `runs/` has ended and none is waiting; a stop request
   (SIGTERM, the supervisor's checkpoint request) checkpoints every run holding a slot at
   the step it is at.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from prime_hpc.core.errors import UserError
from prime_hpc.rundir import BEAT_S, CHECKPOINT_PARTS, RunDir, atomic_write_json, is_stable, runs
from prime_hpc.trainer import distributions, lora, runner
from prime_hpc.trainer.engine import Diverged, Engine

if TYPE_CHECKING:
    from prime_hpc.config.component import TrainerRunConfig
    from prime_hpc.rundir.batch import RolloutBatch
    from prime_hpc.runtime.metrics import MetricsLogger
    from prime_hpc.trainer.ckpt import Checkpointer
    from prime_hpc.trainer.dist import DistEnv
    from prime_hpc.trainer.model import Policy

PROG = "python -m prime_hpc.trainer.multirun"
IDLE_S = 0.05  # how long rank 0 sleeps when no run has a batch ready
SHARED = ("rank", "alpha", "target_modules")  # the LoRA settings every run of a job shares


@dataclass
class Lane:
    """One run holding an adapter slot of the trainer."""

    name: str
    run: RunDir
    cfg: "TrainerRunConfig"
    slot: int
    engine: "SlotEngine"
    ckpt: "Checkpointer"
    metrics: "Optional[MetricsLogger]"  # rank 0
    step: int  # last completed step
    start_step: int
    progress: dict = field(default_factory=lambda: {"num_tokens": 0, "num_samples": 0})
    merged_at: Optional[int] = None  # the step whose weights hold the merged model too
    session: Any = None  # the runner.Session view of this run (for runner's helpers)


def train(cfg: "TrainerRunConfig") -> None:
    """Train every run of the job's `runs/` (see the module docstring)."""
    import torch
    from loguru import logger

    from prime_hpc.runtime.stopping import CHECKPOINT, CONTINUE, Stop
    from prime_hpc.trainer.dist import process_group
    from prime_hpc.trainer.engine import param_count
    from prime_hpc.trainer.model import build_policy

    job = RunDir(cfg.output_dir)
    k = cfg.trainer.max_concurrent_runs
    if k < 2 or not cfg.trainer.model.lora.enabled:
        raise UserError(
            f"{PROG} trains several runs through LoRA adapters: it needs trainer.max_concurrent_runs > 1 "
            f"and trainer.model.lora.enabled=true (got {k}, {cfg.trainer.model.lora.enabled})"
        )
    with process_group(cfg.device) as env:
        torch.manual_seed(cfg.seed)
        policy = build_policy(cfg, env.mesh)
        n = param_count(policy)
        logger.info(
            f"model {cfg.trainer.model.name} ({n / 1e6:.2f}M parameters), {k} adapter slots, "
            f"{env.world_size} rank(s), device {cfg.device}: training the runs of {job.runs_dir}"
        )
        trainer = MultiRun(cfg, job, env, policy, n)
        stop = Stop(job)
        try:
            while True:
                code = _agreed(stop, env)
                if code != CONTINUE:
                    trainer.stop_all(code == CHECKPOINT)
                    return
                plan = trainer.plan()
                if plan is None:
                    break
                if not trainer.apply(plan):
                    if env.is_main:
                        time.sleep(IDLE_S)
                    trainer.beat_idle()
        finally:
            trainer.close()
        logger.info(f"done: {', '.join(f'{r} at step {s}' for r, s in sorted(trainer.ended.items())) or 'no runs'}")


def _agreed(stop: Any, env: "DistEnv") -> int:
    from prime_hpc.runtime import stopping
    from prime_hpc.trainer.dist import all_reduce_max

    code = stop.decision() if stop.pending() else stopping.CONTINUE
    return all_reduce_max([code], env)[0]


def _broadcast(obj: Any, env: "DistEnv") -> Any:
    """Rank 0's `obj` on every rank."""
    import torch.distributed as dist

    box = [obj if env.is_main else None]
    dist.broadcast_object_list(box, src=0, device=env.device if env.device.type != "cpu" else None)
    return box[0]


class MultiRun:
    """The trainer's runs: who holds which slot, what to do next (decided on rank 0)."""

    def __init__(self, cfg: "TrainerRunConfig", job: RunDir, env: "DistEnv", policy: "Policy", num_params: int):
        self.cfg, self.job, self.env, self.policy, self.num_params = cfg, job, env, policy, num_params
        self.lanes: dict[str, Lane] = {}
        self.free = list(range(cfg.trainer.max_concurrent_runs))
        self.ended: dict[str, int] = {}  # run -> its last step
        self.refused: dict[str, str] = {}  # run -> why
        self.turn = 0  # round robin over the lanes
        self.beat_at = 0.0
        self.progress_at = time.time()  # the last step or admission (the watchdog's progress)

    # ------------------------------------------------------------------ rank 0 decides
    def plan(self) -> Optional[dict]:
        """What every rank does next: {"admit": [names], "end": [names], "step": name | None};
        None when every run has ended and none is waiting."""
        plan = None
        if self.env.is_main:
            plan = self._decide()
        return _broadcast(plan, self.env)

    def _decide(self) -> Optional[dict]:
        from prime_hpc.trainer.rl import rollouts_done_before

        known = set(self.lanes) | set(self.ended) | set(self.refused)
        waiting = [r for r in self.job.sub_runs() if r not in known and not runs.is_over(self.job.sub_run(r))]
        waiting.sort(key=lambda r: (runs.config_mtime(self.job.sub_run(r)) or 0, r))  # first come, first served
        admit = waiting[: len(self.free)]
        end, ready = [], []
        for name, lane in self.lanes.items():
            nxt = lane.step + 1
            done = lane.cfg.max_steps is not None and lane.step >= lane.cfg.max_steps
            if (
                done or rollouts_done_before(lane.run, nxt) or runs.is_stopped(lane.run)
            ):  # its orchestrator failed, or it was cancelled
                end.append(name)
            elif is_stable(lane.run.rollout_step(nxt)):
                ready.append(name)
        step = None
        if ready:
            order = sorted(self.lanes)
            ready.sort(key=lambda r: (order.index(r) - self.turn) % len(order))
            step = ready[0]
            self.turn = (order.index(step) + 1) % len(order)
        if not (admit or end or step or self.lanes or waiting):
            return None
        return {"admit": admit, "end": end, "step": step}

    # ------------------------------------------------------------------ every rank acts
    def apply(self, plan: dict) -> bool:
        """Carry out `plan`; False when there was nothing to do."""
        for name in plan["admit"]:
            self._admit(name)
        for name in plan["end"]:
            self._end(name)
        if plan["step"]:
            self._step(self.lanes[plan["step"]])
        acted = bool(plan["admit"] or plan["end"] or plan["step"])
        if acted:
            self.beat_idle(progress=True)
        return acted

    def _admit(self, name: str) -> None:
        import torch
        from loguru import logger

        from prime_hpc.rundir.checkpoints import resolve_resume_step
        from prime_hpc.trainer.config import load_config

        run = self.job.sub_run(name)
        try:
            cfg = load_config(run.component_config("trainer"))
            self._check(name, cfg)
            resume = resolve_resume_step(run, cfg.ckpt.step, CHECKPOINT_PARTS)
        except UserError as e:
            self._refuse(name, run, str(e))
            return
        slot = self.free.pop(0)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)  # the adapter a run starts from: its own seed's, on every rank
            lora.reset_slot(self.policy.model, slot)
        lane = self._lane(name, run, cfg, slot)
        if resume is not None:
            t0 = time.perf_counter()
            state = lane.ckpt.load(resume, lane.engine)
            lane.step = lane.start_step = resume
            lane.progress = dict(state.get("progress", lane.progress))
            lane.session.load_ckpt_s = time.perf_counter() - t0  # reported with its next step
            logger.info(
                f"run {name}: resumed from {run.checkpoint_part(resume, 'trainer')} in {lane.session.load_ckpt_s:.2f}s"
            )
        self.lanes[name] = lane
        logger.info(
            f"run {name}: adapter slot {slot}, from step {lane.step} to {cfg.max_steps} (lr {cfg.trainer.optim.lr:g})"
        )
        runner.beat(lane.session, lane.step)

    def _check(self, name: str, cfg: "TrainerRunConfig") -> None:
        """A run must train the job's base model with the job's LoRA shape."""
        mine, theirs = self.cfg.trainer.model, cfg.trainer.model
        if theirs.name != mine.name:
            raise UserError(f"trains {theirs.name}, this job's trainer holds {mine.name}")
        if cfg.trainer.type != "rl" or not theirs.lora.enabled:
            raise UserError(
                "a run of a multi-run job trains with LoRA (trainer.type=rl, trainer.model.lora.enabled=true)"
            )
        differ = [k for k in SHARED if _shape(theirs.lora, k) != _shape(mine.lora, k)]
        if differ:
            raise UserError(
                "its LoRA shape differs from the job's adapter slots: "
                + ", ".join(
                    f"trainer.model.lora.{k}={getattr(theirs.lora, k)} (the job's: {getattr(mine.lora, k)})"
                    for k in differ
                )
            )

    def _refuse(self, name: str, run: RunDir, why: str) -> None:
        from loguru import logger

        self.refused[name] = why
        logger.error(f"run {name} refused: {why}")
        if self.env.is_main:
            runs.record(run, runs.REFUSED, None, why)

    def _lane(self, name: str, run: RunDir, cfg: "TrainerRunConfig", slot: int) -> Lane:
        from prime_hpc.runtime.metrics import MetricsLogger
        from prime_hpc.trainer.ckpt import Checkpointer
        from prime_hpc.trainer.model import clean_key

        params = [
            p
            for n, p in self.policy.model.named_parameters()
            if p.requires_grad and lora.is_slot_key(clean_key(n), slot)
        ]
        engine = SlotEngine(
            self.policy, self.env, cfg.trainer.optim, total_steps=cfg.max_steps, params=params, slot=slot
        )
        ckpt = Checkpointer(run, cfg.ckpt, self.env)
        metrics = None
        if self.env.is_main:
            metrics = MetricsLogger(
                run,
                "trainer",
                cfg.wandb,
                run_name=cfg.name,
                config={"trainer": runner.plain(cfg.trainer), "max_steps": cfg.max_steps, "adapter_slot": slot},
                wandb_writer=False,  # each run's orchestrator writes its W&B run, these rows included
            )
        lane = Lane(name, run, cfg, slot, engine, ckpt, metrics, step=0, start_step=0)
        lane.session = runner.Session(cfg, run, self.env, self.policy, engine, ckpt, metrics, 0, None, self.num_params)
        return lane

    def _step(self, lane: Lane) -> None:
        """One step of `lane`'s run, as `prime_hpc.trainer.rl` trains one."""
        from loguru import logger

        from prime_hpc.rundir import batch as rollout_batch
        from prime_hpc.trainer.dist import barrier
        from prime_hpc.trainer.rl import log_step

        t0 = time.perf_counter()
        step = lane.step + 1
        s = lane.session
        data = rollout_batch.read_rank(
            lane.run, step, self.env.rank, timeout_s=lane.cfg.trainer.rollout_timeout_s, producer_log=None
        )
        timers = {"time/read_batch": time.perf_counter() - t0}
        lora.activate(self.policy.model, lane.slot)
        micro_batches, loss_fn = step_inputs(s, data, step, self.policy.compiled)
        try:
            temperature = float(data.info.get("temperature", 1.0))
            result = distributions.logged(
                s, step, lambda: s.engine.train_step(micro_batches, loss_fn, temperature=temperature, step=step)
            )
        except Diverged as e:  # this run's adapter alone: the others never saw its gradient
            self._fail(lane, str(e))
            return
        t_pub = time.perf_counter()
        self._write_adapter(lane, step, final=lane.cfg.max_steps is not None and step == lane.cfg.max_steps)
        timers["time/save_weights"] = time.perf_counter() - t_pub
        barrier()  # every rank has read its rollout file
        if self.env.is_main:
            rollout_batch.remove_step(lane.run, step)
        lane.progress["num_tokens"] += int(result.sums["num_tokens"])
        lane.progress["num_samples"] += int(result.sums["num_samples"])
        final = lane.cfg.max_steps is not None and step == lane.cfg.max_steps
        _, t_ckpt = runner.checkpoint_if_due(s, step, final, {"progress": lane.progress})
        if self.env.is_main:
            runner.prune_weights(lane.run, step, lane.cfg.async_level)
        lane.step = step
        log_step(s, step, result, time.perf_counter() - t0, 0.0, t_ckpt, lane.progress, timers)
        logger.info(f"run {lane.name}: step {step} done")
        runner.beat(s, step)
        self.beat_idle(progress=True)

    def _write_adapter(self, lane: Lane, step: int, final: bool) -> None:
        """`runs/<name>/weights/step_<step>/`: the run's adapter (what its servers load);
        at its last step the merged model too. Collective: every rank calls it."""
        from prime_hpc.trainer.model import full_state_dict, write_weights

        if final:
            sd = full_state_dict(self.policy.model)
            sd = {k: v for k, v in sd.items() if not lora.is_lora_key(k)} | lora.slot_state(sd, lane.slot)
        else:
            sd = self._slot_tensors(lane.slot)
        if self.env.is_main:
            write_weights(lane.run, step, self.policy, sd, serve_adapter=True, merged=final)
        if final:
            lane.merged_at = step

    def _slot_tensors(self, slot: int) -> dict[str, Any]:
        """The slot's adapter, whole, on rank 0 (one gather per tensor; every rank calls it
        in the same order)."""
        from torch.distributed.tensor import DTensor

        from prime_hpc.trainer.model import clean_key

        out = {}
        for name, p in self.policy.model.named_parameters():
            if lora.is_slot_key(clean_key(name), slot):
                full = p.full_tensor() if isinstance(p, DTensor) else p
                out[clean_key(name)] = full.detach().cpu().clone()
        return lora.slot_state(out, slot)

    def _end(self, name: str) -> None:
        """The run is done: its last weights and checkpoint, its slot freed."""
        from loguru import logger

        lane = self.lanes.pop(name)
        if lane.step > lane.start_step:
            if lane.merged_at != lane.step:  # ended before its max_steps (rollouts/DONE)
                self._write_adapter(lane, lane.step, final=True)
            if lane.cfg.ckpt.enabled and lane.step not in lane.ckpt.requested:
                lane.ckpt.save(lane.step, lane.engine, {"progress": lane.progress})
        self._release(lane, done=True)
        if self.env.is_main:
            runner.prune_weights(lane.run, lane.step, lane.cfg.async_level)
            if not runs.is_stopped(lane.run):  # a failure or a cancel stays recorded
                runs.record(lane.run, runs.ENDED, lane.step)
        logger.info(f"run {name}: ended at step {lane.step}; adapter slot {lane.slot} free")

    def _release(self, lane: Lane, **beat: bool) -> None:
        """A run leaves its slot: its saves finished, its files closed, its last heartbeat
        (`beat`: done or stopped), the slot free for the next run."""
        lane.ckpt.wait()
        lane.ckpt.close()
        if lane.metrics is not None:
            lane.metrics.close()
        runner.beat(lane.session, lane.step, **beat)
        self.free.append(lane.slot)
        self.free.sort()
        self.ended[lane.name] = lane.step

    def _fail(self, lane: Lane, why: str) -> None:
        """The run's loss diverged: it ends here, FAILED, with its last good adapter and
        checkpoints as they are (nothing of the failed step is written), and its slot is
        freed; the job's head stops its orchestrator (`run.json` says FAILED)."""
        from loguru import logger

        del self.lanes[lane.name]
        self._release(lane, stopped=True)
        if self.env.is_main:
            runs.record(lane.run, runs.FAILED, lane.step, f"trainer: {why}")
        logger.error(
            f"run {lane.name} failed: {why}; adapter slot {lane.slot} free, the other runs go on "
            f"(its newest checkpoint: step {max(lane.run.complete_checkpoint_steps(), default=0)})"
        )

    def stop_all(self, checkpoint: bool) -> None:
        """A stop: every run holding a slot checkpoints the step it is at (when asked)."""
        from loguru import logger

        for lane in self.lanes.values():
            if checkpoint and lane.step > lane.start_step and lane.step not in lane.ckpt.requested:
                lane.ckpt.save(lane.step, lane.engine, {"progress": lane.progress})
            lane.ckpt.wait()
            runner.beat(lane.session, lane.step, stopped=True)
            logger.info(f"run {lane.name}: stopped at step {lane.step}" + (" (checkpointed)" if checkpoint else ""))
        if checkpoint and self.env.is_main:
            atomic_write_json(self.job.checkpoint_answer, {"runs": {n: lane.step for n, lane in self.lanes.items()}})

    def beat_idle(self, progress: bool = False) -> None:
        """The trainer's own heartbeat in the job's directory (the watchdog's): the step of
        each run it holds; `progress`: it has just done something (a step, an admission),
        otherwise it is waiting on the runs' orchestrators."""
        now = time.time()
        if progress:
            self.progress_at = now
        if progress or now - self.beat_at >= BEAT_S:
            self.beat_at = now
            steps = {n: lane.step for n, lane in self.lanes.items()}
            waiting = {} if progress else {"waiting_on": "orchestrator"}
            self.job.beat("trainer", self.env.rank, runs=steps, progress_at=self.progress_at, **waiting)

    def close(self) -> None:
        for lane in self.lanes.values():
            lane.ckpt.close()
            if lane.metrics is not None:
                lane.metrics.close()


def step_inputs(s: runner.Session, data: "RolloutBatch", step: int, compiled: bool) -> tuple[list[dict], Any]:
    """A run's step as `prime_hpc.trainer.rl` trains it: its rollouts packed
    (`runner.packed`), each sample's environment placed (`rl.add_env_index`), and the
    objective its info asks for, the step's environments' figures apart (`rl.make_loss_fn`)."""
    from prime_hpc.trainer.rl import add_env_index, make_loss_fn

    mode = str(data.info.get("mode", "rl"))
    loss_fn = make_loss_fn(s.cfg.trainer.loss, step, mode, compiled, envs=data.envs)
    micro_batches = runner.packed(s, data.micro_batches)
    if data.envs:
        add_env_index(micro_batches, data.envs)
    return micro_batches, loss_fn


def _shape(lora_cfg: Any, key: str) -> Any:
    value = getattr(lora_cfg, key)
    return sorted(value) if key == "target_modules" else value


class SlotEngine(Engine):
    """One run's optimizer and schedule over its adapter slot; its state dicts (what its
    checkpoints hold) are the slot's alone, under a one-adapter model's names."""

    def __init__(self, *args: Any, slot: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.slot = slot

    def state_dicts(self) -> tuple[dict, dict]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        model_sd = lora.slot_state(get_model_state_dict(self.model), self.slot)
        optim_sd = get_optimizer_state_dict(self.model, self.optimizer)
        return model_sd, _rename_optim(optim_sd, lambda k: lora.to_one_adapter(k, self.slot))

    def load_state_dicts(self, model_sd: dict, optim_sd: dict) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        mine = {lora.to_slot(k, self.slot): v for k, v in model_sd.items()}
        set_model_state_dict(self.model, mine, options=StateDictOptions(strict=False))
        set_optimizer_state_dict(
            self.model, self.optimizer, _rename_optim(optim_sd, lambda k: lora.to_slot(k, self.slot))
        )


def _rename_optim(sd: dict, rename: Any) -> dict:
    """An optimizer state dict keyed by parameter name (DCP's), its names mapped."""
    return {
        "state": {rename(k): v for k, v in sd.get("state", {}).items()},
        "param_groups": [{**g, "params": [rename(k) for k in g["params"]]} for g in sd.get("param_groups", [])],
    }


def main(argv: Optional[list[str]] = None) -> int:
    return runner.main(train, PROG, "Multi-run RL trainer: one LoRA adapter per run of the job's runs/.", argv)


if __name__ == "__main__":
    raise SystemExit(main())
