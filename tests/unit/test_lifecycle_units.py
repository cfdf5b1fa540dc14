"""Pure rules of a run's lifecycle, without a cluster or vLLM: advantages, admission of new
groups, placement on cores and addresses, end of data, resume points and metrics
clean-up, recorded configs with overrides, and the stop decision of a component."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import yaml

from prime_hpc.config.compose import compose, recorded_config
from prime_hpc.config.overrides import override
from prime_hpc.config.schema import EnvEntry
from prime_hpc.core.errors import UserError
from prime_hpc.core.net import address_env, node_address
from prime_hpc.job import attempt
from prime_hpc.launcher.plan import group_cpus, group_env, job_groups, make_plan, one_host_cores
from prime_hpc.orchestrator.envs import EnvSampler, EnvSlot
from prime_hpc.orchestrator.loop import Orchestrator
from prime_hpc.orchestrator.rollouts import advantages
from prime_hpc.orchestrator.source import GroupSource
from prime_hpc.rundir import RunDir, atomic_write_json, jobs, logtree, mark_stable, truncate_jsonl
from prime_hpc.runtime import stopping


# --------------------------------------------------------------------------- advantages
def test_advantage_variants_by_hand():
    rewards = [1.0, 0.0, 0.5, 0.5]  # mean 0.5, population std sqrt(0.125) = 0.353553
    assert advantages(rewards, "mean") == [0.5, -0.5, 0.0, 0.0]
    std = [round(a, 4) for a in advantages(rewards, "std")]
    assert std == [1.4142, -1.4142, 0.0, 0.0]
    # leave one out: 1 - mean(0, .5, .5) = 2/3; 0 - mean(1, .5, .5) = -2/3; .5 - mean(1, 0, .5) = 0
    assert [round(a, 4) for a in advantages(rewards, "loo")] == [0.6667, -0.6667, 0.0, 0.0]
    assert advantages([0.3, 0.3], "std") == [0.0, 0.0]  # no spread: no signal, no division by zero
    with pytest.raises(ValueError):
        advantages(rewards, "median")


# --------------------------------------------------------------------------- admission window
class _Window:
    """The attributes `GroupSource.admission_limit` reads."""

    def __init__(self, policy, k=2, groups_per_step=8, max_groups=32, max_steps=None, oversampling=1.0):
        self.policy = lambda: policy
        self.async_level, self.groups_per_step, self.max_groups, self.max_steps = (
            k,
            groups_per_step,
            max_groups,
            max_steps,
        )
        self.oversampling = oversampling


def test_groups_are_admitted_only_as_far_as_the_async_window_can_use_them():
    limit = GroupSource.admission_limit
    # policy 3, async_level 2: a group started now can train steps 4 and 5 -> 16 groups
    assert limit(_Window(policy=3), step=4, accepted=0, waiting=0) == 16
    assert limit(_Window(policy=3), step=4, accepted=5, waiting=3) == 8
    # the step being filled is already beyond what policy 3 may feed: nothing is started
    assert limit(_Window(policy=3), step=6, accepted=0, waiting=0) == 0
    # never past max_steps, never more than max_concurrent allows
    assert limit(_Window(policy=9, max_steps=10), step=10, accepted=0, waiting=0) == 8
    assert limit(_Window(policy=50, k=8), step=51, accepted=0, waiting=0) == 32
    # fully on-policy: only the current step
    assert limit(_Window(policy=4, k=1), step=5, accepted=2, waiting=1) == 5
    # oversampling 1.5: half as many groups again, rounded up (8 x 1.5 = 12, less the 3 in hand)
    assert limit(_Window(policy=4, k=1, oversampling=1.5), step=5, accepted=2, waiting=1) == 9
    assert limit(_Window(policy=4, k=1, oversampling=1.3), step=5, accepted=0, waiting=0) == 11  # ceil(10.4)


# --------------------------------------------------------------------------- placement
def test_one_host_cores_give_trainer_and_inference_their_own_cores_unless_they_take_turns():
    three = ["orchestrator", "inference", "trainer"]
    assert one_host_cores([0, 1], three, take_turns=True) == {name: [0, 1] for name in three}
    assert one_host_cores([0, 1], three) == {"orchestrator": [0], "inference": [0], "trainer": [1]}
    assert one_host_cores([0, 1, 2, 3, 4], three)["trainer"] == [3, 4]
    assert one_host_cores([0, 1, 2, 3], ["trainer"]) == {"trainer": [0, 1, 2, 3]}  # SFT: all of them
    assert one_host_cores([0], three) == {name: [0] for name in three}


def test_groups_threads_and_pinning_follow_the_config(tmp_path):
    cfg = compose(["+experiment=reverse_text", f"output_dir={tmp_path}", "warmup.experiment=null", "async_level=2"])
    assert job_groups(cfg) == ["orchestrator", "inference", "trainer"]
    assert group_cpus(cfg, job_groups(cfg), cores=[0, 1]) == {"orchestrator": "0", "inference": "0", "trainer": "1"}
    recipe = compose(["+experiment=reverse_text", f"output_dir={tmp_path}", "warmup.experiment=null"])
    assert recipe.async_level == 3  # generation overlaps training: cores of their own
    assert group_cpus(recipe, job_groups(recipe), cores=[0, 1]) == {
        "orchestrator": "0",
        "inference": "0",
        "trainer": "1",
    }
    on_policy = compose(
        ["+experiment=reverse_text", f"output_dir={tmp_path}", "warmup.experiment=null", "async_level=1"]
    )  # generation and training take turns: each gets both cores
    assert group_cpus(on_policy, job_groups(on_policy), cores=[0, 1]) == {name: "0,1" for name in job_groups(cfg)}
    sft = compose(["+experiment=reverse_text_sft", f"output_dir={tmp_path}"])
    assert job_groups(sft) == ["trainer"] and job_groups(sft, "doctor") == ["orchestrator", "trainer"]
    assert group_env("trainer", "0-3", 1, 2, "cpu") == {"OMP_NUM_THREADS": "2", "PRIME_HPC_CPUS": "0-3"}
    assert group_env("inference", None, 16, 1, "cpu") == {"OMP_NUM_THREADS": "16"}  # SLURM's cpus_per_task
    assert group_env("orchestrator", "0", 1, 1, "cpu")["OMP_NUM_THREADS"] == "1"
    plan = make_plan(sft, cores=[0, 1])
    assert plan.group_names == ["trainer"] and not plan.het and plan.kind == "sft"
    assert plan.group("trainer").prefix == ["env", "OMP_NUM_THREADS=2", "PRIME_HPC_CPUS=0,1", "taskset", "-c", "0,1"]
    slurm = compose(["+experiment=reverse_text", "cluster=slurm", f"output_dir={tmp_path}", "warmup.experiment=null"])
    assert all(g.cpu_ids is None for g in make_plan(slurm).groups)  # a real cluster: SLURM binds


def test_gpus_are_split_between_inference_and_trainer_on_one_node(tmp_path):
    from prime_hpc.config.validate import validate
    from prime_hpc.launcher.render import render_local

    one_node = [
        "+experiment=reverse_text",
        "cluster=local",
        "cluster.device=cuda",
        f"output_dir={tmp_path}/a",
        "cluster.inference.gpus_per_node=2",
        "cluster.trainer.gpus_per_node=4",
    ]
    plan = make_plan(compose(one_node), cores=[0, 1])
    assert plan.group("inference").env["CUDA_VISIBLE_DEVICES"] == "0,1"  # the first GPUs ...
    assert plan.group("trainer").env["CUDA_VISIBLE_DEVICES"] == "2,3,4,5"  # ... and the next, never shared
    assert "CUDA_VISIBLE_DEVICES" not in plan.group("orchestrator").env
    text = render_local(plan, "local-1")
    assert "CUDA_VISIBLE_DEVICES=0,1" in text and "CUDA_VISIBLE_DEVICES=2,3,4,5" in text
    # chosen by hand (validated: as many as gpus_per_node, no overlap), also on SLURM
    chosen = compose(
        [
            *one_node[:-2],
            "cluster.inference.gpus_per_node=2",
            "cluster.trainer.gpus_per_node=2",
            "cluster.inference.gpu_ids=6-7",
            "cluster.trainer.gpu_ids='0,3'",
        ]
    )
    validate(chosen)
    plan = make_plan(chosen, cores=[0, 1])
    assert plan.group("inference").env["CUDA_VISIBLE_DEVICES"] == "6,7"
    assert plan.group("trainer").env["CUDA_VISIBLE_DEVICES"] == "0,3"
    slurm = make_plan(compose(["+experiment=reverse_text", "cluster=slurm", f"output_dir={tmp_path}/b"]), cores=[0, 1])
    assert all("CUDA_VISIBLE_DEVICES" not in g.env for g in slurm.groups)  # SLURM binds the allocation's GPUs
    cpu = make_plan(compose(["+experiment=reverse_text", "cluster=local", f"output_dir={tmp_path}/c"]), cores=[0, 1])
    assert all("CUDA_VISIBLE_DEVICES" not in g.env for g in cpu.groups)


def test_one_host_runs_use_loopback_and_real_clusters_the_nodes_address(tmp_path, monkeypatch):
    monkeypatch.delenv("PRIME_HPC_NODE_ADDRESS", raising=False)
    for cluster in ("local", "dev"):
        cfg = compose(["+experiment=reverse_text", f"cluster={cluster}", f"output_dir={tmp_path}"])
        env = make_plan(cfg, cores=[0, 1]).env
        assert env["PRIME_HPC_NODE_ADDRESS"] == "127.0.0.1" and env["GLOO_SOCKET_IFNAME"] == "lo"
        assert env["VLLM_HOST_IP"] == "127.0.0.1"  # vLLM's engine/worker connections too
    slurm = compose(["+experiment=reverse_text", "cluster=slurm", f"output_dir={tmp_path}"])
    assert "PRIME_HPC_NODE_ADDRESS" not in make_plan(slurm).env
    assert address_env(None) == {} and address_env("10.0.0.5") == {
        "PRIME_HPC_NODE_ADDRESS": "10.0.0.5",
        "VLLM_HOST_IP": "10.0.0.5",
    }
    assert node_address("127.0.0.1") == "127.0.0.1"
    monkeypatch.setenv("PRIME_HPC_NODE_ADDRESS", "127.0.0.1")
    assert node_address() == "127.0.0.1"


# --------------------------------------------------------------------------- end of data
def _slots(sizes):
    return [
        EnvSlot(
            name=f"e{i}", entry=EnvEntry(id=f"e{i}", ratio=1.0), env=None, rows=[{"example_id": j} for j in range(n)]
        )
        for i, n in enumerate(sizes)
    ]


def test_one_epoch_sampler_serves_every_task_once_then_stops():
    s = EnvSampler(_slots([3, 5]), seed=0, epochs=1)
    seen = []
    while (picked := s.next()) is not None:
        seen.append((picked[0].name, picked[1]["example_id"]))
        assert s.remaining() == 8 - len(seen)
    assert sorted(seen) == sorted([("e0", i) for i in range(3)] + [("e1", i) for i in range(5)])
    assert s.exhausted()
    endless = EnvSampler(_slots([2]), seed=0)
    assert all(endless.next() is not None for _ in range(10)) and not endless.exhausted()
    assert endless.remaining() is None
    two = EnvSampler(_slots([2]), seed=0, epochs=2)
    assert two.remaining() == 4 and two.next() and two.next() and two.next() and two.remaining() == 1


# --------------------------------------------------------------------------- resume points
def _complete_checkpoint(run: RunDir, step: int, parts=("trainer", "orchestrator")):
    for part in parts:
        d = run.checkpoint_part(step, part)
        d.mkdir(parents=True, exist_ok=True)
        mark_stable(d)


def _write_configs(run: RunDir, kind: str = "rl", step=None):
    for comp in ("trainer", "orchestrator") if kind == "rl" else ("trainer",):
        atomic_write_json(run.component_config(comp), {"ckpt": {"step": step}, "trainer": {"type": kind}})


def test_resume_point_clears_later_state_and_tells_every_component(tmp_path):
    run = RunDir(tmp_path)
    _write_configs(run, step=-1)
    for s in (5, 10):
        _complete_checkpoint(run, s)
    _complete_checkpoint(run, 12, parts=("trainer",))  # torn: no orchestrator part
    for s in range(1, 13):
        mark_stable(run.weights_step(s))
    mark_stable(run.rollout_step(13))
    atomic_write_json(run.rollouts_done, {"last_step": 12})
    run.metrics_dir.mkdir()
    run.metrics("trainer").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(0, 13)) + "torn{")
    assert attempt.resume_point(run, restarted=False) == 10
    assert run.weight_steps() == list(range(1, 11)) and run.rollout_steps() == []
    assert not run.rollouts_done.exists() and not run.checkpoint_step(12).exists()
    assert [json.loads(x)["step"] for x in run.metrics("trainer").read_text().splitlines()] == list(range(0, 11))
    for comp in ("trainer", "orchestrator"):
        assert yaml.safe_load(run.component_config(comp).read_text())["ckpt"]["step"] == 10


def test_a_requeue_before_any_checkpoint_starts_over_and_a_bad_step_is_refused(tmp_path):
    run = RunDir(tmp_path)
    _write_configs(run, kind="sft", step=None)
    mark_stable(run.weights_step(3))
    run.metrics_dir.mkdir()
    run.metrics("trainer").write_text('{"step": 0, "val/loss": 4.6}\n{"step": 1}\n')
    assert attempt.resume_point(run, restarted=True) is None
    assert run.weight_steps() == [] and run.metrics("trainer").read_text() == ""  # step 0 is redone too
    _write_configs(run, kind="sft", step=7)
    _complete_checkpoint(run, 4, parts=("trainer",))
    with pytest.raises(UserError, match=r"ckpt.step=7: no complete checkpoint at step 7 .*complete checkpoints: \[4\]"):
        attempt.resume_point(run, restarted=False)


def _stopping_run(run: RunDir, job_id: str, max_requeues: int, requeues: int) -> None:
    run.root.mkdir(parents=True, exist_ok=True)
    run.config_yaml.write_text(yaml.safe_dump({"cluster": {"max_requeues": max_requeues}}))
    attempts = [
        {"attempt": k, "job_id": job_id, "started_at": 1.0, "ended_at": 2.0, "end": "REQUEUED"} for k in range(requeues)
    ] + [{"attempt": requeues, "job_id": job_id, "started_at": 3.0}]
    atomic_write_json(
        run.job_json,
        {"backend": "slurm", "state": "RUNNING", "job_ids": [job_id], "requeues": requeues, "attempts": attempts},
    )


@pytest.mark.parametrize("reason, state", [("TIMEOUT", "TIMEOUT"), ("PREEMPTED", "PREEMPTED"), ("REQUEUED", "FAILED")])
def test_a_run_past_its_requeues_ends_and_is_not_started_again(tmp_path, reason, state):
    run = RunDir(tmp_path / "run")
    _stopping_run(run, "42", max_requeues=1, requeues=1)
    message, requeued = attempt.requeue(run, "42", reason)  # past the limit: SLURM is not asked
    job = jobs.read_job(run)
    assert not requeued and "cluster.max_requeues=1 reached" in message, message
    assert job["state"] == state and job["requeues"] == 1 and job["attempts"][-1]["end"] == reason
    assert "cluster.max_requeues=1 reached" in job["failure"]["reason"]
    assert f"continue with: prime-hpc resume {run.root}" in job["failure"]["reason"]
    before = run.job_json.read_text()
    with pytest.raises(UserError, match=r"requeued after it had reached cluster.max_requeues=1; not continued"):
        attempt.start(run, "42")  # SLURM brought the job back all the same (a requeue it did itself)
    assert run.job_json.read_text() == before and not run.logs_root.exists()


def test_requeues_by_slurm_count_against_the_limit(tmp_path):
    run = RunDir(tmp_path / "run")
    _stopping_run(run, "42", max_requeues=2, requeues=0)
    message, requeued = attempt.requeue(run, "42", "REQUEUED")  # scontrol requeue: SLURM requeued it already
    assert requeued and "requeue 1 of at most 2" in message
    assert jobs.read_job(run)["requeues"] == 1 and jobs.read_job(run)["state"] == "REQUEUED"


def test_truncate_jsonl_keeps_only_accepted_rows(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"step": 1}\n{"step": 2}\n')
    assert not truncate_jsonl(p, lambda r: r["step"] <= 2)
    assert truncate_jsonl(p, lambda r: r["step"] <= 1) and p.read_text() == '{"step": 1}\n'


# --------------------------------------------------------------------------- recorded configs
def test_recorded_config_takes_typed_overrides_and_refuses_the_rest(tmp_path):
    from prime_hpc.config.dump import to_yaml

    cfg = compose(["+experiment=reverse_text", f"output_dir={tmp_path}/run"])
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(cfg))
    got = recorded_config(path, ["max_steps=40", "ckpt.step=-1", "trainer.optim.lr=5e-4"])
    assert (got.max_steps, got.ckpt.step, got.trainer.optim.lr) == (40, -1, 5e-4)
    assert got.output_dir == cfg.output_dir
    for bad, needle in (
        (["max_steps=many"], "max_steps"),
        (["trainer.optim.rate=1"], "unknown key"),
        (["cluster=dev"], "cannot be switched"),
        ([f"output_dir={tmp_path}/x"], "keeps its directory"),
    ):
        with pytest.raises(UserError, match=needle):
            recorded_config(path, bad)


def test_override_quotes_any_value():
    for value in ("/tmp/we ird 'q\" ; $(x)", "back\\", "a\\'b", "é ü"):
        assert compose([override("name", value)]).name == value


# --------------------------------------------------------------------------- stopping
def test_stop_decision_after_sigterm_waits_for_the_supervisor(tmp_path, monkeypatch):
    monkeypatch.setattr(stopping, "DECIDE_S", 0.3)
    run = RunDir(tmp_path)
    old = signal.getsignal(signal.SIGTERM)
    try:
        stop = stopping.Stop(run)
        assert not stop.pending() and stop.decision() == stopping.CONTINUE
        run.control_dir.mkdir()
        atomic_write_json(run.job_json, {"backend": "local", "job_ids": ["local-1"], "state": "RUNNING"})
        os.kill(os.getpid(), signal.SIGTERM)  # a cancel: nobody asks for a checkpoint
        assert stop.pending() and stop.poll() == stopping.CONTINUE  # undecided yet
        assert len(run.sigterm_markers()) == 1  # for a supervisor SLURM did not signal itself
        assert attempt.cause(run, "local-1") == "CANCELLED" and not run.sigterm_markers()  # answered
        t0 = time.monotonic()
        assert stop.decision() == stopping.EXIT and time.monotonic() - t0 >= 0.2
        atomic_write_json(run.checkpoint_request, {"reason": "TIMEOUT"})  # a time limit
        assert stopping.Stop(run, handle_sigterm=False).decision() == stopping.CHECKPOINT
        assert stop.reason() == "TIMEOUT"
        assert stopping.CHECKPOINT > stopping.EXIT > stopping.CONTINUE  # ranks agree on the max
    finally:
        signal.signal(signal.SIGTERM, old)


# --------------------------------------------------------------------------- lr schedules
def test_lr_schedules_by_hand():
    from prime_hpc.trainer.engine import lr_factor

    warm = lr_factor(4, "constant", None, 0.0)
    assert [warm(i) for i in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    lin = lr_factor(2, "linear", 6, 0.2)  # decays over steps 3..6
    assert [round(lin(i), 4) for i in range(6)] == [0.5, 1.0, 0.8, 0.6, 0.4, 0.2]
    cos = lr_factor(0, "cosine", 4, 0.0)
    assert [round(cos(i), 4) for i in range(4)] == [0.8536, 0.5, 0.1464, 0.0]
    assert lr_factor(0, "cosine", None, 0.0)(10) == 1.0  # no max_steps: no decay


def test_watchdog_tells_a_stall_from_a_wait():
    from prime_hpc.job.watchdog import stalled

    now = 1000.0
    beats = {
        "trainer_0": {"time": now - 2, "progress_at": now - 500, "waiting_on": "orchestrator", "step": 4},
        "inference_1": {"time": now - 3},
        "orchestrator_0": {"time": now - 1, "progress_at": now - 2, "waiting_on": None},
    }
    assert stalled(beats, 60, now) is None  # the trainer only waits; the others beat and progress
    beats["orchestrator_0"]["progress_at"] = now - 90  # alive, generating and judging, but no step written
    assert stalled(beats, 60, now) == {
        "component": "orchestrator",
        "rank": 0,
        "silent_s": 90,
        "why": "no progress",
        "step": None,
    }
    beats["inference_1"]["time"] = now - 200  # a frozen server is no stall of the job: the fleet's business
    assert stalled(beats, 60, now)["component"] == "orchestrator"
    done = {"trainer_0": {"time": now - 900, "done": True}, "orchestrator_0": {"time": now - 900, "stopped": True}}
    assert stalled(done, 60, now) is None


def test_the_watchdog_finds_the_stalled_orchestrator_of_one_run_of_several(tmp_path):
    """In a job of several runs each run's orchestrator beats in its own directory: one that
    makes no progress is that run's stall (its log the run's), one over is not watched, the
    job's servers at work excuse a wait for inference, and a run's trainer heartbeat
    (written at its steps only) is not judged."""
    from prime_hpc.job.watchdog import run_stalls
    from prime_hpc.rundir import RunDir, runs

    job, logs, now = RunDir(tmp_path / "job"), tmp_path / "logs" / "attempt_0", 1000.0
    for name in ("stuck", "waits", "over", "fine"):
        sub = job.sub_run(name)
        sub.component_config("trainer").parent.mkdir(parents=True)
        sub.component_config("trainer").write_text("{}\n")
        sub.beat("trainer", 0, time=now - 500, step=3)  # old: a run's trainer beat is not judged
    job.sub_run("stuck").beat("orchestrator", 0, time=now - 1, progress_at=now - 90, step=2)
    job.sub_run("waits").beat("orchestrator", 0, time=now - 1, progress_at=now - 90, waiting_on="inference")
    job.sub_run("over").beat("orchestrator", 0, time=now - 300, progress_at=now - 300)
    runs.record(job.sub_run("over"), runs.ENDED, 5)
    job.sub_run("fine").beat("orchestrator", 0, time=now - 1, progress_at=now - 2)
    busy = {"inference_0": {"time": now - 1, "progress_at": now - 1, "in_flight": 4}}
    [(name, stall)] = run_stalls(job, busy, 60, now, False, logs)
    assert name == "stuck" and stall["component"] == "orchestrator" and stall["why"] == "no progress"
    assert stall["log"] == str(logs / "runs" / "stuck" / "orchestrator.log") and stall["step"] == 2
    assert stall["reason"].startswith("stalled: alive, but no progress for 90s (watchdog.stall_timeout_s=60) at step 2")
    idle = {"inference_0": {"time": now - 1, "progress_at": now - 100, "waiting_on": "orchestrator"}}
    assert sorted(n for n, _ in run_stalls(job, idle, 60, now, False, logs)) == ["stuck", "waits"]
    assert run_stalls(RunDir(tmp_path / "single"), busy, 60, now, False, logs) == []


def test_a_hung_server_is_found_by_its_own_timeout_and_excuses_the_orchestrator_it_starves():
    """A server whose engine hangs keeps beating (its API loop runs) but finishes no
    generation: after inference.stall_timeout_s it is hung (and restarted, not the job's
    end); one whose heartbeat stops is hung too; an idle or working one is not. The
    orchestrator waiting for generations is excused while a server holds them, or while no
    server can serve (the fleet's verdict decides); waiting on idle servers is its own stall."""
    from prime_hpc.job.watchdog import hung_servers, stalled

    now = 1000.0
    beats = {
        "inference_0": {"time": now - 1, "progress_at": now - 70, "waiting_on": None, "in_flight": 8},
        "inference_7.1": {"time": now - 1, "progress_at": now - 300, "waiting_on": "orchestrator", "in_flight": 0},
        "orchestrator_0": {"time": now - 1, "progress_at": now - 200, "waiting_on": "inference"},
        "trainer_0": {"time": now - 1, "progress_at": now - 300, "waiting_on": "orchestrator"},
    }
    assert hung_servers(beats, 60, now) == {
        "inference_0": "alive, but no progress for 70s with 8 request(s) in flight",
        "inference_7.1": None,  # idle (another job's server): it only waits
    }
    assert hung_servers(beats, 0, now) == {"inference_0": None, "inference_7.1": None}  # 0: off
    assert stalled(beats, 60, now) is None  # the orchestrator waits for what inference_0 holds
    beats["inference_0"]["progress_at"] = now - 5  # the server works on (long rollouts): a wait, no stall
    assert hung_servers(beats, 60, now)["inference_0"] is None and stalled(beats, 60, now) is None
    beats["inference_0"].update(in_flight=0, updating=True, progress_at=now - 70)  # frozen in an update
    assert hung_servers(beats, 60, now)["inference_0"] == "alive, but no progress for 70s in a weight update"
    beats["inference_0"]["progress_at"] = now - 5  # an update begun 5 s ago: not hung yet
    assert hung_servers(beats, 60, now)["inference_0"] is None
    beats["inference_0"].update(in_flight=8, updating=False)
    beats["inference_0"]["time"] = now - 61  # its loop froze
    assert hung_servers(beats, 60, now)["inference_0"] == "no heartbeat for 61s"
    beats["inference_0"].update(time=now - 1, waiting_on="orchestrator", in_flight=0)  # every server idle
    s = stalled(beats, 60, now)  # works for the orchestrator (a stuck router, say): its own stall
    assert (s["component"], s["why"], s["silent_s"]) == ("orchestrator", "no progress", 200)
    assert stalled(beats, 60, now, fleet_down=True) is None  # unless the fleet is being restarted


def test_the_watchdog_asks_once_per_hung_process_and_fails_only_a_fleet_that_cannot_serve(tmp_path):
    from prime_hpc.job.watchdog import Fleet
    from prime_hpc.rundir import fleet as fleet_files

    run = RunDir(tmp_path / "run")
    logs = run.logs_root / "attempt_0"
    run.control_dir.mkdir(parents=True)
    for slot in ("inference_0", "inference_1"):
        fleet_files.write_process(run, slot, fleet_files.STARTING, restarts=0, log=str(logtree.log_of(logs, slot)))
    f = Fleet(run, logs, timeout_s=100, server_timeout_s=20)
    now = 1000.0
    ok = {"time": now - 1, "progress_at": now - 1, "in_flight": 2, "pid": 11}
    hung = {"time": now - 1, "progress_at": now - 30, "in_flight": 4, "pid": 12, "slurm_step": "88.3"}
    assert f.check({}, now) is False and f.stall(now + 1000) is None  # no server yet: starting is not a stall
    assert f.check({"inference_0": ok, "inference_1": hung}, now) is False
    req = json.loads(run.restart_request("inference_1").read_text())
    assert req["slot"] == "inference_1" and req["slurm_step"] == "88.3" and req["pid"] == 12
    assert req["reason"].startswith("hung: alive, but no progress for 30s with 4 request(s) in flight")
    assert req["log"] == str(logs / "inference" / "node_1.log")
    # the request is consumed (the supervisor kills it): the same process is not asked twice
    assert attempt.hung(run, run.restart_request("inference_1")) == "inference_1 88.3"
    assert not run.restart_request("inference_1").exists()
    assert fleet_files.read_process(run, "inference_1")["state"] == fleet_files.HUNG
    assert json.loads(run.failure_record("inference_1").read_text())["reason"] == req["reason"]
    f.check({"inference_0": ok, "inference_1": hung}, now + 2)
    assert not run.restart_request("inference_1").exists()
    f.check({"inference_0": ok, "inference_1": {**hung, "pid": 13}}, now + 3)  # its restart hung again
    assert run.restart_request("inference_1").exists()
    # no server can serve: the job goes on for watchdog.stall_timeout_s, then fails naming every server
    assert f.check({"inference_1": {**hung, "pid": 13}}, now + 10) is True
    assert f.stall(now + 3 + 99) is None
    s = f.stall(now + 3 + 101)
    assert s["component"] == "inference" and s["servers"] == ["inference_0", "inference_1"]
    assert s["reason"].startswith("stalled: no inference server could serve for 101s (watchdog.stall_timeout_s=100): ")
    assert "inference_1 hung, 0 restart(s), log " + str(logs / "inference" / "node_1.log") in s["reason"]
    assert s["log"] == str(logs / "inference" / "node_0.log")


def test_the_orchestrators_progress_is_a_step_written_or_trained_never_a_group_judged(tmp_path):
    """Judging groups that all get dropped is no progress (the watchdog ends such a run);
    waiting for the trainer's weights is no stall; the weights' arrival ends the wait."""
    import asyncio
    from types import SimpleNamespace

    from prime_hpc.config.component import component_config
    from prime_hpc.job.watchdog import stalled
    from prime_hpc.orchestrator.client import make_client
    from prime_hpc.orchestrator.envs import dataset_rows, load_env
    from prime_hpc.orchestrator.rollouts import Rollout
    from prime_hpc.orchestrator.sink import StepFill

    cfg = compose(
        [
            "+experiment=reverse_text",
            f"output_dir={tmp_path}",
            "async_level=2",
            "orchestrator.online_difficulty_filtering=true",
        ]
    )
    o = Orchestrator(component_config(cfg, "orchestrator"))
    env = load_env(EnvEntry(id="broken_reverse", args={"fail": "empty", "num_train_examples": 4}))
    slot = EnvSlot(name="b", entry=EnvEntry(id="broken_reverse"), env=env, rows=dataset_rows(env.get_dataset()))
    nowhere = make_client("http://127.0.0.1:9/v1", "x")  # never asked: these rollouts end before any model turn

    async def update_weights(d, step):
        return [{}]

    o.wire(nowhere, "tiny", SimpleNamespace(update_weights=update_weights), None, [slot], [slot])
    o.progress_at = long_ago = time.time() - 1000
    o.sink.filling, o.relay.policy, o.source.inflight = 1, 0, {"a group generating"}
    uniform = [
        Rollout(
            env="e",
            example_id=0,
            reward=0.0,
            input_ids=[1, 2],
            loss_mask=[False, True],
            logprobs=[0.0] * 2,
            policy_steps=[0],
            num_turns=1,
            is_truncated=False,
        )
        for _ in range(8)
    ]
    fill = StepFill(t0=time.monotonic())
    for _ in range(20):
        asyncio.run(o.sink.judge(1, list(uniform), fill))
    assert fill.dropped["no reward variance"] == 20 and o.progress_at == long_ago
    # a train group generated is no progress either; an eval group is (an eval is finite)
    assert all(r.empty for r in asyncio.run(o.generator.group(slot, slot.rows[0])))
    assert o.progress_at == long_ago
    asyncio.run(o.evaluator.evaluate(0))
    assert o.progress_at > long_ago
    o.progress_at = long_ago
    o.beat()
    beat = o.run.beats()["orchestrator_0"]
    assert beat["waiting_on"] is None and beat["progress_at"] == long_ago and beat["env_waits"] == []
    assert stalled(o.run.beats(), 600, time.time())["why"] == "no progress"
    # a group out at an env server for longer than the timeout: the stall is that server's
    from prime_hpc.orchestrator.envservers import EnvServerProcess

    log = tmp_path / "logs" / "envs" / "train" / "b" / "env_server.log"
    o.served_envs = [EnvServerProcess("b", "train", None, log, tmp_path / "b.json", "k")]  # type: ignore[arg-type]
    o.served_envs[0].sent = {7: long_ago}
    o.beat()
    (wait,) = o.run.beats()["orchestrator_0"]["env_waits"]
    assert wait == {"env": "b", "kind": "train", "since": long_ago, "groups": 1, "log": str(log)}
    assert stalled(o.run.beats(), 600, time.time())["env_server"]["env"] == "b"
    o.served_envs = []
    # nothing generating before any step is filled (the eval of the starting policy): no wait
    o.sink.filling, o.source.inflight = None, set()
    o.beat()
    assert o.run.beats()["orchestrator_0"]["waiting_on"] is None
    # step 4 needs policy 2 or newer; policy 1 is served and nothing generates: a wait
    o.sink.filling, o.relay.policy, o.source.inflight = 4, 1, set()
    o.beat()
    assert (
        o.run.beats()["orchestrator_0"]["waiting_on"] == "trainer" and stalled(o.run.beats(), 600, time.time()) is None
    )

    async def relay_until_policy(n):  # the trainer's weights of step 2 arrive
        task = asyncio.create_task(o.relay.watch())
        while o.relay.policy < n:
            await asyncio.sleep(0.01)
        task.cancel()

    (o.run.weights_step(2) / "model.safetensors").parent.mkdir(parents=True)
    (o.run.weights_step(2) / "model.safetensors").write_bytes(b"")
    mark_stable(o.run.weights_step(2))
    before = time.time()
    asyncio.run(asyncio.wait_for(relay_until_policy(2), 30))
    assert o.progress_at >= before and not o.sink.waiting_for_trainer()


def test_watchdog_records_a_job_script_that_died_and_nothing_after_a_recorded_end(tmp_path):
    import subprocess

    from prime_hpc.job.watchdog import Supervisor
    from prime_hpc.rundir import jobs

    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    atomic_write_json(
        run.job_json,
        {
            "backend": "local",
            "job_ids": ["local-ab12"],
            "state": "RUNNING",
            "attempts": [{"attempt": 0, "job_id": "local-ab12", "logs": str(run.logs_root / "attempt_0")}],
        },
    )
    script = subprocess.Popen(["sleep", "60"])
    try:
        watched = Supervisor("local-ab12", script.pid)
        assert not watched.died(run) and jobs.read_job(run)["state"] == "RUNNING"
    finally:
        script.kill()
        script.wait()
    assert watched.died(run)
    job = jobs.read_job(run)
    assert job["state"] == "FAILED" and job["ended_at"] and job["attempts"][-1]["end"] == "FAILED", job
    f = job["failure"]
    assert f["component"] == "supervisor" and f["rc"] is None and f["log"] == str(run.local_batch_log), f
    assert f["reason"].startswith(f"died without ending the attempt (the job script, pid {script.pid} on "), f
    # an attempt that ended (completed, cancelled, requeued) before its script is not rewritten
    for state in ("COMPLETED", "CANCELLED", "REQUEUED"):
        atomic_write_json(run.job_json, {"job_ids": ["local-ab12"], "state": state, "ended_at": 1.0})
        assert attempt.supervisor_died(run, "local-ab12", script.pid) is None
        assert jobs.read_job(run) == {"job_ids": ["local-ab12"], "state": state, "ended_at": 1.0}


def test_a_failure_names_the_node_that_failed_first(tmp_path):
    logs = tmp_path / "logs" / "attempt_0"
    (logs / "trainer").mkdir(parents=True)
    (logs / "trainer" / "srun.log").write_text(
        "srun: error: node7: task 2: Killed\nsrun: error: node5: task 0: Terminated\n"
    )
    assert attempt.where_it_died(logs, "trainer") == {
        "node": 2,
        "host": "node7",
        "log": str(logs / "trainer" / "node_2.log"),
    }
    assert attempt.where_it_died(logs, "inference_3") == {"node": 3, "log": str(logs / "inference" / "node_3.log")}
    assert attempt.where_it_died(logs, "orchestrator") == {"node": 0, "log": str(logs / "orchestrator.log")}


def test_the_requeue_cap_falls_back_to_the_schemas_default(tmp_path):
    """A config.yaml without cluster.max_requeues (or none at all) caps requeues at the
    schema's default, not at 0 (which would end every time-limited run at its first limit)."""
    from dataclasses import fields

    from prime_hpc.config.schema import ClusterConfig
    from prime_hpc.rundir.jobs import read_job

    default = next(f.default for f in fields(ClusterConfig) if f.name == "max_requeues")
    assert default > 0
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    assert attempt.max_requeues(run) == default  # no config.yaml
    for text in ("cluster: {}\n", "name: x\n", "cluster: {max_requeues: null}\n", ": : not yaml ["):
        run.config_yaml.write_text(text)
        assert attempt.max_requeues(run) == default, text
    run.config_yaml.write_text("cluster: {max_requeues: 3}\n")
    assert attempt.max_requeues(run) == 3
    run.config_yaml.write_text("cluster: {max_requeues: 0}\n")
    assert attempt.max_requeues(run) == 0
    # the cap is what the message names when it is reached (no SLURM call on this path)
    run.config_yaml.write_text("name: x\n")
    atomic_write_json(
        run.job_json, {"backend": "slurm", "requeues": default, "attempts": [{"job_id": "77", "attempt": 0}]}
    )
    said, again = attempt.requeue(run, "77", "TIMEOUT")
    assert f"cluster.max_requeues={default} reached" in said and not again
    assert read_job(run)["state"] == "TIMEOUT"


def test_a_components_own_one_line_cause_is_the_recorded_failure(tmp_path):
    """The orchestrator's own cause (control/failure_orchestrator.json) follows the
    supervisor's "exited with code N" in job.json, with the log it names; a component that
    left none is recorded as before; status shows the step that was not filled."""
    from prime_hpc.rundir import read_json
    from prime_hpc.watch.vitals import format_vitals, vitals

    run = RunDir(tmp_path)
    k, logs = run.new_attempt()
    job = {"job_ids": ["7"], "state": "RUNNING", "attempts": [{"attempt": k, "job_id": "7"}]}
    atomic_write_json(run.job_json, job)
    env_log = logtree.env_worker_log(logs, "train", "broken")
    cause = "train env 'broken': 3 groups in a row errored (orchestrator.max_errored_groups=3); the last: boom"
    atomic_write_json(run.failure_record("orchestrator"), {"reason": cause, "log": str(env_log)})
    said = attempt.end(run, "7", 1, "orchestrator", "exited with code 1")
    f = read_json(run.job_json)["failure"]
    assert (f["component"], f["reason"], f["log"]) == ("orchestrator", f"exited with code 1: {cause}", str(env_log))
    assert said == f"prime-hpc: run failed: orchestrator on node 0 exited with code 1: {cause}; see {env_log}"
    atomic_write_json(run.job_json, job)
    attempt.end(run, "7", 1, "trainer", "exited with code 1")
    f = read_json(run.job_json)["failure"]
    assert f["reason"] == "exited with code 1" and f["log"] == str(logs.resolve() / "trainer" / "node_0.log")

    run.metrics_dir.mkdir()
    rows = [
        {"step": 1, "reward/all/mean": 0.5},
        {"step": 2, "reward/all/mean": 0.4},
        {
            "step": 3,
            "filter/unfilled": 1,
            "filter/accepted_groups": 0,
            "filter/judged_groups": 12,
            "filter/errored_groups": 9,
            "filter/zero_variance_groups": 3,
            "filter/invalid_groups": 0,
        },
    ]
    run.metrics("orchestrator").write_text("".join(json.dumps(r) + "\n" for r in rows))
    v = vitals(run, 10)
    assert v["orchestrator_step"] == 2
    assert "step 3 not filled: 0 group(s) accepted of 12 judged (errored: 9, no reward variance: 3)" in format_vitals(
        v, "rl"
    )


# --------------------------------------------------------------------------- the inference fleet
def test_server_slots_are_named_and_parsed_in_one_place(tmp_path):
    from prime_hpc.rundir import Slot, parse_slot, server_slot

    assert server_slot(3) == "inference_3" and server_slot(1, "4711") == "inference_4711.1"
    assert parse_slot("inference_3") == Slot(None, 3) and parse_slot("inference_4711.1.json") == Slot("4711", 1)
    for other in ("inference", "inference_", "inference_x", "inference_1.", "router_0", "trainer_0", "inference_1_2"):
        assert parse_slot(other) is None, other
    run = RunDir(tmp_path / "run")
    assert run.inference_endpoint(2) == run.inference_endpoint("inference_2") == run.endpoints_dir / "inference_2.json"
    with pytest.raises(ValueError):
        run.inference_endpoint("router")
    for slot in ("inference_12.0", "inference_1", "inference_0", "inference_9.1"):
        atomic_write_json(run.inference_endpoint(slot), {"url": f"http://127.0.0.1/{slot}"})
    (run.endpoints_dir / "router.json").write_text("{}")
    assert run.server_slots() == ["inference_0", "inference_1", "inference_9.1", "inference_12.0"]
    assert run.server_endpoints()["inference_9.1"]["url"].endswith("inference_9.1")
    logs = tmp_path / "logs"
    assert logtree.log_of(logs, "inference_9.1") == logs / "inference" / "node_9.1.log"
    assert attempt.where_it_died(logs, "inference_9.1")["node"] == 1


def test_a_servers_state_merges_its_supervisors_record_and_the_relays(tmp_path):
    from prime_hpc.rundir import fleet as f

    p = {"state": f.STARTING, "since": 100.0}
    assert f.merged_state(p, None) == "starting"
    assert f.merged_state(p, {"state": f.SERVING, "since": 90.0}) == "starting"  # the relay holds the old process
    assert f.merged_state(p, {"state": f.LOADING, "since": 110.0}) == "loading weights"
    assert f.merged_state(p, {"state": f.SERVING, "since": 120.0}) == "serving"
    assert f.merged_state({"state": f.LOST, "since": 130.0}, {"state": f.SERVING, "since": 120.0}) == "lost"
    assert f.merged_state({"state": f.LOST, "since": 130.0}, {"state": f.REMOVED, "since": 131.0}) == "lost"
    assert f.merged_state({"state": f.HUNG, "since": 130.0}, {"state": f.SERVING, "since": 120.0}) == "hung"
    assert f.merged_state({}, {"state": f.SERVING, "since": 1.0}) == "serving"  # a slot without a supervisor's file


def test_a_lost_server_is_restarted_in_its_slot_at_most_max_restarts_times(tmp_path):
    from prime_hpc.rundir import fleet as f

    run = RunDir(tmp_path / "run")
    _, logs = run.new_attempt()
    run.component_config("inference").parent.mkdir(parents=True)
    run.component_config("inference").write_text(yaml.safe_dump({"nodes": 2, "inference": {"max_restarts": 2}}))
    atomic_write_json(run.job_json, {"job_ids": ["7"], "state": "RUNNING", "attempts": [{"job_id": "7"}]})
    attempt.start_fleet(run, "7", logs)
    assert [r["state"] for r in f.fleet(run)] == ["starting", "starting"]
    atomic_write_json(run.inference_endpoint(1), {"url": "http://127.0.0.1:1"})
    run.beat_as(run.server_heartbeat(1), in_flight=0)
    atomic_write_json(run.failure_record("inference_1"), {"reason": "hung: no heartbeat for 30s", "log": "x"})
    message, restart = attempt.lost(run, "inference_1", 137)
    assert restart and "restart 1 of at most 2" in message and "hung: no heartbeat" in message
    assert not run.inference_endpoint(1).exists() and not run.server_heartbeat(1).exists()
    row = f.fleet(run)[1]
    assert (row["slot"], row["state"], row["restarts"], row["log"]) == (
        "inference_1",
        "starting",
        1,
        str(logs / "inference" / "node_1.log"),
    )
    assert attempt.lost(run, "inference_1", 1)[1] is True
    message, restart = attempt.lost(run, "inference_1", 1)
    assert not restart and "no restart left (inference.max_restarts=2)" in message
    assert f.fleet(run)[1]["state"] == "lost" and f.fleet(run)[1]["restarts"] == 2
    lost = jobs.read_job(run)["attempts"][-1]["lost"]
    assert [(x["component"], x["rc"], x["restarted"]) for x in lost] == [
        ("inference_1", 137, True),
        ("inference_1", 1, True),
        ("inference_1", 1, False),
    ]
    assert lost[0]["reason"] == "hung: no heartbeat for 30s" and "reason" not in lost[1]
    attempt.request_checkpoint(run, "TIMEOUT")  # a run that stops restarts nothing
    assert attempt.lost(run, "inference_0", 1)[1] is False


def test_a_requeue_its_job_script_did_not_record_counts_as_node_fail(tmp_path):
    """The node of the job script failed: SLURM requeued the job with nobody recording the
    end of the attempt. The next start closes it as NODE_FAIL and counts the requeue."""
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    (run.root / "config.yaml").write_text(yaml.safe_dump({"cluster": {"max_requeues": 1}}))
    open_attempt = {"attempt": 0, "job_id": "9", "started_at": 1.0}
    atomic_write_json(
        run.job_json, {"backend": "slurm", "job_ids": ["9"], "state": "RUNNING", "attempts": [open_attempt]}
    )
    job = attempt.unrecorded_requeue(run, "9")
    assert job["requeues"] == 1 and job["attempts"][0]["end"] == "NODE_FAIL" and not job.get("failure"), job
    assert attempt.unrecorded_requeue(run, "9")["requeues"] == 1  # a recorded end is not counted again
    with jobs.editing_job(run) as j:
        j["attempts"].append({**open_attempt, "attempt": 1})
    job = attempt.unrecorded_requeue(run, "9")  # past cluster.max_requeues: the run ends
    assert job["state"] == "FAILED" and job["failure"]["max_requeues"] == 1, job
    with pytest.raises(UserError, match="cluster.max_requeues=1"):
        attempt.start(run, "9")


def test_a_run_of_several_takes_its_jobs_checkpoint_request_and_its_own_step_of_the_answer(tmp_path):
    """At a time limit the supervisor asks the job (`control/checkpoint.json` of the job's
    directory): every run's orchestrator sees that request, and saves its part of the step
    the multi-run trainer saved for that run (the job's answer, by run)."""
    from prime_hpc.rundir import RunDir, atomic_write_json
    from prime_hpc.runtime.stopping import CHECKPOINT, CONTINUE, Stop, checkpointed_step

    job = RunDir(tmp_path / "job")
    run = job.sub_run("a")
    stop = Stop(run, handle_sigterm=False, control=job)
    assert stop.poll() == CONTINUE
    job.checkpoint_request.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(job.checkpoint_request, {"reason": "time limit", "requested_at": 0})
    assert stop.poll() == CHECKPOINT and stop.reason() == "time limit"
    assert Stop(run, handle_sigterm=False).poll() == CONTINUE  # the run's own control has no request
    assert checkpointed_step(run, job) is None
    atomic_write_json(job.checkpoint_answer, {"runs": {"a": 4, "b": 2}})
    assert checkpointed_step(run, job) == 4 and checkpointed_step(job.sub_run("c"), job) is None
    assert checkpointed_step(job) is None  # a single run's answer is {"step": n}


TORCHRUN_REPORT = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
=======================================================
prime_hpc.trainer.rl FAILED
-------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-28_01:13:35
  host      : node1
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 26348)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 26348
-------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-28_01:13:35
  host      : node1
  rank      : 3 (local_rank: 1)
  exitcode  : -9 (pid: 26349)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 26349
