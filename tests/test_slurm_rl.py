"""A real RL run as one het job on the dev cluster: two inference "nodes" behind the router
in group 1, the trainer in group 2, the orchestrator on the head. Asserts on the run
directory: endpoints published while it runs, weights per step, metrics, job.json, logs,
and that the API key is written nowhere."""
from __future__ import annotations

import json
import subprocess
import time

import pytest

from prime_hpc import jobs
from prime_hpc.config import compose
from prime_hpc.launcher import launch
from prime_hpc.rundir import RunDir, is_stable

pytestmark = [pytest.mark.slurm, pytest.mark.vllm]

KEY = "slurm-test-key-5e2a"


def _wait(pred, timeout_s, what, run: RunDir):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        job = jobs.read_job(run)
        if job.get("ended_at"):
            raise AssertionError(f"the job ended ({job.get('state')}, {job.get('failure')}) before {what}")
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def test_rl_job_with_two_inference_nodes_and_a_router(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERENCE_SERVER_API_KEY", KEY)
    cfg = compose(["+experiment=reverse_text", "cluster=dev", f"output_dir={tmp_path}/run", "max_steps=3",
                   "cluster.inference.nodes=2", "orchestrator.batch_size=32", "orchestrator.eval.interval=0"])
    sub = launch.submit(cfg, [])
    run = sub.ref.run
    try:
        ep = run.endpoints_dir
        names = ("inference_0.json", "inference_1.json", "router.json")
        _wait(lambda: all((ep / n).exists() for n in names), 600, "the endpoints", run)
        servers = [json.loads((ep / n).read_text()) for n in names[:2]]
        router = json.loads((ep / "router.json").read_text())
        assert [s["node"] for s in servers] == [0, 1]
        assert len({(s["host"], s["port"]) for s in servers}) == 2
        assert router["workers"] == [s["url"] for s in servers]
        assert launch.wait_done(sub, 900) == "COMPLETED", jobs.read_job(run)
    finally:
        subprocess.run(["scancel", sub.ref.job_id], capture_output=True, timeout=60)
    assert is_stable(run.weights_step(3))  # the final policy, loadable by vLLM and transformers
    orch = [json.loads(line) for line in run.metrics("orchestrator").read_text().splitlines()]
    trainer = [json.loads(line) for line in run.metrics("trainer").read_text().splitlines()]
    assert [r["step"] for r in orch] == [1, 2, 3] and [r["step"] for r in trainer] == [1, 2, 3]
    logs = run.latest_logs
    for rel in ("inference/node_0.log", "inference/node_1.log", "inference/router_0.log", "orchestrator.log",
                "trainer/node_0.log"):
        assert (logs / rel).is_file(), rel
    assert (logs / "inference.log").resolve() == (logs / "inference/node_0.log").resolve()
    for path in run.root.rglob("*"):  # the key lives in the environment only
        if path.is_file() and path.stat().st_size < 50_000_000:
            assert KEY.encode() not in path.read_bytes(), path
