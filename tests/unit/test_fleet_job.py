"""A run whose inference servers run in a job of their own (`cluster.inference_job=own`):
its het job holds the head (orchestrator and router) and the trainer, placed and pinned as
with the servers beside them; the servers' job is an extra inference job that waits for what
the run waits for; the orchestrator and the router wait for that many servers of any slot;
a backend without extra jobs refuses it in one line."""

from __future__ import annotations

import json
import re

import pytest

from prime_hpc.config.compose import compose
from prime_hpc.config.validate import check_slurm, validate
from prime_hpc.core.errors import ConfigError
from prime_hpc.inference.client import wait_for_servers
from prime_hpc.launcher.plan import After, inference_job_plan, make_plan
from prime_hpc.launcher.render import render_inference, render_sbatch
from prime_hpc.rundir import RunDir
from prime_hpc.rundir.files import WaitTimeout
from prime_hpc.rundir.layout import server_slot

RL = ["+experiment=reverse_text", "cluster=dev", "output_dir=/shared/runs/rt", "cluster.inference.nodes=2"]


def plans(*extra: str):
    het = make_plan(compose([*RL, *extra]), python="/opt/venv/bin/python", cores=[0, 1])
    own = make_plan(compose([*RL, "cluster.inference_job=own", *extra]), python="/opt/venv/bin/python", cores=[0, 1])
    return het, own


def test_the_runs_job_holds_the_head_and_the_trainer_placed_as_beside_the_servers():
    het, own = plans()
    assert het.group_names == ["orchestrator", "inference", "trainer"] and het.fleet_nodes == 0
    assert own.group_names == ["orchestrator", "trainer"] and own.fleet_nodes == 2
    for name in ("orchestrator", "trainer"):  # the same pinning: the servers' share is not given away
        assert own.group(name).cpu_ids == het.group(name).cpu_ids, name
        assert own.group(name).env == het.group(name).env, name
    assert own.watchdog_argv == het.watchdog_argv and "--server-stall-timeout-s" in own.watchdog_argv
    text = render_sbatch(own)
    assert "start_inference() {" not in text and '--job-name="inference_' not in text
    assert "inference servers run in a job of their own (2 node(s), cluster.inference_job=own)" in text
    router = [line for line in text.splitlines() if "prime_hpc.inference.router" in line]
    assert len(router) == 1 and "--het-group=0 " in text and "--het-group=2" not in text
    assert re.search(r"^PIDS\[router\]=\$!; SERVICE\[router\]=1$", text, re.M)


def test_the_servers_job_is_the_runs_inference_group_and_waits_for_what_the_run_waits_for():
    cfg = compose([*RL, "cluster.inference_job=own"])
    job = inference_job_plan(cfg, 2, python="/opt/venv/bin/python", cores=[0, 1])
    het, _ = plans()
    assert job.nodes == 2 and job.group.cpu_ids == het.group("inference").cpu_ids
    assert job.group.argv == het.group("inference").argv
    plain = render_inference(job)
    assert "#SBATCH --no-kill" in plain and "--dependency" not in plain  # several nodes: one may fail alone
    assert "--exclusive" not in plain  # an extra job of `scale` shares nodes as SLURM allows
    fleet = render_inference(inference_job_plan(cfg, 2, python="/opt/venv/bin/python", cores=[0, 1], fleet=True))
    assert "#SBATCH --exclusive\n" in fleet  # the run's own servers: no node shared with the run's job
    after = render_inference(
        inference_job_plan(cfg, 2, python="/opt/venv/bin/python", cores=[0, 1], after=[After("41", "/w")])
    )
    assert "#SBATCH --dependency=afterok:41\n#SBATCH --kill-on-invalid-dep=yes\n" in after


def test_a_backend_without_extra_jobs_refuses_it_in_one_line():
    with pytest.raises(ConfigError) as e:
        validate(compose(["+experiment=reverse_text", "cluster=local", "cluster.inference_job=own"]), (check_slurm,))
    assert e.value.key == "cluster.inference_job" and "\n" not in str(e.value)
    # an SFT run has no servers: nothing to refuse
    validate(compose(["+experiment=reverse_text_sft", "cluster=local", "cluster.inference_job=own"]), (check_slurm,))


def test_the_servers_of_another_job_are_waited_for_one_then_all_or_a_while(tmp_path, monkeypatch):
    from prime_hpc.inference import client

    monkeypatch.setattr(client, "OWN_SETTLE_S", 1.0)
    run = RunDir(tmp_path / "run")
    run.endpoints_dir.mkdir(parents=True)
    slots = [server_slot(n, "77") for n in range(2)]
    with pytest.raises(WaitTimeout):  # none: the run's inference job is named
        wait_for_servers(run, 2, 0.5, own_job=True)
    run.inference_endpoint(slots[0]).write_text(json.dumps({"slot": slots[0], "url": "http://127.0.0.1:1"}))
    assert [r["slot"] for r in wait_for_servers(run, 2, 5, own_job=True)] == slots[:1]  # one lost: after a while
    run.inference_endpoint(slots[1]).write_text(json.dumps({"slot": slots[1], "url": "http://127.0.0.1:2"}))
    assert [r["slot"] for r in wait_for_servers(run, 2, 5, own_job=True)] == slots
    with pytest.raises(WaitTimeout):  # the run's own slots are what a het run waits for
        wait_for_servers(run, 1, 0.5)


def test_only_a_requeued_attempt_submits_missing_server_jobs_again():
    """The first attempt of a job may start while `submit` (or `resume`) is still
    submitting the servers' jobs: topping up then would submit them twice. A requeued
    attempt of the same job tops up; a run without jobs of its own never does."""
    from prime_hpc.job.attempt import tops_up_fleet

    first = {"fleet_nodes": 2, "attempts": [{"job_id": "41"}]}
    assert not tops_up_fleet(first, "41")
    requeued = {"fleet_nodes": 2, "attempts": [{"job_id": "41"}, {"job_id": "41"}]}
    assert tops_up_fleet(requeued, "41")
    resumed = {"fleet_nodes": 2, "attempts": [{"job_id": "41"}, {"job_id": "57"}]}  # a new job: its submitter's
    assert not tops_up_fleet(resumed, "57")
    assert not tops_up_fleet({"attempts": [{"job_id": "41"}, {"job_id": "41"}]}, "41")
