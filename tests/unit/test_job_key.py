"""The job's key, kept for its owner alone and sent only where it belongs, without a
cluster: `private/api_key` (0600 in 0700) written at submit and read on opened
descriptors (someone else's, or one group or others can read, is refused in one line); a
key the user chose shorter than 32 bytes refused at submit; `scale` taking the kept key;
`eval`/`synthesize` sending an endpoint they were given `$ENDPOINT_API_KEY`, never the
job's variable, and a serve job of the user's own its kept key. (On the dev cluster:
tests/integration/test_scale.py scales a run submitted without an exported key.)"""

from __future__ import annotations

import os
import stat

import pytest

from prime_hpc.core import jobenv, keyfile
from prime_hpc.core.errors import ConfigError
from prime_hpc.core.keyfile import KeyFileError
from prime_hpc.inference.client import ENDPOINT_KEY_VAR, SERVE_DIR, endpoint_key
from prime_hpc.launcher import launch
from prime_hpc.rundir import RunDir, jobs
from tests.conftest import cli

JOB_VAR = "INFERENCE_SERVER_API_KEY"
NOBODY = 65534  # the tests run as root: a directory or file of another user


def _mode(p) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_the_key_is_kept_0600_in_a_0700_directory_and_read_back(tmp_path):
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    assert keyfile.read(run.private_dir) is None  # a run that kept none
    previous = os.umask(0o002)  # a permissive umask changes nothing
    try:
        path = keyfile.write(run.private_dir, "k" * 40)
    finally:
        os.umask(previous)
    assert path == run.key_file and _mode(run.private_dir) == 0o700 and _mode(run.key_file) == 0o600
    assert keyfile.read(run.private_dir) == "k" * 40
    keyfile.write(run.private_dir, "j" * 40)  # replaced whole, nothing left beside it
    assert keyfile.read(run.private_dir) == "j" * 40 and os.listdir(run.private_dir) == ["api_key"]


def _spoil(run: RunDir, how: str, tmp_path) -> str:
    """Make the kept key untrustworthy in one way; what the one-line refusal says."""
    keyfile.write(run.private_dir, "k" * 40)
    if how == "file-readable":
        os.chmod(run.key_file, 0o640)
        return "is open to group or others (mode 0640)"
    if how == "dir-readable":
        os.chmod(run.private_dir, 0o750)
        return "is open to group or others (mode 0750)"
    if how == "file-theirs":
        os.chown(run.key_file, NOBODY, NOBODY)
        return "belongs to"
    if how == "dir-theirs":
        os.chown(run.private_dir, NOBODY, NOBODY)
        return "belongs to"
    if how == "file-link":
        (tmp_path / "elsewhere").write_text("k" * 40)
        os.chmod(tmp_path / "elsewhere", 0o600)
        run.key_file.unlink()
        run.key_file.symlink_to(tmp_path / "elsewhere")
        return "is a symbolic link"
    if how == "dir-link":
        os.rename(run.private_dir, tmp_path / "theirs")
        run.private_dir.symlink_to(tmp_path / "theirs")
        return "is a symbolic link"
    assert how == "empty"
    run.key_file.write_text("")
    return "is empty"


@pytest.mark.parametrize(
    "how", ["file-readable", "dir-readable", "file-theirs", "dir-theirs", "file-link", "dir-link", "empty"]
)
def test_a_kept_key_that_is_not_the_users_alone_is_refused_in_one_line(tmp_path, how):
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    says = _spoil(run, how, tmp_path)
    with pytest.raises(KeyFileError) as e:
        keyfile.read(run.private_dir)
    assert says in str(e.value) and "\n" not in str(e.value) and str(run.private_dir) in str(e.value), e.value
    if how.startswith("dir"):  # nor is a new key written into a directory others can read or swap
        with pytest.raises(KeyFileError):
            keyfile.write(run.private_dir, "n" * 40)
    else:  # a new one replaces the file whole, 0600
        keyfile.write(run.private_dir, "n" * 40)
        assert keyfile.read(run.private_dir) == "n" * 40 and _mode(run.key_file) == 0o600


def test_submit_keeps_the_users_key_or_makes_one_and_a_resume_keeps_using_it(tmp_path, monkeypatch):
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    monkeypatch.delenv(JOB_VAR, raising=False)
    made = launch.keep_job_key(run)
    assert len(made) >= 43 and keyfile.read(run.private_dir) == made
    assert launch.keep_job_key(run) == made  # a resume without an exported key: the same key
    with jobenv.job_api_key(made):
        assert os.environ[JOB_VAR] == made  # what sbatch hands the job
    assert JOB_VAR not in os.environ
    monkeypatch.setenv(JOB_VAR, "u" * 32)  # the user's own, exactly 32 bytes
    assert launch.keep_job_key(run) == "u" * 32 == keyfile.read(run.private_dir)


