"""Faults on the real dev cluster: a component that cannot be replaced is killed (SIGKILL)
or frozen (SIGSTOP) mid-run. The job must end soon, name the component, its node, its exit
code and the log of the process that died, and leave no process of the run behind:
neither those listed before the fault (children included, found by their parent chain)
nor any found afresh after the end by the job's environment. torchrun's agent and the job
script itself are killed too, on SLURM and in cluster=local. An inference server is
replaceable: its loss ends the job only when it may not be restarted
(`inference.max_restarts=0`) and no other server is left, or when no server can serve for
longer than the watchdog's timeout (a frozen server killed and restarted, but not serving
again in time). Servers that heal: tests/integration/test_slurm_rl.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from prime_hpc.config.compose import compose
from prime_hpc.launcher import launch
from prime_hpc.launcher.render import STOP_GRACE_S
from prime_hpc.launcher.state import batch_log
from prime_hpc.rundir import RunDir, jobs, logtree
from tests import procs
from tests.conftest import cli
from tests.runs import agent_pid, engine_pid, rank0_pid, run_processes, still_alive, supervisor_pid, wait_for_step

pytestmark = [pytest.mark.slurm, pytest.mark.vllm]

STALL_S = 15


# ----------------------------------------------------------------------------- runs
def start_run(tmp_path: Path, name: str, *overrides: str):
    cfg = compose(
        [
            "+experiment=reverse_text",
            "cluster=dev",
            f"output_dir={tmp_path}/{name}",
            "max_steps=200",
            "orchestrator.batch_size=16",
            "orchestrator.eval.interval=0",
            f"watchdog.stall_timeout_s={STALL_S}",
            f"inference.stall_timeout_s={STALL_S}",
            *overrides,
        ]
    )
    return launch.submit(cfg, [])


def wait_ended(run: RunDir, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = jobs.read_job(run)
        if job.get("ended_at"):
            return job
        time.sleep(0.5)
    raise AssertionError(f"the job did not end within {timeout_s}s of the fault: {jobs.read_job(run)}")


def assert_nothing_left(logs: Path, listed: dict[int, int], wait_s: float = 30) -> None:
    """No process of the run is alive: none of those `listed` before the fault, and none
    found afresh by the job's environment (a process started after that listing)."""
    deadline = time.monotonic() + wait_s  # SLURM's step cleanup may lag the job's end by a moment
    while (left := still_alive({**listed, **run_processes(logs)})) and time.monotonic() < deadline:
        time.sleep(1)
    assert not left, f"processes of the run outlived it: {left}"


def victim_pid(run: RunDir, target: str) -> int:
    if target == "trainer":
        return int(json.loads(run.heartbeat("trainer", 0).read_text())["pid"])
    if target == "orchestrator":
        deadline = time.monotonic() + 60
        while not run.heartbeat("orchestrator", 0).exists():
            assert time.monotonic() < deadline, "the orchestrator never beat"
            time.sleep(0.5)
        return int(json.loads(run.heartbeat("orchestrator", 0).read_text())["pid"])
    server = int(json.loads(run.inference_endpoint(0).read_text())["pid"])
    return engine_pid(server) if target == "engine" else server


def kill_router_past_its_restarts(run: RunDir) -> float:
    """SIGKILL the router's serving process as often as its supervisor restarts it, and
    once more; returns when the last kill was sent."""
    from prime_hpc.inference.router import MAX_RESTARTS

    for k in range(MAX_RESTARTS + 1):
        deadline = time.monotonic() + 120
        while (rec := json.loads(run.router_endpoint.read_text()) if run.router_endpoint.exists() else {}).get(
            "restarts"
        ) != k:
            assert time.monotonic() < deadline, f"the router was not restarted a {k}th time: {rec}"
            time.sleep(0.2)
        t0 = time.time()
        os.kill(int(rec["pid"]), signal.SIGKILL)
    return t0


