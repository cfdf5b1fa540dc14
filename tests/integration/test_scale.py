"""Elastic inference on the dev cluster: a run with one inference node gets a second one
from an extra job (`prime-hpc scale +1` at step 5) and loses it again (`scale -1` at step
20 of 30, or seven steps after it joined where its start took longer). The run completes without an errored rollout; the extra server, named
`inference_<job id>.0`, joined (the relay loaded the run's policy into it), served
requests, loaded every policy the run loaded while it was in (its own log against the
relay's), left by draining (endpoint first, out of the router, no request in flight, exit
0; it asked the router, proven against router.json, signed) and left nothing behind; `scale`
checked the key against the run's router, proven without sending it; the run's job.json records the extra job and how it ended, and
`status`, `list` and `tail` show it. The run is submitted without an exported key, as a
new user would: `scale` takes the key the submit kept for its owner (`private/api_key`,
0600 in 0700), and that key is in no other file of the run, nor on any command line of
its processes."""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest

from prime_hpc.config.compose import compose
from prime_hpc.launcher import launch
from prime_hpc.rundir import RunDir, jobs, logtree
from prime_hpc.rundir.layout import server_slot
from tests import procs
from tests.conftest import cli
from tests.runs import wait_for_step

pytestmark = [pytest.mark.slurm, pytest.mark.vllm]

STEPS = 30  # 10 steps after the extra job is told to leave: it drains within a few


def _wait(pred, timeout_s: float, what: str, run: RunDir):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        assert not jobs.read_job(run).get("ended_at"), f"the run ended before {what}: {jobs.read_job(run)}"
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def _extra(run: RunDir) -> dict:
    (record,) = jobs.read_job(run)["extra_jobs"]
    return record


def _rows(run: RunDir, component: str) -> list[dict]:
    return [json.loads(line) for line in run.metrics(component).read_text().splitlines()]


def _relay_while_in(orchestrator_log: str, slot: str) -> tuple[int, list[int]]:
    """From the orchestrator's log: the policy the relay loaded into `slot` as it joined,
    and every policy the relay then loaded into the servers until `slot` left."""
    joined, during, state = None, [], "out"
    for line in orchestrator_log.splitlines():
        if state == "out" and (
            m := re.search(rf"inference server {re.escape(slot)} \(.*\) joined at policy (\d+)", line)
        ):
            joined, state = int(m.group(1)), "in"
        elif state == "in" and (m := re.search(r"inference now serves policy (\d+) ", line)):
            during.append(int(m.group(1)))
        elif state == "in" and re.search(rf"inference server {re.escape(slot)} \(.*\) left: ", line):
            state = "left"
    assert joined is not None and state == "left", f"{slot} never joined, or never left, in the orchestrator's log"
    return joined, during


def _key_nowhere_else(run: RunDir, key: str) -> None:
    """The kept key: the user's alone; no other file of the run, nor any command line, has it."""
    assert run.key_file.read_text() == key
    assert (run.private_dir.stat().st_mode & 0o777, run.key_file.stat().st_mode & 0o777) == (0o700, 0o600)
    for path in run.root.rglob("*"):
        if path.is_file() and path != run.key_file and path.stat().st_size < 50_000_000:
            assert key.encode() not in path.read_bytes(), path
    for pid in procs.table():
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        assert key.encode() not in argv, (pid, argv)


