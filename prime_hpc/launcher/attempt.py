"""Runtime helpers the job script calls (light imports: runs once per attempt).

  python -m prime_hpc.launcher.attempt start <output_dir> --job-id ID
      new log tree logs/attempt_<k>/ (+ logs/latest), job.json state RUNNING; prints the path
  python -m prime_hpc.launcher.attempt end <output_dir> --job-id ID --rc N [--component C] [--reason R]
      job.json final state, and which component failed with the log to read
  python -m prime_hpc.launcher.attempt rendezvous
      prints <address>:<port> of this node with a port free here (torchrun c10d endpoint)
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import time

from prime_hpc.jobs import CANCELLED, COMPLETED, FAILED, RUNNING, editing_job
from prime_hpc.rundir import RunDir


def start(run: RunDir, job_id: str) -> str:
    k, logs = run.new_attempt()
    # endpoints are per attempt: nobody may find a previous attempt's servers
    shutil.rmtree(run.endpoints_dir, ignore_errors=True)
    run.endpoints_dir.mkdir(parents=True, exist_ok=True)
    for sub in ("inference", "trainer", "envs"):
        (logs / sub).mkdir(exist_ok=True)
    # top-level names of the reference layout, pointing at node 0's stream
    for comp in ("trainer", "inference"):
        os.symlink(os.path.join(comp, "node_0.log"), run.component_log(logs, comp))
    with editing_job(run) as job:
        job.update(state=RUNNING, attempt=k, failure=None, ended_at=None)
        job.setdefault("attempts", []).append(
            {"attempt": k, "job_id": job_id, "host": socket.gethostname(), "started_at": time.time(),
             "logs": str(logs)})
    return str(logs)


def end(run: RunDir, job_id: str, rc: int, component: str = "", reason: str = "") -> str:
    """Record how this attempt ended. A job that no longer owns the run directory (it was
    cancelled and the directory reused) records nothing; a cancel stays a cancel."""
    logs = run.latest_logs.resolve()
    with editing_job(run) as job:
        ids = [str(i) for i in job.get("job_ids", [])]
        if ids and ids[-1] != str(job_id):
            return f"prime-hpc: job {job_id} no longer owns {run.root}; nothing recorded"
        job["ended_at"] = time.time()
        if job.get("state") == CANCELLED:
            return f"prime-hpc: run cancelled; logs in {logs}"
        job["state"] = COMPLETED if rc == 0 else FAILED
        job["failure"] = None
        if rc != 0:
            log = component_log(logs, component) if component else logs
            job["failure"] = {"component": component or None, "rc": rc, "reason": reason, "log": str(log)}
    if rc != 0:
        return f"prime-hpc: run failed: {(component + ' ') if component else ''}{reason}; see {job['failure']['log']}"
    return f"prime-hpc: run completed; logs in {logs}"


def component_log(logs, component: str):
    """The log to read first when `component` failed."""
    if component == "router":
        return RunDir.router_log(logs, 0)
    if component.startswith("inference_"):  # a local "node"
        return RunDir.node_log(logs, "inference", int(component.split("_")[1]))
    return RunDir.component_log(logs, component)


def rendezvous() -> str:
    """This node's address and a port that is free here right now."""
    from prime_hpc.net import free_port

    return f"{socket.gethostname()}:{free_port('')}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prime_hpc.launcher.attempt")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start")
    s.add_argument("output_dir")
    s.add_argument("--job-id", default="")
    e = sub.add_parser("end")
    e.add_argument("output_dir")
    e.add_argument("--job-id", required=True)
    e.add_argument("--rc", type=int, required=True)
    e.add_argument("--component", default="")
    e.add_argument("--reason", default="")
    sub.add_parser("rendezvous")
    a = p.parse_args(argv)
    if a.cmd == "start":
        print(start(RunDir(a.output_dir), a.job_id))
    elif a.cmd == "end":
        print(end(RunDir(a.output_dir), a.job_id, a.rc, a.component, a.reason), file=sys.stderr)
    else:
        print(rendezvous())
    return 0


if __name__ == "__main__":
    sys.exit(main())
