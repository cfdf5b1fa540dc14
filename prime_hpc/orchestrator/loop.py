"""The orchestrator's async loop.

For step n = start+1 .. max_steps:
  - keep up to `max_concurrent / group_size` groups generating through the router
    (each: pick an env by ratio, its next task, `group_size` rollouts, scored by the env);
  - judge each finished group against step n (policy lag, spanning, errors, filtering)
    and collect `batch_size / group_size` groups; groups finished beyond that carry over;
  - write `rollouts/step_n/rank_<r>.pt` (one file per trainer rank) and its metrics.
New groups start only while the served policy is recent enough for the step being filled
(>= n - async_level); meanwhile a relay task loads every new `weights/step_m` into all
servers (each server drains, swaps and stamps completions with m).
After `max_errored_groups` errored groups in a row (`rollouts.group_error`) the run ends
with one line quoting the env's error (`EnvFailed`). The heartbeat's progress is a step
written or a new policy served (a step trained), never a train group judged: a loop that
judges groups forever without filling a step is a stall for the watchdog.
"""
from __future__ import annotations

import asyncio
import math
import random
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from statistics import mean
from typing import Any, Mapping, Optional

from loguru import logger

from prime_hpc.core import jobenv
from prime_hpc.rundir import batch, window
from prime_hpc.config.component import OrchestratorRunConfig, typed
from prime_hpc.config.schema import SamplingConfig
from prime_hpc.core.errors import UserError
from prime_hpc.rundir import BEAT_S
from prime_hpc.inference.client import Admin, api_key, discover, forget_worker, headers
from prime_hpc.orchestrator import envs as envs_mod
from prime_hpc.orchestrator.client import make_client
from prime_hpc.orchestrator.envs import (CURRENT_ENV, REWARD_ERROR, EnvFailed, EnvSampler, EnvSlot, dataset_rows,
                                         env_name)
from prime_hpc.orchestrator.rollouts import (ErrorStreak, Rollout, from_output, judge_group, opd_token_advantages,
                                             pass_at_k)
from prime_hpc.rundir.checkpoints import CheckpointWriteError, is_due, resolve_resume_step, rotate
from prime_hpc.rundir import CHECKPOINT_PARTS, STABLE, RunDir, atomic_write_json, mark_stable, read_json, stable_time

STATE_FILE = "state.json"
LORA_NAME = "policy"  # served name of the run's adapter when only adapters are written
SNAPSHOTS_KEPT = 32  # recent steps whose state is kept (the trainer is at most async_level behind)
CHECKPOINT_WAIT_S = 120.0  # asked to checkpoint: how long to wait for the trainer's step
TRAINER_WAIT_S = 300.0  # at the end, with W&B: how long to wait for the trainer's last metrics
SERVERS_WAIT_S = 3600.0  # at the start: how long to wait for the inference servers and the router to publish
FILL_LOG_S = 30.0  # while a step does not fill: how often to say how far it got


@dataclass
class StepFill:
    """What filling one step collected."""
    t0: float
    t_wait: float = 0.0  # waiting for recent-enough weights
    accepted: list = field(default_factory=list)  # groups (lists of rollouts) for the step
    finished: list = field(default_factory=list)  # every judged rollout (for metrics)
    counts: dict = field(default_factory=lambda: defaultdict(int))  # judged groups, and why dropped
    reported: float = 0.0  # when the last line about this step's progress was logged (monotonic)



