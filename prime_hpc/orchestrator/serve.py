"""The head of a serve job (`prime-hpc serve`, `serve.enabled`): waits for the job's
inference servers and router, then publishes where they answer in `<output_dir>/serve.json`
and keeps the job up (its heartbeat beating) until the job is cancelled or reaches its
time limit. The servers are supervised and restarted in their slots as in any run, and
the fleet's membership kept as a run's relay keeps it (`orchestrator.fleet.Membership`,
every server at the base model): a restarted server rejoins the router, `status` shows
each server's state.

`serve.json`: {"url": the router's OpenAI-compatible base URL, "model": the name to ask
for, "key_var": the environment variable that holds the key every server demands (the
one the job was submitted with, never written anywhere), "servers": how many, "since"}. Readers: `prime-hpc eval serve=<job>`, `synthesize`, a run's teacher, `status`
(`served`). It is removed when the head stops, so no reader finds a URL that no longer
answers.
"""

from __future__ import annotations

import os
import time
from typing import Any

from prime_hpc.core import jobenv
from prime_hpc.rundir import RunDir, atomic_write_json


def run(cfg: Any) -> dict:  # never returns: the job's end stops it
    import asyncio

    from prime_hpc.inference.client import discover
    from prime_hpc.orchestrator.client import SERVERS_WAIT_S

    job_dir = RunDir(cfg.output_dir)
    job_dir.beat("orchestrator", 0, progress_at=time.time())
    ep = discover(job_dir, cfg.inference_nodes, timeout_s=SERVERS_WAIT_S, logs=jobenv.logs_dir())
    record = {
        "url": ep.openai_base_url,
        "model": cfg.model.name,
        "key_var": jobenv.API_KEY_VAR,
        "servers": len(ep.servers),
        "since": time.time(),
    }
    atomic_write_json(job_dir.serve_json, record)
    print(f"prime-hpc serve: {cfg.model.name} at {ep.openai_base_url} ({len(ep.servers)} server(s))", flush=True)
    try:  # until the job ends: its SIGTERM is a SystemExit here (the head task's handler)
        asyncio.run(keep_serving(job_dir, ep))
    finally:
        try:
            os.unlink(job_dir.serve_json)
        except OSError:
            pass
        print("prime-hpc serve: stopped", flush=True)
    return record


async def keep_serving(job_dir: RunDir, ep: Any) -> None:
    """The fleet's membership as in a run, every server at the base model (`fleet.keep_fixed`);
    the heartbeat beats."""
    from prime_hpc.inference.client import api_key
    from prime_hpc.orchestrator.fleet import keep_fixed
    from prime_hpc.rundir import BEAT_S

    beaten = [0.0]

    def beat(members: Any) -> None:
        if time.monotonic() - beaten[0] >= BEAT_S:
            job_dir.beat("orchestrator", 0, progress_at=time.time(), serving=members.serving())
            beaten[0] = time.monotonic()

    await keep_fixed(job_dir, ep, api_key(), beat)