=======================================================
"""


def test_a_component_killed_by_a_signal_is_named_with_the_rank_and_slurms_out_of_memory_verdict(tmp_path):
    """torchrun's report names the first rank that died and its signal; SLURM's words on the
    step's cgroup (srun's log) turn "out of memory?" into "out of memory"; a Python error
    that mentions memory is no kill; a process killed outright is its exit code 128 + N."""
    from prime_hpc.job import kill_signals

    node_log, srun_log = tmp_path / "node_0.log", tmp_path / "srun.log"
    node_log.write_text("step 7 | loss 0.1\n" * 5000 + TORCHRUN_REPORT)  # the report at the end of a long log
    assert kill_signals.cause(1, [node_log, srun_log]) == f"rank 3 was killed by SIGKILL: {kill_signals.OOM_HINT}"
    oom = "slurmstepd: error: Detected 1 oom_kill event in StepId=57.2. Some of the step tasks have been OOM Killed."
    srun_log.write_text(f"srun: error: node2: task 1: Out Of Memory\n{oom}\n")
    assert kill_signals.cause(1, [node_log, srun_log]) == f"rank 3 was killed by SIGKILL: out of memory ({oom})"
    srun_log.write_text("slurmstepd: error: Detected 2 oom-kill event(s) in step 57.2 cgroup.\n")  # older SLURM
    assert kill_signals.cause(1, [node_log, srun_log]).startswith(
        "rank 3 was killed by SIGKILL: out of memory (slurmstepd"
    )

    node_log.write_text("RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB\n")  # an exception: exit 1
    srun_log.write_text("srun: error: node2: task 1: Exited with exit code 1\n")
    assert kill_signals.cause(1, [node_log, srun_log]) == ""
    assert kill_signals.cause(137, [node_log, srun_log]) == f"killed by SIGKILL: {kill_signals.OOM_HINT}"
    assert kill_signals.cause(139, []) == "killed by SIGSEGV"
    assert kill_signals.cause(None, [tmp_path / "missing.log"]) == ""
