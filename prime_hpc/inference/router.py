"""`python -m prime_hpc.inference.router --config <run>/configs/inference.yaml`: one
vllm-router per run, on the first inference node, in front of every server of the run.

It waits (at most `inference.startup_timeout_s`) until every server has published
`endpoints/inference_<node>.json`, starts `vllm-router` on this node's address and a port
free here, waits for it to answer, publishes `endpoints/router.json`, and then lives as
long as the router does (SIGTERM/SIGINT are passed on). A vllm-router that dies by itself
is started again on the same port, in front of the servers that still answer, at most
`MAX_RESTARTS` times; after that this process exits with its code and the job ends.

vllm-router checks no key on the requests it receives (its own routes, such as
`/add_worker`, would be open to anyone on the network), so it listens on this node's
loopback only, and the published address is a small proxy in this process (`KeyProxy`)
that demands the job's key on every route but `/health` and forwards the rest as is. The router forwards the client's
`Authorization` header, so the servers' API key check covers requests through it too.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from prime_hpc.core import jobenv
from prime_hpc.core.net import LOOPBACK, free_port, node_address, url
from prime_hpc.inference.client import api_key, wait_for_servers
from prime_hpc.inference.gate import ApiKey, send_json
from prime_hpc.rundir import RunDir, WaitTimeout, atomic_write_json, wait_for
from prime_hpc.runtime.stopping import die_with_parent

POLICY = "round_robin"
MAX_RESTARTS = 3  # a vllm-router that dies is started again at most this often per attempt


def router_binary() -> str:
    """The vllm-router executable next to this interpreter, or on PATH."""
    exe = Path(sys.executable).parent / "vllm-router"
    path = str(exe) if exe.exists() else shutil.which("vllm-router")
    if not path:
        raise FileNotFoundError("vllm-router not found next to the interpreter nor on PATH (pip install vllm-router)")
    return path


def router_argv(binary: str, host: str, port: int, metrics_port: int, worker_urls: list[str]) -> list[str]:
    return [binary, "--host", host, "--port", str(port), "--worker-urls", *worker_urls, "--policy", POLICY,
            "--prometheus-host", host, "--prometheus-port", str(metrics_port),
            "--worker-startup-check-interval", "1",
            # a server that died is out of rotation within ~10 s; requests it failed are retried elsewhere
            "--health-check-interval-secs", "5", "--health-failure-threshold", "2"]


def wait_ready(proc: subprocess.Popen, base: str, timeout_s: float) -> None:
    import httpx

    def ready() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm-router exited with code {proc.returncode} before it was ready")
        try:
            return httpx.get(base + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(ready, what=f"vllm-router at {base}/health", timeout_s=timeout_s, producer="vllm-router")


class KeyProxy:
    """ASGI app: the job's API key on every route but liveness, then the request as it
    came (method, path, query, headers, body) to `upstream`, and the answer back streamed."""

    def __init__(self, upstream: str, key: Optional[str]) -> None:
        self.upstream = upstream
        self.key = ApiKey(key)
        self.client: Any = None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        import httpx

        if scope["type"] != "http":
            return
        if not self.key.allows(scope):
            return await self.key.refuse(send)
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        if self.client is None:
            self.client = httpx.AsyncClient(base_url=self.upstream, timeout=None)
        query = scope.get("query_string", b"").decode("latin-1")
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() not in HOP_HEADERS]
        request = self.client.build_request(scope["method"], scope["path"] + (f"?{query}" if query else ""),
                                            headers=headers, content=body)
        try:
            response = await self.client.send(request, stream=True)
        except httpx.HTTPError as e:  # vllm-router restarting: the client retries
            return await send_json(send, 503, {"error": f"the router is not answering: {type(e).__name__}"})
        try:
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": [(k, v) for k, v in response.headers.raw if k.lower() not in HOP_HEADERS]})
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await response.aclose()


HOP_HEADERS = (b"host", b"content-length", b"transfer-encoding", b"connection", b"keep-alive")


def serve_proxy(app: KeyProxy, host: str, port: int) -> Any:
    """Serve `app` on host:port from a daemon thread; returns the uvicorn server."""
    import threading

    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                                          access_log=False))
    thread = threading.Thread(target=server.run, name="key-proxy", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the key proxy could not listen on {host}:{port}")
        time.sleep(0.05)
    return server


def live_workers(urls: list[str]) -> list[str]:
    """The servers among `urls` that answer `/health` now."""
    import httpx

    out = []
    for u in urls:
        try:
            if httpx.get(u + "/health", timeout=3).status_code == 200:
                out.append(u)
        except httpx.HTTPError:
            pass
    return out


def main(argv: Optional[list[str]] = None) -> int:
    from prime_hpc.config.component import InferenceRunConfig, load
    from prime_hpc.core.errors import UserError

    p = argparse.ArgumentParser(prog="python -m prime_hpc.inference.router", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="the run's configs/inference.yaml")
    a = p.parse_args(argv)
    try:
        cfg = load(a.config, InferenceRunConfig, "inference")
    except UserError as e:
        print(f"prime-hpc router: {e}", file=sys.stderr, flush=True)
        return 2
    run = RunDir(cfg.output_dir)
    logs = jobenv.logs_dir()
    timeout_s = float(cfg.inference.startup_timeout_s)
    try:
        servers = wait_for_servers(run, cfg.nodes, timeout_s, logs)
    except WaitTimeout as e:
        print(f"prime-hpc router: {str(e).splitlines()[0]}", file=sys.stderr, flush=True)
        return 1
    host = node_address(cfg.address)
    port, metrics_port = free_port(host), free_port(LOOPBACK)
    inner = free_port(LOOPBACK)  # vllm-router itself: reachable from this node only, behind the key proxy
    workers = [s["url"] for s in servers]
    try:
        serve_proxy(KeyProxy(url(LOOPBACK, inner), api_key()), host, port)
    except RuntimeError as e:
        print(f"prime-hpc router: {e}", file=sys.stderr, flush=True)
        return 1
    state: dict = {"proc": None, "stopping": False}

    def on_signal(sig: int, _frame: object) -> None:
        state["stopping"] = True
        if state["proc"] is not None:
            state["proc"].send_signal(sig)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    restarts = 0
    while True:
        argv_ = router_argv(router_binary(), LOOPBACK, inner, metrics_port, workers)
        print("prime-hpc router: " + " ".join(argv_), flush=True)
        proc = state["proc"] = subprocess.Popen(argv_, preexec_fn=die_with_parent)  # never outlives this process
        try:
            wait_ready(proc, url(LOOPBACK, inner), timeout_s=120)
        except (WaitTimeout, RuntimeError) as e:
            proc.terminate()
            print(f"prime-hpc router: {str(e).splitlines()[0]}", file=sys.stderr, flush=True)
            return 1
        atomic_write_json(run.router_endpoint, {
            "url": url(host, port), "host": host, "port": port, "metrics_port": metrics_port, "pid": proc.pid,
            "router_url": url(LOOPBACK, inner), "policy": POLICY, "workers": workers, "restarts": restarts,
            "started_at": time.time()})
        print(f"prime-hpc router: serving at {url(host, port)} in front of {len(workers)} server(s)", flush=True)
        rc = proc.wait()
        if state["stopping"] or restarts >= MAX_RESTARTS:
            break
        restarts += 1
        workers = live_workers(workers) or workers
        print(f"prime-hpc router: vllm-router exited with code {rc}; restarting it on the same port "
              f"(restart {restarts} of at most {MAX_RESTARTS})", file=sys.stderr, flush=True)
    try:
        os.unlink(run.router_endpoint)
    except OSError:
        pass
    if not state["stopping"]:
        print(f"prime-hpc router: vllm-router exited with code {rc} after {restarts} restart(s); giving up",
              file=sys.stderr, flush=True)
        return rc or 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
