"""Composition of every experiment and each validation rule (the CLI's one-line errors
for the same mistakes: tests/unit/test_config_cli.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from prime_hpc.config.compose import compose
from prime_hpc.config.validate import validate
from prime_hpc.core.errors import ConfigError, UserError
from tests.conftest import REPO

EXPERIMENTS = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml"))


def make(tmp_path: Path, *overrides: str):
    return compose(["+experiment=reverse_text", f"output_dir={tmp_path}/run", *overrides])


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_and_validates(experiment, tmp_path):
    cfg = compose([f"+experiment={experiment}", f"output_dir={tmp_path}/run"])
    validate(cfg)
    assert cfg.output_dir == f"{tmp_path}/run"


def test_reference_defaults(tmp_path):
    cfg = compose([f"output_dir={tmp_path}"])
    assert cfg.async_level == 2
    assert cfg.orchestrator.max_off_policy_steps == 8
    assert cfg.orchestrator.eval.interval == 100
    assert cfg.trainer.model.optimization_dtype == "auto" and cfg.trainer.model.reduce_dtype == "float32"
    assert cfg.inference.dtype == "float32"  # the default model's (tiny, float32: vLLM's "auto" would halve it)
    assert compose([f"output_dir={tmp_path}", "model=qwen3_0_6b"]).inference.dtype == "auto"  # the reference's
    assert cfg.ckpt.interval is None and cfg.ckpt.keep_last is None  # checkpointing off by default
    assert cfg.wandb.enabled is False
    assert cfg.log.level == "info"


def test_model_name_propagates_and_max_model_len_follows_seq_len(tmp_path):
    cfg = make(tmp_path, "model.name=/models/x", "seq_len=256")
    assert cfg.trainer.model.name == cfg.inference.model.name == cfg.orchestrator.model.name == "/models/x"
    assert cfg.trainer.tokenizer.name == "/models/x"
    assert cfg.inference.max_model_len == 256


@pytest.mark.parametrize(
    "overrides, key, fix",
    [
        (["orchestrator.batch_size=60"], "orchestrator.batch_size", "set it to 56 or 64"),
        (["inference.max_model_len=4096"], "inference.max_model_len", "max_model_len<=80"),
        (["orchestrator.sampling.max_tokens=128"], "orchestrator.sampling.max_tokens", "lower it"),
        (["cluster.trainer.gpus_per_node=4"], "cluster.trainer.gpus_per_node", "cluster.device=cuda"),
        (["cluster=slurm", "inference.data_parallel_size=2"], "cluster.inference.gpus_per_node", "make them equal"),
        (["cluster=slurm", "inference.tensor_parallel_size=3"], "cluster.inference.gpus_per_node", "multiple of 3"),
        (["cluster=slurm", "cluster.trainer.nproc_per_node=4"], "cluster.trainer.nproc_per_node", "set it to 8"),
        (["inference.model.name=other"], "inference.model.name", "model.name"),
        (["trainer.tokenizer.name=other"], "trainer.tokenizer.name", "model.name"),
        (["orchestrator.env.0.id=no_such_env_pkg"], "orchestrator.env.0.id", "install its package"),
        (["orchestrator.eval.env.0.id=no_such_env_pkg"], "orchestrator.eval.env.0.id", "install its package"),
        (["orchestrator.env.0.ratio=0"], "orchestrator.env.0.ratio", "must be > 0"),
        (["orchestrator.training_mode=opd"], "orchestrator.teacher.client.base_url", "teacher"),
        (["orchestrator.teacher.client.base_url=http://h:1/v1"], "orchestrator.teacher.client.base_url", "unset it"),
        (["orchestrator.training_mode=bogus"], "orchestrator.training_mode", "choose from rl, opd, sft"),
        (["cluster.device=tpu"], "cluster.device", "choose from cpu, cuda"),
        (["cluster.inference_job=own"], "cluster.inference_job", "use het (the default) or cluster=slurm"),
        (["cluster.inference_job=apart"], "cluster.inference_job", "choose from het, own"),
        (["trainer.loss.type=ppo"], "trainer.loss.type", "choose from"),
        (["trainer.loss.target_kl=0.01"], "trainer.loss.target_kl", "give ref_kl_coef > 0"),
        (["trainer.loss.ref_kl_coef=0.1", "trainer.loss.target_kl=0"], "trainer.loss.target_kl", "> 0"),
        (
            [
                "trainer.loss.ref_kl_coef=0.1",
                "trainer.loss.target_kl=0.01",
                "trainer.max_concurrent_runs=2",
                "trainer.model.lora.enabled=true",
            ],
            "trainer.loss.ref_kl_coef",
            "set it to 0 (and unset target_kl)",
        ),
        (
            ["trainer.loss.ref_kl_coef=0.1", "trainer.max_concurrent_runs=2", "trainer.model.lora.enabled=true"],
            "trainer.loss.ref_kl_coef",
            "keeps no reference policy",
        ),
        (["trainer.loss.kl_horizon=0"], "trainer.loss.kl_horizon", ">= 1"),
        (
            ["ckpt.weights.interval=5", "trainer.max_concurrent_runs=2", "trainer.model.lora.enabled=true"],
            "ckpt.weights.interval",
            "not kept by the multi-run trainer",
        ),
        (
            ["ckpt.weights_only=true", "trainer.max_concurrent_runs=2", "trainer.model.lora.enabled=true"],
            "ckpt.weights_only",
            "not kept by the multi-run trainer",
        ),
        (["trainer.type=sft"], "trainer.data.name", "dataset"),
        (
            ["trainer.type=sft", "trainer.data.name=d", "trainer.data.batch_size=64"],
            "trainer.data.batch_size",
            "multiple of 80",
        ),
        (
            ["trainer.type=sft", "trainer.data.name=d", "trainer.val.interval=5"],
            "trainer.val.data.name",
            "validation dataset",
        ),
        (["trainer.model.ac.freq=0"], "trainer.model.ac.freq", ">= 1"),
        (["trainer.model.lora.enabled=true", "trainer.model.lora.rank=0"], "trainer.model.lora.rank", ">= 1"),
        (["trainer.model.lora.enabled=true", "trainer.model.lora.dropout=1.0"], "trainer.model.lora.dropout", "[0, 1)"),
        (["ckpt.keep_last=0"], "ckpt.keep_last", ">= 1"),
        (["ckpt.weights.keep_last=2"], "ckpt.weights.keep_last", "ckpt.weights.interval or ckpt.weights_only"),
        (["ckpt.weights.interval=0"], "ckpt.weights.interval", ">= 1"),
        (["trainer.max_concurrent_runs=2"], "trainer.max_concurrent_runs", "trainer.model.lora.enabled=true"),
        (
            ["trainer.max_concurrent_runs=2", "trainer.model.lora.enabled=true", "weights.transport=broadcast"],
            "trainer.max_concurrent_runs",
            "weights.transport=filesystem",
        ),
        (["job_dir=/j"], "job_dir", "trainer.max_concurrent_runs"),
        (["orchestrator.advantage=median"], "orchestrator.advantage", "choose from mean, std, loo"),
        (
            ["trainer.type=sft", "trainer.data.name=d", "trainer.val.stop_below=1.0"],
            "trainer.val.stop_below",
            "trainer.val.interval",
        ),
        (["async_level=0"], "async_level", "1 is fully on-policy"),
        (["cluster.max_requeues=-1"], "cluster.max_requeues", ">= 0"),
        (["cluster.trainer.cpu_ids=cores"], "cluster.trainer.cpu_ids", "core list"),
        (["cluster.trainer.gpu_ids=0-7"], "cluster.trainer.gpu_ids", "cluster.device=cuda"),
        (["cluster=slurm", "cluster.inference.gpu_ids=0-3"], "cluster.inference.gpu_ids", "make them equal"),
        (["cluster=slurm", "cluster.inference.gpu_ids=gpu0"], "cluster.inference.gpu_ids", "not a GPU list"),
        (["cluster=slurm", "cluster.inference.gpu_ids='0-6,6'"], "cluster.inference.gpu_ids", "names a GPU twice"),
        (
            ["cluster=slurm", "cluster.inference.gpu_ids=0-7", "cluster.trainer.gpu_ids=4-11"],
            "cluster.trainer.gpu_ids",
            "cluster.share_gpus=true",
        ),
        (["cluster.orchestrator.nodes=2"], "cluster.orchestrator.nodes", "exactly one node"),
        (["cluster.trainer.mem_gb=8"], "cluster.orchestrator.mem_gb", "every group or for none"),
        (
            [
                "weights.transport=broadcast",
                "trainer.model.lora.enabled=true",
                "ckpt.weights.save_adapter_separately=true",
            ],
            "ckpt.weights.save_adapter_separately",
            "weights.transport=filesystem",
        ),
    ],
)
def test_validation_rule(tmp_path, overrides, key, fix):
    cfg = make(tmp_path, *overrides)
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert e.value.key == key
    assert fix in str(e.value)
    assert "\n" not in str(e.value)


def test_output_dir_without_slurm_patterns(tmp_path):
    cfg = compose(["+experiment=reverse_text", f"output_dir={tmp_path}/run_%j"])
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert e.value.key == "output_dir" and "'%'" in str(e.value)


def test_output_dir_must_be_writable_directory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cfg = compose(["+experiment=reverse_text", f"output_dir={blocker}/run"])
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert e.value.key == "output_dir"


@pytest.mark.parametrize(
    "override, needle",
    [
        ("trainer.optim.lrr=1", "trainer.optim.lrr: unknown key; valid keys here: betas, lr,"),
        ("trainer.optim.lr=abc", "trainer.optim.lr:"),
        ("+foo=1", "foo: unknown key"),
        ("model=nope", "model=nope: unknown model; choose from"),
        ("orchestrator.batch_size=1.5", "orchestrator.batch_size:"),
    ],
)
def test_composition_errors_are_one_line(override, needle):
    with pytest.raises(UserError) as e:
        compose(["+experiment=reverse_text", override])
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def _fixed_length_fields() -> list[tuple[str, int]]:
    """(dotted key, length) of every fixed-length field of the schema (typed Tuple[X, Y])."""
    import typing

    from prime_hpc.config.walk import schema_fields

    out = []
    for site in schema_fields():
        args = typing.get_args(site.hint)
        if typing.get_origin(site.hint) is tuple and args and args[-1] is not Ellipsis:
            out.append((site.key, len(args)))
    return out


def test_every_fixed_length_field_refuses_another_length(tmp_path):
    found = _fixed_length_fields()
    assert ("trainer.optim.betas", 2) in found
    for key, n in found:
        for values in ([0.5] * (n - 1), [0.5] * (n + 1)):
            cfg = make(tmp_path, f"{key}=[{','.join(map(str, values))}]")
            with pytest.raises(ConfigError) as e:
                validate(cfg)
            assert e.value.key == key and f"takes exactly {n} values" in str(e.value) and "\n" not in str(e.value)
        validate(make(tmp_path, f"{key}=[{','.join(['0.5'] * n)}]"))


def _refused(argv: list[str], capsys) -> str:
    """The CLI's answer to a bad submit: exit code 2 and one line on stderr."""
    from prime_hpc.cli import main

    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (argv, code, out, err)
    assert len(err.strip().splitlines()) == 1 and err.startswith("prime-hpc: error: ") and "Traceback" not in err, err
    return err.strip()


