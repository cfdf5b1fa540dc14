"""The supervisor's own verdict on a lost node, without a cluster: which SLURM node states
say a node is lost to its job (`sched.slurm.node_failed`, on the strings `sinfo -o %T`
prints: SLURM's `node_state_string`, lowercased, and the `+`-joined form of `scontrol show
node`), which nodes of an `sinfo` listing are lost (`failed_nodes`), and what an attempt
that a component ended with its node records (`job.attempt.node_lost`, then `requeue`
NODE_FAIL): the nodes, named by the attempt's end and by the run's failure past
`cluster.max_requeues`; and a restarted attempt that first stops what an earlier one still
runs (`attempt.stop_leftovers`). The dev cluster's run is
`tests/integration/test_node_loss.py`."""

from __future__ import annotations

import pytest
import yaml

from prime_hpc.core.errors import UserError
from prime_hpc.job import attempt
from prime_hpc.rundir import RunDir, atomic_write_json, jobs
from prime_hpc.sched.slurm import Slurm, component_ids, failed_nodes, node_failed

LOST = [
    "down",
    "down*",
    "DOWN",
    "down~",  # down and powered off
    "drain",  # `sinfo -o %t`'s short form
    "drained",
    "draining",  # drained while the job still runs on it (a health check's verdict)
    "draining*",
    "drained@",
    "failing",
    "fail",
    "fail*",
    "idle*",  # not responding: its slurmd is gone (a trailing `*`, whatever the state)
    "mixed*",
    "allocated*",
    "completing*",
    "unknown",
    "powered_down",
    "mixed+drain",  # `scontrol show node` / `sinfo -O StateComplete`
    "ALLOCATED+DRAIN",
    "idle+not_responding",
    "mixed+fail",
    "down+not_responding",
    " down \n",
]
UP = [
    "allocated",
    "mixed",
    "idle",
    "completing",
    "allocated+",  # completing a job
    "allocated#",  # powering up for the job
    "mixed@",  # a reboot asked for once its jobs end
    "idle~",  # powered off, idle
    "reserved",
    "planned",
    "mixed+planned",
    "allocated+completing",
    "idle+cloud+powered_down",
    "",
]


@pytest.mark.parametrize("state", LOST)
def test_a_node_down_drained_failing_or_not_responding_is_lost(state):
    assert node_failed(state), state


@pytest.mark.parametrize("state", UP)
def test_a_node_that_works_for_the_job_is_not_lost(state):
    assert not node_failed(state), state


def test_the_lost_nodes_of_an_sinfo_listing():
    out = "node1 mixed\nnode1 mixed\nnode2 draining\nnode2 draining\nnode3 idle*\nnode4 allocated\n\nnode5\n"
    assert failed_nodes(out) == {"node2": "draining", "node3": "idle*"}
    assert failed_nodes("") == {}


def _running(run: RunDir, max_requeues: int, requeues: int = 0) -> None:
    run.root.mkdir(parents=True, exist_ok=True)
    run.config_yaml.write_text(yaml.safe_dump({"cluster": {"max_requeues": max_requeues}}))
    done = [{"attempt": 0, "job_id": "7", "started_at": 1.0, "ended_at": 2.0, "end": "TIMEOUT"}]
    atomic_write_json(
        run.job_json,
        {
            "backend": "slurm",
            "state": "RUNNING",
            "job_ids": ["7"],
            "requeues": requeues,
            "attempts": [*done, {"attempt": 1, "job_id": "7", "started_at": 3.0}],
        },
    )


def test_a_component_that_died_with_its_node_ends_the_attempt_naming_the_node(tmp_path, monkeypatch):
    run = RunDir(tmp_path / "run")
    _running(run, max_requeues=2)
    monkeypatch.setattr(Slurm, "down_nodes", lambda self, job_id: [])
    assert attempt.node_lost(run, "7") is None  # every node up: the component failed on its own
    assert "down_nodes" not in jobs.read_job(run)["attempts"][-1]

    monkeypatch.setattr(Slurm, "down_nodes", lambda self, job_id: ["node3"])
    monkeypatch.setattr(Slurm, "requeue", lambda self, job_id: "")
    assert attempt.node_lost(run, "7") == "prime-hpc: node(s) of the job down: node3"
    message, requeued = attempt.requeue(run, "7", "NODE_FAIL")
    job = jobs.read_job(run)
    assert requeued and "requeue 1 of at most 2" in message, message
    last = job["attempts"][-1]
    assert (last["end"], last["reason"], last["down_nodes"]) == (
        "NODE_FAIL",
        "node(s) of the job down: node3",
        ["node3"],
    )
    assert "reason" not in job["attempts"][0]  # an earlier attempt is left as it ended
    assert job["state"] == "REQUEUED" and job["requeues"] == 1, job


