"""The helpers an extra inference job's script calls (`prime-hpc scale`; light imports).

python -m prime_hpc.job.extra <command> <output_dir> --job-id ID [options]

start   the job's log directory, logs/extra/<id>/ (printed); its record in job.json's
        `extra_jobs` RUNNING; each of its slots `starting` in the fleet (`fleet/<slot>.json`). Refused (exit 1, nothing started) when the run does not
        record this job, when it was cancelled meanwhile, or when the run has ended
check   exit 0 while the run still runs (its servers stay), 1 once it ended: its job.json
        state is final (COMPLETED, FAILED, CANCELLED ...); a run between two attempts
        (REQUEUED, PENDING) still runs
leave   --reason WHY: tell the job's servers to leave the run (`logs/extra/<id>/leave`,
        which each of them watches): they drain and exit
hung    --request FILE: the run's watchdog found a server of this job hung
        (`control/restart_<slot>.json`): its cause recorded, the request consumed; prints
        "<slot> <SLURM step>" for the script, which kills it (an extra job's server is not
        restarted: it leaves, as if it had died)
end     --reason WHY --exits "n=rc ...": how the job ended, in its record (state, end,
        ended_at, each server's exit code); its slots' fleet records, and the endpoint and
        heartbeat files its servers left (a server that was killed), are removed

States of an extra job's record: PENDING (submitted), RUNNING, then COMPLETED (it left
because the run ended), TIMEOUT (it left before its time limit), PREEMPTED, CANCELLED
(`prime-hpc scale -N`, `prime-hpc cancel`, scancel), FAILED (every server exited on its
own, one of them with an error).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Optional

from prime_hpc.rundir import RunDir, atomic_write_text, logtree
from prime_hpc.rundir.fleet import STARTING, write_process
from prime_hpc.rundir.jobs import CANCELLED, COMPLETED, FAILED, FINAL_STATES, extra_job, read_job, update_extra_job
from prime_hpc.rundir.layout import server_slot

# why the job's script told its servers to leave -> the state recorded (unless cancelled:
# `prime-hpc scale -N` and `cancel` record that first, then send the same SIGUSR2)
LEFT_BECAUSE = {"USR2": "TIMEOUT", "RUN_ENDED": COMPLETED}


def start(run: RunDir, job_id: str) -> str:
    """The job's log directory (created); its record RUNNING. Raises RuntimeError (one
    line) when the job must not start."""
    job = read_job(run)
    record = extra_job(job, job_id)
    if record is None:
        raise RuntimeError(f"job {job_id} is not an extra inference job of {run.root} (its job.json does not list it)")
    if record.get("state") == CANCELLED:
        raise RuntimeError(f"job {job_id} was cancelled before it started")
    if job.get("state") in FINAL_STATES:
        update_extra_job(run, job_id, state=COMPLETED, end="RUN_ENDED", started_at=None, ended_at=time.time())
        raise RuntimeError(f"the run ended ({job.get('state')}) before job {job_id} started: nothing to serve")
    logs = run.extra_job_logs(job_id)
    logtree.group_log_dir(logs, "inference").mkdir(parents=True, exist_ok=True)
    for node in range(int(record.get("nodes") or 0)):  # the fleet's view (`status`): starting, until the relay has it
        slot = server_slot(node, job_id)
        try:
            write_process(
                run, slot, STARTING, node=node, job_id=job_id, restarts=0, log=str(logtree.log_of(logs, slot))
            )
        except OSError:  # an attempt of the run's job starting this moment empties fleet/: the view only
            pass
    update_extra_job(
        run,
        job_id,
        state="RUNNING",
        started_at=time.time(),
        nodelist=os.environ.get("SLURM_JOB_NODELIST"),
        logs=str(logs),
    )
    return str(logs)


def running(run: RunDir, job_id: str) -> bool:
    """The run still runs (an attempt, or between two), and this job was not cancelled."""
    job = read_job(run)
    record = extra_job(job, job_id) or {}
    return job.get("state") not in FINAL_STATES and record.get("state") != CANCELLED


def parse_exits(text: str) -> dict[str, int]:
    """{node: exit code} from the script's "0=0 1=143"."""
    out = {}
    for item in text.split():
        node, _, rc = item.partition("=")
        if node.isdigit() and rc.lstrip("-").isdigit():
            out[node] = int(rc)
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def end_state(recorded: Optional[str], reason: str, exits: dict[str, int], cause: str) -> str:
    """The state an extra job ended in: cancelled stays cancelled; told to leave before its
    time limit (TIMEOUT) or because the run ended (COMPLETED); stopped by SLURM (a cancel,
    a preemption: `cause`, SLURM's answer); else its servers exited on their own: FAILED
    when one of them failed."""
    if recorded == CANCELLED:
        return CANCELLED
    if reason in LEFT_BECAUSE:
        return LEFT_BECAUSE[reason]
    if reason == "STOPPED" or (exits and all(rc == 0 for rc in exits.values())):
        return cause
    return FAILED


def end(run: RunDir, job_id: str, rc: int, reason: str, exits: dict[str, int]) -> str:
    """Record how the job ended and remove what its servers left in `endpoints/` and
    `heartbeats/` (all of them have exited)."""
    from prime_hpc.sched.registry import of

    job = read_job(run)
    record = extra_job(job, job_id) or {}
    for node in range(int(record.get("nodes") or 0)):
        slot = server_slot(node, job_id)
        for path in (run.inference_endpoint(slot), run.server_heartbeat(slot), run.fleet_process(slot)):
            path.unlink(missing_ok=True)
    if rc != 0:
        state = FAILED
    else:
        cause = of(job).stop_cause(run, job_id) if reason in ("STOPPED", "") else ""
        state = end_state(record.get("state"), reason, exits, cause)
    update_extra_job(run, job_id, state=state, end=reason or None, ended_at=time.time(), exits=exits)
    return f"prime-hpc: extra inference job {job_id} ended {state}" + (f" ({reason})" if reason else "")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prime_hpc.job.extra")
    p.add_argument("cmd", choices=("start", "check", "leave", "hung", "end"))
    p.add_argument("--request", default="")
    p.add_argument("output_dir")
    p.add_argument("--job-id", required=True)
    p.add_argument("--rc", type=int, default=0)
    p.add_argument("--reason", default="")
    p.add_argument("--exits", default="")
    a = p.parse_args(argv)
    run = RunDir(a.output_dir)
    if a.cmd == "start":
        try:
            print(start(run, a.job_id))
        except RuntimeError as e:
            print(f"prime-hpc: {e}", file=sys.stderr)
            return 1
        return 0
    if a.cmd == "check":
        return 0 if running(run, a.job_id) else 1
    if a.cmd == "leave":
        atomic_write_text(run.extra_leave_request(a.job_id), a.reason + "\n")
        return 0
    if a.cmd == "hung":
        from prime_hpc.job.attempt import hung

        print(hung(run, Path(a.request)))
        return 0
    print(end(run, a.job_id, a.rc, a.reason, parse_exits(a.exits)), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
