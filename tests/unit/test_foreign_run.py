"""`prime-hpc eval` of a run that belongs to someone else runs only the user's code: their
recorded config is read once (an interpolation in it is refused, never resolved in the
user's environment), the config the server loads is a copy in a directory of the user's
alone (the run's owner cannot swap it between the check and the read), and their
`cluster.*` settings (umask, cache) are not the user's. The run directory belongs to
another uid (these tests run as root, which may give files away); no server starts: the
server process is replaced by one that reads its config as the server does."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from prime_hpc.cli import main
from prime_hpc.config.compose import compose
from prime_hpc.core import umask
from prime_hpc.launcher import evaluate as eval_command
from prime_hpc.orchestrator import evaluate
from prime_hpc.rundir import RunDir, mark_stable

THEIRS = 65534  # nobody
SECRET = "s3cr3t-token-of-the-user-0f9a"


def _their_run(root: Path, *overrides: str, edit=None) -> RunDir:
    """A run directory of another user's: config.yaml as submit writes it (resolved), then
    edited by them (`edit` on the parsed YAML), one complete weights step, all theirs."""
    cfg = compose(["+experiment=reverse_text", "warmup.experiment=null", f"output_dir={root}", *overrides])
    root.mkdir(parents=True)
    OmegaConf.save(cfg, root / "config.yaml", resolve=True)
    if edit is not None:
        data = yaml.safe_load((root / "config.yaml").read_text())
        edit(data)
        (root / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    run = RunDir(root)
    run.weights_step(1).mkdir(parents=True)
    mark_stable(run.weights_step(1))
    for p in [root, *root.rglob("*")]:
        os.chown(p, THEIRS, THEIRS)
    return run


def _files(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def me(tmp_path, monkeypatch) -> Path:
    """The user's working directory (eval's default results go to outputs/eval/ there)."""
    home = tmp_path / "me"
    home.mkdir()
    monkeypatch.chdir(home)
    monkeypatch.setenv("SECRET_X", SECRET)
    return home


@pytest.fixture
def served(monkeypatch) -> dict:
    """What eval would start its server with (its config, cache, the umask in force); the
    server itself is not started."""
    seen: dict = {}

    def server(cfg, edir, cache):
        seen.update(cfg=cfg, edir=edir.root, cache=cache, umask=umask.current())
        raise SystemExit(3)

    monkeypatch.setattr(evaluate, "eval_server", server)
    return seen


def _eval(argv: list[str]) -> int:
    try:
        return main(["eval", *argv])
    except SystemExit as e:
        return int(e.code or 0)


@pytest.mark.parametrize(
    "key, value",
    [
        ("name", "${oc.env:SECRET_X}"),
        ("wandb.project", "pre-${oc.env:SECRET_X}-post"),  # inside a string
        ("orchestrator.eval.env.0.args.prompt", "${oc.env:SECRET_X}"),  # in a list's entry
        ("name", "\\${oc.env:SECRET_X}"),  # escaped: a literal here, an interpolation once written back
    ],
)
@pytest.mark.parametrize("whose", ["theirs", "mine"])
def test_an_interpolation_in_a_recorded_config_is_refused_and_the_secret_goes_nowhere(
    tmp_path, me, served, capsys, key, value, whose
):
    def plant(data: dict) -> None:
        node, *path, last = [data, *key.split(".")]
        for part in path:
            node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
        node[last] = value

    run = _their_run(tmp_path / "run", edit=plant)
    if whose == "mine":  # submit writes none either: the user's own run is refused the same
        for p in [run.root, *run.root.rglob("*")]:
            os.chown(p, os.getuid(), os.getgid())
    before = _files(tmp_path)
    assert _eval([str(run.root), "steps=1"]) == 2
    out, err = capsys.readouterr()
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert f"{run.config_yaml}: {key} holds an interpolation" in err, err
    assert SECRET not in out + err and not served
    assert _files(tmp_path) == before and not (me / "outputs").exists() and not run.eval_dir.exists()
    assert all(SECRET.encode() not in data for data in before.values())


def test_an_interpolation_restated_as_an_override_is_the_users_value(tmp_path, me, served, capsys):
    run = _their_run(tmp_path / "run", edit=lambda d: d.update(name="${oc.env:SECRET_X}"))
    assert _eval([str(run.root), "steps=1", "name=mine"]) == 3  # as far as the server
    assert served["cfg"].name == "mine" and SECRET not in capsys.readouterr().out


def test_the_server_reads_a_private_copy_that_their_swap_never_reaches(tmp_path, me, monkeypatch, capsys):
    """The owner swaps both their config.yaml and the config eval used to write into their
    `eval/configs/` (made writable for it) once the check has passed, as the server starts:
    the server loads the checked config, from a file in the user's own 0700 directory, and
    nothing of the user's goes into their tree."""
    from prime_hpc.inference import client
    from prime_hpc.inference import server as srv

    run = _their_run(tmp_path / "run")
    planted = run.eval_dir / "configs" / "inference.yaml"
    planted.parent.mkdir(parents=True)
    for p in (run.eval_dir, planted.parent):
        os.chown(p, THEIRS, THEIRS)
        os.chmod(p, 0o777)
    theirs_before = _files(run.root)
    started: dict = {}

    class Server:  # the server process, reading its config as `python -m prime_hpc.inference` does
        pid = 2**22 + 1  # above any pid: its process group is never found

        def __init__(self, argv, env, **_):
            swapped = yaml.safe_load(run.config_yaml.read_text())
            swapped["inference"]["extra_args"] = ["--tool-parser-plugin", "/their/plugin.py"]
            swapped["model"]["trust_remote_code"] = True
            for target in (run.config_yaml, planted):
                target.write_text(yaml.safe_dump(swapped))
            path = argv[argv.index("--config") + 1]
            started.update(path=Path(path), cfg=srv.load_config(path), cache=env["PRIME_HPC_CACHE"])

        def poll(self):
            return None

        def terminate(self):
            pass

        def wait(self, timeout=None):
            return 0

    class Subprocess:
        Popen = Server
        STDOUT = -2
        TimeoutExpired = TimeoutError

    monkeypatch.setattr(evaluate, "subprocess", Subprocess)
    monkeypatch.setattr(client, "wait_for_servers", lambda *a, **k: [{"url": "http://127.0.0.1:9"}])
    scored: dict = {}
    monkeypatch.setattr(evaluate, "score_steps", lambda *a: scored.update(results=a[-1]))
    assert _eval([str(run.root), "steps=1"]) == 0, capsys.readouterr()
    (mine,) = (me / "outputs" / "eval").iterdir()
    assert started["path"] == mine / "configs" / "inference.yaml" and scored["results"] == mine
    assert started["cfg"].inference.extra_args == [] and started["cfg"].model.trust_remote_code is False
    assert mine.stat().st_mode & 0o777 == 0o700 and mine.stat().st_uid == os.getuid()
    assert not started["cache"].startswith(str(run.root))
    now = _files(run.root)  # their tree: only what they wrote themselves
    assert set(now) == set(theirs_before) | {planted} and now[run.config_yaml] == planted.read_bytes()