def test_a_node_lost_past_the_requeue_cap_ends_the_run_naming_the_node(tmp_path, monkeypatch):
    run = RunDir(tmp_path / "run")
    _running(run, max_requeues=1, requeues=1)
    monkeypatch.setattr(Slurm, "down_nodes", lambda self, job_id: ["node2", "node4"])
    attempt.node_lost(run, "7")
    message, requeued = attempt.requeue(run, "7", "NODE_FAIL")  # past the limit: SLURM is not asked
    job = jobs.read_job(run)
    assert not requeued and job["state"] == "NODE_FAIL", job
    assert job["failure"]["reason"].startswith(
        "NODE_FAIL: not requeued (node(s) of the job down: node2, node4) (cluster.max_requeues=1 reached)"
    ), job["failure"]
    assert message.startswith("prime-hpc: NODE_FAIL: not requeued (node(s) of the job down: node2, node4)"), message


def test_other_ends_name_no_node(tmp_path, monkeypatch):
    """A node recorded down in an attempt that then ends otherwise (its time limit came
    first) is not named by that end; nor is one of an attempt already ended."""
    run = RunDir(tmp_path / "run")
    _running(run, max_requeues=2)
    monkeypatch.setattr(Slurm, "down_nodes", lambda self, job_id: ["node3"])
    monkeypatch.setattr(Slurm, "requeue", lambda self, job_id: "")
    attempt.node_lost(run, "7")
    attempt.requeue(run, "7", "TIMEOUT")
    assert jobs.read_job(run)["attempts"][-1]["reason"] is None
    assert attempt.node_lost(run, "7") is not None  # said, but recorded in no ended attempt
    assert jobs.read_job(run)["attempts"][0].get("down_nodes") is None


def test_the_components_of_a_job_from_scontrol():
    out = (
        "JobId=65 HetJobId=65 HetJobOffset=0 JobName=run JobState=RUNNING NodeList=node3\n"
        "JobId=66 HetJobId=65 HetJobOffset=1 JobName=run JobState=RUNNING NodeList=node4\n"
    )
    assert component_ids(out) == ["65", "66"]
    assert component_ids("JobId=7 JobName=sft NodeList=node1\n") == ["7"] and component_ids("") == []


def test_a_restarted_attempt_stops_what_an_earlier_one_still_runs_before_it_starts(tmp_path, monkeypatch, capsys):
    """SLURM requeued only the head's component after its node failed: the trainer's step of
    the attempt before still runs. It is stopped, and said, before the new attempt reads
    the run; the attempt starts."""
    run = RunDir(tmp_path / "run")
    _running(run, max_requeues=2)
    asked = []
    monkeypatch.setattr(Slurm, "stop_leftovers", lambda self, job_id: asked.append(job_id) or (["66.2"], []))
    logs = attempt.start(run, "7")
    assert asked == ["7"] and "prime-hpc: stopped what an earlier attempt of job 7 still ran: steps 66.2" in (
        capsys.readouterr().err
    )
    job = jobs.read_job(run)
    assert job["state"] == "RUNNING" and job["attempts"][-1]["logs"] == logs, job
    assert job["attempts"][1]["end"] == "NODE_FAIL", job  # the attempt its job script could not record


def test_steps_of_an_earlier_attempt_that_do_not_stop_fail_the_run_naming_them(tmp_path, monkeypatch):
    run = RunDir(tmp_path / "run")
    _running(run, max_requeues=2)
    monkeypatch.setattr(Slurm, "stop_leftovers", lambda self, job_id: (["66.2", "66.3"], ["66.3"]))
    with pytest.raises(UserError, match=r"steps of an earlier attempt of job 7 still run after SIGKILL: 66.3; "):
        attempt.start(run, "7")
    job = jobs.read_job(run)
    assert job["state"] == "FAILED" and "66.3" in job["failure"]["reason"] and len(job["attempts"]) == 2, job
    assert not run.logs_root.exists()  # nothing of the attempt started
