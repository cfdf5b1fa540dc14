"""A broken environment ends its run loudly (cluster=local, the tiny model): a rollout that
raises, a reward function that raises, rollouts that produce no completion. After
`orchestrator.max_errored_groups` such groups in a row the job is FAILED, and one line
quoting the env's error and naming its worker log is the last line of the orchestrator's
log, the recorded failure and what `status` shows; the step that could not be filled is in
the metrics; nothing of the run is left running."""

from __future__ import annotations

import json
import time

import pytest

from prime_hpc.rundir import RunDir, jobs, logtree
from tests.conftest import REPO, cli
from tests.runs import run_processes, still_alive

pytestmark = [pytest.mark.vllm]

ENVS = REPO / "tests" / "envs"
BROKEN = [  # (env file, its args, what the line must quote)
    ("broken_reverse.py", "fail: rollout", "ToolCallError('the reversal checker refused the call: connection reset')"),
    ("flaky_reverse.py", "raise_every: 1", "reward: ValueError: reward exploded on "),
    ("broken_reverse.py", "fail: empty", "every completion was empty"),
]
LIMIT = 3


def submit(out, env_file: str, args: str, *overrides: str) -> RunDir:
    r = cli(
        "submit",
        "+experiment=reverse_text",
        "cluster=local",
        "warmup.experiment=null",
        f"output_dir={out}",
        "max_steps=5",
        "orchestrator.batch_size=16",
        "orchestrator.group_size=4",
        "orchestrator.eval.env=[]",
        f'orchestrator.env=[{{id: "{ENVS / env_file}", args: {{{args}, num_train_examples: 64}}}}]',
        *(overrides or [f"orchestrator.max_errored_groups={LIMIT}"]),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return RunDir(out)


def wait_ended(run: RunDir, timeout_s: float) -> dict:
    """job.json once the job recorded its end and every process of the run is gone (the
    end is recorded first, then the other components are stopped)."""
    deadline = time.monotonic() + timeout_s
    while not jobs.read_job(run).get("ended_at"):
        assert time.monotonic() < deadline, f"the job did not end within {timeout_s}s: {jobs.read_job(run)}"
        time.sleep(1)
    procs = run_processes(run.latest_logs.resolve())
    deadline = time.monotonic() + 60
    while (left := still_alive(procs)) and time.monotonic() < deadline:
        time.sleep(1)
    assert not left, f"processes of the run outlived it: {left}"
    return jobs.read_job(run)


@pytest.mark.parametrize("env_file, args, quoted", BROKEN, ids=["rollout-raises", "reward-raises", "empty"])
def test_a_broken_env_fails_the_job_with_one_line_quoting_its_error(tmp_path, env_file, args, quoted):
    run = submit(tmp_path / "run", env_file, args)
    try:
        job = wait_ended(run, 600)
        logs = run.latest_logs.resolve()
        assert job["state"] == "FAILED", job
        name = env_file.removesuffix(".py")
        env_log = logtree.env_worker_log(logs, "train", name)
        # the orchestrator's last word: one line, quoting the error, naming the env's log
        last = logtree.component_log(logs, "orchestrator").read_text().strip().splitlines()[-1]
        prefix = f"prime-hpc orchestrator: train env {name!r}: {LIMIT} groups in a row errored"
        assert last.startswith(prefix) and quoted in last and last.endswith(f"; see {env_log}"), last
        cause = last.removeprefix("prime-hpc orchestrator: ").removesuffix(f"; see {env_log}")
        assert job["failure"] == {
            "component": "orchestrator",
            "rc": 1,
            "node": 0,
            "reason": f"exited with code 1: {cause}",
            "log": str(env_log),
        }, job["failure"]
        # the env's worker log: its own records, and a line per errored group
        noted = [x for x in env_log.read_text().splitlines() if "nothing of the group can train: " in x]
        assert len(noted) >= LIMIT and quoted in noted[-1], noted
        # status: the step that could not be filled, and the failure in one line
        status = cli("status", str(run.root)).stdout
        assert f"failed: orchestrator on node 0 exited with code 1: {cause}; see {env_log}" in status, status
        rows = [json.loads(x) for x in run.metrics("orchestrator").read_text().splitlines()]
        assert rows[-1]["step"] == 1 and rows[-1]["filter/unfilled"] == 1, rows
        assert rows[-1]["filter/errored_groups"] >= LIMIT and rows[-1]["filter/accepted_groups"] == 0, rows
        assert "step 1 not filled: 0 group(s) accepted" in status and "errored: " in status, status
        assert not run.rollout_steps()
    finally:
        if not jobs.read_job(run).get("ended_at"):
            cli("cancel", str(run.root))


def test_a_healthy_env_whose_groups_are_all_filtered_is_a_stall_the_watchdog_ends(tmp_path):
    """Every reward the same and zero-variance groups filtered: no group ever errors, so the
    orchestrator judges groups without end; no step is written, which is no progress: the
    watchdog ends the job quoting the orchestrator's line on why the step does not fill."""
    stall_s = 45
    run = submit(
        tmp_path / "run",
        "flaky_reverse.py",
        "constant_every: 1",
        "orchestrator.online_difficulty_filtering=true",
        f"watchdog.stall_timeout_s={stall_s}",
    )
    try:
        job = wait_ended(run, 600)
        assert job["state"] == "FAILED", job
        f = job["failure"]
        assert f["component"] == "orchestrator", f
        assert f["reason"].startswith("stalled: alive, but no progress for "), f
        line = f["reason"].split("; last line of its log: ")[1]
        assert "step 1: 0/4 groups accepted after " in line and "(no reward variance: " in line, f
        assert "errored" not in line, f  # a hard or uniform task is not an error
        rows = [json.loads(x) for x in run.metrics("orchestrator").read_text().splitlines()]
        assert rows[-1]["step"] == 1 and rows[-1]["filter/unfilled"] == 1, rows
        assert rows[-1]["filter/zero_variance_groups"] > 0 and rows[-1]["filter/errored_groups"] == 0, rows
        assert not run.rollout_steps()
        status = cli("status", str(run.root)).stdout
        assert "step 1 not filled: 0 group(s) accepted of " in status and "failed: orchestrator" in status, status
    finally:
        if not jobs.read_job(run).get("ended_at"):
            cli("cancel", str(run.root))
