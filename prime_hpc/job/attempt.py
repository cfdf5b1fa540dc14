"""Runtime helpers the job script calls (light imports: a few calls per attempt).

python -m prime_hpc.job.attempt <command> <output_dir> --job-id ID [options]

start       new log tree logs/attempt_<k>/ (+ logs/latest); on a restart (requeue) or a
            resume, pick the checkpoint to continue from and clear what came after it;
            job.json RUNNING; prints the log tree's path
end         --rc N [--component C] [--reason R] [--state S]: how the attempt ended
lost        --component C --rc N: a server (its slot, inference_<n> or teacher_<n>) exited;
            exit 0 when it is to be restarted in its slot (inference.max_restarts), else 1
            (the run goes on without it while other servers are left)
hung        --request FILE: the watchdog found a server hung (control/restart_<slot>.json):
            record why, print "<slot> <SLURM step>" for the supervisor to kill it
node-lost   exit 0 when a node of the job is down (SLURM; recorded in the attempt, named by
            its end): a component that died with it ends the attempt, which is requeued
checkpoint  --reason R: ask the trainer and the orchestrator to checkpoint and exit
requeue     --reason R: record the attempt as ended by R and put the job back in the queue
            (SLURM), unless cluster.max_requeues is reached (then exit 1)
cause       [--checkpoint] print why the job is being stopped: CANCELLED, TIMEOUT, PREEMPTED
            or REQUEUED; with --checkpoint, for the last three also ask for the checkpoint
wait-for    DIR: (local pipelines) wait until the run in DIR completed; fail otherwise
rendezvous  make the run's private rendezvous/ (0700) ready for this attempt's file stores
            (torchrun's rendezvous, the trainer's process group): emptied; print it. A
            directory or store there that is not the user's alone fails in one line
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any, Optional

from prime_hpc.core.errors import UserError
from prime_hpc.job import kill_signals
from prime_hpc.rundir import (
    CHECKPOINT_PARTS,
    RunDir,
    atomic_write_json,
    atomic_write_text,
    logtree,
    parse_slot,
    read_json,
    server_slot,
)
from prime_hpc.rundir import fleet as fleet_files
from prime_hpc.rundir.jobs import (
    CANCELLED,
    COMPLETED,
    FAILED,
    FINAL_STATES,
    REQUEUED,
    RUNNING,
    editing_job,
    job_groups,
    on_node,
    read_job,
)
from prime_hpc.sched import local
from prime_hpc.sched.registry import of

STOP_REASONS = ("TIMEOUT", "PREEMPTED", "REQUEUED")  # why a job checkpoints and continues later
NODE_FAIL = "NODE_FAIL"  # an attempt ended by a component that died with its node (or by its job script's)


# ----------------------------------------------------------------------------- start
def start(run: RunDir, job_id: str) -> str:
    job = read_job(run)
    restarted = any(str(a.get("job_id")) == str(job_id) for a in job.get("attempts", []))
    if restarted:
        job = unrecorded_requeue(run, job_id)
    limit = (job.get("failure") or {}).get("max_requeues")
    if restarted and limit is not None:  # SLURM brought back a job that had used its requeues: nothing written
        raise UserError(
            f"job {job_id} was requeued after it had reached cluster.max_requeues={limit}; not "
            f"continued (continue with: prime-hpc resume {run.root})"
        )
    if restarted:
        stop_leftovers(run, job_id)
    k, logs = run.new_attempt()
    # endpoints, requests and the fleet are per attempt: nobody may find a previous attempt's servers
    for d in (run.endpoints_dir, run.control_dir, run.heartbeats_dir, run.fleet_dir):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True, exist_ok=True)
    groups = job_groups(job)
    for group in ("inference", "teacher"):
        if group in groups:
            start_fleet(run, job_id, logs, group)
    for sub in ("inference", "trainer", "envs", "teacher"):  # inference/: the servers' logs and the router's
        if sub in ("trainer", "envs") or sub in groups or (sub == "inference" and job.get("fleet_nodes")):
            (logs / sub).mkdir(exist_ok=True)
    # top-level names of the reference layout, pointing at node 0's stream
    for comp in ("trainer", "inference", "teacher"):
        if comp in groups:
            os.symlink(os.path.join(comp, "node_0.log"), logtree.component_log(logs, comp))
    try:
        resumed_from = resume_point(run, restarted)
    except UserError as e:
        with editing_job(run) as job:
            job.update(
                state=FAILED,
                ended_at=time.time(),
                failure={"component": None, "rc": 1, "reason": str(e), "log": str(logs)},
            )
        raise
    if restarted:  # a job of several runs: each one not over goes on from its own latest checkpoint
        resume_runs(run)
    with editing_job(run) as job:
        job.update(state=RUNNING, attempt=k, failure=None, ended_at=None)
        job.setdefault("attempts", []).append(
            {
                "attempt": k,
                "job_id": job_id,
                "host": socket.gethostname(),
                "started_at": time.time(),
                "logs": str(logs),
                "resumed_from": resumed_from,
            }
        )
    if tops_up_fleet(job, job_id):
        ensure_fleet(run)
    return str(logs)


def tops_up_fleet(job: dict, job_id: str) -> bool:
    """Whether this attempt (the newest in `job`) submits the run's missing inference jobs
    again: only when its servers run in jobs of their own and an earlier attempt of the
    same job came before it (a requeue). The first attempt of a job leaves that to the
    command that submitted it (`submit`, `resume`), which may still be submitting them:
    an idle cluster starts a job within a second of its submission."""
    return bool(job.get("fleet_nodes")) and any(a.get("job_id") == job_id for a in job.get("attempts", [])[:-1])


def ensure_fleet(run: RunDir) -> None:
    """A run whose servers run in jobs of their own (`cluster.inference_job=own`): at the
    start of an attempt, submit again those no longer queued or running (their time limit,
    a preemption, a lost node). A failure is said in one line; the run goes on with the
    servers it has (with none, until its timeout names the inference job)."""
    from prime_hpc.launcher.scale import ensure_fleet as top_up
    from prime_hpc.rundir.jobs import resolve

    try:
        records = top_up(resolve(str(run.root)))
    except Exception as e:  # noqa: BLE001 (said, not raised: the attempt goes on)
        print(f"prime-hpc: could not submit the run's inference jobs again: {str(e).splitlines()[0]}", file=sys.stderr)
        return
    for record in records:
        print(f"prime-hpc: submitted an inference job of the run again: {record['job_id']}", file=sys.stderr)


def unrecorded_requeue(run: RunDir, job_id: str) -> dict:
    """A job SLURM requeued without its script recording the end of the attempt (the node
    of the job script failed): that attempt ended NODE_FAIL, and the requeue counts against
    `cluster.max_requeues` (past it, the run ends as with any requeue). Returns job.json."""

    def unended(job: dict) -> bool:
        last = (job.get("attempts") or [{}])[-1]
        return str(last.get("job_id")) == str(job_id) and not last.get("ended_at")

    if not unended(job := read_job(run)):
        return job
    limit = max_requeues(run)
    with editing_job(run) as job:
        if not unended(job):
            return dict(job)
        _end_attempt(job, job_id, NODE_FAIL, "the attempt ended without its job script (its node failed?)")
        done = int(job.get("requeues", 0))
        if done >= limit:
            job["failure"] = {
                "component": None,
                "rc": 0,
                "reason": f"{NODE_FAIL} by SLURM: not continued (cluster.max_requeues={limit} reached); "
                f"continue with: prime-hpc resume {run.root}",
                "log": str(of(job).batch_log(run, job_id)),
                "max_requeues": limit,
            }
            job["state"], job["ended_at"] = FAILED, time.time()
        else:
            job["requeues"] = done + 1
        return dict(job)


def stop_leftovers(run: RunDir, job_id: str) -> None:
    """A restarted job: what an earlier attempt still runs (the scheduler's `stop_leftovers`:
    SLURM leaves a het job's other components running when it requeues the head's after
    its node failed) is stopped before anything of this attempt reads the run, said in one
    line; steps that would not stop fail the run in one line naming them (two trainers
    would write into it)."""
    found, left = of(read_job(run)).stop_leftovers(job_id)
    if found:
        print(
            f"prime-hpc: stopped what an earlier attempt of job {job_id} still ran: steps {', '.join(found)}",
            file=sys.stderr,
        )
    if not left:
        return
    why = f"steps of an earlier attempt of job {job_id} still run after SIGKILL: {', '.join(left)}; not continued"
    with editing_job(run) as job:
        job.update(
            state=FAILED,
            ended_at=time.time(),
            failure={"component": None, "rc": 1, "reason": why, "log": str(of(job).batch_log(run, job_id))},
        )
    raise UserError(f"{why} (continue with: prime-hpc resume {run.root} once they are gone)")


def start_fleet(run: RunDir, job_id: str, logs: Path, group: str = "inference") -> None:
    """Every server of `group` (inference, teacher) this job starts is `starting` in its
    slot, with no restarts yet."""
    nodes = int((_component_yaml(run, group) or {}).get("nodes") or 0)
    for node in range(nodes):
        slot = server_slot(node, None, group)
        fleet_files.write_process(
            run, slot, fleet_files.STARTING, restarts=0, node=node, job_id=job_id, log=str(logtree.log_of(logs, slot))
        )


def _component_yaml(run: RunDir, component: str) -> Optional[dict]:
    import yaml

    path = run.component_config(component)
    return yaml.safe_load(path.read_text()) if path.exists() else None


def _set_resume_step(run: RunDir, step: Optional[int]) -> None:
    """Write the step every component resumes from into its config (`ckpt.step`)."""
    import yaml

    for component in CHECKPOINT_PARTS:
        cfg = _component_yaml(run, component)
        if cfg is None:
            continue
        cfg.setdefault("ckpt", {})["step"] = step
        atomic_write_text(run.component_config(component), yaml.safe_dump(cfg, sort_keys=False))


def resume_runs(job: RunDir) -> None:
    """A requeued job of several runs (`runs/<name>/`): every run that is not over continues
    from its own latest complete checkpoint (or starts over), like a requeued run; one
    whose checkpoints cannot be read fails alone (its `run.json`)."""
    from prime_hpc.rundir import runs

    for name in job.sub_runs():
        sub = job.sub_run(name)
        if runs.is_over(sub):
            continue
        try:
            resume_point(sub, restarted=True)
        except UserError as e:
            runs.record(sub, runs.FAILED, reason=f"cannot continue after the requeue: {e}")


def resume_point(run: RunDir, restarted: bool) -> Optional[int]:
    """The step this attempt continues from (None: from the start). A restart of the same
    job (requeue) continues from the latest complete checkpoint, or from scratch when there
    is none; otherwise the configured `ckpt.step` (a resume) is honoured. Everything after
    that step (rollouts, weights, checkpoints, metrics rows) is cleared first, and the
    resolved step is written into the components' configs, so they agree on it."""
    from prime_hpc.rundir.checkpoints import resolve_resume_step

    trainer = _component_yaml(run, "trainer") or {}
    parts = ("trainer",) if (trainer.get("trainer") or {}).get("type") == "sft" else CHECKPOINT_PARTS
    requested = -1 if restarted else (trainer.get("ckpt") or {}).get("step")
    if requested is None:  # a fresh run: nothing to clear
        return None
    if requested == 0:  # start over in this directory
        run.clear_after(0)
        return None
    if requested == -1 and restarted and not run.complete_checkpoint_steps(parts):
        run.clear_after(0)  # requeued before the first checkpoint: start over
        _set_resume_step(run, None)
        return None
    step = resolve_resume_step(run, int(requested), parts)
    assert step is not None
    run.clear_after(step)
    _set_resume_step(run, step)
    return step


