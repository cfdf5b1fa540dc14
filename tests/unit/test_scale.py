"""Extra inference jobs (`prime-hpc scale`) without a cluster: the job script (golden and
shell-hostile paths), the slot names, which extra jobs `inference=-N` cancels, what
job.json records and how the job's helper ends it, what the read-only views show, and the
command's one-line refusals."""

from __future__ import annotations

import json
import shlex
import subprocess
import time

import pytest

from prime_hpc.config.compose import compose
from prime_hpc.job import extra
from prime_hpc.launcher import scale
from prime_hpc.launcher.plan import inference_job_plan
from prime_hpc.launcher.render import render_inference
from prime_hpc.rundir import RunDir, jobs, logtree
from prime_hpc.rundir.fleet import fleet as read_fleet
from prime_hpc.rundir.layout import Slot, parse_slot, server_slot
from prime_hpc.watch import plot
from prime_hpc.watch.extra_jobs import format_extra, log_sources, state_of
from prime_hpc.watch.tail import extra_sources
from tests.conftest import HOSTILE, REPO, cli, hydra_quote

GOLDEN = REPO / "tests" / "golden" / "inference.sbatch"
GOLDEN_OVERRIDES = [
    "+experiment=reverse_text",
    "cluster=dev",
    "output_dir=/shared/runs/reverse_text",
    "cluster.cache_dir=/shared/cache",
    'cluster.env_setup=["module load cuda"]',
    # the scale's overrides (partition=scavenger time=00:20:00 qos=low gpus=... on a cpu run: mem)
    "cluster.partition=scavenger",
    "cluster.time=00:20:00",
    "cluster.qos=low",
    "cluster.account=proj",
    "cluster.constraint=ib",
    'cluster.sbatch_extra=["--mail-type=END"]',
    "cluster.inference.mem_gb=16",
    "cluster.signal_delay_s=90",
]


def golden_job():
    return inference_job_plan(compose(GOLDEN_OVERRIDES), 2, python="/opt/venv/bin/python", cores=[0, 1])


def test_extra_job_script_matches_golden_file():
    text = render_inference(golden_job())
    assert text == GOLDEN.read_text(), (
        "the rendering of inference.sbatch changed; review the difference, then write the golden anew with "
        "`python -m tests.unit.test_scale`"
    )
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)


if __name__ == "__main__":  # write the golden from today's rendering (after reviewing the change)
    GOLDEN.write_text(render_inference(golden_job()))
    print(f"wrote {GOLDEN}")


def test_extra_job_script_with_a_hostile_run_dir(tmp_path):
    out = tmp_path / HOSTILE
    cfg = compose(["+experiment=reverse_text", "cluster=dev", f"output_dir={hydra_quote(str(out))}"])
    text = render_inference(inference_job_plan(cfg, 1, python="/opt/venv/bin/python", cores=[0, 1]))
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)
    # the run dir reaches the shell as one quoted word: in the helper and in the server's config path
    assert f'-m prime_hpc.job.extra "$1" {shlex.quote(str(out))} --job-id' in text
    assert f"--config {shlex.quote(str(out / 'configs' / 'inference.yaml'))} --extra-job" in text
    # the extra job's batch output: under the run's logs/extra/, quoted for sbatch
    output = next(line for line in text.splitlines() if line.startswith("#SBATCH --output="))
    assert output.startswith('#SBATCH --output="') and output.endswith('/logs/extra/%j.out"'), output
    assert "--no-requeue" in text and "--signal=B:USR2@120" in text


# --------------------------------------------------------------------------- slots
def test_slot_names_of_the_runs_servers_and_of_extra_jobs(tmp_path):
    run = RunDir(tmp_path)
    assert server_slot(1) == "inference_1" and server_slot(0, "57") == "inference_57.0"
    assert parse_slot("inference_1") == Slot(None, 1) and parse_slot("inference_57.3") == Slot("57", 3)
    assert parse_slot("inference_57.3.json").name == "inference_57.3"
    assert run.inference_endpoint(1) == run.inference_endpoint("inference_1") == run.endpoints_dir / "inference_1.json"
    assert run.inference_endpoint("inference_57.0") == run.endpoints_dir / "inference_57.0.json"
    assert run.server_heartbeat("inference_57.0") == run.heartbeats_dir / "inference_57.0"
    assert run.server_heartbeat(1) == run.heartbeat("inference", 1) == run.heartbeats_dir / "inference_1"
    for bad in ("inference_", "router", "inference_57.x", "inference_../x.0", "inference_5 7.0", "inference_a.0"):
        assert parse_slot(bad) is None
        with pytest.raises(ValueError):
            run.inference_endpoint(bad)
    logs = run.extra_job_logs("57")
    assert logtree.log_of(logs, "inference_57.1") == logs / "inference" / "node_57.1.log"