def sampling_args(s: SamplingConfig) -> dict:
    """The OpenAI request's sampling arguments from `orchestrator.sampling`: the standard
    ones at the top level, vLLM's own (`top_k`, `min_p`, `repetition_penalty`, then
    `extra_body` verbatim) in the body's extras; token ids are always asked for."""
    extra = dict(s.extra_body)
    if s.top_k:
        extra["top_k"] = s.top_k
    if s.min_p:
        extra["min_p"] = s.min_p
    if s.repetition_penalty != 1.0:
        extra["repetition_penalty"] = s.repetition_penalty
    extra["return_token_ids"] = True  # the trainer needs them
    args: dict = {"temperature": s.temperature, "top_p": s.top_p, "logprobs": True, "extra_body": extra}
    if s.max_tokens:
        args["max_tokens"] = s.max_tokens
    if s.stop:
        args["stop"] = list(s.stop)
    if s.seed is not None:
        args["seed"] = s.seed
    return args


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
        self.group_size = self.ocfg.group_size
        self.groups_per_step = self.ocfg.batch_size // self.group_size
        self.max_groups = max(1, self.ocfg.max_concurrent // self.group_size)
        self.policy = 0
        self.step = 0  # last step written
        self.totals = {"tokens": 0, "samples": 0, "problems": 0}
        self.slots: list[EnvSlot] = []
        self.eval_slots: list[EnvSlot] = []
        self.sampler: Optional[EnvSampler] = None
        self.admin: Optional[Admin] = None
        self.progress_at = time.time()  # the last step written, policy served or eval group finished (heartbeat)
        self.filling: Optional[int] = None  # the step being filled
        self.errors = ErrorStreak(self.ocfg.max_errored_groups)  # errored train groups in a row
        self.client: Any = None
        self.model = cfg.model.name
        self.metrics: Any = None
        self.log_router: Optional[envs_mod.EnvLogRouter] = None
        self.update_log: list[dict] = []  # (for tests and metrics) every relay update
        self._pending_eval: Optional[asyncio.Task] = None
        self.inflight: set[asyncio.Task] = set()  # groups generating
        self.carry: list[list[Rollout]] = []  # finished groups beyond the step being filled
        self.snapshots: dict[int, dict] = {}  # step -> state right after writing it (for checkpoints)
        self.relay_task: Any = None
        self.stop: Any = None  # prime_hpc.runtime.stopping.Stop, installed by main()
        self.stop_code: Optional[int] = None

    # ------------------------------------------------------------------ setup
    def use_server(self, client: Any, model: Optional[str] = None) -> None:
        """Generate through `client` (an OpenAI-compatible client of a server or router),
        asking for `model` (default: the run's model name)."""
        self.client = client
        self.model = model or self.model

    def load_envs(self, train: bool = True) -> None:
        """The eval envs, and (unless `train=False`) the train envs and their sampler."""
        seen = set()
        kinds = [("train", self.ocfg.env, self.slots)] if train else []
        for kind, entries, into in (*kinds, ("eval", self.ocfg.eval.env, self.eval_slots)):
            for entry in entries:
                name = env_name(entry)
                if (kind, name) in seen:
                    raise UserError(f"two {kind} envs are named {name!r}: give one a `name`")
                seen.add((kind, name))
                env = envs_mod.load_env(entry, kind)
                ds = env.get_dataset() if kind == "train" else env.get_eval_dataset(
                    n=self.ocfg.eval.num_examples or -1)
                into.append(EnvSlot(name=name, entry=entry, env=env, rows=dataset_rows(ds)))
        if train:  # max_steps: null = until the train data is used once
            epochs = 1 if self.max_steps is None else None
            self.sampler = EnvSampler(self.slots, self.cfg.seed, epochs)  # refuses an empty list
        if self.logs is not None:
            files = {f"{kind}/{s.name}": self.run.env_worker_log(self.logs, kind, s.name)
                     for kind, slots in (("train", self.slots), ("eval", self.eval_slots)) for s in slots}
            self.log_router = envs_mod.EnvLogRouter(files)
            self.log_router.attach(self.ocfg.log.vf_level)

    def sampling_args(self) -> dict:
        return sampling_args(self.ocfg.sampling)

    # ------------------------------------------------------------------ checkpoint
    def state(self, step: int) -> dict:
        """What this component's checkpoint of `step` holds (taken right after writing it)."""
        return {"step": step, "policy": self.policy, "totals": dict(self.totals), "sampler": self.sampler.state()}

    def save_checkpoint(self, step: int) -> None:
        """`checkpoints/step_<n>/orchestrator/` from the snapshot taken when step n was written."""
        d = self.run.checkpoint_part(step, "orchestrator")
        try:
            d.mkdir(parents=True, exist_ok=True)
            atomic_write_json(d / STATE_FILE, {**self.snapshots[step], "saved_at": time.time()})
            mark_stable(d, {"step": step})
        except OSError as e:
            raise CheckpointWriteError(step, d, e) from e
        rotate(self.run, "orchestrator", self.cfg.ckpt.keep_last, self.cfg.ckpt.keep_interval)

    def load_checkpoint(self, step: int) -> None:
        state = read_json(self.run.checkpoint_part(step, "orchestrator") / STATE_FILE)
        self.step = int(state["step"])
        self.totals = dict(state["totals"])
        self.sampler.load_state(state["sampler"])
        self.snapshots[self.step] = self.state(self.step)

    # ------------------------------------------------------------------ generation
    async def generate_group(self, slot: EnvSlot, row: dict, client: Any, model: str, kind: str = "train",
                             n: Optional[int] = None) -> list[Rollout]:
        token = CURRENT_ENV.set(f"{kind}/{slot.name}")
        try:
            outs = await slot.env.run_group([dict(row) for _ in range(n or self.group_size)], client, model,
                                            self.sampling_args(), state_columns=["trajectory", REWARD_ERROR])
            return [from_output(o, slot.name, self.cfg.seq_len, self.ocfg.trajectory_strategy) for o in outs]
        except Exception as e:  # a crashed group is counted, never fatal
            logger.warning(f"{kind} env {slot.name}: group failed: {type(e).__name__}: {e}")
            return [Rollout(env=slot.name, example_id=row.get("example_id"), reward=0.0, input_ids=[], loss_mask=[],
                            logprobs=[], policy_steps=[], num_turns=0, is_truncated=False,
                            error=f"{type(e).__name__}: {e}")
                    for _ in range(n or self.group_size)]
        finally:
            CURRENT_ENV.reset(token)
            if kind == "eval":  # an eval is finite: its groups are progress (a train group is not)
                self.progress_at = time.time()

    async def add_teacher_logprobs(self, group: list[Rollout]) -> None:
        """opd: the teacher's log-probability of every token of each rollout (of each of its
        samples, when branched)."""
        import httpx

        t = self.ocfg.teacher.client
        async with httpx.AsyncClient(timeout=600, headers=headers(api_key(t.api_key_var) or "")) as c:
            for r in (seq for rollout in group for seq in rollout.sequences()):
                resp = await c.post(t.base_url.rstrip("/") + "/completions", json={
                    "model": t.model or self.model, "prompt": r.input_ids, "max_tokens": 1,
                    "prompt_logprobs": 0, "temperature": 1.0})
                resp.raise_for_status()
                plp = resp.json()["choices"][0].get("prompt_logprobs") or resp.json().get("prompt_logprobs")
                lps = [0.0]
                for tok, entry in zip(r.input_ids[1:], plp[1:]):
                    lps.append(float(entry[str(tok)]["logprob"]))
                r.teacher_logprobs = lps
                r.token_advantages = opd_token_advantages(r)

    # ------------------------------------------------------------------ weight relay
    async def relay(self) -> None:
        """Load every new `weights/step_m` into all servers, newest first."""
        while True:
            steps = self.run.weight_steps()
            newest = steps[-1] if steps else None
            if newest is not None and newest > self.policy:
                t0 = time.monotonic()
                d = self.run.weights_step(newest)
                handoff = max(0.0, time.time() - stable_time(d))  # written -> seen here
                try:
                    serve = read_json(d / STABLE).get("serve")  # the marker holds the weights' metadata
                except (OSError, ValueError):
                    serve = None
                if serve == "adapter" or (serve is None and not any(d.glob("*.safetensors"))
                                          and self.run.weights_adapter(newest).is_dir()):
                    # LoRA with save_adapter_separately: the servers keep the base model and load the adapter
                    answers = await self.admin.load_lora(LORA_NAME, self.run.weights_adapter(newest), newest)
                    self.model = LORA_NAME
                else:
                    answers = await self.admin.update_weights(d, newest)
                self.update_log.append({
                    "step": newest, "seconds": time.monotonic() - t0, "handoff": handoff, "at_step": self.step,
                    # the slowest server's wait for its in-flight generations, and its load
                    "drain": max((float(a.get("drain_s", 0)) for a in answers), default=0.0),
                    "load": max((float(a.get("load_s", 0)) for a in answers), default=0.0)})
                logger.info(f"inference now serves policy {newest} ({time.monotonic() - t0:.2f}s)")
                self.policy = newest
                self.progress_at = time.time()  # a step trained: a wait for the trainer's weights ends
            await asyncio.sleep(0.02)  # on-policy generation waits for each new policy

    def server_lost(self, ep: Any, server: str, why: str) -> None:
        """A server stopped answering: the run goes on with the others. The router is told
        to stop sending to it (it would also find out by its own health checks)."""
        left = len(self.admin.live) if self.admin is not None else 0
        node = next((r.get("node") for r in ep.server_records if r.get("url") == server), "?")
        logger.warning(f"inference server on node {node} ({server}) is gone ({why}); "
                       f"{left} server(s) left; weight updates skip it from now on")
        asyncio.get_running_loop().create_task(forget_worker(ep.router, server))

    # ------------------------------------------------------------------ eval
    async def evaluate(self, step: int) -> dict:
        k = self.ocfg.eval.rollouts_per_example
        out: dict = {}
        for slot in self.eval_slots:
            sem = asyncio.Semaphore(self.max_groups)

            async def one(row: dict, slot: EnvSlot = slot) -> list[Rollout]:
                async with sem:
                    return await self.generate_group(slot, row, self.client, self.model, "eval", n=k)

            groups = await asyncio.gather(*(one(r) for r in slot.rows))
            rewards = [[r.reward for r in g] for g in groups]
            out[f"eval/{slot.name}/avg@{k}"] = mean(mean(x) for x in rewards) if rewards else 0.0
            out[f"eval/{slot.name}/pass@{k}"] = mean(pass_at_k(x) for x in rewards) if rewards else 0.0
        return out

    async def _eval_and_log(self, step: int) -> None:
        t0 = time.monotonic()
        try:
            metrics = await self.evaluate(step)
        except Exception as e:
            logger.warning(f"eval at step {step} failed: {type(e).__name__}: {e}")
            return
        metrics["time/eval"] = time.monotonic() - t0
        self.metrics.log(step, metrics)
        logger.info(f"eval step {step}: " + ", ".join(f"{k}={v:.3f}" for k, v in metrics.items()))

    # ------------------------------------------------------------------ the loop
    def admission_limit(self, step: int, accepted: int, waiting: int) -> int:
        """How many groups may be generating while step `step` is being filled: a group
        started now (under policy p) can train steps up to p + async_level, so only as many
        as those steps (not past `max_steps`) still need, minus the groups already accepted
        or waiting to be judged; at most `max_concurrent / group_size`. Generating more
        would only produce groups that turn stale before a step can use them. With
        `oversampling_factor` f > 1, f times as many: the filters' losses are made up
        while the step fills."""
        last = window.last_trainable(self.policy, self.async_level)
        if self.max_steps is not None:
            last = min(last, int(self.max_steps))
        need = math.ceil((last - step + 1) * self.groups_per_step * self.ocfg.oversampling_factor) - accepted - waiting
        return max(0, min(self.max_groups, need))

    def step_metrics(self, step: int, finished: list[Rollout], kept: list[Rollout], counts: dict,
                     t_step: float, t_wait: float) -> dict:
        m: dict = {}
        by_env: dict = defaultdict(list)
        for r in finished:
            by_env[r.env].append(r)
        for scope, rs in (("all", finished), *sorted(by_env.items())):
            if not rs:
                continue
            lens = [len(seq.input_ids) for r in rs for seq in r.sequences()]  # per sample
            m[f"reward/{scope}/mean"] = mean(r.reward for r in rs)
            m[f"seq_len/{scope}/mean"] = mean(lens)
            m[f"seq_len/{scope}/max"] = max(lens)
            m[f"is_truncated/{scope}/mean"] = mean(float(r.is_truncated) for r in rs)
            m[f"num_turns/{scope}/mean"] = mean(r.num_turns for r in rs)
            m[f"samples_per_rollout/{scope}/mean"] = mean(1 + len(r.branches) for r in rs)  # > 1: branching
            m[f"empty_rollouts/{scope}"] = mean(float(r.empty and not r.error) for r in rs)
            m[f"errored_rollouts/{scope}"] = mean(float(bool(r.error)) for r in rs)
        lags = [step - r.oldest_policy for r in kept]
        m.update({
            "off_policy/lag/mean": mean(lags) if lags else 0.0,
            "off_policy/lag/max": max(lags) if lags else 0,
            "off_policy/policy": self.policy,
            "off_policy/stale_groups": counts["stale"],
            "off_policy/stale_share": counts["stale"] / max(counts["judged"], 1),
            "off_policy/spanning_rollouts": counts["spanning"],
            "filter/judged_groups": counts["judged"],
            "filter/errored_groups": counts["errored"],
            "filter/zero_variance_groups": counts["no reward variance"],
            "filter/invalid_groups": counts["too few valid rollouts"],
            "filter/too_hard_groups": counts["too hard"],
            "filter/too_easy_groups": counts["too easy"],
            "filter/low_variance_groups": counts["low reward variance"],
            "inference/servers": len(self.admin.live) if self.admin is not None else 0,
            # the newest policy update: weights marked -> seen by the relay, and the update call to every server
            "time/weight_handoff": self.update_log[-1]["handoff"] if self.update_log else 0.0,
            "time/weight_update": self.update_log[-1]["seconds"] if self.update_log else 0.0,
            "time/weight_drain": self.update_log[-1]["drain"] if self.update_log else 0.0,
            "time/weight_load": self.update_log[-1]["load"] if self.update_log else 0.0,
            "progress/total_tokens": self.totals["tokens"],
            "progress/total_samples": self.totals["samples"],
            "progress/total_problems": self.totals["problems"],
            "time/step": t_step,
            "time/wait_for_ckpt": t_wait,
        })
        return m

    async def loop(self, start: int, eval_first: bool = False) -> None:
        """Evaluate the starting policy as step 0 when `eval_first` (under the heartbeat,
        like the steps), then fill and write steps start+1 .. max_steps (or until the train
        data is used once when max_steps is null), then write `rollouts/DONE`. Stops early,
        without DONE, when asked to (`prime_hpc.runtime.stopping`): after checkpointing the
        trainer's step if the supervisor wants a checkpoint."""
        self.relay_task = asyncio.create_task(self.relay())
        self.progress_at = time.time()
        beats = asyncio.create_task(self.heartbeat())
        step = start + 1
        try:
            if eval_first:
                await self._eval_and_log(0)  # the base policy, before any update
            while self.max_steps is None or step <= self.max_steps:
                filled = await self.fill_step(step)
                self.filling = None
                if filled is None:
                    break
                self.write_step(step, filled)
                await self.after_step(step)
                step += 1
            if self.stop_code is not None:
                await self.stop_now()
                return
            if self._pending_eval is not None:
                await self._pending_eval
            ckpt = self.cfg.ckpt
            if self.step > start and self.step != self.max_steps and is_due(self.step, True, ckpt) \
                    and not is_due(self.step, False, ckpt):
                self.save_checkpoint(self.step)  # the data ran out: the last step is the final one
            atomic_write_json(self.run.rollouts_done, {"last_step": self.step})
            logger.info(f"last step written: {self.step} ({self.run.rollouts_done})")
        finally:
            self.relay_task.cancel()
            beats.cancel()
            for t in self.inflight:
                t.cancel()
            await asyncio.gather(self.relay_task, beats, *self.inflight, return_exceptions=True)
            self.beat(done=True)

    async def heartbeat(self) -> None:
        """`heartbeats/orchestrator_0` every `BEAT_S` from the event loop: the step, the
        last time it made progress (`progress_at`: a step written, a new policy served, an
        eval group finished; never a train group judged), and whether it is only waiting
        for the trainer's weights, which the watchdog does not count as a stall of its own."""
        while True:
            self.beat()
            await asyncio.sleep(BEAT_S)

    def waiting_for_trainer(self) -> bool:
        """Nothing generating, and the served policy too old for the step being filled."""
        return not self.inflight and self.filling is not None and \
            window.is_stale(self.policy, self.filling, self.async_level)

    def beat(self, **info: Any) -> None:
        self.run.beat("orchestrator", 0, step=self.step, policy=self.policy, progress_at=self.progress_at,
                      waiting_on="trainer" if self.waiting_for_trainer() else None, **info)

    async def fill_step(self, step: int) -> Optional["StepFill"]:
        """Collect `batch_size / group_size` accepted groups for `step`: keep generation
        admitted up to `admission_limit`, judge finished groups in order (carrying over
        those beyond this step). None when the data is used up or a stop is decided (a
        metrics row then records what this step judged, when it judged anything)."""
        from prime_hpc.runtime.stopping import EXIT

        fill = StepFill(t0=time.monotonic(), reported=time.monotonic())
        self.filling = step
        pending, self.carry = self.carry, []
        while len(fill.accepted) < self.groups_per_step:
            self.check_relay()
            if await self.stop_decided():
                if self.stop_code == EXIT and fill.counts["judged"]:
                    self.log_unfilled(step, fill)
                return None
            recent = not window.is_stale(self.policy, step, self.async_level)
            self.admit(step, len(fill.accepted), len(pending) + len(self.carry))
            left = self.sampler.remaining()
            if left is not None and len(fill.accepted) + len(pending) + len(self.carry) + len(self.inflight) + left \
                    < self.groups_per_step:
                logger.info(f"the train data is used up; step {step} cannot be filled")
                return None
            if not pending:
                tw = time.monotonic()
                pending = await self.next_finished()
                if not recent:
                    fill.t_wait += time.monotonic() - tw
            while pending:
                group = pending.pop(0)
                if len(fill.accepted) >= self.groups_per_step:
                    self.carry.append(group)
                else:
                    await self.judge(step, group, fill)
            self.carry += pending
            pending = []
            self.report_filling(step, fill)
        return fill

    def report_filling(self, step: int, fill: "StepFill") -> None:
        """Every `FILL_LOG_S` while `step` does not fill (unless only waiting for the
        trainer's weights): one line with how far it got and why groups were dropped, the
        line a watchdog's stall message quotes when the step never fills."""
        now = time.monotonic()
        if now - fill.reported < FILL_LOG_S or self.waiting_for_trainer():
            return
        fill.reported = now
        why = ", ".join(f"{k}: {v}" for k, v in sorted(fill.counts.items()) if k not in ("judged", "spanning") and v)
        logger.info(f"step {step}: {len(fill.accepted)}/{self.groups_per_step} groups accepted after "
                    f"{fill.counts['judged']} judged in {now - fill.t0:.0f}s" + (f" ({why})" if why else ""))

    def log_unfilled(self, step: int, fill: "StepFill") -> None:
        """A metrics row for a step that will not be filled (the run gives up or stops):
        what it judged and why groups were dropped, `filter/unfilled` 1; no reward keys
        (nothing of it is trained)."""
        m = self.step_metrics(step, fill.finished, [], fill.counts, time.monotonic() - fill.t0, fill.t_wait)
        self.metrics.log(step, {**{k: v for k, v in m.items() if not k.startswith("reward/")},
                                "filter/accepted_groups": len(fill.accepted), "filter/unfilled": 1})

    def admit(self, step: int, accepted: int, waiting: int) -> None:
        """Start new groups while the admission limit allows and there is data."""
        while len(self.inflight) < self.admission_limit(step, accepted, waiting):
            picked = self.sampler.next()
            if picked is None:
                return
            slot, row = picked
            self.totals["problems"] += 1
            self.inflight.add(asyncio.create_task(self.generate_group(slot, row, self.client, self.model)))

    async def next_finished(self) -> list[list[Rollout]]:
        """The groups that finish next (waits at most 0.5 s)."""
        if not self.inflight:  # waiting for a policy: new groups start at most 0.01 s after it is loaded
            await asyncio.sleep(0.01)
            return []
        done, self.inflight = await asyncio.wait(self.inflight, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
        return [d.result() for d in done]

    async def judge(self, step: int, group: list[Rollout], fill: "StepFill") -> None:
        """Accept a finished group for `step`, or count why it is dropped; give up after
        `max_errored_groups` errored groups in a row."""
        fill.finished += group
        fill.counts["judged"] += 1
        limit_reached = self.errors.add(group)
        if self.errors.count:  # this group errored: every rollout of it errored or was empty
            fill.counts["errored"] += 1
            envs_mod.note_errored("train", group[0].env, group[0].example_id, self.errors.error)
            if limit_reached:
                self.give_up(step, fill)
            return
        v = judge_group(group, step, self.async_level, self.ocfg.max_off_policy_steps, self.ocfg.online_difficulty_filtering,
                        self.ocfg.advantage, self.ocfg.difficulty_filter)
        fill.counts["spanning"] += v.dropped_spanning
        if v.reason:
            fill.counts[v.reason] += 1
            return
        if self.ocfg.training_mode == "opd":
            await self.add_teacher_logprobs(v.kept)
        fill.accepted.append(v.kept)

    def give_up(self, step: int, fill: "StepFill") -> None:
        """The train env only errors: record what filling `step` judged, then end the run
        with one line quoting the env's last error and naming its worker log."""
        e = self.errors
        self.log_unfilled(step, fill)
        error = e.error if len(e.error or "") <= 300 else e.error[:300] + "..."
        raise EnvFailed(f"train env {e.env!r}: {e.count} groups in a row errored (orchestrator.max_errored_groups="
                        f"{e.limit}); the last: {error}",
                        self.run.env_worker_log(self.logs, "train", e.env) if self.logs is not None else None)

    def write_step(self, step: int, fill: "StepFill") -> None:
        """`rollouts/step_<n>/` (one file per trainer rank), totals, metrics, heartbeat,
        and the snapshot of this step's state (what a checkpoint of the step holds)."""
        kept = [r for g in fill.accepted for r in g]
        samples = [s for r in kept for s in r.to_samples()]
        per_rank = batch.shard(samples, self.cfg.trainer_ranks, self.cfg.micro_batch_size)
        info = {"policies": sorted({r.oldest_policy for r in kept}), "mode": self.ocfg.training_mode,
                "temperature": float(self.ocfg.sampling.temperature)}
        batch.write_step(self.run, step, per_rank, info)
        self.step = step
        self.totals["samples"] += len(samples)
        self.totals["tokens"] += sum(len(s) for s in samples)
        self.snapshots[step] = self.state(step)
        for old in [k for k in self.snapshots if k <= step - SNAPSHOTS_KEPT]:
            del self.snapshots[old]
        metrics = self.step_metrics(step, fill.finished, kept, fill.counts, time.monotonic() - fill.t0, fill.t_wait)
        self.metrics.log(step, metrics)
        self.log_extras(step, kept)
        self.metrics.forward()  # the trainer's new rows, into the same W&B run
        self.progress_at = time.time()
        self.beat()
        logger.info(f"step {step}: {len(samples)} samples, reward {metrics.get('reward/all/mean', 0):.3f}, "
                    f"policy {self.policy}, waited {fill.t_wait:.2f}s for weights")

    def log_extras(self, step: int, kept: list[Rollout]) -> None:
        """Every `wandb.log_extras.interval` steps: a table of sampled rollouts and
        histograms of the step's rewards and advantages (W&B only)."""
        extras = self.cfg.wandb.log_extras
        every = extras.interval
        if self.metrics.wandb is None or not every or step % every or not kept:
            return
        if extras.samples:
            n = max(1, round(len(kept) * extras.sample_ratio))
            picked = random.Random(f"{self.cfg.seed}:{step}").sample(kept, min(n, len(kept)))
            self.metrics.log_table(step, "samples", ["step", "env", "example_id", "prompt", "completion", "reward",
                                                     "advantage"],
                                   [[step, r.env, str(r.example_id), r.prompt_text, r.completion_text, r.reward,
                                     r.advantage] for r in picked])
        if extras.distributions:
            self.metrics.log_histograms(step, {"distributions/reward": [r.reward for r in kept],
                                               "distributions/advantage": [r.advantage for r in kept]})

    async def after_step(self, step: int) -> None:
        """Checkpoint when due; start the eval when due (in the background)."""
        if is_due(step, step == self.max_steps, self.cfg.ckpt):
            self.save_checkpoint(step)
        interval = self.ocfg.eval.interval
        if self.eval_slots and interval and step % interval == 0:
            if self._pending_eval is not None:
                await self._pending_eval
            self._pending_eval = asyncio.create_task(self._eval_and_log(step))

    def check_relay(self) -> None:
        if self.relay_task.done():
            self.relay_task.result()  # raises the relay's error
            raise RuntimeError("weight relay stopped")

    async def stop_decided(self) -> bool:
        """Whether to stop now (`self.stop_code` says how); waits briefly after a SIGTERM
        for the supervisor's decision."""
        from prime_hpc.runtime.stopping import CONTINUE

        if self.stop is None or not self.stop.pending():
            return False
        code = await asyncio.to_thread(self.stop.decision)
        if code == CONTINUE:
            return False
        self.stop_code = code
        return True

    async def wait_for_trainer(self, step: int, timeout_s: float = TRAINER_WAIT_S) -> None:
        """Until the trainer's heartbeat says it is done or at `step` (bounded)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                beat = read_json(self.run.heartbeat("trainer", 0))
            except (OSError, ValueError):
                beat = {}
            if beat.get("done") or int(beat.get("step", 0)) >= step:
                return
            await asyncio.sleep(0.5)

    async def stop_now(self) -> None:
        """Asked to stop: on CHECKPOINT wait for the step the trainer saves and save this
        component's part of it (from that step's snapshot)."""
        from prime_hpc.runtime.stopping import CHECKPOINT, checkpointed_step

        if self.stop_code != CHECKPOINT:
            logger.info(f"stopping at step {self.step} (SIGTERM)")
            return
        deadline = time.monotonic() + CHECKPOINT_WAIT_S
        saved = checkpointed_step(self.run)
        while saved is None and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            saved = checkpointed_step(self.run)
        if saved is None:
            logger.warning(f"the trainer did not say which step it saved within {CHECKPOINT_WAIT_S:g}s; "
                           f"the next attempt continues from the last complete checkpoint")
        elif saved in self.snapshots:
            self.save_checkpoint(saved)
            logger.info(f"checkpointed step {saved} as asked ({self.stop.reason()}); stopping")
        elif saved > 0:
            logger.warning(f"no state kept for step {saved} (kept: {sorted(self.snapshots)}); not checkpointed")

    async def main(self) -> dict:
        from prime_hpc.runtime.metrics import MetricsLogger
        from prime_hpc.runtime.stopping import Stop

        self.load_envs()
        start = resolve_resume_step(self.run, self.cfg.ckpt.step, CHECKPOINT_PARTS)
        if start is not None:
            self.load_checkpoint(start)
        nodes = self.cfg.inference_nodes
        teacher = self.ocfg.teacher.client
        ep = discover(self.run, nodes, timeout_s=SERVERS_WAIT_S, logs=self.logs)
        self.admin = Admin(ep.servers, on_lost=lambda server, why: self.server_lost(ep, server, why))
        if self.ocfg.training_mode == "sft":  # the teacher generates, the student trains on it
            self.use_server(make_client(teacher.base_url, api_key(teacher.api_key_var), max_context=self.cfg.seq_len),
                            teacher.model)
        else:
            self.use_server(make_client(ep.openai_base_url, api_key(), max_context=self.cfg.seq_len))
        if start is not None and self.run.weights_step(start).exists():
            await self.admin.update_weights(self.run.weights_step(start), start)
            self.policy = start
        self.metrics = MetricsLogger(self.run, "orchestrator", self.cfg.wandb, run_name=self.cfg.name,
                                     config=asdict(self.cfg))
        self.metrics.follow("trainer", start or 0)  # one W&B run: the trainer's rows go in through this logger
        logger.info(f"orchestrator: {len(self.slots)} train env(s), {len(self.eval_slots)} eval env(s), "
                    f"router {ep.router}, {len(ep.servers)} server(s), steps {(start or 0) + 1}..{self.max_steps}")
        self.stop = Stop(self.run)  # from here on SIGTERM means: stop at a safe point (maybe checkpoint)
        try:
            await self.loop(start or 0, eval_first=start is None and bool(self.eval_slots) and self.ocfg.eval.at_start
                            and bool(self.ocfg.eval.interval))
            if self.metrics.wandb is not None and self.stop_code is None:
                await self.wait_for_trainer(self.step)  # its last rows belong to the same W&B run
        finally:
            self.metrics.close()
            await self.admin.aclose()
            if self.log_router is not None:
                self.log_router.close()
        return {"last_step": self.step, "policy": self.policy, **self.totals}
