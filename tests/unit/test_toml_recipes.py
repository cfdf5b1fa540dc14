"""Recipes in the reference's TOML layout (`submit @ rl.toml`) and its `PRIME_` variables:
the reverse-text recipes compose to the experiments', files and variables take their
place in the precedence, a key with no counterpart is refused in one line, and the docs'
table is the module's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from prime_hpc.config import toml_recipes
from prime_hpc.config.compose import compose
from prime_hpc.core.errors import UserError
from tests.conftest import REPO, cli

# The reference's reverse-text RL recipe (`rl @ examples/reverse_text/rl.toml`: its keys),
# holding the values of +experiment=reverse_text.
RL_RECIPE = """\
max_steps = 350
seq_len = 80

[model]
name = "tiny"

[orchestrator]
batch_size = 64
rollouts_per_example = 8

[orchestrator.sampling]
max_tokens = 32

[orchestrator.eval]
interval = 175
rollouts_per_example = 4

[[orchestrator.env]]
id = "reverse_text"

[[orchestrator.eval.env]]
id = "reverse_text"

[trainer.optim]
lr = 5e-4

[inference]
gpu_memory_utilization = 0.2

[inference.model]
dtype = "float32"
"""
# what +experiment=reverse_text sets that the reference's layout has no key for
RL_UNSTATED = (
    "name",
    "async_level",
    "warmup.experiment",
    "warmup.overrides",
    "orchestrator.advantage",
    "orchestrator.eval.at_start",
    "trainer.micro_batch_size",
    "trainer.optim.schedule",
)

# The reference's SFT recipe (`sft @ examples/reverse_text/sft.toml`: its layout), holding
# the values of +experiment=reverse_text_sft.
SFT_RECIPE = """\
max_steps = 1000

[ckpt]

[model]
name = "tiny"

[data]
name = "reverse_text:make_sft_dataset"
seq_len = 80
batch_size = 2560
micro_batch_size = 32

[optim]
lr = 1e-3

[val]
interval = 100

[val.data]
name = "reverse_text:make_sft_dataset"
"""
SFT_UNSTATED = (
    "name",
    "trainer.data.args",  # the generated dataset's kwargs
    "trainer.val.data.args",
    "orchestrator.env",  # the eval env of `prime-hpc eval`
    "orchestrator.eval.env",
)

# The reference's own RL recipe, with its values
REFERENCE_RL = """\
max_steps = 20
seq_len = 2048

[model]
name = "PrimeIntellect/Qwen3-0.6B-Reverse-Text-SFT"

[wandb]
project = "reverse-text"
name = "reverse-text"

[orchestrator]
batch_size = 128
rollouts_per_example = 16

[orchestrator.sampling]
max_tokens = 128

[[orchestrator.env]]
id = "reverse-text"

[trainer.model.lora]
rank = 8
alpha = 32
dropout = 0.0
target_modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

[trainer.optim]
lr = 3e-6

