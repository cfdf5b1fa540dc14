"""Nodes of a run fail on the dev cluster (`scontrol update nodename=... state=down`, then
`state=drain`: with the dev cluster's `ReturnToService=2` a DOWN node whose slurmd still
answers is back in service at once, and would be given to the requeued job again).

One RL run whose two inference servers run in jobs of their own, one node each
(`cluster.inference_job=own`): SLURM requeues a het job's one-node components whenever any
node of the het job fails, so servers that may be lost alone live outside it.
1. The first inference node is taken away: only its server (and its job) is lost; the run
   goes on with the other in the same attempt (no requeue).
2. That node is put back, then the trainer's node is taken away: the attempt ends, the job
   is requeued (counted against `cluster.max_requeues`), SLURM starts it again on nodes that
   are up, and it continues from the last complete checkpoint to `max_steps`, the remaining
   server joining it again; the new attempt submits a job for the lost server again. The
   first attempt leaves no process behind.
Every node is put back (`state=resume`) however the test ends."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from prime_hpc.config.compose import compose
from prime_hpc.launcher import launch
from prime_hpc.rundir import jobs
from prime_hpc.rundir.layout import server_slot
from tests.runs import run_processes, slurm_node, still_alive, wait_for_step

pytestmark = [pytest.mark.slurm, pytest.mark.vllm]


def _job_nodes(job_id: str) -> set[str]:
    """The nodes SLURM gave the job (every het component)."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30).stdout
    lists = [f.split("=", 1)[1] for line in out.splitlines() for f in line.split() if f.startswith("NodeList=")]
    names = subprocess.run(
        ["scontrol", "show", "hostnames", ",".join(lists)], capture_output=True, text=True, timeout=30
    ).stdout
    return set(names.split())


def _take_away(node: str) -> None:
    for state in ("down", "drain"):  # down: its steps end; drained: it stays out of the next allocation
        subprocess.run(
            ["scontrol", "update", f"nodename={node}", f"state={state}", "reason=prime-hpc node loss test"],
            check=True,
            timeout=60,
        )


def _put_back(node: str) -> None:
    subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], capture_output=True, timeout=60)


def _orch_rows(run) -> list[dict]:
    path = run.metrics("orchestrator")
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_lost_inference_node_costs_its_server_and_a_lost_trainer_node_an_attempt(tmp_path):
    steps = 24
    cfg = compose(
        [
            "+experiment=reverse_text",
            "cluster=dev",
            f"output_dir={tmp_path}/run",
            f"max_steps={steps}",
            "cluster.inference.nodes=2",
            "cluster.inference_job=own",
            "orchestrator.batch_size=16",
            "orchestrator.eval.interval=0",
            "ckpt.interval=2",
        ]
    )
    sub = launch.submit(cfg, [])
    run = sub.ref.run
    xids = [str(x["job_id"]) for x in jobs.extra_jobs(jobs.read_job(run))]
    down: list[str] = []
    try:
        assert [(x["fleet"], x["nodes"]) for x in jobs.extra_jobs(jobs.read_job(run))] == [(True, 1), (True, 1)]
        assert jobs.read_job(run)["groups"] == ["orchestrator", "trainer"]
        wait_for_step(run, 3)
        eps = run.server_endpoints()
        assert sorted(eps) == sorted(server_slot(0, x) for x in xids), eps
        assert _orch_rows(run)[0]["inference/servers"] == 2
        # 1. the first inference node: its server is lost, the run goes on in the same attempt
        node = slurm_node(int(eps[server_slot(0, xids[0])]["pid"]))
        assert _job_nodes(xids[0]) == {node} and node not in _job_nodes(sub.ref.job_id) | _job_nodes(xids[1])
        _take_away(node)
        down.append(node)
        deadline = time.monotonic() + 120
        while not any(r["inference/servers"] == 1 for r in _orch_rows(run)):
            assert time.monotonic() < deadline and not jobs.read_job(run).get("ended_at"), jobs.read_job(run)
            time.sleep(0.5)
        at = _orch_rows(run)[-1]["step"]
        wait_for_step(run, at + 3)  # steps go on with one server
        job = jobs.read_job(run)
        assert len(job["attempts"]) == 1 and not job.get("requeues"), job
        _put_back(node)
        down.remove(node)

        # 2. the trainer's node: the attempt ends and is requeued onto nodes that are up
        logs = run.latest_logs.resolve()
        listed = run_processes(logs)
        tnode = slurm_node(int(json.loads(run.heartbeat("trainer", 0).read_text())["pid"]))
        t0 = time.time()
        _take_away(tnode)
        down.append(tnode)
        deadline = time.monotonic() + 300
        while not (job := jobs.read_job(run)).get("requeues"):
            assert time.monotonic() < deadline and job.get("state") == "RUNNING", job
            time.sleep(1)
        first = job["attempts"][0]  # SLURM requeues a het job itself when one of its nodes fails
        assert first["end"] in ("REQUEUED", "NODE_FAIL") and job["requeues"] == 1, job
        print(f"node {tnode} down -> requeued after {time.time() - t0:.0f}s")
        deadline = time.monotonic() + 120
        while still_alive(listed):  # the first attempt leaves nothing behind
            assert time.monotonic() < deadline, still_alive(listed)
            time.sleep(1)
        assert launch.wait_done(sub, 900) == "COMPLETED", jobs.read_job(run)
        job = jobs.read_job(run)
        assert len(job["attempts"]) == 2 and job["attempts"][1]["resumed_from"] >= 4, job  # its last checkpoint
        assert tnode not in _job_nodes(sub.ref.job_id)  # the second attempt ran on nodes that were up
        extra = jobs.extra_jobs(job)
        assert len(extra) == 3 and extra[2]["fleet"], extra  # the lost server's job, submitted again
        assert extra[2]["submitted_at"] > job["attempts"][1]["started_at"] - 1, extra
        deadline = time.monotonic() + 120  # the remaining server's job leaves once the run ended
        while not (kept := jobs.extra_jobs(jobs.read_job(run))[1]).get("ended_at"):
            assert time.monotonic() < deadline, kept
            time.sleep(1)
        assert kept["state"] == "COMPLETED", kept
    finally:
        for n in down:
            _put_back(n)
        for j in [x["job_id"] for x in jobs.extra_jobs(jobs.read_job(run))] + [sub.ref.job_id]:
            subprocess.run(["scancel", str(j)], capture_output=True, timeout=60)
    rows = [json.loads(line) for line in run.metrics("trainer").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), rows  # each step trained and recorded once
    servers = [r["inference/servers"] for r in _orch_rows(run)]
    assert servers[0] == 2 and servers[-1] == 1, servers  # the server left rejoined the second attempt
