"""Several runs in one job, as a user submits them (`prime-hpc submit -m ... --together`,
on the dev cluster): one vLLM server holding every run's adapter, one multi-run trainer
(`trainer.max_concurrent_runs`), one orchestrator per run under the head; each run lives in
the job's `runs/<name>/`. Two learning rates, each once with an environment whose reward
always raises: those two runs fail alone, the other two train to their end. A run added
later whose groups are all filtered (it never writes a step) is ended alone by the
job's watchdog."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from prime_hpc.rundir import STABLE, RunDir, jobs
from prime_hpc.rundir.fleet import read_membership
from tests.conftest import REPO, cli
from tests.integration.test_env_failures import wait_ended
from tests.runs import release_held, wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.vllm]
ENV = {"INFERENCE_SERVER_API_KEY": "together-test-key-81f3e60b2c9d4a7f", "SBATCH_EXPORT": "NONE"}
STALL_S = 60

FLAKY = REPO / "tests" / "envs" / "flaky_reverse.py"
LRS = (2e-3, 2e-2)


def _cli(*args: str):
    return cli(*args, env=ENV)


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _common(job: RunDir) -> list[str]:
    return [
        "+experiment=reverse_text",
        "cluster=dev",
        "warmup.experiment=null",
        f"output_dir={job.root}",
        "max_steps=5",
        "async_level=1",
        "ckpt.interval=5",
        "orchestrator.batch_size=16",
        "orchestrator.group_size=4",
        "orchestrator.eval.interval=0",
        "orchestrator.eval.at_start=false",
        "orchestrator.sampling.max_tokens=12",
        "orchestrator.max_errored_groups=2",
        f'orchestrator.env=[{{id: "{FLAKY}", args: {{num_train_examples: 64}}}}]',
        "trainer.micro_batch_size=8",
        "trainer.optim.schedule=constant",
        "trainer.model.lora.enabled=true",
        "trainer.model.lora.rank=8",
        f"watchdog.stall_timeout_s={STALL_S}",
    ]


def test_a_sweep_together_trains_its_runs_side_by_side_and_a_failing_run_ends_alone(tmp_path):
    """Four runs in four adapter slots; the two that fail give their slots back, and a run
    added to the running job (`--into`) takes one; `status` shows every run."""
    job = RunDir(tmp_path / "job")
    r = _cli(
        "submit",
        "-m",
        *_common(job),
        f"trainer.optim.lr={','.join(map(str, LRS))}",
        "+orchestrator.env.0.args.raise_every=0,1",
        "--together",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "4 runs together" in r.stdout and "4 at a time on one trainer" in r.stdout, r.stdout
    late = _cli("submit", *_common(job), "name=late", "trainer.optim.lr=5e-3", "--into", str(job.root))
    assert late.returncode == 0 and "added 1 run(s)" in late.stdout, late.stdout + late.stderr
    gone = _cli("submit", *_common(job), "name=gone", "--into", str(job.root))
    stop = _cli("cancel", str(job.root), "--run", "gone")  # one run alone: the others go on
    assert gone.returncode == stop.returncode == 0 and "cancelled run gone" in stop.stdout, stop.stdout + stop.stderr
    stuck = _cli(
        "submit",
        *_common(job),
        "name=stuck",
        "+orchestrator.env.0.args.constant_every=1",  # every reward the same: every group filtered
        "orchestrator.online_difficulty_filtering=true",
        "--into",
        str(job.root),
    )
    assert stuck.returncode == 0, stuck.stdout + stuck.stderr
    clash = _cli("submit", *_common(job), "name=late", "--into", str(job.root))
    assert clash.returncode == 2 and "already has run(s) late" in clash.stderr, clash.stderr
    other = _cli("submit", *_common(job), "name=other", "trainer.model.lora.rank=4", "--into", str(job.root))
    assert other.returncode == 2 and "trainer.model differs from job" in other.stderr, other.stderr
    record = wait_ended(job, 600)
    assert record["state"] == "COMPLETED", record  # two runs failed, not the job
    names = record["runs"]
    assert names == [f"reverse_text_{i}" for i in range(4)] + ["late", "gone", "stuck"]
    assert sorted(names) == job.sub_runs()
    assert json.loads(job.sub_run("gone").run_json.read_text())["state"] == "CANCELLED"
    logs = job.latest_logs.resolve()
    # the run that never wrote a step: the watchdog ended it alone, quoting its orchestrator's last line
    stalled = json.loads(job.sub_run("stuck").run_json.read_text())
    assert stalled["state"] == "FAILED", stalled
    assert stalled["reason"].startswith("orchestrator stalled: alive, but no progress for "), stalled
    assert "groups accepted after" in stalled["reason"], stalled
    assert "run stuck failed (orchestrator stalled" in (logs / "orchestrator.log").read_text()
    # the sweep's order: lr varies slowest, raise_every fastest
    points = {f"reverse_text_{i}": (LRS[i // 2], i % 2 == 1) for i in range(4)}
    points["late"] = (5e-3, False)

    adapters = {}
    for name, (lr, raises) in points.items():
        run = job.sub_run(name)
        state = json.loads(run.run_json.read_text())
        log = logs / "runs" / name / "orchestrator.log"
        if raises:  # its orchestrator failed: recorded with its last line, its slot freed
            assert state["state"] == "FAILED" and "groups in a row errored" in state["reason"], state
            assert f"run {name} failed" in (logs / "orchestrator.log").read_text()
            continue
        assert state == {**state, "state": "ENDED", "step": 5}, state
        orch, trained = _rows(run.metrics("orchestrator")), _rows(run.metrics("trainer"))
        assert [r["step"] for r in orch] == [r["step"] for r in trained] == [1, 2, 3, 4, 5], (name, log)
        assert all(abs(r["optim/lr"] - lr) < 1e-12 for r in trained)  # its own optimizer
        assert all(r["off_policy_steps/mean"] <= 1.0 for r in trained)  # its own policies, async_level=1
        meta = json.loads((run.weights_step(5) / STABLE).read_text())
        assert meta["serve"] == "adapter" and meta["merged"] is True
        assert run.complete_checkpoint_steps() == [5]  # its trainer's part and its orchestrator's
        adapters[name] = (run.weights_adapter(5) / "adapter_model.safetensors").read_bytes()
    assert len(adapters) == 3 and len(set(adapters.values())) == 3  # three learning rates, three adapters
    trainer_log = (logs / "trainer.log").read_text()
    assert all(f"run {name}: adapter slot" in trainer_log for name in adapters)  # first come, first served
    assert trainer_log.index("run late: adapter slot") > trainer_log.index("run reverse_text_2: adapter slot")
    status = _cli("status", str(job.root)).stdout
    assert "RUN" in status and all(n in status for n in names) and status.count("FAILED") == 3, status
    tail = _cli("tail", str(job.root), "-n", "3").stdout  # each run's orchestrator, by name
    assert all(f"orchestrator[{n}]" in tail for n in names if n != "gone") and "last step written: 5" in tail, tail
    plot = _cli("plot", str(job.root), "-o", str(tmp_path / "runs.png"))
    assert plot.returncode == 0 and "(7 runs)" in plot.stdout and (tmp_path / "runs.png").stat().st_size > 0, plot
    assert jobs.read_job(job)["kind"] == "rl"

    # one run resumed alone from its own checkpoint: the job is submitted again, the others
    # stay as they ended; no periodic checkpoint any more
    run0 = job.sub_run("reverse_text_0")
    again = _cli("resume", str(job.root), "--run", "reverse_text_0", "max_steps=16", "ckpt.interval=100")
    assert again.returncode == 0 and "resumed run reverse_text_0" in again.stdout, again.stdout + again.stderr
    assert "from checkpoint step 5" in again.stdout
    # the job's server dies: restarted in its slot, it gets the run's adapter from the head
    # before it is routed again, and the run trains on through it
    trained = lambda: max((r["step"] for r in _rows(run0.metrics("trainer"))), default=0)  # noqa: E731
    wait_until(lambda: trained() >= 7, 600, "step 7 of the resumed run", job)
    server = job.server_endpoints()["inference_0"]
    os.kill(int(server["pid"]), signal.SIGKILL)
    killed_at = trained()
    wait_until(
        lambda: (
            (m := read_membership(job).get("inference_0", {})).get("state") == "serving"
            and m.get("url") != server["url"]
        ),
        300,
        "the restarted server in the job's fleet",
        job,
    )
    wait_until(lambda: trained() >= killed_at + 2, 300, "two steps after the server's restart", job)
    # requeued by SLURM midway: the job's checkpoint request reaches the run's orchestrator
    # too, so the step the trainer saves on request is a complete checkpoint to go on from
    second_logs = job.latest_logs.resolve()
    subprocess.run(["scontrol", "requeue", str(jobs.read_job(job)["job_ids"][-1])], check=True, timeout=60)
    deadline = time.monotonic() + 600
    while len(attempts := jobs.read_job(job).get("attempts") or []) < 3 or not attempts[-1].get("end"):
        assert time.monotonic() < deadline, jobs.read_job(job)
        release_held(str(jobs.read_job(job)["job_ids"][-1]))
        time.sleep(1)
    record = wait_ended(job, 600)
    assert record["state"] == "COMPLETED" and len(record["attempts"]) == 3, record
    assert record["attempts"][1]["end"] == "REQUEUED", record
    saved = [s for s in run0.complete_checkpoint_steps() if 5 < s < 16]
    assert len(saved) == 1, run0.complete_checkpoint_steps()  # the step it was at, both parts
    orch_log = (second_logs / "runs" / "reverse_text_0" / "orchestrator.log").read_text()
    assert f"checkpointed step {saved[0]} as asked" in orch_log, orch_log[-2000:]
    assert "inference server inference_0 (" in orch_log and "joined the job's fleet at this run's policy" in orch_log
    head_log = (second_logs / "orchestrator.log").read_text()
    assert "inference server inference_0 (" in head_log and "joined at policy 0" in head_log, head_log[-2000:]
    rows = _rows(run0.metrics("trainer"))
    assert [r["step"] for r in rows] == list(range(1, 17)), rows
    assert "time/load_ckpt" in rows[5] and "time/load_ckpt" in rows[saved[0]], rows
    assert json.loads(run0.run_json.read_text())["step"] == 16
    assert [r["step"] for r in _rows(job.sub_run("late").metrics("trainer"))] == [1, 2, 3, 4, 5]
    third = (job.latest_logs.resolve() / "trainer.log").read_text()
    assert f"run reverse_text_0: resumed from {run0.checkpoint_part(saved[0], 'trainer')}" in third
    assert "run late:" not in third
    nope = _cli("resume", str(job.root), "--run", "nosuch")
    assert nope.returncode == 2 and "has the runs reverse_text_0" in nope.stderr, nope.stderr
