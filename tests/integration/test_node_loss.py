"""Nodes of a run fail on the dev cluster (`scontrol update nodename=... state=down`, then
`state=drain`: with the dev cluster's `ReturnToService=2` a DOWN node whose slurmd still
answers is back in service at once, and would be given to the requeued job again).

One RL run whose two inference servers run in jobs of their own, one node each
(`cluster.inference_job=own`): SLURM requeues a het job's one-node components whenever any
node of the het job fails, so servers that may be lost alone live outside it.
1. The first inference node is taken away: only its server (and its job) is lost; the run
   goes on with the other in the same attempt (no requeue).
2. That node is put back. The trainer's node is drained (what a node health check does to
   failing hardware) and the trainer dies on it (every process of the run there killed, as
   the node's failure kills them). SLURM does nothing to the jobs of a node it drains: only
   the supervisor's own verdict (`attempt node-lost`: the node is `draining` in `sinfo`)
   ends the attempt as NODE_FAIL, naming the node, and requeues the job (counted against
   `cluster.max_requeues`); without it the run would fail naming the trainer. SLURM starts
   the job again on nodes that are up; it continues from the last complete checkpoint, the
   remaining server joining it again; the new attempt submits a job for the lost server
   again, which starts once the drained node is back.
3. The head node (het group 0: the job script, the orchestrator, the router) dies (every
   process of the job there killed, SLURM's step daemon of the job script too, then the node
   set DOWN): SLURM requeues the head's component only (22.05: the trainer's keeps running its
   step); the next attempt's start records the attempt the dead script could not end
   (NODE_FAIL, a requeue), stops what the previous one still runs before anything else, and
   continues from the last complete checkpoint to `max_steps`.
While the test waits for the second server's job to start and for SLURM to end the first
server's step, it holds the trainer (SIGSTOP): the run's steps take under a second here, and
a run that reached `max_steps` in such a wait would leave the later parts nothing to lose.
Each step is trained once, no rollout errored (a lost server's requests went to the other),
and the ended attempts leave no process behind. Every node is put back (`state=resume`)
however the test ends."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from typing import Iterator

import pytest

from prime_hpc.config.compose import compose
from prime_hpc.launcher import launch
from prime_hpc.rundir import jobs
from prime_hpc.rundir.layout import server_slot
from prime_hpc.sched.slurm import Slurm, component_ids, job_steps
from tests import procs
from tests.runs import (
    rank0_pid,
    release_held,
    run_processes,
    slurm_node,
    still_alive,
    supervisor_pid,
    wait_for_step,
    wait_until,
)

pytestmark = [pytest.mark.slurm, pytest.mark.vllm]


def _job_nodes(job_id: str) -> set[str]:
    """The nodes SLURM gave the job (every het component)."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30).stdout
    lists = [f.split("=", 1)[1] for line in out.splitlines() for f in line.split() if f.startswith("NodeList=")]
    names = subprocess.run(
        ["scontrol", "show", "hostnames", ",".join(lists)], capture_output=True, text=True, timeout=30
    ).stdout
    return set(names.split())


def _set_state(node: str, *states: str) -> None:
    for state in states:
        subprocess.run(
            ["scontrol", "update", f"nodename={node}", f"state={state}", "reason=prime-hpc node loss test"],
            check=True,
            timeout=60,
        )


def _take_away(node: str) -> None:
    _set_state(node, "down", "drain")  # down: its steps end; drained: it stays out of the next allocation


def _resume(node: str) -> None:
    subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], capture_output=True, timeout=60)


def _put_back(node: str, timeout_s: float = 120) -> None:
    """Back in service, and seen so by SLURM: a node just set DOWN may still be ending the
    job it ran when it is resumed, and a resume SLURM refuses then would leave it out of
    every later allocation (the run's next attempt would wait for nodes for ever)."""
    deadline = time.monotonic() + timeout_s
    while True:
        _resume(node)
        state = subprocess.run(
            ["sinfo", "-h", "-N", "-n", node, "-o", "%T"], capture_output=True, text=True, timeout=60
        ).stdout
        if state.strip() and not any(s in state for s in ("down", "drain", "fail")):
            return
        assert time.monotonic() < deadline, f"{node} not back in service: {state.strip()}\n{_queue()}"
        time.sleep(1)


