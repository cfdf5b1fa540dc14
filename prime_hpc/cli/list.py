"""`prime-hpc list [-n N]`: the newest jobs, a pipeline's warm-up and a run's extra
inference jobs (`prime-hpc scale`) under its run, and a sweep's points under the sweep."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from prime_hpc.core.text import columns, printable


def add_parser(sub: Any) -> argparse.ArgumentParser:
    ls = sub.add_parser("list", help="recently submitted jobs (pipelines and sweeps grouped)")
    ls.add_argument("-n", type=int, default=20, help="how many jobs")
    return ls


def run(a: argparse.Namespace) -> int:
    from prime_hpc.rundir import jobs

    refs = jobs.recent(a.n)
    if not refs:
        print("no jobs submitted yet (prime-hpc submit ...)")
        return 0
    records = readable_records(refs)
    refs = [r for r in refs if r.output_dir in records]
    live, note = live_states(refs, records)
    rows = [("JOB", "NAME", "STATE", "KIND", "SUBMITTED", "OUTPUT DIR")]
    shown: set = set()
    sweeps_shown: set = set()
    for r in refs:
        rec = records[r.output_dir]
        if r.output_dir in shown or ((rec.get("pipeline") or {}).get("run") in records):
            continue  # listed already, or a warm-up listed under its run
        if r.sweep and r.sweep not in sweeps_shown:
            sweeps_shown.add(r.sweep)
            points = [x for x in refs if x.sweep == r.sweep]
            rows.append((r.sweep, f"{len(points)} points", "", "sweep", "", ""))
        indent = "  " if r.sweep else ""
        rows.append(_row(r, rec, live, indent, (rec.get("sweep") or {}).get("swept", "")))
        shown.add(r.output_dir)
        rows += _extra_rows(r, rec, indent + " + ")
        warm = ((rec.get("pipeline") or {}).get("warmup") or {}).get("output_dir")
        for w in refs:
            if w.output_dir == warm and w.output_dir not in shown:
                rows.append(_row(w, records[w.output_dir], live, indent + " └ ", ""))
                shown.add(w.output_dir)
    if note:
        print(note)
    for line in columns(rows):
        print(printable(line))  # names and states come from files: no control sequence reaches the terminal
    return 0


def readable_records(refs: list) -> dict[str, dict]:
    """{output dir: job.json} of the jobs `refs` name; a job.json that is no job record is
    left out, named in one line on stderr (the other jobs are still listed)."""
    from prime_hpc.rundir import jobs

    records: dict[str, dict] = {}
    for r in refs:
        if r.output_dir in records:
            continue
        try:
            records[r.output_dir] = jobs.read_job(r.run)
        except jobs.BadJobFile as e:
            print(f"prime-hpc list: skipped job {r.job_id}: {e}", file=sys.stderr)
    return records


def _row(r: Any, job: dict, live: dict, indent: str, swept: str) -> tuple:

    state = live.get(r.job_id) or job.get("state", "?")
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.submitted_at))
    kind = f"{job.get('kind', r.kind)}/{r.backend}" + ("/doctor" if r.mode == "doctor" else "")
    return (indent + r.job_id, r.name, state, kind, when, r.output_dir + (f"  [{swept}]" if swept else ""))


def _extra_rows(r: Any, job: dict, indent: str) -> list[tuple]:
    """The run's extra inference jobs (`prime-hpc scale`), one row each, under its row."""
    if not job.get("extra_jobs"):
        return []
    from prime_hpc.watch.extra_jobs import live_states as extra_live
    from prime_hpc.watch.extra_jobs import state_of

    live, _ = extra_live(job)
    rows = []
    for x in job["extra_jobs"]:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(x.get("submitted_at") or 0))
        kind = f"inference/{x.get('backend', r.backend)}/extra"
        rows.append((indent + str(x.get("job_id")), f"{r.name} +{x.get('nodes')}", state_of(x, live), kind, when, ""))
    return rows


def live_states(refs: list, records: dict) -> tuple[dict[str, str], str]:
    """{job id: state} of these jobs, each backend asked once for all of its jobs, and
    a note naming what could not be asked (those jobs show what job.json recorded)."""
    from prime_hpc.sched import BACKENDS
    from prime_hpc.sched.registry import choose

    by_backend: dict[str, dict[str, dict]] = {}
    for r in refs:
        if r.backend in BACKENDS:  # anything else shows what its job.json recorded
            by_backend.setdefault(r.backend, {})[r.job_id] = records[r.output_dir]
    states: dict[str, str] = {}
    notes = []
    for name, recs in by_backend.items():
        found, note = choose(name).states(recs)
        states.update(found)
        notes += [note] if note else []
    return states, "; ".join(notes)