# --------------------------------------------------------------------------- inference=-N
def _x(job_id: str, nodes: int) -> dict:
    return {"job_id": job_id, "nodes": nodes}


@pytest.mark.parametrize(
    "extras, n, cancelled",
    [
        ([_x("51", 1), _x("52", 2), _x("53", 1)], 1, ["53"]),  # newest first
        ([_x("51", 1), _x("52", 2), _x("53", 1)], 3, ["53", "52"]),
        ([_x("51", 1), _x("52", 2), _x("53", 1)], 4, ["53", "52", "51"]),
        ([_x("51", 2)], 2, ["51"]),
    ],
)
def test_minus_n_cancels_the_newest_whole_jobs(extras, n, cancelled):
    assert [x["job_id"] for x in scale.to_cancel(extras, n)] == cancelled


@pytest.mark.parametrize(
    "extras, n, says",
    [
        (
            [_x("51", 1), _x("52", 2)],
            1,
            "job 52 (2 node(s)), job 51 (1 node(s)); remove one of: inference=-2, inference=-3",
        ),
        ([_x("51", 1), _x("52", 2)], 5, "remove one of: inference=-2, inference=-3"),
        ([], 1, "the run has no live extra inference job"),
    ],
)
def test_minus_n_that_is_no_sum_of_whole_jobs_is_refused_listing_them(extras, n, says):
    with pytest.raises(scale.ScaleError) as e:
        scale.to_cancel(extras, n)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_the_change_and_the_overrides_of_a_scale():
    assert scale.parse_delta("inference=+2") == 2 and scale.parse_delta("inference=-1") == -1
    for bad in ("inference=2", "inference=+0", "trainer=+1", "inference=+x", "inference="):
        with pytest.raises(scale.ScaleError):
            scale.parse_delta(bad)
    assert scale.cluster_overrides(["partition=scavenger", "time=00:20:00", "gpus=4", "cluster.qos=low"]) == [
        "cluster.partition=scavenger",
        "cluster.time=00:20:00",
        "cluster.inference.gpus_per_node=4",
        "cluster.qos=low",
    ]
    for bad, says in (
        ("inference.max_model_len=64", "cannot change for an extra inference job"),
        ("cluster.backend=local", "cannot change"),
        ("nodes=2", "cannot change"),
        ("cluster.inference.nodes=2", r"the N of inference=\+N"),
        ("partition", "is not key=value"),
    ):
        with pytest.raises(scale.ScaleError, match=says):
            scale.cluster_overrides([bad])


# --------------------------------------------------------------------------- job.json records
def _run_with_extra(tmp_path, backend="slurm", run_state="RUNNING", **record) -> RunDir:
    run = RunDir(tmp_path / "run")
    jobs.update_job(
        run, name="rt", kind="rl", backend=backend, state=run_state, job_ids=["42"], output_dir=str(run.root)
    )
    jobs.add_extra_job(run, {"job_id": "57", "nodes": 2, "backend": backend, "state": "PENDING", **record})
    return run


def test_the_extra_jobs_start_and_end_in_its_record(tmp_path):
    run = _run_with_extra(tmp_path)
    logs = extra.start(run, "57")
    assert logs == str(run.root / "logs" / "extra" / "57") and (run.extra_job_logs("57") / "inference").is_dir()
    rec = jobs.extra_job(jobs.read_job(run), "57")
    assert rec["state"] == "RUNNING" and rec["started_at"] and rec["logs"] == logs
    assert extra.running(run, "57")
    fleet = {r["slot"]: r for r in read_fleet(run)}  # `status` shows its servers starting
    assert set(fleet) == {"inference_57.0", "inference_57.1"} and fleet["inference_57.1"]["state"] == "starting"
    assert fleet["inference_57.1"]["log"] == str(run.extra_job_logs("57") / "inference" / "node_57.1.log")
    # a server that was killed left its endpoint and heartbeat: the end removes them
    for slot in ("inference_57.0", "inference_57.1"):
        run.inference_endpoint(slot).parent.mkdir(parents=True, exist_ok=True)
        run.inference_endpoint(slot).write_text("{}")
        run.server_heartbeat(slot).parent.mkdir(parents=True, exist_ok=True)
        run.server_heartbeat(slot).write_text("{}")
    run.inference_endpoint(0).write_text("{}")  # the run's own server stays
    assert extra.main(["leave", str(run.root), "--job-id", "57", "--reason", "USR2"]) == 0
    assert run.extra_leave_request("57").read_text() == "USR2\n"  # what its servers watch
    extra.end(run, "57", 0, "USR2", extra.parse_exits(" 1=0 0=0"))
    rec = jobs.extra_job(jobs.read_job(run), "57")
    assert rec["state"] == "TIMEOUT" and rec["end"] == "USR2" and rec["exits"] == {"0": 0, "1": 0}
    assert sorted(p.name for p in run.endpoints_dir.iterdir()) == ["inference_0.json"]
    assert list(run.heartbeats_dir.iterdir()) == [] and read_fleet(run) == []


