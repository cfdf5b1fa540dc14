"""Watching runs on the real dev cluster (tools/dev-cluster start): a sweep as one unit
(job.json, the --max-parallel dependency chain, list, status, plot, cancel), status --json
of a finished run against its metrics, status/list/tail when SLURM cannot be asked, and
the exit code of submit --follow.

Everything is submitted at once by the module fixture (a 2-point SFT sweep chained by
--max-parallel 1, a held sweep to cancel, a run followed to completion and a run that
fails inside its job), so the runs overlap and the file stays within a few minutes; the
tests then look at them in turn. Every job submitted is cancelled at the end."""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from prime_hpc.core.net import LOOPBACK, free_port
from prime_hpc.rundir import RunDir, jobs
from tests.conftest import REPO, cli

pytestmark = [pytest.mark.slurm]

SFT = ["+experiment=reverse_text_sft", "cluster=dev", "max_steps=4"]
LRS = (1e-3, 3e-4)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NOTE = "SLURM could not be asked"
RUN_TIMEOUT_S = 300  # one tiny SFT run takes ~1 minute on this 2-core machine when it is busy


@dataclass
class Work:
    """What the module submitted: its own job index (state dir), the outputs."""

    root: Path
    env: dict
    sweep: subprocess.CompletedProcess  # submit -m ... --max-parallel 1
    held: subprocess.CompletedProcess  # submit -m ... (held in cluster.env_setup)
    follow: dict = field(default_factory=dict)  # "ok"/"bad": (Popen, stdout file, stderr file)

    def cli(self, *args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
        return cli(*args, env={**self.env, **(env or {})}, timeout=timeout)

    def points(self, name: str) -> list[RunDir]:
        return [RunDir(self.root / name / str(i)) for i in range(len(LRS))]

    def job_id(self, run: RunDir) -> str:
        return str(jobs.read_job(run)["job_ids"][-1])

    def followed(self, key: str, timeout: float = RUN_TIMEOUT_S) -> tuple[int, str, str]:
        """Exit code, stdout, stderr of a `submit -f` once it returned."""
        proc, out, err = self.follow[key]
        rc = proc.wait(timeout=timeout)
        return rc, out.read_text(), err.read_text()


def sweep_id(stdout: str) -> str:
    m = re.search(r"^sweep (sweep-[0-9a-f]+): 2 runs", stdout, re.M)
    assert m, stdout
    return m.group(1)


def wait_for(what: str, fn, timeout: float = RUN_TIMEOUT_S, poll: float = 1.0):
    """fn()'s first truthy value within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(poll)


def squeue(job_id: str, fmt: str) -> str:
    return subprocess.run(
        ["squeue", "-h", "-j", job_id, "-o", fmt], capture_output=True, text=True, timeout=30
    ).stdout.strip()


def sacct(job_id: str, fields: str = "State") -> str:
    return subprocess.run(
        ["sacct", "-n", "-X", "-P", "-o", fields, "-j", job_id], capture_output=True, text=True, timeout=30
    ).stdout.strip()


def trainer_rows(run: RunDir) -> list[dict]:
    return [json.loads(line) for line in run.metrics("trainer").read_text().splitlines()]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    if shutil.which("sinfo") is None:
        pytest.fail("SLURM is not installed here; run tools/dev-cluster start")
    up = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=30)
    if up.returncode != 0 or not any(s.startswith(("idle", "mix", "alloc")) for s in up.stdout.split()):
        pytest.fail(
            f"the dev cluster is not up ({up.stderr.strip() or up.stdout.strip()}); run tools/dev-cluster start"
        )
    root = tmp_path_factory.mktemp("watch")
    env = {"PRIME_HPC_STATE_DIR": str(root / "state")}
    lrs = "trainer.optim.lr=" + ",".join(f"{lr:g}" for lr in LRS)
    procs: list[subprocess.Popen] = []
    try:
        # the sweep first: its two points, one after the other, are the longest wait here
        # (no validation passes: ~8 s less per point)
        sweep = cli(
            "submit",
            "-m",
            *SFT,
            f"output_dir={root / 'sweep'}",
            lrs,
            "--max-parallel",
            "1",
            "trainer.val.interval=null",
            env=env,
        )
        # each `submit -f` keeps following in the background
        follow = {}
        # "bad" passes every submit-time check and fails in its job: the dataset's function does not exist
        for key, extra in (("ok", []), ("bad", ["trainer.data.name=reverse_text:no_such_function"])):
            out, err = root / f"{key}.stdout", root / f"{key}.stderr"
            with open(out, "w") as o, open(err, "w") as e:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "prime_hpc.cli", "submit", *SFT, f"output_dir={root / key}", *extra, "-f"],
                    stdout=o,
                    stderr=e,
                    text=True,
                    cwd=REPO,
                    env={**os.environ, **env},
                )
            procs.append(proc)
            follow[key] = (proc, out, err)
        # held in its job script: point 0 runs (sleeping), point 1 waits for it
        held = cli(
            "submit",
            "-m",
            *SFT,
            f"output_dir={root / 'held'}",
            lrs,
            "--max-parallel",
            "1",
            'cluster.env_setup=["sleep 300"]',
            env=env,
        )
        w = Work(root=root, env=env, sweep=sweep, held=held, follow=follow)
        yield w
    finally:
        for proc in procs:  # a follow still running (a failed test): stop following
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)
        index = root / "state" / "jobs.jsonl"  # exactly the jobs this module submitted
        ids = sorted({json.loads(line)["job_id"] for line in index.read_text().splitlines()}) if index.exists() else []
        if ids:
            subprocess.run(["scancel", *ids], capture_output=True, timeout=60)


# --------------------------------------------------------------------------- a sweep as one unit
def test_a_sweep_is_recorded_chained_listed_and_shown_as_one_unit(work):
    r = work.sweep
    assert r.returncode == 0, r.stdout + r.stderr
    sid = sweep_id(r.stdout)
    assert "at most 1 at a time" in r.stdout
    points = work.points("sweep")
    ids = [work.job_id(p) for p in points]
    # every point's job.json names the sweep, the point and what it sets
    for i, p in enumerate(points):
        sw = jobs.read_job(p)["sweep"]
        assert (sw["id"], sw["point"], sw["points"]) == (sid, i, 2)
        key, value = sw["swept"].split("=")
        assert key == "trainer.optim.lr" and float(value) == LRS[i]
    # --max-parallel 1: the second point waits on SLURM for the first to end, whatever its end
    state, reason, dependency = squeue(ids[1], "%T|%r|%E").split("|")
    assert (state, reason) == ("PENDING", "Dependency")
    assert dependency.startswith(f"afterany:{ids[0]}")

    ls = work.cli("list")
    assert ls.returncode == 0 and ls.stderr == "", ls.stderr
    lines = ls.stdout.splitlines()
    (head,) = [i for i, line in enumerate(lines) if line.startswith(sid)]
    assert lines[head].split()[1:] == ["2", "points", "sweep"]
    grouped = lines[head + 1 : head + 3]  # both points right under the sweep, indented
    assert all(line.startswith("  ") for line in grouped), ls.stdout
    for i, job_id in enumerate(ids):
        (line,) = [g for g in grouped if g.split()[0] == job_id]
        assert line.endswith(f"[{jobs.read_job(points[i])['sweep']['swept']}]") and str(points[i].root) in line

    st = work.cli("status", sid)
    assert st.returncode == 0 and st.stderr == "", st.stderr
    out = st.stdout.splitlines()
    assert out[0] == f"sweep {sid}: 2 points"
    assert out[1].split() == ["POINT", "JOB", "STATE", "STEP", "REWARD", "LOSS", "SWEPT"]
    rows = [line.split() for line in out[2:]]
    assert [row[:2] for row in rows] == [["0", ids[0]], ["1", ids[1]]]
    assert rows[0][2] in ("PENDING", "RUNNING") and rows[1][2] == "PENDING"
    assert [row[-1] for row in rows] == [jobs.read_job(p)["sweep"]["swept"] for p in points]
    js = json.loads(work.cli("status", sid, "--json").stdout)
    assert js["sweep"] == sid and [p["job_id"] for p in js["points"]] == ids


def test_cancel_of_a_sweep_cancels_every_point(work):
    r = work.held
    assert r.returncode == 0, r.stdout + r.stderr
    sid = sweep_id(r.stdout)
    points = work.points("held")
    ids = [work.job_id(p) for p in points]
    wait_for(f"job {ids[0]} to run", lambda: squeue(ids[0], "%T") == "RUNNING", timeout=120)
    assert squeue(ids[1], "%T|%r") == "PENDING|Dependency"

    c = work.cli("cancel", sid)
    assert c.returncode == 0, c.stdout + c.stderr
    for job_id in ids:
        assert f"cancelled job {job_id}" in c.stdout
    for job_id in ids:
        wait_for(
            f"sacct to record job {job_id} cancelled", lambda job_id=job_id: sacct(job_id).startswith("CANCELLED"), 60
        )
    # job.json is the job's own record, written as its script ends (after SLURM's record)
    wait_for(
        "job.json to record both points cancelled",
        lambda: [jobs.read_job(p)["state"] for p in points] == ["CANCELLED", "CANCELLED"],
        60,
    )
    # the waiting point was cancelled before the running one: it never started
    # (sacct gives a job cancelled while pending a Start time, the cancel's; it has no node)
    assert sacct(ids[1], "NodeList") == "None assigned"
    assert not any(a.get("started_at") for a in jobs.read_job(points[1]).get("attempts", []))

    def shown() -> list[str]:
        st = work.cli("status", sid)
        assert st.returncode == 0, st.stderr
        return [line.split()[2] for line in st.stdout.splitlines()[2:]]

    # never RUNNING again: while SLURM cleans up after the cancel the point is COMPLETING
    assert set(shown()) <= {"COMPLETING", "CANCELLED"}
    wait_for("status to show both points cancelled", lambda: shown() == ["CANCELLED", "CANCELLED"], 90, 2)


# --------------------------------------------------------------------------- submit --follow
def test_follow_exits_1_when_the_run_fails_in_its_job(work):
    rc, out, err = work.followed("bad")
    run = RunDir(work.root / "bad")
    job_id = work.job_id(run)
    assert f"submitted run job {job_id}" in out  # accepted at submit time: it fails in the job
    assert rc == 1, out + err
    # the trainer's own complaint, then the final state naming the failed component and its log
    assert re.search(r"^trainer\[0\] +\| .*dataset 'reverse_text:no_such_function': cannot import", out, re.M), out
    last = out.splitlines()[-1]
    assert last.startswith(f"job {job_id} ended: FAILED (trainer:") and "trainer/node_0.log" in last
    job = jobs.read_job(run)
    assert job["state"] == "FAILED" and job["failure"]["component"] == "trainer"


def test_follow_exits_0_when_the_run_completes(work):
    rc, out, err = work.followed("ok")
    run = RunDir(work.root / "ok")
    job_id = work.job_id(run)
    assert rc == 0, out + err
    assert out.splitlines()[-1] == f"job {job_id} ended: COMPLETED"
    assert re.search(r"^trainer\[0\] +\| .*\| step 4 \| loss", out, re.M), out
    assert jobs.read_job(run)["state"] == "COMPLETED"


# --------------------------------------------------------------------------- status --json
def test_status_json_of_a_completed_run_gives_its_vital_signs(work):
    work.followed("ok")
    run = RunDir(work.root / "ok")
    job_id = work.job_id(run)
    r = work.cli("status", job_id, "--json")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert len(r.stdout.splitlines()) == 1  # one JSON object, one line
    s = json.loads(r.stdout)
    assert (s["job_id"], s["state"], s["kind"], s["backend"]) == (job_id, "COMPLETED", "sft", "slurm")
    assert s["output_dir"] == str(run.root) and s["slurm_note"] is None and s["failure"] is None
    assert s["groups"]["trainer"]["state"] == "COMPLETED"
    assert s["groups"]["trainer"]["heartbeat"]["step"] == 4
    assert [a["end"] for a in s["attempts"]] == ["COMPLETED"] and s["requeues"] == 0

    rows = trainer_rows(run)
    steps = [row for row in rows if "loss/mean" in row]
    last = steps[-1]
    v = s["vitals"]
    assert (v["trainer_step"], v["max_steps"]) == (4, 4) and [row["step"] for row in steps] == [1, 2, 3, 4]
    assert v["loss"] == pytest.approx(last["loss/mean"])
    assert v["val_loss"] == pytest.approx([row["val/loss"] for row in rows if "val/loss" in row][-1])
    assert v["entropy"] == pytest.approx(last["entropy/mean"])
    assert v["tokens_per_s"] == pytest.approx(last["perf/throughput"])
    assert v["s_per_step"] == pytest.approx(statistics.mean(row["time/step"] for row in steps))
    assert v["last_step_at"] == pytest.approx(last["time"])
    assert v["eta_s"] is None  # it has ended: nothing left to estimate
    # an SFT run has no orchestrator: no reward, no mismatch KL
    assert v["orchestrator_step"] is None and v["reward"] is None and v["mismatch_kl"] is None

    text = work.cli("status", job_id).stdout
    assert "step: trainer 4/4" in text and "orchestrator" not in text
    assert f"loss {last['loss/mean']:.4f}" in text and f"{v['s_per_step']:.2f} s/step" in text


# --------------------------------------------------------------------------- SLURM unreachable
def unreachable_conf(tmp: Path) -> Path:
    """A copy of the dev cluster's slurm.conf naming unused loopback ports for the
    controller and the accounting daemon (and a short message timeout)."""
    show = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=30).stdout
    (conf,) = re.findall(r"^SLURM_CONF\s*=\s*(\S+)", show, re.M)
    text = Path(conf).read_text()
    for key, value in (
        ("SlurmctldPort", free_port(LOOPBACK)),
        ("AccountingStoragePort", free_port(LOOPBACK)),
        ("MessageTimeout", 2),
    ):
        text, n = re.subn(rf"^{key}=.*$", f"{key}={value}", text, flags=re.M)
        if not n:
            text += f"\n{key}={value}\n"
    out = tmp / "slurm.conf"
    out.write_text(text)
    return out


def test_status_list_and_tail_answer_when_slurm_cannot_be_asked(work, tmp_path):
    work.followed("ok")
    run = RunDir(work.root / "ok")
    job_id = work.job_id(run)
    down = {"SLURM_CONF": str(unreachable_conf(tmp_path))}
    for cmd in (["squeue", "-h", "-j", job_id], ["sacct", "-n", "-X", "-j", job_id]):  # SLURM really cannot answer
        t0 = time.monotonic()
        assert subprocess.run(cmd, capture_output=True, timeout=60, env={**os.environ, **down}).returncode != 0
        assert time.monotonic() - t0 < 20

    # a job that recorded its own successful end needs no SLURM at all
    st = work.cli("status", job_id, env=down)
    assert st.returncode == 0 and st.stderr == "" and NOTE not in st.stdout, st.stdout + st.stderr
    assert st.stdout.splitlines()[0].split()[:4] == ["job", job_id, "reverse_text_sft", "COMPLETED"]
    assert "UNKNOWN" not in st.stdout and "step: trainer 4/4" in st.stdout
    js = json.loads(work.cli("status", job_id, "--json", env=down).stdout)
    assert js["state"] == "COMPLETED" and js["slurm_note"] is None
    # one that did not: the recorded state, and one line saying SLURM could not be asked
    unfinished = tmp_path / "copy"
    shutil.copytree(run.root, unfinished)
    job = json.loads((unfinished / "job.json").read_text())
    (unfinished / "job.json").write_text(json.dumps({**job, "state": "FAILED"}))
    st = work.cli("status", str(unfinished), env=down)
    assert st.returncode == 0 and st.stderr == "", st.stderr
    notes = [line for line in st.stdout.splitlines() if NOTE in line]
    assert len(notes) == 1 and "state as recorded in job.json" in notes[0], st.stdout
    assert st.stdout.splitlines()[0].split()[3] == "FAILED"

    ls = work.cli("list", env=down)
    assert ls.returncode == 0 and ls.stderr == "", ls.stderr
    notes = [line for line in ls.stdout.splitlines() if NOTE in line]
    assert len(notes) == 1 and ls.stdout.startswith(NOTE), ls.stdout
    (row,) = [line.split() for line in ls.stdout.splitlines() if line.split()[:1] == [job_id]]
    assert row[2] == "COMPLETED" and "UNKNOWN" not in ls.stdout

    sweep = work.cli("status", sweep_id(work.held.stdout), env=down)  # a sweep: one line for all its points
    assert sweep.returncode == 0 and sweep.stderr == "", sweep.stderr
    assert len([line for line in sweep.stdout.splitlines() if NOTE in line]) == 1, sweep.stdout

    tail = work.cli("tail", job_id, "--no-follow", env=down)  # a finished job's record is enough
    assert tail.returncode == 0 and tail.stderr == "", tail.stderr
    assert tail.stdout.splitlines()[-1] == f"job {job_id} ended: COMPLETED" and NOTE not in tail.stdout
    assert re.search(r"^trainer\[0\] +\| .*done at step 4", tail.stdout, re.M), tail.stdout


# --------------------------------------------------------------------------- the sweep's end: status, plot
def test_a_finished_sweep_in_status_and_plot(work, tmp_path, monkeypatch):
    sid = sweep_id(work.sweep.stdout)
    points = work.points("sweep")
    ends = wait_for(
        "both sweep points to end",
        lambda: all(jobs.read_job(p).get("ended_at") for p in points) and [jobs.read_job(p)["state"] for p in points],
        timeout=2 * RUN_TIMEOUT_S,
    )
    assert ends == ["COMPLETED", "COMPLETED"]
    losses = [[row["loss/mean"] for row in trainer_rows(p) if "loss/mean" in row] for p in points]
    assert all(len(x) == 4 for x in losses)

    st = work.cli("status", sid)
    assert st.returncode == 0 and st.stderr == "", st.stderr
    rows = [line.split() for line in st.stdout.splitlines()[2:]]
    assert len(rows) == 2
    for i, row in enumerate(rows):
        assert row[2:6] == ["COMPLETED", "4/4", "-", f"{losses[i][-1]:.4f}"], st.stdout

    out = tmp_path / "x.png"
    p = work.cli("plot", sid, "-o", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip() == f"wrote {out} (2 runs)"
    assert out.read_bytes()[:8] == PNG_MAGIC

    # the figure `plot` draws: its legend names each point by its swept value
    from prime_hpc.cli.plot import runs_of
    from prime_hpc.watch import plot

    monkeypatch.setenv("PRIME_HPC_STATE_DIR", work.env["PRIME_HPC_STATE_DIR"])
    runs = runs_of([sid])
    labels = [label for label, _ in runs]
    assert labels == [jobs.read_job(p)["sweep"]["swept"] for p in points]
    assert [float(label.split("=")[1]) for label in labels] == list(LRS)
    fig = plot.build_figure(runs)
    assert [t.get_text() for t in fig.legends[0].get_texts()] == labels
    (loss_ax,) = [ax for ax in fig.axes if ax.get_title().startswith("loss")]
    curves = [line for line in loss_ax.lines if line.get_label() == "trainer loss/mean"]
    assert len(curves) == 2
    for line, values in zip(curves, losses):
        assert list(line.get_ydata()) == pytest.approx(values)
    assert curves[0].get_color() != curves[1].get_color()