# ----------------------------------------------------------------------------- end
SUPERVISOR = "supervisor"  # the job script itself, as job.json names it


def end(run: RunDir, job_id: str, rc: Optional[int], component: str = "", reason: str = "", state: str = "") -> str:
    """Record how this attempt ended (`rc`: the exit code, None when unknown). A job that
    no longer owns the run directory (it was cancelled and the directory reused) records
    nothing; a cancel stays a cancel."""
    logs = run.latest_logs.resolve()
    with editing_job(run) as job:
        ids = [str(i) for i in job.get("job_ids", [])]
        if ids and ids[-1] != str(job_id):
            return f"prime-hpc: job {job_id} no longer owns {run.root}; nothing recorded"
        now = time.time()
        job["ended_at"] = now
        if job.get("state") == CANCELLED or state == CANCELLED:
            job["state"] = CANCELLED
            _end_attempt(job, job_id, CANCELLED, reason or "cancelled")
            return f"prime-hpc: run cancelled; logs in {logs}"
        job["state"] = state or (COMPLETED if rc == 0 else FAILED)
        job["failure"] = None
        if rc != 0:
            if component == "watchdog":  # a stall: name the component that stalled
                component, reason, where = stall_record(run, logs, reason)
            elif component == SUPERVISOR:
                where = {"node": None, "log": str(of(job).batch_log(run, job_id))}
            else:
                where = where_it_died(logs, component) if component else {"log": str(logs)}
                reason, where = own_cause(run, component, reason, where)
                if component and not run.failure_record(component).exists():  # it said nothing of its own
                    how = kill_signals.cause(rc, [Path(where["log"]), logtree.srun_log(logs, component)])
                    reason = f"{reason}: {how}" if how and reason else (how or reason)
            job["failure"] = {"component": component or None, "rc": rc, "reason": reason, **where}
        _end_attempt(job, job_id, job["state"], reason)
    if rc != 0:
        f = job["failure"]
        return f"prime-hpc: run failed: {(component + on_node(f) + ' ') if component else ''}{reason}; see {f['log']}"
    return f"prime-hpc: run completed; logs in {logs}"