@pytest.mark.parametrize(
    "overrides, needles",
    [
        (["trainer.optim.betas=[0.9]"], ["trainer.optim.betas", "exactly 2 values", "got 1"]),
        (["trainer.optim.betas=[0.9,0.99,0.999]"], ["trainer.optim.betas", "exactly 2 values", "got 3"]),
        (["orchestrator.env=[{ratio: 1}]"], ["orchestrator.env.0.id", "not set"]),
        (["orchestrator.group_size=1"], ["orchestrator.group_size", "zero advantage", "2 or more"]),
        (
            ["cluster=slurm", "cluster.sbatch_extra=['--export=NONE']"],
            ["cluster.sbatch_extra.0", "'--export=NONE'", "INFERENCE_SERVER_API_KEY", "cluster.env_setup"],
        ),
    ],
)
def test_bad_submits_are_refused_in_one_line_and_write_nothing(overrides, needles, tmp_path, capsys):
    out = tmp_path / "run"
    line = _refused(["submit", "+experiment=reverse_text", f"output_dir={out}", *overrides, "--dry-run"], capsys)
    assert all(n in line for n in needles), line
    assert not out.exists()


@pytest.mark.parametrize(
    "mode, extra",
    [
        ("rl", []),
        ("opd", ["orchestrator.teacher.client.base_url=http://h:1/v1"]),
        ("sft", ["orchestrator.teacher.client.base_url=http://h:1/v1"]),
    ],
)
def test_a_group_of_one_is_refused_where_every_group_would_be_dropped(mode, extra, tmp_path):
    from prime_hpc.orchestrator.rollouts import Rollout, advantages, judge_group

    one = Rollout(
        env="e",
        example_id=0,
        reward=1.0,
        input_ids=[1, 2],
        loss_mask=[False, True],
        logprobs=[0.0, 0.0],
        policy_steps=[0],
        num_turns=1,
        is_truncated=False,
    )
    assert advantages([0.7], "mean") == [0.0]  # why rl cannot learn from it
    assert judge_group(
        [one], step=1, async_level=2, max_off_policy_steps=8, filter_zero_variance=False, advantage="mean"
    ).reason
    cfg = make(
        tmp_path, "orchestrator.group_size=1", "orchestrator.batch_size=8", f"orchestrator.training_mode={mode}", *extra
    )
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert e.value.key == "orchestrator.group_size" and "set it to 2 or more" in str(e.value)
    validate(
        make(
            tmp_path,
            "orchestrator.group_size=2",
            "orchestrator.batch_size=8",
            f"orchestrator.training_mode={mode}",
            *extra,
        )
    )


