"""`prime-hpc eval` before anything runs: which steps it scores (the base model first by
default), the job it makes on a SLURM cluster (the run's servers with the eval runner in
the orchestrator's place, its files under `<run>/eval/job`, the results beside them),
per-env arguments, and the per-sample record. No server, no job."""

from __future__ import annotations

import pytest
import yaml
from omegaconf import OmegaConf

from prime_hpc.cli import main
from prime_hpc.config.compose import compose
from prime_hpc.launcher import evaluate as eval_command
from prime_hpc.launcher import launch
from prime_hpc.orchestrator import evaluate
from prime_hpc.orchestrator.evaluator import sample_record
from prime_hpc.orchestrator.rollouts import from_output
from prime_hpc.rundir import RunDir, mark_stable


def _run(root, *overrides: str, steps=(2, 4)) -> tuple[RunDir, object]:
    cfg = compose(["+experiment=reverse_text_sft", f"output_dir={root}", *overrides])
    root.mkdir(parents=True)
    OmegaConf.save(cfg, root / "config.yaml", resolve=True)
    run = RunDir(root)
    for s in steps:
        run.weights_step(s).mkdir(parents=True)
        mark_stable(run.weights_step(s))
    return run, cfg


def test_eval_scores_the_base_model_first_unless_told_not_to(tmp_path):
    run, _ = _run(tmp_path / "run")
    assert evaluate.eval_steps(run, None, None, base=True) == [0, 2, 4]
    assert evaluate.eval_steps(run, None, None, base=False) == [2, 4]
    assert evaluate.eval_steps(run, [4, 0], None, base=True) == [0, 4]  # asked: as asked, 0 needs no weights
    assert evaluate.eval_steps(run, None, 2, base=True) == [2]  # a weights dir names one step
    try:
        evaluate.eval_steps(run, [3], None, base=True)
    except Exception as e:
        assert "no complete weights for step(s) [3]" in str(e) and "0, the base model" in str(e)
    else:
        raise AssertionError("a step without weights was accepted")


def test_on_a_slurm_cluster_eval_is_a_job_of_the_runs_servers_with_the_eval_runner_beside_them(tmp_path):
    """The run's own model, envs, inference and cluster; kind `eval`; its files in
    `<run>/eval/job`, replaced by the next eval (the results beside it are kept)."""
    run, cfg = _run(tmp_path / "run", "cluster=dev")
    assert not eval_command.runs_here(cfg) and eval_command.runs_here(compose(["+experiment=reverse_text_sft"]))
    job_cfg = eval_command.eval_job_config(cfg, [0, 4], run.eval_dir, run)
    job, plan = launch.prepare(job_cfg, "run", dry_run=True)
    assert job.root == run.eval_dir / "job" and plan.kind == "eval" and job_cfg.name == "reverse_text_sft-eval"
    assert job_cfg.cluster.max_requeues == 0  # no checkpoint to come back to: a time limit ends it
    assert plan.group_names == ["orchestrator", "inference"] and plan.group("inference").nodes == 1
    orch = yaml.safe_load(job.component_config("orchestrator").read_text())
    assert orch["eval_job"] == {"steps": [0, 4], "run": str(run.root), "results": str(run.eval_dir)}
    assert orch["orchestrator"]["eval"]["env"] == OmegaConf.to_container(cfg.orchestrator.eval.env)
    inference = yaml.safe_load(job.component_config("inference").read_text())
    assert inference["model"]["name"] == cfg.model.name and job.sbatch_script("eval").exists()
    # a later eval replaces the job's files, never the results next to them
    (run.eval_dir / "step_4.json").write_text("{}")
    again = eval_command.eval_job_config(OmegaConf.load(run.config_yaml), [2], run.eval_dir, run)
    assert again.clean_output_dir
    launch.check_fresh(again)
    assert (run.eval_dir / "step_4.json").exists()


def test_a_model_named_on_the_command_line_is_an_eval_job_without_a_training_env(tmp_path):
    """`eval model=... env=... cluster=dev`: the default config with only eval envs (no
    training env is needed or loaded); step 0, the model as it is; results in `out`."""
    from prime_hpc.config.schema import EnvEntry

    cfg = compose(["model.name=tiny", "cluster=dev", f"output_dir={tmp_path / 'out'}"])
    cfg.orchestrator.eval.env = [EnvEntry(id="reverse-text", args={"max_len": 4})]
    job_cfg = eval_command.eval_job_config(cfg, [0], tmp_path / "out", None)
    job, plan = launch.prepare(job_cfg, "run", dry_run=True)
    orch = yaml.safe_load(job.component_config("orchestrator").read_text())
    assert orch["eval_job"] == {"steps": [0], "run": None, "results": str(tmp_path / "out")}
    assert orch["orchestrator"]["eval"]["env"][0]["args"] == {"max_len": 4} and plan.kind == "eval"


def where_eval_runs(monkeypatch, argv: list[str]) -> list[str]:
    """What `prime-hpc eval argv` starts: "server" (one on this machine) or "job"; neither
    is really started."""
    seen: list[str] = []

    def local_server(*a, **k):
        seen.append("server")
        raise SystemExit(3)

    monkeypatch.setattr(evaluate, "eval_server", local_server)
    monkeypatch.setattr(eval_command, "submit_and_follow", lambda *a, **k: seen.append("job") or 0)
    try:
        main(["eval", *argv])
    except SystemExit as e:
        assert e.code == 3
    return seen


