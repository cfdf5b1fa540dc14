"""`prime-hpc status [JOB] [--json] [--watch [S]]`: the state of each group, the inference
fleet (each server's state, restarts, policy step and log), the env servers of a running job
(`watch.envservers`: pid, workers, log; one whose pid is gone said so), the attempts, and the
run's vital signs (steps, reward and its trend, eval, loss, mismatch KL, s/step, throughput,
ETA). A pipeline shows both jobs; a sweep one line per point. When SLURM
cannot be asked, the answer comes from the run directory, saying so in one line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Optional

from prime_hpc.core.text import ago, columns, printable


def add_parser(sub: Any) -> argparse.ArgumentParser:
    st = sub.add_parser("status", help="state, attempts and vital signs of a job (or of a pipeline or a sweep)")
    st.add_argument("job", nargs="?", help="job id, run name, output dir or sweep id (default: the newest job)")
    st.add_argument("--json", action="store_true", help="print one JSON object instead (for scripts)")
    st.add_argument(
        "--watch",
        nargs="?",
        const=5.0,
        type=float,
        default=None,
        metavar="S",
        help="refresh every S seconds (default 5) until Ctrl-C",
    )
    return st


def heartbeat(run: Any, component: str) -> Optional[dict]:
    """The newest heartbeat of any rank/node of `component`."""
    best = None
    for info in run.beats(component).values():
        if best is None or info.get("time", 0) > best.get("time", 0):
            best = info
    return best


def job_status(ref: Any) -> dict[str, Any]:
    """Everything `status` shows of one job, as plain data."""
    from prime_hpc.rundir import jobs
    from prime_hpc.rundir.fleet import fleet
    from prime_hpc.sched.registry import choose
    from prime_hpc.watch.envservers import env_servers
    from prime_hpc.watch.extra_jobs import extra_status
    from prime_hpc.watch.vitals import vitals

    job = jobs.read_job(ref.run)
    backend = choose(ref.backend)
    groups, note = backend.group_states(ref.run, ref.job_id)
    overall = backend.overall(groups)
    if note:
        overall = job.get("state", "UNKNOWN")
    beats = {g: heartbeat(ref.run, g) for g in groups}
    extras, extra_note = extra_status(ref.run, job)
    return {
        "job_id": ref.job_id,
        "name": ref.name,
        "state": overall,
        "backend": ref.backend,
        "kind": job.get("kind", ref.kind),
        "mode": ref.mode,
        "output_dir": ref.output_dir,
        "slurm_note": note,
        "groups": {g: {"state": st, "heartbeat": beats[g]} for g, st in groups.items()},
        "extra_jobs": extras,
        "extra_note": extra_note,
        "fleet": fleet(ref.run) + fleet(ref.run.of_group("teacher")),  # the run's own teacher's after
        "env_servers": env_servers(ref.run, job) if overall not in jobs.FINAL_STATES else [],
        "attempts": job.get("attempts", []),
        "requeues": job.get("requeues", 0),
        "failure": job.get("failure"),
        "sweep": job.get("sweep"),
        "pipeline": job.get("pipeline"),
        "vitals": vitals(ref.run, _max_steps(ref.run), ended=overall in jobs.FINAL_STATES),
        "served": jobs.served(ref.run) if job.get("kind") == "serve" else None,
        "runs": run_rows(ref.run, job.get("runs") or [], ended=overall in jobs.FINAL_STATES),
    }


def run_rows(job_run: Any, names: list[str], ended: bool) -> list[dict]:
    """Each run of a job that trains several (`--together`): its state (its `run.json`, else
    running or waiting while the job runs; stopped when the job ended without its end), its
    steps and its reward."""
    from prime_hpc.rundir import runs
    from prime_hpc.watch.vitals import vitals

    rows = []
    for name in names:
        run = job_run.sub_run(name)
        rec = runs.state(run)
        v = vitals(run, _max_steps(run), ended=ended)
        state = rec["state"] if rec else ("RUNNING" if v["trainer_step"] or v["orchestrator_step"] else "WAITING")
        if rec is None and ended:
            state = "STOPPED"
        rows.append(
            {
                "name": name,
                "state": state,
                "trainer_step": v["trainer_step"],
                "orchestrator_step": v["orchestrator_step"],
                "max_steps": v["max_steps"],
                "reward": v["reward"],
                "reason": (rec or {}).get("reason"),
            }
        )
    return rows


def _max_steps(run: Any) -> Optional[int]:
    import yaml

    try:
        return (yaml.safe_load(run.component_config("trainer").read_text()) or {}).get("max_steps")
    except (OSError, ValueError):
        return None


def format_job(s: dict[str, Any]) -> list[str]:
    from prime_hpc.rundir import jobs
    from prime_hpc.watch.envservers import env_server_line
    from prime_hpc.watch.extra_jobs import format_extra
    from prime_hpc.watch.vitals import format_vitals

    attempts = s["attempts"]
    requeues = f", {s['requeues']} requeue(s)" if s["requeues"] else ""
    out = [
        f"job {s['job_id']}  {s['name']}  {s['state']}  ({s['backend']}, {s['kind']}"
        f"{', preflight' if s['mode'] == 'doctor' else ''}, attempt {len(attempts) or '-'}{requeues})",
        f"output dir: {s['output_dir']}",
    ]
    if s.get("served"):
        found = s["served"]
        out.append(f"serving {found['model']} at {found['url']} (key: ${found['key_var']})")
    if s["slurm_note"]:
        out.append(s["slurm_note"])
    rows: list[tuple[str, ...]] = [("GROUP", "STATE", "HEARTBEAT")]
    for g, info in s["groups"].items():
        beat = info["heartbeat"] or {}
        rows.append((g, info["state"], ago(beat.get("time")) + (f" step {beat['step']}" if "step" in beat else "")))
    out += columns(rows, indent="  ")
    out += fleet_lines(s.get("fleet") or [], ended=s["state"] in jobs.FINAL_STATES)
    out += [env_server_line(r) for r in s.get("env_servers") or []]
    if s.get("extra_note"):
        out.append(s["extra_note"])
    out += format_extra(s.get("extra_jobs") or [])
    for i, a in enumerate(attempts[:-1] if len(attempts) > 1 else []):
        out.append(
            f"  attempt {i + 1} (job {a['job_id']}, logs/attempt_{a['attempt']}) ended {a.get('end', '?')}"
            + (f", resumed from step {a['resumed_from']}" if a.get("resumed_from") else "")
        )
    v = s["vitals"]
    if s["mode"] != "doctor" and (v["trainer_step"] is not None or v["orchestrator_step"] or v.get("unfilled")):
        out += format_vitals(s["vitals"], s["kind"])
    for lost in (attempts[-1].get("lost") or []) if attempts else []:
        then = "restarted in its slot" if lost.get("restarted") else "the run went on without it"
        out.append(
            f"lost: {lost['component']}{jobs.on_node(lost)} exited with code {lost['rc']} at "
            f"{time.strftime('%H:%M:%S', time.localtime(lost['at']))}"
            + (f" ({lost['reason']})" if lost.get("reason") else "")
            + f"; {then}; see {lost.get('log')}"
        )
    if s.get("runs"):
        rows = [("RUN", "STATE", "STEP", "REWARD")]
        for r in s["runs"]:
            step = f"{r['trainer_step'] or 0}/{r['max_steps'] or '-'}"
            reward = f"{r['reward']:.3f}" if r["reward"] is not None else "-"
            rows.append((r["name"], r["state"], step, reward + (f"  ({r['reason']})" if r.get("reason") else "")))
        out += columns(rows, indent="  ")
    if s["failure"]:
        f = s["failure"]
        out.append(f"failed: {f.get('component') or 'job'}{jobs.on_node(f)} {f.get('reason', '')}; see {f.get('log')}")
    return out


def fleet_lines(rows: list[dict], ended: bool = False) -> list[str]:
    """The inference fleet (and the run's own teacher's servers) as a table: one row per
    server (slot), from the run directory
    (`rundir.fleet`: the supervisors' and the relay's files, no HTTP)."""
    if not rows:
        return []
    table = [("SERVER", "NODE", "STATE", "SINCE", "RESTARTS", "POLICY", "LOG")]
    for r in rows:
        node = "-" if r.get("node") is None else str(r["node"])
        table.append(
            (
                r["slot"],
                node + (f" ({r['host']})" if r.get("host") else ""),
                "ended" if ended and r["state"] != "lost" else r["state"],
                ago(r.get("since")),
                str(r.get("restarts", 0)),
                "-" if r.get("policy_step") is None else str(r["policy_step"]),
                str(r.get("log") or "-"),
            )
        )
    return columns(table, indent="  ")


def sweep_lines(refs: list, statuses: list[dict]) -> list[str]:
    """One line per point of a sweep: state, step, reward, loss, swept values (and one
    line when SLURM could not be asked)."""
    sweep = statuses[0]["sweep"] or {}
    rows = [("POINT", "JOB", "STATE", "STEP", "REWARD", "LOSS", "SWEPT")]
    for st in statuses:
        v, sw = st["vitals"], st["sweep"] or {}
        step = v["trainer_step"] if v["trainer_step"] is not None else "-"
        rows.append(
            (
                str(sw.get("point", "?")),
                st["job_id"],
                st["state"],
                f"{step}/{v['max_steps']}" if v["max_steps"] else str(step),
                "-" if v["reward"] is None else f"{v['reward']:.3f}",
                "-" if v["loss"] is None else f"{v['loss']:.4f}",
                sw.get("swept", ""),
            )
        )
    notes = [st["slurm_note"] for st in statuses if st["slurm_note"]]
    return [f"sweep {sweep.get('id')}: {len(refs)} points"] + notes[:1] + columns(rows, indent="  ")


def snapshot(name: Optional[str]) -> tuple[list[str], Any]:
    """(lines, json object) for a job, a pipeline or a sweep."""
    from prime_hpc.launcher import state
    from prime_hpc.rundir import jobs

    if name:
        refs = jobs.resolve_many(name)
    else:
        recent = jobs.recent(1)
        if not recent:
            return ["no jobs submitted yet (prime-hpc submit ...)"], {}
        refs = [recent[0]]
    if len(refs) > 1:  # a sweep
        statuses = [job_status(r) for r in refs]
        return sweep_lines(refs, statuses), {"sweep": (statuses[0]["sweep"] or {}).get("id"), "points": statuses}
    stages = state.pipeline_refs(refs[0])
    statuses = [job_status(r) for r in stages]
    lines: list[str] = []
    if len(stages) > 1:
        lines.append(
            f"pipeline: {stages[0].name} (warm-up, job {stages[0].job_id}) -> {stages[1].name} (job {stages[1].job_id})"
        )
    for i, st in enumerate(statuses):
        lines += ([""] if i else []) + format_job(st)
    obj = statuses[0] if len(statuses) == 1 else {"pipeline": statuses}
    return lines, obj


def run(a: argparse.Namespace) -> int:
    while True:
        lines, obj = snapshot(a.job)
        if a.json:
            print(json.dumps(obj, default=str))
        else:
            if a.watch:
                sys.stdout.write("\x1b[H\x1b[2J")  # clear the terminal
                lines = [time.strftime("%H:%M:%S") + f"  (every {a.watch:g}s, Ctrl-C to stop)"] + lines
            print("\n".join(printable(line) for line in lines), flush=True)  # what runs wrote, escaped
        if not a.watch:
            return 0
        try:
            time.sleep(a.watch)
        except KeyboardInterrupt:
            return 0
