"""On-policy distillation from a teacher the run starts itself, as one het job on the dev
cluster (`orchestrator.teacher.model`): the orchestrator, the inference server and the
trainer, and a fourth group, the teacher's server, behind a router of its own on the head
node. While it runs: the job has four components in SLURM; every port of the job, the
teacher's too, answers nothing without the key, on loopback only; `status` and `tail` show
the teacher; its server is killed (SIGKILL): it is restarted in its slot and rejoins its
router while the run goes on; then the job is requeued (`scontrol requeue`): the next
attempt starts the teacher again and continues from the last checkpoint to the end."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import httpx
import pytest

from prime_hpc.config.compose import compose
from prime_hpc.launcher import launch
from prime_hpc.rundir import jobs
from prime_hpc.rundir.fleet import read_membership
from tests.conftest import cli
from tests.netcheck import unkeyed_answers
from tests.runs import fleet_row, release_held, slurm_node, wait_fleet, wait_for_step, wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.vllm]

KEY = "slurm-teacher-key-81c4f29e0b7d6a53"  # a key the user chose: 32 bytes at least


def _components(job_id: str) -> list[str]:
    """The het components SLURM runs for the job, as `<id>+<k> <state>`."""
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%i %T"], capture_output=True, text=True, timeout=60)
    return sorted(out.stdout.split("\n")[:-1])


def test_a_teacher_the_run_starts_is_supervised_healed_and_requeued_with_the_job(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERENCE_SERVER_API_KEY", KEY)
    steps = 150  # a step takes about half a second: long enough for a restart and a requeue
    cfg = compose(
        [
            "+experiment=reverse_text",
            "warmup.experiment=null",
            "cluster=dev",
            f"output_dir={tmp_path}/run",
            f"max_steps={steps}",
            "orchestrator.training_mode=opd",
            "orchestrator.teacher.model=tiny",
            "orchestrator.batch_size=16",
            "orchestrator.eval.interval=0",
            "orchestrator.eval.at_start=false",
            "ckpt.interval=10",
        ]
    )
    sub = launch.submit(cfg, [])
    run, job_id = sub.ref.run, sub.ref.job_id
    teacher = run.of_group("teacher")
    try:
        assert jobs.read_job(run)["groups"] == ["orchestrator", "inference", "trainer", "teacher"]
        first = wait_until(lambda: teacher.server_endpoints().get("teacher_0"), 600, "the teacher's server", run)
        wait_until(lambda: teacher.router_endpoint.exists() and run.router_endpoint.exists(), 300, "both routers", run)
        router = json.loads(teacher.router_endpoint.read_text())
        assert (
            router["workers"] == [first["url"]] and router["url"] != json.loads(run.router_endpoint.read_text())["url"]
        )
        wait_for_step(run, 2)
        states = _components(job_id)
        assert [s.split()[0] for s in states] == [f"{job_id}+{k}" for k in range(4)], states
        assert all(s.endswith("RUNNING") for s in states), states
        # the teacher is on a node of its own group; its router beside the orchestrator
        inference = run.server_endpoints()["inference_0"]
        assert slurm_node(first["pid"]) != slurm_node(inference["pid"])
        assert slurm_node(router["supervisor_pid"]) == slurm_node(
            json.loads(run.heartbeat("orchestrator", 0).read_text())["pid"]
        )
        # its listeners demand the job's key, on loopback, like every other of the job
        answers = unkeyed_answers(run.root)
        http = {k: v for k, v in answers.items() if any(a not in ("silent", "closed", "refused") for a in v)}
        assert {port for _, port, _ in http} >= {first["port"], router["port"]}, answers
        assert all(a == "401" for v in http.values() for a in v), http
        assert all(addr == "127.0.0.1" for addr, _, _ in answers), answers
        auth = {"Authorization": f"Bearer {KEY}"}
        assert httpx.get(router["url"] + "/v1/models", headers=auth, timeout=30).json()["data"][0]["id"] == "tiny"

        status = cli("status", job_id).stdout
        assert "  teacher       RUNNING" in status and "teacher_0" in status, status
        row = next(line for line in status.splitlines() if line.strip().startswith("teacher_0"))
        assert "serving" in row and str(run.latest_logs.resolve() / "teacher" / "node_0.log") in row, status
        tail = cli("tail", job_id, "--no-follow", "--component", "teacher", "-n", "50", "--all").stdout
        assert "teacher[0]" in tail and "teacher-router" in tail and "POST /v1/completions" in tail, tail[-2000:]

        # its server dies: restarted in its slot, it rejoins the teacher's router; the run goes on
        logs = run.latest_logs.resolve()
        os.kill(first["pid"], signal.SIGKILL)
        wait_fleet(
            teacher, "teacher_0", lambda r: r["restarts"] == 1 and r["state"] == "serving", "teacher_0 again", 300
        )
        member = read_membership(teacher)["teacher_0"]
        assert member["url"] != first["url"], member
        workers = httpx.get(router["url"] + "/workers", headers=auth, timeout=30).json()
        assert member["url"] in json.dumps(workers) and first["url"] not in json.dumps(workers), workers
        at = json.loads(run.heartbeat("trainer", 0).read_text())["step"]
        wait_for_step(run, at + 2)

        # the job is requeued: the next attempt starts the teacher again and continues
        before = len(jobs.read_job(run)["attempts"])
        subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=60)
        wait_until(
            lambda: release_held(job_id) or len(jobs.read_job(run)["attempts"]) > before, 600, "attempt 2", run, 2
        )
        assert launch.wait_done(sub, 900) == "COMPLETED", jobs.read_job(run)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=60)
    job = jobs.read_job(run)
    assert [a["end"] for a in job["attempts"]] == ["REQUEUED", "COMPLETED"], job["attempts"]
    assert job["attempts"][1]["resumed_from"] >= 10, job["attempts"]
    lost = job["attempts"][0]["lost"]
    assert [(x["component"], x["restarted"]) for x in lost] == [("teacher_0", True)], lost
    assert lost[0]["log"] == str(logs / "teacher" / "node_0.log"), lost
    assert "vllm" in (logs / "teacher" / "node_0.log").read_text()
    assert (logs / "teacher" / "node_0.log").read_text().count(
        "prime-hpc inference: vllm "
    ) == 2  # its restart appended
    # the second attempt: the teacher served again, and every step was trained once
    again = run.latest_logs.resolve()
    assert again != logs and (again / "teacher.log").resolve() == (again / "teacher" / "node_0.log").resolve()
    assert 'POST /v1/completions HTTP/1.1" 200' in (again / "teacher" / "node_0.log").read_text()
    orch_log = (again / "orchestrator.log").read_text()
    assert "teacher tiny at http://127.0.0.1:" in orch_log, orch_log[-2000:]
    rows = [json.loads(line) for line in run.metrics("trainer").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), rows
    # losing the teacher's server, then the requeue, failed no request: no rollout errored (a teacher's
    # request that fails for good ends the run)
    errored = [
        {k: v for k, v in json.loads(line).items() if "errored" in k}
        for line in run.metrics("orchestrator").read_text().splitlines()
    ]
    assert len(errored) == steps and all(v == 0 for e in errored for v in e.values()), errored
    assert fleet_row(run, "teacher_0")["state"] in ("serving", "ended")
    for path in [run.root, *run.root.rglob("*")]:
        if path.is_file() and not path.is_symlink() and path != run.key_file and path.stat().st_size < 50_000_000:
            assert KEY.encode() not in path.read_bytes(), path  # the key: the environment, and its owner's file