def test_here_keeps_eval_on_this_machine_on_a_slurm_cluster(tmp_path, monkeypatch):
    run, _ = _run(tmp_path / "run", "cluster=dev")
    assert where_eval_runs(monkeypatch, [str(run.root), "--here"]) == ["server"]


def test_env_arguments_are_given_per_env_and_typed():
    got = eval_command.parse_env_args(
        ["args.reverse-text.num_words=5", "args.gsm8k.split=test"], ["reverse-text", "gsm8k"]
    )
    assert got == {"reverse-text": {"num_words": 5}, "gsm8k": {"split": "test"}}
    for bad, said in [("args.other.n=1", "not among env="), ("args.n=1", "args.<env>.<arg>=<value>")]:
        try:
            eval_command.parse_env_args([bad], ["reverse-text"])
        except Exception as e:
            assert said in str(e) and "\n" not in str(e)
        else:
            raise AssertionError(f"{bad} was accepted")


def test_a_sample_record_has_what_a_person_reads_and_a_script_loads():
    out = {
        "example_id": 7,
        "prompt": [{"role": "user", "content": "abc"}],
        "completion": [{"role": "assistant", "content": "cba"}],
        "reward": 1.0,
        "metrics": {"lcs_ratio": 1.0, "note": "text is left out"},
        "trajectory": [
            {"tokens": {"prompt_ids": [1, 2], "completion_ids": [3], "completion_logprobs": [-0.1]}, "response": {}}
        ],
    }
    r = from_output(out, "reverse-text", 80, "interleaved")
    rec = sample_record(5, r, 1)
    assert rec == {
        "step": 5,
        "env": "reverse-text",
        "example_id": 7,
        "rollout": 1,
        "prompt": "abc",
        "completion": "cba",
        "reward": 1.0,
        "metrics": {"lcs_ratio": 1.0},
        "error": None,
    }


def test_someone_elses_run_is_scored_here_not_in_a_job_with_their_cluster_settings(tmp_path, monkeypatch, capsys):
    import os

    run, _ = _run(tmp_path / "run", "cluster=dev")
    os.chown(run.config_yaml, 65534, 65534)
    monkeypatch.chdir(tmp_path)  # its results go to outputs/eval/run-<time>, the user's own
    assert where_eval_runs(monkeypatch, [str(run.root)]) == ["server"]
    assert "is not yours: scored with your cluster settings, not its; eval writes to " in capsys.readouterr().out
    (mine,) = (tmp_path / "outputs" / "eval").iterdir()
    assert mine.name.startswith("run-") and mine.stat().st_mode & 0o777 == 0o700


def test_an_eval_job_is_not_resumed_or_scaled(tmp_path, capsys):
    from prime_hpc.rundir import atomic_write_json

    run, _ = _run(tmp_path / "run", "cluster=dev")
    job = RunDir(run.eval_dir / "job")
    job.root.mkdir(parents=True)
    (job.root / "config.yaml").write_text(run.config_yaml.read_text())
    atomic_write_json(
        job.job_json,
        {"name": "x-eval", "kind": "eval", "backend": "slurm", "job_ids": ["7"], "state": "TIMEOUT", "mode": "run"},
    )
    capsys.readouterr()
    assert main(["resume", str(job.root)]) == 2
    err = capsys.readouterr().err
    assert "is an eval job, which keeps no checkpoint to resume from" in err and err.count("\n") == 1, err
    assert main(["scale", str(job.root), "inference=+1"]) == 2
    assert "is an eval job" in capsys.readouterr().err


def _served_in(monkeypatch) -> dict:
    seen: dict = {}

    def server(cfg, edir, cache):
        seen["edir"] = edir.root
        raise SystemExit(3)

    monkeypatch.setattr(evaluate, "eval_server", server)
    return seen


@pytest.mark.parametrize("word", ["out", "output_dir"])
def test_output_dir_is_where_eval_writes_as_out_is(tmp_path, monkeypatch, capsys, word):
    """`output_dir=DIR` names the directory a command writes, for eval as for submit: its
    results and its server's files go there (a model, or a run of the user's)."""
    monkeypatch.chdir(tmp_path)
    seen = _served_in(monkeypatch)
    given = tmp_path / "here" / "mine"
    with pytest.raises(SystemExit):
        main(["eval", "model=tiny", "env=reverse-text", f"{word}={given}", "--here"])
    assert seen.pop("edir") == given and not (tmp_path / "outputs").exists()
    run, _ = _run(tmp_path / "run")
    with pytest.raises(SystemExit):
        main(["eval", str(run.root), "steps=2", f"{word}={given}"])
    assert seen.pop("edir") == given and not run.eval_dir.exists()


def test_out_and_output_dir_that_differ_are_refused_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _served_in(monkeypatch)
    run, _ = _run(tmp_path / "run")
    for target in (["model=tiny", "env=reverse-text"], [str(run.root)]):
        assert main(["eval", *target, "out=a", "output_dir=b"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "out=a and output_dir=b: give one" in err, err
    assert not run.eval_dir.exists() and not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
