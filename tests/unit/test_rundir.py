"""The run-directory contract: atomic writes survive SIGKILL, STABLE markers, waits that
say what they waited for, attempts that never overwrite each other, fresh-dir rules."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from prime_hpc.rundir import (
    TMP_PREFIX,
    RunDir,
    WaitTimeout,
    atomic_write_bytes,
    is_stable,
    logtree,
    mark_stable,
    wait_file,
    wait_stable,
)

# A writer that rewrites a few files as fast as it can; each file carries its own length
# and checksum, so a reader can tell a partial file from a complete one.
WRITER = textwrap.dedent(
    """
    import hashlib, os, sys
    from prime_hpc.rundir import atomic_write_bytes
    out = sys.argv[1]
    i = 0
    while True:
        payload = os.urandom(4096 * (1 + i % 64))
        body = len(payload).to_bytes(8, "big") + hashlib.sha256(payload).digest() + payload
        atomic_write_bytes(os.path.join(out, f"rank_{i % 3}.bin"), body)
        i += 1
        if i == 5:
            print("ready", flush=True)
    """
)


def complete(data: bytes) -> bool:
    if len(data) < 40:
        return False
    n = int.from_bytes(data[:8], "big")
    payload = data[40:]
    return len(payload) == n and hashlib.sha256(payload).digest() == data[8:40]


def test_reader_never_sees_a_partial_file_when_writer_is_killed(tmp_path):
    out = tmp_path / "rollouts" / "step_0"
    out.mkdir(parents=True)
    rng = random.Random(0)
    seen = 0
    stop = threading.Event()
    bad: list[str] = []

    def reader() -> None:  # reads concurrently with the writers, the whole time
        nonlocal seen
        while not stop.is_set():
            for name in os.listdir(out):
                if name.startswith(TMP_PREFIX):
                    continue
                try:
                    data = (out / name).read_bytes()
                except FileNotFoundError:
                    continue
                seen += 1
                if not complete(data):
                    bad.append(name)

    t = threading.Thread(target=reader)
    t.start()
    try:
        for _ in range(40):
            proc = subprocess.Popen([sys.executable, "-c", WRITER, str(out)], stdout=subprocess.PIPE, text=True)
            assert proc.stdout.readline().strip() == "ready"
            # kill at a random point of a write
            threading.Event().wait(rng.uniform(0, 0.05))
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    finally:
        stop.set()
        t.join()
    assert not bad, f"reader saw partial files: {bad[:5]}"
    assert seen > 0
    for p in out.iterdir():  # what remains under a final name is complete; temp orphans are ignorable
        if not p.name.startswith(TMP_PREFIX):
            assert complete(p.read_bytes())


def test_stable_marker_and_wait(tmp_path):
    d = tmp_path / "weights" / "step_3"
    d.mkdir(parents=True)
    atomic_write_bytes(d / "model.safetensors", b"x")
    assert not is_stable(d)
    timer = threading.Timer(0.2, mark_stable, args=(d,))
    timer.start()
    assert wait_stable(d, timeout_s=10) == d
    assert is_stable(d)


def test_wait_timeout_names_artifact_producer_and_log_tail(tmp_path):
    log = tmp_path / "trainer.log"
    log.write_text("starting\nRuntimeError: CUDA out of memory\n")
    with pytest.raises(WaitTimeout) as e:
        wait_file(
            tmp_path / "rollouts" / "step_7" / "rank_0.pt", timeout_s=0.3, producer="orchestrator", producer_log=log
        )
    msg = str(e.value)
    assert "rollouts/step_7/rank_0.pt" in msg and "orchestrator" in msg and str(log) in msg
    assert "CUDA out of memory" in msg


def test_wait_gives_up_at_once_when_producer_is_dead(tmp_path):
    with pytest.raises(WaitTimeout) as e:
        wait_file(tmp_path / "never", timeout_s=3600, producer="trainer", alive=lambda: False)
    assert "producer exited" in str(e.value)


def test_attempts_get_their_own_log_tree(tmp_path):
    run = RunDir(tmp_path)
    k0, logs0 = run.new_attempt()
    (logs0 / "trainer.log").write_text("first attempt\n")
    k1, logs1 = run.new_attempt()
    assert (k0, k1) == (0, 1)
    assert (logs0 / "trainer.log").read_text() == "first attempt\n"
    assert run.latest_logs.resolve() == logs1.resolve()
    assert run.attempts() == [0, 1]


def test_paths_are_step_tagged(tmp_path):
    run = RunDir(tmp_path)
    assert run.rollout_file(5, 1).relative_to(run.root) == Path("rollouts/step_5/rank_1.pt")
    assert run.weights_step(5).relative_to(run.root) == Path("weights/step_5")
    assert run.checkpoint_part(5, "trainer").relative_to(run.root) == Path("checkpoints/step_5/trainer")
    assert run.inference_endpoint(1).relative_to(run.root) == Path("endpoints/inference_1.json")
    assert run.metrics("orchestrator").relative_to(run.root) == Path("metrics/orchestrator.jsonl")


@pytest.mark.parametrize(
    "component, node, path",
    [
        ("inference_3", None, "inference/node_3.log"),  # one server of the set
        ("router", None, "inference/router_0.log"),
        ("router_1", None, "inference/router_1.log"),
        ("trainer", 2, "trainer/node_2.log"),
        ("inference", 1, "inference/node_1.log"),
        ("trainer", None, "trainer.log"),  # node 0's, linked
        ("inference", None, "inference.log"),
        ("orchestrator", None, "orchestrator.log"),
        ("orchestrator", 0, "orchestrator.log"),
        ("watchdog", None, "watchdog.log"),
    ],
)
def test_the_log_of_a_component(tmp_path, component, node, path):
    assert logtree.log_of(tmp_path, component, node) == tmp_path / path


def test_checkpoint_part_steps_are_the_one_lookup(tmp_path):
    run = RunDir(tmp_path)
    for step, parts, marked in ((1, ("trainer", "orchestrator"), ("trainer",)), (2, ("trainer",), ("trainer",))):
        for part in parts:
            run.checkpoint_part(step, part).mkdir(parents=True)
            if part in marked:
                mark_stable(run.checkpoint_part(step, part))
    (run.checkpoints_dir / "step_x").mkdir()  # not a step
    assert run.checkpoint_part_steps(("trainer",), complete=False) == run.checkpoint_steps("trainer") == [1, 2]
    assert run.checkpoint_part_steps(("orchestrator",), complete=False) == [1]
    assert run.checkpoint_part_steps(("trainer", "orchestrator"), complete=False) == [1]
    assert run.checkpoint_part_steps(("trainer",), complete=True) == run.complete_checkpoint_steps(("trainer",))
    assert run.complete_checkpoint_steps() == [] and run.complete_checkpoint_steps(("trainer",)) == [1, 2]


def test_latest_checkpoint_needs_every_marker_and_clear_after(tmp_path):
    run = RunDir(tmp_path)
    for step in (2, 4, 6):
        for part in ("trainer", "orchestrator"):
            run.checkpoint_part(step, part).mkdir(parents=True)
            if not (step == 6 and part == "orchestrator"):  # step 6 is incomplete
                mark_stable(run.checkpoint_part(step, part))
        run.weights_step(step).mkdir(parents=True)
        run.rollout_step(step).mkdir(parents=True)
    run.sent_dir.mkdir()
    for step in (3, 5):  # policies sent by broadcast (weights.transport=broadcast)
        run.sent_step(step).write_text("{}")
    assert run.complete_checkpoint_steps() == [2, 4]
    assert run.latest_checkpoint_step() == 4
    run.clear_after(4)
    assert not run.weights_step(6).exists() and not run.rollout_step(6).exists()
    assert run.weights_step(4).exists()
    assert run.sent_steps() == [3]  # a resumed relay never waits for a policy of the lost future


def test_fresh_rules(tmp_path):
    run = RunDir(tmp_path / "r")
    assert run.is_fresh()
    run.configs_dir.mkdir(parents=True)
    (run.root / "config.yaml").write_text("x")
    assert run.is_fresh()  # a dry run leaves only launch files
    run.job_json.write_text("{}")
    assert not run.is_fresh()


# ----------------------------------------------------------------------------- job.json
@pytest.mark.parametrize(
    "text, why",
    [
        ('{"name": "r", "state": "RUNN', "cannot be read as a job record (JSONDecodeError"),  # cut short
        ("", "cannot be read as a job record (JSONDecodeError"),
        (b"\xff\xfe{}", "cannot be read as a job record (UnicodeDecodeError"),
        ('["RUNNING"]', "it holds list, not an object"),
        ('"RUNNING"', "it holds str, not an object"),
        ('{"attempts": {"0": {}}}', "its 'attempts' is dict, not list"),
        ('{"attempts": [3]}', "an entry of its 'attempts' is not an object"),
        ('{"extra_jobs": [{"nodes": 1}]}', "an entry of its 'extra_jobs' has no 'job_id'"),
        ('{"pipeline": ["x"]}', "its 'pipeline' is list, not dict"),
        ('{"pid": "123"}', "its 'pid' is str, not int"),
        ('{"submitted_at": true}', "its 'submitted_at' is bool, not int or float"),
    ],
)
def test_a_job_json_that_is_no_job_record_is_refused_in_one_line_naming_it(tmp_path, text, why):
    from prime_hpc.rundir import jobs

    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    (run.job_json.write_bytes if isinstance(text, bytes) else run.job_json.write_text)(text)
    with pytest.raises(jobs.BadJobFile) as e:
        jobs.read_job(run)
    assert str(e.value).startswith(f"{run.job_json}: ") and why in str(e.value), e.value
    assert len(str(e.value).splitlines()) == 1
    assert jobs.readable_job(run) == {}  # a scan over many runs goes on past it


def test_a_job_json_as_prime_hpc_writes_it_reads_back(tmp_path):
    from prime_hpc.rundir import jobs

    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    assert jobs.read_job(run) == {}  # none yet
    jobs.update_job(run, name="r", state="RUNNING", job_ids=["1"], pipeline=None, pid=12, pid_start="99")
    jobs.add_extra_job(run, {"job_id": "2", "nodes": 1})
    assert jobs.read_job(run)["extra_jobs"] == [{"job_id": "2", "nodes": 1}]