def supervisor_died(run: RunDir, job_id: str, pid: int) -> Optional[str]:
    """The job script (`pid`) is gone without having ended its attempt (`kill -9`, the OOM
    killer): record that, naming it (rc unknown). None if the attempt had ended already."""
    job = read_job(run)
    if job.get("state") != RUNNING or job.get("ended_at"):
        return None
    return end(
        run,
        job_id,
        None,
        SUPERVISOR,
        f"died without ending the attempt (the job script, pid {pid} on {socket.gethostname()})",
    )


def stall_record(run: RunDir, logs: Path, reason: str) -> tuple[str, str, dict]:
    """(component, reason, where) of the stall the watchdog found (control/stall.json)."""
    try:
        stall = read_json(run.stall_record)
    except (OSError, ValueError):
        return "watchdog", reason, {"node": None, "log": str(logtree.component_log(logs, "watchdog"))}
    component = stall.get("component", "watchdog")  # "inference": the whole fleet (no server could serve)
    return component, stall["reason"], {"node": stall.get("node"), "log": stall["log"], "who": stall.get("who")}


def own_cause(run: RunDir, component: str, reason: str, where: dict) -> tuple[str, dict]:
    """The failed component's own one-line cause (`control/failure_<component>.json`),
    after the supervisor's `reason` ("exited with code N"), and the log it names; as given
    when the component left none."""
    try:
        record = read_json(run.failure_record(component)) if component else {}
    except (OSError, ValueError):
        return reason, where
    cause = str(record.get("reason") or "").strip()
    if not cause:
        return reason, where
    return (f"{reason}: {cause}" if reason else cause), {**where, "log": str(record.get("log") or where["log"])}


