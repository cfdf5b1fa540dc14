"""A teacher the run starts itself (`orchestrator.teacher.model`): its group of the job, its
slots, router, membership and logs beside the inference servers', and the three ways of
naming a teacher. The run itself is `tests/integration/test_slurm_teacher.py`."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from prime_hpc.config.compose import compose
from prime_hpc.config.validate import validate
from prime_hpc.core.errors import ConfigError
from prime_hpc.job import attempt
from prime_hpc.launcher.plan import make_plan
from prime_hpc.launcher.render import render_local, render_sbatch
from prime_hpc.rundir import RunDir, Slot, atomic_write_json, logtree, parse_slot, server_slot
from prime_hpc.rundir import fleet as fleet_files

OPD = ["+experiment=reverse_text", "warmup.experiment=null", "orchestrator.training_mode=opd"]


def opd(tmp_path, *extra: str):
    return compose([*OPD, f"output_dir={tmp_path}/run", *extra])


# --------------------------------------------------------------------------- slots and paths
def test_teacher_slots_router_and_membership_are_their_own(tmp_path):
    assert server_slot(2, None, "teacher") == "teacher_2" and parse_slot("teacher_2.json") == Slot(None, 2, "teacher")
    assert parse_slot("inference_2") == Slot(None, 2) and parse_slot("teacher_router") is None
    with pytest.raises(ValueError):
        server_slot(0, None, "trainer")
    run = RunDir(tmp_path / "run")
    teacher = run.of_group("teacher")
    assert teacher.root == run.root and teacher.group == "teacher"
    assert teacher.inference_endpoint(1) == run.endpoints_dir / "teacher_1.json"
    assert teacher.router_endpoint == run.endpoints_dir / "teacher_router.json" != run.router_endpoint
    assert teacher.fleet_membership == run.fleet_dir / "teacher_membership.json" != run.fleet_membership
    assert teacher.server_heartbeat(0) == run.heartbeats_dir / "teacher_0"
    for slot in ("inference_0", "inference_1", "teacher_0", "teacher_1"):
        atomic_write_json(run.inference_endpoint(slot), {"url": f"http://127.0.0.1/{slot}"})
    atomic_write_json(teacher.router_endpoint, {"url": "http://127.0.0.1:1"})
    # the weight relay and the run's router see only the inference servers, the teacher's only its own
    assert run.server_slots() == ["inference_0", "inference_1"]
    assert teacher.server_slots() == ["teacher_0", "teacher_1"]
    assert set(teacher.server_endpoints()) == {"teacher_0", "teacher_1"}
    logs = tmp_path / "logs"
    assert logtree.log_of(logs, "teacher_1") == logs / "teacher" / "node_1.log"
    assert logtree.log_of(logs, "teacher_router") == logs / "teacher" / "router_0.log"
    assert attempt.where_it_died(logs, "teacher_1") == {"node": 1, "log": str(logs / "teacher" / "node_1.log")}


def test_status_shows_the_teachers_servers_after_the_fleet_without_a_policy(tmp_path):
    run = RunDir(tmp_path / "run")
    _, logs = run.new_attempt()
    run.component_config("inference").parent.mkdir(parents=True)
    for group, nodes in (("inference", 2), ("teacher", 1)):
        run.component_config(group).write_text(json.dumps({"nodes": nodes}))
        attempt.start_fleet(run, "7", logs, group)
    atomic_write_json(
        run.fleet_membership, {"servers": {"inference_0": {"url": "u0", "state": "serving", "policy_step": 4}}}
    )
    teacher = run.of_group("teacher")
    atomic_write_json(
        teacher.fleet_membership,
        {"servers": {"teacher_0": {"url": "t0", "state": "serving", "policy_step": 0, "since": 4e9}}},
    )
    rows = fleet_files.fleet(run)
    assert [r["slot"] for r in rows] == ["inference_0", "inference_1"] and rows[0]["policy_step"] == 4
    (t,) = fleet_files.fleet(teacher)
    assert (t["slot"], t["state"], t["policy_step"], t["log"]) == (
        "teacher_0",
        "serving",
        None,
        str(logs / "teacher" / "node_0.log"),
    )


def test_a_lost_teacher_is_restarted_in_its_slot_like_a_server(tmp_path):
    run = RunDir(tmp_path / "run")
    _, logs = run.new_attempt()
    run.component_config("inference").parent.mkdir(parents=True)
    run.component_config("inference").write_text(json.dumps({"nodes": 1, "inference": {"max_restarts": 1}}))
    run.component_config("teacher").write_text(json.dumps({"nodes": 1}))
    atomic_write_json(run.job_json, {"job_ids": ["7"], "state": "RUNNING", "attempts": [{"job_id": "7"}]})
    attempt.start_fleet(run, "7", logs, "teacher")
    teacher = run.of_group("teacher")
    atomic_write_json(teacher.inference_endpoint(0), {"url": "http://127.0.0.1:9"})
    message, restart = attempt.lost(run, "teacher_0", 137)
    assert restart and "lost teacher_0" in message and "restart 1 of at most 1" in message
    assert not teacher.inference_endpoint(0).exists()  # its router and membership drop it
    assert fleet_files.read_process(run, "teacher_0")["restarts"] == 1
    message, restart = attempt.lost(run, "teacher_0", 137)
    assert not restart and "no restart left" in message and str(logs / "teacher" / "node_0.log") in message


def test_the_watchdog_restarts_a_hung_teacher_but_a_teacher_does_not_count_as_the_fleet(tmp_path):
    from prime_hpc.job.watchdog import Fleet, stalled

    run = RunDir(tmp_path / "run")
    logs = run.logs_root / "attempt_0"
    run.control_dir.mkdir(parents=True)
    f = Fleet(run, logs, timeout_s=100, server_timeout_s=20)
    now = 1000.0
    ok = {"time": now - 1, "progress_at": now - 1, "in_flight": 1, "pid": 11}
    hung = {"time": now - 1, "progress_at": now - 30, "in_flight": 4, "pid": 12}
    assert f.check({"inference_0": ok, "teacher_0": hung}, now) is False
    req = json.loads(run.restart_request("teacher_0").read_text())
    assert req["slot"] == "teacher_0" and req["log"] == str(logs / "teacher" / "node_0.log")
    assert attempt.hung(run, run.restart_request("teacher_0")) == "teacher_0"
    # a serving teacher does not keep a dead inference fleet alive
    assert f.check({"inference_0": {**hung, "pid": 13}, "teacher_0": ok}, now + 1) is True
    # an orchestrator waiting while the teacher works (opd scores, sft generates) is no stall; idle, it is
    beats = {"orchestrator_0": {"time": now, "progress_at": now - 500, "waiting_on": "inference"}, "teacher_0": ok}
    assert stalled(beats, 100, now) is None
    idle = {**ok, "waiting_on": "orchestrator", "in_flight": 0}
    assert stalled({**beats, "teacher_0": idle}, 100, now)["component"] == "orchestrator"


# --------------------------------------------------------------------------- the job
def test_the_teacher_is_a_fourth_group_with_its_servers_and_router_supervised(tmp_path):
    cfg = opd(tmp_path, "orchestrator.teacher.model=tiny-35m", "cluster=dev", "cluster.teacher.nodes=2")
    validate(cfg)
    plan = make_plan(cfg, python="/opt/venv/bin/python", cores=[0, 1])
    assert plan.group_names == ["orchestrator", "inference", "trainer", "teacher"]
    tea = plan.group("teacher")
    assert (tea.index, tea.nodes, tea.service) == (3, 2, True)
    assert tea.cpu_ids == plan.group("inference").cpu_ids  # on one host it shares the servers' cores
    assert tea.argv[-2:] == ["--config", str(plan.run.component_config("teacher"))]
    script = render_sbatch(plan)
    lines = script.splitlines()
    assert "#   group 3  2 node(s)  teacher (one server per node)" in lines
    assert lines.count("#SBATCH hetjob") == 3
    assert 'for n in $(seq 0 1); do start_teacher "$n"; done' in lines
    start = next(ln for ln in lines if ln.lstrip().startswith("PRIME_HPC_NODE_RANK=$1 PRIME_HPC_HET_GROUP=3"))
    assert '--het-group=3 --nodes=1 --ntasks=1 --relative="$1"' in start and '--job-name="teacher_$1"' in start
    assert 'PIDS[teacher_$1]=$!; SERVICE[teacher_$1]=1; REPLICA[teacher_$1]=teacher; unset "DONE[teacher_$1]"' in script
    assert "prime_hpc.inference.router --config " + str(plan.run.component_config("teacher")) in script
    assert (
        '--output="$LOGS/teacher/router_0.log"' in script
        and "PIDS[teacher_router]=$!; SERVICE[teacher_router]=1" in script
    )
    # a lost server is restarted in its own group's slot
    assert 'then "start_${REPLICA[$c]}" "${c#*_}"; continue; fi' in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    local = render_local(make_plan(opd(tmp_path, "orchestrator.teacher.model=tiny-35m"), cores=[0, 1]), "local-1")
    assert 'for n in $(seq 0 0); do start_teacher "$n"; done' in local and "PIDS[teacher_router]" in local
    subprocess.run(["bash", "-n"], input=local, text=True, check=True)
    # its preflight (doctor) probes the teacher's nodes too: a probe that ends, no router of its own
    doctor = make_plan(cfg, mode="doctor", python="/opt/venv/bin/python", cores=[0, 1])
    assert doctor.group_names == ["orchestrator", "inference", "trainer", "teacher"]
    assert doctor.group("teacher").service is False and doctor.teacher_router_argv == []
    assert doctor.group("teacher").argv[-4:] == ["--group", "teacher", "--output-dir", str(doctor.run.root)]
    probe = render_sbatch(doctor)
    assert 'PIDS[teacher_$1]=$!; SERVICE[teacher_$1]=0; unset "DONE[teacher_$1]"' in probe
    assert "start_teacher" in probe and "teacher_router" not in probe
    from prime_hpc.launcher.launch import expected_reports

    assert expected_reports(doctor) == {"inference": 1, "router": 1, "trainer": 1, "teacher": 2}
    subprocess.run(["bash", "-n"], input=probe, text=True, check=True)
    # without a teacher of its own, nothing of it
    plain = render_sbatch(make_plan(compose([*OPD[:2], f"output_dir={tmp_path}/p", "cluster=dev"]), cores=[0, 1]))
    assert "start_teacher" not in plain and "teacher_router" not in plain and "group 3" not in plain


def test_a_gpu_teacher_gets_its_own_gpus(tmp_path):
    cfg = opd(
        tmp_path,
        "orchestrator.teacher.model=tiny-35m",
        "cluster=slurm",
        "cluster.teacher.gpus_per_node=4",
        "cluster.teacher.mem_gb=100",
        "cluster.orchestrator.mem_gb=10",
        "cluster.inference.mem_gb=100",
        "cluster.trainer.mem_gb=100",
    )
    validate(cfg)
    script = render_sbatch(make_plan(cfg, python="/opt/venv/bin/python"))
    assert script.count("#SBATCH --gpus-per-node=8") == 2 and script.count("#SBATCH --gpus-per-node=4") == 1
    with pytest.raises(ConfigError, match="cluster.teacher.gpus_per_node"):
        validate(
            opd(tmp_path, "orchestrator.teacher.model=tiny-35m", "cluster=slurm", "cluster.teacher.gpus_per_node=0")
        )
    with pytest.raises(ConfigError, match="cluster.teacher.mem_gb"):
        validate(
            opd(
                tmp_path,
                "orchestrator.teacher.model=tiny-35m",
                *(f"cluster.{g}.mem_gb=4" for g in ("orchestrator", "inference", "trainer")),
            )
        )


# --------------------------------------------------------------------------- naming the teacher
def test_opd_and_sft_need_exactly_one_teacher_and_rl_none(tmp_path):
    with pytest.raises(ConfigError, match="needs a teacher: its OpenAI URL .* orchestrator.teacher.model="):
        validate(opd(tmp_path))
    with pytest.raises(
        ConfigError,
        match="orchestrator.teacher.model: the run has one teacher: orchestrator.teacher.client.base_url is set too",
    ):
        validate(
            opd(
                tmp_path,
                "orchestrator.teacher.client.base_url=http://127.0.0.1:1/v1",
                "orchestrator.teacher.model=tiny",
            )
        )
    with pytest.raises(
        ConfigError, match="orchestrator.teacher.model: a teacher is only used with training_mode=opd or sft"
    ):
        validate(compose(["+experiment=reverse_text", f"output_dir={tmp_path}/r", "orchestrator.teacher.model=tiny"]))
    # the run's own teacher is asked with the job's key: no variable of its own to name
    validate(
        opd(
            tmp_path,
            "orchestrator.teacher.model=tiny",
            "orchestrator.teacher.client.api_key_var=INFERENCE_SERVER_API_KEY",
        )
    )
    with pytest.raises(ConfigError, match="is the job's own key"):
        validate(
            opd(
                tmp_path,
                "orchestrator.teacher.client.base_url=http://127.0.0.1:1/v1",
                "orchestrator.teacher.client.api_key_var=INFERENCE_SERVER_API_KEY",
            )
        )


def test_a_serve_job_teacher_must_serve_and_its_key_be_here(tmp_path, monkeypatch):
    from prime_hpc.orchestrator.teacher import locate

    job = RunDir(tmp_path / "serve")
    job.root.mkdir()
    atomic_write_json(
        job.job_json,
        {
            "job_ids": ["55"],
            "state": "RUNNING",
            "kind": "serve",
            "output_dir": str(job.root),
            "backend": "slurm",
            "name": "s",
        },
    )
    with pytest.raises(ConfigError, match="orchestrator.teacher.serve: serve job .* does not serve now"):
        validate(opd(tmp_path, f"orchestrator.teacher.serve={job.root}"))
    atomic_write_json(
        job.serve_json, {"url": "http://127.0.0.1:7/v1", "model": "tiny", "key_var": "INFERENCE_SERVER_API_KEY"}
    )
    monkeypatch.delenv("TEACHER_API_KEY", raising=False)
    with pytest.raises(ConfigError, match=r"answers only with its key: set \$TEACHER_API_KEY"):
        validate(opd(tmp_path, f"orchestrator.teacher.serve={job.root}"))
    monkeypatch.setenv("TEACHER_API_KEY", "k-serve")
    # named relative to where it is submitted, recorded by its directory: every attempt asks the same job
    from prime_hpc.launcher.launch import prepare

    monkeypatch.chdir(tmp_path)
    run, _ = prepare(opd(tmp_path, "orchestrator.teacher.serve=serve"), dry_run=True)
    assert f"serve: {job.root}" in run.component_config("orchestrator").read_text()
    cfg = validate(opd(tmp_path, f"orchestrator.teacher.serve={job.root}"))
    assert make_plan(cfg, cores=[0, 1]).group_names == ["orchestrator", "inference", "trainer"]  # nothing started
    at = locate(cfg.orchestrator.teacher, RunDir(cfg.output_dir), 1, 1.0)
    assert (at.url, at.key, at.model, at.fleet) == ("http://127.0.0.1:7/v1", "k-serve", "tiny", None)
    atomic_write_json(job.job_json, {**json.loads(job.job_json.read_text()), "state": "CANCELLED"})
    with pytest.raises(Exception, match="does not serve now"):
        locate(cfg.orchestrator.teacher, RunDir(cfg.output_dir), 1, 1.0)


def test_the_run_finds_its_own_teacher_behind_its_router_with_the_jobs_key(tmp_path, monkeypatch):
    """Its router (the real one, in front of a teacher server behind the server's gate) is
    proven against `teacher_router.json` with the job's key, and asked signed: the key
    reaches neither. A `teacher_router.json` whose router is gone and whose port someone
    else holds is waited past, named when the wait ends, and sent nothing but a nonce."""
    import asyncio

    from prime_hpc.inference.router import Router
    from prime_hpc.orchestrator.rollouts import Rollout
    from prime_hpc.orchestrator.teacher import Teacher, locate
    from prime_hpc.rundir import WaitTimeout
    from tests.unit.test_router import KEY, Recorder, Served, Stranger, Worker, publish_router

    cfg = opd(tmp_path, "orchestrator.teacher.model=tiny-35m")
    run = RunDir(cfg.output_dir)
    teacher = run.of_group("teacher")
    server = Served(Worker("teacher"), gated=True)
    atomic_write_json(teacher.inference_endpoint(0), server.endpoint(0, slot="teacher_0"))
    router = Router([server.url], KEY, teacher, no_server_wait_s=30)
    front = Served(Recorder(router))
    try:
        publish_router(teacher, router, front)
        monkeypatch.setenv("INFERENCE_SERVER_API_KEY", KEY)
        monkeypatch.setenv("TEACHER_API_KEY", "not-this-one")
        at = locate(cfg.orchestrator.teacher, run, 1, 10.0)
        assert (at.url, at.key, at.model) == (front.url + "/v1", KEY, "tiny-35m")
        assert at.fleet.servers == [server.url]
        r = Rollout("e", 0, 0.0, [1, 2, 3], [False, True, True], [0.0, -1.0, -1.0], [0], 1, False)

        async def ask() -> None:
            asking = Teacher(at, lambda: "tiny-35m")
            try:
                await asking.add_logprobs([r])
            finally:
                await asking.aclose()

        asyncio.run(ask())
        assert r.teacher_logprobs == [0.0, -0.5, -0.25]
        heard = front.app.heard() + b"".join(a.encode() for _, _, a in server.app.app.seen)
        assert front.app.seen and KEY.encode() not in heard
    finally:
        front.stop()
        server.stop()
    stranger = Recorder(Stranger(instance=router.identity["instance"]))
    held = Served(stranger, port=front.port)
    try:
        with pytest.raises(WaitTimeout, match="teacher_router.json names the router at .*, which did not prove"):
            locate(cfg.orchestrator.teacher, run, 1, 1.0)
    finally:
        held.stop()
    assert {(m, p) for m, p, *_ in stranger.seen} == {("GET", "/identity")} and KEY.encode() not in stranger.heard()
    os.unlink(teacher.router_endpoint)
    with pytest.raises(Exception, match="teacher router"):
        locate(cfg.orchestrator.teacher, run, 1, 0.5)


def test_tail_follows_the_teachers_servers_and_router(tmp_path):
    from prime_hpc.watch.tail import COMPONENTS, discover

    logs = tmp_path / "attempt_1"
    (logs / "teacher").mkdir(parents=True)
    (logs / "inference").mkdir()
    for name in ("teacher/node_0.log", "teacher/node_1.log", "teacher/router_0.log", "inference/node_0.log"):
        (logs / name).write_text("x\n")
    labels = [s.label for s in discover(logs)]
    assert labels[-3:] == ["teacher[0]", "teacher[1]", "teacher-router"] and "inference[0]" in labels
    assert "teacher" in COMPONENTS and [s.label for s in discover(logs, ["teacher"])] == labels[-3:]


def test_the_teachers_engine_is_its_own_and_its_nodes_hold_whole_replicas(tmp_path):
    from prime_hpc.config.component import CONFIGS, component_config, typed

    gpu = ["cluster=slurm", "orchestrator.teacher.model=big"]
    cfg = opd(tmp_path, *gpu, "orchestrator.teacher.tensor_parallel_size=8", "orchestrator.teacher.dtype=bfloat16")
    validate(cfg)
    t = typed(CONFIGS["teacher"], component_config(cfg, "teacher"), "teacher")
    i = typed(CONFIGS["inference"], component_config(cfg, "inference"), "inference")
    assert (t.inference.tensor_parallel_size, t.inference.dtype) == (8, "bfloat16")
    assert (i.inference.tensor_parallel_size, i.inference.dtype) == (1, cfg.inference.dtype)
    with pytest.raises(
        ConfigError,
        match=r"cluster.teacher.gpus_per_node: 8 GPUs per node cannot hold replicas of orchestrator.teacher.tensor_parallel_size=3",
    ):
        validate(opd(tmp_path, *gpu, "orchestrator.teacher.tensor_parallel_size=3"))
    with pytest.raises(
        ConfigError,
        match="orchestrator.teacher.tensor_parallel_size: sets the engine of a teacher the run starts itself",
    ):
        validate(
            opd(
                tmp_path,
                "orchestrator.teacher.client.base_url=http://127.0.0.1:1/v1",
                "orchestrator.teacher.tensor_parallel_size=2",
            )
        )
    with pytest.raises(
        ConfigError, match="orchestrator.teacher.client.model: the run's own teacher serves big under that name"
    ):
        validate(opd(tmp_path, *gpu, "orchestrator.teacher.client.model=other"))
    # a bench measures the run's own parts: no teacher is started for it
    bench = opd(tmp_path, "orchestrator.teacher.model=tiny", "bench.mode=inference")
    assert "teacher" not in make_plan(bench, cores=[0, 1]).group_names


def test_a_teacher_that_does_not_answer_ends_the_run_in_one_line(tmp_path):
    import asyncio
    import socket

    from prime_hpc.core.errors import UserError
    from prime_hpc.orchestrator.rollouts import Rollout
    from prime_hpc.orchestrator.teacher import Teacher, TeacherAt

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    teacher = Teacher(TeacherAt(f"http://127.0.0.1:{port}/v1", "k", "tiny"), lambda: "tiny")
    teacher.retry_delays_s = (0.01, 0.01)
    r = Rollout("e", 0, 0.0, [1, 2, 3], [False, True, True], [0.0, -1.0, -1.0], [0], 1, False)

    async def ask() -> None:
        try:
            await teacher.add_logprobs([r, r])
        finally:
            await teacher.aclose()

    with pytest.raises(
        UserError,
        match=rf"^the teacher at http://127.0.0.1:{port}/v1/completions did not answer: ConnectError.* \(3 tries\)$",
    ):
        asyncio.run(ask())


def test_a_teacher_whose_answer_breaks_off_is_asked_again(tmp_path):
    """A teacher server that dies mid-answer (its router relays the broken stream) costs a
    new try of the request, not the run."""
    import asyncio

    from prime_hpc.orchestrator.rollouts import Rollout
    from prime_hpc.orchestrator.teacher import Teacher, TeacherAt

    asked: list[bytes] = []
    whole = json.dumps(
        {"choices": [{"prompt_logprobs": [None, {"2": {"logprob": -0.5}}, {"3": {"logprob": -0.25}}]}]}
    ).encode()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1])
        asked.append(await reader.readexactly(length))
        if len(asked) == 1:  # the answer's headers and half a chunk, then the connection is gone
            writer.write(b'HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n40\r\n{"choi')
        else:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(whole), whole))
        await writer.drain()
        writer.close()

    r = Rollout("e", 0, 0.0, [1, 2, 3], [False, True, True], [0.0, -1.0, -1.0], [0], 1, False)

    async def ask() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        teacher = Teacher(TeacherAt(f"http://127.0.0.1:{port}/v1", "k", "tiny"), lambda: "tiny")
        teacher.retry_delays_s = (0.01,)
        try:
            await teacher.add_logprobs([r])
        finally:
            await teacher.aclose()
            server.close()

    asyncio.run(ask())
    assert len(asked) == 2 and asked[0] == asked[1] and json.loads(asked[0])["prompt"] == [1, 2, 3]
    assert r.teacher_logprobs == [0.0, -0.5, -0.25]
