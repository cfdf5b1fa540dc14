"""One worker of an env server: loads the env itself and runs the groups its server sends.

Consumes, on stdin, one JSON request a line (`{"id", "row", "kind", "n", "model",
"sampling", "seq_len", "strategy"}`) and produces, on the stdout it was started with, one
JSON answer a line (`{"id", "rollouts"}`; first `{"ready": true}` once the env is loaded, with
the env's `rows` when it runs under another Python than the run's, `spec["python"]`).
Groups run concurrently on one asyncio loop, through the policy client the orchestrator
uses (`client.make_client` toward the same base URL, the router proven and signed for as
the orchestrator does, the same `max_context`). Whatever else writes to stdout (an env's
prints) goes to stderr, the worker's log. It exits when stdin closes: its server is gone.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from prime_hpc.config.schema import EnvEntry
from prime_hpc.core.jobenv import ENV_POLICY_KEY_VAR as POLICY_KEY_VAR
from prime_hpc.envserver.channel import Channel, open_worker, serve_requests


def policy_client(spec: dict) -> Any:
    """The orchestrator's policy client, rebuilt from `spec["client"]`: `url`, `router_json`
    (the run's router.json, None for another endpoint), `max_context`, `timeout_s`."""
    from prime_hpc.inference.client import RouterLink, RouterURL, api_key
    from prime_hpc.orchestrator.client import make_client

    c = spec["client"]
    base: Any = RouterURL(c["url"], RouterLink(c["router_json"])) if c.get("router_json") else c["url"]
    key = os.environ.get(POLICY_KEY_VAR) or api_key()
    return make_client(base, key, max_context=c.get("max_context"), timeout_s=float(c["timeout_s"]))


async def serve(spec: dict, channel: Channel) -> None:
    """Load the env, say ready, answer requests until stdin closes."""
    from prime_hpc.orchestrator.envs import load_env
    from prime_hpc.orchestrator.generate import generate_group
    from prime_hpc.orchestrator.wire import group_to_json

    entry = EnvEntry(**spec["entry"])
    env = load_env(entry, spec["kind"])
    rows: dict = {}
    if spec.get("python"):  # another Python than the run's: the env's rows are only here
        from prime_hpc.orchestrator.envs import dataset_rows

        n = spec.get("num_examples")
        ds = env.get_dataset() if spec["kind"] == "train" else env.get_eval_dataset(n=n or -1)
        rows = {"rows": dataset_rows(ds)}
    client = policy_client(spec)

    async def one(req: dict) -> None:
        rollouts = await generate_group(
            env,
            spec["name"],
            req["row"],
            req["kind"],
            int(req["n"]),
            client,
            req["model"],
            req["sampling"],
            int(req["seq_len"]),
            req["strategy"],
        )
        channel.answer({"id": req["id"], "rollouts": group_to_json(rollouts)})

    await serve_requests(channel, rows, one)


def main() -> None:
    spec, channel = open_worker("python -m prime_hpc.envserver.worker")
    from prime_hpc.orchestrator.envs import ENV_LOG

    ENV_LOG.propagate = True
    asyncio.run(serve(spec, channel))


if __name__ == "__main__":
    main()
