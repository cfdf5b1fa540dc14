"""`weights.transport=broadcast` without servers: which steps keep full weights and which
get a marker, the run directory's view of both, the trainer's background sender (against
stand-in Broadcasters) and the orchestrator's relay waiting for the servers (against a
stand-in admin client); the sender's calls to servers behind the inference server's own
gate (the key never sent: each server proves itself, each call is signed for it)."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace as NS

import httpx
import pytest
import torch
from loguru import logger

from prime_hpc.config.component import component_config
from prime_hpc.config.compose import compose
from prime_hpc.inference.gate import SIGNATURE_SCHEME
from prime_hpc.rundir import RunDir, atomic_write_json, mark_stable
from prime_hpc.rundir.checkpoints import full_weights_due
from tests.inference_util import request_body
from tests.unit.test_router import KEY, Served


# ----------------------------------------------------------------------------- what is written
@pytest.mark.parametrize(
    "transport, interval, enabled, expected",
    [
        ("filesystem", None, False, [1, 2, 3, 4, 5, 6, 7]),  # every step, as always
        ("broadcast", 3, False, [3, 6, 7]),  # checkpoints and the last step
        ("broadcast", None, True, [7]),  # a checkpoint at the end only
        ("broadcast", None, False, [7]),  # no checkpoints: still the last step
    ],
)
def test_full_weights_at_checkpoints_and_the_last_step_with_broadcast(transport, interval, enabled, expected):
    ckpt = NS(interval=interval, enabled=enabled)
    assert [s for s in range(1, 8) if full_weights_due(s, s == 7, ckpt, transport)] == expected


def test_the_trainer_and_the_orchestrator_are_told_the_transport(tmp_path):
    cfg = compose(["+experiment=reverse_text", f"output_dir={tmp_path}/run", "weights.transport=broadcast"])
    for component in ("trainer", "orchestrator", "inference"):
        assert component_config(cfg, component)["weights"] == {"transport": "broadcast"}, component


def _full(run: RunDir, step: int) -> None:
    d = run.weights_step(step)
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(b"x")
    mark_stable(d, {"step": step})


def test_a_policy_sent_by_broadcast_leaves_a_marker_and_no_weights_and_readers_find_the_saved_ones(tmp_path):
    from prime_hpc.model import resolve_model
    from prime_hpc.trainer.model import write_marker
    from prime_hpc.trainer.runner import prune_weights

    run = RunDir(tmp_path)
    (tmp_path / "config.yaml").write_text("{}\n")
    for step in range(1, 9):
        if step in (3, 6):
            _full(run, step)
        else:
            write_marker(run, step)
    assert run.weight_steps() == [3, 6]  # no weights/step_<n> between checkpoints
    assert sorted(p.name for p in run.weights_dir.iterdir()) == ["step_3", "step_6"]
    assert json.loads(run.sent_step(5).read_text())["step"] == 5
    assert run.sent_steps() == [1, 2, 4, 5, 7, 8]
    assert run.policy_steps() == list(range(1, 9))  # the relay sees every policy
    assert [s for s in range(1, 9) if run.has_weights(s)] == [3, 6]
    half = run.weights_step(9)
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"x")  # not marked yet
    assert not run.has_weights(9) and run.weight_steps() == [3, 6]
    assert resolve_model(str(tmp_path)) == str(run.weights_step(6))  # the newest weights, not step 8's marker
    # retention: after step 8 at async_level 2 policies >= 5 stay, and step 3 stays with its checkpoint
    (run.checkpoint_part(3, "trainer")).mkdir(parents=True)
    prune_weights(run, 8, async_level=2)
    assert run.weight_steps() == [3, 6] and run.sent_steps() == [5, 7, 8]


def test_the_policy_handed_to_the_sender_is_a_copy_of_the_live_parameters():
    from prime_hpc.trainer.model import Policy, full_state_dict, hf_weights

    model = torch.nn.Linear(3, 2)
    pol = Policy(model, None, "x", NS(tie_word_embeddings=False), None, torch.float32, sharded=False)
    sd = full_state_dict(model)
    assert sd["weight"].data_ptr() == model.weight.data_ptr()  # one rank: the state dict is the parameters
    own = hf_weights(pol, sd, own=True)
    assert own["weight"].data_ptr() != model.weight.data_ptr() and torch.equal(own["weight"], model.weight)
    with torch.no_grad():
        model.weight.add_(1.0)  # the next optimizer step
    assert not torch.equal(own["weight"], model.weight)


# ----------------------------------------------------------------------------- the trainer's sender
class FakeBroadcaster:
    """Records joins and sends; `fail` holds the URLs whose next send fails, `hold` the
    URLs whose sends wait until their event is set (a frozen server), `refuse` those whose
    sends are refused by their digests (what arrived was altered)."""

    verified = True  # it sends digests: computed once per policy and dtype, by the sender
    dtype = "float32"

    def __init__(self, url: str, log: list, fail: set, hold: dict, refuse: set = frozenset()) -> None:
        self.url, self.log, self.fail, self.hold, self.refuse = url, log, fail, hold, refuse

    def expect(self, record: dict) -> None:
        self.record = record

    def join(self) -> dict:
        self.log.append(("join", self.url))
        return {}

    def served(self, named) -> list:
        return list(named)

    def digests(self, named) -> list:
        from prime_hpc.inference.broadcast import tensor_digests

        self.log.append(("digests", self.url))
        return tensor_digests([t for _, t in named])

    def send(self, step, named, announced, digests=None) -> dict:
        from prime_hpc.inference.broadcast import DigestRefused, tensor_digest

        assert [n for n, _ in named] == announced["names"]
        assert digests == [tensor_digest(t) for _, t in named]
        self.log.append(("send", self.url, step))
        if self.url in self.fail:
            raise RuntimeError(f"{self.url}: the group timed out")
        if self.url in self.refuse:
            raise DigestRefused(f"{self.url}: policy {step} refused: differs", step, "w")
        if self.url in self.hold:
            assert self.hold[self.url].wait(30)
        time.sleep(0.05)
        return {"bytes": 24, "drain_s": 0.01, "load_s": 0.02}

    def close(self, leave: bool = True) -> None:
        self.log.append(("close", self.url))


def _until(pred, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_sender_joins_every_server_sends_each_policy_and_syncs_a_replaced_one(tmp_path):
    from prime_hpc.trainer.sender import WeightSender

    run = RunDir(tmp_path)
    log: list = []
    fail: set = set()
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m)), level="INFO")
    atomic_write_json(run.inference_endpoint(0), {"url": "http://a"})
    atomic_write_json(run.inference_endpoint(1), {"url": "http://b"})
    sender = WeightSender(run, make=lambda url: FakeBroadcaster(url, log, fail, {}), poll_s=0.02)
    try:
        _until(lambda: {("join", "http://a"), ("join", "http://b")} <= set(log))  # joined before any policy
        w = {"w": torch.ones(2)}
        sender.publish(1, w)
        assert sender.wait(10) and {("send", "http://a", 1), ("send", "http://b", 1)} <= set(log)
        sender.publish(2, w)
        assert sender.wait(10)
        assert sender.stats() == pytest.approx(
            {"step": 2, "seconds": sender.stats()["seconds"], "servers": 2, "bytes": 24, "drain": 0.01, "load": 0.02}
        )
        assert sender.stats()["seconds"] >= 0.05  # from the publish to the end of the slower send
        fail.add("http://b")  # server 1 fails a send: left out, the trainer goes on
        sender.publish(3, w)
        assert sender.wait(10) and sender.stats()["servers"] == 1 and sender.behind() == []
        sender.publish(4, w)
        sender.wait(10)
        assert ("send", "http://b", 4) not in log and ("send", "http://a", 4) in log
        assert sum("left out: policy 3 failed" in line for line in lines) == 1
        # a new server takes slot 1 (its supervisor restarted it): joined and sent the current policy at once
        atomic_write_json(run.inference_endpoint(1), {"url": "http://c"})
        _until(lambda: ("send", "http://c", 4) in log)
        assert log.index(("join", "http://c")) < log.index(("send", "http://c", 4))
        _until(lambda: ("close", "http://b") in log)
        run.inference_endpoint(0).unlink()  # server 0 left
        _until(lambda: ("close", "http://a") in log)
        sender.publish(5, w)
        assert sender.wait(10)
        assert ("send", "http://c", 5) in log and ("send", "http://a", 5) not in log
    finally:
        sender.close()
        logger.remove(sink)


def test_a_frozen_server_holds_back_neither_the_trainer_nor_the_others_and_gets_the_newest_policy_next(tmp_path):
    """A server stuck in a send (its engine frozen until the watchdog restarts it) keeps
    only its own thread: publish returns at once, the other server gets every policy, and
    once free the stuck one gets the newest policy, skipping those in between."""

    from prime_hpc.trainer.sender import WeightSender

    run = RunDir(tmp_path)
    log: list = []
    frozen = threading.Event()
    atomic_write_json(run.inference_endpoint(0), {"url": "http://a"})
    atomic_write_json(run.inference_endpoint(1), {"url": "http://b"})
    sender = WeightSender(run, make=lambda url: FakeBroadcaster(url, log, set(), {"http://b": frozen}), poll_s=0.02)
    try:
        w = {"w": torch.ones(2)}
        sender.publish(1, w)
        _until(lambda: ("send", "http://b", 1) in log)  # b is stuck in policy 1
        for step in (2, 3, 4):  # were publish to wait for b, this would hang: b is freed only below
            sender.publish(step, w)
            _until(lambda s=step: ("send", "http://a", s) in log)
        assert not sender.wait(0.3) and sender.behind() == ["inference_1"]
        assert sender.stats()["step"] == 4 and sender.stats()["servers"] == 1
        frozen.set()  # b is free again: the newest policy next, not 2 and 3
        assert sender.wait(10)
        assert [e[2] for e in log if e[:2] == ("send", "http://b")] == [1, 4]
        assert sender.stats()["servers"] == 2 and sender.behind() == []
    finally:
        frozen.set()
        sender.close()


def test_a_server_left_out_after_a_failure_that_did_not_end_it_is_joined_again_later(tmp_path, monkeypatch):
    """A send refused by a server that lives on (its drain timed out, say) does not leave it
    without policies for the rest of the run: after the back-off it gets a fresh group and
    the newest policy."""
    from prime_hpc.trainer import sender as sender_mod

    monkeypatch.setattr(sender_mod, "RETRY_S", (1.0, 1.0))
    run = RunDir(tmp_path)
    log: list = []
    fail = {"http://a"}
    atomic_write_json(run.inference_endpoint(0), {"url": "http://a"})
    sender = sender_mod.WeightSender(run, make=lambda url: FakeBroadcaster(url, log, fail, {}), poll_s=0.02)
    try:
        sender.publish(1, {"w": torch.ones(2)})
        _until(lambda: ("send", "http://a", 1) in log and sender.behind() == [])  # left out: not waited for
        assert sender.wait(0.05)
        fail.clear()  # the server is fine again
        sender.publish(2, {"w": torch.ones(2)})
        _until(lambda: ("send", "http://a", 2) in log)
        assert log.count(("join", "http://a")) == 2 and ("close", "http://a") in log  # a fresh group
        assert sender.wait(5) and sender.stats()["step"] == 2
    finally:
        sender.close()


def test_a_server_that_refuses_a_policy_by_its_digests_gets_it_from_disk_and_a_fresh_group(tmp_path):
    """A server whose received policy differs from the digests the sender gave refuses it
    (`DigestRefused`): the sender names it in one line, writes `weights/step_<n>` (which the
    server loads in its place) once even if several refuse it, and joins that server
    again with a fresh group; the others are not held back. Each policy's digests are
    computed once for all servers of one dtype."""
    from prime_hpc.trainer.sender import WeightSender

    run = RunDir(tmp_path)
    log: list = []
    lines: list[str] = []
    written: list = []
    sink = logger.add(lambda m: lines.append(str(m)), level="INFO")

    def write(step, named):
        written.append((step, sorted(named)))
        _full(run, step)

    atomic_write_json(run.inference_endpoint(0), {"url": "http://a"})
    atomic_write_json(run.inference_endpoint(1), {"url": "http://b"})
    atomic_write_json(run.inference_endpoint(2), {"url": "http://c"})
    refuse = {"http://b", "http://c"}
    make = lambda url: FakeBroadcaster(url, log, set(), {}, refuse)  # noqa: E731
    sender = WeightSender(run, make=make, poll_s=0.02, write=write)
    try:
        _until(lambda: sum(e[0] == "join" for e in log) == 3)
        sender.publish(1, {"w": torch.ones(2), "b": torch.zeros(1)})
        assert sender.wait(10) and sender.behind() == []
        assert written == [(1, ["b", "w"])] and run.has_weights(1)  # written once, for both
        assert sum(e[0] == "digests" for e in log) == 1  # once for the three servers
        refused = [line for line in lines if "refused policy 1" in line]
        assert len(refused) == 2 and all(f"loads the step from {run.weights_step(1)}" in line for line in refused)
        _until(lambda: log.count(("join", "http://b")) == 2 and log.count(("join", "http://c")) == 2)
        assert log.count(("join", "http://a")) == 1  # a fresh group for the refusing servers only
        refuse.clear()
        sender.publish(2, {"w": torch.full((2,), 2.0), "b": torch.zeros(1)})
        assert sender.wait(10) and {("send", u, 2) for u in ("http://a", "http://b", "http://c")} <= set(log)
        assert written == [(1, ["b", "w"])] and len(sender.delivered[2]) == 3
    finally:
        sender.close()
        logger.remove(sink)


# ----------------------------------------------------------------------------- the relay
class FakeAdmin:
    """The admin client's membership and `GET /policy`, from a dict url -> policy step."""

    def __init__(self, policies: dict) -> None:
        self.policies = policies
        self.servers = list(policies)
        self.lost: dict = {}
        self.unjoined: set = set()  # servers in no weight group
        self.loads: list = []  # (path, step, servers) of every load from disk
        self.errors: set = set()  # servers whose GET /policy answers an error
        self.asked = 0

    @property
    def live(self) -> list:
        return [s for s in self.servers if s not in self.lost]

    def add(self, server: str) -> None:
        if server not in self.servers:
            self.servers.append(server)

    def remove(self, server: str) -> None:
        if server in self.servers:
            self.servers.remove(server)

    async def update_weights(self, path, step, to=None) -> list:
        self.loads.append((str(path), step, list(to or self.live)))
        for server in to or self.live:
            self.policies[server] = step
        return [{"policy_step": step}]

    async def policy_of(self, to=None) -> dict:
        from prime_hpc.inference.client import InferenceError

        self.asked += 1
        if self.errors & set(self.live if to is None else to):
            raise InferenceError(f"{sorted(self.errors)[0]}/policy: HTTP 500: engine error")
        return {
            s: {"policy_step": self.policies[s], "weights_joined": s not in self.unjoined}
            for s in (self.live if to is None else to)
        }


