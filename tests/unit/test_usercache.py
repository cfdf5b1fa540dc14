"""What prime-hpc loads as code (compile caches, compiled templates, pickled compositions)
comes only from a directory, and a file, that are the user's alone: checked on the opened
descriptor, never following a symlink. Run as root, "someone else" is another uid (chown)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest

from prime_hpc.core import usercache
from prime_hpc.core.errors import ConfigError

OTHER_UID = 65534  # giving a file to another uid needs root, as these tests run


def spoil(p: Path, how: str, tmp_path: Path) -> None:
    """Make the directory or file `p` untrusted in the way `how` names."""
    if how == "symlink":
        real = tmp_path / f"real-{p.name}"
        if p.is_dir():
            p.rename(real)
        else:
            real.write_bytes(p.read_bytes())
            os.chmod(real, 0o600)
            p.unlink()
        p.symlink_to(real)  # the target itself is the user's and private: only the link is wrong
    elif how == "other-uid":
        os.chown(p, OTHER_UID, OTHER_UID)
    elif how == "group-writable":
        os.chmod(p, p.stat().st_mode | 0o020)
    elif how == "other-writable":
        os.chmod(p, p.stat().st_mode | 0o002)


HOW = ["symlink", "other-uid", "group-writable", "other-writable"]


def test_the_compile_dir_is_made_private_in_a_shared_cache(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # a project cache everyone writes, sticky as /tmp is
    assert usercache.compile_dir(shared, create=False) == shared / f"compile-{os.getuid()}"
    assert not list(shared.iterdir())  # at submit time nothing is written
    p = usercache.compile_dir(shared)
    st = p.lstat()
    assert p.is_dir() and st.st_uid == os.getuid() and st.st_mode & 0o777 == 0o700
    assert usercache.compile_dir(shared) == p  # and found again


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("create", [True, False], ids=["in the component", "at submit"])
def test_a_compile_dir_not_the_users_alone_is_refused(tmp_path, how, create):
    shared = tmp_path / "shared"
    p = usercache.compile_dir(shared)
    spoil(p, how, tmp_path)
    with pytest.raises(ConfigError) as e:
        usercache.compile_dir(shared, create=create)
    line = str(e.value)
    assert line.startswith("cluster.cache_dir: ") and str(p) in line and "directory of your own" in line
    assert "\n" not in line


@pytest.mark.parametrize(
    "above, why",
    [
        (0o777, "writable by group or others without the sticky bit"),  # anyone may rename compile-<uid> away
        (0o775, "writable by group or others without the sticky bit"),
        ("other-uid", "belongs to nobody, who can rename what is in it"),  # its owner may, sticky or not
    ],
    ids=["others may write", "the group may write", "someone else's"],
)
@pytest.mark.parametrize("level", ["cache_dir", "above it"])
@pytest.mark.parametrize("create", [True, False], ids=["in the component", "at submit"])
def test_a_compile_dir_below_a_directory_others_can_change_is_refused(tmp_path, above, why, level, create):
    """vLLM and inductor are given a path and look it up again much later: a directory on
    the way that someone else may write (and that is not sticky), or owns, lets them
    rename the user's compile-<uid> away and put theirs in its place."""
    shared = tmp_path / "project" / "shared"
    p = usercache.compile_dir(shared)  # the user's own, 0700
    planted = shared if level == "cache_dir" else shared.parent
    if above == "other-uid":
        os.chown(planted, OTHER_UID, OTHER_UID)
        os.chmod(planted, 0o1755)
    else:
        os.chmod(planted, above)
    with pytest.raises(ConfigError) as e:
        usercache.compile_dir(shared, create=create)
    line = str(e.value)
    assert line.startswith(f"cluster.cache_dir: {planted} ") and why in line and str(p) in line, line
    assert "\n" not in line
    os.chown(planted, os.getuid(), os.getgid())
    os.chmod(planted, 0o1777)  # sticky, as /tmp: nobody renames what is not theirs
    assert usercache.compile_dir(shared, create=create) == p


def test_a_compile_dir_reached_through_a_link_is_handed_out_by_its_real_path(tmp_path):
    """A link on the way is resolved once, and the directories of the real path checked:
    the path vLLM gets has no link that could be turned elsewhere later."""
    real = tmp_path / "real"
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    p = usercache.compile_dir(tmp_path / "link" / "shared")
    assert p == real / "shared" / f"compile-{os.getuid()}" and p.is_dir() and not p.is_symlink()
    os.chmod(real, 0o777)
    with pytest.raises(ConfigError, match=f"{real} is writable by group or others"):
        usercache.compile_dir(tmp_path / "link" / "shared")