def test_an_extra_job_starts_while_an_attempt_of_the_run_empties_its_directories(tmp_path):
    """The servers' own jobs (`cluster.inference_job=own`) can start in the same second as
    the run's job, whose attempt empties `fleet/`: the fleet's view of them starting is
    then lost, never the job (the relay records its servers once they serve)."""
    run = _run_with_extra(tmp_path)
    run.fleet_dir.parent.mkdir(parents=True, exist_ok=True)
    run.fleet_dir.write_text("")  # not a directory this moment: every write into it fails
    logs = extra.start(run, "57")
    assert jobs.extra_job(jobs.read_job(run), "57")["state"] == "RUNNING" and logs


def test_a_hung_server_of_the_job_is_handed_to_its_script_to_kill(tmp_path, capsys):
    run = _run_with_extra(tmp_path)
    extra.start(run, "57")
    request = run.restart_request("inference_57.1")
    request.parent.mkdir(parents=True, exist_ok=True)
    request.write_text(json.dumps({"slot": "inference_57.1", "slurm_step": "57.1", "reason": "hung: no heartbeat"}))
    assert extra.main(["hung", str(run.root), "--job-id", "57", "--request", str(request)]) == 0
    assert capsys.readouterr().out.split() == ["inference_57.1", "57.1"]  # the script: scancel --signal=KILL 57.1
    assert not request.exists()
    assert {r["slot"]: r["state"] for r in read_fleet(run)}["inference_57.1"] == "hung"


@pytest.mark.parametrize(
    "recorded, reason, exits, cause, state",
    [
        ("CANCELLED", "STOPPED", {"0": 0}, "CANCELLED", "CANCELLED"),  # prime-hpc scale -N / cancel
        ("CANCELLED", "USR2", {"0": 0}, "", "CANCELLED"),  # asked to leave by prime-hpc scale -N
        ("RUNNING", "USR2", {"0": 0}, "", "TIMEOUT"),  # drained before its time limit
        ("RUNNING", "RUN_ENDED", {"0": 0}, "", "COMPLETED"),  # the run ended
        ("RUNNING", "STOPPED", {"0": 0}, "PREEMPTED", "PREEMPTED"),  # SLURM says why
        ("RUNNING", "", {"0": 0, "1": 0}, "PREEMPTED", "PREEMPTED"),  # a grace time: only the servers got it
        ("RUNNING", "", {"0": 1, "1": 0}, "CANCELLED", "FAILED"),  # a server failed on its own
    ],
)
def test_how_an_extra_job_ended(recorded, reason, exits, cause, state):
    assert extra.end_state(recorded, reason, exits, cause) == state


def test_an_extra_job_the_run_does_not_record_or_that_was_cancelled_starts_nothing(tmp_path):
    run = _run_with_extra(tmp_path)
    with pytest.raises(RuntimeError, match="not an extra inference job"):
        extra.start(run, "58")
    jobs.update_extra_job(run, "57", state="CANCELLED")
    with pytest.raises(RuntimeError, match="cancelled before it started"):
        extra.start(run, "57")
    assert not extra.running(run, "57")
    ended = _run_with_extra(tmp_path / "b", run_state="COMPLETED")
    with pytest.raises(RuntimeError, match="the run ended"):
        extra.start(ended, "57")
    assert jobs.extra_job(jobs.read_job(ended), "57")["state"] == "COMPLETED"
    assert not extra.running(ended, "57")


def test_a_run_between_two_attempts_still_runs_for_its_extra_jobs(tmp_path):
    assert extra.running(_run_with_extra(tmp_path, run_state="REQUEUED"), "57")


# --------------------------------------------------------------------------- what the views show
def test_status_lines_of_the_extra_jobs():
    now = time.time()
    rows = [
        {
            "job_id": "57",
            "nodes": 1,
            "state": "RUNNING",
            "submitted_at": now - 30,
            "partition": "scavenger",
            "time": "00:20:00",
        },
        {
            "job_id": "56",
            "nodes": 2,
            "state": "CANCELLED",
            "submitted_at": now - 90,
            "ended_at": now - 10,
            "end": "STOPPED",
        },
        {"job_id": "55", "nodes": 2, "state": "RUNNING", "submitted_at": now - 99, "time": "04:00:00", "fleet": True},
    ]
    lines = format_extra(rows)
    assert lines[0].split() == ["EXTRA", "JOB", "NODES", "STATE", "SUBMITTED", "ENDED", "WHERE"]
    assert lines[1].split()[:3] == ["57", "1", "RUNNING"] and "partition=scavenger time=00:20:00" in lines[1]
    assert lines[2].split()[:3] == ["56", "2", "CANCELLED"] and "10s ago (STOPPED)" in lines[2]
    assert lines[3].rstrip().endswith("the run's servers time=04:00:00")  # cluster.inference_job=own
    assert state_of({"job_id": "1", "state": "RUNNING"}, {}) == "ENDED"  # killed before it could record its end
    assert state_of({"job_id": "1", "state": "PENDING"}, {"1": "RUNNING"}) == "RUNNING"


