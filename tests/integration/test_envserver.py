"""Env servers (`prime_hpc.envserver`): the reverse_text env in a server of its own with
real worker processes, generating against the session's real vLLM servers and router
(tiny model): a group comes back as the rollouts in-process generation gives; the key is
demanded; a worker killed with SIGKILL is restarted and the next group succeeds; a worker
killed while its group is in flight makes that group come back errored (the run goes on) and
the next one succeeds; past the restarts, or with the server gone, the next group fails in
one line naming the env and its log. (A run that trains from an env server:
test_slurm_multiturn.)"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from prime_hpc.config.schema import EnvEntry, OrchestratorConfig, SamplingConfig
from prime_hpc.envserver.server import MAX_RESTARTS
from prime_hpc.orchestrator.envs import EnvFailed, load_slots
from prime_hpc.orchestrator.envservers import EnvServerProcess, RemoteGenerator, client_spec, server_log
from prime_hpc.orchestrator.rollouts import group_error
from prime_hpc.rundir import RunDir, logtree

REPO = Path(__file__).resolve().parents[2]
REVERSE_TEXT = str(REPO / "examples" / "reverse_text")
SEQ_LEN = 512


@pytest.fixture
def keyed(inference, monkeypatch):
    monkeypatch.setenv("INFERENCE_SERVER_API_KEY", inference.key)
    return inference


def _start(inference, root: Path, workers: int) -> tuple[EnvServerProcess, Path]:
    logs = root / "logs"
    entry = EnvEntry(id=REVERSE_TEXT, workers=workers)
    spec = client_spec(inference.endpoints.openai_base_url, SEQ_LEN, 60.0)
    return EnvServerProcess.start(entry, "train", RunDir(root), logs, spec, timeout_s=120), logs


def _generator(inference, server: EnvServerProcess, max_tokens: int = 8, min_tokens: int = 2):
    sampling = SamplingConfig(max_tokens=max_tokens, extra_body={"min_tokens": min_tokens})
    ocfg = OrchestratorConfig(group_size=4, sampling=sampling)
    gen = RemoteGenerator(ocfg, SEQ_LEN, None, lambda: "tiny")
    (slot,) = load_slots([EnvEntry(id=REVERSE_TEXT, workers=1)], "train")
    slot.server = server
    return gen, slot


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _worker_pids(log: Path) -> list[int]:
    return [int(p) for p in re.findall(r"worker \d+ started \(pid (\d+)\)", log.read_text())]


def _wait_for(cond, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s:.0f} s for {what}")
        time.sleep(0.05)


def _ready_count(log: Path) -> int:
    return log.read_text().count(" ready")


@pytest.mark.vllm
def test_a_group_comes_back_from_the_env_servers_workers(keyed, tmp_path):
    server, logs = _start(keyed, tmp_path / "run", workers=2)
    try:
        assert server.endpoint.stat().st_mode & 0o077 == 0
        assert server.me["url"].startswith("http://127.0.0.1:")
        info = asyncio.run(server.info())
        assert info["env"] == "reverse_text" and info["kind"] == "classic" and info["rows"] == len(info["example_ids"])
        gen, slot = _generator(keyed, server)

        async def two_groups():
            return await asyncio.gather(gen.group(slot, slot.rows[0]), gen.group(slot, slot.rows[1], n=2))

        first, second = asyncio.run(two_groups())
        assert len(first) == 4 and len(second) == 2
        for r in first + second:
            assert r.error is None and r.env == "reverse_text" and r.num_turns == 1
            assert len(r.input_ids) == len(r.loss_mask) == len(r.logprobs) and any(r.loss_mask)
            assert r.policy_steps == [0] and r.generated is not None and r.generated[0] <= r.generated[1]
        assert first[0].example_id == slot.rows[0]["example_id"]
        assert {r.example_id for r in second} == {slot.rows[1]["example_id"]}
        # every route but liveness demands the job's key: 401 without it, or with another
        for headers in ({}, {"authorization": "Bearer not-the-key"}):
            assert httpx.post(server.me["url"] + "/group", json={"index": 0}, headers=headers).status_code == 401
            assert httpx.get(server.me["url"] + "/info", headers=headers).status_code == 401
        ok = httpx.get(server.me["url"] + "/info", headers={"authorization": f"Bearer {keyed.key}"})
        assert ok.status_code == 200
        for name in ("env_server.log", "env_worker_0.log", "env_worker_1.log"):
            assert (logtree.env_log_dir(logs, "train", "reverse_text") / name).exists(), name
        pids = _worker_pids(server.log)
        assert len(pids) == 2 and all(_alive(p) for p in pids)
    finally:
        server.close()
    # the orchestrator gone (its pipe closed): the server and its workers are ended
    assert server.proc.returncode is not None
    _wait_for(lambda: not any(_alive(p) for p in pids), "the workers to end")
    assert not server.endpoint.exists()


@pytest.mark.vllm
def test_a_killed_worker_is_restarted_and_past_the_bound_the_env_fails_the_run(keyed, tmp_path):
    server, logs = _start(keyed, tmp_path / "run", workers=1)
    try:
        gen, slot = _generator(keyed, server)
        _wait_for(lambda: _ready_count(server.log) == 1, "the worker to be ready")
        for kill in range(1, MAX_RESTARTS + 1):
            os.kill(_worker_pids(server.log)[-1], signal.SIGKILL)
            _wait_for(lambda k=kill: _ready_count(server.log) == k + 1, f"restart {kill}")
            assert f"restarting it ({kill} of {MAX_RESTARTS} restarts)" in server.log.read_text()
            group = asyncio.run(gen.group(slot, slot.rows[kill]))  # by the restarted worker: the only one
            assert [r.error for r in group] == [None] * 4
        os.kill(_worker_pids(server.log)[-1], signal.SIGKILL)
        _wait_for(lambda: "no more restarts" in server.log.read_text(), "the server to give up")
        with pytest.raises(EnvFailed) as failed:
            asyncio.run(gen.group(slot, slot.rows[0]))
        message = str(failed.value)
        assert "\n" not in message and "train env reverse_text" in message
        assert str(server_log(logs, "train", "reverse_text")) in message and failed.value.log == server.log
    finally:
        server.close()


@pytest.mark.vllm
def test_a_worker_killed_mid_group_errors_that_group_and_the_next_one_succeeds(keyed, tmp_path):
    """The server answers 502 for the group its worker was running when it died, and the
    generator turns that into an errored group (nothing of it trains) instead of failing
    the run; the worker is restarted and the next group comes back whole."""
    server, _ = _start(keyed, tmp_path / "run", workers=1)
    try:
        # many at once, as long as the context allows (80 tokens, 28 after row 0's prompt): in flight when killed
        gen, slot = _generator(keyed, server, max_tokens=28, min_tokens=28)
        _wait_for(lambda: _ready_count(server.log) == 1, "the worker to be ready")
        (pid,) = _worker_pids(server.log)
        admin = keyed.admin()

        async def killed_mid_group():
            group = asyncio.create_task(gen.group(slot, slot.rows[0], n=32))
            deadline = time.monotonic() + 60
            while not sum(p["in_flight"] for p in await admin.policies()):
                assert not group.done(), f"the group ended before it was seen in flight: {group.result()}"
                assert time.monotonic() < deadline, "no request of the group reached the policy in 60 s"
                await asyncio.sleep(0.01)
            os.kill(pid, signal.SIGKILL)
            return await group

        errored = asyncio.run(killed_mid_group())
        died = f"WorkerDied: worker 0 (pid {pid}) died (exit -9; see "
        assert len(errored) == 32 and all(r.error is not None and r.error.startswith(died) for r in errored)
        assert group_error(errored) == errored[0].error  # the whole group errored: nothing of it trains
        assert not any(r.input_ids or r.loss_mask for r in errored)
        assert {r.example_id for r in errored} == {slot.rows[0]["example_id"]}
        _wait_for(lambda: _ready_count(server.log) == 2, "the worker's restart")
        assert f"restarting it (1 of {MAX_RESTARTS} restarts)" in server.log.read_text()
        assert not _alive(pid) and _worker_pids(server.log)[-1] != pid
        gen, slot = _generator(keyed, server)
        group = asyncio.run(gen.group(slot, slot.rows[1]))  # by the restarted worker
        assert [r.error for r in group] == [None] * 4 and all(any(r.loss_mask) for r in group)
        assert asyncio.run(server.info())["restarts"] == 1
    finally:
        server.close()


@pytest.mark.vllm
def test_a_dead_env_server_fails_the_next_group_naming_its_log(keyed, tmp_path):
    server, _ = _start(keyed, tmp_path / "run", workers=1)
    try:
        gen, slot = _generator(keyed, server)
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(timeout=10)
        with pytest.raises(
            EnvFailed, match=r"train env reverse_text: its env server died \(exit -9\); see .*env_server\.log"
        ):
            asyncio.run(gen.group(slot, slot.rows[0]))
    finally:
        server.close()
    # its worker sees its stdin close and leaves
    _wait_for(lambda: not any(_alive(p) for p in _worker_pids(server.log)), "the orphaned worker to end")


def test_a_v1_worker_without_its_wheelhouse_fails_the_start_in_one_line_and_is_not_retried(tmp_path, monkeypatch):
    """A compute node has no index: a v1 task set's worker that finds no wheelhouse for the
    chat harness exits before loading anything (it would fetch from an index otherwise),
    the server does not restart it, and the run's start fails naming the directory and the
    server's log. (No model call is made: no inference server is needed.)"""
    from prime_hpc.config.env_kinds import envs_python

    monkeypatch.setenv("INFERENCE_SERVER_API_KEY", "k" * 32)
    monkeypatch.setenv("PRIME_HPC_WHEELHOUSE", str(tmp_path / "no-wheelhouse"))
    python = envs_python()
    assert python, "tools/setup builds .venv-envs"
    spec = client_spec("http://127.0.0.1:9/v1", SEQ_LEN, 60.0)
    with pytest.raises(EnvFailed) as e:
        EnvServerProcess.start(
            EnvEntry(id="reverse_text_v1"),
            "train",
            RunDir(tmp_path),
            tmp_path / "logs",
            spec,
            timeout_s=120,
            env_kind="v1",
            python=python,
            tokenizer=str(tmp_path),
        )
    line = str(e.value)
    assert len(line.splitlines()) == 1 and f"no wheelhouse at {tmp_path / 'no-wheelhouse'}" in line, line
    assert str(server_log(tmp_path / "logs", "train", "reverse_text_v1")) in line, line
    served = server_log(tmp_path / "logs", "train", "reverse_text_v1").read_text()
    assert served.count("started (pid") == 1 and "restarting" not in served, served