@pytest.mark.parametrize("spoil", ["other-uid", "group-writable", "symlink"])
def test_a_server_refuses_a_config_that_is_not_the_users_alone(tmp_path, monkeypatch, capsys, spoil):
    from prime_hpc.config.component import write_component_config
    from prime_hpc.inference import server as srv

    cfg = compose(["+experiment=reverse_text", f"output_dir={tmp_path / 'run'}"])
    path = write_component_config(cfg, "inference")
    assert srv.load_config(str(path)).model.name == cfg.model.name  # the user's own: loaded
    if spoil == "other-uid":
        os.chown(path, THEIRS, THEIRS)
    elif spoil == "group-writable":
        os.chmod(path, 0o664)
    else:
        real = tmp_path / "elsewhere.yaml"
        path.rename(real)
        path.symlink_to(real)
    monkeypatch.setenv("INFERENCE_SERVER_API_KEY", "k" * 43)
    assert srv.main(["--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"prime-hpc inference: inference config {path} "), err
    assert "nobody else can write" in err


def test_their_cluster_settings_and_cache_are_not_the_users(tmp_path, me, served, capsys):
    """Their umask (one that lets everyone write), their cache (with a compile directory
    planted for the user), their env_setup and address: none reaches what the user runs."""
    cache = tmp_path / "their-cache"
    planted = cache / f"compile-{os.getuid()}"
    planted.mkdir(parents=True)
    run = _their_run(
        tmp_path / "run",
        f"cluster.cache_dir={cache}",
        "cluster.umask=000",
        "cluster.env_setup=[touch /tmp/pwned]",
        "cluster.address=0.0.0.0",
    )
    for p in (cache, planted):
        os.chown(p, THEIRS, THEIRS)
        os.chmod(p, 0o777)
    cache_before = sorted(cache.rglob("*"))
    assert _eval([str(run.root), "steps=1"]) == 3, capsys.readouterr()
    cfg = served["cfg"]
    assert served["umask"] == 0o027 and str(cfg.cluster.umask) == "027"  # the user's default
    assert Path(served["cache"]) == Path(os.environ["PRIME_HPC_CACHE"]).absolute()  # the user's own cache
    assert cfg.cluster.env_setup == [] and cfg.cluster.address == "127.0.0.1"
    assert served["edir"].parent == me / "outputs" / "eval"
    assert sorted(cache.rglob("*")) == cache_before
    # --trust-run-code keeps their cluster for a job of it, but never their umask or cache
    served.clear()
    assert _eval([str(run.root), "steps=1", "--trust-run-code"]) == 3, capsys.readouterr()
    assert served["umask"] == 0o027 and Path(served["cache"]) == Path(os.environ["PRIME_HPC_CACHE"]).absolute()
    assert list(served["cfg"].cluster.env_setup) == ["touch /tmp/pwned"]
    # the user's own cluster.* overrides apply
    served.clear()
    mine = tmp_path / "my-cache"
    assert _eval([str(run.root), "steps=1", f"cluster.cache_dir={mine}", "cluster.umask=077"]) == 3
    assert served["umask"] == 0o077 and served["cache"] == str(mine)


def test_results_of_their_run_go_only_to_a_directory_of_the_users_alone(tmp_path, me, served, capsys):
    run = _their_run(tmp_path / "run")
    theirs = tmp_path / "shared-out"
    theirs.mkdir()
    os.chown(theirs, THEIRS, THEIRS)
    for out in (theirs, theirs / "sub", run.eval_dir):
        assert _eval([str(run.root), "steps=1", f"out={out}"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"out={out}: " in err and "give out=DIR" in err, err
    assert not served and list(theirs.iterdir()) == [] and not run.eval_dir.exists()
    assert _eval([str(run.root), "steps=1", f"output_dir={tmp_path / 'mine'}"]) == 3
    assert served["edir"] == tmp_path / "mine" and (tmp_path / "mine").stat().st_mode & 0o777 == 0o700


def test_a_run_directory_of_someone_elses_is_theirs_even_with_a_config_of_the_users(tmp_path, me, served):
    run = _their_run(tmp_path / "run")
    os.chown(run.config_yaml, os.getuid(), os.getgid())
    cfg, owner = eval_command.recorded_run(run, [])
    assert owner == THEIRS
