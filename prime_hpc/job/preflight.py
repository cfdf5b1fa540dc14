"""Preflight (`prime-hpc doctor`): the run's het layout with a check on every node instead
of the components. Each node reports hostname, visible accelerators, the Python imports
its component needs, read+write of the shared run directory, and whether it reaches a
port opened by the head group; the trainer group also runs a collective over its process
group (gloo on CPU, NCCL on GPU) under the same torchrun/rendezvous the trainer uses.

  head (group 0):  run_head()  -> preflight/head.json, waits for every report, report.json
  nodes (1-3):     python -m prime_hpc.job.preflight node --group inference|trainer|teacher --output-dir D
                   (teacher: the servers of the teacher the run starts itself, if any)
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import importlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Optional

from prime_hpc.core import jobenv
from prime_hpc.core.net import node_address
from prime_hpc.core.text import columns
from prime_hpc.inference.client import api_key
from prime_hpc.inference.gate import MissingKey
from prime_hpc.rundir import RunDir, WaitTimeout, atomic_write_json, logtree, read_json, wait_file

IMPORTS = {
    "orchestrator": ("verifiers", "openai", "transformers"),
    "inference": ("vllm", "transformers"),
    "router": ("uvicorn", "httpx"),
    "trainer": ("torch", "transformers"),
}
IMPORTS["teacher"] = IMPORTS["inference"]  # a teacher server is an inference server
HANDSHAKE = b"prime-hpc-preflight\n"  # the head's answer; a node says it followed by its key's digest


def _greeting() -> bytes:
    """What a node sends the head: the handshake and the digest of the job's key (the head
    answers only a node of its own job)."""
    return HANDSHAKE + hashlib.sha256((api_key() or "").encode()).hexdigest().encode()


REPORT_TIMEOUT_S = float(os.environ.get("PRIME_HPC_PREFLIGHT_TIMEOUT_S", "600"))


def _check(name: str, fn: Callable[[], str]) -> dict[str, Any]:
    try:
        return {"name": name, "ok": True, "detail": fn()}
    except Exception as e:  # a failed check is data, not a crash
        return {"name": name, "ok": False, "detail": f"{type(e).__name__}: {e}".strip()}


def _accelerators() -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    smi = shutil.which("nvidia-smi")
    if smi:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
        gpus = [ln for ln in out.stdout.splitlines() if ln.startswith("GPU")]
        return f"{len(gpus)} GPU(s) (CUDA_VISIBLE_DEVICES={visible})"
    return f"none (CPU only; CUDA_VISIBLE_DEVICES={visible})"


def _check_accelerators(device: str) -> str:
    found = _accelerators()
    if device == "cuda" and found.startswith("none"):
        raise RuntimeError(f"cluster.device=cuda but {found}")
    return found


def required_modules(group: str) -> list[str]:
    """What this group must import: its component's stack, plus the modules listed in
    `PRIME_HPC_PREFLIGHT_REQUIRE` (comma-separated; the run's env ids, `doctor --require`)."""
    extra = [m for m in os.environ.get("PRIME_HPC_PREFLIGHT_REQUIRE", "").split(",") if m]
    return list(IMPORTS[group]) + extra


def _import(name: str) -> Any:
    """A module by its name, or a run's env id in the other forms the orchestrator loads
    (a path, a distribution name, owner/name: `prime_hpc.orchestrator.envs.import_env_module`)."""
    if all(part.isidentifier() for part in name.split(".")):
        return importlib.import_module(name)
    from prime_hpc.orchestrator.envs import import_env_module

    return import_env_module(name)


def _env_elsewhere(env_id: str) -> str:
    """For an env id this Python cannot import: what the envs' Python (`config.env_kinds`)
    says it is, when it can run it ('' otherwise)."""
    from prime_hpc.config.env_kinds import CLASSIC, V1, ask

    python, answer = ask(env_id)
    if answer.get("kind") not in (CLASSIC, V1):
        return ""
    return f"{env_id} ({answer['kind']}, verifiers {answer.get('verifiers')}, {python})"


def _imports(group: str) -> str:
    versions, missing = [], []
    for mod in required_modules(group):
        try:
            m = _import(mod)
        except Exception as e:
            elsewhere = _env_elsewhere(mod)  # a v1 task set: the Python that runs it answers for it
            if elsewhere:
                versions.append(elsewhere)
            else:
                missing.append(f"{mod} ({type(e).__name__}: {e})")
            continue
        versions.append(f"{mod} {getattr(m, '__version__', '?')}")
    if missing:
        raise ImportError("cannot import " + "; ".join(missing))
    return ", ".join(versions)


def _shared_rw(run: RunDir, group: str, rank: int) -> str:
    """Write a file into the shared run dir and read it back; read the head's file too
    (proves this node sees what another node wrote)."""
    probe = run.preflight_dir / f".rw_{group}_{rank}"
    token = f"{socket.gethostname()}:{os.getpid()}:{time.time()}"
    atomic_write_json(probe, {"token": token})
    if read_json(probe)["token"] != token:
        raise RuntimeError(f"read back a different content from {probe}")
    probe.unlink()
    if group != "orchestrator":
        _head(run)
    return f"read+write ok in {run.preflight_dir}"


def _head(run: RunDir) -> dict[str, Any]:
    """The head's published address (waits for it)."""
    return read_json(wait_file(run.preflight_head, timeout_s=120, producer="the head group (orchestrator)"))


def _reach_head(run: RunDir) -> str:
    head = _head(run)
    with socket.create_connection((head["address"], head["port"]), timeout=30) as s:
        s.sendall(_greeting())
        reply = s.recv(64)
    if reply != HANDSHAKE:
        raise RuntimeError(f"unexpected reply {reply!r} from {head['address']}:{head['port']}")
    return f"reached {head['address']}:{head['port']} ({head['host']})"


def _collective(device: str) -> str:
    """all_reduce over the trainer's process group (set up by torchrun)."""
    import torch
    import torch.distributed as dist

    from prime_hpc.core import device as devices

    backend = devices.dist_backend(device)
    dist.init_process_group(backend=backend, **jobenv.process_group_init())
    try:
        dev = devices.torch_device(device, int(os.environ.get("LOCAL_RANK", 0)))
        t = torch.ones(1, device=dev)
        dist.all_reduce(t)
        world = dist.get_world_size()
        if int(t.item()) != world:
            raise RuntimeError(f"all_reduce gave {t.item()}, expected {world}")
        return f"{backend} all_reduce over {world} rank(s) ok"
    finally:
        dist.destroy_process_group()


def node_checks(run: RunDir, group: str, rank: int, device: str) -> list[dict[str, Any]]:
    checks = [
        _check("hostname", socket.gethostname),
        _check("accelerators", lambda: _check_accelerators(device)),
        _check("imports", lambda: _imports(group)),
        _check("shared run dir", lambda: _shared_rw(run, group, rank)),
    ]
    if group != "orchestrator":
        checks.append(_check("reach head port", lambda: _reach_head(run)))
    if group == "trainer" and "WORLD_SIZE" in os.environ:
        checks.append(_check("trainer collective", lambda: _collective(device)))
    return checks


def _node_rank(group: str) -> int:
    if group == "trainer":
        return int(os.environ.get("RANK", 0))
    if group == "router":
        return 0
    return jobenv.node_rank()


def write_report(run: RunDir, group: str, rank: int, checks: list[dict[str, Any]]) -> dict[str, Any]:
    report = {
        "group": group,
        "rank": rank,
        "host": socket.gethostname(),
        "slurm_node": os.environ.get("SLURMD_NODENAME"),
        "ok": all(c["ok"] for c in checks),
        "checks": checks,
    }
    atomic_write_json(run.preflight_report(group, rank), report)
    return report


def run_node(run: RunDir, group: str) -> int:
    rank = _node_rank(group)
    run.beat(group, rank, phase="preflight")
    device = jobenv.device()
    report = write_report(run, group, rank, node_checks(run, group, rank, device))
    print(json.dumps(report, indent=2))
    return 0  # a failed check is in the report; the head's verdict decides the job's exit


class _HeadServer:
    """A TCP port on the head node that every other node must reach; it answers only a
    node that shows the job's key."""

    def __init__(self) -> None:
        if not api_key():
            raise MissingKey(
                f"{jobenv.API_KEY_VAR} is not set: the preflight's head port never opens without the job's key"
            )
        self.expected = _greeting()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.address = node_address()
        self.sock.bind((self.address, 0))
        self.sock.listen(64)
        self.sock.settimeout(0.5)
        self.port = self.sock.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (socket.timeout, OSError):
                continue
            with conn:
                conn.settimeout(10)
                try:
                    if hmac.compare_digest(conn.recv(len(self.expected)), self.expected):
                        conn.sendall(HANDSHAKE)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()


def run_head(run: RunDir, expected: dict[str, int]) -> dict[str, Any]:
    """Open the port, publish it, check this node, wait for every node's report and
    write `preflight/report.json`. `expected` maps group -> number of reports."""
    server = _HeadServer()
    run.beat("orchestrator", 0, phase="preflight")
    try:
        atomic_write_json(
            run.preflight_head, {"host": socket.gethostname(), "address": server.address, "port": server.port}
        )
        device = jobenv.device()
        write_report(run, "orchestrator", 0, node_checks(run, "orchestrator", 0, device))
        reports = {"orchestrator": [read_json(run.preflight_report("orchestrator", 0))]}
        logs = run.latest_logs
        deadline = time.monotonic() + REPORT_TIMEOUT_S  # one deadline for all reports
        for group, n in expected.items():
            reports[group] = []
            for rank in range(n):
                path = run.preflight_report(group, rank)
                try:
                    wait_file(
                        path,
                        timeout_s=max(0.0, deadline - time.monotonic()),
                        producer=f"{group} rank {rank}",
                        producer_log=logtree.log_of(logs, group),
                    )
                    reports[group].append(read_json(path))
                except WaitTimeout as e:
                    reports[group].append(
                        {
                            "group": group,
                            "rank": rank,
                            "host": None,
                            "ok": False,
                            "checks": [{"name": "report", "ok": False, "detail": str(e).splitlines()[0]}],
                        }
                    )
    finally:
        server.close()
    summary = {"ok": all(r["ok"] for rs in reports.values() for r in rs), "groups": reports}
    atomic_write_json(run.preflight_summary, summary)
    return summary


def collect(run: RunDir, expected: dict[str, int], why_missing: str) -> dict[str, Any]:
    """A summary from whatever reports exist (the job ended before the head wrote one)."""
    groups: dict[str, list] = {}
    for group, n in {"orchestrator": 1, **expected}.items():
        groups[group] = []
        for rank in range(n):
            try:
                groups[group].append(read_json(run.preflight_report(group, rank)))
            except (OSError, ValueError):
                groups[group].append(
                    {
                        "group": group,
                        "rank": rank,
                        "host": None,
                        "ok": False,
                        "checks": [{"name": "report", "ok": False, "detail": why_missing}],
                    }
                )
    return {"ok": False, "groups": groups}


def format_table(summary: dict[str, Any]) -> str:
    """One row per group and rank: PASS/FAIL, host, and the failing checks' details."""
    rows = [("GROUP", "RANK", "RESULT", "HOST", "DETAIL")]
    order = {"orchestrator": 0, "inference": 1, "router": 2, "trainer": 3, "teacher": 4}
    for group, reports in sorted(summary["groups"].items(), key=lambda kv: order.get(kv[0], 9)):
        for r in reports:
            failed = [f"{c['name']}: {c['detail']}" for c in r["checks"] if not c["ok"]]
            detail = "; ".join(failed) if failed else ", ".join(f"{c['name']}" for c in r["checks"])
            host = (r.get("host") or "-") + (f" ({r['slurm_node']})" if r.get("slurm_node") else "")
            rows.append((group, str(r["rank"]), "PASS" if r["ok"] else "FAIL", host, detail))
    return "\n".join(columns(rows))


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prime_hpc.job.preflight")
    sub = p.add_subparsers(dest="cmd", required=True)
    n = sub.add_parser("node")
    n.add_argument("--group", choices=("inference", "router", "trainer", "teacher"), required=True)
    n.add_argument("--output-dir", required=True)
    a = p.parse_args(argv)
    return run_node(RunDir(a.output_dir), a.group)


if __name__ == "__main__":
    sys.exit(main())
