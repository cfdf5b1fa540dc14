"""Bad input, table-driven: each malformed override or command is rejected before anything
is submitted or written — exit code 2, one line on stderr naming the key (or the job) and
the fix, no traceback. Run in-process through the CLI's own `main`, as a user's command
line would be (no SLURM, no servers)."""

from __future__ import annotations

import os
import sys
import typing
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from prime_hpc.cli import main

RL = ["+experiment=reverse_text", "warmup.experiment=null"]

# (overrides, the key the error must name)
BAD_OVERRIDES = [
    (["orchestrator.sampling.temperature=-0.5"], "orchestrator.sampling.temperature"),
    (["orchestrator.sampling.max_tokens=0"], "orchestrator.sampling.max_tokens"),
    (["orchestrator.sampling.max_tokens=-3"], "orchestrator.sampling.max_tokens"),
    (["orchestrator.sampling.top_p=0"], "orchestrator.sampling.top_p"),
    (["orchestrator.sampling.top_p=1.5"], "orchestrator.sampling.top_p"),
    (["trainer.optim.lr=0"], "trainer.optim.lr"),
    (["trainer.optim.lr=-1e-4"], "trainer.optim.lr"),
    (["trainer.optim.lr=fast"], "trainer.optim.lr"),
    (["trainer.optim.weight_decay=-0.1"], "trainer.optim.weight_decay"),
    (["trainer.optim.max_norm=0"], "trainer.optim.max_norm"),
    (["trainer.optim.min_lr_ratio=2"], "trainer.optim.min_lr_ratio"),
    (["trainer.optim.warmup_steps=-1"], "trainer.optim.warmup_steps"),
    (["trainer.optim.schedule=exponential"], "trainer.optim.schedule"),
    (["trainer.loss.type=ppo"], "trainer.loss.type"),
    (["trainer.loss.kl_coef=-1"], "trainer.loss.kl_coef"),
    (["trainer.loss.clip_low=1.5"], "trainer.loss.clip_low"),
    (["trainer.micro_batch_size=0"], "trainer.micro_batch_size"),
    (["trainer.model.lora.rank=0"], "trainer.model.lora.rank"),
    (["trainer.model.ac.freq=0"], "trainer.model.ac.freq"),
    (["trainer.no_such_key=1"], "trainer.no_such_key"),
    (["+trainer.no_such_key=1"], "trainer.no_such_key"),
    (["ckpt.keep_last=0"], "ckpt.keep_last"),
    (["ckpt.interval=0"], "ckpt.interval"),
    (["ckpt.keep_interval=-5"], "ckpt.keep_interval"),
    (["ckpt.step=-2"], "ckpt.step"),
    (["orchestrator.eval.interval=-1"], "orchestrator.eval.interval"),
    (["orchestrator.eval.rollouts_per_example=0"], "orchestrator.eval.rollouts_per_example"),
    (["orchestrator.batch_size=0"], "orchestrator.batch_size"),
    (["orchestrator.batch_size=1.5"], "orchestrator.batch_size"),
    (["orchestrator.batch_size=60"], "orchestrator.batch_size"),
    (["orchestrator.group_size=0"], "orchestrator.group_size"),
    (["orchestrator.max_concurrent=0"], "orchestrator.max_concurrent"),
    (["orchestrator.advantage=median"], "orchestrator.advantage"),
    (["orchestrator.oversampling_factor=0.5"], "orchestrator.oversampling_factor"),
    (["orchestrator.difficulty_filter.min_reward_variance=-0.1"], "orchestrator.difficulty_filter.min_reward_variance"),
    (
        ["orchestrator.difficulty_filter.min_reward=0.9", "orchestrator.difficulty_filter.max_reward=0.1"],
        "orchestrator.difficulty_filter.min_reward",
    ),
    (["orchestrator.training_mode=bogus"], "orchestrator.training_mode"),
    (["orchestrator.trajectory_strategy=tree"], "orchestrator.trajectory_strategy"),
    (["orchestrator.env.0.ratio=-1"], "orchestrator.env.0.ratio"),
    (["orchestrator.env.0.id=no_such_env_pkg"], "orchestrator.env.0.id"),
    (["inference.gpu_memory_utilization=0"], "inference.gpu_memory_utilization"),
    (["inference.gpu_memory_utilization=1.5"], "inference.gpu_memory_utilization"),
    (["inference.tensor_parallel_size=0"], "inference.tensor_parallel_size"),
    (["inference.dtype=int4"], "inference.dtype"),
    (["inference.max_model_len=4096"], "inference.max_model_len"),
    (["weights.transport=nfs"], "weights.transport"),
    (["cluster.max_requeues=-1"], "cluster.max_requeues"),
    (["cluster.signal_delay_s=-10"], "cluster.signal_delay_s"),
    (["cluster.trainer.nodes=0"], "cluster.trainer.nodes"),
    (["cluster.trainer.cpus_per_task=0"], "cluster.trainer.cpus_per_task"),
    (["cluster.trainer.mem_gb=-4"], "cluster.trainer.mem_gb"),
    (["cluster.trainer.gpus_per_node=4"], "cluster.trainer.gpus_per_node"),  # on cluster.device=cpu
    (["cluster.orchestrator.nodes=2"], "cluster.orchestrator.nodes"),
    (["cluster.device=tpu"], "cluster.device"),
    (["cluster.umask=999"], "cluster.umask"),
    (["cluster.umask=rw-r-----"], "cluster.umask"),
    (["watchdog.stall_timeout_s=-1"], "watchdog.stall_timeout_s"),
    (["max_steps=0"], "max_steps"),
    (["seq_len=0"], "seq_len"),
    (["async_level=0"], "async_level"),
    (["wandb.log_extras.sample_ratio=0"], "wandb.log_extras.sample_ratio"),
    (["log.level=verbose"], "log.level"),
    (["model.name=/nonexistent/model"], "model.name"),
    (["bench.mode=foo"], "bench.mode"),
    (["bench.steps=0"], "bench.steps"),
    (["bench.mode=all", "bench.samples_per_step=60"], "bench.samples_per_step"),
    (["bench.mode=inference", "bench.completion_len=80"], "bench.completion_len"),
    # a control character in a value that reaches a job script: a newline in the run's name
    # ended the comment of the extra inference job's script and ran the rest as a command
    (["name='x\ntouch /tmp/x #'"], "name"),
    (["output_dir='{tmp}/run\x1b]0;pwned\x07'"], "output_dir"),
    (["cluster.partition='batch\rx'"], "cluster.partition"),
    (["cluster.account='a\u2028b'"], "cluster.account"),
    (["cluster.qos='normal\x85'"], "cluster.qos"),
    (["cluster.constraint='a\x7f'"], "cluster.constraint"),
    (["cluster.exclude='n1\tn2'"], "cluster.exclude"),
    (["cluster.time='1:00:00\n'"], "cluster.time"),
    (["cluster.python='/usr/bin/python3\n'"], "cluster.python"),
    (["cluster.cache_dir='{tmp}/c\nx'"], "cluster.cache_dir"),
    (["cluster.address='127.0.0.1\n'"], "cluster.address"),
    (["cluster.sbatch_extra=['--mail-type=END\x0b']"], "cluster.sbatch_extra.0"),
]


