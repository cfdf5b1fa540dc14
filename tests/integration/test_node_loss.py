"""A node of the job fails on the dev cluster (`scontrol update nodename=... state=down`,
then `state=drain`: with the dev cluster's `ReturnToService=2` a DOWN node whose slurmd
still answers is back in service at once, and would be given to the requeued job again).
Losing the trainer's node ends the attempt; the job is requeued (counted against
`cluster.max_requeues`), SLURM starts it again on nodes that are up, and it continues from
the last complete checkpoint to `max_steps`. The node is put back (`state=resume`) however
the test ends, and the first attempt leaves no process behind."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from prime_hpc.config.compose import compose
from prime_hpc.launcher import launch
from prime_hpc.rundir import jobs
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


def test_a_lost_trainer_node_requeues_the_attempt_onto_nodes_that_are_up(tmp_path):
    steps = 10
    cfg = compose(
        [
            "+experiment=reverse_text",
            "cluster=dev",
            f"output_dir={tmp_path}/run",
            f"max_steps={steps}",
            "orchestrator.batch_size=16",
            "orchestrator.eval.interval=0",
            "ckpt.interval=2",
        ]
    )
    sub = launch.submit(cfg, [])
    run = sub.ref.run
    down = None
    try:
        wait_for_step(run, 5)
        logs = run.latest_logs.resolve()
        listed = run_processes(logs)
        rank0 = int(json.loads(run.heartbeat("trainer", 0).read_text())["pid"])
        down = slurm_node(rank0)
        t0 = time.time()
        for state in ("down", "drain"):  # down: its steps end; drained: it stays out of the next allocation
            subprocess.run(
                ["scontrol", "update", f"nodename={down}", f"state={state}", "reason=prime-hpc node loss test"],
                check=True,
                timeout=60,
            )
        deadline = time.monotonic() + 300  # the attempt ends as NODE_FAIL and the job goes back to the queue
        while not (job := jobs.read_job(run)).get("requeues"):
            assert time.monotonic() < deadline and job.get("state") == "RUNNING", job
            time.sleep(1)
        first = job["attempts"][0]  # SLURM requeues a het job itself when one of its nodes fails
        assert first["end"] in ("REQUEUED", "NODE_FAIL") and job["requeues"] == 1, job
        print(f"node {down} down -> requeued after {time.time() - t0:.0f}s")
        deadline = time.monotonic() + 120
        while still_alive(listed):  # the first attempt leaves nothing behind
            assert time.monotonic() < deadline, still_alive(listed)
            time.sleep(1)
        assert launch.wait_done(sub, 900) == "COMPLETED", jobs.read_job(run)
        job = jobs.read_job(run)
        assert len(job["attempts"]) == 2 and job["attempts"][1]["resumed_from"] >= 4, job  # its last checkpoint
        assert down not in _job_nodes(sub.ref.job_id)  # the second attempt ran on nodes that were up
    finally:
        if down is not None:
            subprocess.run(["scontrol", "update", f"nodename={down}", "state=resume"], capture_output=True, timeout=60)
        subprocess.run(["scancel", sub.ref.job_id], capture_output=True, timeout=60)
    rows = [json.loads(line) for line in run.metrics("trainer").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), rows  # each step trained and recorded once
