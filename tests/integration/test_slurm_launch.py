"""The launcher on the real dev cluster (tools/dev-cluster start): preflight, submit,
status across states, list, cancel, and what sacct records. Asserts on the run
directory and on SLURM, not on log wording."""

from __future__ import annotations

import json
import shutil
import subprocess
import time

import pytest

from prime_hpc.config.compose import compose
from prime_hpc.launcher import launch
from prime_hpc.rundir import RunDir, jobs
from tests.conftest import HOSTILE, cli, hydra_quote

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module", autouse=True)
def dev_cluster():
    if shutil.which("sinfo") is None:
        pytest.fail("SLURM is not installed here; run tools/dev-cluster start")
    r = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=30)
    if r.returncode != 0 or not any(s.startswith(("idle", "mix", "alloc")) for s in r.stdout.split()):
        pytest.fail(f"the dev cluster is not up ({r.stderr.strip() or r.stdout.strip()}); run tools/dev-cluster start")


@pytest.fixture
def cancel_later():
    """Jobs a test submits are cancelled at its end, whatever happens."""
    ids: list[str] = []
    yield ids.append
    for job_id in ids:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=60)


def sacct_states(job_id: str, timeout_s: float = 60) -> dict[str, str]:
    """{'<id>+0': state, ...} for the het components, once sacct has recorded all three."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = subprocess.run(
            ["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", job_id], capture_output=True, text=True, timeout=30
        ).stdout
        states = dict(line.split("|", 1) for line in out.splitlines() if "|" in line)
        if len(states) >= 3 or time.monotonic() > deadline:
            return states
        time.sleep(1)


def wait_state(ref, wanted: set[str], timeout_s: float = 120) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = launch.job_state(ref)
        if st in wanted:
            return st
        time.sleep(0.5)
    raise AssertionError(f"job {ref.job_id} never reached {wanted}; last state {launch.job_state(ref)}")


def test_preflight_passes_on_every_node_of_a_multi_node_layout(tmp_path):
    out = tmp_path / HOSTILE
    r = cli(
        "doctor",
        "+experiment=reverse_text",
        "cluster=dev",
        f"output_dir={hydra_quote(str(out))}",
        f"name={hydra_quote('pre flight; $(x)')}",
        "cluster.inference.nodes=2",
        "cluster.trainer.nproc_per_node=2",
        "--timeout",
        "300",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    run = RunDir(out).doctor_run
    summary = json.loads(run.preflight_summary.read_text())
    assert summary["ok"]
    got = {g: sorted(x["rank"] for x in reps) for g, reps in summary["groups"].items()}
    assert got == {"orchestrator": [0], "inference": [0, 1], "router": [0], "trainer": [0, 1]}
    # every group ran on its own SLURM node(s) of the het job
    nodes = {g: {x["slurm_node"] for x in reps} for g, reps in summary["groups"].items()}
    assert len(nodes["inference"]) == 2
    assert nodes["router"] == nodes["orchestrator"]  # the router shares the head node
    assert nodes["orchestrator"].isdisjoint(nodes["inference"] | nodes["trainer"])
    for reps in summary["groups"].values():
        for rep in reps:
            names = {c["name"] for c in rep["checks"] if c["ok"]}
            assert {"hostname", "accelerators", "imports", "shared run dir"} <= names
            if rep["group"] != "orchestrator":
                assert "reach head port" in names
            if rep["group"] == "trainer":
                assert "trainer collective" in names
    for line in ("orchestrator  0", "inference     1", "trainer       1"):
        assert line in r.stdout
    job_id = jobs.read_job(run)["job_ids"][-1]
    assert set(sacct_states(job_id).values()) == {"COMPLETED"}
    assert jobs.read_job(run)["state"] == "COMPLETED"
    assert not (tmp_path / "PWNED").exists() and not (out / "PWNED").exists()
    # the per-attempt log layout of the reference
    logs = run.latest_logs
    for rel in ("orchestrator.log", "inference/node_0.log", "inference/node_1.log", "trainer/node_0.log"):
        assert (logs / rel).is_file(), rel
    assert (logs / "trainer.log").resolve() == (logs / "trainer/node_0.log").resolve()
    assert list((logs / "trainer" / "torchrun").glob("*/attempt_0/1/stdout.log"))


def test_preflight_failure_exits_nonzero_and_names_the_failing_check(tmp_path):
    r = cli(
        "doctor",
        "+experiment=reverse_text",
        "cluster=dev",
        f"output_dir={tmp_path}/run",
        "--require",
        "no_such_module_on_nodes",
        "--timeout",
        "300",
    )
    assert r.returncode == 1, r.stdout + r.stderr
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith(("orchestrator", "inference", "router", "trainer"))]
    assert len(rows) == 4 and all(" FAIL " in ln and "no_such_module_on_nodes" in ln for ln in rows)
    assert "preflight FAIL" in r.stdout


def test_broken_python_on_nodes_fails_with_the_log_to_read(tmp_path):
    r = cli(
        "doctor",
        "+experiment=reverse_text",
        "cluster=dev",
        f"output_dir={tmp_path}/run",
        "cluster.python=/nonexistent/bin/python",
        "--timeout",
        "300",
    )
    assert r.returncode == 1
    assert "without a full report; see" in r.stdout
    log = r.stdout.split("see ")[-1].strip()
    assert "_batch.out" in log and "nonexistent" in open(log).read()


def test_submit_returns_at_once_with_job_id_and_output_dir(tmp_path, cancel_later):
    out = tmp_path / "run"
    r = cli(
        "submit",
        "+experiment=reverse_text",
        "warmup.experiment=null",
        "cluster=dev",
        f"output_dir={out}",
        'cluster.sbatch_extra=["--begin=now+3600"]',
    )
    assert r.returncode == 0, r.stderr
    job = jobs.read_job(RunDir(out))
    job_id = job["job_ids"][-1]
    cancel_later(job_id)
    assert f"submitted run job {job_id}" in r.stdout and str(out) in r.stdout
    for rel in (
        "config.yaml",
        "configs/orchestrator.yaml",
        "configs/trainer.yaml",
        "configs/inference.yaml",
        "submit/rl.sbatch",
        "job.json",
    ):
        assert (out / rel).is_file(), rel
    assert job["name"] == "reverse_text" and job["backend"] == "slurm" and job["git_sha"]
    q = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%i %T"], capture_output=True, text=True).stdout
    assert q.count("PENDING") == 3  # three het components, held by --begin
    # a second submit to the same output_dir is refused, nothing is submitted
    again = cli("submit", "+experiment=reverse_text", "cluster=dev", f"output_dir={out}")
    assert again.returncode == 2 and "is not empty" in again.stderr
    assert jobs.read_job(RunDir(out))["job_ids"] == [job_id]


def test_status_list_cancel_across_states(tmp_path, cancel_later):
    # PENDING: held by --begin
    held = compose(
        [
            "+experiment=reverse_text",
            "cluster=dev",
            f"output_dir={tmp_path}/held",
            "name=held",
            'cluster.sbatch_extra=["--begin=now+3600"]',
        ]
    )
    sub_held = launch.submit(held, [], mode="doctor")
    cancel_later(sub_held.ref.job_id)
    # RUNNING: its script sleeps before starting any component
    busy = compose(
        [
            "+experiment=reverse_text",
            "cluster=dev",
            f"output_dir={tmp_path}/busy",
            "name=busy",
            'cluster.env_setup=["sleep 300"]',
        ]
    )
    sub_busy = launch.submit(busy, [], mode="doctor")
    cancel_later(sub_busy.ref.job_id)

    assert wait_state(sub_held.ref, {"PENDING"}) == "PENDING"
    assert wait_state(sub_busy.ref, {"RUNNING"}) == "RUNNING"
    st = cli("status", sub_held.ref.job_id)
    assert st.returncode == 0 and "PENDING" in st.stdout
    assert all(f"{g}" in st.stdout for g in ("orchestrator", "inference", "trainer"))
    st = cli("status", "busy-doctor")  # by run name
    assert st.returncode == 0
    rows = [
        ln.split() for ln in st.stdout.splitlines() if ln.strip().startswith(("orchestrator", "inference", "trainer"))
    ]
    assert [r[1] for r in rows] == ["RUNNING"] * 3
    st = cli("status", str(tmp_path / "busy" / "doctor"))  # by output dir
    assert st.returncode == 0 and sub_busy.ref.job_id in st.stdout

    ls = cli("list")
    assert ls.returncode == 0
    lines = {ln.split()[0]: ln for ln in ls.stdout.splitlines()[1:]}
    assert "PENDING" in lines[sub_held.ref.job_id] and "RUNNING" in lines[sub_busy.ref.job_id]

    for ref in (sub_held.ref, sub_busy.ref):
        c = cli("cancel", ref.job_id)
        assert c.returncode == 0, c.stderr
    for ref in (sub_held.ref, sub_busy.ref):
        assert wait_state(ref, {"CANCELLED"}) == "CANCELLED"
        states = sacct_states(ref.job_id)
        assert len(states) == 3 and all(s.startswith("CANCELLED") for s in states.values()), states
    st = cli("status", sub_busy.ref.job_id)
    assert "CANCELLED" in st.stdout


def test_scancel_of_a_running_job_is_recorded_by_the_job_itself(tmp_path, cancel_later):
    """A plain scancel (as by an admin, or the time limit) ends every group, and the job's
    own supervisor records the outcome in job.json before SLURM kills it."""
    started = tmp_path / "started"
    cfg = compose(
        [
            "+experiment=reverse_text",
            "cluster=dev",
            f"output_dir={tmp_path}/run",
            f'cluster.env_setup=["touch {started}","sleep 300"]',
        ]
    )
    sub = launch.submit(cfg, [], mode="doctor")
    cancel_later(sub.ref.job_id)
    wait_state(sub.ref, {"RUNNING"})
    # SLURM says RUNNING before its step daemon has started the script: cancelled once the
    # script runs its setup lines (its traps are set before them)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not started.exists():
        time.sleep(0.2)
    assert started.exists(), "the job's script did not reach its setup lines within 60 s"
    subprocess.run(["scancel", sub.ref.job_id], check=True, timeout=60)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not jobs.read_job(sub.ref.run).get("ended_at"):
        time.sleep(0.5)
    job = jobs.read_job(sub.ref.run)
    assert job.get("ended_at"), job
    assert job["state"] == "CANCELLED" and job["attempts"][-1]["end"] == "CANCELLED"
    assert wait_state(sub.ref, {"CANCELLED"}) == "CANCELLED"


def test_a_failing_component_ends_the_job_and_is_named(tmp_path):
    """The trainer group cannot start (pinned to a core its node does not have: taskset
    fails); the others are stopped at once and job.json names the trainer and its log."""
    cfg = compose(
        ["+experiment=reverse_text", "cluster=dev", f"output_dir={tmp_path}/run", "cluster.trainer.cpu_ids=63"]
    )
    sub = launch.submit(cfg, [], mode="doctor")
    try:
        assert launch.wait_done(sub, 300) == "FAILED"
    finally:
        subprocess.run(["scancel", sub.ref.job_id], capture_output=True)
    failure = jobs.read_job(sub.ref.run)["failure"]
    assert failure["component"] == "trainer" and failure["node"] == 0  # the node srun saw fail, and its own log
    assert failure["log"].endswith("trainer/node_0.log") and failure["host"].startswith("node")
    assert set(sacct_states(sub.ref.job_id).values()) == {"FAILED"}


def test_a_job_whose_environment_lost_the_key_starts_nothing_and_says_so(tmp_path):
    """The key reaches a job only through its environment; a job script that finds none
    (here a setup line removes it) records one line naming the variable and starts no
    component: no listener of the job ever runs without it."""
    cfg = compose(
        [
            "+experiment=reverse_text",
            "cluster=dev",
            f"output_dir={tmp_path}/run",
            'cluster.env_setup=["unset INFERENCE_SERVER_API_KEY"]',
        ]
    )
    sub = launch.submit(cfg, [], mode="doctor")
    try:
        assert launch.wait_done(sub, 300) == "FAILED"
    finally:
        subprocess.run(["scancel", sub.ref.job_id], capture_output=True)
    run = sub.ref.run
    failure = jobs.read_job(run)["failure"]
    assert "INFERENCE_SERVER_API_KEY did not reach the job" in failure["reason"], failure
    logs = run.latest_logs
    assert not [p for p in logs.rglob("*.log") if p.is_file() and p.stat().st_size], list(
        logs.rglob("*")
    )  # nothing ran
    assert not run.preflight_head.exists()
    out = cli("status", str(run.root)).stdout
    assert "INFERENCE_SERVER_API_KEY did not reach the job" in out, out


def test_unknown_job_is_a_one_line_error():
    r = cli("status", "no-such-job-999")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no job 'no-such-job-999'" in r.stderr


def test_refused_submission_leaves_the_directory_fresh(tmp_path):
    out = tmp_path / "run"
    r = cli(
        "submit",
        "+experiment=reverse_text",
        "warmup.experiment=null",
        "cluster=dev",
        f"output_dir={out}",
        "cluster.partition=nosuch",
    )
    assert r.returncode == 1 and "sbatch refused the job" in r.stderr and r.stderr.count("\n") == 1
    assert RunDir(out).is_fresh() and not (out / "job.json").exists()
    assert jobs.recent() == []