def test_the_engine_gets_the_private_dir_or_refuses(tmp_path, monkeypatch):
    """The inference server's own check, just before vLLM and inductor are given the
    directory (it may have changed since submit)."""
    from prime_hpc.core.device import inference_env

    shared = tmp_path / "shared"
    monkeypatch.setenv("PRIME_HPC_CACHE", str(shared))
    env = inference_env("cpu")
    private = shared / f"compile-{os.getuid()}"
    assert env["VLLM_CACHE_ROOT"] == str(private / "vllm")
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(private / "inductor")
    os.chmod(shared, 0o777)  # a directory above it that others may write: renamed away before vLLM looks
    with pytest.raises(ConfigError, match=f"{shared} is writable by group or others without the sticky bit"):
        inference_env("cpu")
    os.chmod(shared, 0o755)
    spoil(private, "symlink", tmp_path)
    with pytest.raises(ConfigError, match="symbolic link"):
        inference_env("cpu")


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]], ids=["submit", "submit --dry-run"])
def test_submit_refuses_a_compile_dir_not_the_users_alone_and_writes_nothing(tmp_path, capsys, dry_run):
    from prime_hpc.cli import main

    shared, out = tmp_path / "shared", tmp_path / "run"
    spoil(usercache.compile_dir(shared), "other-writable", tmp_path)
    code = main(
        [
            "submit",
            "+experiment=reverse_text",
            "warmup.experiment=null",
            f"output_dir={out}",
            f"cluster.cache_dir={shared}",
            *dry_run,
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "cluster.cache_dir: " in err and f"compile-{os.getuid()}" in err and "writable by group or others" in err
    assert not out.exists()


@pytest.mark.parametrize("mask", ["000", "002", "020", "0007", "005"])
@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]], ids=["submit", "submit --dry-run"])
def test_submit_refuses_a_umask_that_lets_group_or_others_write_and_writes_nothing(tmp_path, capsys, mask, dry_run):
    """What a run writes includes what its processes load again (configs/*.yaml, the
    inductor headers): nobody else may write it."""
    from prime_hpc.cli import main

    out = tmp_path / "run"
    code = main(
        [
            "submit",
            "+experiment=reverse_text",
            "warmup.experiment=null",
            f"output_dir={out}",
            f"cluster.umask={mask}",
            *dry_run,
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"cluster.umask: {mask} lets group or others write" in err and "027" in err, err
    assert not out.exists()


@pytest.mark.parametrize("mask", ["022", "027", "077", "0027", "137"])
def test_a_umask_that_keeps_group_and_others_from_writing_is_accepted(tmp_path, mask):
    from prime_hpc.config.compose import compose
    from prime_hpc.config.validate import check_umask

    check_umask(compose(["+experiment=reverse_text", f"output_dir={tmp_path}", f"cluster.umask={mask}"]))


def test_a_compile_dir_that_cannot_be_made_is_refused_at_submit(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="cluster.cache_dir: cannot create"):
        usercache.compile_dir(blocker / "cache")


def _entry(tmp_path: Path) -> tuple[Path, Path]:
    d = tmp_path / "cache"
    d.mkdir(mode=0o700)
    usercache.write(d, "entry", b"payload")
    return d, d / "entry"


def test_read_and_write_a_trusted_entry(tmp_path):
    d, entry = _entry(tmp_path)
    assert usercache.read(d, "entry") == b"payload"
    assert entry.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in d.iterdir()] == ["entry"]  # no temporary file left


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("what", ["file", "directory"])
def test_an_entry_or_directory_not_the_users_alone_is_not_read(tmp_path, how, what):
    d, entry = _entry(tmp_path)
    spoil(entry if what == "file" else d, how, tmp_path)
    assert usercache.read(d, "entry") is None


def test_no_write_into_a_directory_not_the_users_alone(tmp_path):
    d, _ = _entry(tmp_path)
    os.chmod(d, 0o777)
    with pytest.raises(usercache.Untrusted, match="writable by group or others"):
        usercache.write(d, "other", b"x")
    assert not (d / "other").exists()


def test_a_pickle_swapped_for_a_symlink_is_never_unpickled(tmp_path, monkeypatch):
    """The composition cache: an entry replaced by a symlink to a pickle that would run
    code is not loaded (the check and the read are on one descriptor)."""
    from prime_hpc.config import compose_cache

    d, entry = _entry(tmp_path)
    ran = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.mkdir, (str(ran),))

    evil = tmp_path / "evil.pkl"
    evil.write_bytes(pickle.dumps(Payload()))
    os.chmod(evil, 0o600)
    entry.unlink()
    entry.symlink_to(evil)
    assert compose_cache.load(entry) is None and not ran.exists()
    entry.unlink()
    usercache.write(d, "entry", evil.read_bytes())  # a trusted file is unpickled (this test's own check)
    compose_cache.load(entry)
    assert ran.exists()