def test_the_relay_moves_on_once_every_server_received_the_broadcast_policy(tmp_path, monkeypatch):
    from prime_hpc.orchestrator import relay as relay_mod
    from prime_hpc.trainer.model import write_marker

    run = RunDir(tmp_path)
    admin = FakeAdmin({"http://a": 1, "http://b": 1})
    relay = relay_mod.WeightRelay(run, admin, "m", transport="broadcast")
    relay.policy = 1
    write_marker(run, 2)

    async def go() -> None:
        task = asyncio.create_task(relay.update(2))  # loads nothing: it only asks the servers' policies
        await asyncio.sleep(0.2)
        assert not task.done() and relay.policy == 1  # the servers still serve policy 1
        admin.policies["http://a"] = 2
        await asyncio.sleep(0.2)
        assert not task.done()
        admin.policies["http://b"] = 3  # a later one is as good
        await asyncio.wait_for(task, 5)

    asyncio.run(go())
    assert relay.policy == 2 and relay.updates[-1]["step"] == 2 and relay.updates[-1]["seconds"] >= 0.4
    assert admin.loads == []
    assert relay.gauges()["time/weight_update"] == relay.updates[-1]["seconds"]

    # a server the policy never reaches is waited for BROADCAST_WAIT_S, then left out
    monkeypatch.setattr(relay_mod, "BROADCAST_WAIT_S", 0.3)
    write_marker(run, 4)
    admin.policies["http://a"] = 4
    asyncio.run(asyncio.wait_for(relay.update(4), 5))
    assert relay.policy == 4 and admin.live == ["http://a"]

    # a server in no weight group (the trainer's send to it failed) is waited for UNJOINED_WAIT_S only
    monkeypatch.setattr(relay_mod, "BROADCAST_WAIT_S", 60)
    monkeypatch.setattr(relay_mod, "UNJOINED_WAIT_S", 0.2)
    admin.add("http://c")
    admin.policies["http://c"] = 4
    admin.unjoined.add("http://c")
    write_marker(run, 5)
    admin.policies["http://a"] = 5
    asyncio.run(asyncio.wait_for(relay.update(5), 5))  # not BROADCAST_WAIT_S
    assert relay.policy == 5 and admin.live == ["http://a"]


