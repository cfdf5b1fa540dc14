"""The weight relay: every new policy the trainer publishes, loaded into every inference
server.

Consumes: `weights/step_<m>/` directories once complete (`STABLE`, written by trainer rank
0), newest first: steps published while a load was under way are skipped. Produces: each
server serving policy m (`Admin.update_weights`: every server drains its in-flight
requests, swaps and stamps later completions with m; with LoRA's
`save_adapter_separately`, `Admin.load_lora` and the servers' adapter `LORA_NAME`, which
`model` then names); `policy`, the newest policy served (0: the initial model), read by
the source's admission and the sink's policy-lag rules; one record per update in
`updates` (handoff: the weights marked -> seen here; seconds of the update call, and of
it the slowest server's drain and load), reported by `gauges`; and a call to `on_policy`
after each update (a step trained is progress for the heartbeat).

With `weights.transport=broadcast` the trainer sends each policy to the servers itself and
writes `sent/step_<m>.json` (`weights/step_<m>` only at checkpoints and the last step): a
new step m in either means the trainer is sending policy m. The relay then calls no server; it waits until
every serving server's `GET /policy` shows m or later (or the server is lost; one that
lags `BROADCAST_WAIT_S`, by which time the trainer has given up on it, is taken out), then
moves `policy` on as above, with the handoff and the wait as the update's times. A joining
server is routed only once it serves the current policy or a later one (the trainer sends
it the newest on its own); until then it stays `loading weights`, with one line in the log
if that takes longer than `fleet.JOIN_TIMEOUT_S`. A resumed run's servers still load the
checkpoint's weights from disk (`serve`).

The relay owns the fleet's membership (`fleet.Membership`, polled between updates): a
server that joins (a restarted one, another job's) is loaded with the current policy
before the router sends it anything, and takes part in every later update; one that
leaves or stops answering is taken out of the router and of later updates; the run goes
on with the others, and with none for a while (an update then only moves `policy`, which
every server that joins loads). An update that fails otherwise stops the relay; `check`
then raises its error in the loop.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Optional

from loguru import logger

from prime_hpc.inference.client import InferenceError
from prime_hpc.orchestrator.fleet import Membership
from prime_hpc.rundir import STABLE, RunDir, read_json, stable_time

LORA_NAME = "policy"  # served name of the run's adapter when only adapters are written
POLL_S = 0.02  # how often weights/ is looked at: on-policy generation waits for each new policy
RECEIVED_POLL_S = 0.05  # broadcast: how often the servers' policies are asked while one is on its way
RECEIVED_WARN_S = 60.0  # broadcast: a server still without the new policy after this is named in the log
BROADCAST_WAIT_S = 660.0  # broadcast: the sender's own timeout and its margin (inference.broadcast)
UNJOINED_WAIT_S = 30.0  # broadcast: ...or this, for a server in no weight group (the trainer gave up on it)


def served_step(answer: dict) -> int:
    """The policy a server's `GET /policy` answer shows (-1: none readable)."""
    try:
        return int(answer.get("policy_step", -1))
    except (TypeError, ValueError):
        return -1


def lags(answer: dict, step: int) -> bool:
    """Does a server's `GET /policy` answer show a policy older than `step`?"""
    return served_step(answer) < step