def test_tail_follows_the_servers_of_extra_jobs_that_had_not_ended_when_the_attempt_started(tmp_path):
    run = _run_with_extra(tmp_path)
    jobs.add_extra_job(run, {"job_id": "50", "nodes": 1, "state": "CANCELLED", "ended_at": 100.0})
    jobs.update_job(run, attempts=[{"attempt": 1, "started_at": 200.0}])
    job = jobs.read_job(run)
    assert [label for _, label in log_sources(run, job, since=200.0)] == ["inference[57.0]", "inference[57.1]"]
    log = run.extra_job_logs("57") / "inference" / "node_57.1.log"
    log.parent.mkdir(parents=True)
    log.write_text("serving\n")
    assert [(s.path, s.label) for s in extra_sources(run)] == [(log, "inference[57.1]")]


def test_the_server_count_is_plotted_when_it_changed(tmp_path):
    run = RunDir(tmp_path)
    rows = [{"step": s, "time/step": 1.0, "inference/servers": 2 if 5 <= s < 20 else 1} for s in range(1, 30)]
    run.metrics("orchestrator").parent.mkdir(parents=True)
    run.metrics("orchestrator").write_text("".join(json.dumps(r) + "\n" for r in rows))
    panels = plot.build_panels([plot.load_metrics(run)])
    timing = panels[4]
    assert timing.title.endswith("steps: inference servers") and [s.key for s in timing.twin] == ["inference/servers"]
    assert timing.twin[0].values[3:5] == (1.0, 2.0)
    plot.plot_runs([("scaled", run)], tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 0
    steady = RunDir(tmp_path / "steady")
    steady.metrics("orchestrator").parent.mkdir(parents=True)
    steady.metrics("orchestrator").write_text(json.dumps({"step": 1, "inference/servers": 1}) + "\n")
    assert plot.build_panels([plot.load_metrics(steady)])[4].twin == []


# --------------------------------------------------------------------------- the command's refusals
def _indexed(run: RunDir, backend: str, kind: str = "rl", state: str = "RUNNING", mode: str = "run") -> None:
    jobs.update_job(
        run,
        name="rt",
        kind=kind,
        mode=mode,
        backend=backend,
        state=state,
        job_ids=["42"],
        groups=["orchestrator", "inference", "trainer"] if kind == "rl" else ["trainer"],
        output_dir=str(run.root),
    )
    jobs.record(
        jobs.JobRef(
            job_id="42", name="rt", output_dir=str(run.root), backend=backend, submitted_at=0, mode=mode, kind=kind
        )
    )


@pytest.mark.parametrize(
    "backend, kind, state, args, says",
    [
        ("local", "rl", "RUNNING", ["inference=+1"], "cluster.backend=local, which takes no extra inference jobs"),
        ("slurm", "sft", "RUNNING", ["inference=+1"], "only an RL run has inference servers to scale"),
        ("slurm", "rl", "COMPLETED", ["inference=+1"], "is not running (COMPLETED)"),
        ("slurm", "rl", "RUNNING", ["inference=2"], "say how many inference nodes to add or remove"),
        ("slurm", "rl", "RUNNING", ["inference=-1", "partition=x"], "takes no overrides"),
        ("slurm", "rl", "RUNNING", ["inference=+1", "trainer.optim.lr=1"], "cannot change for an extra inference job"),
    ],
)
def test_scale_refuses_in_one_line(tmp_path, backend, kind, state, args, says):
    run = RunDir(tmp_path / "run")
    _indexed(run, backend, kind, state)
    r = cli("scale", "42", *args)
    assert r.returncode == 2, r
    err = r.stderr.strip()
    assert err.startswith("prime-hpc: error: scale: ") and says in err and "\n" not in err, err
    assert r.stdout == ""
    assert not jobs.read_job(run).get("extra_jobs")  # nothing submitted, nothing recorded


def test_scale_of_an_unknown_job_is_refused_in_one_line(tmp_path):
    r = cli("scale", "4711", "inference=+1")
    assert r.returncode == 2 and r.stderr.strip().startswith("prime-hpc: error: no job '4711'"), r
    assert "\n" not in r.stderr.strip()