def test_a_server_that_only_answers_errors_spoils_no_other_answer_and_is_restarted(tmp_path, monkeypatch):
    """One server's `GET /policy` failing does not hide the others': the policy moves on
    once they have it and that server is left out after BROADCAST_WAIT_S, and since it still
    answers, its supervisor is asked to restart it (a server left alive would sit idle)."""
    from prime_hpc.orchestrator import fleet as fleet_mod
    from prime_hpc.orchestrator import relay as relay_mod
    from prime_hpc.trainer.model import write_marker

    async def router_call(router, url):
        pass

    monkeypatch.setattr(fleet_mod, "add_worker", router_call)
    monkeypatch.setattr(fleet_mod, "forget_worker", router_call)
    monkeypatch.setattr(relay_mod, "BROADCAST_WAIT_S", 0.3)
    run = RunDir(tmp_path)
    admin = FakeAdmin({"http://a": 1, "http://b": 1})
    admin.errors.add("http://b")
    relay = relay_mod.WeightRelay(run, admin, "m", router="http://router", transport="broadcast")
    relay.policy = 1
    relay.members.start_with([{"url": "http://a", "node": 0}, {"url": "http://b", "node": 1}], 1)
    for node, url in enumerate(("http://a", "http://b")):
        atomic_write_json(run.inference_endpoint(node), {"url": url, "node": node, "policy_step": 1})
    atomic_write_json(run.server_heartbeat("inference_1"), {"pid": 4242, "slurm_step": "7.1"})
    write_marker(run, 2)
    admin.policies["http://a"] = 2

    async def go() -> None:
        await asyncio.wait_for(relay.update(2), 5)
        await asyncio.gather(*relay.members.tasks)

    asyncio.run(go())
    assert relay.policy == 2 and admin.live == ["http://a"]
    request = json.loads(run.restart_request("inference_1").read_text())
    assert (request["slot"], request["pid"], request["slurm_step"]) == ("inference_1", 4242, "7.1")
    assert request["reason"].startswith("left out by the orchestrator: policy 2 did not reach it"), request
    assert "gives no policy" in request["reason"], request


