"""`prime-hpc status` and the env servers of a running job: one line per published endpoint
(written as a server writes it, `envserver.server.publish`), from the run directory alone:
its pid, its workers and restarts (its log), its log; an endpoint whose server is gone (or
whose pid another process took since) said so; nothing once the job ended. A local job,
run by a live process of this test; real processes for the servers' pids."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from prime_hpc.cli import main
from prime_hpc.envserver.server import publish
from prime_hpc.rundir import RunDir, jobs, logtree
from prime_hpc.watch.envservers import env_server_line, env_servers

SERVER_LOG = """\
2026-12-02 10:00:00 INFO env_server: env reverse_text: worker 0 started (pid {w0}), log {logs}/env_worker_0.log
2026-12-02 10:00:00 INFO env_server: env reverse_text: worker 1 started (pid {w1}), log {logs}/env_worker_1.log
2026-12-02 10:00:05 INFO env_server: env reverse_text: worker 0 ready
2026-12-02 10:00:05 INFO env_server: env reverse_text: serving 1000 rows at http://127.0.0.1:4321 with 2 workers
"""
RESTART = (
    "2026-12-02 10:05:00 WARNING env_server: env reverse_text: worker 1 (pid {w1}) died (exit -9); see {logs}/"
    "env_worker_1.log; restarting it (1 of 3 restarts)\n"
    "2026-12-02 10:05:00 INFO env_server: env reverse_text: worker 1 started (pid 777), log {logs}/env_worker_1.log\n"
)


@pytest.fixture
def sleeper():
    """A real process standing for a server (its pid in an endpoint); ended by its pid."""
    procs = []

    def start() -> subprocess.Popen:
        procs.append(subprocess.Popen(["sleep", "60"]))
        return procs[-1]

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def running_job(tmp_path: Path, host: str | None = None) -> tuple[RunDir, Path]:
    """A local job that runs (its supervisor: this test's process) in its first attempt."""
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    _, logs = run.new_attempt()
    attempt = {"attempt": 0, "job_id": "local-0", "host": host or socket.gethostname(), "logs": str(logs)}
    jobs.update_job(
        run,
        name="run0",
        state="RUNNING",
        backend="local",
        job_ids=["local-0"],
        groups=["orchestrator"],
        pid=os.getpid(),
        pid_start=jobs.start_time(os.getpid()),
        attempts=[{**attempt, "started_at": time.time()}],
    )
    jobs.record(jobs.JobRef("local-0", "run0", str(run.root), "local", time.time()))
    return run, logs


def serve(run: RunDir, logs: Path, kind: str, env: str, pid: int, log: str = "") -> Path:
    """What a server of `env` leaves: its log, then its endpoint (`publish`)."""
    server_log = logtree.env_server_log(logs, kind, env)
    server_log.parent.mkdir(parents=True, exist_ok=True)
    server_log.write_text(log)
    endpoint = run.env_server_endpoint(kind, env)
    publish(endpoint, {"url": "http://127.0.0.1:4321", "instance": "ab" * 16, "pid": pid})
    return endpoint


def status_lines(run: RunDir, capsys) -> list[str]:
    assert main(["status", str(run.root)]) == 0
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("env server")]


