"""Synthetic SFT data (`prime-hpc synthesize`): each env of `orchestrator.env` played
against a model, and the rollouts that pass written as an SFT dataset the trainer reads as
it is (`trainer.data.name=<out>/data.jsonl`).

Consumes: the envs' training sets (`synthesize.examples` of each, from its start, or all),
`synthesize.rollouts` rollouts per example through a `Generator` (the run's sampling,
`orchestrator.max_concurrent`), the servers of the job (or any endpoint). Produces:
`<out>/data.jsonl`, one rollout a line in the `messages` layout (the whole conversation:
system and user messages, the model's turns with their `tool_calls`, the `tool`
messages), with `env`, `example_id`, `reward` and the env's `metrics` beside it; only
rollouts that did not fail, produced a completion and (`synthesize.min_reward`) reached
the reward. Written to `data.jsonl.partial` as groups finish and renamed at the end, so
`data.jsonl` is always whole. `<out>/summary.json`: counts, mean reward, seconds. A line
every `PROGRESS_S` on progress.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Optional

from prime_hpc.rundir import RunDir, atomic_write_json

PROGRESS_S = 10.0
DATA = "data.jsonl"
SUMMARY = "summary.json"


def record(r: Any) -> dict:
    """A kept rollout as a line of the dataset."""
    return {"messages": r.messages, "env": r.env, "example_id": r.example_id, "reward": r.reward, "metrics": r.metrics}


def passes(r: Any, min_reward: Optional[float]) -> bool:
    return not r.error and not r.empty and bool(r.messages) and (min_reward is None or r.reward >= min_reward)


async def synthesize(
    slots: list,
    generator: Any,
    out: Path,
    rollouts: int,
    examples: Optional[int],
    min_reward: Optional[float],
    on_group: Callable[[], None] = lambda: None,
    log: Callable[[str], None] = print,
    max_errored: int = 10,
) -> dict:
    """Play every slot's first `examples` rows (all: None), `rollouts` each, at most
    `generator.max_groups` groups at once; write what passes to `<out>/data.jsonl`; the
    summary. An env whose groups error `max_errored` times in a row ends it with one line
    quoting the error (nothing would pass: no spinning through the rest)."""
    from prime_hpc.core.errors import UserError
    from prime_hpc.orchestrator.rollouts import group_error

    out.mkdir(parents=True, exist_ok=True)
    partial = out / f"{DATA}.partial"
    work = [(slot, row) for slot in slots for row in (slot.rows[:examples] if examples else slot.rows)]
    t0 = last = time.monotonic()
    done = kept = failed = 0
    rewards: list[float] = []
    streak: dict[str, int] = {}
    sem = asyncio.Semaphore(generator.max_groups)
    with open(partial, "w") as f:

        async def one(slot: Any, row: dict) -> None:
            nonlocal done, kept, failed, last
            async with sem:
                group = await generator.group(slot, row, "train", n=rollouts)
            error = group_error(group)
            streak[slot.name] = streak.get(slot.name, 0) + 1 if error else 0
            if error and max_errored and streak[slot.name] >= max_errored:
                raise UserError(f"env {slot.name!r}: {streak[slot.name]} groups in a row errored: {error}")
            for r in group:
                rewards.append(r.reward)
                failed += bool(r.error)
                if passes(r, min_reward):
                    f.write(json.dumps(record(r), default=str) + "\n")
                    kept += 1
            f.flush()
            done += 1
            on_group()
            if time.monotonic() - last >= PROGRESS_S or done == len(work):
                last = time.monotonic()
                log(
                    f"synthesize: {done}/{len(work)} examples, {kept}/{len(rewards)} rollouts kept, "
                    f"mean reward {sum(rewards) / len(rewards):.3f}, {failed} failed, {last - t0:.0f}s"
                )

        await asyncio.gather(*(one(slot, row) for slot, row in work))
        os.fsync(f.fileno())
    os.replace(partial, out / DATA)
    summary = {
        "examples": len(work),
        "rollouts": len(rewards),
        "kept": kept,
        "failed": failed,
        "min_reward": min_reward,
        "mean_reward": sum(rewards) / len(rewards) if rewards else 0.0,
        "envs": [s.name for s in slots],
        "seconds": round(time.monotonic() - t0, 1),
        "data": str(out / DATA),
    }
    atomic_write_json(out / SUMMARY, summary)
    return summary


def train_slots(o: Any, where: RunDir) -> list:
    """The train envs of `o` (the orchestrator's config) loaded as a run loads them: one
    that runs in a server of its own (a v1 task set, `python`) only named here, its
    server's files under `where` (`remote.served` starts it)."""
    from prime_hpc.orchestrator.envs import load_slots

    return load_slots(o.env, "train", pylib=where.private_dir / "envservers" / "pylib", where="orchestrator.env")


def run_job(cfg: Any) -> dict:
    """The head of a synthesize job: waits for the job's servers, then synthesizes through
    the router, beating the orchestrator's heartbeat (each finished group is progress)."""
    from prime_hpc.core import jobenv
    from prime_hpc.inference.client import api_key, discover
    from prime_hpc.orchestrator.client import SERVERS_WAIT_S, make_client
    from prime_hpc.orchestrator.envservers import RemoteGenerator, served
    from prime_hpc.orchestrator.evaluate import beating

    job_dir = RunDir(cfg.output_dir)
    sy = cfg.synthesize
    o = cfg.orchestrator
    slots = train_slots(o, job_dir)
    ep = discover(job_dir, cfg.inference_nodes, timeout_s=SERVERS_WAIT_S, logs=jobenv.logs_dir())
    client = make_client(ep.openai_base_url, api_key(), timeout_s=o.generation_timeout_s)
    # it only waits on the servers: the watchdog excuses it while they work
    state: dict = {"progress_at": time.time(), "waiting_on": "inference"}

    def progressed() -> None:
        state["progress_at"] = time.time()

    logs = jobenv.logs_dir() or job_dir.logs_root
    with served({"train": slots}, job_dir, logs, cfg, ep.openai_base_url, policy_key=api_key()):
        work = synthesize(
            slots,
            RemoteGenerator(o, cfg.seq_len, client, lambda: cfg.model.name),
            Path(sy.out),
            int(sy.rollouts),
            sy.examples,
            sy.min_reward,
            on_group=progressed,
            log=lambda line: print(line, flush=True),
            max_errored=int(o.max_errored_groups),
        )
        summary = asyncio.run(beating(job_dir, state, work))
    print(f"prime-hpc synthesize: wrote {summary['kept']} rollouts to {summary['data']}", flush=True)
    return summary


def synthesize_here(
    cfg: Any, opts: dict, name: str, out: Path, k: int, n: Optional[int], min_reward: Optional[float], key: Any
) -> dict:
    """Synthesize from this machine: through the endpoint given (`client.base_url=`, asked
    with `key`, the endpoint's own: `inference.client.endpoint_key`, never the job's
    variable; a serve job's router, proven with `key` and sent signed requests, never
    the key), or one server started here (with a key made for it). An env that runs in a
    server of its own gets one here, its files under `out`."""
    from prime_hpc.config.cluster import cache_root
    from prime_hpc.config.component import OrchestratorRunConfig, component_config, typed
    from prime_hpc.core import usercache
    from prime_hpc.orchestrator import evaluate
    from prime_hpc.orchestrator.client import make_client
    from prime_hpc.orchestrator.envservers import RemoteGenerator, served

    rcfg = typed(OrchestratorRunConfig, component_config(cfg, "orchestrator"), "orchestrator config")
    o = rcfg.orchestrator
    here = RunDir(out)
    out.mkdir(parents=True, exist_ok=True)
    slots = train_slots(o, here)

    def play(url: str, model: str, api_key: Any) -> dict:
        client = make_client(url, api_key, timeout_s=o.generation_timeout_s)
        with served({"train": slots}, here, here.logs_root, rcfg, url, policy_key=api_key):
            generator = RemoteGenerator(o, rcfg.seq_len, client, lambda: model)
            return asyncio.run(
                synthesize(slots, generator, out, k, n, min_reward, max_errored=int(o.max_errored_groups))
            )

    if "client.base_url" in opts:  # a serve job's router is proven and sent no key (`evaluate.endpoint_url`)
        return play(evaluate.endpoint_url(opts["client.base_url"]), opts.get("client.model") or name, key)
    usercache.compile_dir(cache_root(cfg), create=False)
    with evaluate.eval_server(cfg, here, cache_root(cfg)) as (url, server_key):
        return play(url + "/v1", cfg.model.name, server_key)
