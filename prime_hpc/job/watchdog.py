"""`python -m prime_hpc.job.watchdog <output_dir> --stall-timeout-s T`: the run's
stall watchdog, a service of the job script next to the supervisor (light imports).

Every running component writes `heartbeats/<component>_<rank>` at least every `BEAT_S`
from the loop that does its work (`RunDir.beat`). A component is stalled when

- its heartbeat is older than T: the process is alive (the supervisor would have seen it
  exit) but its loop no longer runs: stopped, deadlocked, stuck in a call; or
- it still beats but has made no progress (`progress_at`: a step written or trained, a
  policy served, an inference server's finished generation) for T while it was not only
  waiting for another component (`waiting_on`). A stalled inference server is named
  before the orchestrator whose generations it holds.

Components that said they are done, heartbeats of servers the run has lost, and the
servers of extra inference jobs (`inference_<job id>.<node>`, `prime-hpc scale`: the run
does not depend on them; the relay drops one that stops answering) are not watched. On a stall the watchdog prints one line (component, how long it was silent, the
last line of its log), writes `control/stall.json` for the supervisor's record, and
exits 3; the supervisor then ends the job like any failed component.

It also watches the job script (`--supervisor-pid`): a script that dies without ending its
attempt (`kill -9`, the OOM killer) cannot record that, so the watchdog does (job.json:
FAILED, `failure.component = supervisor`, its batch output as the log) and exits.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Optional

from prime_hpc.core import jobenv
from prime_hpc.rundir import RunDir, atomic_write_json, tail_lines
from prime_hpc.rundir.layout import parse_slot

POLL_S = 2.0
STALLED = 3  # exit code


def is_extra_slot(name: str) -> bool:
    """A heartbeat of a server of an extra inference job (`inference_<job id>.<node>`)."""
    slot = parse_slot(name)
    return slot is not None and slot.job_id is not None


def stalled(beats: dict[str, dict], timeout_s: float, now: float) -> Optional[dict[str, Any]]:
    """The stall to report among heartbeats {"trainer_0": {...}, ...}, or None: an
    inference server's first (a hung engine also starves the orchestrator, which then
    stalls with it: the server is the cause), else the longest silence."""
    # a server at work (not only waiting); one that hangs is what an orchestrator waiting for
    # inference waits on: without one, that wait is no excuse
    serving = any(
        n.startswith("inference_") and not b.get("waiting_on") and not b.get("done") for n, b in beats.items()
    )
    stalls = []
    for name, b in beats.items():
        if b.get("done") or b.get("stopped") or not isinstance(b.get("time"), (int, float)) or is_extra_slot(name):
            continue
        silent = now - float(b["time"])
        why = "no heartbeat"
        waiting = b.get("waiting_on") if b.get("waiting_on") != "inference" or serving else None
        if silent <= timeout_s and isinstance(b.get("progress_at"), (int, float)) and not waiting:
            silent, why = now - float(b["progress_at"]), "no progress"
        if silent > timeout_s:
            component, _, rank = name.rpartition("_")
            stalls.append(
                {
                    "component": component,
                    "rank": int(rank) if rank.isdigit() else 0,
                    "silent_s": int(silent),
                    "why": why,
                    "step": b.get("step"),
                }
            )
    return max(stalls, key=lambda x: (x["component"] == "inference", x["silent_s"]), default=None)


def last_line(path: Path, max_bytes: int = 8192) -> str:
    """The last non-blank line of the log `path` (at most 300 characters; '' if none)."""
    lines = [ln.strip() for ln in tail_lines(path, max_bytes, keep_cut=True) if ln.strip()]
    return lines[-1][:300] if lines else ""


def stall_log(logs: Path, component: str, rank: int, ranks_per_node: int) -> Path:
    """The log of the stalled `component` rank: its node's (`RunDir.log_of`)."""
    node = {"trainer": rank // max(1, ranks_per_node), "inference": rank}.get(component)
    return RunDir.log_of(logs, component, node)


class Supervisor:
    """The job script, told apart from a later process that reuses its pid by its start
    time (where that cannot be read, no /proc, the script is not watched)."""

    def __init__(self, job_id: str, pid: int) -> None:
        from prime_hpc.rundir.jobs import start_time

        self.job_id, self.pid, self.started = job_id, pid, start_time(pid)

    def died(self, run: RunDir) -> bool:
        """True (and recorded in job.json) once the script is gone."""
        from prime_hpc.job.attempt import supervisor_died
        from prime_hpc.rundir.jobs import start_time

        if self.started is None or start_time(self.pid) == self.started:
            return False
        print(
            supervisor_died(run, self.job_id, self.pid) or "prime-hpc watchdog: the job script ended",
            file=sys.stderr,
            flush=True,
        )
        return True


def watch(
    run: RunDir,
    timeout_s: float,
    logs: Path,
    ranks_per_node: int = 1,
    poll_s: float = POLL_S,
    supervisor: Optional[Supervisor] = None,
) -> int:
    while True:
        time.sleep(poll_s)
        if supervisor is not None and supervisor.died(run):
            return 0
        s = stalled(run.beats(), timeout_s, time.time())
        if s is None:
            continue
        log = stall_log(logs, s["component"], s["rank"], ranks_per_node)
        who = s["component"] + (
            f" rank {s['rank']}"
            if s["component"] == "trainer"
            else f" node {s['rank']}"
            if s["component"] == "inference"
            else ""
        )
        what = "no heartbeat" if s["why"] == "no heartbeat" else "alive, but no progress"
        reason = (
            f"stalled: {what} for {s['silent_s']}s (watchdog.stall_timeout_s={timeout_s:g})"
            + (f" at step {s['step']}" if s.get("step") is not None else "")
            + f"; last line of its log: {last_line(log) or '(empty)'}"
        )
        node = s["rank"] // max(1, ranks_per_node) if s["component"] == "trainer" else s["rank"]
        atomic_write_json(
            run.stall_record, {**s, "who": who, "reason": reason, "log": str(log), "node": node, "at": time.time()}
        )
        print(f"prime-hpc watchdog: {who} {reason}; see {log}", file=sys.stderr, flush=True)
        return STALLED


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prime_hpc.job.watchdog")
    p.add_argument("output_dir")
    p.add_argument("--stall-timeout-s", type=float, required=True)
    p.add_argument("--ranks-per-node", type=int, default=1)
    p.add_argument("--job-id", default="")
    p.add_argument("--supervisor-pid", type=int, help="the job script's pid: its death ends the attempt")
    a = p.parse_args(argv)
    if a.stall_timeout_s <= 0:
        return 0
    run = RunDir(a.output_dir)
    logs = jobenv.logs_dir() or run.latest_logs
    supervisor = Supervisor(a.job_id, a.supervisor_pid) if a.supervisor_pid else None
    try:
        return watch(run, a.stall_timeout_s, logs, a.ranks_per_node, supervisor=supervisor)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
