"""`prime-hpc tail` on synthetic run directories: which files are followed and how their
lines are labelled, trainer rank selection, the noise filter, and the job's lifecycle
(pending, a new attempt, the final state). No cluster, no servers."""

from __future__ import annotations

import io
import re
import threading
import time
from pathlib import Path

import pytest

from prime_hpc.rundir import RunDir, logtree
from prime_hpc.rundir.jobs import update_job
from prime_hpc.watch import tail

ACCESS = 'INFO:     127.0.0.1:54321 - "POST /v1/chat/completions HTTP/1.1" 200 OK'
RESET = "(EngineCore pid=2687) INFO 11-23 06:09:24 [block_pool.py:861] Successfully reset prefix cache"
THROUGHPUT = (
    "(MainProcess pid=2645) INFO 11-23 06:11:43 [loggers.py:335] Engine 000: Avg prompt throughput: "
    "3464.4 tokens/s, Avg generation throughput: 543.2 tokens/s, Running: 65 reqs, Waiting: 0 reqs"
)
ROUTER_DONE = (
    "\x1b[2m2026-11-23 06:11:50\x1b[0m \x1b[32m INFO\x1b[0m http_request{method=POST "
    "uri=/v1/chat/completions}: \x1b[2mvllm_router_rs::response\x1b[0m: finished processing request"
)


