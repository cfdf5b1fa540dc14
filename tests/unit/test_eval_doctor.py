"""`eval` and `doctor` before anything runs: eval's overrides are typed, a run of someone
else's is not a way to run their code, doctor deletes only what doctor wrote, and what a
dry run or doctor writes gets `cluster.umask`. In-process through the CLI's `main`; no
server, no job."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from prime_hpc.cli import main
from prime_hpc.config.compose import compose
from prime_hpc.core.errors import ConfigError
from prime_hpc.launcher import launch
from prime_hpc.rundir import RunDir, mark_stable
from tests.conftest import REPO

RL = ["+experiment=reverse_text", "warmup.experiment=null"]
OTHER_UID = 65534  # someone else (these tests run as root, which may give files away)
PATH_ENV = str(REPO / "examples" / "reverse_text" / "reverse_text")  # an env id that is a path


@pytest.fixture(autouse=True)
def no_server(monkeypatch):
    """Nothing here may get as far as starting an inference server."""
    from prime_hpc.orchestrator import evaluate

    def refuse(*_a, **_k):
        raise AssertionError("eval started a server")

    monkeypatch.setattr(evaluate, "eval_server", refuse)


def _reject(argv: list[str], capsys) -> str:
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (argv, code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out + err, err
    return lines[0]


def _run(root: Path, *overrides: str) -> RunDir:
    """A run directory with its config.yaml and one complete (empty) weights step."""
    cfg = compose([*RL, f"output_dir={root}", *overrides])
    root.mkdir(parents=True)
    OmegaConf.save(cfg, root / "config.yaml", resolve=True)
    run = RunDir(root)
    run.weights_step(1).mkdir(parents=True)
    mark_stable(run.weights_step(1))
    return run


@pytest.mark.parametrize(
    "bad, key",
    [
        ("orchestrator.sampling.temprature=0", "orchestrator.sampling.temprature"),  # a typo
        ("orchestrator.sampling.temperature=hot", "orchestrator.sampling.temperature"),  # a wrong type
        ("orchestrator.eval.num_examples=1.5", "orchestrator.eval.num_examples"),
        ("+orchestrator.eval.extra=1", "orchestrator.eval.extra"),
    ],
)
def test_eval_overrides_are_typed(tmp_path, capsys, bad, key):
    run = _run(tmp_path / "run")
    line = _reject(["eval", str(run.root), "steps=1", bad], capsys)
    assert key in line, line
    assert not run.eval_dir.exists()


@pytest.mark.parametrize(
    "given, refused",
    [
        ([f"orchestrator.eval.env=[{{id: '{PATH_ENV}'}}]"], "orchestrator.eval.env.0.id"),
        (["model.trust_remote_code=true"], "model.trust_remote_code=true"),
        (["inference.extra_args=[--tool-parser-plugin,/tmp/p.py]"], "inference.extra_args"),
    ],
)
def test_eval_of_someone_elses_run_refuses_what_would_run_their_code(tmp_path, capsys, given, refused):
    from prime_hpc.launcher.evaluate import check_foreign_run, recorded_run

    run = _run(tmp_path / "run", *given)
    os.chown(run.config_yaml, OTHER_UID, OTHER_UID)
    line = _reject(["eval", str(run.root), "steps=1"], capsys)
    assert refused in line and "--trust-run-code" in line and "belongs to" in line, line
    assert not run.eval_dir.exists()  # nothing written, no server started
    # the user's explicit word allows it: the flag, or restating the keys as overrides
    cfg, owner = recorded_run(run, [])
    assert owner == OTHER_UID
    check_foreign_run(run, owner, cfg, [], trust=True)
    check_foreign_run(run, owner, *recorded_run(run, given)[:1], given, trust=False)
    # and the user's own run is the user's own code
    check_foreign_run(run, os.getuid(), cfg, [], trust=False)


def test_eval_refuses_a_compile_cache_that_is_not_the_users(tmp_path, capsys):
    shared = tmp_path / "shared"
    private = shared / f"compile-{os.getuid()}"
    private.mkdir(parents=True)
    os.chmod(private, 0o777)
    run = _run(tmp_path / "run", f"cluster.cache_dir={shared}")
    line = _reject(["eval", str(run.root), "steps=1"], capsys)
    assert line.startswith("prime-hpc: error: cluster.cache_dir: ") and str(private) in line
    assert not run.eval_dir.exists()


@pytest.mark.parametrize("dry_run", [True, False], ids=["submit --dry-run", "doctor"])
def test_a_dry_run_and_doctor_write_under_the_cluster_umask(tmp_path, dry_run):
    cfg = compose([*RL, f"output_dir={tmp_path}/run"])  # cluster.umask=027 by default
    previous = os.umask(0o022)  # a user's shell: files readable by everyone
    try:
        run, _ = launch.prepare(cfg, "run" if dry_run else "doctor", dry_run=dry_run)
    finally:
        os.umask(previous)
    written = [p for p in Path(tmp_path / "run").rglob("*")]
    assert run.config_yaml in written and len(written) > 3
    assert all(p.stat().st_mode & 0o007 == 0 for p in written), [(p, oct(p.stat().st_mode)) for p in written]


def test_doctor_empties_only_what_doctor_wrote(tmp_path):
    cfg = compose([*RL, f"output_dir={tmp_path}/run"])
    run, _ = launch.prepare(cfg, "doctor")
    leftover = run.root / "logs" / "from-the-last-preflight.log"  # what an earlier preflight left
    leftover.parent.mkdir()
    leftover.write_text("x")
    launch.prepare(cfg, "doctor")
    assert not leftover.exists() and run.config_yaml.exists()


@pytest.mark.parametrize("spoil", ["no marker", "someone else's marker", "a symlink"])
def test_doctor_refuses_a_directory_it_did_not_write_and_deletes_nothing(tmp_path, spoil):
    cfg = compose([*RL, f"output_dir={tmp_path}/run"])
    doctor = RunDir(cfg.output_dir).doctor_run
    kept = doctor.root
    if spoil == "a symlink":  # even to a marked directory: doctor/ is not a plain directory
        kept = tmp_path / "mine"
        kept.mkdir()
        (kept / doctor.doctor_marker.name).write_text("")
        doctor.root.parent.mkdir(parents=True)
        doctor.root.symlink_to(kept)
    else:
        launch.prepare(cfg, "doctor")  # an earlier preflight, but its marker is gone or not the user's
        doctor.doctor_marker.unlink()
        if spoil == "someone else's marker":
            doctor.doctor_marker.write_text("")
            os.chown(doctor.doctor_marker, OTHER_UID, OTHER_UID)
    (kept / "notes.txt").write_text("mine")
    before = sorted(p.name for p in kept.iterdir())
    with pytest.raises(ConfigError, match="output_dir: .*doctor") as e:
        launch.prepare(cfg, "doctor")
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in kept.iterdir()) == before