def test_a_classic_env_under_a_python_of_its_own_is_served_from_there(tmp_path, monkeypatch):
    """`env[i].python` for a classic env: its server's worker runs under that interpreter
    with only prime-hpc's own package put on its path, loads the env itself and hands the
    orchestrator its rows (the orchestrator never imports it). No model call is made."""
    import sys

    monkeypatch.setenv("INFERENCE_SERVER_API_KEY", "k" * 32)
    spec = client_spec("http://127.0.0.1:9/v1", SEQ_LEN, 60.0)
    entry = EnvEntry(id=REVERSE_TEXT, python=sys.executable, args={"num_eval_examples": 5})
    server = EnvServerProcess.start(
        entry, "eval", RunDir(tmp_path), tmp_path / "logs", spec, num_examples=3, python=sys.executable, timeout_s=120
    )
    try:
        info = asyncio.run(server.info())
        rows = asyncio.run(server.rows())
    finally:
        server.close()
    assert (info["kind"], info["rows"], info["workers"]) == ("classic", 3, 1)
    assert [r["example_id"] for r in rows] == [0, 1, 2] and all(r["answer"] == r["question"][::-1] for r in rows)
    worker_log = (tmp_path / "logs" / "envs" / "eval" / "reverse_text" / "env_worker_0.log").read_text()
    assert "Traceback" not in worker_log, worker_log


