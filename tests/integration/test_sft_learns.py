"""The shipped SFT recipe, `prime-hpc submit +experiment=reverse_text_sft` on the dev
cluster with a time limit shorter than the run: at the warning before the time limit the
trainer checkpoints, the same job goes back to the queue and the next attempt continues
where it stopped; no step or sample is lost or trained twice. (Once the job is back in the
queue its limit is raised, as an admin could, so that the second attempt finishes: two
attempts prove the hand-over, a third would only cost time.) Then `prime-hpc eval`, a job
of the dev cluster, of the base model and every saved step, greedy, on held-out strings:
the offline tiny model learned to reverse them."""

from __future__ import annotations

import json
import subprocess

import pytest

from prime_hpc.rundir import RunDir, jobs
from tests.conftest import cli
from tests.integration.test_slurm_lifecycle import _rows, _wait
from tests.runs import release_held

pytestmark = [pytest.mark.slurm, pytest.mark.vllm]


def test_reverse_text_sft_outlives_its_time_limit_and_reaches_80_of_100_exact_reversals(tmp_path):
    out = tmp_path / "sft"
    r = cli(
        "submit",
        "+experiment=reverse_text_sft",
        "cluster=dev",
        f"output_dir={out}",
        "cluster.time=3",
        "cluster.signal_delay_s=75",  # warned 105 s into the first attempt: after a first checkpointable step
    )
    assert r.returncode == 0, r.stderr
    run = RunDir(out)
    job_id = jobs.read_job(run)["job_ids"][-1]
    raised = []

    def raise_limit_once_requeued() -> bool:
        if not raised and jobs.read_job(run).get("requeues"):
            r = subprocess.run(
                ["scontrol", "update", f"JobId={job_id}", "TimeLimit=30"], capture_output=True, timeout=60
            )
            assert r.returncode == 0, r.stderr
            raised.append(job_id)
        return False

    try:
        _wait(
            lambda: (
                raise_limit_once_requeued()
                or release_held(job_id)
                or jobs.read_job(run).get("state") in jobs.FINAL_STATES
            ),
            1500,
            "the end of the run",
            run,
            poll_s=2,
        )
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=60)
    job = jobs.read_job(run)
    ends = [a["end"] for a in job["attempts"]]
    assert job["state"] == "COMPLETED" and len(ends) == 2, job
    assert ends[:-1] == ["TIMEOUT"] * (len(ends) - 1) and ends[-1] == "COMPLETED"
    assert job["requeues"] == len(ends) - 1 and job["job_ids"] == [job_id]  # the same job, requeued
    assert job["groups"] == ["trainer"] and not (out / "configs" / "inference.yaml").exists()
    # each attempt continued from the step the previous one checkpointed when warned
    resumed = [a["resumed_from"] for a in job["attempts"]]
    assert resumed[0] is None and all(b > (a or 0) for a, b in zip(resumed, resumed[1:]))
    rows = [r for r in _rows(run, "trainer") if "loss/mean" in r]
    final = run.weight_steps()[-1]
    assert final == 1000 and [r["step"] for r in rows] == list(range(1, final + 1))
    # no sample trained twice or skipped: the data position continues across attempts
    samples = [r["progress/num_samples"] for r in rows]
    assert all(b > a for a, b in zip(samples, samples[1:]))
    # `prime-hpc eval` of a dev-cluster run is a job of its own: the run's inference node and
    # the eval runner, its files in <run>/eval/job; the base model is scored first (greedy:
    # pass@1 is the share of exact reversals, avg@1 the mean LCS ratio)
    e = cli(
        "eval",
        str(out),
        "orchestrator.sampling.temperature=0",
        "orchestrator.eval.rollouts_per_example=1",
        timeout=900,
    )
    assert e.returncode == 0, e.stdout + e.stderr
    assert "submitted eval job" in e.stdout
    eval_job = RunDir(run.eval_dir / "job")
    record = jobs.read_job(eval_job)
    assert (record["kind"], record["state"], record["groups"]) == ("eval", "COMPLETED", ["orchestrator", "inference"])
    assert not list(eval_job.endpoints_dir.glob("*.json")), "the eval job's servers are gone"
    status = cli("status", str(record["job_ids"][-1]))
    assert status.returncode == 0 and "eval" in status.stdout, status.stdout + status.stderr
    base = json.loads(run.eval_result(0).read_text())
    result = json.loads(run.eval_result(final).read_text())
    assert result["eval/reverse_text/pass@1"] >= 0.80, result
    assert result["eval/reverse_text/avg@1"] >= 0.90, result
    assert base["eval/reverse_text/pass@1"] <= 0.05 < result["eval/reverse_text/pass@1"], base
    assert sorted(int(p.name.split("_")[1].split(".")[0]) for p in run.eval_dir.glob("step_*.json")) == sorted(
        {0, *run.weight_steps()}
    )
    # every rollout, as a person reads it: the greedy completion of an exact reversal is the prompt reversed
    samples = [json.loads(line) for line in run.eval_samples(final).read_text().splitlines()]
    assert len(samples) == 100 and {s["step"] for s in samples} == {final}
    exact = [s for s in samples if s["reward"] == 1.0]
    assert len(exact) / len(samples) == pytest.approx(result["eval/reverse_text/pass@1"])
    assert all(s["prompt"][::-1] in s["completion"] for s in exact), exact[:3]
    assert all(s["error"] is None and 0.0 <= s["reward"] <= 1.0 for s in samples)