def _kill_on(node: str, processes: dict[int, int]) -> list[int]:
    """SIGKILL every process of the run on `node` (its SLURMD_NODENAME): a node that fails."""
    killed = []
    for pid in processes:
        try:
            if slurm_node(pid) == node:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        except (OSError, StopIteration):  # gone already, or not a step's process
            continue
    return killed


def _die(node: str, script: int, processes: dict[int, int]) -> None:
    """The head node dies: SLURM's step daemon of the job script (so that nothing reports the
    script's end, as nothing does from a dead node), the job script and every process of the
    run on it, SIGKILL. Setting the node DOWN alone is no node death on one host: its slurmd
    still answers and ends the job script, which then exits in its own time; that exit, reaching
    SLURM after it requeued the head's component, ends the other components too (22.05), and
    the requeued job waited beside idle nodes."""
    stepd = procs.table()[script][0]
    assert (procs.cmdline(stepd) or "").startswith("slurmstepd:"), procs.cmdline(stepd)
    for pid in (stepd, script):
        os.kill(pid, signal.SIGKILL)
    _kill_on(node, processes)


@contextlib.contextmanager
def _trainer_held(run) -> Iterator[None]:
    """The run's trainer stopped (SIGSTOP) for the block, then let go on: a step takes under a
    second here, while what the block waits for (a server's job to start, SLURM to end a step)
    can take a minute on a busy machine, and the run must not reach `max_steps` meanwhile. The
    orchestrator generates at most its async window ahead; the watchdog's stall timeout
    (600 s) is further off than any wait in the block."""
    pid = rank0_pid(run)
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _orch_rows(run) -> list[dict]:
    path = run.metrics("orchestrator")
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _attempts(run, n: int, job_id: str, timeout_s: float = 600) -> dict:
    """job.json once the run's attempt `n` (1-based) runs (a requeued job held by SLURM is
    let go sooner)."""
    deadline = time.monotonic() + timeout_s
    while len((job := jobs.read_job(run)).get("attempts", [])) < n or job.get("state") != "RUNNING":
        assert time.monotonic() < deadline and job.get("state") in ("RUNNING", "REQUEUED"), (job, _queue())
        release_held(job_id)
        time.sleep(1)
    return job


def _queue() -> str:
    """What SLURM says of the queue and the nodes (why a job still waits)."""
    return "\n".join(
        subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout
        for cmd in (["squeue", "-a", "-o", "%i %T %r %S %N"], ["sinfo", "-N", "-h", "-o", "%N %T %E"])
    )


