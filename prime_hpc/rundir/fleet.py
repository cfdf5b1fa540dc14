"""The inference fleet's state, in two kinds of files (one writer each), read together.

- `fleet/<slot>.json` (`RunDir.fleet_process`), written by the supervisor of the job that
  runs the slot (`prime_hpc.job.attempt`): the server's *process* — `starting` (launched,
  not yet seen by the relay), `hung` (the watchdog found it stuck; being killed), `lost`
  (exited, not restarted: no restarts left or the run stops) — with `restarts` (this
  attempt), `since`, `log`, `node`, `job_id`, the last exit (`rc`, `reason`).
- `fleet/membership.json` (`RunDir.fleet_membership`), written by the orchestrator's weight
  relay: per slot `loading weights` (found in `endpoints/`, the current policy being loaded
  into it alone), `serving` (in the router and in every later update) or `removed` (its
  endpoint went away or it stopped answering), with `url`, `policy_step`, `since`.

`fleet(run)` merges them into one row per slot, the state a user sees:
starting → loading weights → serving, and on a fault lost (or hung) → starting → ...
A process record newer than the relay's view wins (the relay has not seen the new server
yet); otherwise the relay's state is the server's.
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional

from prime_hpc.rundir.files import atomic_write_json, read_json
from prime_hpc.rundir.layout import RunDir, parse_slot

STARTING, HUNG, LOST = "starting", "hung", "lost"  # the supervisor's
LOADING, SERVING, REMOVED = "loading weights", "serving", "removed"  # the relay's
PROCESS_STATES = (STARTING, HUNG, LOST)
MEMBER_STATES = (LOADING, SERVING, REMOVED)


def read_process(run: RunDir, slot: str) -> dict[str, Any]:
    try:
        record = read_json(run.fleet_process(slot))
        return record if isinstance(record, dict) else {}
    except (OSError, ValueError):
        return {}


def write_process(run: RunDir, slot: str, state: str, **info: Any) -> dict[str, Any]:
    """The supervisor's record of `slot` moved to `state` now (other fields kept unless
    given). Returns the record written."""
    assert state in PROCESS_STATES, state
    record = {**read_process(run, slot), **info, "slot": slot, "state": state, "since": time.time()}
    atomic_write_json(run.fleet_process(slot), record, durable=False)
    return record


def request_restart(run: RunDir, slot: str, reason: str, log: Any, beat: Optional[dict] = None) -> dict[str, Any]:
    """Ask the supervisor of `slot`'s job to kill and restart that server now
    (`control/restart_<slot>.json`; `beat`: its heartbeat, None: read now). Returns the
    request written."""
    if beat is None:
        try:
            beat = read_json(run.server_heartbeat(slot))
        except (OSError, ValueError):
            beat = {}
    request = {
        "slot": slot,
        "pid": (beat or {}).get("pid"),
        "slurm_step": (beat or {}).get("slurm_step"),
        "reason": reason,
        "log": str(log),
        "at": time.time(),
    }
    atomic_write_json(run.restart_request(slot), request)
    return request


def read_membership(run: RunDir) -> dict[str, dict]:
    """{slot: the relay's record} ({} before the relay wrote any)."""
    try:
        servers = read_json(run.fleet_membership).get("servers")
        return servers if isinstance(servers, dict) else {}
    except (OSError, ValueError, AttributeError):
        return {}


def serving_urls(run: RunDir) -> list[str]:
    """The URLs the relay has synced and routes to now (what a restarted router serves)."""
    return [m["url"] for m in read_membership(run).values() if m.get("state") == SERVING and m.get("url")]


def merged_state(process: dict, member: Optional[dict]) -> str:
    """The state of one server from its supervisor's record and the relay's (either may
    be missing): the relay's loading or serving when it is newer than the process record
    (the relay has seen this process), else the process's state."""
    member = member or {}
    if member.get("state") in (LOADING, SERVING) and float(member.get("since") or 0) >= float(
        process.get("since") or 0
    ):
        return str(member["state"])
    return str(process.get("state") or member.get("state") or "unknown")


def fleet(run: RunDir) -> list[dict[str, Any]]:
    """One row per slot of the servers of `run.group` (the run's own job's first): slot,
    state, restarts, policy_step (a teacher's: None, it is not trained), node, host, since,
    log, url."""
    members = read_membership(run)
    try:
        files = os.listdir(run.fleet_dir)
    except OSError:
        files = []
    parsed = {n[:-5]: parse_slot(n) for n in files}
    slots = {n for n, s in parsed.items() if s is not None and s.group == run.group} | set(members)
    rows = []
    for slot in sorted(slots, key=_order):
        p, m = read_process(run, slot), members.get(slot)
        since = max(float(p.get("since") or 0), float((m or {}).get("since") or 0)) or None
        rows.append(
            {
                "slot": slot,
                "state": merged_state(p, m),
                "restarts": int(p.get("restarts") or 0),
                "policy_step": (m or {}).get("policy_step") if run.group == "inference" else None,
                "node": p.get("node", (m or {}).get("node")),
                "host": (m or {}).get("hostname") or p.get("host"),
                "since": since,
                "log": p.get("log"),
                "url": (m or {}).get("url"),
                "reason": p.get("reason"),
            }
        )
    return rows


def _order(slot: str) -> tuple:
    s = parse_slot(slot)
    return (s is None, s is not None and s.job_id is not None, int((s.job_id if s else None) or 0), s.node if s else 0)