def max_restarts(run: RunDir) -> int:
    """`inference.max_restarts` of the run (its servers' config); the schema's default
    where it does not say."""
    from prime_hpc.config.schema import InferenceConfig

    value = ((_component_yaml(run, "inference") or {}).get("inference") or {}).get("max_restarts")
    return int(InferenceConfig.max_restarts) if value is None else int(value)


def lost(run: RunDir, component: str, rc: int) -> tuple[str, bool]:
    """Record that the server in slot `component` exited: in the attempt's `lost` list, in
    its fleet file, and by removing its endpoint and heartbeat (the relay and the router
    drop it; the watchdog no longer waits for it). Returns (what happened, whether to
    restart it in its slot: while it has restarts left this attempt and the run is not
    stopping)."""
    logs = run.latest_logs.resolve()
    entry: dict[str, Any] = {"component": component, "rc": rc, "at": time.time(), **where_it_died(logs, component)}
    cause, _ = own_cause(run, component, "", entry)
    if cause:
        entry["reason"] = cause
    for path in (run.server_heartbeat(component), run.inference_endpoint(component)):
        path.unlink(missing_ok=True)
    done = int(fleet_files.read_process(run, component).get("restarts") or 0)
    limit = max_restarts(run)
    restart = done < limit and not run.checkpoint_request.exists()
    entry["restarted"] = restart
    with editing_job(run) as job:
        if job.get("attempts"):
            job["attempts"][-1].setdefault("lost", []).append(entry)
    how = kill_signals.cause(rc, [])  # a server killed by a signal (srun's exit code 128 + N)
    why = entry.get("reason") or (f"exited with code {rc}: {how}" if how else f"exited with code {rc}")
    if restart:
        run.failure_record(component).unlink(missing_ok=True)  # its cause is recorded; a later death has its own
        fleet_files.write_process(run, component, fleet_files.STARTING, restarts=done + 1, rc=rc, reason=why)
        return f"prime-hpc: lost {component} ({why}); restarting it (restart {done + 1} of at most {limit})", True
    fleet_files.write_process(run, component, fleet_files.LOST, rc=rc, reason=why)
    note = f"no restart left (inference.max_restarts={limit})" if done >= limit else "the run is stopping"
    return f"prime-hpc: lost {component} ({why}); {note}; see {entry['log']}", False


