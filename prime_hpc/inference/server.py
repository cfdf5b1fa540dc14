"""`python -m prime_hpc.inference --config <run>/configs/inference.yaml`: one vLLM OpenAI
server on this node, for the run's model, with in-place weight updates.

vLLM's own app serves the OpenAI API and `/health` (its `/pause`, `/resume` and
weight-transfer routes exist only with `VLLM_SERVER_DEV_MODE=1`, never set here). This
module adds what is missing for RL:

  POST /update_weights     {"weight_dir": ".../weights/step_N", "step": N?}
                           load the full HF safetensors weights the trainer wrote, in place
  POST /reload_weights     back to the base model (policy step 0)
  POST /load_lora_adapter  {"lora_name", "lora_path", "step"?}: load/replace an adapter (in a
                           job of several runs, `inference.lora.runs` > 1: run <lora_name>'s
                           policy, its step kept apart in "adapters")
  GET  /policy             {"policy_step", "weight_dir", "adapters", "in_flight", "workers", ...}

With `weights.transport=broadcast` vLLM is started with a weight-transfer backend (gloo on
CPU, NCCL on GPUs) and the trainer sends each policy over a process group of its own, one
per server (`prime_hpc.inference.broadcast`: it is rank 0, this server's workers the next):

  POST /weights/join       {"store_path" (one host) or "master_address", "master_port",
                           "world_size", "rank_offset", "timeout_s"?}: join the sender's group
                           (answers once joined)
  POST /weights/receive    {"step", "names", "dtype_names", "shapes", "digests"}: receive a
                           policy over the group and serve it, applied like an update from a
                           directory; one that differs from its digests is never served: 409
                           at once, and the step is loaded from the run's weights/step_<n>
  POST /weights/leave      leave the group

An update (`inference.weight_update`, see `gate.py`) either goes in flight: it pauses the
engine keeping the requests in flight and their KV cache (vLLM's keep mode), loads and
resumes, so those requests finish under the new policy; or drains: it waits for the
generations in flight to finish, keeps new ones waiting, reloads and clears the prefix
cache. Every request is salted with its policy, so none reuses another policy's cached
prefix. Every completion carries the policies that produced it (`policy_step`, the oldest,
and `policy_step_end`). Every route except `/health` needs `Authorization: Bearer
<key>`, the job's `INFERENCE_SERVER_API_KEY`; without that variable the server does not
start.

The server is named by its slot (`inference_<node>`; `rundir.server_slot`; a server of an
extra inference job, `prime-hpc scale`: `inference_<job id>.<node>`, `--extra-job`). Once
healthy, it publishes `endpoints/<slot>.json` (address, port, slot, job, node, pid, its
`instance`: a random id of this process, model, policy step) and rewrites it after each
update; it removes it when it stops. It answers `GET /identity?nonce=` (open) with its
proof that it holds the job's key as that instance, and takes requests signed for that
instance (`gate.Proofs`): the router and the weight relay send it nothing before. Generation
reaches it only through the router, to which the orchestrator's weight relay adds it once
it has loaded the run's current policy (docs/inference.md#the-fleet).

A server of an extra job leaves the run without failing a request when its job's script
asks (`logs/extra/<id>/leave`: the job's time limit is near, `prime-hpc scale -N`, the run
ended): it removes its endpoint first (the relay then takes it out of the router and of
later updates), waits until the router no longer lists it and its requests in flight have
finished (at most `DRAIN_TIMEOUT_S` in all), then exits 0. SIGTERM or SIGUSR2 (a plain
scancel, a preemption) start the same, but SLURM signals vLLM's engine process too, which
then stops at once. While it serves, it publishes its endpoint again if the file is gone
without its doing (a new attempt of the run's job empties `endpoints/`).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Iterable, Optional, TypeGuard

from fastapi import Request

from prime_hpc.config.component import InferenceRunConfig, typed
from prime_hpc.config.schema import InferenceConfig
from prime_hpc.core import device as devices
from prime_hpc.core import jobenv
from prime_hpc.core.errors import UserError
from prime_hpc.core.net import address_env, node_address, url
from prime_hpc.inference.broadcast import DIGEST_MISMATCH, NCCL_UNIQUE_ID_BYTES, TIMEOUT_S
from prime_hpc.inference.client import LEAVING_STATUS, api_key
from prime_hpc.inference.gate import GateMiddleware, PolicyGate, UpdateTimeout
from prime_hpc.inference.vllm_plugin import SERVER_PID_VAR
from prime_hpc.rundir import BEAT_S, RunDir, atomic_write_json, jobs, logtree, read_json, server_slot
from prime_hpc.runtime.limits import raise_open_files

PROCESS_STARTED_AT = time.time()  # this module is imported as the server process starts
TMP_DIR_PREFIX = "prime-hpc-inference-"  # <tmp>/prime-hpc-inference-<pid>.<random>: a server's own temporary directory
UPDATE_DRAIN_TIMEOUT_S = 600.0  # longest an update waits for in-flight generations
# Longest a server of an extra job takes to leave (router first, then its requests in
# flight): within SLURM's KillWait (30 s by default) after a cancel's SIGTERM.
DRAIN_TIMEOUT_S = 20.0
DRAIN_QUIET_S = 0.5  # no request in flight for this long: nothing is on its way any more
NO_WEIGHT_GROUP = "this server was started without a weight group (set weights.transport=broadcast)"
ENGINE_STOPPING = "Server shutting down"  # vLLM's engine's refusal of any call once it was signalled to stop
HALF_LOADED_RC = 75  # exit code of a server whose weights failed to arrive midway (see exit_half_loaded)
TIED_ON_CPU = (
    "this model ties its input and output embeddings: in-place updates are wrong "
    "on CPU vLLM; use a model with tie_word_embeddings=false"
)


def load_config(path: str) -> InferenceRunConfig:
    """The server's config, read from a file that is the user's alone, checked on the
    descriptor it is read from (`usercache.read_own`): a config that someone else wrote,
    can write, or swaps in through a link could turn on remote code or a vLLM plugin
    (`inference.extra_args`), run as this user. One line naming it otherwise."""
    import yaml

    from prime_hpc.core import usercache

    try:
        raw = yaml.safe_load(usercache.read_own(path)) or {}
    except usercache.Untrusted as e:
        raise UserError(
            f"inference config {e}: a server loads only a config of yours that nobody else can write"
        ) from None
    except OSError as e:
        raise UserError(f"cannot read inference config {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise UserError(f"inference config {path} is not valid YAML: {e}") from None
    return typed(InferenceRunConfig, raw, f"inference config {path}")


def data_parallel_size(inf: InferenceConfig, gpus_per_node: int, device: str) -> int:
    if inf.data_parallel_size:
        return inf.data_parallel_size
    if device == "cuda" and gpus_per_node:
        return max(1, gpus_per_node // inf.tensor_parallel_size)
    return 1


def vllm_args(cfg: InferenceRunConfig, model_path: str, host: str) -> list[str]:
    """The vLLM server command line for this run (port 0: the kernel picks one)."""
    inf = cfg.inference
    m = inf.model
    argv = [
        "--model",
        model_path,
        "--served-model-name",
        cfg.model.name,
        "--host",
        host,
        "--port",
        "0",
        "--dtype",
        inf.dtype,
        "--gpu-memory-utilization",
        str(inf.gpu_memory_utilization),
        "--tensor-parallel-size",
        str(inf.tensor_parallel_size),
        "--seed",
        str(cfg.seed),
        # logprobs after temperature/top-k/top-p, i.e. of the distribution actually sampled
        # from: what the trainer's importance ratio compares against
        "--logprobs-mode",
        "processed_logprobs",
        # the token-in/token-out route (`/inference/v1/generate`) verifiers v1's train client
        # samples through; behind the gate like every other route
        "--enable-scale-out",
    ]
    if inf.max_model_len:
        argv += ["--max-model-len", str(inf.max_model_len)]
    dp = data_parallel_size(inf, cfg.gpus_per_node, cfg.device)
    if dp > 1:
        argv += ["--data-parallel-size", str(dp)]
    if m.enable_auto_tool_choice:
        argv.append("--enable-auto-tool-choice")
    if m.tool_call_parser:
        argv += ["--tool-call-parser", m.tool_call_parser]
    if m.reasoning_parser:
        argv += ["--reasoning-parser", m.reasoning_parser]
    if cfg.model.trust_remote_code:
        argv.append("--trust-remote-code")
    if cfg.lora.enabled:
        argv += ["--enable-lora", "--max-lora-rank", str(cfg.lora.rank)]
        if cfg.lora.runs > 1:  # one adapter per run of the job, all in one batch
            argv += ["--max-loras", str(cfg.lora.runs), "--max-cpu-loras", str(cfg.lora.runs)]
    if cfg.weights.transport == "broadcast":
        backend = devices.weight_transfer_backend(cfg.device)
        argv += ["--weight-transfer-config", json.dumps({"backend": backend})]
    return argv + [str(a) for a in inf.extra_args]


def engine_env(cfg: InferenceRunConfig) -> dict[str, str]:
    """What the engine needs in its environment on this device (CPU: KV cache space and
    threads from the config, or from the CPUs SLURM gave this task)."""
    inf = cfg.inference
    cpu_ids = os.environ.get(devices.CPUS_VAR) or None  # the cores the launcher pinned this server to
    threads = inf.cpu_threads or (
        None
        if cpu_ids
        else int(os.environ["SLURM_CPUS_PER_TASK"])
        if os.environ.get("SLURM_CPUS_PER_TASK", "").isdigit()
        else None
    )
    env = devices.inference_env(cfg.device, inf.cpu_kvcache_space_gb, threads, cpu_ids)
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    return env


def step_of(weight_dir: str) -> Optional[int]:
    m = re.search(r"step_(\d+)/?$", str(weight_dir))
    return int(m.group(1)) if m else None


class Server:
    """State shared by the added routes: the engine, the gate, what to publish."""

    def __init__(self, cfg: InferenceRunConfig, model_path: str, host: str, extra_job: Optional[str] = None) -> None:
        self.cfg = cfg
        self.model_path = model_path
        self.host = host
        self.port = 0
        self.node = jobenv.node_rank()
        self.extra_job = extra_job  # the id of the extra inference job this server belongs to (None: the run's)
        self.slot = jobenv.slot() or server_slot(self.node, extra_job, cfg.group)
        self.draining: Optional[str] = None  # why it leaves, once it does
        self.instance = secrets.token_hex(16)  # this process, in its endpoint: what it proves it is
        self.engine_stopping = False  # vLLM's engine refused a call: it was signalled to stop
        self.run = RunDir(cfg.output_dir, cfg.group)
        self.gate = PolicyGate(step=0, weight_dir=None)
        self.engine: Any = None
        self.app: Any = None
        self.healthy = False
        self.healthy_at: Optional[float] = None
        self.tied_on_cpu = False
        self.updates = 0
        self.workers = 1  # vLLM workers (ranks of a weight group), once the engine is up
        self.dtype: Optional[str] = None  # the dtype the engine holds the weights in ("bfloat16"), once it is up
        self.broadcast = cfg.weights.transport == "broadcast"
        self.joined: Optional[dict] = None  # the weight group joined (broadcast), as the sender gave it
        self.transfer_lock = asyncio.Lock()  # one join, leave or receive at a time
        self.receiving: set = set()  # receives under way (one refused by its digests loads the step from disk)
        self.device_name = devices.inference_device_name(cfg.device)

    # ------------------------------------------------------------------ publishing
    def endpoint(self) -> dict:
        return {
            "url": url(self.host, self.port),
            "host": self.host,
            "port": self.port,
            "slot": self.slot,
            "job_id": os.environ.get("SLURM_JOB_ID"),
            "slurm_step": jobenv.slurm_step(),
            "node": self.node,
            "extra": self.extra_job is not None,
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "instance": self.instance,
            "model": self.cfg.model.name,
            "policy_step": self.gate.step,
            "weight_dir": self.gate.weight_dir,
            "adapters": dict(self.gate.adapters),  # several runs: each run's policy step
            "updated_at": time.time(),
            "process_started_at": PROCESS_STARTED_AT,  # start-up = healthy_at - process_started_at
            "healthy_at": self.healthy_at,
            "device_name": self.device_name,  # what it computes on, and on how many devices (bench MFU)
            "devices": max(1, int(self.cfg.gpus_per_node)),
        }

    def identity(self) -> Optional[dict]:
        """What it proves to be at its identity challenge (`gate.GateMiddleware`); None
        until it knows its port."""
        if not self.port:
            return None
        return {"url": url(self.host, self.port), "instance": self.instance, "pid": os.getpid(), "slot": self.slot}

    def publish(self) -> None:
        if self.draining:  # it has left: never announced again
            return
        atomic_write_json(self.run.inference_endpoint(self.slot), self.endpoint(), durable=False)

    def beat(self) -> None:
        """The heartbeat: from the serving loop, so it stops when the loop does; its progress
        is a finished generation or update (an engine that hangs with either under way makes
        none), and an idle server only waits for the orchestrator."""
        gate = self.gate
        self.run.beat_as(
            self.run.server_heartbeat(self.slot),
            slurm_step=jobenv.slurm_step(),
            policy_step=gate.step,
            in_flight=gate.active,
            updating=gate.update_under_way,
            progress_at=gate.progress_at,
            waiting_on=None if gate.busy else "orchestrator",
        )

    def unpublish(self) -> None:
        try:
            os.unlink(self.run.inference_endpoint(self.slot))
        except OSError:
            pass

    def republish_if_gone(self) -> None:
        """A server of an extra job that still serves publishes its endpoint again when the
        file is gone without its doing: a new attempt of the run's job (a requeue) empties
        `endpoints/`, and the relay of that attempt syncs it again."""
        if self.extra_job is None or self.draining or not self.healthy:
            return
        if not self.run.inference_endpoint(self.slot).exists():
            self.publish()
            print(
                f"prime-hpc inference: {self.slot} published its endpoint again (the run's job restarted)", flush=True
            )

    def leave(self) -> None:
        """What an extra job's server leaves behind as it exits: nothing (its endpoint and
        heartbeat go: the run does not wait for it)."""
        self.unpublish()
        if self.extra_job is not None:
            self.run.server_heartbeat(self.slot).unlink(missing_ok=True)

    # ------------------------------------------------------------------ leaving (extra jobs)
    async def drain(self, why: str) -> None:
        """Leave the run without failing a request: the endpoint goes first, then wait (at
        most `DRAIN_TIMEOUT_S` in all) until the router no longer lists this server and no
        request is in flight, then shut down (SIGINT: vLLM's own graceful stop)."""
        if self.draining:
            return
        self.draining = why
        t0 = time.monotonic()
        deadline = t0 + DRAIN_TIMEOUT_S
        self.unpublish()
        print(f"prime-hpc inference: {self.slot} leaves the run ({why}): endpoint removed", flush=True)
        routed = await self._wait_unrouted(deadline)
        quiet = await self._wait_quiet(deadline)
        print(
            f"prime-hpc inference: {self.slot} left after {time.monotonic() - t0:.1f}s: "
            f"{'out of the router' if routed else 'still in the router (timed out)'}, "
            f"{'no request in flight' if quiet else f'{self.gate.active} request(s) still in flight (timed out)'}, "
            f"{self.gate.served} served, policy {self.gate.step}",
            flush=True,
        )
        os.kill(os.getpid(), signal.SIGINT)

    async def _wait_unrouted(self, deadline: float) -> bool:
        """Until the run's router no longer lists this server (True), or `deadline`
        (False). No router to ask, or none that proves itself against `router.json`
        (`client.RouterLink`: asked signed, never with the key): True."""
        import httpx

        from prime_hpc.inference.client import NotProven, RouterLink

        me = url(self.host, self.port)
        link = RouterLink(self.run.router_endpoint)
        async with httpx.AsyncClient(timeout=5, auth=link.auth()) as client:
            while time.monotonic() < deadline:
                try:
                    router = str(read_json(self.run.router_endpoint)["url"])
                    workers = (await client.get(router + "/workers")).json()["workers"]
                except NotProven as e:
                    print(f"prime-hpc inference: {self.slot} does not ask the router: {e}", flush=True)
                    return True
                except (OSError, ValueError, KeyError, TypeError, httpx.HTTPError):
                    return True
                if me not in [w.get("url") for w in workers]:
                    return True
                await asyncio.sleep(0.2)
        return False

    async def _wait_quiet(self, deadline: float) -> bool:
        """Until no generation has been in flight for `DRAIN_QUIET_S` (True), or
        `deadline` (False)."""
        quiet_since: Optional[float] = None
        while time.monotonic() < deadline:
            if self.gate.active:
                quiet_since = None
            elif quiet_since is None:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= DRAIN_QUIET_S:
                return True
            await asyncio.sleep(0.05)
        return False

    # ------------------------------------------------------------------ weight updates
    async def _swap(self, load, step: int, weight_dir: Optional[str], adapter: Optional[str] = None) -> Any:
        """Apply `load` (new weights) as `inference.weight_update` says; the answer gives
        the wait before it (`drain_s`: for the requests in flight to finish, or for the
        engine to pause) and the load itself (`load_s`). `adapter`: the policy of one run
        of several (its adapter's name) moves to `step`, not the server's own."""
        t0 = time.monotonic()
        in_flight = self.cfg.inference.weight_update == "in_flight"
        if self.draining:
            return self._leaving_answer(step)
        try:
            async with self.gate.updating() if in_flight else self.gate.exclusive(UPDATE_DRAIN_TIMEOUT_S):
                if await self.engine.is_paused():
                    return _error(409, "generation is paused (POST /resume first): an update pauses by itself")
                if in_flight:
                    await self.engine.pause_generation(mode="keep", clear_cache=False)
                waited = time.monotonic() - t0
                try:
                    await load()
                    if not in_flight:  # nothing in flight: the old policy's cached prefixes go at once
                        await self.engine.reset_prefix_cache()
                    if adapter is not None:
                        self.gate.adapters[adapter] = step
                    else:
                        self.gate.step, self.gate.weight_dir = step, weight_dir
                    self.updates += 1
                finally:
                    if in_flight and not self.stopping(sys.exc_info()[1]):
                        await self.engine.resume_generation()
        except UpdateTimeout as e:
            return _error(503, f"update not applied: {e}")
        except Exception as e:
            if self.stopping(e):
                return self._leaving_answer(step)
            raise
        self.publish()
        print(
            f"prime-hpc inference: {self.slot} serves {f'run {adapter} ' if adapter else ''}policy {step} "
            f"(update {self.updates}, "
            f"{'in flight, pause' if in_flight else 'drain'} {waited:.2f}s, load {time.monotonic() - t0 - waited:.2f}s)",
            flush=True,
        )
        return {
            "status": "ok",
            "policy_step": step,
            "weight_dir": weight_dir,
            "drain_s": round(waited, 4),
            "load_s": round(time.monotonic() - t0 - waited, 4),
        }

    def stopping(self, e: Optional[BaseException] = None) -> bool:
        """Is this server on its way out (leaving the run, or its engine stopping: SLURM
        signals vLLM's engine process too, which then refuses every call)?"""
        if e is not None and ENGINE_STOPPING in str(e):
            self.engine_stopping = True
        return bool(self.draining) or self.engine_stopping or bool(self.engine.errored)

    def _leaving_answer(self, step: int) -> Any:
        """A server on its way out takes no update: 410, which the run reads as this server
        having left (not as a failed update)."""
        why = self.draining or "its engine is shutting down"
        print(f"prime-hpc inference: {self.slot} takes no policy {step}: it is leaving ({why})", flush=True)
        return _error(LEAVING_STATUS, f"{self.slot} is leaving the run ({why}): policy {step} not applied")

    async def update_weights(self, body: dict) -> Any:
        weight_dir = body.get("weight_dir") or body.get("weights_path")
        if not weight_dir:
            return _error(400, "body needs 'weight_dir': a directory with HF safetensors weights")
        d = Path(weight_dir)
        if not d.is_dir() or not any(d.glob("*.safetensors")):
            return _error(400, f"{weight_dir}: no *.safetensors weights there")
        step = body.get("step", step_of(weight_dir))
        if step is None:
            return _error(400, f"give 'step': it cannot be read from {weight_dir} (expected .../step_<n>)")
        if self.tied_on_cpu:
            return _error(409, TIED_ON_CPU)

        async def load():
            await self.engine.collective_rpc("reload_weights", kwargs={"weights_path": str(d)})

        return await self._swap(load, int(step), str(d))

    async def reload_base(self) -> Any:
        async def load():
            await self.engine.collective_rpc("reload_weights", kwargs={"weights_path": self.model_path})

        if self.tied_on_cpu and self.gate.step == 0:
            return {"status": "ok", "policy_step": 0, "weight_dir": None}
        return await self._swap(load, 0, None)

    async def load_lora(self, body: dict) -> Any:
        from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            return _error(400, "body needs 'lora_name' and 'lora_path'")
        if not self.cfg.lora.enabled:
            return _error(409, "this server was started without LoRA (trainer.model.lora.enabled=false)")
        step = body.get("step", step_of(path))
        # a job of several runs: each adapter is one run's policy, with a step of its own
        adapter = str(name) if self.cfg.lora.runs > 1 else None
        result: dict = {}

        async def load():
            models = self.app.state.openai_serving_models
            resp = await models.load_lora_adapter(
                LoadLoRAAdapterRequest(lora_name=name, lora_path=str(path), load_inplace=True)
            )
            if not isinstance(resp, str):
                result["error"] = resp.model_dump() if hasattr(resp, "model_dump") else str(resp)

        out = await self._swap(
            load, int(step) if step is not None else self.gate.step_for(name), str(path), adapter=adapter
        )
        if result.get("error"):
            return _error(400, f"adapter not loaded: {result['error']}")
        return out

    # ------------------------------------------------------------------ weights by broadcast
    def _refuse_transfer(self) -> Any:
        if not self.broadcast:
            return _error(409, NO_WEIGHT_GROUP)
        if self.tied_on_cpu:
            return _error(409, TIED_ON_CPU)
        return None

    async def join_weights(self, body: dict) -> Any:
        """Join the sender's group (any earlier one is left first); answers once every rank
        has joined, or with the error when the sender does not come within its timeout."""
        refused = self._refuse_transfer()
        if refused is not None:
            return refused
        info, problem = join_info(
            body, self.workers, devices.weight_transfer_backend(self.cfg.device), self.run.rendezvous_dir
        )
        if problem:
            return _error(400, problem)
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        async with self.transfer_lock:
            if self.joined is not None:
                self.joined = None
                await self.engine.shutdown_weight_transfer_engine()
            t0 = time.monotonic()
            try:
                await self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))
            except Exception as e:
                return _error(500, f"did not join the weight group: {_one_line(e)}")
            self.joined = info
        sender = _sender(info)
        print(
            f"prime-hpc inference: {self.slot} joined the weight group of {sender} (ranks {info['rank_offset']}..{info['rank_offset'] + self.workers - 1} "
            f"of {info['world_size']}, {time.monotonic() - t0:.2f}s)",
            flush=True,
        )
        return {"status": "ok", "workers": self.workers, "world_size": info["world_size"]}

    async def receive_weights(self, body: dict) -> Any:
        """Receive policy `step` over the group and serve it (as `_swap` applies any update).
        What arrived differs from the digests the sender gave (gloo): the answer comes at
        once (409, `"refused": "digest"`, the directory the step is loaded from instead),
        while the update goes on without serving it (`_load_refused`)."""
        refused = self._refuse_transfer()
        if refused is not None:
            return refused
        step, info, problem = receive_info(body, digests=devices.weight_transfer_backend(self.cfg.device) == "gloo")
        if problem:
            return _error(400, problem)
        if self.joined is None:
            return _error(409, "no weight group: the sender has not joined (POST /weights/join first)")
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        joined, differs = self.joined, asyncio.get_running_loop().create_future()
        reloaded: list[str] = []

        async def load():
            await self.engine.start_weight_update()
            try:
                await self.engine.update_weights(WeightTransferUpdateRequest(update_info=info))
                await self.engine.finish_weight_update(weight_version=str(step))
            except Exception as e:  # the layers are half loaded (vLLM's layerwise reload): never serve them
                if self.stopping(e):  # it never serves again anyway
                    raise
                if DIGEST_MISMATCH not in str(e):
                    self.exit_half_loaded(step, e)
                reloaded.append(await self._load_refused(step, joined, e, differs))

        async def receive() -> Any:
            async with self.transfer_lock:
                try:
                    answer = await self._swap(load, step, None)
                except Exception as e:  # the group's state is unknown now: the sender joins again
                    self.joined = None
                    print(f"prime-hpc inference: {self.slot} did not receive policy {step}: {_one_line(e)}", flush=True)
                    return _error(500, f"policy {step} not received: {_one_line(e)}; join again")
                if reloaded and self.gate.step == step:
                    self.gate.weight_dir = reloaded[0]
                    self.publish()
                return answer

        task = asyncio.ensure_future(receive())
        self.receiving.add(task)  # held until done: a refused one goes on after its answer
        task.add_done_callback(self.receiving.discard)
        await asyncio.wait({task, differs}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        return _refused_answer(step, differs.result())  # it goes on: the step from the sender's files

    async def _load_refused(self, step: int, joined: dict, e: BaseException, differs: asyncio.Future) -> str:
        """Policy `step` came over the group but differs from its digests: said in one line
        naming the sender, the route answered (`differs`), the group dropped (the sender joins
        a fresh one), and the step loaded from `weights/step_<step>` once the sender has
        written it, while generation stays paused; never served otherwise (the server exits
        as half loaded when it does not come within the group's timeout)."""
        from prime_hpc.rundir import is_stable

        where = self.run.weights_step(step)
        detail = str(e)[str(e).index(DIGEST_MISMATCH) :].splitlines()[0].rstrip("'\". ")
        print(
            f"prime-hpc inference: {self.slot} refused policy {step} from {_sender(joined)}: {detail}; "
            f"none of it is served, the step is loaded from {where}",
            flush=True,
        )
        self.joined = None
        differs.set_result(str(where))
        try:
            await self.engine.shutdown_weight_transfer_engine()
            deadline = time.monotonic() + float(joined.get("timeout_s", TIMEOUT_S))
            while not is_stable(where):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{where} was not written within {joined.get('timeout_s', TIMEOUT_S):g}s")
                await asyncio.sleep(0.2)
            await self.engine.collective_rpc("reload_weights", kwargs={"weights_path": str(where)})
        except Exception as e2:
            if self.stopping(e2):
                raise
            self.exit_half_loaded(step, e2)
        print(
            f"prime-hpc inference: {self.slot} loaded policy {step} from {where} in place of the refused one",
            flush=True,
        )
        return str(where)

    def exit_half_loaded(self, step: int, e: BaseException) -> None:
        """A policy that failed to arrive midway leaves the model's layers partly loaded
        (or on the meta device): generation is still paused, and must not resume on them.
        The server exits at once (its requests fail over to the other servers); its
        supervisor restarts it in its slot, and it joins again and gets the current policy
        before it serves."""
        print(
            f"prime-hpc inference: {self.slot} stops: policy {step} failed midway ({_one_line(e)}) and its "
            f"weights are half loaded; exiting {HALF_LOADED_RC} without serving them (restarted in its slot)",
            file=sys.stderr,
            flush=True,
        )
        os._exit(HALF_LOADED_RC)

    async def leave_weights(self) -> Any:
        if not self.broadcast:
            return _error(409, NO_WEIGHT_GROUP)
        async with self.transfer_lock:
            if self.joined is not None:
                self.joined = None
                await self.engine.shutdown_weight_transfer_engine()
        return {"status": "ok"}


def join_info(body: dict, workers: int, backend: str, store_dir: Optional[Path] = None) -> tuple[dict, Optional[str]]:
    """The workers' init info for `POST /weights/join`'s body, or what is wrong with it
    (one line). The rendezvous is by backend: gloo's (CPU) is the sender's file store
    on one host, `store_path`, a `weights_<hex>.store` in `store_dir` (the run's private
    `rendezvous/`, checked: `rundir.private`), else its TCP store, `master_address` and
    `master_port` (and `timeout_s`, which vLLM's NCCL engine takes none of); NCCL's (GPU)
    is only the unique id the sender minted, `nccl_unique_id_b64`: a store would let anyone
    who reaches its port into the group, while the id comes through this keyed route."""
    world, offset = body.get("world_size"), body.get("rank_offset", 1)
    if not _is_int(world) or not _is_int(offset) or offset < 1 or offset + workers > world:
        return {}, (
            f"'world_size' and 'rank_offset' must hold this server's {workers} worker(s) after the sender "
            f"(rank_offset >= 1, rank_offset + {workers} <= world_size; got {world!r}, {offset!r})"
        )
    info: dict = {"world_size": world, "rank_offset": offset}
    if backend == "nccl":
        uid = body.get("nccl_unique_id_b64")
        if "master_address" in body or "master_port" in body:
            return {}, "a GPU server joins by the sender's NCCL unique id ('nccl_unique_id_b64'), not a TCP store"
        try:
            raw = base64.b64decode(uid, validate=True) if isinstance(uid, str) else b""
        except ValueError:
            raw = b""
        if len(raw) != NCCL_UNIQUE_ID_BYTES:
            return (
                {},
                f"body needs 'nccl_unique_id_b64': the sender's NCCL unique id ({NCCL_UNIQUE_ID_BYTES} bytes, base64)",
            )
        return {**info, "nccl_unique_id_b64": uid}, None
    if "store_path" in body:
        where, problem = _store_path(body, store_dir)
        if problem:
            return {}, problem
        info["store_path"] = where
    else:
        address, port = body.get("master_address"), body.get("master_port")
        if not isinstance(address, str) or not address:
            return {}, "body needs 'master_address': the sender's address"
        if not _is_int(port) or not 0 < port < 65536:
            return {}, "body needs 'master_port': the sender's port (1..65535)"
        info.update(master_address=address, master_port=port)
    timeout = body.get("timeout_s")
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            return {}, f"'timeout_s' must be a positive number of seconds (got {timeout!r})"
        info["timeout_s"] = float(timeout)
    return info, None


def _store_path(body: dict, store_dir: Optional[Path]) -> tuple[str, Optional[str]]:
    """`store_path` of a join's body, when it is a weight group's store in the run's
    private rendezvous directory (and that directory is the user's alone), or why not."""
    from prime_hpc.rundir import private

    path = body.get("store_path")
    if "master_address" in body or "master_port" in body:
        return "", "a join names either the sender's file store ('store_path') or its TCP store, not both"
    if (
        store_dir is None
        or not isinstance(path, str)
        or not re.fullmatch(r"weights_[0-9a-f]{8,64}\.store", Path(path).name)
    ):
        return "", f"'store_path' must be a weight group's store (weights_<hex>.store) in {store_dir}"
    try:
        d = private.ensure(store_dir)
    except (private.Untrusted, OSError) as e:
        return "", f"the weight group's store: {e}"
    if os.path.realpath(Path(path).parent) != str(d):
        return "", f"'store_path' must be a weight group's store (weights_<hex>.store) in {store_dir}"
    return str(d / Path(path).name), None


def _sender(joined: dict) -> str:
    """A joined group's sender, as the log names it."""
    if "store_path" in joined:
        return f"the file store {joined['store_path']}"
    if "master_address" in joined:
        return f"{joined['master_address']}:{joined['master_port']}"
    return "its NCCL unique id"


def _refused_answer(step: int, where: str) -> Any:
    return _error(
        409,
        f"policy {step} refused: what arrived differs from the sender's digests; none of it is served, "
        f"the step is loaded from {where} once written",
        refused="digest",
        weight_dir=where,
    )


def receive_info(body: dict, digests: bool = True) -> tuple[int, dict, Optional[str]]:
    """(step, the workers' update info) for `POST /weights/receive`'s body, or what is wrong
    with it (one line). `digests` (gloo): each tensor's hex digest must come with it."""
    import torch

    step, names = body.get("step"), body.get("names")
    dtypes, shapes = body.get("dtype_names"), body.get("shapes")
    if not _is_int(step) or step < 0:
        return 0, {}, "body needs 'step': the policy's step (an integer >= 0)"
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
        return 0, {}, "body needs 'names', 'dtype_names' and 'shapes': one entry per tensor, in the order sent"
    if not names or not len(names) == len(dtypes) == len(shapes):
        return (
            0,
            {},
            f"'names', 'dtype_names', 'shapes' differ in length or are empty ({len(names)}, {len(dtypes)}, {len(shapes)})",
        )
    bad = [d for d in dtypes if not isinstance(d, str) or not isinstance(getattr(torch, d, None), torch.dtype)]
    if bad:
        return 0, {}, f"unknown dtype name {bad[0]!r} (e.g. float32, bfloat16)"
    if not all(isinstance(s, list) and all(_is_int(n) and n >= 0 for n in s) for s in shapes):
        return 0, {}, "each of 'shapes' is a list of sizes (integers >= 0)"
    if not all(isinstance(n, str) and n for n in names):
        return 0, {}, "each of 'names' is a tensor's name"
    info = {"names": names, "dtype_names": dtypes, "shapes": shapes}
    if digests:
        sums = body.get("digests")
        if not isinstance(sums, list) or len(sums) != len(names):
            return 0, {}, "body needs 'digests': each tensor's digest as sent (sha256, hex), one per name"
        if not all(isinstance(d, str) and re.fullmatch(r"[0-9a-f]{64}", d) for d in sums):
            return 0, {}, "each of 'digests' is a sha256 hex digest of a tensor's bytes"
        info["digests"] = sums
    return step, info, None


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def _error(status: int, message: str, **more: Any) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=status, content={"error": message, **more})


