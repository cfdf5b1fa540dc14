"""A running job's env servers as `status` shows them, from the run directory alone: no
HTTP, no key (a server's `GET /info` says more, behind the job's key).

Consumes, per env server:
- its endpoint, `private/envservers/<kind>-<env>.json` {"url", "pid", "instance"}
  (`RunDir.env_server_endpoint`), written by the server once it serves and removed when
  it stops: an endpoint there means a server that serves, or one that died without
  removing it;
- its log, `logs/<attempt>/envs/<kind>/<env>/env_server.log` (`logtree.env_server_log`):
  its workers (`worker <id> started (pid <p>)`, again on each restart) and restarts
  (`restarting it (...)`), and `no more restarts` once its workers died past its bound.

Produces one row per endpoint (`env_servers`) and one line per row (`env_server_line`).
A server's pid is checked only on the host that runs the attempt (the head node, whose
orchestrator started the server): `alive` is True or False there, None elsewhere.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import Any, Optional

from prime_hpc.rundir import RunDir, logtree

_STARTED = re.compile(r"worker (\d+) started \(pid (\d+)\)")
_RESTARTED = re.compile(r"; restarting it \(")
_GAVE_UP = "no more restarts"
CLOCK_SLACK_S = 2.0  # a process's start time from /proc is whole seconds after boot (btime), in ticks


def attempt_logs(run: RunDir, job: dict[str, Any]) -> Path:
    """The log tree of the job's current attempt (job.json's record, else `logs/latest`)."""
    attempts = job.get("attempts") or []
    logs = attempts[-1].get("logs") if attempts else None
    return Path(logs) if logs else run.latest_logs


def attempt_host(job: dict[str, Any]) -> Optional[str]:
    """The host that runs the job's current attempt (its job script, the orchestrator)."""
    attempts = job.get("attempts") or []
    return attempts[-1].get("host") if attempts else None


def server_alive(pid: int, published_at: float) -> bool:
    """Whether `pid` is still the env server that published its endpoint at `published_at`
    (the file's mtime), on this host: a live process, not a zombie, started before it
    published (a later one was given the pid of a server that died)."""
    from prime_hpc.rundir.jobs import start_time

    if not os.path.exists("/proc/self/stat"):  # no /proc: whether the pid is taken is all there is
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    ticks = start_time(pid)  # None: gone, or a zombie
    boot = boot_time()
    if ticks is None:
        return False
    return boot is None or boot + int(ticks) / os.sysconf("SC_CLK_TCK") <= published_at + CLOCK_SLACK_S


def boot_time() -> Optional[float]:
    """When this host booted (`btime` of /proc/stat), None when unknown."""
    try:
        with open("/proc/stat") as f:
            return next(float(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, StopIteration, IndexError, ValueError):
        return None


def read_server_log(log: Path) -> dict[str, Any]:
    """{"workers": {id: pid of its latest start}, "restarts", "gave_up"} from a server's
    log (empty when there is none)."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        text = ""
    workers = {int(w): int(p) for w, p in _STARTED.findall(text)}  # the last start of each wins
    return {"workers": workers, "restarts": len(_RESTARTED.findall(text)), "gave_up": _GAVE_UP in text}


def endpoints(run: RunDir) -> list[tuple[str, str, Path]]:
    """(kind, env, endpoint file) of every published env server, in name order ([] when
    there is none, or the run's private directory cannot be read)."""
    try:
        names = sorted(os.listdir(run.env_servers_dir))
    except OSError:
        return []
    out = []
    for name in names:
        kind, sep, env = name[: -len(".json")].partition("-")
        if name.startswith(".") or not name.endswith(".json") or not sep or not env:
            continue  # a file being written (`.tmp.*`), or not an endpoint
        out.append((kind, env, run.env_servers_dir / name))
    return out


def env_servers(run: RunDir, job: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per published env server of `run`: kind, env, url, pid, host (the attempt's),
    alive (None: not checked, from another host), workers (their count in its log),
    restarts, gave_up, log, endpoint. An endpoint that cannot be read (being replaced) is
    left out."""
    from prime_hpc.rundir.files import read_json

    logs, host = attempt_logs(run, job), attempt_host(job)
    here = bool(host) and host == socket.gethostname()
    rows = []
    for kind, env, endpoint in endpoints(run):
        try:
            me, published_at = read_json(endpoint), endpoint.stat().st_mtime
        except (OSError, ValueError):
            continue
        if not isinstance(me, dict) or not isinstance(me.get("pid"), int):
            continue
        log = logtree.env_server_log(logs, kind, env)
        said = read_server_log(log)
        rows.append(
            {
                "kind": kind,
                "env": env,
                "url": me.get("url"),
                "pid": me["pid"],
                "host": host,
                "alive": server_alive(me["pid"], published_at) if here else None,
                "workers": len(said["workers"]),
                "restarts": said["restarts"],
                "gave_up": said["gave_up"],
                "log": str(log),
                "endpoint": str(endpoint),
            }
        )
    return rows


def env_server_line(r: dict[str, Any]) -> str:
    """`env server <kind>/<env>: pid <p>, <n> workers, log <path>`, or what is wrong with it."""
    head = f"env server {r['kind']}/{r['env']}: pid {r['pid']}"
    if r["alive"] is False:
        return f"{head} is gone (it ended without removing {r['endpoint']}); log {r['log']}"
    where = f" on {r['host']} (not checked from here)" if r["alive"] is None and r.get("host") else ""
    parts = [head + where]
    if r["workers"]:
        parts.append(f"{r['workers']} worker{'s' if r['workers'] != 1 else ''}")
    if r["restarts"]:
        parts.append(f"{r['restarts']} restart{'s' if r['restarts'] != 1 else ''}")
    if r["gave_up"]:
        parts.append("its workers died past its restarts (the next group fails the run)")
    return ", ".join(parts) + f", log {r['log']}"
