"""A real RL run as one het job on the dev cluster: two inference "nodes" in group 1 behind
the router (on the head node), the trainer in group 2, the orchestrator on the head. Asserts
on the run directory: endpoints published while it runs, weights per step, metrics,
job.json, logs, and that the API key is written nowhere, although the site's default would
export no environment to the job (`SBATCH_EXPORT=NONE`). While it runs, every port a process
of the job listens on (found from the processes' sockets) is loopback and answers nothing
without the key.

Then the fleet heals, one fault after the other, in the same attempt: the router is killed
(it is started again in front of the servers); at step 5 server 1 is killed (SIGKILL) with
requests in flight, under load: the trainer trains and server 0 generates while it is
restarted in its slot, loads the run's current policy before it serves, and takes every
later update; then server 0's engine is frozen (SIGSTOP): with requests in flight and none
finished for `inference.stall_timeout_s` it is hung, taken out, killed and restarted, its
requests retried on server 1. The run completes in the same attempt, both servers serving,
and no request failed: no rollout errored. Nothing of a killed server is left behind.

The run sends its weights by broadcast (`weights.transport=broadcast`; the filesystem path
is covered by the other runs on the dev cluster): the trainer sends each policy straight to
both servers and `weights/step_n` holds the full weights only at checkpoints (every 25
steps) and at the end, loadable there; every restarted server gets the current policy from
the trainer before it is routed; the mismatch KL of on-policy steps is as small as with the
filesystem."""

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
from prime_hpc.rundir.fleet import fleet, read_membership
from tests import procs
from tests.conftest import cli
from tests.netcheck import unkeyed_answers
from tests.runs import (
    engine_pid,
    fleet_row,
    run_processes,
    slurm_node,
    still_alive,
    wait_fleet,
    wait_for_step,
    wait_until,
)

pytestmark = [pytest.mark.slurm, pytest.mark.vllm]

KEY = "slurm-test-key-5e2a90c4d7b1e36f8a"  # a key the user chose: 32 bytes at least


def _server_processes(logs, pid: int) -> dict[int, int]:
    """{pid: start time} of an inference server and everything under it."""
    return {p: st for p, st in run_processes(logs).items() if p == pid or procs.descends(p, pid)}