def add_routes(app: Any, server: Server) -> None:
    @app.post("/update_weights")
    async def update_weights(request: Request):
        return await server.update_weights(await _json(request))

    @app.post("/reload_weights")
    async def reload_weights():
        return await server.reload_base()

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        return await server.load_lora(await _json(request))

    @app.post("/weights/join")
    async def weights_join(request: Request):
        return await server.join_weights(await _json(request))

    @app.post("/weights/receive")
    async def weights_receive(request: Request):
        return await server.receive_weights(await _json(request))

    @app.post("/weights/leave")
    async def weights_leave():
        return await server.leave_weights()

    @app.get("/policy")
    async def policy():
        return {
            "slot": server.slot,
            "draining": server.draining,
            "policy_step": server.gate.step,
            "weight_dir": server.gate.weight_dir,
            "adapters": dict(server.gate.adapters),
            "in_flight": server.gate.active,
            "served": server.gate.served,
            "updates": server.updates,
            "workers": server.workers,
            "dtype": server.dtype,
            "transport": server.cfg.weights.transport,
            "weights_joined": server.joined is not None,
        }


async def _json(request: Any) -> dict:
    try:
        body = await request.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


async def _publish_when_healthy(server: Server, timeout_s: float, log: str) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=5) as client:
        while True:
            try:
                r = await client.get(url(server.host, server.port) + "/health")
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                print(
                    f"prime-hpc inference: node {server.node} not healthy after {timeout_s:g}s; see {log}",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(1)
            await asyncio.sleep(0.5)
    server.healthy, server.healthy_at = True, time.time()
    server.publish()
    print(
        f"prime-hpc inference: node {server.node} serving {server.cfg.model.name} at {url(server.host, server.port)}"
        + (f" as {server.slot} (extra inference job {server.extra_job})" if server.extra_job else ""),
        flush=True,
    )
    while not server.draining:  # heartbeat while serving
        server.beat()
        server.republish_if_gone()
        await asyncio.sleep(BEAT_S)


async def _leave_when_told(server: Server, poll_s: float = 0.25) -> None:
    """A server of an extra job: leave the run (`Server.drain`) once its job's script asks
    (`logs/extra/<id>/leave`, its content the reason)."""
    assert server.extra_job is not None
    request = server.run.extra_leave_request(server.extra_job)
    while not server.draining:
        try:
            why = request.read_text().strip() or "asked"
        except OSError:
            await asyncio.sleep(poll_s)
            continue
        await server.drain(f"its job asks: {why}")


async def _drain_on_signals(server: Server, app: Any) -> None:
    """A server of an extra job: SIGTERM and SIGUSR2 make it leave the run (`Server.drain`)
    instead of stopping at once. Installed once vLLM's `serve_http` has set its own SIGTERM
    handler (which this one replaces), i.e. once it serves."""
    loop = asyncio.get_running_loop()
    while getattr(app.state, "server", None) is None:
        await asyncio.sleep(0.05)

    def leave(why: str) -> None:
        loop.create_task(server.drain(why))

    loop.add_signal_handler(signal.SIGTERM, leave, "SIGTERM")
    loop.add_signal_handler(signal.SIGUSR2, leave, "SIGUSR2: its job's time limit is near")


async def serve(cfg: InferenceRunConfig, log: str, extra_job: Optional[str] = None) -> None:
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.launchers.launcher import serve_http, setup_server
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from prime_hpc.model import resolve_model

    model_path = resolve_model(cfg.model.name, cfg.model.seed)
    host = node_address(cfg.address)
    server = Server(cfg, model_path, host, extra_job)
    server.unpublish()
    argv = vllm_args(cfg, model_path, host)
    args = make_arg_parser(FlexibleArgumentParser(prog="prime_hpc.inference")).parse_args(argv)
    validate_parsed_serve_args(args)
    print("prime-hpc inference: vllm " + " ".join(argv), flush=True)
    _, sock = setup_server(args, reuse_port=False)
    server.port = args.port = sock.getsockname()[1]
    try:
        async with build_async_engine_client(args) as engine:
            server.engine = engine
            hf = engine.model_config.hf_config
            server.tied_on_cpu = cfg.device == "cpu" and bool(getattr(hf, "tie_word_embeddings", False))
            server.workers = engine.vllm_config.parallel_config.world_size_across_dp
            server.dtype = str(engine.model_config.dtype).removeprefix("torch.")
            tasks = await engine.get_supported_tasks()
            app = build_app(args, tasks, engine.model_config)
            server.app = app
            add_routes(app, server)
            app.middleware_stack = None  # built early by vLLM's bootstrap; rebuilt lazily with ours outermost
            app.add_middleware(GateMiddleware, gate=server.gate, api_key=api_key(), identity=server.identity)
            await init_app_state(engine, app.state, args, tasks)
            loop = asyncio.get_running_loop()
            background = [loop.create_task(_publish_when_healthy(server, float(cfg.inference.startup_timeout_s), log))]
            if extra_job is not None:
                background.append(loop.create_task(_drain_on_signals(server, app)))
                background.append(loop.create_task(_leave_when_told(server)))
            shutdown = await serve_http(
                app,
                sock=sock,
                host=host,
                port=server.port,
                log_level=args.uvicorn_log_level,
                access_log=not args.disable_uvicorn_access_log,
            )
        try:
            await shutdown
        finally:
            for task in background:
                task.cancel()
    finally:
        server.leave()
        sock.close()


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prime_hpc.inference", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="the run's configs/inference.yaml")
    p.add_argument(
        "--extra-job",
        metavar="JOB_ID",
        help="this server belongs to extra inference job JOB_ID (prime-hpc scale): slot inference_<JOB_ID>.<node>",
    )
    a = p.parse_args(argv)
    raise_open_files("prime-hpc inference")
    if not jobenv.require_key("prime-hpc inference", "a server"):
        return 2
    try:
        cfg = load_config(a.config)
        env = engine_env(cfg)  # refuses a compile cache that is not the user's alone
        if a.extra_job is not None and not a.extra_job.isdigit():
            raise UserError(f"--extra-job {a.extra_job!r}: a job id is a number")
    except UserError as e:
        print(f"prime-hpc inference: {e}", file=sys.stderr, flush=True)
        return 2
    node = jobenv.node_rank()
    logs = jobenv.logs_dir()
    log = str(logtree.node_log(logs, "inference", node)) if logs else "this process's output"
    os.environ.update(env)
    for name, value in address_env(cfg.address).items():  # as the launcher sets them (a weight group's gloo too)
        os.environ.setdefault(name, value)
    os.environ[SERVER_PID_VAR] = str(os.getpid())  # vLLM's own processes die with this one
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # inductor's default cache (its C++ precompiled headers, ~150 MB and seconds to build,
    # even where TORCHINDUCTOR_CACHE_DIR is set) stays the node's, shared by every start,
    # when it is the user's alone; else it is kept in the run's private compile cache
    from prime_hpc.core.usercache import Untrusted

    compiled = env.get("TORCHINDUCTOR_CACHE_DIR")
    try:
        private = private_tmp_dir([Path(default_cache_dir())], Path(compiled).parent if compiled else None)
    except (OSError, Untrusted) as e:  # the compile cache changed since engine_env checked it
        print(f"prime-hpc inference: {e}", file=sys.stderr, flush=True)
        return 2
    os.environ.update(TMPDIR=str(private), VLLM_RPC_BASE_PATH=str(private))
    tempfile.tempdir = str(private)
    try:
        import uvloop

        uvloop.run(serve(cfg, log, a.extra_job))
    except KeyboardInterrupt:
        return 0
    except Exception as e:  # the traceback above for the log; one line for the reader
        traceback.print_exc()
        print(
            f"prime-hpc inference: node {node} failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            f"; see {log}",
            file=sys.stderr,
            flush=True,
        )
        return 1
    finally:
        shutil.rmtree(private, ignore_errors=True)
    return 0


def private_tmp_dir(shared: Iterable[Path] = (), fallback: Optional[Path] = None) -> Path:
    """A temporary directory of this server's own (0700, in the node's, `$TMPDIR` where SLURM
    gives the job one), for what vLLM's processes put there: the sockets they talk through
    (`<tmp>/<uuid>`) and their rendezvous file (`<tmp>/vllm_dist_<hex>`), which vLLM leaves
    behind, a few per start, readable by the node's other users. Here only this user can
    reach them, and the directory goes with the server (one a SIGKILL left is removed by the
    next server start of this user, once the process it names is gone). The caches in
    `shared` (directories of the node's temporary directory, such as inductor's
    `torchinductor_<user>`, whose headers it includes in every kernel it compiles) stay
    where they are, linked from the private directory under their names, but only when
    they are the user's alone (`usercache.private_dir`: anyone may create that name
    first); otherwise the link goes to one of that name in `fallback` (the user's private
    compile cache), or a directory of the private one (lost with it) without one."""
    tmp = Path(tempfile.gettempdir())
    me = os.getuid()
    for old in tmp.glob(f"{TMP_DIR_PREFIX}*"):
        try:
            pid = int(old.name[len(TMP_DIR_PREFIX) :].split(".", 1)[0])
            st = old.lstat()
            if st.st_uid == me and stat.S_ISDIR(st.st_mode) and jobs.start_time(pid) is None:
                shutil.rmtree(old, ignore_errors=True)
        except (ValueError, OSError):
            continue
    private = Path(tempfile.mkdtemp(prefix=f"{TMP_DIR_PREFIX}{os.getpid()}.", dir=tmp))
    for cache in shared:
        kept = own_cache(cache, fallback)
        if kept is None:
            (private / cache.name).mkdir(mode=0o700)
        else:
            (private / cache.name).symlink_to(kept)
    return private


def own_cache(cache: Path, fallback: Optional[Path]) -> Optional[Path]:
    """`cache` (made 0700 if missing) when it is the user's alone, with every directory
    above it; else `<fallback>/<its name>`, or None without a fallback; one line in the
    log when the node's is passed over."""
    from prime_hpc.core import usercache

    try:
        return usercache.private_dir(cache)
    except (usercache.Untrusted, OSError) as e:
        instead = fallback / cache.name if fallback is not None else "this server's temporary directory"
        print(f"prime-hpc inference: {cache} is not used ({e}); inductor's cache is kept in {instead}", flush=True)
    return None if fallback is None else usercache.private_dir(fallback / cache.name)