def write(path: Path, *lines: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write("".join(line + "\n" for line in lines))


def make_run(tmp_path: Path, state: str = "RUNNING", **job) -> tuple[RunDir, Path]:
    """A run with job.json and a first attempt's (empty) log tree."""
    run = RunDir(tmp_path / "run")
    update_job(run, state=state, job_ids=["42"], groups=["orchestrator", "inference", "trainer"], **job)
    _, logs = run.new_attempt()
    return run, logs


def rl_tree(logs: Path, tag: str = "") -> None:
    """An RL attempt: orchestrator, 2 inference nodes with a router, 2 trainer nodes of 2
    ranks each (torchrun's per-rank directories included), one train and one eval env."""
    write(logtree.component_log(logs, "orchestrator"), f"06:21:00 INFO orchestrator: step 1{tag}")
    for i in range(2):
        write(
            logtree.node_log(logs, "inference", i),
            f"prime-hpc inference: node {i} serving{tag}",
            ACCESS,
            RESET,
            THROUGHPUT,
        )
    write(logtree.router_log(logs, 0), f"prime-hpc router: serving{tag}", ROUTER_DONE)
    for node in range(2):
        for local in range(2):
            (logtree.torchrun_log_dir(logs) / f"42_n{node}" / "attempt_0" / str(local)).mkdir(parents=True)
        write(
            logtree.node_log(logs, "trainer", node),
            *[
                f"[default{local}]:2026-11-23 06:20:27 | INFO    | trainer[{node * 2 + local}] | step 1{tag}"
                for local in range(2)
            ],
            f"W1123 06:20:30.1 123 torch/distributed/elastic/agent/server/api.py:753] node {node} agent{tag}",
        )
    write(logtree.env_log_dir(logs, "train", "reverse_text") / "env_worker_0.log", f"train env line{tag}")
    write(logtree.env_log_dir(logs, "eval", "reverse_text") / "env_worker_0.log", f"eval env line{tag}")


def labelled(output: str) -> list[tuple[str, str]]:
    """(label, text) of every source line of `output`."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^(\S+) +\| (.*)$", output, re.M)]


def once(run: RunDir, **kwargs) -> tuple[int, str]:
    out = io.StringIO()
    code = tail.follow(run, once=True, out=out, **kwargs)
    return code, out.getvalue()


# ----------------------------------------------------------------------------- sources
def test_discover_finds_every_source_with_its_label(tmp_path):
    run, logs = make_run(tmp_path)
    rl_tree(logs)
    assert [s.label for s in tail.discover(logs)] == [
        "orchestrator",
        "inference[0]",
        "inference[1]",
        "router",
        "torchrun[0]",
        "torchrun[1]",
        "env:train/reverse_text",
        "env:eval/reverse_text",
    ]
    assert [s.label for s in tail.discover(logs, ["router", "envs"])] == [
        "router",
        "env:train/reverse_text",
        "env:eval/reverse_text",
    ]
    assert tail.nproc_per_node(logs) == 2


def test_once_prefixes_and_aligns_every_line(tmp_path):
    run, logs = make_run(tmp_path)
    rl_tree(logs)
    code, output = once(run)
    assert code == 0
    lines = [ln for ln in output.splitlines() if " | " in ln]
    assert len({ln.index(" | ") for ln in lines}) == 1, output  # one column for every label
    got = labelled(output)
    assert ("orchestrator", "06:21:00 INFO orchestrator: step 1") in got
    assert ("inference[1]", "prime-hpc inference: node 1 serving") in got
    assert ("router", "prime-hpc router: serving") in got
    assert ("env:eval/reverse_text", "eval env line") in got
    assert "==> attempt 0 (" in output and output.rstrip().endswith("job 42 is RUNNING")


def test_components_narrow_the_sources(tmp_path):
    run, logs = make_run(tmp_path)
    rl_tree(logs)
    _, output = once(run, components=["orchestrator", "router"])
    assert {label for label, _ in labelled(output)} == {"orchestrator", "router"}
    with pytest.raises(ValueError, match="unknown component"):
        tail.follow(run, components=["nope"], once=True, out=io.StringIO())


def test_an_env_servers_log_comes_with_its_workers_logs(tmp_path):
    """An env that runs in an env server: its server's log (`env-server:<kind>/<env>`) is
    followed first among that env's logs, then each worker's; an env in process has only
    its worker log. A server log that appears later is picked up."""
    run, logs = make_run(tmp_path)
    rl_tree(logs)
    train = logtree.env_log_dir(logs, "train", "reverse_text")
    write(train / "env_server.log", "env reverse_text: worker 0 started (pid 11)", "env reverse_text: serving")
    write(train / "env_worker_1.log", "worker 1 line")
    assert [s.label for s in tail.discover(logs, ["envs"])] == [
        "env-server:train/reverse_text",
        "env:train/reverse_text",
        "env:train/reverse_text[1]",
        "env:eval/reverse_text",
    ]
    assert tail.discover(logs, ["envs"])[0].path == logtree.env_server_log(logs, "train", "reverse_text")
    got = labelled(once(run, components=["envs"])[1])
    assert got[:2] == [
        ("env-server:train/reverse_text", "env reverse_text: worker 0 started (pid 11)"),
        ("env-server:train/reverse_text", "env reverse_text: serving"),
    ]
    assert ("env:train/reverse_text[1]", "worker 1 line") in got
    # followed: the eval env's server starts later, and a worker restart is said in the train one's
    t = tail.Tail(["envs"], 0, False, io.StringIO())
    t.switch(logs)
    t.poll(initial_lines=10)
    before = len(t.out.getvalue())
    write(logtree.env_server_log(logs, "eval", "reverse_text"), "env reverse_text: serving 5 rows")
    write(train / "env_server.log", "env reverse_text: worker 0 (pid 11) died (exit -9); restarting it")
    t.poll()
    assert labelled(t.out.getvalue()[before:]) == [
        ("env-server:train/reverse_text", "env reverse_text: worker 0 (pid 11) died (exit -9); restarting it"),
        ("env-server:eval/reverse_text", "env reverse_text: serving 5 rows"),
    ]


def test_last_lines_per_source(tmp_path):
    run, logs = make_run(tmp_path)
    write(logtree.component_log(logs, "orchestrator"), *[f"line {i}" for i in range(30)])
    _, output = once(run, lines=3)
    assert [text for _, text in labelled(output)] == ["line 27", "line 28", "line 29"]


def test_last_lines_of_a_log_longer_than_the_window_and_what_follows(tmp_path, monkeypatch):
    """Only the end of a long log is read (its cut first line left out); following goes on
    from there, a line completed later printed whole."""
    monkeypatch.setattr(tail, "TAIL_WINDOW", 40)
    run, logs = make_run(tmp_path)
    log = logtree.component_log(logs, "orchestrator")
    write(log, *[f"line {i:02d}" for i in range(30)])
    with open(log, "a") as f:
        f.write("half")
    t = tail.Tail(["orchestrator"], 0, False, io.StringIO())
    t.switch(logs)
    t.poll(initial_lines=10)
    with open(log, "a") as f:
        f.write(" done\nnext\n")
    t.poll()
    printed = [line.split(" | ", 1)[1] for line in t.out.getvalue().splitlines() if " | " in line]
    assert printed == ["line 26", "line 27", "line 28", "line 29", "half done", "next"]


# ----------------------------------------------------------------------------- ranks
def test_rank_zero_by_default(tmp_path):
    run, logs = make_run(tmp_path)
    rl_tree(logs)
    got = labelled(once(run, components=["trainer"])[1])
    assert got == [
        ("trainer[0]", "2026-11-23 06:20:27 | INFO    | trainer[0] | step 1"),
        ("torchrun[0]", "W1123 06:20:30.1 123 torch/distributed/elastic/agent/server/api.py:753] node 0 agent"),
    ]


def test_rank_all_and_a_rank_on_another_node(tmp_path):
    run, logs = make_run(tmp_path)
    rl_tree(logs)
    got = labelled(once(run, components=["trainer"], rank="all")[1])
    assert [label for label, _ in got] == [
        "trainer[0]",
        "trainer[1]",
        "torchrun[0]",
        "trainer[2]",
        "trainer[3]",
        "torchrun[1]",
    ]
    for label, text in got:  # each global rank found where the trainer itself says it is
        if label.startswith("trainer"):
            assert f"| {label} |" in text
    got = labelled(once(run, components=["trainer"], rank=3)[1])
    assert [label for label, _ in got] == ["trainer[3]", "torchrun[1]"]


def test_parse_rank():
    assert tail.parse_rank("all") == "all" and tail.parse_rank("3") == 3 and tail.parse_rank(0) == 0
    with pytest.raises(ValueError):
        tail.parse_rank("-1")


# ----------------------------------------------------------------------------- noise
@pytest.mark.parametrize(
    "line, noise",
    [
        (ACCESS, True),
        ('INFO:     10.0.0.7:40210 - "POST /update_weights HTTP/1.1" 200 OK', True),
        ('(APIServer pid=7) INFO:     127.0.0.1:5 - "GET /health HTTP/1.1" 200 OK', True),
        ('INFO:     127.0.0.1:54321 - "POST /v1/chat/completions HTTP/1.1" 500 Internal Server Error', False),
        (RESET, True),
        (ROUTER_DONE, True),
        ("2026-11-23 06:11:50 INFO vllm_router_rs::http: HTTP request completed method=POST status=200", True),
        ("2026-11-23 06:11:50 ERROR vllm_router_rs::response: request failed with server error", False),
        (THROUGHPUT, False),
        ("prime-hpc inference: inference_57.0 serves policy 12 (update 3, drain 0.01s, load 0.05s)", True),
        ("prime-hpc inference: inference_57.0 left after 1.2s: out of the router, no request in flight", False),
        ("INFO:     Application startup complete.", False),
        ("[default0]:2026-11-23 06:20:27 | INFO    | trainer[0] | step 3 | loss 0.1", False),
    ],
)
def test_is_noise(line, noise):
    assert tail.is_noise(line) is noise


def test_noise_hidden_by_default_and_shown_with_show_all(tmp_path):
    run, logs = make_run(tmp_path)
    rl_tree(logs)
    shown = [text for label, text in labelled(once(run, components=["inference", "router"])[1])]
    assert THROUGHPUT in shown and "prime-hpc router: serving" in shown
    assert ACCESS not in shown and RESET not in shown and ROUTER_DONE not in shown
    shown = [text for label, text in labelled(once(run, components=["inference", "router"], show_all=True)[1])]
    uncoloured = re.sub(r"\x1b\[[0-9;]*m", "", ROUTER_DONE)  # the router's colours are dropped
    assert ACCESS in shown and RESET in shown and uncoloured in shown
    assert "2026-11-23 06:11:50  INFO http_request" in uncoloured


# ----------------------------------------------------------------------------- the terminal
HOSTILE = (
    "reply: \x1b[2J\x1b[H\x1b]0;owned\x07\x1b]52;c;cm0gLXJmIH4=\x07 done"  # clear, home, title, clipboard
    "\x9b31m\x7f\x08\x00 \u00e9t\u00e9 \u65e5\u672c \u2603\tcol"  # a C1 CSI, DEL, backspace, NUL; Unicode, a tab
)


def test_what_a_model_or_env_wrote_cannot_drive_the_terminal(tmp_path):
    """A model's output in a server's or an env's log, and a failure reason in job.json,
    reach the terminal with every control sequence escaped; Unicode text and tabs stay."""
    run, logs = make_run(
        tmp_path,
        state="FAILED",
        ended_at=time.time(),
        failure={"component": "orchestrator", "rc": 1, "reason": "env said \x1b[31mboom\x1b]0;x\x07", "log": "l"},
    )
    write(logtree.component_log(logs, "orchestrator"), HOSTILE)
    write(logtree.env_log_dir(logs, "train", "rev\x1b[1Ax") / "env_worker_0.log", "partial\x1b[1A")
    for kwargs in ({"once": True}, {"poll_s": 0.01}):
        out = io.StringIO()
        tail.follow(run, out=out, **kwargs)
        output = out.getvalue()
        assert not re.search("[\x00-\x08\x0b-\x1f\x7f-\x9f]", output), repr(output)
        got = dict(labelled(output))
        assert got["orchestrator"] == (
            "reply: \\x1b[2J\\x1b[H\\x1b]0;owned\\x07\\x1b]52;c;cm0gLXJmIH4=\\x07 done"
            "\\x9b31m\\x7f\\x08\\x00 \u00e9t\u00e9 \u65e5\u672c \u2603\tcol"
        ), got
        assert got["env:train/rev\\x1b[1Ax"] == "partial\\x1b[1A"
        assert output.rstrip().splitlines()[-1].endswith("env said boom\\x1b]0;x\\x07; log: l)")


def test_last_per_label():
    items = [("a", "1"), ("b", "1"), ("a", "2"), ("a", "3"), ("b", "2")]
    assert tail.last_per_label(items, 1) == [("a", "3"), ("b", "2")]
    assert tail.last_per_label(items, 2) == [("b", "1"), ("a", "2"), ("a", "3"), ("b", "2")]
    assert tail.last_per_label(items, 0) == []


def test_visible_keeps_what_a_terminal_shows():
    assert tail.visible("\rMap:   0%| 0/10\rMap: 100%| 10/10") == "Map: 100%| 10/10"
    assert tail.visible("plain") == "plain" and tail.visible("") == ""


# ----------------------------------------------------------------------------- lifecycle
def test_once_on_a_failed_job_shows_the_failure(tmp_path):
    log = "/runs/x/logs/attempt_0/inference/node_0.log"
    run, logs = make_run(
        tmp_path,
        state="FAILED",
        ended_at=time.time(),
        failure={"component": "inference_0", "rc": 1, "reason": "exited with code 1", "log": log},
    )
    write(logtree.node_log(logs, "inference", 0), "RuntimeError: Engine core initialization failed.")
    for kwargs in ({"once": True}, {}):  # --no-follow, and following a job that already ended
        out = io.StringIO()
        assert tail.follow(run, out=out, poll_s=0.01, **kwargs) == 1
        output = out.getvalue()
        assert ("inference[0]", "RuntimeError: Engine core initialization failed.") in labelled(output)
        assert output.rstrip().splitlines()[-1] == f"job 42 ended: FAILED (inference_0: exited with code 1; log: {log})"


def wait_for_output(out: io.StringIO, text: str, timeout_s: float = 5) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in out.getvalue():
        assert time.monotonic() < deadline, f"no {text!r} in:\n{out.getvalue()}"
        time.sleep(0.02)


def test_follow_across_a_new_attempt_until_completed(tmp_path):
    run, logs = make_run(tmp_path)
    rl_tree(logs)
    out, result = io.StringIO(), {}
    thread = threading.Thread(target=lambda: result.update(code=tail.follow(run, out=out, poll_s=0.05)), daemon=True)
    thread.start()
    wait_for_output(out, "step 1")
    write(logtree.component_log(logs, "orchestrator"), "06:21:05 INFO orchestrator: step 2")
    write(logtree.node_log(logs, "inference", 2), "prime-hpc inference: node 2 serving (late)", ACCESS)
    wait_for_output(out, "node 2 serving (late)")
    update_job(run, state="REQUEUED")
    wait_for_output(out, "job 42 was requeued")
    update_job(run, state="RUNNING")
    _, logs1 = run.new_attempt()
    rl_tree(logs1, tag=" (attempt 1)")
    wait_for_output(out, "step 1 (attempt 1)")
    update_job(run, state="COMPLETED", ended_at=time.time())
    thread.join(timeout=5)
    assert not thread.is_alive() and result["code"] == 0
    output = out.getvalue()
    got = labelled(output)
    assert ("orchestrator", "06:21:05 INFO orchestrator: step 2") in got
    assert ("inference[2]", "prime-hpc inference: node 2 serving (late)") in got
    assert ("trainer[0]", "2026-11-23 06:20:27 | INFO    | trainer[0] | step 1 (attempt 1)") in got
    assert ("env:train/reverse_text", "train env line (attempt 1)") in got
    assert ACCESS not in output
    assert output.index("06:21:05 INFO orchestrator: step 2") < output.index(f"==> attempt 1 ({logs1}) <==")
    assert output.index(f"==> attempt 1 ({logs1}) <==") < output.index("step 1 (attempt 1)")
    assert output.rstrip().splitlines()[-1] == "job 42 ended: COMPLETED"


def test_pending_job_says_what_it_waits_for_until_interrupted(tmp_path):
    run = RunDir(tmp_path / "run")
    update_job(run, state="PENDING", job_ids=["42"], pipeline={"warmup": {"job_id": "41", "output_dir": "w"}})
    calls = []

    def state_fn():
        calls.append(1)
        if len(calls) > 3:
            raise KeyboardInterrupt
        return tail.job_state(run)

    out = io.StringIO()
    assert tail.follow(run, out=out, poll_s=0.01, state_fn=state_fn) == 130
    assert out.getvalue().splitlines() == [
        "job 42 is pending (waiting for job 41 to complete)",
        "stopped following (the job goes on)",
    ]


def test_waiting_messages(tmp_path):
    run = RunDir(tmp_path / "run")
    job = {"job_ids": ["42"], "backend": "slurm"}
    assert tail.waiting_message(run, "PENDING", job, None) == "job 42 is pending (waiting for the job to start)"
    assert tail.waiting_message(run, "RUNNING", job, None).startswith("job 42 is RUNNING: waiting for its logs")
    assert tail.waiting_message(run, "RUNNING", job, tmp_path) is None
    update_job(run, state="RUNNING", job_ids=["42"], backend="slurm")
    code, output = once(run)
    assert code == 0
    assert output == f"job 42 is RUNNING: waiting for its logs (until they exist, see {run.slurm_batch_log('42')})\n"


def test_final_state_without_ended_at_ends_after_a_grace(tmp_path, monkeypatch):
    """A job cancelled before it started has nobody to record `ended_at`."""
    monkeypatch.setattr(tail, "ENDED_GRACE_S", 0.2)
    run, logs = make_run(tmp_path, state="CANCELLED")
    write(logtree.component_log(logs, "orchestrator"), "last words")
    out = io.StringIO()
    started = time.monotonic()
    assert tail.follow(run, out=out, poll_s=0.02) == 1
    assert time.monotonic() - started < 3
    assert ("orchestrator", "last words") in labelled(out.getvalue())
    assert out.getvalue().rstrip().splitlines()[-1] == "job 42 ended: CANCELLED"