def test_a_lost_node_costs_its_server_or_an_attempt_and_no_step_or_request(tmp_path):
    # room for part 1's unheld wait for requests on the first server (a server's heartbeat
    # shows them only when one is written mid-generation): one CI run saw them at step 28 of
    # a 30-step run, which then ended before its steps could go on with one server
    steps = 60
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
    run, job_id = sub.ref.run, sub.ref.job_id
    xids = [str(x["job_id"]) for x in jobs.extra_jobs(jobs.read_job(run))]
    down: list[str] = []
    try:
        assert [(x["fleet"], x["nodes"]) for x in jobs.extra_jobs(jobs.read_job(run))] == [(True, 1), (True, 1)]
        assert jobs.read_job(run)["groups"] == ["orchestrator", "trainer"]
        wait_for_step(run, 1)
        with _trainer_held(run):  # one server's job may start a minute after the other's on a busy machine
            wait_until(lambda: len(run.server_endpoints()) == 2, 540, "two servers", run)
        wait_until(lambda: (rows := _orch_rows(run)) and rows[-1]["inference/servers"] == 2, 120, "two serving", run)
        eps = run.server_endpoints()
        assert sorted(eps) == sorted(server_slot(0, x) for x in xids), eps
        # 1. the first inference node: its server is lost, the run goes on in the same attempt
        node = slurm_node(int(eps[server_slot(0, xids[0])]["pid"]))
        assert _job_nodes(xids[0]) == {node} and node not in _job_nodes(job_id) | _job_nodes(xids[1])
        beat = run.server_heartbeat(server_slot(0, xids[0]))
        wait_until(lambda: json.loads(beat.read_text()).get("in_flight"), 120, "requests on the server", run, 0.1)
        with _trainer_held(run):  # however long SLURM takes to end the server's step, the run stays far from its end
            _take_away(node)  # SLURM ends its step: SIGTERM to the server and to vLLM's engine under its requests
            down.append(node)
            wait_until(lambda: server_slot(0, xids[0]) not in run.server_endpoints(), 120, "the server gone", run)
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

        # 2. the trainer's node drained and the trainer dead on it: the supervisor's verdict, not SLURM's
        logs = run.latest_logs.resolve()
        listed = run_processes(logs)
        tnode = slurm_node(rank0_pid(run))
        t0 = time.time()
        _set_state(tnode, "drain")
        down.append(tnode)
        assert _kill_on(tnode, listed), f"no process of the run on {tnode}"
        deadline = time.monotonic() + 300
        while not (job := jobs.read_job(run)).get("requeues"):
            assert time.monotonic() < deadline and job.get("state") == "RUNNING", job
            time.sleep(1)
        first = job["attempts"][0]
        assert (first["end"], first["reason"], first["down_nodes"], job["requeues"]) == (
            "NODE_FAIL",
            f"node(s) of the job down: {tnode}",
            [tnode],
            1,
        ), job
        batch = run.slurm_batch_log(job_id).read_text()
        assert f"prime-hpc: node(s) of the job down: {tnode}" in batch, batch[-3000:]
        assert "prime-hpc: trainer exited with code " in batch and "a node of the job failed; requeueing" in batch
        print(f"node {tnode} drained, its trainer killed -> requeued by the supervisor after {time.time() - t0:.0f}s")
        deadline = time.monotonic() + 120
        while still_alive(listed):  # the first attempt leaves nothing behind
            assert time.monotonic() < deadline, still_alive(listed)
            time.sleep(1)
        job = _attempts(run, 2, job_id)
        assert job["attempts"][1]["resumed_from"] >= 4, job  # its last checkpoint
        assert tnode not in _job_nodes(job_id)  # the second attempt runs on nodes that are up
        extra = wait_until(lambda: (x := jobs.extra_jobs(jobs.read_job(run)))[2:] and x, 120, "a new server job", run)
        assert len(extra) == 3 and extra[2]["fleet"], extra  # the lost server's job, submitted again
        assert extra[2]["submitted_at"] > job["attempts"][1]["started_at"] - 1, extra
        _put_back(tnode)  # repaired: the lost server's new job starts there
        down.remove(tnode)

        # 3. the head node: the job script, the orchestrator and the router go with it
        wait_for_step(run, job["attempts"][1]["resumed_from"] + 3)
        logs = run.latest_logs.resolve()
        listed = run_processes(logs)
        head = slurm_node(int(json.loads(run.heartbeat("orchestrator", 0).read_text())["pid"]))
        assert head not in _job_nodes(xids[1]) | _job_nodes(str(extra[2]["job_id"]))
        t0 = time.time()
        _die(head, supervisor_pid(sub.ref), listed)
        _take_away(head)  # what SLURM concludes itself once the node's slurmd stops answering
        down.append(head)
        deadline = time.monotonic() + 300
        while (
            "PENDING"
            not in subprocess.run(
                ["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=60
            ).stdout
        ):
            assert time.monotonic() < deadline and jobs.read_job(run).get("state") in ("RUNNING", "REQUEUED")
            time.sleep(1)
        print(f"head node {head} down -> requeued after {time.time() - t0:.0f}s")
        _put_back(head)  # the only free node besides the trainer's
        down.remove(head)
        job = _attempts(run, 3, job_id)
        # its job script died with the node before it could record the requeue: the next attempt's
        # start records it, counted against cluster.max_requeues
        second = job["attempts"][1]
        assert (second["end"], second["reason"]) == (
            "NODE_FAIL",
            "the attempt ended without its job script (its node failed?)",
        ), job
        # SLURM requeued the head's component only: where the trainer's step outlived the head's srun (a
        # node that dies, not one set DOWN whose srun still aborts its steps), the third attempt's start
        # stopped it (else it trained on, on the third attempt's rollouts: steps trained twice, below)
        stopped = (
            f"prime-hpc: stopped what an earlier attempt of job {job_id} still ran"
            in run.slurm_batch_log(job_id).read_text()
        )
        print(f"the trainer's step of the second attempt {'outlived' if stopped else 'ended with'} the head's srun")
        deadline = time.monotonic() + 120
        while still_alive(listed):  # the second attempt leaves nothing behind
            assert time.monotonic() < deadline, still_alive(listed)
            time.sleep(1)
        assert launch.wait_done(sub, 900) == "COMPLETED", jobs.read_job(run)
        job = jobs.read_job(run)
        assert job["requeues"] == 2 and len(job["attempts"]) == 3, job
        assert job["attempts"][2]["resumed_from"] > job["attempts"][1]["resumed_from"], job  # a later checkpoint
        deadline = time.monotonic() + 120  # the remaining server's job leaves once the run ended
        while not (kept := jobs.extra_jobs(jobs.read_job(run))[1]).get("ended_at"):
            assert time.monotonic() < deadline, kept
            time.sleep(1)
        assert kept["state"] == "COMPLETED", kept
    finally:
        for n in down:
            _resume(n)
        for j in [x["job_id"] for x in jobs.extra_jobs(jobs.read_job(run))] + [job_id]:
            subprocess.run(["scancel", str(j)], capture_output=True, timeout=60)
    rows = [json.loads(line) for line in run.metrics("trainer").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), rows  # each step trained and recorded once
    orch = _orch_rows(run)
    servers = [r["inference/servers"] for r in orch]
    assert 1 in servers[servers.index(2) :], servers  # two, then one
    # losing a server, the trainer's node or the head's failed no request: no rollout errored
    errored = [{k: v for k, v in r.items() if "errored" in k} for r in orch]
    assert all(v == 0 for e in errored for v in e.values()), errored


def test_a_restarted_attempt_stops_the_steps_an_earlier_one_left_running(tmp_path):
    """What SLURM leaves when it requeues a het job's head component alone (its node failed):
    the step another component ran for the earlier attempt, still running. The SLURM side of
    what a restarted attempt does first (`Slurm.stop_leftovers`): every step of the job but
    the script's own killed and waited for."""
    script = tmp_path / "het.sh"
    script.write_text(
        "#!/bin/bash\n"
        f"#SBATCH --output={tmp_path}/out.txt --job-name=prime-hpc-leftovers\n"
        "#SBATCH --nodes=1 --ntasks-per-node=1 --cpus-per-task=1\n"
        "#SBATCH hetjob\n"
        "#SBATCH --nodes=1 --ntasks-per-node=1 --cpus-per-task=1\n"
        "srun --het-group=1 sleep 300 &\n"
        "sleep 300\n"
    )
    job = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=True, timeout=60)
    job_id = job.stdout.strip().split(";")[0]
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
        ids = component_ids(out.stdout)
        assert len(ids) == 2, out.stdout
        deadline = time.monotonic() + 120
        while not (steps := job_steps(ids)):
            assert time.monotonic() < deadline, "the component's step never ran"
            time.sleep(0.5)
        assert [s.split(".")[0] for s in steps] == [ids[1]], steps  # the other component's
        found, left = Slurm().stop_leftovers(job_id)
        assert (found, left) == (steps, []) and job_steps(ids) == []
        listed = subprocess.run(["squeue", "-h", "-s", "-j", ",".join(ids), "-o", "%i"], capture_output=True, text=True)
        assert listed.stdout.split() == [f"{job_id}.batch"], listed.stdout  # the job script's own step goes on
        assert Slurm().stop_leftovers(job_id) == ([], [])
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=60)