class WeightRelay:
    def __init__(
        self,
        run: RunDir,
        admin: Any,
        model: str,
        on_policy: Callable[[], None] = lambda: None,
        router: Optional[str] = None,
        transport: str = "filesystem",
        adapter: Optional[str] = None,
        job: Optional[RunDir] = None,
    ) -> None:
        """`adapter`: this run is one of several sharing the servers, its policy the adapter
        of that name (every update, a resume's included, loads it; the base model's step
        on the servers is not this run's); `job`: the job whose head keeps those servers'
        membership (`follow`)."""
        self.run = run
        self.job = job
        self.unready: set[str] = set()  # servers of the job's fleet named for not taking the adapter
        self.adapter = adapter
        self.lora_name = adapter or LORA_NAME  # the served name of the run's adapter
        self.broadcast = transport == "broadcast"  # the trainer sends the policies; see the module docstring
        self.admin = admin
        self.model = model  # the name generation asks for
        self.on_policy = on_policy
        self.policy = 0
        self.loaded: Optional[tuple[str, str]] = None  # what the servers hold: ("full" | "adapter", path)
        self.updates: list[dict] = []
        self.task: Optional[asyncio.Task] = None
        self.members = (
            Membership(run, admin, router, self.synced if self.broadcast else self.load_into) if router else None
        )

    async def serve(self, step: int) -> None:
        """Load `weights/step_<step>` into every server now (a resumed run's policy)."""
        if self.adapter is not None:
            path = self.run.weights_adapter(step)
            await self.admin.load_lora(self.lora_name, path, step)
            self.policy, self.loaded, self.model = step, ("adapter", str(path)), self.lora_name
            return
        await self.admin.update_weights(self.run.weights_step(step), step)
        self.policy, self.loaded = step, ("full", str(self.run.weights_step(step)))

    async def load_into(self, server: str, endpoint: dict) -> int:
        """Load the current policy into `server` alone (a joining one); returns its step."""
        if self.loaded is None:  # still the base model
            if endpoint.get("policy_step", 0) != 0:
                await self.admin.reload_base(to=[server])
            return 0
        kind, path = self.loaded
        if kind == "adapter":
            await self.admin.load_lora(self.lora_name, path, self.policy, to=[server])
        elif endpoint.get("policy_step") != self.policy or endpoint.get("weight_dir") != path:
            await self.admin.update_weights(path, self.policy, to=[server])
        return self.policy

    async def synced(self, server: str, endpoint: dict) -> Optional[int]:
        """Broadcast: the policy a joining `server` serves once it may be routed, None while
        it may not. It may when it serves the current policy, or a later one this run made
        (still listed in `weights/` or `sent/`: a resume clears the policies of the future it
        discarded, which a server that outlived the requeue may still serve). Otherwise,
        when the current policy is the base model or its weights are on disk (a
        checkpoint, the start of a resumed run) it loads them from there now; else the
        trainer sends it the newest by itself, and it is asked again at the next poll."""
        step = served_step((await self.admin.policy_of(to=[server]))[server])
        if step == self.policy or (step > self.policy and step in self.run.policy_steps()):
            return step
        if self.policy == 0:  # the base model: from its own files
            await self.admin.reload_base(to=[server])
            return 0
        if self.run.has_weights(self.policy):
            await self.admin.update_weights(self.run.weights_step(self.policy), self.policy, to=[server])
            return self.policy
        return None

    async def watch(self) -> None:
        """Keep the membership current and load every new `weights/step_m` into all
        servers, newest first (until cancelled)."""
        while True:
            if self.members is not None:
                await self.members.poll()
            elif self.job is not None:
                await self.follow()
            steps = self.run.policy_steps() if self.broadcast else self.run.weight_steps()
            if steps and steps[-1] > self.policy:
                await self.update(steps[-1])
            await asyncio.sleep(POLL_S)

    async def follow(self) -> None:
        """One run of several: the job's head keeps the servers' membership
        (`fleet/membership.json` of the job, `prime_hpc.job.runs`). A server it made a member
        (restarted in its slot: a new URL) gets this run's current adapter, then this run's
        updates; one it took out gets none. A server that cannot take the adapter now is
        tried again at the next poll."""
        from prime_hpc.rundir.fleet import REMOVED, SERVING, read_membership

        assert self.job is not None
        for slot, m in read_membership(self.job).items():
            url = str(m.get("url"))
            if m.get("state") == REMOVED and url in self.admin.servers:
                self.admin.remove(url)
                logger.info(f"inference server {slot} ({url}) left the job's fleet; updates skip it")
            elif m.get("state") == SERVING and url not in self.admin.live:
                try:
                    if self.loaded is not None and self.loaded[0] == "adapter":
                        await self.admin.load_lora(self.lora_name, self.loaded[1], self.policy, to=[url])
                except InferenceError as e:
                    if url not in self.unready:
                        self.unready.add(url)
                        logger.warning(f"inference server {slot} ({url}) could not take this run's adapter yet: {e}")
                    continue
                self.admin.add(url)
                logger.info(
                    f"inference server {slot} ({url}) joined the job's fleet at this run's policy {self.policy}"
                )

    async def update(self, step: int) -> None:
        t0 = time.monotonic()
        d = self.run.weights_step(step)
        written = stable_time(d)
        if self.broadcast and not self.run.has_weights(step):
            try:
                written = float(read_json(self.run.sent_step(step))["sent_at"])
            except (OSError, ValueError, KeyError, TypeError):
                pass
        handoff = max(0.0, time.time() - written)  # written -> seen here
        try:
            serve = read_json(d / STABLE).get("serve")  # the marker holds the weights' metadata
        except (OSError, ValueError):
            serve = None
        if self.broadcast:
            answers = await self.received(step)
        elif (
            self.adapter is not None
            or serve == "adapter"
            or (serve is None and not any(d.glob("*.safetensors")) and self.run.weights_adapter(step).is_dir())
        ):
            # LoRA with save_adapter_separately, or one run of several: the servers keep the base
            # model and load the adapter
            answers = await self.admin.load_lora(self.lora_name, self.run.weights_adapter(step), step)
            self.model = self.lora_name
            self.loaded = ("adapter", str(self.run.weights_adapter(step)))
        else:
            answers = await self.admin.update_weights(d, step)
            self.loaded = ("full", str(d))
        self.updates.append(
            {
                "step": step,
                "seconds": time.monotonic() - t0,
                "handoff": handoff,
                # the slowest server's wait for its in-flight generations, and its load
                "drain": max((float(a.get("drain_s", 0)) for a in answers), default=0.0),
                "load": max((float(a.get("load_s", 0)) for a in answers), default=0.0),
            }
        )
        self.policy = step
        if self.members is not None:
            self.members.updated(step)
        logger.info(
            f"inference now serves policy {step} ({time.monotonic() - t0:.2f}s, {len(answers)} server(s))"
            if answers
            else f"policy {step}: no server serving now; every server that joins loads it"
        )
        self.on_policy()  # a step trained: a wait for the trainer's weights ends

    async def received(self, step: int) -> list[dict]:
        """Broadcast: wait until every serving server serves policy `step` or a later one
        (keeping the membership current meanwhile: a server that is lost or leaves is not
        waited for); their `GET /policy` answers. A server that lags `BROADCAST_WAIT_S`, or
        `UNJOINED_WAIT_S` while it is in no weight group (`weights_joined` false: the trainer's
        join or send failed), leaves the fleet: the trainer gave up on it."""
        t0, warned = time.monotonic(), False
        unjoined: dict[str, float] = {}  # server -> since when it is in no weight group
        while True:
            if self.members is not None:
                await self.members.poll()
            answers, behind = await self._policies()
            behind.update({s: f"serves {a.get('policy_step')}" for s, a in answers.items() if lags(a, step)})
            if not behind:
                return list(answers.values())
            waited = time.monotonic() - t0
            for server in [s for s in behind if s in answers and answers[s].get("weights_joined") is False]:
                if time.monotonic() - unjoined.setdefault(server, time.monotonic()) > UNJOINED_WAIT_S:
                    self.drop(server, f"policy {step} did not reach it: it is in no weight group (it {behind[server]})")
            if waited > BROADCAST_WAIT_S:  # a server that answers with errors all along too
                for server in [s for s in behind if s in self.admin.live]:
                    self.drop(server, f"policy {step} did not reach it in {waited:.0f}s (it {behind[server]})")
            elif waited > RECEIVED_WARN_S and not warned:
                warned = True
                logger.warning(
                    f"policy {step}: {len(behind)} server(s) still without it after {waited:.0f}s "
                    f"({'; '.join(f'{s} {why}' for s, why in behind.items())}); waiting for the trainer's send"
                )
            await asyncio.sleep(RECEIVED_POLL_S)

    async def _policies(self) -> tuple[dict[str, dict], dict[str, str]]:
        """Every live server's `GET /policy`, and why for those that did not answer it (an
        error from one server spoils none of the others' answers)."""
        try:
            return await self.admin.policy_of(), {}
        except InferenceError:
            pass
        live = list(self.admin.live)
        results = await asyncio.gather(*(self.admin.policy_of(to=[s]) for s in live), return_exceptions=True)
        answers: dict[str, dict] = {}
        errors: dict[str, str] = {}
        for server, r in zip(live, results):
            if isinstance(r, BaseException):
                errors[server] = f"gives no policy ({r})"
            else:
                answers.update(r)
        return answers, errors

    def drop(self, server: str, why: str) -> None:
        """Take `server` out of the fleet (the router and later updates) although it answers,
        and ask its supervisor to restart it (a fresh server rejoins in its slot and gets the
        current policy; one left alive would sit idle for the rest of the run)."""
        if self.members is None:
            self.admin.remove(server)
            logger.warning(f"inference server {server} is left out: {why}")
            return
        slot = self.members.slot_of(server)
        self.members.lost(server, why)
        if slot is not None:
            from prime_hpc.rundir.fleet import read_process, request_restart

            log = read_process(self.run, slot).get("log") or "its job's inference log"
            request_restart(self.run, slot, f"left out by the orchestrator: {why}", log)
            logger.warning(f"inference server {slot} ({server}): asked its supervisor to restart it; see {log}")

    def start(self) -> None:
        self.task = asyncio.create_task(self.watch())

    def check(self) -> None:
        """Raise the relay's error if it stopped."""
        if self.task is not None and self.task.done():
            self.task.result()
            raise RuntimeError("weight relay stopped")

    async def aclose(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    def serving(self) -> int:
        """Servers that generate with the current policy now (`inference/servers`)."""
        if self.members is not None:
            return self.members.serving()
        return len(self.admin.live) if self.admin is not None else 0

    def server_lost(self, server: str, why: str) -> None:
        """The admin client found `server` no longer answering: it leaves the fleet."""
        if self.members is not None:
            self.members.lost(server, why)
        else:
            logger.warning(f"inference server {server} is gone ({why}); weight updates skip it from now on")

    def gauges(self) -> dict:
        """The relay's numbers in a step's metrics row (the newest update's times)."""
        last = self.updates[-1] if self.updates else {}
        return {
            "off_policy/policy": self.policy,
            "inference/servers": self.serving(),
            # the newest policy update: weights marked -> seen by the relay, and the update call to every server
            "time/weight_handoff": last.get("handoff", 0.0),
            "time/weight_update": last.get("seconds", 0.0),
            "time/weight_drain": last.get("drain", 0.0),
            "time/weight_load": last.get("load", 0.0),
        }