@pytest.mark.vllm
def test_a_stall_while_a_hung_worker_holds_a_group_names_the_env_server_and_its_log(keyed, tmp_path):
    """A worker stopped mid-run (SIGSTOP: a reward or tool that never returns) keeps its
    group out: the orchestrator's heartbeat says which server holds it and since when
    (`waited`), and past the stall timeout the watchdog's one line names that env server and
    its log, not the orchestrator's."""
    from prime_hpc.job.watchdog import component_stall, stalled

    server, logs = _start(keyed, tmp_path / "run", workers=1)
    (pid,) = _worker_pids(server.log)
    try:
        gen, slot = _generator(keyed, server)
        assert server.waited() is None
        os.kill(pid, signal.SIGSTOP)

        async def stuck() -> dict:
            task = asyncio.create_task(gen.group(slot, slot.rows[0]))
            await asyncio.sleep(1.0)
            out = server.waited()
            os.kill(pid, signal.SIGCONT)  # it goes on: the group comes back
            assert all(r.error is None for r in await task)
            return out

        sent = time.time()
        wait = asyncio.run(stuck())
        assert wait is not None and (wait["env"], wait["kind"], wait["groups"]) == ("reverse_text", "train", 1)
        assert sent <= wait["since"] <= sent + 1 and wait["log"] == str(server.log)
        assert server.waited() is None  # answered
        now = wait["since"] + 90
        beat = {"time": now - 1, "progress_at": now - 120, "waiting_on": "inference", "step": 3, "env_waits": [wait]}
        s = stalled({"orchestrator_0": beat}, 60, now)
        record = component_stall(s, logs, 60, 1)
        assert record["log"] == str(server.log) and record["component"] == "orchestrator", record
        assert record["reason"].startswith(
            "stalled: waiting on its train env server reverse_text: 1 group(s) out, the oldest for 90s"
            " (watchdog.stall_timeout_s=60) at step 3"
        ), record
        # out for less than the timeout: the orchestrator's own stall (groups come back, none is kept)
        beat["env_waits"] = [{**wait, "since": now - 5}]
        record = component_stall(stalled({"orchestrator_0": beat}, 60, now), logs, 60, 1)
        assert record["log"].endswith("orchestrator.log") and "alive, but no progress for 120s" in record["reason"]
    finally:
        os.kill(pid, signal.SIGCONT)
        server.close()
