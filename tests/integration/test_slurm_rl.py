"""A real RL run as one het job on the dev cluster: two inference "nodes" behind the router
in group 1, the trainer in group 2, the orchestrator on the head. Asserts on the run
directory: endpoints published while it runs, weights per step, metrics, job.json, logs,
and that the API key is written nowhere, although the site's default would export no
environment to the job (`SBATCH_EXPORT=NONE`). While it runs, every port a process of the
job listens on (found from the processes' sockets) is loopback and answers nothing
without the key. Mid-run one of the two servers is killed (SIGKILL: the run goes on with the other, and
nothing of the dead server is left), then the router (it is started again, in front of the
server left)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import httpx
import pytest

from prime_hpc.config.compose import compose
from prime_hpc.launcher import launch
from prime_hpc.rundir import RunDir, is_stable, jobs
from tests import procs
from tests.conftest import cli
from tests.netcheck import unkeyed_answers
from tests.runs import run_processes, still_alive, wait_for_step

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
    monkeypatch.setenv("SBATCH_EXPORT", "NONE")  # a site default that would keep the key out of the job
    steps = 20
    cfg = compose(
        [
            "+experiment=reverse_text",
            "cluster=dev",
            f"output_dir={tmp_path}/run",
            f"max_steps={steps}",
            "cluster.inference.nodes=2",
            "orchestrator.batch_size=32",
            "orchestrator.eval.interval=0",
        ]
    )
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
        # the router demands the key on every route but /health, its own admin routes included
        auth = {"Authorization": f"Bearer {KEY}"}
        assert httpx.get(router["url"] + "/list_workers", timeout=30).status_code == 401
        assert (
            httpx.post(router["url"] + "/remove_worker", params={"url": servers[0]["url"]}, timeout=30).status_code
            == 401
        )
        assert httpx.get(router["url"] + "/health", timeout=30).status_code == 200
        assert httpx.get(router["url"] + "/v1/models", headers=auth, timeout=30).status_code == 200

        wait_for_step(run, 2)  # every component runs: no port of the job serves anything without the key
        answers = unkeyed_answers(run.root)
        http = {k: v for k, v in answers.items() if any(a not in ("silent", "closed", "refused") for a in v)}
        assert {port for _, port, _ in http} >= {servers[0]["port"], servers[1]["port"], router["port"]}, answers
        assert all(a == "401" for v in http.values() for a in v), http
        assert all(addr == "127.0.0.1" for addr, _, _ in answers), answers
        logs = run.latest_logs.resolve()  # one server dies: the run goes on with the other
        server1 = {
            pid: start
            for pid, start in run_processes(logs).items()
            if pid == servers[1]["pid"] or procs.descends(pid, servers[1]["pid"])
        }
        os.kill(servers[1]["pid"], signal.SIGKILL)
        os.kill(router["pid"], signal.SIGKILL)  # the router dies: it is started again, on the same address
        again = _wait(
            lambda: (r := json.loads((ep / "router.json").read_text())).get("restarts") == 1 and r,
            120,
            "the router's restart",
            run,
        )
        assert again["url"] == router["url"] and again["pid"] != router["pid"]
        assert again["workers"] == [servers[0]["url"]]  # in front of the server still there
        assert launch.wait_done(sub, 900) == "COMPLETED", jobs.read_job(run)
    finally:
        subprocess.run(["scancel", sub.ref.job_id], capture_output=True, timeout=60)
    assert is_stable(run.weights_step(steps))  # the final policy, loadable by vLLM and transformers
    orch = [json.loads(line) for line in run.metrics("orchestrator").read_text().splitlines()]
    trainer = [json.loads(line) for line in run.metrics("trainer").read_text().splitlines()]
    assert [r["step"] for r in orch] == list(range(1, steps + 1)) == [r["step"] for r in trainer]
    assert orch[0]["inference/servers"] == 2 and orch[-1]["inference/servers"] == 1
    job = jobs.read_job(run)
    lost = job["attempts"][-1]["lost"]
    assert [(x["component"], x["node"], x["log"]) for x in lost] == [
        ("inference_1", 1, str(logs / "inference" / "node_1.log"))
    ] and lost[0]["rc"] != 0, lost
    assert not still_alive(server1), "the killed server left processes behind"
    assert "is gone" in (logs / "orchestrator.log").read_text()
    assert "restarting it on the same socket" in (logs / "inference" / "router_0.log").read_text()
    out = cli("status", str(run.root)).stdout
    assert "lost: inference_1" in out and "node_1.log" in out, out
    for rel in (
        "inference/node_0.log",
        "inference/node_1.log",
        "inference/router_0.log",
        "orchestrator.log",
        "trainer/node_0.log",
    ):
        assert (logs / rel).is_file(), rel
    assert (logs / "inference.log").resolve() == (logs / "inference/node_0.log").resolve()
    for path in [run.root, *run.root.rglob("*")]:
        if path.is_symlink():
            continue
        assert path.stat().st_mode & 0o007 == 0, f"{path} is open to other users (cluster.umask=027)"
        if path.is_file() and path.stat().st_size < 50_000_000:  # the key lives in the environment only
            assert KEY.encode() not in path.read_bytes(), path