def hung(run: RunDir, request: Path) -> str:
    """The watchdog's request to restart a hung server: its cause recorded (the fleet file,
    `control/failure_<slot>.json` for the record of its end), the request consumed.
    Returns "<slot> <SLURM step or ''>" for the supervisor, which kills it."""
    req = read_json(request)
    slot = str(req["slot"])
    if parse_slot(slot) is None:
        raise UserError(f"{request}: {slot!r} is not a server's slot")
    atomic_write_json(run.failure_record(slot), {"reason": req.get("reason"), "log": req.get("log")})
    fleet_files.write_process(run, slot, fleet_files.HUNG, reason=req.get("reason"))
    request.unlink(missing_ok=True)
    return f"{slot} {req.get('slurm_step') or ''}".strip()


SRUN_TASK_ERROR = re.compile(r"srun: error: (\S+): tasks? (\d+)(?:-\d+)?: (.*)")


def where_it_died(logs: Path, component: str) -> dict[str, Any]:
    """Which node of `component` failed first, and the log to read (`logtree.log_of`): for a
    server of a set, its own node; for the trainer (one step over its nodes), the first task
    srun reports as failed (`trainer/srun.log`, one task per node); else node 0."""
    node: Optional[int] = 0
    host = None
    slot = parse_slot(component)
    if slot is not None:
        node = slot.node
    elif component == "trainer":
        try:
            for line in logtree.srun_log(logs, "trainer").read_text(errors="replace").splitlines():
                m = SRUN_TASK_ERROR.search(line)
                if m:
                    host, node = m.group(1), int(m.group(2))
                    break
        except OSError:
            pass
    elif component not in ("router", "orchestrator"):
        node = None
    log = logtree.log_of(logs, component, 0 if component in ("inference", "teacher") else node)
    return {"node": node, "log": str(log), **({"host": host} if host else {})}


def _end_attempt(job: dict, job_id: str, how: str, reason: str = "") -> None:
    """Close this job's open attempt; a job that ended before its attempt started (in
    cluster.env_setup, say) gets an attempt of its own that says so."""
    attempts = job.setdefault("attempts", [])
    last = attempts[-1] if attempts else {}
    if str(last.get("job_id")) != str(job_id) or last.get("ended_at"):
        last = {
            "attempt": None,
            "job_id": job_id,
            "host": socket.gethostname(),
            "started_at": None,
            "logs": None,
            "resumed_from": None,
            "note": "ended before the attempt started",
        }
        attempts.append(last)
    last.update(ended_at=time.time(), end=how, reason=reason or None)


# ----------------------------------------------------------------------------- a lost node
def node_lost(run: RunDir, job_id: str) -> Optional[str]:
    """A component of the job exited with an error: is a node of the job down (the
    scheduler's `down_nodes`: down, drained, failing, not responding)? If so, the nodes go
    into the attempt (`down_nodes`), for its end (`requeue` NODE_FAIL) to name them, and
    the line saying so is returned; None when every node is up (the component failed on
    its own)."""
    down = of(read_job(run)).down_nodes(job_id)
    if not down:
        return None
    with editing_job(run) as job:
        last = (job.get("attempts") or [{}])[-1]
        if str(last.get("job_id")) == str(job_id) and not last.get("ended_at"):
            last["down_nodes"] = down
    return f"prime-hpc: node(s) of the job down: {', '.join(down)}"