def check_job_key(run: RunDir) -> str:
    """Submitted without $INFERENCE_SERVER_API_KEY: the job made its own key, and a server
    refuses every route without it (weight updates included)."""
    import httpx

    assert not os.environ.get("INFERENCE_SERVER_API_KEY")
    ep = json.loads(run.inference_endpoint(0).read_text())
    env = Path(f"/proc/{ep['pid']}/environ").read_bytes().split(b"\0")
    key = next(v.split(b"=", 1)[1].decode() for v in env if v.startswith(b"INFERENCE_SERVER_API_KEY="))
    assert len(key) >= 32
    assert httpx.get(ep["url"] + "/v1/models", timeout=30).status_code == 401
    assert httpx.post(ep["url"] + "/update_weights", json={"weight_dir": "/tmp"}, timeout=30).status_code == 401
    ok = httpx.get(ep["url"] + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert ok.status_code == 200
    return key


FAULTS = [  # (what is done, to which component, what job.json must name)
    ("kill", "trainer", "trainer"),
    ("kill", "orchestrator", "orchestrator"),
    ("kill", "inference", "inference_0"),  # the only server, with inference.max_restarts=0
    ("kill", "router", "router"),  # past its restarts
    ("stop", "orchestrator", "orchestrator"),
    ("stop", "trainer", "trainer"),
    ("stop", "inference", "inference"),  # the only server hangs: restarted, but none serves for too long
]


@pytest.mark.parametrize("how, target, named", FAULTS, ids=[f"{h}-{t}" for h, t, _ in FAULTS])
def test_a_dead_or_frozen_component_ends_the_job_precisely_and_leaves_nothing(
    tmp_path, monkeypatch, how, target, named
):
    tokens = {"WANDB_API_KEY": "wandb-token-7f3e9c1a", "HF_TOKEN": "hf_token_52b8d0e4"}
    for var, value in tokens.items():  # in the submitting environment, as on a user's login node
        monkeypatch.setenv(var, value)
    sub = start_run(tmp_path, f"{how}-{target}", *(["inference.max_restarts=0"] if how == "kill" else []))
    run = sub.ref.run
    stopped = None
    try:
        wait_for_step(run, 2)
        logs = run.latest_logs.resolve()
        listed = run_processes(logs)
        assert len(listed) >= 4, listed  # orchestrator, server, router, torchrun + rank, watchdog (at least)
        pid = victim_pid(run, target) if target != "router" else json.loads(run.router_endpoint.read_text())["pid"]
        assert pid in listed, (pid, listed)
        key = check_job_key(run) if (how, target) == ("kill", "trainer") else None
        t0 = time.time()
        if target == "router":
            t0 = kill_router_past_its_restarts(run)
        elif how == "kill":
            os.kill(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGSTOP)
            stopped = pid
        # a frozen server is found hung after inference.stall_timeout_s, then no server serves for the watchdog's
        budget = (STALL_S + 10 if how == "stop" else 0) + (STALL_S if target == "inference" else 0) + 30 + STOP_GRACE_S
        job = wait_ended(run, budget + 30)
        assert launch.wait_done(sub, 120) == "FAILED", job
        job = jobs.read_job(run)
        ended_after = job["ended_at"] - t0
        assert ended_after <= budget, f"the job took {ended_after:.0f}s to end (budget {budget}s)"
        f = job["failure"]
        assert f["component"] == named, f
        if named.startswith("inference"):
            assert f["log"] == str(logtree.node_log(logs, "inference", 0)), f
        elif named == "router":
            assert f["log"] == str(logtree.router_log(logs, 0)), f
            assert "giving up" in logtree.router_log(logs, 0).read_text()
        elif named == "trainer":
            assert f["log"] == str(logtree.node_log(logs, "trainer", 0)) and f["node"] == 0, f
        else:
            assert f["log"] == str(logtree.component_log(logs, named)), f
        if how == "kill":
            assert f["rc"] != 0 and f["reason"], f
        elif target == "inference":  # hung, killed and restarted; no server serves for the watchdog's timeout
            assert f["reason"].startswith("stalled: no inference server could serve for "), f
            silent = int(f["reason"].split(" for ")[1].split("s")[0])
            assert STALL_S <= silent <= STALL_S + 10, f
            assert f"inference_0 starting, 1 restart(s), log {logs / 'inference' / 'node_0.log'}" in f["reason"], f
            lost = job["attempts"][-1]["lost"]
            assert [x["component"] for x in lost] == ["inference_0"] and lost[0]["restarted"], lost
            assert lost[0]["reason"].startswith("hung: no heartbeat for "), lost
        else:
            assert f["reason"].startswith("stalled: no heartbeat for "), f
            assert "last line of its log: " in f["reason"] and "(empty)" not in f["reason"], f
            silent = int(f["reason"].split(" for ")[1].split("s")[0])
            assert STALL_S <= silent <= STALL_S + 10, f
        # status says the same, in one line
        out = cli("status", str(run.root)).stdout
        assert f"failed: {named}" in out and str(f["log"]) in out, out
        assert_nothing_left(logs, listed)
        if key:  # no secret of the environment lands in a file of the run but the key kept for its owner
            assert run.key_file.read_text() == key
            assert (run.private_dir.stat().st_mode & 0o777, run.key_file.stat().st_mode & 0o777) == (0o700, 0o600)
            for path in run.root.rglob("*"):
                if path.is_file() and path != run.key_file and path.stat().st_size < 50_000_000:
                    data = path.read_bytes()
                    for secret in (key, *tokens.values()):
                        assert secret.encode() not in data, (path, secret)
    finally:
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGCONT)
            except OSError:
                pass
        subprocess.run(["scancel", sub.ref.job_id], capture_output=True, timeout=60)


