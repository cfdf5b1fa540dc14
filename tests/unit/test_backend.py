"""The backend protocol (`prime_hpc.sched`): one place maps a backend's name to its class,
nothing else tells backends apart by name or by the shape of a job id, and the pure parts
of each backend (state aggregation, why SLURM stops a job, a local job's state)."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from prime_hpc.config.schema import ClusterConfig
from prime_hpc.job import attempt
from prime_hpc.rundir import RunDir, atomic_write_json, jobs
from prime_hpc.rundir.jobs import start_time
from prime_hpc.sched import BACKENDS, local
from prime_hpc.sched.registry import UnknownBackend, _classes, choose, of
from prime_hpc.sched.slurm import aggregate, stop_cause

REPO = Path(__file__).resolve().parents[2]
BACKEND_NAME_TEST = re.compile(
    r"""[!=]=\s*["'](slurm|local)["']|["'](slurm|local)["']\s*[!=]=|startswith\(\s*["']local-"""
)


def test_only_the_backend_package_tells_backends_apart():
    """A backend is asked for what differs (`prime_hpc.sched`); no code outside it compares
    a backend's name, nor reads the backend off a job id."""
    sources = [p for p in (REPO / "prime_hpc").rglob("*.py") if "sched" not in p.relative_to(REPO / "prime_hpc").parts]
    sources += sorted((REPO / "sbatch_templates").glob("*.j2"))
    assert len(sources) > 50
    found = [
        f"{p.relative_to(REPO)}:{i}: {line.strip()}"
        for p in sources
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if BACKEND_NAME_TEST.search(line)
    ]
    assert found == []
    assert BACKEND_NAME_TEST.search('if plan.backend == "slurm":') and BACKEND_NAME_TEST.search(
        "id.startswith('local-')"
    )


def test_the_backend_package_imports_only_what_lies_below_it():
    """Light and low: job/, watch/ and the read-only commands import it, so it imports
    nothing of theirs (nor config or the launcher), and no submitit, Hydra or Jinja."""
    for path in (REPO / "prime_hpc" / "sched").glob("*.py"):
        for m in re.finditer(r"^\s*(?:from|import) prime_hpc\.(\w+)", path.read_text(), re.M):
            assert m.group(1) in ("core", "rundir", "sched"), f"{path.name} imports prime_hpc.{m.group(1)}"
    heavy = ("submitit", "omegaconf", "hydra", "jinja2")
    code = f"import sys, prime_hpc.sched.registry; print(sorted(m for m in {heavy} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr
    # the schema takes the backends' names from the package, which loads nothing else
    code = "import sys, prime_hpc.sched; print(sorted(m for m in sys.modules if m.startswith('prime_hpc.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.stdout.strip() == "['prime_hpc.sched']", out.stderr


def test_choose_maps_every_name_and_refuses_an_unknown_one_in_one_line():
    assert tuple(_classes()) == BACKENDS  # every name has its class, every class its name
    for name in BACKENDS:
        assert choose(name).name == name
    with pytest.raises(UnknownBackend) as e:
        choose("pbs")
    assert str(e.value) == "unknown backend 'pbs'; choose from local, slurm"
    with pytest.raises(UnknownBackend, match=r"^job.json of /r records no backend \(one of local, slurm\)$"):
        of({"output_dir": "/r", "job_ids": ["7"]})
    assert of({"backend": "slurm"}).name == "slurm"


def test_cluster_backend_choices_are_the_backends():
    rule = next(f for f in dataclasses.fields(ClusterConfig) if f.name == "backend").metadata["rule"]
    assert tuple(rule.choices) == BACKENDS and ClusterConfig.backend in BACKENDS


def test_what_differs_is_declared_by_each_backend():
    slurm, here = choose("slurm"), choose("local")
    assert slurm.requeues and not here.requeues
    assert here.one_machine and not slurm.one_machine
    assert slurm.job_env == {"SUBMITIT_EXECUTOR": "slurm", "SRUN_EXPORT_ENV": "ALL"} and here.job_env == {}
    run = RunDir("/runs/a b")
    assert slurm.batch_log(run, "42") == Path("/runs/a b/submit/submitit/42_batch.out")
    assert here.batch_log(run, "local-1f") == Path("/runs/a b/submit/local.out")
    assert here.requeue("local-1f") == "local runs are not requeued"


def test_het_job_state_from_its_components():
    assert aggregate([]) == "UNKNOWN" and aggregate(["UNKNOWN", ""]) == "UNKNOWN"
    assert aggregate(["COMPLETED"] * 3) == "COMPLETED"
    assert aggregate(["PENDING"] * 3) == "PENDING"
    assert aggregate(["COMPLETED", "RUNNING", "PENDING"]) == "RUNNING"  # one component still runs
    assert aggregate(["COMPLETING", "RUNNING", "COMPLETED"]) == "RUNNING"
    assert aggregate(["COMPLETING", "CANCELLED by 0", "COMPLETED"]) == "COMPLETING"  # SLURM still cleaning up
    assert aggregate(["CANCELLED by 1000", "FAILED", "COMPLETED"]) == "FAILED"  # a failure names the job
    assert aggregate(["CANCELLED by 1000", "TIMEOUT", "TIMEOUT"]) == "TIMEOUT"
    assert aggregate(["CANCELLED by 1000", "COMPLETED"]) == "CANCELLED"
    assert aggregate(["PENDING", "COMPLETED"]) == "PENDING"  # neither all pending nor failed: the first one
    slurm = choose("slurm")
    assert slurm.overall({"orchestrator": "RUNNING", "inference": "COMPLETED", "trainer": "FAILED"}) == "RUNNING"