def end_reason(job: dict, job_id: str, how: str) -> str:
    """What the end of this job's open attempt records beside `how`: for NODE_FAIL, the
    nodes that were down (`node_lost`)."""
    last = (job.get("attempts") or [{}])[-1]
    down = last.get("down_nodes") if str(last.get("job_id")) == str(job_id) and not last.get("ended_at") else None
    return f"node(s) of the job down: {', '.join(down)}" if how == NODE_FAIL and down else ""


# ----------------------------------------------------------------------------- stop and requeue
def request_checkpoint(run: RunDir, reason: str) -> None:
    atomic_write_json(run.checkpoint_request, {"reason": reason, "requested_at": time.time()})
    with editing_job(run) as job:
        if job.get("attempts"):
            job["attempts"][-1]["stopping"] = reason


def max_requeues(run: RunDir) -> int:
    """`cluster.max_requeues` of the run's config.yaml; the schema's default where the file
    does not say (no such key, or no readable file)."""
    import yaml

    from prime_hpc.config.schema import ClusterConfig

    default = int(ClusterConfig.max_requeues)  # the field's declared default
    try:
        cfg = yaml.safe_load(run.config_yaml.read_text()) or {}
        value = (cfg.get("cluster") or {}).get("max_requeues")
        return default if value is None else int(value)
    except (OSError, ValueError, TypeError, AttributeError, yaml.YAMLError):
        return default


def requeue(run: RunDir, job_id: str, reason: str) -> tuple[str, bool]:
    """Record that this attempt ended because of `reason` and let the job go back to the
    queue, at most `cluster.max_requeues` times over the run. Every requeue counts: SLURM's
    own (REQUEUED: `scontrol requeue`, a preemption that requeues; the job is back in the
    queue already) and prime-hpc's (a time limit, a preemption with a grace time: it
    requeues the job itself). Past the limit the run ends, its failure naming the limit;
    a job SLURM requeues all the same is refused when it starts again (`start`).
    Returns (what happened, whether the job goes back to the queue)."""
    limit = max_requeues(run)
    with editing_job(run) as job:
        backend = of(job)
        job["ended_at"] = time.time()
        if job.get("state") == CANCELLED:  # cancelled while it checkpointed: a cancel stays a cancel
            _end_attempt(job, job_id, CANCELLED, "cancelled")
            return "prime-hpc: run cancelled; not requeued", False
        nodes = end_reason(job, job_id, reason)
        _end_attempt(job, job_id, reason, nodes)
        done = int(job.get("requeues", 0))
        if done >= limit or not backend.requeues:
            why = (
                f"cluster.max_requeues={limit} reached" if backend.requeues else f"{backend.name} runs are not requeued"
            )
            what = f"{reason} by SLURM: not continued" if reason == REQUEUED else f"{reason}: not requeued"
            what = f"{what} ({nodes})" if nodes else what
            what += f" ({why})"
            job["state"] = FAILED if reason == REQUEUED else reason
            job["failure"] = {
                "component": None,
                "rc": 0,
                "reason": f"{what}; continue with: prime-hpc resume {run.root}",
                "log": str(run.latest_logs.resolve()),
                **({"max_requeues": limit} if backend.requeues else {}),
            }
            return f"prime-hpc: {what}", False
        job["state"] = REQUEUED
        job["requeues"] = done + 1
    if reason == REQUEUED:
        backend.requeued(job_id)  # back soon, not after SLURM's hold
        return (
            f"prime-hpc: the job was requeued by SLURM (requeue {done + 1} of at most {limit}); its next "
            f"attempt continues from the latest checkpoint",
            True,
        )
    err = backend.requeue(job_id)
    if err:
        with editing_job(run) as job:
            job["state"] = reason
            job["failure"] = {
                "component": None,
                "rc": 0,
                "reason": f"{reason}: requeue failed: {err}",
                "log": str(backend.batch_log(run, job_id)),
            }
        return f"prime-hpc: {reason}; requeue failed: {err}", False
    return f"prime-hpc: {reason}; requeued (requeue {done + 1} of at most {limit})", True


def cause(run: RunDir, job_id: str) -> str:
    """Why the job is being stopped: CANCELLED when `prime-hpc cancel` marked it so, else
    its backend's answer (`stop_cause`: SLURM says; a local run is only ever cancelled).
    The components' SIGTERM markers are answered: cleared."""
    for marker in run.sigterm_markers():
        marker.unlink(missing_ok=True)
    job = read_job(run)
    if job.get("state") == CANCELLED:
        return CANCELLED
    return of(job).stop_cause(run, job_id)