def _policy(server_url: str) -> int:
    r = httpx.get(server_url + "/policy", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    return int(r.json()["policy_step"])


def _members(run: RunDir) -> dict:
    return read_membership(run)


def _rejoined(run: RunDir, slot: str, old_url: str, timeout_s: float = 300) -> dict:
    """The relay's record of `slot` once a new server serves there (not `old_url`)."""
    return wait_until(
        lambda: (m := _members(run).get(slot, {})).get("state") == "serving" and m.get("url") != old_url and m,
        timeout_s,
        f"{slot} serving again",
        run,
    )


def _synced_at_next_update(run: RunDir, slot: str, member: dict) -> None:
    """At the relay's next update the rejoined server serves the run's policy, like the others."""
    after = wait_until(
        lambda: (m := _members(run).get(slot, {})).get("policy_step", -1) > member["policy_step"] and m,
        120,
        f"an update reaching {slot}",
        run,
    )
    deadline = time.monotonic() + 60  # read between two updates: every server serves the same policy
    while True:
        policies = {s: _policy(m["url"]) for s, m in _members(run).items() if m["state"] == "serving"}
        if len(set(policies.values())) <= 1:
            break
        assert time.monotonic() < deadline, policies
        time.sleep(0.2)
    assert len(policies) == 2 and policies[slot] >= after["policy_step"], policies


def _restarted(run: RunDir, slot: str, old_url: str, timeout_s: float = 300) -> dict:
    """`slot`'s endpoint once a new server published it (its vLLM is up)."""
    return wait_until(
        lambda: (e := run.server_endpoints().get(slot, {})).get("url") not in (None, old_url) and e,
        timeout_s,
        f"a new server in {slot}",
        run,
    )


def _trainer(logs) -> list[int]:
    """The trainer's ranks (torchrun's workers: TORCHELASTIC_RUN_ID in their environment)."""
    ranks = procs.with_env("TORCHELASTIC_RUN_ID=", run_processes(logs), prefix=True)
    assert ranks, "no trainer rank found"
    return sorted(ranks)


def _signal_all(pids, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def _sending(run: RunDir) -> bool:
    """Is a policy on its way to a serving server? (The trainer writes a policy's marker
    just before it sends it; a server that has it serves it.)"""
    newest = max(run.policy_steps(), default=0)
    for m in _members(run).values():
        if m["state"] != "serving":
            continue
        try:
            if _policy(m["url"]) < newest:
                return True
        except httpx.HTTPError:  # a server that just died
            continue
    return False


def _trainer_step(run: RunDir) -> int:
    return int(json.loads(run.heartbeat("trainer", 0).read_text()).get("step", 0))


def _restarted_under_load(run: RunDir, logs, slot: str, old_url: str, last_step: int) -> tuple[dict, list[int]]:
    """`_restarted`, the trainer training meanwhile; paused only if it reaches `last_step`
    first (a machine too busy to start a server within the run's steps): the later faults
    need steps of their own. Returns the endpoint and the ranks paused (none: it trained
    throughout)."""
    deadline = time.monotonic() + 600
    while (e := run.server_endpoints().get(slot, {})).get("url") in (None, old_url):
        assert time.monotonic() < deadline and not jobs.read_job(run).get("ended_at"), f"a new server in {slot}"
        if _trainer_step(run) >= last_step:
            print(f"step {last_step} reached before {slot} was up again: the trainer pauses")
            paused = _pause_trainer(run, logs)
            return _restarted(run, slot, old_url), paused
        time.sleep(0.5)
    return e, []


def _pause_trainer(run: RunDir, logs) -> list[int]:
    """SIGSTOP the trainer's ranks between two sends: a server paused for a policy that
    stops arriving midway would be hung for inference.stall_timeout_s."""
    deadline = time.monotonic() + 120
    while True:
        ranks = _trainer(logs)
        _signal_all(ranks, signal.SIGSTOP)
        if not _sending(run):
            return ranks
        _signal_all(ranks, signal.SIGCONT)
        assert time.monotonic() < deadline, "the trainer was always sending"
        time.sleep(0.05)


def test_rl_job_with_two_inference_nodes_heals_its_fleet(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERENCE_SERVER_API_KEY", KEY)
    monkeypatch.setenv("SBATCH_EXPORT", "NONE")  # a site default that would keep the key out of the job
    # a step takes ~0.4 s on 2 cores: enough steps to outlast two restarts, one with the trainer running
    steps, every = 150, 25
    cfg = compose(
        [
            "+experiment=reverse_text",
            "cluster=dev",
            f"output_dir={tmp_path}/run",
            f"max_steps={steps}",
            "cluster.inference.nodes=2",
            "orchestrator.batch_size=32",
            "orchestrator.eval.interval=0",
            "inference.stall_timeout_s=20",
            "watchdog.stall_timeout_s=300",
            "weights.transport=broadcast",
            f"ckpt.interval={every}",
        ]
    )
    sub = launch.submit(cfg, [])
    run = sub.ref.run
    stopped, paused = None, []
    try:
        ep = run.endpoints_dir
        names = ("inference_0.json", "inference_1.json", "router.json")
        wait_until(lambda: all((ep / n).exists() for n in names), 600, "the endpoints", run)
        servers = [json.loads((ep / n).read_text()) for n in names[:2]]
        router = json.loads((ep / "router.json").read_text())
        assert [(s["slot"], s["node"], s["job_id"]) for s in servers] == [
            ("inference_0", 0, servers[0]["job_id"]),
            ("inference_1", 1, servers[0]["job_id"]),
        ]
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
        logs = run.latest_logs.resolve()
        nodes = [slurm_node(s["pid"]) for s in servers]
        assert slurm_node(router["supervisor_pid"]) not in nodes  # the router lives on the head node

        os.kill(router["pid"], signal.SIGKILL)  # the router dies: it is started again, on the same address
        again = wait_until(
            lambda: (r := json.loads((ep / "router.json").read_text())).get("restarts") == 1 and r,
            120,
            "the router's restart",
            run,
        )
        assert again["url"] == router["url"] and again["pid"] != router["pid"]
        assert sorted(again["workers"]) == sorted(s["url"] for s in servers)  # the relay's members

        # 1. server 1 dies with requests in flight: restarted in its slot, synced before it serves, in every
        # later update, while the trainer trains and server 0 generates (its requests in flight go there).
        # On 2 cores a vLLM start beside training and generation takes minutes (alone ~40 s): should the
        # run come within 40 steps of its end first, the trainer pauses until the new server is up. The
        # trainer then sends it the current policy, and only then does the relay route to it.
        wait_for_step(run, 5)
        wait_until(lambda: json.loads(run.server_heartbeat(1).read_text()).get("in_flight"), 120, "requests on 1", run)
        t_kill, at_kill = time.time(), _trainer_step(run)
        gone = _server_processes(logs, servers[1]["pid"])
        os.kill(servers[1]["pid"], signal.SIGKILL)
        _, paused = _restarted_under_load(run, logs, "inference_1", servers[1]["url"], steps - 40)
        trained = _trainer_step(run) - at_kill
        _signal_all(paused, signal.SIGCONT)
        assert trained >= 10, f"only {trained} steps trained while server 1 restarted"  # under load
        member1 = _rejoined(run, "inference_1", servers[1]["url"])
        assert member1["policy_step"] >= 3, member1  # restarted with the base model: the trainer's policy came first
        row = fleet_row(run, "inference_1")
        assert (row["state"], row["restarts"], row["log"]) == ("serving", 1, str(logs / "inference" / "node_1.log"))
        _synced_at_next_update(run, "inference_1", member1)
        print(f"server 1 killed -> serving again in {time.time() - t_kill:.0f}s, {trained} steps trained meanwhile")

        # 2. server 0's engine hangs: taken out, killed and restarted; its requests go to server 1
        wait_fleet(run, "inference_0", lambda r: r["state"] == "serving", "server 0 serving")
        wait_until(lambda: json.loads(run.server_heartbeat(0).read_text()).get("in_flight"), 120, "requests on 0", run)
        stopped = engine_pid(servers[0]["pid"])
        gone.update(_server_processes(logs, servers[0]["pid"]))
        t_stop = time.time()
        os.kill(stopped, signal.SIGSTOP)
        # the trainer keeps going until the hang is found (its requests in flight on the frozen server,
        # the others still served), then pauses while the server restarts
        wait_fleet(run, "inference_0", lambda r: r["restarts"] == 1, "server 0 found hung and restarted", 120)
        paused = _pause_trainer(run, logs)
        _restarted(run, "inference_0", servers[0]["url"])
        _signal_all(paused, signal.SIGCONT)
        paused = []
        member0 = _rejoined(run, "inference_0", servers[0]["url"])
        assert member0["policy_step"] > member1["policy_step"], (member0, member1)
        print(f"server 0 frozen -> serving again in {time.time() - t_stop:.0f}s")
        assert fleet_row(run, "inference_0")["restarts"] == 1
        _synced_at_next_update(run, "inference_0", member0)

        assert launch.wait_done(sub, 900) == "COMPLETED", jobs.read_job(run)
    finally:
        _signal_all(paused, signal.SIGCONT)
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGCONT)
            except OSError:
                pass
        subprocess.run(["scancel", sub.ref.job_id], capture_output=True, timeout=60)
    assert is_stable(run.weights_step(steps))  # the final policy, loadable by vLLM and transformers
    # broadcast: weights/ at the checkpoints and the last step only; a marker in sent/ for the later other steps
    saved = list(range(every, steps + 1, every))
    assert sorted((p.name for p in run.weights_dir.iterdir()), key=lambda n: int(n[5:])) == [f"step_{s}" for s in saved]
    markers = run.sent_steps()
    assert markers and max(markers) == steps - 1 and not set(markers) & set(saved), markers
    assert json.loads(run.sent_step(steps - 1).read_text())["step"] == steps - 1
    from transformers import AutoModelForCausalLM

    for s in run.weight_steps():
        AutoModelForCausalLM.from_pretrained(run.weights_step(s))
    orch = [json.loads(line) for line in run.metrics("orchestrator").read_text().splitlines()]
    trainer = [json.loads(line) for line in run.metrics("trainer").read_text().splitlines()]
    assert [r["step"] for r in orch] == list(range(1, steps + 1)) == [r["step"] for r in trainer]
    # as with weights from the filesystem: on-policy steps have the same logprobs in vLLM and the trainer
    on_policy = [(r["step"], r["mismatch_kl/mean"]) for r in trainer if r["off_policy_steps/mean"] == 0]
    print(f"on-policy steps (step, mismatch KL): {on_policy}")
    assert trainer[0]["off_policy_steps/mean"] == 0 and max(kl for _, kl in on_policy) < 1e-6, on_policy
    sent = [r for r in trainer if "time/weight_broadcast" in r]
    assert len(sent) >= steps - 1 and 2 in [r["weights/broadcast_servers"] for r in sent[-5:]], trainer[-5:]
    assert all(r["time/weight_update"] >= 0 for r in orch)
    assert orch[0]["inference/servers"] == 2 and orch[-1]["inference/servers"] == 2
    assert 1 in [r["inference/servers"] for r in orch[5:]]
    # a server killed, one hung and the router killed, each under load: no request failed, no rollout errored
    errored = [{k: v for k, v in r.items() if "errored" in k} for r in orch]
    assert all(v == 0 for e in errored for v in e.values()), [
        (r["step"], e) for r, e in zip(orch, errored) if any(e.values())
    ]
    job = jobs.read_job(run)
    assert len(job["attempts"]) == 1 and not job.get("requeues"), job
    lost = job["attempts"][-1]["lost"]
    assert [(x["component"], x["restarted"]) for x in lost] == [("inference_1", True), ("inference_0", True)]
    assert lost[0]["rc"] != 0 and lost[0]["log"] == str(logs / "inference" / "node_1.log"), lost
    assert lost[1]["reason"].startswith("hung: alive, but no progress for "), lost
    rows = {r["slot"]: r for r in fleet(run)}
    assert rows["inference_1"]["restarts"] == 1 and rows["inference_0"]["restarts"] == 1, rows
    assert not still_alive(gone), "a killed server left processes behind"
    assert (
        "left: " in (logs / "orchestrator.log").read_text()
        and "joined at policy" in (logs / "orchestrator.log").read_text()
    )
    assert "restarting it on the same socket" in (logs / "inference" / "router_0.log").read_text()
    trainer_log = (logs / "trainer" / "node_0.log").read_text()
    for slot in ("inference_0", "inference_1"):  # at the start and once more after its restart
        assert trainer_log.count(f"joined the weight group of {slot} ") == 2, trainer_log[-3000:]
        log = (logs / "inference" / f"node_{slot[-1]}.log").read_text()
        assert log.count(f"{slot} joined the weight group of the file store ") == 2, log[-3000:]  # one host
    out = cli("status", str(run.root)).stdout
    assert "lost: inference_1" in out and "node_1.log" in out and "restarted in its slot" in out, out
    assert "SERVER" in out and "RESTARTS" in out, out
    for rel in (
        "inference/node_0.log",
        "inference/node_1.log",
        "inference/router_0.log",
        "orchestrator.log",
        "trainer/node_0.log",
    ):
        assert (logs / rel).is_file(), rel
    assert (logs / "inference.log").resolve() == (logs / "inference/node_0.log").resolve()
    assert (logs / "inference/node_0.log").read_text().count("prime-hpc inference: vllm ") == 2  # appended
    for path in [run.root, *run.root.rglob("*")]:
        if path.is_symlink():
            continue
        assert path.stat().st_mode & 0o007 == 0, f"{path} is open to other users (cluster.umask=027)"
        if path.is_file() and path != run.key_file and path.stat().st_size < 50_000_000:
            assert KEY.encode() not in path.read_bytes(), path  # the key: the environment, and its owner's file