def test_a_group_of_one_is_fine_where_there_are_no_groups(tmp_path):
    validate(compose(["+experiment=reverse_text_sft", f"output_dir={tmp_path}/sft", "orchestrator.group_size=1"]))
    validate(make(tmp_path, "orchestrator.group_size=1", "orchestrator.batch_size=8", "bench.mode=inference"))


@pytest.mark.parametrize(
    "line",
    [
        "--export=NONE",
        "--export NONE",
        "--export=HOME,PATH",
        "--export=ALL,X=1",
        "--export",
        " --export=ALL",
        "--export-file=/tmp/env",
        "--export-f=/tmp/env",
    ],
)
def test_sbatch_extra_may_not_choose_the_jobs_environment(line, tmp_path):
    """The API key reaches the job only through the environment sbatch passes on: an
    --export (even ALL: prime-hpc's own --export would override its variables) or an
    --export-file (which replaces the environment, verified on SLURM 22.05) is refused."""
    cfg = make(tmp_path, "cluster=slurm", f"cluster.sbatch_extra=['--mail-type=END', '{line}']")
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert e.value.key == "cluster.sbatch_extra.1" and "cluster.env_setup" in str(e.value)


def test_sbatch_extra_options_that_keep_the_environment_pass(tmp_path):
    validate(
        make(
            tmp_path,
            "cluster=slurm",
            "cluster.sbatch_extra=['--get-user-env', '--mail-type=END', '--exclusive', '--comment=export=NONE']",
        )
    )