# ----------------------------------------------------------------------------- pipelines (local)
def wait_for(run: RunDir, job_id: str, before: RunDir, poll_s: float = 2.0, any_end: bool = False) -> int:
    """Block until the run in `before` ended; 0 if it completed (or, with `any_end`,
    however it ended). Otherwise this job fails without starting anything, naming the
    earlier job and its failure."""
    while True:
        state = local.run_state(before)
        if state in FINAL_STATES:
            break
        time.sleep(poll_s)
    if state == COMPLETED or any_end:
        return 0
    prior = read_job(before)
    failure = prior.get("failure") or {}
    where = failure.get("log") or before.latest_logs
    with editing_job(run) as job:
        job.update(
            state=FAILED,
            ended_at=time.time(),
            failure={
                "component": None,
                "rc": 1,
                "log": str(where),
                "reason": f"not started: {prior.get('name', before.root)} (job {(prior.get('job_ids') or ['?'])[-1]}), "
                f"which this run starts from, ended {state}",
            },
        )
    print(f"prime-hpc: not started: the run it continues from ended {state}; see {where}", file=sys.stderr)
    return 1


# ----------------------------------------------------------------------------- rendezvous
def rendezvous(run: RunDir) -> str:
    """The run's private rendezvous directory, emptied for this attempt: torchrun's agents
    and the trainer's ranks meet in file stores there (on every node, through the shared
    filesystem), never in a TCP store that whoever holds or reaches its port would serve."""
    from prime_hpc.rundir import private

    try:
        return str(private.ensure(run.rendezvous_dir, empty=True))
    except private.Untrusted as e:
        raise UserError(
            f"the trainer's rendezvous: {e}; its processes meet only in a directory of yours that nobody else "
            f"can enter: remove it"
        ) from None
    except OSError as e:
        raise UserError(f"the trainer's rendezvous: cannot make {run.rendezvous_dir}: {e.strerror}") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prime_hpc.job.attempt")
    p.add_argument(
        "cmd",
        choices=(
            "start",
            "end",
            "lost",
            "hung",
            "node-lost",
            "checkpoint",
            "requeue",
            "cause",
            "wait-for",
            "rendezvous",
        ),
    )
    p.add_argument("output_dir", nargs="?")
    p.add_argument("--job-id", default="")
    p.add_argument("--rc", type=int, default=0)
    p.add_argument("--component", default="")
    p.add_argument("--reason", default="")
    p.add_argument("--state", default="")
    p.add_argument("before", nargs="?", help="wait-for: the run directory this job starts after")
    p.add_argument("--any", action="store_true", help="wait-for: start however that run ended")
    p.add_argument("--checkpoint", action="store_true", help="cause: ask for the checkpoint when the job stops")
    p.add_argument("--request", help="hung: the watchdog's restart request")
    a = p.parse_intermixed_args(argv)
    run = RunDir(a.output_dir)
    try:
        if a.cmd == "rendezvous":
            print(rendezvous(run))
        elif a.cmd == "start":
            print(start(run, a.job_id))
        elif a.cmd == "end":
            print(end(run, a.job_id, a.rc, a.component, a.reason, a.state), file=sys.stderr)
        elif a.cmd == "lost":
            message, restart = lost(run, a.component, a.rc)
            print(message, file=sys.stderr)
            return 0 if restart else 1
        elif a.cmd == "hung":
            print(hung(run, Path(a.request)))
        elif a.cmd == "node-lost":
            line = node_lost(run, a.job_id)
            if line:
                print(line, file=sys.stderr)
            return 0 if line else 1
        elif a.cmd == "checkpoint":
            request_checkpoint(run, a.reason)
        elif a.cmd == "requeue":
            message, requeued = requeue(run, a.job_id, a.reason)
            print(message, file=sys.stderr)
            return 0 if requeued else 1
        elif a.cmd == "cause":
            why = cause(run, a.job_id)
            if a.checkpoint and why in STOP_REASONS:  # one call: the components wait only briefly
                request_checkpoint(run, why)
            print(why)
        elif a.cmd == "wait-for":
            return wait_for(run, a.job_id, RunDir(a.before), any_end=a.any)
    except UserError as e:
        print(f"prime-hpc: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
