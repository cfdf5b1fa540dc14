"""The CLI on this machine (cluster=local): light imports, dry run, the local backend's
full lifecycle (submit, status, list, tail, cancel), sweeps, refusal of a used output_dir."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prime_hpc.rundir import RunDir, jobs
from tests.conftest import HOSTILE, REPO, cli, hydra_quote

HEAVY = ("torch", "vllm", "transformers", "verifiers")


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def imported_by(argv: list[str], modules: tuple[str, ...], job: dict, tmp_path: Path) -> list[str]:
    """Which of `modules` a CLI call (in a fresh interpreter) imports; `{out}` in argv is a
    run directory holding `job` as its job.json."""
    out = tmp_path / "run"
    (out / "logs").mkdir(parents=True)
    (out / "job.json").write_text(json.dumps(job))
    argv = [a.format(out=out) for a in argv]
    code = (
        "import sys\n"
        "from prime_hpc.cli import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        f"print(sorted(m for m in {modules!r} if m in sys.modules))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        env={**os.environ, "PRIME_HPC_STATE_DIR": str(tmp_path / "state")},
    )
    return json.loads(r.stdout.strip().splitlines()[-1].replace("'", '"')) if r.stdout.strip() else [r.stderr]


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["status"],
        ["list"],
        ["submit", "+experiment=reverse_text", "--dry-run", "output_dir={out}/new"],
        ["tail", "{out}", "--no-follow"],
    ],
)
def test_read_only_commands_do_not_import_heavy_stacks(argv, tmp_path):
    job = {"name": "x", "job_ids": ["local-0"], "backend": "local"}
    assert imported_by(argv, HEAVY, job, tmp_path) == []


@pytest.mark.parametrize("argv", [["status", "{out}"], ["list"], ["tail", "{out}", "--no-follow"], ["--help"]])
def test_commands_that_only_read_import_no_config_or_submission_stack(argv, tmp_path):
    """status, list and tail read job.json and ask squeue/sacct: nothing of composing or
    submitting a run is imported (each costs tens of milliseconds at every call)."""
    job = {"name": "x", "job_ids": ["1"], "backend": "slurm", "state": "RUNNING"}
    assert imported_by(argv, ("hydra", "omegaconf", "submitit", "jinja2"), job, tmp_path) == []


def test_dry_run_writes_launch_files_and_submits_nothing(tmp_path):
    out = tmp_path / "run"
    previous = os.umask(0o022)  # what the user's shell gives; the files get cluster.umask (027)
    try:
        r = cli("submit", "+experiment=reverse_text", f"output_dir={out}", "--dry-run")
    finally:
        os.umask(previous)
    assert r.returncode == 0, r.stderr
    assert all(p.stat().st_mode & 0o007 == 0 for p in out.rglob("*"))
    for rel in (
        "config.yaml",
        "configs/orchestrator.yaml",
        "configs/trainer.yaml",
        "configs/inference.yaml",
        "submit/rl.sbatch",  # the RL run, and its SFT warm-up: a plain job of the trainer alone
        "warmup/config.yaml",
        "warmup/configs/trainer.yaml",
        "warmup/submit/sft.sbatch",
    ):
        assert (out / rel).is_file(), rel
    assert not (out / "warmup/configs/inference.yaml").exists()
    assert str(out / "submit" / "rl.sbatch") in r.stdout and str(out / "warmup/submit/sft.sbatch") in r.stdout
    assert not (out / "job.json").exists() and jobs.recent() == []
    # each component's config holds its own sub-tree and no other component's
    import yaml

    trainer = yaml.safe_load((out / "configs/trainer.yaml").read_text())
    assert "trainer" in trainer and "orchestrator" not in trainer and "inference" not in trainer
    warm = yaml.safe_load((out / "warmup/config.yaml").read_text())
    # the RL run starts from the warm-up's final weights
    assert trainer["output_dir"] == str(out)
    assert trainer["model"]["name"] == str(out / "warmup")  # a run dir: its final weights
    assert warm["trainer"]["type"] == "sft" and warm["model"]["name"] == "tiny"
    # a dry run does not make the directory "used": a real submit may follow
    assert RunDir(out).is_fresh()


def test_sweep_dry_run_gives_each_point_its_own_dir(tmp_path):
    r = cli(
        "submit",
        "-m",
        "+experiment=reverse_text",
        f"output_dir={tmp_path}/sw",
        "--dry-run",
        "trainer.optim.lr=1e-6,3e-6",
    )
    assert r.returncode == 0, r.stderr
    import yaml

    lrs = [yaml.safe_load((tmp_path / f"sw/{i}/config.yaml").read_text()) for i in (0, 1)]
    assert [c["trainer"]["optim"]["lr"] for c in lrs] == [1e-6, 3e-6]
    assert [c["name"] for c in lrs] == ["reverse_text_0", "reverse_text_1"]


def test_local_preflight_with_hostile_paths(tmp_path):
    """A preflight with shell-hostile paths passes, on the teacher's node too when the run
    starts its own; its files get cluster.umask. Its directory (<output_dir>/doctor/) is
    refused while it holds a file doctor did not write, and nothing of it is deleted."""
    out = tmp_path / HOSTILE
    argv = [
        "doctor",
        "+experiment=reverse_text",
        f"output_dir={hydra_quote(str(out))}",
        "orchestrator.training_mode=opd",
        "orchestrator.teacher.model=tiny",
        "--timeout",
        "300",
    ]
    notes = RunDir(out).doctor_run.root / "notes.txt"
    notes.parent.mkdir(parents=True)
    notes.write_text("mine")
    r = cli(*argv)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "did not write" in r.stderr, r.stderr
    assert [p.name for p in notes.parent.iterdir()] == ["notes.txt"] and notes.read_text() == "mine"
    notes.unlink()
    previous = os.umask(0o022)  # what the user's shell gives
    try:
        r = cli(*argv)
    finally:
        os.umask(previous)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "preflight PASS" in r.stdout
    assert not (tmp_path / "PWNED").exists() and not (REPO / "PWNED").exists()
    summary = json.loads(RunDir(out).doctor_run.preflight_summary.read_text())
    assert summary["ok"] and set(summary["groups"]) == {"orchestrator", "inference", "router", "trainer", "teacher"}
    assert "teacher       0     PASS" in r.stdout, r.stdout
    written = list(notes.parent.rglob("*"))
    assert all(p.lstat().st_mode & 0o007 == 0 for p in written if not p.is_symlink()), [
        (str(p), oct(p.lstat().st_mode)) for p in written if p.lstat().st_mode & 0o007
    ]


def test_local_lifecycle_submit_status_tail_cancel(tmp_path):
    out = tmp_path / "run"
    # a run whose script holds before its components start, so it stays RUNNING
    r = cli(
        "submit",
        "+experiment=reverse_text",
        "warmup.experiment=null",
        f"output_dir={out}",
        'cluster.env_setup=["sleep 300"]',
    )
    assert r.returncode == 0, r.stderr
    job = jobs.read_job(RunDir(out))
    job_id = job["job_ids"][-1]
    pid = job["pid"]
    assert job_id.startswith("local-") and f"submitted run job {job_id}" in r.stdout
    try:
        st = cli("status", job_id)
        assert st.returncode == 0 and "RUNNING" in st.stdout and str(out) in st.stdout
        ls = cli("list")
        assert job_id in ls.stdout and "RUNNING" in ls.stdout
        again = cli("submit", "+experiment=reverse_text", f"output_dir={out}")
        assert again.returncode == 2 and "is not empty" in again.stderr and "clean_output_dir=true" in again.stderr
        c = cli("cancel", "reverse_text")  # by run name
        assert c.returncode == 0 and job_id in c.stdout
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "CANCELLED" not in cli("status", str(out)).stdout:
            time.sleep(0.5)
        assert "CANCELLED" in cli("status", str(out)).stdout
        # the supervisor itself stopped everything and recorded the end
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not jobs.read_job(RunDir(out)).get("ended_at"):
            time.sleep(0.5)
        assert jobs.read_job(RunDir(out)).get("ended_at")
        while time.monotonic() < deadline and group_alive(pid):
            time.sleep(0.2)
        assert not group_alive(pid)
        # clean_output_dir=true wipes the finished run and starts a fresh one
        (out / "marker").write_text("old")
        fresh = cli(
            "submit",
            "+experiment=reverse_text",
            "warmup.experiment=null",
            f"output_dir={out}",
            "clean_output_dir=true",
            'cluster.env_setup=["sleep 300"]',
        )
        assert fresh.returncode == 0, fresh.stderr
        new = jobs.read_job(RunDir(out))
        assert not (out / "marker").exists() and new["job_ids"] != [job_id]
        assert cli("cancel", str(out)).returncode == 0
        pid = new["pid"]
    finally:
        if group_alive(pid):
            os.killpg(pid, signal.SIGTERM)


def test_submit_shows_the_composed_config_and_the_groups_as_a_hydra_app_does(tmp_path):
    import yaml

    out = tmp_path / "run"
    job = cli("submit", "+experiment=reverse_text", f"output_dir={out}", "--cfg", "job")
    assert job.returncode == 0, job.stderr
    shown = yaml.safe_load(job.stdout)
    assert shown["max_steps"] == 350 and shown["trainer"]["model"]["name"] == "${model.name}"  # as composed
    resolved = cli("submit", "+experiment=reverse_text", f"output_dir={out}", "--cfg", "job", "--resolve")
    assert "${" not in resolved.stdout
    assert yaml.safe_load(resolved.stdout)["trainer"]["model"]["name"] == f"{out}/warmup"  # starts from the warm-up
    both = cli("submit", "+experiment=reverse_text", f"output_dir={out}", "--cfg", "all")
    assert [line.split(":")[0] for line in both.stdout.splitlines() if line.startswith("# ")] == ["# warm-up", "# run"]
    info = cli("submit", "+experiment=reverse_text", "cluster=dev", "--info", "defaults")
    assert {"experiment: reverse_text", "cluster: dev", "model: tiny"} <= set(info.stdout.splitlines())
    assert not out.exists()  # shown, never written
    help_ = cli("submit", "--help")
    assert help_.returncode == 0 and "config groups" in help_.stdout
    assert re.search(r"^\s+cluster\s+dev, local, slurm$", help_.stdout, re.M), help_.stdout