@pytest.mark.parametrize("how", HOW)
def test_compiled_templates_are_loaded_only_from_the_users_own_file(tmp_path, monkeypatch, how):
    from prime_hpc.launcher import render

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    render._env.cache_clear()
    try:
        env = render._env()
        env.get_template("run.local.sh.j2")  # compiled and kept
        (kept,) = (tmp_path / "xdg" / "prime-hpc" / "templates").iterdir()
        source, filename, _ = env.loader.get_source(env, "run.local.sh.j2")

        def bucket():
            return env.bytecode_cache.get_bucket(env, "run.local.sh.j2", filename, source)

        assert bucket().code is not None  # loaded from the kept file
        spoil(kept, how, tmp_path)
        assert bucket().code is None  # compiled again from the source instead
    finally:
        render._env.cache_clear()


@pytest.mark.parametrize("planted", ["other-uid", "other-writable", "symlink", "tmp-not-sticky"])
def test_inductors_headers_in_the_nodes_tmp_are_used_only_when_the_users_alone(tmp_path, monkeypatch, planted, capsys):
    """Inductor includes the precompiled headers of `<tmp>/torchinductor_<user>` in every
    kernel it compiles, and anyone may create that predictable name first: a server links
    it into its private temporary directory only when it is the user's alone (below a
    directory nobody else can rename it out of); otherwise the headers are kept in the
    user's private compile cache, and the planted directory is never reached."""
    from prime_hpc.inference import server as srv

    tmp, compiled = tmp_path / "tmp", usercache.compile_dir(tmp_path / "cache")
    tmp.mkdir()
    os.chmod(tmp, 0o1777)  # as /tmp
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(srv.tempfile, "tempdir", None)
    node = tmp / "torchinductor_me"
    mine = srv.private_tmp_dir([node], compiled)
    assert (mine / node.name).resolve() == node and node.stat().st_mode & 0o777 == 0o700  # made, the user's: linked
    srv.shutil.rmtree(mine)
    if planted == "tmp-not-sticky":
        os.chmod(tmp, 0o777)  # whoever may write it can rename the user's own directory away
    elif planted == "symlink":
        node.rmdir()
        (tmp_path / "theirs").mkdir(mode=0o700)
        node.symlink_to(tmp_path / "theirs")
    else:
        spoil(node, planted, tmp_path)
    (tmp_path / "theirs").mkdir(exist_ok=True)
    header = (node if planted != "symlink" else tmp_path / "theirs") / "precompiled.h"
    header.write_text("#error planted\n")
    mine = srv.private_tmp_dir([node], compiled)
    used = (mine / node.name).resolve()
    assert (
        used == compiled / node.name and used.stat().st_mode & 0o777 == 0o700 and not (used / "precompiled.h").exists()
    )
    assert f"{node}" in capsys.readouterr().out  # the server's log says why the node's is not used
    srv.shutil.rmtree(mine)
    mine = srv.private_tmp_dir([node], None)  # no compile cache (no cluster.cache_dir): one of its own
    assert (mine / node.name).is_dir() and not (mine / node.name).is_symlink()


def test_eval_refuses_a_umask_that_lets_others_write_before_its_server_starts(tmp_path, monkeypatch, capsys):
    """Its server would load a config written under it (and refuse one others can write):
    one line on cluster.umask instead, no server started, for a model and a run of the
    user's recorded with such a umask."""
    from omegaconf import OmegaConf

    from prime_hpc.cli import main
    from prime_hpc.config.compose import compose
    from prime_hpc.orchestrator import evaluate
    from prime_hpc.rundir import RunDir, mark_stable

    class NoServer:
        def Popen(*a, **k):
            raise AssertionError("a server was started")

    monkeypatch.setattr(evaluate, "subprocess", NoServer)
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    OmegaConf.save(
        compose(["+experiment=reverse_text", f"output_dir={run.root}", "cluster.umask=002"]), run.config_yaml
    )
    run.weights_step(1).mkdir(parents=True)
    mark_stable(run.weights_step(1))
    for argv in (
        ["model=tiny", "env=reverse-text", "cluster.umask=002", f"out={tmp_path / 'm'}", "--here"],
        [str(run.root), "steps=1"],
    ):
        assert main(["eval", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "cluster.umask: 002 lets group or others write" in err, err
    assert not list(tmp_path.glob("**/configs/inference.yaml"))