def test_a_joining_server_is_routed_only_once_the_trainer_sent_it_the_current_policy(tmp_path, monkeypatch):
    from prime_hpc.orchestrator import fleet as fleet_mod
    from prime_hpc.orchestrator.relay import WeightRelay
    from prime_hpc.rundir.fleet import read_membership
    from prime_hpc.trainer.model import write_marker

    added: list = []

    async def add_worker(router, url):
        added.append(url)

    monkeypatch.setattr(fleet_mod, "add_worker", add_worker)
    monkeypatch.setattr(fleet_mod, "JOIN_TIMEOUT_S", 0.2)
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m)), level="WARNING")
    run = RunDir(tmp_path)
    admin = FakeAdmin({"http://a": 3, "http://new": 0})
    admin.servers = ["http://a"]
    relay = WeightRelay(run, admin, "m", router="http://router", transport="broadcast")
    relay.policy = 3
    relay.members.start_with([{"url": "http://a", "node": 0}], 3)
    atomic_write_json(run.inference_endpoint(1), {"url": "http://new", "node": 1, "policy_step": 0})

    async def go() -> None:
        for _ in range(3):  # restarted with the base model: it waits for the trainer's send
            await relay.members.poll(force=True)
            assert read_membership(run)["inference_1"]["state"] == "loading weights"
            await asyncio.sleep(0.15)
        assert added == [] and "http://new" not in admin.live
        write_marker(run, 4)
        admin.policies["http://new"] = 4  # the trainer sent it its newest policy
        await relay.members.poll(force=True)

    try:
        asyncio.run(go())
    finally:
        logger.remove(sink)
    assert added == ["http://new"] and "http://new" in admin.live
    member = read_membership(run)["inference_1"]
    assert (member["state"], member["policy_step"]) == ("serving", 4)
    assert sum("has not got the current policy" in line for line in lines) == 1, lines
    assert admin.loads == []  # nothing was loaded from disk: policy 3 has no weights there


def test_after_a_resume_a_server_serving_a_discarded_policy_loads_the_current_one_from_disk(tmp_path, monkeypatch):
    """A server of another job outlives a requeue serving policy 9 of the discarded future
    (its marker cleared by the resume): it is not routed as if it had policy 9 or 3, but
    loads the resumed policy 3 from its checkpointed weights first; a server at a later
    policy this run did make is routed as it is."""
    from prime_hpc.orchestrator import fleet as fleet_mod
    from prime_hpc.orchestrator.relay import WeightRelay
    from prime_hpc.rundir.fleet import read_membership
    from prime_hpc.trainer.model import write_marker

    async def add_worker(router, url):
        pass

    monkeypatch.setattr(fleet_mod, "add_worker", add_worker)
    run = RunDir(tmp_path)
    _full(run, 3)
    write_marker(run, 4)
    admin = FakeAdmin({"http://a": 3, "http://old": 9, "http://ahead": 4})
    admin.servers = ["http://a"]
    relay = WeightRelay(run, admin, "m", router="http://router", transport="broadcast")
    relay.policy = 3
    relay.members.start_with([{"url": "http://a", "node": 0}], 3)
    atomic_write_json(run.inference_endpoint(1), {"url": "http://old", "node": 1, "policy_step": 9})
    atomic_write_json(run.inference_endpoint(2), {"url": "http://ahead", "node": 2, "policy_step": 4})
    asyncio.run(relay.members.poll(force=True))
    assert admin.loads == [(str(run.weights_step(3)), 3, ["http://old"])]
    members = read_membership(run)
    assert (members["inference_1"]["state"], members["inference_1"]["policy_step"]) == ("serving", 3)
    assert (members["inference_2"]["state"], members["inference_2"]["policy_step"]) == ("serving", 4)


def test_a_tied_model_on_cpu_is_refused_broadcast_up_front():
    """CPU vLLM refuses in-place updates of tied embeddings: the trainer says so in one line
    at its start instead of sending policies every server refuses. GPU servers take them."""
    from types import SimpleNamespace

    from prime_hpc.trainer.publish import refusal

    tied, untied = SimpleNamespace(tie_word_embeddings=True), SimpleNamespace(tie_word_embeddings=False)
    why = refusal("broadcast", "cpu", tied)
    assert why is not None and "tie_word_embeddings=false" in why and "\n" not in why
    assert refusal("broadcast", "cpu", untied) is None
    assert refusal("broadcast", "cuda", tied) is None
    assert refusal("filesystem", "cuda", tied) is None
    assert refusal("filesystem", "cpu", tied) is None  # the servers refuse it themselves (409, the relay stops)


