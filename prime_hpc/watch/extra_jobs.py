"""A run's extra inference jobs (`prime-hpc scale`) as `status`, `list` and `tail` show
them: each job's record in job.json (`extra_jobs`) with its live state (asked of the
backend once for all of them), and its servers' logs. Their servers' states are the run's
fleet's (`rundir.fleet`). Light: no config, no submitit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from prime_hpc.core.text import ago, columns
from prime_hpc.rundir import RunDir, logtree
from prime_hpc.rundir.jobs import FINAL_STATES, extra_jobs
from prime_hpc.rundir.layout import server_slot


def live_states(job: dict[str, Any]) -> tuple[dict[str, str], str]:
    """{job id: state} of the run's extra jobs that their records do not say ended, asked
    of the run's backend at once, and a note when it could not be asked."""
    from prime_hpc.sched.registry import choose

    open_ids = [str(x["job_id"]) for x in extra_jobs(job) if x.get("state") not in FINAL_STATES]
    if not open_ids or "backend" not in job:
        return {}, ""
    return choose(job["backend"]).plain_states(open_ids)


def state_of(record: dict[str, Any], live: dict[str, str]) -> str:
    """An extra job's state: what the scheduler says while it knows the job, else its
    record (which the job writes as it ends; a job killed before it could says RUNNING
    while the scheduler has forgotten it: shown as ENDED)."""
    recorded = str(record.get("state") or "UNKNOWN")
    if recorded in FINAL_STATES:
        return recorded
    return live.get(str(record["job_id"])) or ("ENDED" if recorded == "RUNNING" else recorded)


def extra_status(run: RunDir, job: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """Every extra job of the run (oldest first) with its state, and a note when the
    backend could not be asked. (Their servers are rows of the run's fleet: `rundir.fleet`.)"""
    live, note = live_states(job)
    return [{**x, "state": state_of(x, live)} for x in extra_jobs(job)], note


def format_extra(rows: list[dict[str, Any]]) -> list[str]:
    """`status`'s lines for the extra jobs: one per job (id, nodes, state, when, where);
    their servers are in the fleet's table above, as `inference_<id>.<n>`."""
    if not rows:
        return []
    table = [("EXTRA JOB", "NODES", "STATE", "SUBMITTED", "ENDED", "WHERE")]
    for x in rows:
        where = " ".join(f"{k}={x[k]}" for k in ("partition", "time") if x.get(k))
        if x.get("fleet"):  # the run's own servers (cluster.inference_job=own), not a scale
            where = f"the run's servers {where}".strip()
        ended = ago(x.get("ended_at")) + (f" ({x['end']})" if x.get("end") else "")
        table.append((str(x["job_id"]), str(x["nodes"]), x["state"], ago(x.get("submitted_at")), ended, where or "-"))
    return columns(table, indent="  ")


def log_sources(run: RunDir, job: dict[str, Any], since: Optional[float] = None) -> list[tuple[Path, str]]:
    """(log, label) of every server of the run's extra jobs that had not ended by `since`
    (default: every one): `logs/extra/<id>/inference/node_<id>.<n>.log` as `inference[<id>.<n>]`."""
    out = []
    for x in extra_jobs(job):
        if since is not None and x.get("ended_at") and float(x["ended_at"]) < since:
            continue
        logs = run.extra_job_logs(str(x["job_id"]))
        for n in range(int(x.get("nodes") or 0)):
            out.append((logtree.log_of(logs, server_slot(n, str(x["job_id"]))), f"inference[{x['job_id']}.{n}]"))
    return out