[inference]
"""


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def flat(cfg, prefix: str = "") -> dict:
    """Every leaf of a composed config by its dotted key (lists and empty tables as values)."""
    tree = OmegaConf.to_container(cfg, resolve=False) if prefix == "" else cfg
    out: dict = {}
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            out.update(flat(v, key))
        else:
            out[key] = v
    return out


def differing(a, b) -> set[str]:
    fa, fb = flat(a), flat(b)
    return {k for k in fa.keys() | fb.keys() if fa.get(k, "<absent>") != fb.get(k, "<absent>")}


def covered(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize(
    "recipe,experiment,unstated",
    [(RL_RECIPE, "reverse_text", RL_UNSTATED), (SFT_RECIPE, "reverse_text_sft", SFT_UNSTATED)],
    ids=["rl", "sft"],
)
def test_a_reverse_text_recipe_composes_to_the_experiment(tmp_path, recipe, experiment, unstated):
    path = write(tmp_path, "recipe.toml", recipe)
    from_recipe = compose(toml_recipes.expand(["@", path], {}), resolve=False)
    from_experiment = compose([f"+experiment={experiment}"], resolve=False)
    diff = differing(from_recipe, from_experiment)
    assert all(covered(k, unstated) for k in diff), sorted(k for k in diff if not covered(k, unstated))
    assert all(any(covered(k, (p,)) for k in diff) for p in unstated), (sorted(diff), unstated)


def test_the_reference_rl_recipe_lands_on_prime_hpc_keys(tmp_path):
    cfg = compose(toml_recipes.expand(["@" + write(tmp_path, "rl.toml", REFERENCE_RL)], {}), resolve=False)
    assert (cfg.max_steps, cfg.seq_len, cfg.model.name) == (20, 2048, "PrimeIntellect/Qwen3-0.6B-Reverse-Text-SFT")
    assert cfg.wandb.enabled and (cfg.wandb.project, cfg.wandb.name) == ("reverse-text", "reverse-text")
    assert (cfg.orchestrator.batch_size, cfg.orchestrator.group_size) == (128, 16)
    assert cfg.orchestrator.sampling.max_tokens == 128 and [e.id for e in cfg.orchestrator.env] == ["reverse-text"]
    lora = cfg.trainer.model.lora
    assert lora.enabled and (lora.rank, lora.alpha, lora.dropout) == (8, 32.0, 0.0) and len(lora.target_modules) == 7
    assert cfg.trainer.optim.lr == 3e-6 and cfg.trainer.type == "rl" and not cfg.ckpt.enabled


def test_values_pass_through_hydras_grammar_unchanged(tmp_path):
    text = (
        '[[env]]\nid = "my-env"\nweight = 0.5\nargs = { s = "it\'s a \\\\ and a \\"", n = [1, 2.5e-3], '
        "on = true, sub = { max_turns = 5 } }\n"
        '[orchestrator.sampling]\nstop = ["</a>", "\\n"]\nextra_body = { top_k = 5 }\n'
    )
    cfg = compose(toml_recipes.expand(["@", write(tmp_path, "v.toml", text)], {}), resolve=False)
    entry = cfg.orchestrator.env[0]
    assert (entry.id, entry.ratio) == ("my-env", 0.5)
    assert OmegaConf.to_container(entry.args) == {
        "s": "it's a \\ and a \"",
        "n": [1, 2.5e-3],
        "on": True,
        "sub": {"max_turns": 5},
    }
    assert list(cfg.orchestrator.sampling.stop) == ["</a>", "\n"] and cfg.orchestrator.sampling.extra_body.top_k == 5


def test_precedence_defaults_then_variables_then_files_in_order_then_the_command_line(tmp_path):
    a = write(tmp_path, "a.toml", "max_steps = 10\n[orchestrator]\nbatch_size = 32\n")
    b = write(tmp_path, "b.toml", "max_steps = 20\n")
    env = {"PRIME_MAX_STEPS": "5", "PRIME_ORCHESTRATOR__BATCH_SIZE": "16", "PRIME_MODEL__NAME": "Qwen/Qwen3-4B"}

    def run(words: list[str], environ: dict | None = None):
        return compose(toml_recipes.expand(words, environ or {}), resolve=False)

    cfg = run(["+experiment=reverse_text", "@", a])
    assert (cfg.max_steps, cfg.orchestrator.batch_size) == (10, 32)  # the file over the experiment's 350, 64
    assert run(["@", a, "@", b]).max_steps == 20  # the later file wins
    assert run(["@", b, "@", a]).max_steps == 10
    assert run(["max_steps=30", "@", a, "@", b]).max_steps == 30  # the command line wins, wherever it stands
    cfg = run(["@", b], env)
    assert (cfg.max_steps, cfg.orchestrator.batch_size, cfg.model.name) == (20, 16, "Qwen/Qwen3-4B")  # var < file
    cfg = run(["+experiment=reverse_text"], env)
    assert (cfg.max_steps, cfg.orchestrator.batch_size) == (5, 16)  # variables over the experiment's defaults
    assert run(["model.name=Qwen/Qwen3-32B", "@", b], env).model.name == "Qwen/Qwen3-32B"


def test_other_prime_variables_are_not_config():
    env = {"PRIME_API_KEY": "k", "PRIME_HPC_CONF_DIR": "/x", "PRIME_HPC_COMPOSE_CACHE": "0", "PRIME_ENV": "prod"}
    assert toml_recipes.expand(["max_steps=3"], env) == ["max_steps=3"]


def test_prime_log_level_is_log_levels_fallback(tmp_path):
    def level(words: list[str], environ: dict) -> tuple[str, str]:
        cfg = compose(toml_recipes.expand(words, environ))
        return cfg.log.level, cfg.trainer.log.level

    assert level([], {"PRIME_LOG_LEVEL": "DEBUG"}) == ("debug", "debug")
    assert level([], {}) == ("info", "info")
    assert level(["log.level=error"], {"PRIME_LOG_LEVEL": "debug"})[0] == "error"
    assert level([], {"PRIME_LOG_LEVEL": "debug", "PRIME_LOG__LEVEL": "warning"})[0] == "warning"
    toml = write(tmp_path, "l.toml", '[log]\nlevel = "error"\n')
    assert level(["@", toml], {"PRIME_LOG_LEVEL": "debug"})[0] == "error"
    with pytest.raises(UserError, match=r"^\$PRIME_LOG_LEVEL='loud': prime-hpc has no such log level; choose from"):
        toml_recipes.expand([], {"PRIME_LOG_LEVEL": "loud"})


@pytest.mark.parametrize("value", ["WARN", "warn", "Warning", "WARNING"])
def test_the_references_warn_is_warning_in_any_case(tmp_path, value):
    assert compose(toml_recipes.expand([], {"PRIME_LOG_LEVEL": value})).log.level == "warning"
    toml = write(tmp_path, "l.toml", f'[log]\nlevel = "{value}"\n[orchestrator.log]\nvf_level = "{value}"\n')
    cfg = compose(toml_recipes.expand(["@", toml], {}))
    assert (cfg.log.level, cfg.orchestrator.log.vf_level) == ("warning", "warning")


@pytest.mark.parametrize("value", ["CRITICAL", "trace", "Success"])
def test_a_level_prime_hpc_lacks_is_refused_only_where_it_is_used(tmp_path, value):
    """TRACE, SUCCESS and CRITICAL name no prime-hpc level: refused in one line when
    `$PRIME_LOG_LEVEL` would set log.level, unread (no error) when something else sets it."""
    env = {"PRIME_LOG_LEVEL": value}
    with pytest.raises(UserError) as e:
        toml_recipes.expand(["max_steps=3"], env)
    assert str(e.value).startswith(f"$PRIME_LOG_LEVEL={value!r}: prime-hpc has no such log level")
    assert "\n" not in str(e.value)
    assert compose(toml_recipes.expand(["log.level=error"], env)).log.level == "error"
    toml = write(tmp_path, "l.toml", '[log]\nlevel = "debug"\n')
    assert compose(toml_recipes.expand(["@", toml], env)).log.level == "debug"
    bad = write(tmp_path, "b.toml", f'[log]\nlevel = "{value}"\n')
    with pytest.raises(UserError, match=f"^{bad}: log.level={value!r}: prime-hpc has no such log level"):
        toml_recipes.expand(["@", bad], {})


@pytest.mark.parametrize(
    "text,words",
    [
        (
            '[renderer]\nname = "prime-qwen3"\n',
            "renderer.name has no prime-hpc counterpart: a classic env's turns are tokenized with the model's own chat template",
        ),
        ("[orchestrator]\nrollouts_per_exampel = 8\n", "nearest known key: orchestrator.rollouts_per_example"),
        ('[[orchestrator.env]]\nid = "x"\nwieght = 2\n', "orchestrator.env[0].wieght has no prime-hpc counterpart"),
        ("ckpt = 3\n", "ckpt is a table ([ckpt]) or true/false"),
        ("max_steps = \n", "not valid TOML"),
    ],
    ids=["unknown-table", "typo", "env-entry", "section-value", "bad-toml"],
)
def test_a_key_with_no_counterpart_is_refused_naming_the_file_and_key(tmp_path, text, words):
    path = write(tmp_path, "bad.toml", text)
    with pytest.raises(UserError) as e:
        toml_recipes.expand(["@", path], {})
    assert str(e.value).startswith(f"{path}: ") and words in str(e.value)


def test_an_unknown_variable_is_refused_naming_it():
    with pytest.raises(UserError, match=r"^PRIME_ORCHESTRATOR__BATCHSIZE: orchestrator.batchsize has no .*batch_size"):
        toml_recipes.expand([], {"PRIME_ORCHESTRATOR__BATCHSIZE": "8"})


def test_submit_dry_run_takes_a_recipe_and_refuses_a_bad_one(tmp_path):
    recipe = write(tmp_path, "rl.toml", RL_RECIPE)
    out = tmp_path / "run"
    r = cli("submit", "--dry-run", "@", recipe, f"output_dir={out}", "max_steps=7")
    assert r.returncode == 0, r.stderr
    written = OmegaConf.load(out / "config.yaml")
    assert (written.max_steps, written.orchestrator.group_size, written.seq_len) == (7, 8, 80)
    bad = write(tmp_path, "bad.toml", RL_RECIPE + "\n[renderer]\nname = 'prime-qwen3'\n")
    out2 = tmp_path / "run2"
    r = cli("submit", "--dry-run", "@", bad, f"output_dir={out2}")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"prime-hpc: error: {bad}: renderer.name has no prime-hpc counterpart: ")
    assert lines[0].endswith("(nearest prime-hpc key: orchestrator.trajectory_strategy)")
    assert not out2.exists()
    r = cli("submit", "--dry-run", "@", str(tmp_path / "none.toml"), f"output_dir={out2}")
    assert r.returncode == 2 and "none.toml: no such file" in r.stderr and not out2.exists()
    r = cli("submit", "--bench", "@", recipe, "--cfg", "job")  # `--bench` takes no file for its part
    assert r.returncode == 0 and "\nmax_steps: 350\n" in r.stdout, r.stderr
    # a value the rules refuse: the line names prime-hpc's key, and the file's key that set it
    odd = write(tmp_path, "odd.toml", RL_RECIPE.replace("batch_size = 64", "batch_size = 60"))
    r = cli("submit", "--dry-run", "@", odd, f"output_dir={out2}")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("prime-hpc: error: orchestrator.batch_size: 60 is not a multiple")
    assert r.stderr.strip().endswith(f"(from {odd}: orchestrator.batch_size)") and not out2.exists()
    r = cli("submit", "--dry-run", "@", odd, f"output_dir={out2}", "orchestrator.batch_size=61")
    assert r.returncode == 2 and "61 is not a multiple" in r.stderr and "(from" not in r.stderr  # the command line's


def test_the_cli_imports_the_recipe_module_only_when_asked():
    code = (
        "import os, sys\n"
        "from prime_hpc.cli import with_recipes\n"
        "assert with_recipes(['max_steps=3']) == ['max_steps=3']\n"
        "print('toml_recipes' in str(sorted(sys.modules)))\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("PRIME_") or k.startswith("PRIME_HPC")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr


def test_the_docs_table_is_the_mapping():
    docs = (REPO / "docs" / "configuration.md").read_text()
    assert toml_recipes.table_markdown() in docs


def test_every_prime_hpc_key_of_the_table_is_in_the_schema():
    from prime_hpc.config.schema import RunConfig

    keys = flat(OmegaConf.structured(RunConfig)).keys()
    missing = [t for t, _ in toml_recipes.MAPPING.values() if not any(k == t or k.startswith(t + ".") for k in keys)]
    assert not missing, missing


def test_a_table_given_turns_its_feature_on_and_false_turns_it_off(tmp_path):
    def cfg(text: str):
        return compose(toml_recipes.expand(["@", write(tmp_path, "f.toml", text)], {}), resolve=False)

    on = cfg("[ckpt]\n[wandb]\n[trainer.model.lora]\n")
    assert on.ckpt.enabled and on.wandb.enabled and on.trainer.model.lora.enabled
    assert not cfg("max_steps = 3\n").ckpt.enabled
    assert not compose(
        toml_recipes.expand(["+experiment=reverse_text_sft", "@", write(tmp_path, "g.toml", "ckpt = false\n")], {}),
        resolve=False,
    ).ckpt.enabled
    sft = cfg("[trainer.ckpt]\ninterval = 5\nresume_step = -1\n")
    assert (sft.ckpt.enabled, sft.ckpt.interval, sft.ckpt.step) == (True, 5, -1)


def test_a_variables_value_is_read_as_toml_where_it_is_one():
    cfg = compose(
        toml_recipes.expand(
            [],
            {
                "PRIME_WANDB__NAME": "2024-01-01",  # a TOML date: kept as text
                "PRIME_TRAINER__OPTIM__LR": "3e-6",
                "PRIME_ORCHESTRATOR__SAMPLING__STOP": '["</a>"]',
            },
        ),
        resolve=False,
    )
    assert (cfg.wandb.name, cfg.trainer.optim.lr, list(cfg.orchestrator.sampling.stop)) == (
        "2024-01-01",
        3e-6,
        ["</a>"],
    )
    assert cfg.wandb.enabled  # a key of [wandb] given: the table is there


def test_the_kl_penalty_table_sets_the_adapted_penalty_toward_the_initial_policy(tmp_path):
    """`[kl_penalty]` as the reference's docs show it: `beta` the starting coefficient of the
    penalty toward the initial policy, `target_kl` the KL its adaptation aims at."""
    text = "[kl_penalty]\nbeta = 0.1\ntarget_kl = 0.01\n"
    cfg = compose(toml_recipes.expand(["@", write(tmp_path, "kl.toml", text)], {}), resolve=False)
    assert (cfg.trainer.loss.ref_kl_coef, cfg.trainer.loss.target_kl) == (0.1, 0.01)


def test_weights_only_snapshots_as_the_reference_writes_them(tmp_path):
    text = "[ckpt]\nweights_only = true\n\n[ckpt.weights]\ninterval = 5\nkeep_last = 2\n"
    cfg = compose(toml_recipes.expand(["@", write(tmp_path, "w.toml", text)], {}), resolve=False)
    assert cfg.ckpt.enabled and cfg.ckpt.weights_only
    assert (cfg.ckpt.weights.interval, cfg.ckpt.weights.keep_last) == (5, 2)


def recipe(tmp_path: Path, text: str, *words: str):
    return compose(toml_recipes.expand(["@", write(tmp_path, "r.toml", text), *words], {}), resolve=False)


def refused(tmp_path: Path, text: str) -> str:
    path = write(tmp_path, "bad.toml", text)
    with pytest.raises(UserError) as e:
        toml_recipes.expand(["@", path], {})
    assert "\n" not in str(e.value) and str(e.value).startswith(f"{path}: ")
    return str(e.value)[len(path) + 2 :]


@pytest.mark.parametrize("key", ["max_async_level", "orchestrator.max_async_level", "trainer.max_async_level"])
def test_the_references_async_level_counts_from_zero_prime_hpcs_from_one(tmp_path, key):
    """The reference's max_async_level 0 waits for the policy just before each step (prime-hpc's
    async_level=1, "fully on-policy"); 1 lets generation run one step ahead (prime-hpc's 2)."""
    section, _, name = key.rpartition(".")
    for theirs, ours in ((0, 1), (1, 2), (3, 4)):
        text = (f"[{section}]\n" if section else "") + f"{name} = {theirs}\n"
        assert recipe(tmp_path, text).async_level == ours
    assert "whole number of steps >= 0" in refused(tmp_path, "max_async_level = -1\n")
    assert "whole number of steps >= 0" in refused(tmp_path, "max_async_level = true\n")


def test_gpu_ids_name_the_groups_gpus(tmp_path):
    cfg = recipe(tmp_path, "inference_gpu_ids = [0, 1, 2]\ntrainer_gpu_ids = [3]\n", "cluster.device=cuda")
    assert (cfg.cluster.inference.gpu_ids, cfg.cluster.inference.gpus_per_node) == ("0,1,2", 3)
    assert (cfg.cluster.trainer.gpu_ids, cfg.cluster.trainer.gpus_per_node) == ("3", 1)
    assert "a list of GPU ids" in refused(tmp_path, 'inference_gpu_ids = "0,1"\n')
    assert "a list of GPU ids" in refused(tmp_path, "trainer_gpu_ids = []\n")


def test_the_gpu_check_names_the_reference_key_that_set_the_ids(tmp_path):
    """Overlapping ids (the reference's single-GPU layout) are refused by the rules, naming
    prime-hpc's key and the file's key."""
    path = write(tmp_path, "g.toml", "inference_gpu_ids = [0]\ntrainer_gpu_ids = [0]\n")
    r = cli("submit", "--dry-run", "@", path, "cluster.device=cuda", f"output_dir={tmp_path / 'run'}")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "cluster.trainer.gpu_ids" in r.stderr and "cluster.share_gpus=true" in r.stderr
    assert r.stderr.strip().endswith(f"(from {path}: trainer_gpu_ids)")


def test_a_slurm_table_sends_the_job_to_slurm_with_its_partition_account_time_exclude(tmp_path):
    text = '[slurm]\npartition = "gpu"\naccount = "lab"\ntime = "7-00:00:00"\nexclude = "n[1-2]"\n'
    c = recipe(tmp_path, text).cluster
    assert (c.backend, c.partition, c.account, c.time, c.exclude) == ("slurm", "gpu", "lab", "7-00:00:00", "n[1-2]")
    assert recipe(tmp_path, "[slurm]\n").cluster.backend == "slurm"
    assert recipe(tmp_path, "max_steps = 3\n").cluster.backend == "local"
    for key, near in (("job_name", "name"), ("nodelist", "cluster.exclude"), ("template_path", "cluster.sbatch_extra")):
        msg = refused(tmp_path, f'[slurm]\n{key} = "x"\n')
        assert msg.startswith(f"slurm.{key} has no prime-hpc counterpart: ") and msg.endswith(f"key: {near})")


@pytest.mark.parametrize(
    "text,schedule,warmup",
    [
        ('type = "constant"\n', "constant", 0),
        ('type = "cosine"\n', "cosine", 10),  # the reference's default warm-up
        ('type = "cosine"\nwarmup_steps = 5\nmin_lr = 0.0\n', "cosine", 5),
        ('type = "linear"\nwarmup_steps = 4\ndecay_steps = 0\n', "constant", 4),  # warm-up, then constant
        ('type = "linear"\nwarmup_steps = 20\ndecay_steps = 80\n', "linear", 20),  # decays over the rest
    ],
)
def test_the_trainer_scheduler_table_is_prime_hpcs_schedule(tmp_path, text, schedule, warmup):
    o = recipe(tmp_path, f"max_steps = 100\n[trainer.scheduler]\n{text}").trainer.optim
    assert (o.schedule, o.warmup_steps, o.min_lr_ratio) == (schedule, warmup, 0.0)
    o = recipe(tmp_path, f"max_steps = 100\n[data]\nname = 'x'\n[scheduler]\n{text}").trainer.optim  # sft's layout
    assert (o.schedule, o.warmup_steps) == (schedule, warmup)


@pytest.mark.parametrize(
    "text,words",
    [
        ('type = "linear"\nwarmup_steps = 10\ndecay_steps = 10\n', "trainer.scheduler.decay_steps has no prime-hpc"),
        ('type = "linear"\n', "trainer.scheduler.decay_steps has no prime-hpc"),  # its default 10 of 100
        ('type = "cosine"\nmin_lr = 1e-7\n', "trainer.scheduler.min_lr has no prime-hpc counterpart: "),
        ('type = "step"\n', "trainer.scheduler.type is one of constant, cosine, linear, not 'step'"),
        ('type = "constant"\nwarmup_steps = 3\n', "trainer.scheduler.warmup_steps has no prime-hpc counterpart"),
    ],
    ids=["wsd", "wsd-default", "min-lr", "type", "constant-warmup"],
)
def test_a_schedule_prime_hpc_has_not_is_refused_saying_why(tmp_path, text, words):
    assert words in refused(tmp_path, f"max_steps = 100\n[trainer.scheduler]\n{text}")


def test_the_processes_wandb_extras_are_the_one_runs(tmp_path):
    text = (
        "[orchestrator.wandb.log_extras]\ninterval = 50\nsample_ratio = 0.5\n"
        "[trainer.wandb.log_extras]\ninterval = 7\ndistributions = false\n"
    )
    w = recipe(tmp_path, text).wandb
    assert w.enabled and (w.log_extras.interval, w.log_extras.sample_ratio) == (50, 0.5)
    assert (w.log_extras.trainer.interval, w.log_extras.trainer.distributions) == (7, False)
    msg = refused(tmp_path, '[orchestrator.wandb]\nproject = "p"\n')
    assert msg.startswith("orchestrator.wandb.project has no prime-hpc counterpart: prime-hpc logs trainer and ")
    assert msg.endswith("(nearest prime-hpc key: wandb.project)")
    assert "(nearest prime-hpc key: wandb.log_extras.samples)" in refused(
        tmp_path, "[trainer.wandb.log_extras]\nsamples = true\n"
    )


def test_enabled_switches_the_difficulty_filter_and_the_kl_penalty(tmp_path):
    on = recipe(tmp_path, "[difficulty_filter]\nenabled = true\nmin_reward_variance = 0.1\nmax_reward = 0.95\n")
    f = on.orchestrator
    assert f.online_difficulty_filtering and f.difficulty_filter.min_reward_variance == 0.1
    assert f.difficulty_filter.max_reward == 0.95
    off = recipe(tmp_path, "[difficulty_filter]\nenabled = false\nmin_reward_variance = 0.1\n").orchestrator
    assert not off.online_difficulty_filtering and off.difficulty_filter.min_reward_variance == 0.0
    loss = recipe(tmp_path, "[kl_penalty]\nenabled = true\nbeta = 0.1\ntarget_kl = 0.01\n").trainer.loss
    assert (loss.ref_kl_coef, loss.target_kl) == (0.1, 0.01)
    loss = recipe(tmp_path, "[kl_penalty]\nenabled = false\nbeta = 0.1\ntarget_kl = 0.01\n").trainer.loss
    assert (loss.ref_kl_coef, loss.target_kl) == (0.0, None)
    assert "kl_penalty.enabled is true or false" in refused(tmp_path, '[kl_penalty]\nenabled = "yes"\n')


def test_sft_data_type_and_mixing_keys(tmp_path):
    text = (
        "[data]\nname = 'org/set'\ntype = 'sft'\nsubsets = ['a', 'b']\nsplits = ['train', 'test']\n"
        "probabilities = [0.7, 0.3]\n[val.data]\nname = 'org/set'\nsplits = ['validation']\n"
    )
    cfg = recipe(tmp_path, text)
    d = cfg.trainer.data
    assert cfg.trainer.type == "sft" and (list(d.subsets), list(d.splits), list(d.probabilities)) == (
        ["a", "b"],
        ["train", "test"],
        [0.7, 0.3],
    )
    assert list(cfg.trainer.val.data.splits) == ["validation"]
    msg = refused(tmp_path, "[data]\ntype = 'fake'\n")
    assert msg.startswith("data.type = 'fake' has no prime-hpc counterpart: ") and msg.endswith("key: bench.mode)")


def test_the_docs_list_what_is_refused():
    assert toml_recipes.refused_markdown() in (REPO / "docs" / "configuration.md").read_text()


def test_a_one_part_variable_says_whether_it_was_applied(capsys):
    """`PRIME_MODEL` (a run-level key) is applied, saying so in one line; `PRIME_MAX_STEP`
    (no such key) is not, with a one-line warning naming the nearest; the toolkit's own
    variables are never mentioned."""
    env = {
        "PRIME_MODEL": "Qwen/Qwen3-4B",
        "PRIME_OUTPUT_DIR": "outputs/x",
        "PRIME_MAX_STEP": "5",
        "PRIME_WANDB": "true",
        "PRIME_API_KEY": "k",
        "PRIME_HPC_CONF_DIR": "/x",
        "PRIME_LOG_LEVEL": "info",
    }
    words = toml_recipes.expand([], env)
    cfg = compose(words, resolve=False)
    assert (cfg.model.name, cfg.output_dir) == ("Qwen/Qwen3-4B", "outputs/x")
    assert cfg.max_steps is None and not cfg.wandb.enabled
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 4, err
    assert "prime-hpc: PRIME_MODEL=Qwen/Qwen3-4B applied: model.name=" in err[1]
    assert err[0].startswith("prime-hpc: warning: PRIME_MAX_STEP is not applied: ") and "PRIME_MAX_STEPS" in err[0]
    assert err[0].endswith("(max_steps)")
    assert err[2].startswith("prime-hpc: PRIME_OUTPUT_DIR=outputs/x applied: output_dir=")
    assert err[3].startswith("prime-hpc: warning: PRIME_WANDB is not applied: wandb is a table")
    assert not any("API_KEY" in line or "PRIME_HPC" in line or "LOG_LEVEL" in line for line in err)


def eval_server_cfg(monkeypatch) -> dict:
    """What `prime-hpc eval ... --here` would serve and score (the server is not started)."""
    from prime_hpc.orchestrator import evaluate

    seen: dict = {}

    def server(cfg, edir, cache):
        seen.update(cfg=cfg, edir=edir.root)
        raise SystemExit(3)

    monkeypatch.setattr(evaluate, "eval_server", server)
    return seen


def test_eval_takes_a_recipe_as_submit_does(tmp_path, monkeypatch):
    """`eval @ rl.toml`: the config submit would compose from the recipe, scored on its eval
    envs with its k and n; the command line's model= and env= win over the recipe's."""
    from prime_hpc.cli import main

    monkeypatch.chdir(tmp_path)
    seen = eval_server_cfg(monkeypatch)
    path = write(
        tmp_path, "rl.toml", RL_RECIPE.replace("[orchestrator.eval]\n", "[orchestrator.eval]\nnum_examples = 9\n")
    )
    with pytest.raises(SystemExit):
        main(["eval", "--here", "@", path, "orchestrator.sampling.temperature=0.5"])
    cfg = seen["cfg"]
    assert (cfg.model.name, cfg.seq_len, cfg.orchestrator.sampling.max_tokens) == ("tiny", 80, 32)
    assert [e.id for e in cfg.orchestrator.eval.env] == [
        "reverse_text"
    ] and cfg.orchestrator.sampling.temperature == 0.5
    assert (cfg.orchestrator.eval.rollouts_per_example, cfg.orchestrator.eval.num_examples) == (4, 9)
    assert seen["edir"].parent == tmp_path / "outputs" / "eval" and seen["edir"].name.startswith("tiny-")
    out = tmp_path / "mine"
    with pytest.raises(SystemExit):
        main(
            [
                "eval",
                f"@{path}",
                "model=other",
                "env=reverse-text",
                "args.reverse-text.max_len=4",
                f"out={out}",
                "--here",
            ]
        )
    cfg = seen["cfg"]
    assert cfg.model.name == "other" and seen["edir"] == out
    assert [(e.id, dict(e.args)) for e in cfg.orchestrator.eval.env] == [("reverse-text", {"max_len": 4})]


def test_eval_refuses_a_bad_recipe_as_submit_does(tmp_path, monkeypatch, capsys):
    from prime_hpc.cli import main

    monkeypatch.chdir(tmp_path)
    eval_server_cfg(monkeypatch)
    bad = write(tmp_path, "bad.toml", RL_RECIPE + "\n[renderer]\nname = 'qwen3'\n")
    for argv in (["eval", "@", bad], ["submit", "--dry-run", "@", bad]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"prime-hpc: error: {bad}: renderer.name has no prime-hpc"), err
    no_eval = write(tmp_path, "t.toml", "[model]\nname = 'tiny'\n[[orchestrator.env]]\nid = 'reverse_text'\n")
    assert main(["eval", "@", no_eval]) == 2
    err = capsys.readouterr().err.strip()
    assert "the recipe names no envs (orchestrator.eval.env is empty); give env=" in err and "\n" not in err
    run = tmp_path / "run"
    run.mkdir()
    assert main(["eval", str(run), "@", no_eval]) == 2
    err = capsys.readouterr().err.strip()
    assert f"eval {run} takes overrides of the run's recorded config, not a recipe" in err and "\n" not in err
    assert not (tmp_path / "outputs").exists()


def test_synthesize_takes_a_recipe_as_submit_does(tmp_path, monkeypatch):
    """`synthesize @ rl.toml`: the recipe's model on its training envs (with their args)."""
    from prime_hpc.cli import main
    from prime_hpc.orchestrator import synthesize

    seen: dict = {}

    def here(cfg, opts, name, out, k, n, min_reward, key):
        seen.update(cfg=cfg, name=name, out=out, k=k)
        raise SystemExit(3)

    monkeypatch.setattr(synthesize, "synthesize_here", here)
    text = RL_RECIPE.replace(
        '[[orchestrator.env]]\nid = "reverse_text"\n', '[[orchestrator.env]]\nid = "reverse_text"\nargs = { n = 3 }\n'
    )
    path = write(tmp_path, "rl.toml", text)
    with pytest.raises(SystemExit):
        main(["synthesize", "@", path, "rollouts=2", f"out={tmp_path / 'syn'}", "--here"])
    cfg = seen["cfg"]
    assert seen["name"] == "tiny" and seen["k"] == 2 and seen["out"] == tmp_path / "syn" and cfg.seq_len == 80
    assert [(e.id, dict(e.args)) for e in cfg.orchestrator.env] == [("reverse_text", {"n": 3})]


def test_serve_takes_a_recipe_but_not_its_runs_directory(tmp_path, monkeypatch):
    """`serve @ rl.toml`: the recipe's model with its inference settings, in serve's own
    directory (the recipe's output_dir is its training run's); the command line's wins."""
    from prime_hpc.cli import main
    from prime_hpc.inference.client import API_KEY_VAR
    from prime_hpc.launcher import launch

    seen: list = []

    def submit(cfg, overrides):
        seen.append(cfg)
        raise SystemExit(3)

    monkeypatch.setattr(launch, "submit", submit)
    monkeypatch.setenv(API_KEY_VAR, "secret")
    path = write(tmp_path, "rl.toml", f"output_dir = '{tmp_path / 'train'}'\n" + RL_RECIPE)
    for words, where in (([], "outputs/serve-tiny"), ([f"output_dir={tmp_path / 's'}"], str(tmp_path / "s"))):
        with pytest.raises(SystemExit):
            main(["serve", "@", path, *words])
        cfg = seen.pop()
        assert (cfg.model.name, cfg.inference.gpu_memory_utilization, cfg.output_dir) == ("tiny", 0.2, where)