class Routes:
    """An ASGI app answering each request with `handle(method, path, body, auth)` ->
    (status, JSON object), run in a thread (a route may wait on a weight group)."""

    def __init__(self, handle) -> None:
        self.handle = handle

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        raw = await request_body(receive)
        auth = dict(scope["headers"]).get(b"authorization", b"").decode()
        status, answer = await asyncio.to_thread(
            self.handle, scope["method"], scope["path"], json.loads(raw) if raw else {}, auth
        )
        data = json.dumps(answer).encode()
        await send(
            {"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]}
        )
        await send({"type": "http.response.body", "body": data})


class FakeGpuServer:
    """A GPU server's routes as the NCCL sender meets them (vLLM's NCCL engine behind them
    needs a GPU), behind the inference server's own gate with the job's key (`KEY`): `/policy`
    names its workers; `/weights/join` answers once the sender's end of the group is open
    (NCCL's unique-id rendezvous has every rank enter at once); `/weights/receive` once every
    announced tensor was broadcast. `record`: the endpoint it publishes."""

    def __init__(self, workers: int, dtype=None) -> None:
        self.workers, self.dtype, self.bodies, self.comms = workers, dtype, [], []
        self.opened = threading.Event()
        self.http = Served(Routes(self.handle), gated=True)
        self.url, self.record = self.http.url, self.http.endpoint()

    def handle(self, method: str, path: str, body: dict, auth: str) -> tuple[int, dict]:
        if method == "GET":
            return 200, {"workers": self.workers, "dtype": self.dtype, "policy_step": 0}
        self.bodies.append((path, body, auth))
        if path == "/weights/join":
            assert self.opened.wait(10), "the sender did not open its end while the server joined"
        elif path == "/weights/receive":
            comm = self.comms[-1]
            deadline = time.monotonic() + 10
            while len(comm.sent) < len(body["names"]) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(comm.sent) == len(body["names"]), "the tensors did not come while the server received"
        return 200, {"status": "ok", "policy_step": body.get("step")}

    def communicator(self, uid: bytes, rank: int, world_size: int, device) -> "FakeComm":
        comm = FakeComm(uid, rank, world_size, device)
        self.comms.append(comm)
        self.opened.set()
        return comm

    def close(self) -> None:
        self.http.stop()


class FakeComm:
    def __init__(self, uid: bytes, rank: int, world_size: int, device) -> None:
        self.uid, self.rank, self.world_size, self.device = uid, rank, world_size, device
        self.sent: list = []
        self.destroyed = False

    def broadcast(self, tensor, src: int, stream=None) -> None:
        assert src == 0 and tensor.device == self.device
        self.sent.append(tensor.clone())

    def destroy(self) -> None:
        self.destroyed = True


def test_the_nccl_sender_hands_its_unique_id_through_the_keyed_join_and_sends_in_the_announced_order(monkeypatch):
    """The trainer's side of broadcast to GPU servers (what runs there, but for the GPU:
    NCCL's communicator is replaced, and the device is the CPU): the join's body carries
    the minted unique id and the workers' place, signed for the server's instance once it
    proved it holds the key as its endpoint says (the key itself never sent), while this
    side opens its end as rank 0 of 1 + workers; a send announces the tensors and broadcasts
    each, in that order, from this side's device; close leaves the group and destroys the
    communicator. `broadcaster_for` picks it for cuda, gloo's for cpu."""
    from prime_hpc.inference.broadcast import Broadcaster, NcclBroadcaster, announcement, broadcaster_for

    monkeypatch.setenv("INFERENCE_SERVER_API_KEY", KEY)
    server = FakeGpuServer(workers=2)
    uid = bytes(range(128))
    try:
        sender = NcclBroadcaster(server.url, device="cpu", communicator=server.communicator, mint=lambda: uid)
        sender.expect(server.record)
        sender.join()
        path, body, auth = server.bodies[-1]
        assert path == "/weights/join" and auth.startswith(f"{SIGNATURE_SCHEME} ") and KEY not in auth
        assert sender.instance == server.record["instance"]
        assert body == {"nccl_unique_id_b64": base64.b64encode(uid).decode(), "world_size": 3, "rank_offset": 1}
        comm = server.comms[-1]
        assert (comm.uid, comm.rank, comm.world_size) == (uid, 0, 3)

        named = [("model.embed_tokens.weight", torch.randn(5, 4)), ("lm_head.weight", torch.randn(5, 4).bfloat16())]
        answer = sender.send(7, named)
        path, body, _ = server.bodies[-1]
        assert path == "/weights/receive" and body == {"step": 7, **announcement(named)}
        assert [t.dtype for t in comm.sent] == [torch.float32, torch.bfloat16]
        assert all(torch.equal(a, b) for a, b in zip(comm.sent, [t for _, t in named]))
        assert answer["bytes"] == 5 * 4 * 4 + 5 * 4 * 2 and answer["policy_step"] == 7

        sender.close()
        assert server.bodies[-1][0] == "/weights/leave" and comm.destroyed
    finally:
        server.close()
    assert isinstance(broadcaster_for("cuda", torch.device("cuda", 0))("http://127.0.0.1:1"), NcclBroadcaster)
    assert type(broadcaster_for("cpu")("http://127.0.0.1:1")) is Broadcaster


def test_a_policy_goes_in_the_dtype_the_server_holds_its_weights_in(monkeypatch):
    """A float32 policy to a server that holds bfloat16 weights (its `/policy` says so) is
    announced and sent as bfloat16: half the bytes, rounded as the server's own load would
    round it; integer tensors go as they are."""
    from prime_hpc.inference.broadcast import NcclBroadcaster

    monkeypatch.setenv("INFERENCE_SERVER_API_KEY", KEY)
    server = FakeGpuServer(workers=1, dtype="bfloat16")
    try:
        sender = NcclBroadcaster(server.url, device="cpu", communicator=server.communicator, mint=lambda: bytes(128))
        sender.join()
        weight, ids = torch.randn(4, 8), torch.arange(6)
        answer = sender.send(2, [("w", weight), ("position_ids", ids)])
        body = server.bodies[-1][1]
        assert body["dtype_names"] == ["bfloat16", "int64"] and body["shapes"] == [[4, 8], [6]]
        sent = server.comms[-1].sent
        assert sent[0].dtype == torch.bfloat16 and torch.equal(sent[0], weight.to(torch.bfloat16))
        assert torch.equal(sent[1], ids) and answer["bytes"] == 4 * 8 * 2 + 6 * 8
    finally:
        server.close()
    wide = FakeGpuServer(workers=1, dtype="float32")  # never wider: a bfloat16 policy goes as it is
    try:
        sender = NcclBroadcaster(wide.url, device="cpu", communicator=wide.communicator, mint=lambda: bytes(128))
        sender.join()
        sender.send(3, [("w", torch.randn(2, 2).bfloat16())])
        assert wide.bodies[-1][1]["dtype_names"] == ["bfloat16"] and wide.comms[-1].sent[0].dtype == torch.bfloat16
    finally:
        wide.close()


def test_an_nccl_send_that_fails_midway_aborts_its_communicator(monkeypatch):
    """A server that dies mid-send would leave this side's ncclBroadcast spinning on the GPU:
    the communicator is aborted (destroyed), and the sender must join again."""
    from prime_hpc.inference.broadcast import BroadcastError, NcclBroadcaster

    monkeypatch.setenv("INFERENCE_SERVER_API_KEY", KEY)
    server = FakeGpuServer(workers=1)
    try:
        sender = NcclBroadcaster(server.url, device="cpu", communicator=server.communicator, mint=lambda: bytes(128))
        sender.join()
        comm = server.comms[-1]
        with pytest.raises(BroadcastError):  # announced one tensor, sends two: fails midway
            sender.send(
                1,
                [("a", torch.ones(2)), ("b", torch.ones(2))],
                {"names": ["a"], "dtype_names": ["float32"], "shapes": [[2]]},
            )
        deadline = time.monotonic() + 5
        while not comm.destroyed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert comm.destroyed and sender.group is None
        with pytest.raises(BroadcastError, match="join first"):
            sender.send(2, [("a", torch.ones(2))])
    finally:
        server.close()


def test_weights_are_written_cast_a_chunk_at_a_time_and_read_back_by_safetensors(tmp_path):
    """The published `model.safetensors` (`trainer.safetensors_writer`): float tensors in the served
    dtype, other tensors as they are, metadata kept, whatever the chunking."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from prime_hpc.trainer import safetensors_writer

    g = torch.Generator().manual_seed(0)
    tensors = {
        "model.embed_tokens.weight": torch.randn(97, 33, generator=g),  # spans many chunks
        "model.norm.weight": torch.randn(33, generator=g),
        "transposed": torch.randn(8, 5, generator=g).t(),  # not contiguous
        "empty": torch.zeros(0, 4),
        "positions": torch.arange(7),  # int64: not cast
        "already_bf16": torch.randn(3, 3, generator=g).to(torch.bfloat16),
    }
    for chunk in (64, 1000, safetensors_writer.CHUNK_BYTES):
        path = tmp_path / f"model-{chunk}.safetensors"
        size = safetensors_writer.write(
            path, tensors, dtype=torch.bfloat16, metadata={"format": "pt"}, chunk_bytes=chunk
        )
        assert size == path.stat().st_size
        back = load_file(str(path))
        assert list(back) == list(tensors)  # in the order given
        for name, t in tensors.items():
            want = t.to(torch.bfloat16) if t.is_floating_point() else t
            assert back[name].dtype == want.dtype and torch.equal(back[name], want), name
        with safe_open(str(path), "pt") as f:
            assert f.metadata() == {"format": "pt"}
    kept = tmp_path / "float32.safetensors"
    safetensors_writer.write(kept, tensors)  # no dtype: every tensor as it is
    assert all(torch.equal(load_file(str(kept))[k], t) for k, t in tensors.items())
    with pytest.raises(ValueError, match="complex"):
        safetensors_writer.write(tmp_path / "bad.safetensors", {"z": torch.zeros(2, dtype=torch.complex64)})
    assert not (tmp_path / "bad.safetensors").exists()


def test_a_server_whose_workers_never_join_fails_the_join_in_one_line_instead_of_holding_the_trainer(monkeypatch):
    """NCCL's communicator waits for its peers without a timeout of its own: a server that
    answers its join but whose workers never open their end would hold the trainer's
    sender for ever. The join gives up after the group's timeout (plus the margin a route's
    answer may take), naming the server and what did not come; the sender can join again."""
    from prime_hpc.inference.broadcast import BroadcastError, NcclBroadcaster

    monkeypatch.setenv("INFERENCE_SERVER_API_KEY", KEY)
    server = FakeGpuServer(workers=1)
    released = threading.Event()

    def never_opens(uid, rank, world_size, device):
        server.opened.set()  # the server's route answers; the peers never come
        released.wait(60)
        raise RuntimeError("released")

    try:
        sender = NcclBroadcaster(
            server.url, device="cpu", communicator=never_opens, mint=lambda: bytes(128), timeout_s=0.5
        )
        sender.margin_s = 0.5
        t0 = time.monotonic()
        with pytest.raises(BroadcastError) as e:
            sender.join()
        assert time.monotonic() - t0 < 10
        assert (
            str(e.value)
            == f"{server.url}: joining its weight group: the weight group's exchange did not come within 1 s"
        )
        assert sender.group is None
        released.set()
        sender.communicator = server.communicator
        sender.join()  # a later join works
        assert sender.group is server.comms[-1]
    finally:
        released.set()
        server.close()


# ----------------------------------------------------------------------------- one host, digests
class FakeCpuServer:
    """A CPU server's routes as the gloo sender meets them on one host, behind the inference
    server's own gate with the job's key (`KEY`), its one worker played by a thread of this
    process (vLLM's engine is the integration tests'): `/weights/join` is checked as the
    server checks it (`join_info`, the run's rendezvous directory) and joins the sender's
    file store as rank 1; `/weights/receive` (checked by `receive_info`) receives each
    announced tensor and records it with the body. `port`: listen there; `record`: the
    endpoint it publishes."""

    def __init__(self, run: RunDir, port: int = 0) -> None:
        self.run, self.bodies, self.received, self.group = run, [], [], None
        self.http = Served(Routes(self.handle), port=port, gated=True)
        self.url, self.port = self.http.url, self.http.port

    def endpoint(self, node: int = 0) -> dict:
        return self.http.endpoint(node)

    def handle(self, method: str, path: str, body: dict, auth: str) -> tuple[int, dict]:
        from torch.distributed import BroadcastOptions

        from prime_hpc.inference import server as srv

        if method == "GET":
            return 200, {"workers": 1, "dtype": "float32", "policy_step": 0}
        self.bodies.append((path, body))
        if path == "/weights/join":
            info, why = srv.join_info(body, 1, "gloo", self.run.rendezvous_dir)
            if why:
                return 400, {"error": why}
            self.group = _file_peer(info["store_path"], info["world_size"])
        elif path == "/weights/receive":
            step, info, why = srv.receive_info(body)
            assert why is None, why
            options = BroadcastOptions()
            options.rootRank = 0
            for shape, dtype in zip(info["shapes"], info["dtype_names"]):
                t = torch.empty(shape, dtype=getattr(torch, dtype))
                self.group.broadcast([t], options).wait()
                self.received.append(t)
        return 200, {"status": "ok", "policy_step": body.get("step")}

    def close(self) -> None:
        self.http.stop()


def _file_peer(path: str, world_size: int):
    """Rank 1 of a group meeting in the file store at `path` (as the workers join it)."""
    from datetime import timedelta

    from torch.distributed import FileStore, PrefixStore, ProcessGroupGloo

    from prime_hpc.inference.broadcast import file_store_prefix

    store = FileStore(path, world_size)
    options = ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=30)
    options._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return ProcessGroupGloo(PrefixStore(file_store_prefix(path), store), 1, world_size, options)


def test_on_one_host_a_weight_group_meets_in_a_private_file_store_and_each_tensor_carries_its_digest(
    tmp_path, monkeypatch
):
    """Sender and server on one host (a loopback address): the join names a fresh file
    store in the run's private `rendezvous/` (0700), not a port: no store of the group
    listens. The receive's body carries each tensor's SHA-256 as sent, which the bytes that
    arrive match; the store file goes with the group."""
    import os
    import stat

    from prime_hpc.inference.broadcast import Broadcaster, tensor_digest

    monkeypatch.setenv("INFERENCE_SERVER_API_KEY", KEY)
    run = RunDir(tmp_path)
    server = FakeCpuServer(run)
    sender = Broadcaster(
        server.url, host="127.0.0.1", store_dir=run.rendezvous_dir, timeout_s=30, record=server.endpoint()
    )
    try:
        sender.join()
        ((path, join),) = server.bodies
        store = Path(join["store_path"])
        assert path == "/weights/join" and "master_port" not in join and sender.port is None
        assert store.parent == run.rendezvous_dir and stat.S_IMODE(os.stat(store.parent).st_mode) == 0o700
        named = [("a.weight", torch.randn(3, 4)), ("b", torch.arange(5, dtype=torch.int64)), ("c", torch.ones(()))]
        assert sender.send(4, named)["policy_step"] == 4
        body = server.bodies[-1][1]
        assert body["digests"] == [tensor_digest(t) for _, t in named]
        assert [tensor_digest(t) for t in server.received] == body["digests"]
        assert all(torch.equal(a, b) for (_, a), b in zip(named, server.received))
    finally:
        sender.close(leave=False)
        server.close()
    assert not store.exists()


class Stranger:
    """Someone else's plain HTTP listener, holding no key, that answers every request as a
    server would (200, a server's fields) and records each whole: method, path, query,
    headers, body."""

    def __init__(self) -> None:
        self.heard: list[tuple[str, str, str, dict, bytes]] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        body = await request_body(receive)
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        self.heard.append((scope["method"], scope["path"], scope["query_string"].decode(), headers, body))
        data = json.dumps({"workers": 1, "dtype": "float32", "policy_step": 0, "status": "ok"}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": data})


def test_a_listener_on_a_dead_servers_port_gets_no_key_and_nothing_to_replay_and_the_others_get_the_weights(
    tmp_path,
):
    """Server b dies and, before its endpoint file is removed, someone else binds its freed
    port. The trainer's sender proves each server against the endpoint it published before
    sending it anything: the listener gets an identity challenge and nothing else (no key,
    no signed request it could replay to another server), is named lost in one line (not a
    failed update, and not asked again), and server a gets every policy over its group. A
    server of the run back at that address gets the policy once it published its endpoint
    (a new instance)."""
    from prime_hpc.core.net import LOOPBACK
    from prime_hpc.inference.broadcast import Broadcaster
    from prime_hpc.trainer.sender import WeightSender

    run = RunDir(tmp_path)
    a, b = FakeCpuServer(run), FakeCpuServer(run)
    for node, server in enumerate((a, b)):
        atomic_write_json(run.inference_endpoint(node), server.endpoint(node))
    b.close()  # dead; endpoints/inference_1.json still names it
    stranger_app = Stranger()
    stranger = Served(stranger_app, port=b.port)
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m)), level="INFO")

    def make(url: str) -> Broadcaster:
        return Broadcaster(url, host=LOOPBACK, key=KEY, store_dir=run.rendezvous_dir, timeout_s=30)

    sender = WeightSender(run, make=make, poll_s=0.05)
    back = None
    policy = [("a.weight", torch.randn(3, 4)), ("b", torch.arange(5))]
    try:
        sender.publish(3, dict(policy))
        _until(lambda: len(a.received) == 2 and stranger_app.heard, timeout_s=20)
        heard = list(stranger_app.heard)
        assert not any(KEY in json.dumps([query, headers]) for _, _, query, headers, _ in heard), heard
        assert {(method, path) for method, path, *_ in heard} == {("GET", "/identity")}, heard
        assert not any("authorization" in headers or body for *_, headers, body in heard), heard
        assert sender.wait(20)
        stats = sender.stats()
        assert (stats["step"], stats["servers"], stats["bytes"]) == (3, 1, 3 * 4 * 4 + 5 * 8)
        assert [p for p, _ in a.bodies] == ["/weights/join", "/weights/receive"]
        assert all(torch.equal(t, got) for (_, t), got in zip(policy, a.received))
        assert stranger_app.heard == heard
        said = [line for line in lines if "inference_1" in line]
        assert len(said) == 1 and "inference_1" in said[0] and " lost: " in said[0], lines
        assert "did not prove it holds the job's key" in said[0] and not any("left out" in line for line in lines)
        assert sender.links["inference_1"].failures == 0 and sender.behind() == []
        sender.publish(4, dict(policy))  # a alone; the listener is not asked again
        assert sender.wait(20) and sender.stats()["step"] == 4 and len(a.received) == 4
        assert len(stranger_app.heard) == len(heard)
        stranger.stop()
        back = FakeCpuServer(run, port=b.port)  # a server of the run back at b's address
        atomic_write_json(run.inference_endpoint(1), back.endpoint(1))  # publishes its endpoint
        _until(lambda: len(back.received) == 2, timeout_s=20)
        assert all(torch.equal(t, got) for (_, t), got in zip(policy, back.received))
        assert sender.wait(20) and len(sender.delivered[4]) == 2
    finally:
        sender.close()
        logger.remove(sink)
        stranger.stop()
        for server in (a, back):
            if server is not None:
                server.close()


def test_a_listener_that_took_a_proven_servers_port_gets_nothing_another_server_takes_and_is_not_believed():
    """Server a proved itself and joined its group, then died; someone else binds its port
    before anything noticed. The next send goes out signed for a's instance, never with the
    key: the listener's answer (200, but without a's proof) is not taken (`Lost`, not a
    policy served), and the signed request it got is refused by every other server it could
    be replayed to (401). (NCCL's sender, its communicator replaced: no collective is left
    under way in this process.)"""
    from prime_hpc.inference.broadcast import Lost, NcclBroadcaster

    a, c = FakeGpuServer(workers=1), FakeGpuServer(workers=1)
    sender = NcclBroadcaster(a.url, device="cpu", key=KEY, communicator=a.communicator, mint=lambda: bytes(128))
    sender.expect(a.record)
    stranger_app, stranger = Stranger(), None
    try:
        sender.join()
        a.close()  # dead, its group joined
        stranger = Served(stranger_app, port=a.http.port)
        with pytest.raises(Lost, match="answered without the proof of the server it was sent to"):
            sender.send(2, [("w", torch.ones(3))])
        assert sender.group is None
        ((method, path, query, headers, body),) = stranger_app.heard
        assert (method, path) == ("POST", "/weights/receive") and KEY not in json.dumps([query, headers])
        assert headers["authorization"].startswith(f"{SIGNATURE_SCHEME} ")
        kept = {k: v for k, v in headers.items() if k not in ("host", "content-length")}
        replayed = httpx.request(method, c.url + path, headers=kept, content=body, timeout=10)
        assert replayed.status_code == 401 and c.bodies == []
    finally:
        sender.close(leave=False)
        for server in (c, a):
            server.close()
        if stranger is not None:
            stranger.stop()


def test_a_weight_group_on_one_host_meets_nowhere_but_the_runs_private_directory(tmp_path, monkeypatch):
    """No private directory given, another user's `rendezvous/` planted in the run's
    directory, a store outside it or named otherwise: the sender opens no group, the
    server joins none, each in one line."""
    import os

    from prime_hpc.inference import server as srv
    from prime_hpc.inference.broadcast import Broadcaster, BroadcastError

    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    with pytest.raises(BroadcastError, match="a weight group meets in a file store of the run's private"):
        Broadcaster("http://s", workers=1, host="127.0.0.1")._rendezvous(2)
    good = {"store_path": str(run.rendezvous_dir / "weights_0123abcd.store"), "world_size": 2, "rank_offset": 1}
    info, why = srv.join_info(good, 1, "gloo", run.rendezvous_dir)
    assert why is None and info["store_path"] == good["store_path"]
    for bad, problem in [
        ({**good, "store_path": str(tmp_path / "weights_0123abcd.store")}, "must be a weight group's store"),
        ({**good, "store_path": str(run.rendezvous_dir / "trainer_rendezvous.store")}, "must be a weight group's"),
        ({**good, "master_address": "127.0.0.1", "master_port": 29500}, "not both"),
    ]:
        info, why = srv.join_info(bad, 1, "gloo", run.rendezvous_dir)
        assert why is not None and problem in why and "\n" not in why, (bad, why)
    os.rmdir(run.rendezvous_dir)
    run.rendezvous_dir.mkdir(mode=0o777)
    os.chown(run.rendezvous_dir, 65534, 65534)  # someone else's, made before the run's
    info, why = srv.join_info(good, 1, "gloo", run.rendezvous_dir)
    assert why == f"the weight group's store: {run.rendezvous_dir} belongs to nobody, not to you", why
    with pytest.raises(BroadcastError) as e:
        Broadcaster("http://s", workers=1, host="127.0.0.1", store_dir=run.rendezvous_dir)._rendezvous(2)
    assert str(e.value) == f"http://s: the weight group's store: {run.rendezvous_dir} belongs to nobody, not to you"


def test_digests_are_of_the_bytes_as_sent():
    """A tensor's digest is SHA-256 of its bytes as they go to the server: one flipped
    element changes it; a float32 policy sent narrowed to a bfloat16 server is digested
    narrowed; empty and 0-d tensors too."""
    import hashlib

    from prime_hpc.inference.broadcast import Broadcaster, tensor_digest

    t = torch.randn(4, 5)
    assert tensor_digest(t) == hashlib.sha256(t.numpy().tobytes()).hexdigest()
    flipped = t.clone()
    flipped[2, 3] = -flipped[2, 3]
    assert tensor_digest(flipped) != tensor_digest(t)
    assert tensor_digest(t.t()) == tensor_digest(t.t().contiguous())  # the bytes as sent (contiguous)
    assert tensor_digest(torch.empty(0)) == hashlib.sha256(b"").hexdigest()
    assert len(tensor_digest(torch.ones((), dtype=torch.bfloat16))) == 64
    sender = Broadcaster("http://s", workers=1, host="127.0.0.1")
    sender.dtype = "bfloat16"
    named = [("w", t), ("i", torch.arange(3))]
    assert sender.digests(named) == [tensor_digest(t.to(torch.bfloat16)), tensor_digest(torch.arange(3))]