@pytest.mark.parametrize("key", ["short", "x" * 31, "é" * 15])
def test_a_user_chosen_key_shorter_than_32_bytes_is_refused_at_submit_in_one_line(tmp_path, key):
    out = tmp_path / "run"
    r = cli("submit", "+experiment=reverse_text", f"output_dir={out}", "--dry-run", env={JOB_VAR: key})
    err = r.stderr.strip()
    assert r.returncode == 2 and "\n" not in err, r.stderr
    assert f"{JOB_VAR}: the exported key is {len(key.encode())} bytes, shorter than 32" in err, err
    assert not out.exists()  # nothing written
    with pytest.raises(ConfigError, match="shorter than 32"):
        os.environ[JOB_VAR] = key
        try:
            launch.keep_job_key(RunDir(tmp_path / "other"))
        finally:
            del os.environ[JOB_VAR]
    assert not (tmp_path / "other").exists()


def _running_run(tmp_path) -> RunDir:
    run = RunDir(tmp_path / "run")
    jobs.update_job(
        run,
        name="rt",
        kind="rl",
        mode="run",
        backend="slurm",
        state="RUNNING",
        job_ids=["42"],
        groups=["orchestrator", "inference", "trainer"],
        output_dir=str(run.root),
    )
    return run


def test_scale_takes_the_kept_key_and_refuses_one_that_is_not_the_users_alone(tmp_path, monkeypatch):
    from prime_hpc.launcher import scale

    run = _running_run(tmp_path)
    monkeypatch.setenv(JOB_VAR, "a-key-the-user-has-for-another-run-00")
    keyfile.write(run.private_dir, "r" * 43)
    assert scale.check_key(run) == "r" * 43  # the run's own, whatever this shell exports
    monkeypatch.delenv(JOB_VAR)
    assert scale.check_key(run) == "r" * 43
    os.chmod(run.key_file, 0o644)
    with pytest.raises(KeyFileError, match="is open to group or others"):
        scale.check_key(run)
    run.key_file.unlink()
    with pytest.raises(scale.ScaleError, match=f"{run.key_file} does not exist and {JOB_VAR} is not set"):
        scale.check_key(run)
    monkeypatch.setenv(JOB_VAR, "e" * 40)  # a run that kept none (submitted before keys were kept)
    assert scale.check_key(run) == "e" * 40


def test_an_endpoint_the_user_names_gets_its_own_variable_never_the_jobs(tmp_path, monkeypatch):
    monkeypatch.setenv(JOB_VAR, "the-job-key-" + "j" * 30)
    monkeypatch.delenv(ENDPOINT_KEY_VAR, raising=False)
    given = {"client.base_url": "http://somewhere:8000/v1"}
    assert endpoint_key(given) is None
    monkeypatch.setenv(ENDPOINT_KEY_VAR, "their-endpoint-key")
    assert endpoint_key(given) == "their-endpoint-key"
    # serve=<job> of the user's own serve job: the key it kept
    own = RunDir(tmp_path / "serve")
    own.root.mkdir()
    keyfile.write(own.private_dir, "s" * 43)
    assert endpoint_key({**given, SERVE_DIR: str(own.root)}) == "s" * 43
    # someone else's serve job: its directory is not read; the endpoint's variable
    theirs = RunDir(tmp_path / "theirs")
    theirs.root.mkdir()
    keyfile.write(theirs.private_dir, "t" * 43)
    os.chown(theirs.root, NOBODY, NOBODY)
    assert endpoint_key({**given, SERVE_DIR: str(theirs.root)}) == "their-endpoint-key"


class _Sent(Exception):
    pass


@pytest.mark.parametrize("verb", ["eval", "synthesize"])
def test_eval_and_synthesize_send_a_base_url_the_endpoint_key_not_the_jobs(tmp_path, monkeypatch, verb):
    """Through the command: the client eval/synthesize build for `client.base_url=` gets
    `$ENDPOINT_API_KEY`; the job's key, exported in the same shell, never reaches it."""
    from prime_hpc.cli import main
    from prime_hpc.orchestrator import client as orchestrator_client

    got = []

    def make_client(url, key, timeout_s=None):
        got.append((url, key))
        raise _Sent

    monkeypatch.setattr(orchestrator_client, "make_client", make_client)
    monkeypatch.setenv(JOB_VAR, "the-job-key-" + "j" * 30)
    monkeypatch.setenv(ENDPOINT_KEY_VAR, "endpoint-key")
    with pytest.raises(_Sent):
        main([verb, "client.base_url=http://127.0.0.1:9", "client.model=m", "env=reverse-text", f"out={tmp_path}/o"])
    assert got == [("http://127.0.0.1:9/v1", "endpoint-key")]
    monkeypatch.delenv(ENDPOINT_KEY_VAR)
    with pytest.raises(_Sent):
        main([verb, "client.base_url=http://127.0.0.1:9", "client.model=m", "env=reverse-text", f"out={tmp_path}/p"])
    assert got[-1] == ("http://127.0.0.1:9/v1", None)
