"""Start the run's real inference (our vLLM servers + the router) as local processes,
the way the launcher does on each node, and stop exactly those processes afterwards."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from prime_hpc.config.component import write_component_config
from prime_hpc.config.compose import compose
from prime_hpc.inference.client import Admin, Endpoints, discover
from prime_hpc.rundir import RunDir, tail

REPO = Path(__file__).resolve().parents[1]
API_KEY = "test-key-7c1d"  # tests only


async def request_body(receive) -> bytes:
    """The whole body of an ASGI HTTP request, from its `receive` messages."""
    chunks, more = [], True
    while more:
        message = await receive()
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks)


def child_env(**extra: str) -> dict[str, str]:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    env.update(extra)
    return env


def write_inference_config(root: Path, overrides: list[str] = ()) -> Path:
    cfg = compose(["+experiment=reverse_text", f"output_dir={root}", "inference.dtype=float32", *overrides])
    return write_component_config(cfg, "inference")


@dataclass
class Inference:
    root: Path
    logs: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    endpoints: Optional[Endpoints] = None
    key: str = API_KEY

    @property
    def run(self) -> RunDir:
        return RunDir(self.root)

    def admin(self) -> Admin:
        return Admin(self.endpoints.servers, key=self.key)

    def log(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def start(self, name: str, argv: list[str], **env: str) -> subprocess.Popen:
        f = open(self.log(name), "ab")
        p = subprocess.Popen(
            argv,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=child_env(PRIME_HPC_LOGS=str(self.logs), **env),
        )
        f.close()
        self.procs[name] = p
        return p

    def stop(self, name: str, sig: int = signal.SIGTERM) -> None:
        p = self.procs.get(name)
        if p is None:
            return
        if p.poll() is None:
            p.send_signal(sig)
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=30)
        try:  # children (engine core, workers, the router) live in its session
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def stop_all(self) -> None:
        for name in list(self.procs)[::-1]:
            self.stop(name)

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs.values())

    def describe(self) -> str:
        return "\n".join(f"--- {n} (rc={p.poll()}) ---\n{tail(self.log(n), 30)}" for n, p in self.procs.items())


def start_inference(
    root: Path, nodes: int = 2, key: str = API_KEY, overrides: list[str] = (), timeout_s: float = 600
) -> Inference:
    """`nodes` servers (node ranks 0..nodes-1) and the router, from the run's config, all
    demanding `key`."""
    config = write_inference_config(root, [f"cluster.inference.nodes={nodes}", *overrides])
    logs = root / "logs"
    (logs / "inference").mkdir(parents=True, exist_ok=True)
    inf = Inference(root=root, logs=logs, key=key)
    extra = {"INFERENCE_SERVER_API_KEY": key}
    for node in range(nodes):
        inf.start(
            f"inference/node_{node}",
            [sys.executable, "-u", "-m", "prime_hpc.inference", "--config", str(config)],
            PRIME_HPC_NODE_RANK=str(node),
            **extra,
        )
    inf.start(
        "inference/router_0",
        [sys.executable, "-u", "-m", "prime_hpc.inference.router", "--config", str(config)],
        **extra,
    )
    try:
        inf.endpoints = discover(inf.run, nodes, timeout_s=timeout_s, logs=logs, alive=inf.alive)
    except Exception as e:
        inf.stop_all()
        raise RuntimeError(f"inference did not come up: {e}\n{inf.describe()}") from None
    return inf