def test_one_line_per_published_env_server_with_its_pid_workers_and_log(tmp_path, capsys, sleeper):
    run, logs = running_job(tmp_path)
    train, ev = sleeper(), sleeper()
    train_logs = logtree.env_log_dir(logs, "train", "reverse_text")
    serve(run, logs, "train", "reverse_text", train.pid, SERVER_LOG.format(w0=11, w1=12, logs=train_logs))
    serve(run, logs, "eval", "reverse_text", ev.pid, SERVER_LOG.format(w0=21, w1=22, logs=train_logs).split("\n")[0])
    train_log = logtree.env_server_log(logs, "train", "reverse_text")
    assert status_lines(run, capsys) == [
        f"env server eval/reverse_text: pid {ev.pid}, 1 worker, log {logtree.env_server_log(logs, 'eval', 'reverse_text')}",
        f"env server train/reverse_text: pid {train.pid}, 2 workers, log {train_log}",
    ]
    # a worker restarted: counted once, the workers still two
    with open(train_log, "a") as f:
        f.write(RESTART.format(w1=12, logs=train_logs))
    assert status_lines(run, capsys)[1] == (
        f"env server train/reverse_text: pid {train.pid}, 2 workers, 1 restart, log {train_log}"
    )
    # the same, for scripts
    assert main(["status", str(run.root), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["env_servers"]
    assert [(r["kind"], r["env"], r["pid"], r["alive"], r["workers"], r["restarts"]) for r in rows] == [
        ("eval", "reverse_text", ev.pid, True, 1, 0),
        ("train", "reverse_text", train.pid, True, 2, 1),
    ]
    assert rows[1]["url"] == "http://127.0.0.1:4321" and rows[1]["endpoint"] == str(
        run.env_server_endpoint("train", "reverse_text")
    )
    assert "instance" not in json.dumps(rows)  # nothing more of the endpoint than status shows


def test_an_endpoint_whose_server_is_gone_is_said_so(tmp_path, capsys, sleeper):
    """A server killed before it could remove its endpoint; and one whose pid another
    process took after it published (started later than the endpoint was written)."""
    run, logs = running_job(tmp_path)
    dead = sleeper()
    endpoint = serve(run, logs, "train", "reverse_text", dead.pid, SERVER_LOG.format(w0=1, w1=2, logs="l"))
    dead.kill()
    dead.wait()
    log = logtree.env_server_log(logs, "train", "reverse_text")
    assert status_lines(run, capsys) == [
        f"env server train/reverse_text: pid {dead.pid} is gone (it ended without removing {endpoint}); log {log}"
    ]
    other = sleeper()  # a live process, started after the endpoint it is named in was written
    endpoint = serve(run, logs, "train", "reverse_text", other.pid)
    long_ago = time.time() - 3600
    os.utime(endpoint, (long_ago, long_ago))
    assert status_lines(run, capsys) == [
        f"env server train/reverse_text: pid {other.pid} is gone (it ended without removing {endpoint}); log {log}"
    ]


def test_from_another_host_the_pid_is_not_checked(tmp_path, capsys):
    """A SLURM job's env servers run on its head node: from elsewhere their pids say nothing."""
    run, logs = running_job(tmp_path, host="head-node-7")
    serve(run, logs, "train", "reverse_text", 4242, SERVER_LOG.format(w0=1, w1=2, logs="l"))
    (row,) = env_servers(run, jobs.read_job(run))
    assert row["alive"] is None and row["host"] == "head-node-7"
    log = logtree.env_server_log(logs, "train", "reverse_text")
    assert env_server_line(row) == (
        f"env server train/reverse_text: pid 4242 on head-node-7 (not checked from here), 2 workers, log {log}"
    )


def test_workers_past_their_restarts_and_files_that_are_no_endpoint(tmp_path, capsys, sleeper):
    run, logs = running_job(tmp_path)
    proc = sleeper()
    gave_up = SERVER_LOG.format(w0=1, w1=2, logs="l") + "".join(
        f"... worker 0 (pid 1) died (exit -9); see l; restarting it ({k} of 3 restarts)\n" for k in (1, 2, 3)
    )
    gave_up += "... env reverse_text: worker 0 (pid 9) died (exit -9); see l, after 3 restarts: no more restarts\n"
    serve(run, logs, "train", "reverse_text", proc.pid, gave_up)
    run.env_servers_dir.joinpath(".tmp.train-x.json.123").write_text("{")  # being written
    run.env_servers_dir.joinpath("notes.txt").write_text("x")
    run.env_servers_dir.joinpath("train-half.json").write_text('{"url": ')  # being replaced: left out
    log = logtree.env_server_log(logs, "train", "reverse_text")
    assert status_lines(run, capsys) == [
        f"env server train/reverse_text: pid {proc.pid}, 2 workers, 3 restarts, its workers died past its "
        f"restarts (the next group fails the run), log {log}"
    ]


def test_none_without_endpoints_nor_once_the_job_ended(tmp_path, capsys, sleeper):
    run, logs = running_job(tmp_path)
    assert status_lines(run, capsys) == []  # no env server: no line, no private/envservers/ needed
    serve(run, logs, "train", "reverse_text", sleeper().pid)
    assert len(status_lines(run, capsys)) == 1
    jobs.update_job(run, state="COMPLETED", ended_at=time.time())
    assert status_lines(run, capsys) == []