def _reject(argv: list[str], capsys) -> str:
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (argv, code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("prime-hpc: error: "), err
    assert "Traceback" not in out + err
    return lines[0]


@pytest.mark.parametrize("overrides, key", BAD_OVERRIDES, ids=[" ".join(o) for o, _ in BAD_OVERRIDES])
def test_a_bad_override_is_rejected_in_one_line_and_nothing_is_written(overrides, key, tmp_path, capsys):
    out = tmp_path / "run"
    overrides = [o.replace("{tmp}", str(tmp_path)) for o in overrides]
    line = _reject(["submit", *RL, f"output_dir={out}", *overrides], capsys)
    assert key in line, line
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_unknown_group_option_and_misplaced_option(tmp_path, capsys):
    out = tmp_path / "run"
    assert "cluster=nope" in _reject(["submit", *RL, f"output_dir={out}", "cluster=nope"], capsys)
    assert "--bogus" in _reject(["submit", *RL, f"output_dir={out}", "--bogus"], capsys)
    assert not out.exists()


def test_bad_bench_requests(tmp_path, capsys):
    out = tmp_path / "run"
    assert "--bench foo" in _reject(["submit", *RL, f"output_dir={out}", "--bench", "foo"], capsys)
    assert "bench.mode" in _reject(
        ["submit", "+experiment=reverse_text_sft", f"output_dir={out}", "--bench", "inference"], capsys
    )
    assert "-m" in _reject(["submit", "-m", *RL, f"output_dir={out}", "--bench", "trainer"], capsys)
    assert not out.exists() and not (tmp_path / "run-bench").exists()


def test_output_dirs_that_cannot_take_the_run(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert "output_dir" in _reject(["submit", *RL, f"output_dir={blocker}/run"], capsys)
    assert blocker.read_text() == "x"
    dirty = tmp_path / "dirty"  # not empty: never written into, not even by a dry run
    dirty.mkdir()
    (dirty / "notes.txt").write_text("mine")
    for extra in ([], ["--dry-run"]):
        assert "output_dir" in _reject(["submit", *RL, f"output_dir={dirty}", *extra], capsys)
        assert [p.name for p in dirty.iterdir()] == ["notes.txt"]
    theirs = tmp_path / "theirs"  # another user's directory, even an empty one
    theirs.mkdir()
    if os.getuid() == 0:
        os.chown(theirs, 65534, 65534)
    else:
        theirs = Path("/usr/share")  # root's
    before = sorted(theirs.iterdir())
    for out in (theirs, theirs / "prime-hpc-run"):
        line = _reject(["submit", *RL, f"output_dir={out}"], capsys)
        assert "output_dir" in line and "not to you" in line, line
    assert sorted(theirs.iterdir()) == before


@pytest.mark.parametrize("command", [["status"], ["cancel"], ["tail", "--no-follow"], ["resume"], ["eval"]])
def test_commands_on_an_unknown_job_name_it(command, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PRIME_HPC_STATE_DIR", str(tmp_path / "state"))
    line = _reject([command[0], "no-such-job", *command[1:]], capsys)
    assert "no job 'no-such-job'" in line, line


@pytest.mark.parametrize("model", ["model.name=/models/mine", "model=qwen3_0_6b"])
def test_a_model_on_the_command_line_is_the_warm_ups_and_the_run_continues_from_it(model, tmp_path):
    """A run with a warm-up starts from the warm-up's weights: a model on the command line
    is not dropped, it is the model the warm-up trains (after the experiment's own warm-up
    overrides), and recorded as such in the warm-up's job.json."""
    from prime_hpc.config.pipeline import compose_stages, model_overrides, warmup_overrides

    out = tmp_path / "run"
    overrides = ["+experiment=reverse_text", f"output_dir={out}", model, "max_steps=7"]
    warm, run = compose_stages(overrides)
    name = "Qwen/Qwen3-0.6B" if model.startswith("model=") else "/models/mine"
    assert warm.model.name == name and warm.trainer.type == "sft" and run.model.name == str(out / "warmup")
    assert warm.trainer.val.stop_below == 1.3 and run.max_steps == 7  # the recipe's warm-up, the run's own
    assert model_overrides(overrides) == [model]
    assert warmup_overrides(run, [model])[-1] == model
    assert not out.exists()


def _reaches_the_script(cfg) -> bool:
    """Whether a control character of `cfg` reaches the job's plan (what the scripts render,
    but for `cluster.env_setup`, which is shell the user writes)."""
    from prime_hpc.core.errors import UserError
    from prime_hpc.launcher.plan import make_plan
    from prime_hpc.launcher.render import check_plain

    try:
        plan = make_plan(cfg, cores=[0, 1])
    except Exception:  # a value the plan cannot even use: it reaches no script
        return False
    try:
        check_plain(plan, "plan")
    except UserError:
        return True
    return False


@pytest.mark.parametrize(
    "base",
    [
        [*RL, "cluster=dev"],
        [*RL, "cluster=slurm", "cluster.inference_job=own"],
        [*RL, "orchestrator.training_mode=opd", "orchestrator.teacher.model=tiny-35m", "cluster=dev"],
        ["+experiment=reverse_text_sft", "cluster=dev"],
    ],
    ids=["rl", "own-fleet", "own-teacher", "sft"],
)
def test_every_key_that_reaches_a_job_script_refuses_a_control_character(base, tmp_path):
    """Each string of the schema in turn holds a control character: wherever that reaches
    the job's plan (and so a script), validation refuses it in one error naming the key.
    The keys are found by the walk, not listed here: a new one that reaches a script and is
    not checked fails this test. (A field with choices is refused by its own rule.)"""
    from prime_hpc.config import walk
    from prime_hpc.config.compose import compose
    from prime_hpc.config.validate import validate
    from prime_hpc.core.errors import ConfigError

    cfg = compose([*base, f"output_dir={tmp_path}/run", f"cluster.cache_dir={tmp_path}/cache"])
    validate(cfg)
    assert not _reaches_the_script(cfg)
    reached = set()
    for site in walk.config_fields(cfg):
        hint = walk.bare(site.hint)
        if site.section is not None or site.entries is not None or hint not in (str, list[str], typing.List[str]):
            continue
        trial = cfg.copy()
        node = trial
        for part in site.key.split(".")[:-1]:
            node = node[int(part)] if part.isdigit() else node[part]
        value = f"{site.value if isinstance(site.value, str) else 'v'}\nx"
        node[site.name] = [value] if hint is not str else value
        if not _reaches_the_script(trial):
            continue
        reached.add(site.key)
        with pytest.raises(ConfigError) as e:
            validate(trial)
        assert e.value.key.removesuffix(".0") == site.key and len(str(e.value).splitlines()) == 1, e.value
    assert {"name", "output_dir", "cluster.partition", "cluster.python"} <= reached  # the walk found them


def test_a_plan_holding_a_control_character_never_renders(tmp_path):
    """The renderer refuses on its own what validation refuses (a plan built from a recorded
    config that was never validated, a caller that skipped it): the name with a newline that
    once rendered `touch /tmp/x` as a line of the extra inference job's script."""
    from prime_hpc.config.compose import compose
    from prime_hpc.core.errors import UserError
    from prime_hpc.launcher.plan import inference_job_plan, make_plan
    from prime_hpc.launcher.render import render_inference, render_local, render_sbatch

    cfg = compose([*RL, "cluster=dev", f"output_dir={tmp_path}/run", f"cluster.cache_dir={tmp_path}/cache"])
    assert "#!/bin/bash" in render_inference(inference_job_plan(cfg, 1, cores=[0, 1]))
    for key, value in [
        ("name", "x\ntouch /tmp/x #"),
        ("cluster.partition", "p\r#SBATCH --uid=0"),
        ("output_dir", f"{tmp_path}/r\x1b[2J"),
    ]:
        bad = cfg.copy()
        OmegaConf.update(bad, key, value)
        plan = make_plan(bad, cores=[0, 1])
        for render, args in (
            (render_inference, (inference_job_plan(bad, 1, cores=[0, 1]),)),
            (render_sbatch, (plan,)),
            (render_local, (plan, "local-1")),
        ):
            with pytest.raises(UserError, match="holds the control character") as e:
                render(*args)
            assert len(str(e.value).splitlines()) == 1


def _indexed_runs(tmp_path, monkeypatch, n: int) -> list:
    """`n` ended local runs in the user's index (newest last), each with its job.json."""
    import time

    from prime_hpc.rundir import RunDir, jobs

    monkeypatch.setenv("PRIME_HPC_STATE_DIR", str(tmp_path / "state"))
    runs = []
    for i in range(n):
        run = RunDir(tmp_path / f"run{i}")
        run.root.mkdir()
        jobs.update_job(run, name=f"run{i}", state="COMPLETED", backend="local", job_ids=[f"local-{i}"])
        jobs.record(jobs.JobRef(f"local-{i}", f"run{i}", str(run.root), "local", time.time()))
        runs.append(run)
    return runs


def test_list_skips_a_job_json_that_is_no_job_record_naming_it_and_lists_the_others(tmp_path, monkeypatch, capsys):
    runs = _indexed_runs(tmp_path, monkeypatch, 3)
    runs[1].job_json.write_text('{"name": "run1", "state": "COMPL')  # cut short
    assert main(["list"]) == 0
    out, err = capsys.readouterr()
    assert "local-0" in out and "local-2" in out and "local-1" not in out, out
    assert err.strip().splitlines() == [err.strip()] and str(runs[1].job_json) in err and "local-1" in err, err
    assert "Traceback" not in out + err


@pytest.mark.parametrize("content", ['["RUNNING"]', '{"attempts": 3}', '{"state": "RUN'])
@pytest.mark.parametrize("command", [["status"], ["tail", "--no-follow"], ["cancel"], ["resume"], ["scale"]])
def test_commands_on_a_job_json_that_is_no_job_record_name_it_in_one_line(
    command, content, tmp_path, monkeypatch, capsys
):
    (run,) = _indexed_runs(tmp_path, monkeypatch, 1)
    run.job_json.write_text(content)
    extra = ["inference=+1"] if command == ["scale"] else []
    for job in (str(run.root), "local-0", "run0", None):  # its directory, its id, its name; status: the newest
        if job is None and command != ["status"]:
            continue
        line = _reject([command[0], *([job] if job else []), *command[1:], *extra], capsys)
        assert str(run.job_json) in line, line


THEIRS = 65534  # nobody: another user of the cluster (these tests run as root, which may give files away)


def _their_local_run(tmp_path, monkeypatch, who: str):
    """A local run in the user's index whose job.json names a live process (the pid and start
    time a local job's supervisor records, in a session of its own as a job script runs):
    `who` owns the directory and job.json ("theirs"), the file only ("their-file"), a link
    to it ("link"), or the user owns both but group may write job.json ("group-writable")."""
    import subprocess

    from prime_hpc.rundir import jobs

    if os.getuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    (run,) = _indexed_runs(tmp_path, monkeypatch, 1)
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    jobs.update_job(run, state="RUNNING", pid=proc.pid, pid_start=jobs.start_time(proc.pid))
    if who == "link":
        real = tmp_path / "elsewhere.json"
        run.job_json.rename(real)
        run.job_json.symlink_to(real)
    if who == "group-writable":
        run.job_json.chmod(0o660)
    if who in ("theirs", "their-file"):
        os.chown(run.job_json, THEIRS, THEIRS)
    if who == "theirs":
        os.chown(run.root, THEIRS, THEIRS)
    return run, proc


@pytest.mark.parametrize("who", ["theirs", "their-file", "link", "group-writable"])
@pytest.mark.parametrize("command", [["cancel"], ["resume"], ["scale", "inference=+1"], ["scale", "inference=-1"]])
def test_commands_that_act_on_a_job_refuse_a_run_that_is_not_the_users_alone(
    command, who, tmp_path, monkeypatch, capsys
):
    """cancel signals the pid that job.json names (or scancels its job ids), resume and
    scale submit jobs from the run's config: given a run that is not the user's alone, each
    refuses in one line naming job.json, and nothing is signalled or written."""
    run, proc = _their_local_run(tmp_path, monkeypatch, who)
    try:
        before = sorted(p.name for p in run.root.iterdir())
        for job in (str(run.root), "local-0", "run0"):
            line = _reject([command[0], job, *command[1:]], capsys)
            why = {
                "theirs": f"{run.root} belongs to nobody, not to you",
                "their-file": f"{run.job_json} belongs to nobody, not to you",
                "link": f"{run.job_json} is a symbolic link",
                "group-writable": f"{run.job_json} is writable by group or others",
            }[who]
            assert line.endswith(
                f"cannot {command[0]} the job of {run.root}: {why}; {command[0]} acts only on runs of your own"
            ), line
        assert proc.poll() is None  # the process job.json names is untouched
        assert sorted(p.name for p in run.root.iterdir()) == before
    finally:
        proc.kill()
        proc.wait()


def test_cancel_of_the_users_own_local_run_still_stops_it(tmp_path, monkeypatch, capsys):
    run, proc = _their_local_run(tmp_path, monkeypatch, "mine")
    try:
        assert main(["cancel", str(run.root)]) == 0
        assert proc.wait(timeout=10) == -15  # SIGTERM to the session, as to a job script
        assert "cancelled job local-0 (run0)" in capsys.readouterr().out
    finally:
        proc.kill()


def test_tail_and_status_of_a_run_that_is_not_the_users_still_read_it(tmp_path, monkeypatch, capsys):
    """Reading is not acting: tail and status of another user's readable run show it."""
    run, proc = _their_local_run(tmp_path, monkeypatch, "theirs")
    try:
        assert main(["status", str(run.root)]) == 0
        assert "run0" in capsys.readouterr().out
        assert main(["tail", str(run.root), "--no-follow"]) == 0
        assert "local-0" in capsys.readouterr().out
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_status_and_list_print_no_control_sequence_a_run_wrote(tmp_path, monkeypatch, capsys):
    from prime_hpc.rundir import jobs

    (run,) = _indexed_runs(tmp_path, monkeypatch, 1)
    jobs.update_job(
        run,
        state="FAILED\x1b[2J",
        failure={"component": "trainer", "rc": 1, "reason": "boom\x1b]0;owned\x07", "log": "l"},
    )
    for command in (["status", str(run.root)], ["list"]):
        assert main(command) == 0
        out = capsys.readouterr().out
        assert "\x1b" not in out and "\x07" not in out, out
        assert "FAILED\\x1b[2J" in out, out


SHADOW_CHECK = """
import sys
from pathlib import Path
project = Path(sys.argv[1])
planted = ("colorsys", "httpx")  # a module of the standard library, an installed one
assert not any(m in sys.modules for m in planted), "the test needs modules not imported yet"
from prime_hpc.orchestrator.envs import import_env_module
env = import_env_module(str(project))
assert env.load_environment() == "echo" and env.HELPER == "beside"  # its sibling still imports
import colorsys, httpx
for m in (colorsys, httpx):
    assert project not in Path(m.__file__).parents, m.__file__
assert str(project) == sys.path[-1]
print("ok")
"""


def test_an_environments_directory_shadows_no_module_of_the_standard_library_or_installed(tmp_path):
    """An environment project's directory is appended to sys.path, not put in front of it:
    a `colorsys.py` or `httpx.py` planted beside the environment's package is never what
    `import colorsys` or `import httpx` finds afterwards; the package's own siblings still
    import. (A fresh interpreter: what it imports first is what would be shadowed.)"""
    import subprocess

    project = tmp_path / "echo-word"
    (project / "echo_word").mkdir(parents=True)
    (project / "pyproject.toml").write_text('[project]\nname = "echo-word"\nversion = "0.1.0"\n')
    (project / "echo_word" / "__init__.py").write_text(
        "from env_helpers import HELPER\n\ndef load_environment():\n    return 'echo'\n"
    )
    (project / "env_helpers.py").write_text("HELPER = 'beside'\n")
    for name in ("colorsys", "httpx"):
        (project / f"{name}.py").write_text("raise RuntimeError('planted module imported')\n")
    done = subprocess.run(
        [sys.executable, "-c", SHADOW_CHECK, str(project)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@pytest.mark.parametrize("name", ["json", "httpx"])
def test_an_environment_named_like_a_module_it_would_replace_is_refused_in_one_line(name, tmp_path):
    from prime_hpc.config.schema import EnvEntry
    from prime_hpc.core.errors import UserError
    from prime_hpc.orchestrator.envs import load_env

    package = tmp_path / name
    package.mkdir()
    (package / "__init__.py").write_text("def load_environment():\n    return 'mine'\n")
    before = sys.modules.get(name)
    with pytest.raises(UserError, match=f"would be loaded as module '{name}', which is") as e:
        load_env(EnvEntry(id=str(package), args={}))
    assert len(str(e.value).splitlines()) == 1 and sys.modules.get(name) is before