# `scontrol show job -o` of a job in the dev cluster's preemptible partition (GraceTime=60),
# as SLURM 22.05 showed it: running, then inside the preemption's grace time, then requeued
RUNNING = (
    "JobState=RUNNING Reason=None Restarts=0 StartTime=2026-11-25T09:50:17 EndTime=2026-11-25T10:00:17 PreemptTime=None"
)
IN_GRACE = (
    "JobState=RUNNING Reason=None Restarts=0 StartTime=2026-11-25T09:50:17 EndTime=2026-11-25T09:51:25 "
    "PreemptTime=2026-11-25T09:50:25"
)
REQUEUED_ONCE = "JobState=COMPLETING Reason=None Restarts=1 StartTime=2026-11-25T09:50:30 EndTime=2026-11-25T10:00:30"


def _fields(line: str) -> dict:
    return dict(f.split("=", 1) for f in line.split())


def test_why_slurm_stops_a_job():
    assert stop_cause(_fields(RUNNING), 0) == "CANCELLED"  # nothing of SLURM's: a cancel
    assert stop_cause(_fields(IN_GRACE), 0) == "PREEMPTED"  # only the steps got SIGTERM
    assert stop_cause(_fields(REQUEUED_ONCE), 0) == "REQUEUED"
    assert stop_cause(_fields(REQUEUED_ONCE.replace("Restarts=1", "Restarts=2")), 2) == "CANCELLED"
    assert stop_cause(_fields(RUNNING.replace("RUNNING", "TIMEOUT", 1)), 0) == "TIMEOUT"
    assert stop_cause(_fields(RUNNING.replace("Reason=None", "Reason=TimeLimit")), 0) == "TIMEOUT"
    assert stop_cause({}, 0) == "CANCELLED"  # scontrol could not say: a cancel


def test_a_local_jobs_state_is_its_record_checked_against_its_script():
    me = {"pid": os.getpid(), "pid_start": start_time(os.getpid())}
    gone = {"pid": os.getpid(), "pid_start": "0"}  # the pid, reused by another process
    assert local.job_state({"state": "RUNNING", **me}) == "RUNNING"
    assert local.job_state({"state": "PENDING", **me}) == "RUNNING"  # started, not waiting for anything
    assert local.job_state({"state": "PENDING", "pipeline": {"warmup": {"job_id": "w"}}, **me}) == "PENDING"
    assert local.job_state({"state": "RUNNING", **gone}) == "FAILED"  # died without recording an end
    assert local.job_state({"state": "PENDING"}) == "FAILED"
    assert local.job_state({"state": "CANCELLED", **me}) == "CANCELLED"  # recorded ends stand
    assert local.job_state({"state": "REQUEUED", **gone}) == "REQUEUED"
    assert local.job_state({}) == "UNKNOWN"


def test_local_state_alive_and_group_states_come_from_job_json(tmp_path):
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    here = choose("local")
    job = {"backend": "local", "job_ids": ["local-1"], "groups": ["trainer"], "state": "RUNNING"}
    atomic_write_json(run.job_json, {**job, "pid": os.getpid(), "pid_start": start_time(os.getpid())})
    assert here.alive(run, "local-1") and here.state(run, "local-1") == "RUNNING"
    assert here.group_states(run, "local-1") == ({"trainer": "RUNNING"}, None)
    assert here.states({"local-1": jobs.read_job(run)}) == ({"local-1": "RUNNING"}, "")
    atomic_write_json(run.job_json, job)  # no script recorded: nothing alive
    assert not here.alive(run, "local-1") and here.state(run, "local-1") == "FAILED"


def test_a_backend_that_does_not_requeue_ends_the_run_at_a_time_limit(tmp_path):
    """`attempt requeue` asks the job's backend (from job.json), not the job id."""
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    run.config_yaml.write_text(yaml.safe_dump({"cluster": {"max_requeues": 5}}))
    attempts = [{"attempt": 0, "job_id": "7", "started_at": 1.0}]
    atomic_write_json(run.job_json, {"backend": "local", "state": "RUNNING", "job_ids": ["7"], "attempts": attempts})
    message, requeued = attempt.requeue(run, "7", "TIMEOUT")
    job = jobs.read_job(run)
    assert not requeued and message == "prime-hpc: TIMEOUT: not requeued (local runs are not requeued)"
    assert job["state"] == "TIMEOUT" and "max_requeues" not in job["failure"] and job.get("requeues", 0) == 0