def test_an_extra_inference_job_joins_at_step_5_and_leaves_at_step_20(tmp_path, monkeypatch):
    monkeypatch.delenv("INFERENCE_SERVER_API_KEY", raising=False)  # the job makes its own; scale finds it
    cfg = compose(
        [
            "+experiment=reverse_text",
            "cluster=dev",
            f"output_dir={tmp_path}/run",
            f"max_steps={STEPS}",
            "orchestrator.batch_size=256",  # steps of a few seconds: the extra server starts within ~10
            "orchestrator.eval.interval=0",
            "orchestrator.eval.at_start=false",
        ]
    )
    sub = launch.submit(cfg, [])
    run, job_id = sub.ref.run, sub.ref.job_id
    xid = None
    try:
        wait_for_step(run, 5)
        # the extra "node" is this machine too: its server on the trainer's core, which is mostly idle
        # (inference's core is busy generating: a server starting there takes ~100 s instead of ~35)
        added = cli("scale", job_id, "inference=+1", "cluster.inference.cpu_ids=1")
        assert added.returncode == 0, added.stderr
        xid = str(_extra(run)["job_id"])
        assert f"submitted extra inference job {xid} (1 node(s)" in added.stdout, added.stdout
        slot = server_slot(0, xid)
        endpoint = _wait(
            lambda: run.inference_endpoint(slot).exists() and json.loads(run.inference_endpoint(slot).read_text()),
            300,
            "the extra server's endpoint",
            run,
        )
        assert endpoint["slot"] == slot and endpoint["job_id"] == xid and endpoint["extra"], endpoint
        joined_at = json.loads(run.heartbeat("trainer", 0).read_text()).get("step", 0)
        record = _extra(run)
        assert record["state"] == "RUNNING" and record["logs"] == str(run.extra_job_logs(xid)), record
        status = cli("status", job_id).stdout
        assert f"  {xid} " in status and slot in status and "serving" in status, status
        listed = cli("list").stdout
        assert f" + {xid}" in listed and "inference/slurm/extra" in listed, listed
        _key_nowhere_else(run, run.key_file.read_text())  # the run's, its extra job's processes: all running

        # out again at step 20, or later where its start took long: it serves five policies or more first
        wait_for_step(run, max(20, joined_at + 7))
        removed = cli("scale", job_id, "inference=-1")
        assert removed.returncode == 0 and f"cancelled extra inference job {xid}" in removed.stdout, removed
        left = _wait(lambda: _extra(run).get("ended_at") and _extra(run), 120, "the extra job's end", run)
        assert launch.wait_done(sub, 900) == "COMPLETED", jobs.read_job(run)
    finally:
        for j in filter(None, (xid, job_id)):
            subprocess.run(["scancel", j], capture_output=True, timeout=60)
    assert joined_at < STEPS - 10, f"the extra server published its endpoint only at step {joined_at}"
    # the extra job: cancelled, its server drained and exited 0, nothing of it left behind
    assert left["state"] == "CANCELLED" and left["exits"] == {"0": 0} and left["end"] == "USR2", left
    log = logtree.log_of(run.extra_job_logs(xid), slot).read_text()
    assert f"{slot} leaves the run (its job asks: USR2)" in log, log[-3000:]
    assert "out of the router, no request in flight" in log, log[-3000:]
    assert "does not ask the router" not in log, log[-3000:]  # it proved the run's router, and asked it signed
    # its engine stopped only once it had left (vLLM's own shutdown), not on a signal from SLURM
    assert log.index(f"{slot} left after") < log.index("EngineCore: trigger received"), log[-3000:]
    served = int(re.search(r"no request in flight, (\d+) served", log).group(1))
    assert served > 0, "the extra server served no request"
    # it loaded the run's policy as it joined, then every policy the run loaded while it was in
    joined, during = _relay_while_in((run.latest_logs / "orchestrator.log").read_text(), slot)
    loaded = [int(m) for m in re.findall(rf"{re.escape(slot)} serves policy (\d+) \(update", log)]
    assert loaded == [joined, *during] and len(during) >= 5, (loaded, joined, during)
    assert not run.inference_endpoint(slot).exists() and not run.server_heartbeat(slot).exists()
    assert not procs.with_env(f"PRIME_HPC_LOGS={run.extra_job_logs(xid)}"), "the extra job left processes behind"
    assert subprocess.run(["squeue", "-h", "-j", f"{xid},{job_id}"], capture_output=True, text=True).stdout == ""
    # the run: every step, no request that failed (no errored rollout, no errored group)
    orch = _rows(run, "orchestrator")
    assert [r["step"] for r in orch] == list(range(1, STEPS + 1))
    servers = [r["inference/servers"] for r in orch]
    assert servers[0] == 1 and 2 in servers and servers[-1] == 1, servers
    assert all(v == 0 for r in orch for k, v in r.items() if k.startswith(("errored_rollouts/", "filter/errored"))), [
        {k: v for k, v in r.items() if "errored" in k} for r in orch
    ]
    tail = cli("tail", job_id, "--no-follow", "--component", "inference", "-n", "3").stdout
    assert f"inference[{xid}.0]" in tail, tail
    _key_nowhere_else(run, run.key_file.read_text())  # nor in what the run wrote until its end