KILLS = [  # (cluster, what is killed with SIGKILL, what job.json must name)
    ("dev", "agent", "trainer"),
    ("dev", "supervisor", "supervisor"),
    ("local", "agent", "trainer"),
    ("local", "rank", "trainer"),
    ("local", "supervisor", "supervisor"),
]


@pytest.mark.parametrize("cluster, target, named", KILLS, ids=[f"{c}-kill-{t}" for c, t, _ in KILLS])
def test_a_killed_torchrun_agent_or_job_script_ends_the_job_and_leaves_nothing(tmp_path, cluster, target, named):
    """SFT jobs (the trainer is all they run: no vLLM to wait for). torchrun's agent is
    found by parent chain (rank 0's parent), the job script as the parent of the run's
    processes (on SLURM: the one with the job's SLURM_JOB_ID; locally: job.json's pid)."""
    cfg = compose(
        [
            "+experiment=reverse_text_sft",
            f"cluster={cluster}",
            f"output_dir={tmp_path}/run",
            "max_steps=2000",
            "trainer.data.args.num_examples=4000",
            "trainer.val.interval=null",
        ]
    )
    sub = launch.submit(cfg, [])
    run = sub.ref.run
    logs = None
    try:
        wait_for_step(run, 2)
        logs = run.latest_logs.resolve()
        listed = run_processes(logs)
        pid = (
            {"agent": agent_pid, "rank": rank0_pid}[target](run) if target != "supervisor" else supervisor_pid(sub.ref)
        )
        assert (pid in listed) == (target != "supervisor"), (pid, listed)  # the job script is no child of itself
        listed[pid] = procs.stat(pid)[1]
        os.kill(pid, signal.SIGKILL)
        assert launch.wait_done(sub, 120) == "FAILED"
        f = wait_ended(run, 60)["failure"]
        assert f["component"] == named, f
        if target == "supervisor":
            assert f["log"] == str(batch_log(sub.ref)) and f"pid {pid} " in f["reason"], f
        else:
            assert f["log"] == str(logtree.node_log(logs, "trainer", 0)) and f["node"] == 0 and f["rc"] != 0, f
            # the agent's own death is its exit code (128 + 9), a rank's is torchrun's report
            killed = "rank 0 was killed by SIGKILL" if target == "rank" else "killed by SIGKILL"
            assert f"{killed}: out of memory?" in f["reason"], f
        assert f"failed: {named}" in cli("status", str(run.root)).stdout
        assert_nothing_left(logs, listed, wait_s=60)
    finally:
        if cluster == "dev":
            subprocess.run(["scancel", sub.ref.job_id], capture_output=True, timeout=60)
        for pid in run_processes(logs) if logs else ():  # what a failed test left of its own run
            os.kill(pid, signal.SIGKILL)
