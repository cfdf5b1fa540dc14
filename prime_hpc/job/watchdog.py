"""`python -m prime_hpc.job.watchdog <output_dir> --stall-timeout-s T`: the run's
stall watchdog, a service of the job script next to the supervisor (light imports).

Every running component writes `heartbeats/<component>_<rank>` at least every `BEAT_S`
from the loop that does its work (`RunDir.beat`). A component is stalled when

- its heartbeat is older than T: the process is alive (the supervisor would have seen it
  exit) but its loop no longer runs: stopped, deadlocked, stuck in a call; or
- it still beats but has made no progress (`progress_at`: a step written or trained, a
  policy served) for T while it was not only waiting for another component (`waiting_on`).

Inference servers are replaceable and watched apart (`--server-stall-timeout-s` S,
`inference.stall_timeout_s`): a server whose heartbeat is older than S, or that has
requests in flight and finished none for S, is hung. The watchdog does not end the job
for it: it asks the server's supervisor to kill it (`control/restart_<slot>.json`, once
per process), which then restarts it like a server that died. The job fails only when no
server could serve for longer than T (hung, dead, restarting): one line naming every
server, its state and its log. An orchestrator that waits for inference is excused while
a server works on its requests, or while the fleet is being restarted.

Components that said they are done, and heartbeats of servers that left, are not
watched. On a stall the watchdog prints one line (component, how long it was silent, the
last line of its log), writes `control/stall.json` for the supervisor's record, and
exits 3; the supervisor then ends the job like any failed component.

In a job of several runs (`runs/<name>/`), each run's orchestrator is watched the same way
(its heartbeat in the run's directory, excused by the job's servers), and a stall ends that
run alone: `runs/<name>/run.json` FAILED with the same line, which has the job's head stop
its orchestrator and the trainer free its slot; the watchdog goes on watching the others.

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
from prime_hpc.rundir import RunDir, atomic_write_json, last_line, logtree, parse_slot, runs

POLL_S = 2.0
STALLED = jobenv.STALLED  # the exit code


def stalled(beats: dict[str, dict], timeout_s: float, now: float, fleet_down: bool = False) -> Optional[dict[str, Any]]:
    """The longest stall among the heartbeats {"trainer_0": {...}, ...} of components that
    are not inference servers (`hung_servers` judges those), or None. An orchestrator
    only waiting for inference is excused while a server works on requests (a hung one
    included: the watchdog has it restarted), or while the fleet is down (`fleet_down`:
    `Fleet.stall` ends the job if that lasts)."""
    # a server at work (a teacher's too: in opd it scores, in sft it generates) excuses the wait
    busy = any(parse_slot(n) and not b.get("waiting_on") and not b.get("done") for n, b in beats.items())
    stalls: list[dict[str, Any]] = []
    for name, b in beats.items():
        if parse_slot(name) or b.get("done") or b.get("stopped") or not isinstance(b.get("time"), (int, float)):
            continue
        silent = now - float(b["time"])
        why = "no heartbeat"
        waiting = b.get("waiting_on") if b.get("waiting_on") != "inference" or busy or fleet_down else None
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
                    **({"env_server": w} if why == "no progress" and (w := env_wait(b, timeout_s, now)) else {}),
                }
            )
    return max(stalls, key=lambda x: int(x["silent_s"]), default=None)


def env_wait(beat: dict, timeout_s: float, now: float) -> Optional[dict]:
    """The env server an orchestrator that makes no progress waits for (its heartbeat's
    `env_waits`): the one whose oldest group has been out longer than `timeout_s`, if any;
    its `out_s`, how long."""
    waits = [w for w in beat.get("env_waits") or [] if isinstance(w, dict) and isinstance(w.get("since"), (int, float))]
    oldest = min(waits, key=lambda w: float(w["since"]), default=None)
    if oldest is None or now - float(oldest["since"]) <= timeout_s:
        return None
    return {**oldest, "out_s": int(now - float(oldest["since"]))}


def _inference(name: str) -> bool:
    """`name` is the heartbeat of an inference server (not of a teacher's, not another
    component's)."""
    slot = parse_slot(name)
    return slot is not None and slot.group == "inference"


def hung_servers(beats: dict[str, dict], timeout_s: float, now: float) -> dict[str, Optional[str]]:
    """{slot: None if the server can serve, else why it is hung} for every inference
    server's heartbeat: silent for `timeout_s`, or requests in flight and none finished
    for `timeout_s`, or a weight update under way for `timeout_s` (an engine frozen in an
    update takes no request: nothing else would show it; 0: never hung)."""
    out: dict[str, Optional[str]] = {}
    for name, b in beats.items():
        if not parse_slot(name) or b.get("done") or not isinstance(b.get("time"), (int, float)):
            continue
        silent, idle = now - float(b["time"]), now - float(b.get("progress_at") or b["time"])
        if timeout_s > 0 and silent > timeout_s:
            out[name] = f"no heartbeat for {int(silent)}s"
        elif timeout_s > 0 and int(b.get("in_flight") or 0) > 0 and idle > timeout_s:
            out[name] = f"alive, but no progress for {int(idle)}s with {b['in_flight']} request(s) in flight"
        elif timeout_s > 0 and b.get("updating") and idle > timeout_s:
            out[name] = f"alive, but no progress for {int(idle)}s in a weight update"
        else:
            out[name] = None
    return out


class Fleet:
    """The watchdog's view of the inference servers across polls: which hung process it
    asked to restart already, and since when no server could serve."""

    def __init__(self, run: RunDir, logs: Path, timeout_s: float, server_timeout_s: float) -> None:
        self.run, self.logs = run, logs
        self.timeout_s, self.server_timeout_s = timeout_s, server_timeout_s
        self.asked: dict[str, Any] = {}  # slot -> the pid whose restart was asked
        self.serving_at: Optional[float] = None  # the last time a server could serve (None: none yet)

    def check(self, beats: dict[str, dict], now: float) -> bool:
        """Ask for the restart of every newly hung server (the run's own teacher's too);
        True while the inference fleet is down (no server can serve now, after one could)."""
        verdicts = hung_servers(beats, self.server_timeout_s, now)
        for slot, why in verdicts.items():
            if why is not None and self.asked.get(slot) != beats[slot].get("pid"):
                self.asked[slot] = beats[slot].get("pid")
                self.request_restart(slot, beats[slot], why, now)
        serving = [why is None for slot, why in verdicts.items() if _inference(slot)]
        if any(serving):
            self.serving_at = now
        return self.serving_at is not None and not any(serving)

    def request_restart(self, slot: str, beat: dict, why: str, now: float) -> None:
        from prime_hpc.rundir.fleet import request_restart

        log = logtree.log_of(self.logs, slot)
        reason = f"hung: {why} (inference.stall_timeout_s={self.server_timeout_s:g})"
        request_restart(self.run, slot, reason, log, beat)
        print(f"prime-hpc watchdog: {slot} {reason}; asking for its restart; see {log}", file=sys.stderr, flush=True)

    def stall(self, now: float) -> Optional[dict[str, Any]]:
        """The job's stall when no server could serve for longer than the watchdog's
        timeout: every server named with its state and log."""
        if self.serving_at is None or now - self.serving_at <= self.timeout_s:
            return None
        from prime_hpc.rundir.fleet import fleet

        rows = fleet(self.run)
        servers = [
            f"{r['slot']} {r['state']}, {r['restarts']} restart(s), log {r['log'] or logtree.log_of(self.logs, r['slot'])}"
            for r in rows
        ]
        silent = int(now - self.serving_at)
        reason = (
            f"stalled: no inference server could serve for {silent}s (watchdog.stall_timeout_s={self.timeout_s:g}): "
            + ("; ".join(servers) or "none left")
        )
        log = rows[0]["log"] if rows and rows[0]["log"] else str(logtree.log_of(self.logs, "inference_0"))
        return {
            "component": "inference",
            "servers": [r["slot"] for r in rows],
            "silent_s": silent,
            "why": "no server",
            "reason": reason,
            "log": log,
            "node": None,
            "who": "inference",
        }


def stall_log(logs: Path, component: str, rank: int, ranks_per_node: int) -> Path:
    """The log of the stalled `component` rank: its node's (`logtree.log_of`)."""
    node = {"trainer": rank // max(1, ranks_per_node)}.get(component)
    return logtree.log_of(logs, component, node)


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
    server_timeout_s: Optional[float] = None,
) -> int:
    """Poll the heartbeats until a stall (then record it and return `STALLED`) or the job
    script's death (0). `server_timeout_s`: the run has inference servers, watched as a
    fleet (None: it has none)."""
    fleet = Fleet(run, logs, timeout_s, server_timeout_s) if server_timeout_s is not None else None
    while True:
        time.sleep(poll_s)
        if supervisor is not None and supervisor.died(run):
            return 0
        beats, now = run.beats(), time.time()
        down = fleet.check(beats, now) if fleet is not None else False
        for name, stall in run_stalls(run, beats, timeout_s, now, down, logs):
            runs.record(run.sub_run(name), runs.FAILED, stall.get("step"), f"{stall['who']} {stall['reason']}")
            print(
                f"prime-hpc watchdog: run {name}: {stall['who']} {stall['reason']}; see {stall['log']}; "
                "the run ends, the others go on",
                file=sys.stderr,
                flush=True,
            )
        record = fleet.stall(now) if fleet is not None else None
        if record is None:
            s = stalled(beats, timeout_s, now, fleet_down=down)
            if s is None:
                continue
            record = component_stall(s, logs, timeout_s, ranks_per_node)
        atomic_write_json(run.stall_record, {**record, "at": time.time()})
        print(
            f"prime-hpc watchdog: {record['who']} {record['reason']}; see {record['log']}", file=sys.stderr, flush=True
        )
        return STALLED


def run_stalls(
    job: RunDir, beats: dict[str, dict], timeout_s: float, now: float, fleet_down: bool, logs: Path
) -> list[tuple[str, dict[str, Any]]]:
    """The stalled orchestrators of a job's runs still going (`runs/<name>/heartbeats/`; the
    job's servers excuse a wait for inference as they do the job's own), each with its
    record (`component_stall`, its log the run's)."""
    servers = {n: b for n, b in beats.items() if parse_slot(n)}
    out = []
    for name in job.sub_runs():
        sub = job.sub_run(name)
        if runs.is_over(sub):
            continue
        # the run's trainer heartbeat is written at its steps only: the job's trainer beat is the one watched
        own = {n: b for n, b in sub.beats().items() if n.startswith("orchestrator_")}
        s = stalled({**servers, **own}, timeout_s, now, fleet_down) if own else None
        if s is not None:
            out.append((name, component_stall(s, logtree.sub_run_logs(logs, name), timeout_s, 1)))
    return out


def component_stall(s: dict[str, Any], logs: Path, timeout_s: float, ranks_per_node: int) -> dict[str, Any]:
    """The record of a component's stall `s` (`stalled`): who, why in one line, its log."""
    log = stall_log(logs, s["component"], s["rank"], ranks_per_node)
    who = s["component"] + (f" rank {s['rank']}" if s["component"] == "trainer" else "")
    what = "no heartbeat" if s["why"] == "no heartbeat" else "alive, but no progress"
    at = f" at step {s['step']}" if s.get("step") is not None else ""
    if (w := s.get("env_server")) is not None:  # it waits for an env server that answers nothing: that one is named
        log = Path(w["log"])
        what = (
            f"waiting on its {w.get('kind', 'train')} env server {w.get('env')}: {w.get('groups', 1)} group(s) out,"
            f" the oldest for {w['out_s']}s"
        )
        reason = (
            f"stalled: {what} (watchdog.stall_timeout_s={timeout_s:g}){at}; its workers' logs are beside its log,"
            f" whose last line: {last_line(log) or '(empty)'}"
        )
    else:
        reason = (
            f"stalled: {what} for {s['silent_s']}s (watchdog.stall_timeout_s={timeout_s:g}){at}"
            f"; last line of its log: {last_line(log) or '(empty)'}"
        )
    node = s["rank"] // max(1, ranks_per_node) if s["component"] == "trainer" else s["rank"]
    return {**s, "who": who, "reason": reason, "log": str(log), "node": node}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prime_hpc.job.watchdog")
    p.add_argument("output_dir")
    p.add_argument("--stall-timeout-s", type=float, required=True)
    p.add_argument("--ranks-per-node", type=int, default=1)
    p.add_argument("--job-id", default="")
    p.add_argument("--supervisor-pid", type=int, help="the job script's pid: its death ends the attempt")
    p.add_argument("--server-stall-timeout-s", type=float, help="inference.stall_timeout_s (a run with servers)")
    a = p.parse_args(argv)
    if a.stall_timeout_s <= 0:
        return 0
    run = RunDir(a.output_dir)
    logs = jobenv.logs_dir() or run.latest_logs
    supervisor = Supervisor(a.job_id, a.supervisor_pid) if a.supervisor_pid else None
    try:
        return watch(
            run,
            a.stall_timeout_s,
            logs,
            a.ranks_per_node,
            supervisor=supervisor,
            server_timeout_s=a.server_stall_timeout_s,
        )
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
