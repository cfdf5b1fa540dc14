"""`prime-hpc config export JOB`: a run's recorded config as a recipe in the reference's TOML
layout that `submit @` composes back to the same config; the TOML emitter round-trips
through tomllib; `[prime_hpc]` holds the keys the layout has no counterpart of; bad input
gets one line, exit 2."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from prime_hpc.config import toml_recipes
from prime_hpc.config.compose import compose, recorded_config
from prime_hpc.core.errors import UserError
from tests.conftest import REPO, cli

# what `config export` leaves out (toml_recipes.NOT_EXPORTED): they name the run's directory
# and job, so that a recipe submitted again is a new run. The round trip gives name and
# output_dir back on the command line (job_dir: null in these runs) and then holds on every
# key, also those submit derives from output_dir (a warm-up's weights: model.name)
EXCLUDED = ("name", "output_dir", "job_dir")

CUSTOM = [
    "+experiment=reverse_text",
    "warmup.experiment=null",  # the model then is tiny, not the warm-up's output
    "trainer.model.lora.enabled=true",
    "trainer.model.lora.rank=4",
    "ckpt.interval=7",  # with checkpoints off: not under [ckpt], which would turn them on
    "wandb.enabled=true",
    'wandb.project="a\\"b c\\\\d"',
    "+orchestrator.sampling.extra_body={x:1,y:{z:q}}",
    "orchestrator.sampling.top_k=5",
    'orchestrator.sampling.stop=["</a>","b c"]',
    "seed=7",
    "inference.max_model_len=null",  # a null where the default is not: [prime_hpc] null_keys
    "orchestrator.env=[{id:reverse_text,name:rt,ratio:2.0,args:{n:3}}]",
    "trainer.loss.ref_kl_coef=0.01",
]


def leaves(cfg) -> dict:
    return toml_recipes.flat_leaves(OmegaConf.to_container(cfg, resolve=True))


def dry_run(tmp_path: Path, name: str, *overrides: str) -> Path:
    out = tmp_path / name
    r = cli("submit", "--dry-run", f"output_dir={out}", *overrides)
    assert r.returncode == 0, r.stderr
    return out


def round_trip(run: Path, tmp_path: Path) -> tuple[dict, dict, str]:
    from prime_hpc.cli.config import export_text
    from prime_hpc.config.pipeline import compose_stages

    text = export_text(str(run))
    path = tmp_path / f"{run.name}.toml"
    path.write_text(text)
    want = leaves(recorded_config(run / "config.yaml"))  # as resume reads it
    back = [f"output_dir={run}", f"name={want['name']}"]
    got = leaves(compose_stages(toml_recipes.expand(["@", str(path), *back], {}))[-1])  # as submit composes it
    return want, got, text


@pytest.mark.parametrize(
    "overrides",
    [["+experiment=reverse_text"], ["+experiment=reverse_text_sft"], CUSTOM],
    ids=["rl", "sft", "custom"],
)
def test_submit_at_the_export_composes_to_the_runs_config(tmp_path, overrides):
    run = dry_run(tmp_path, "run", *overrides)
    want, got, text = round_trip(run, tmp_path)
    assert got == want
    assert toml_recipes.NOT_EXPORTED == EXCLUDED
    data = tomllib.loads(text)
    assert not set(EXCLUDED) & {*data, *data.get("prime_hpc", {})}


def test_a_run_after_a_warm_up_exports_the_model_the_warm_up_trains(tmp_path):
    run = dry_run(tmp_path, "run", "+experiment=reverse_text")
    data = tomllib.loads(round_trip(run, tmp_path)[2])
    assert data["model"]["name"] == "tiny" and data["prime_hpc"]["warmup"]["experiment"] == "reverse_text_sft"
    assert "name" not in data["inference"].get("model", {}) and "tokenizer" not in data.get("trainer", {})


def test_reference_keys_in_their_section_form_the_rest_in_prime_hpc(tmp_path):
    run = dry_run(tmp_path, "run", *CUSTOM)
    _, _, text = round_trip(run, tmp_path)
    data = tomllib.loads(text)
    assert data["model"] == {"name": "tiny", "trust_remote_code": False}  # [model] name, not model = "..."
    assert data["orchestrator"]["rollouts_per_example"] == 8 and "group_size" not in data["orchestrator"]
    assert data["orchestrator"]["batch_size"] == 64 and "batch_size" not in data  # not the lab layout's
    assert data["trainer"]["optim"]["lr"] == 5e-4 and "learning_rate" not in data and "optim" not in data
    assert data["orchestrator"]["env"] == [{"id": "reverse_text", "args": {"n": 3}, "ratio": 2.0, "name": "rt"}]
    assert data["trainer"]["model"]["lora"]["rank"] == 4  # [trainer.model.lora] given: LoRA on
    assert data["ckpt"] is False and data["prime_hpc"]["ckpt"]["interval"] == 7
    assert data["wandb"]["project"] == OmegaConf.load(run / "config.yaml").wandb.project  # its escapes kept
    assert data["orchestrator"]["sampling"]["extra_body"] == {"x": 1, "y": {"z": "q"}}
    assert data["kl_penalty"]["beta"] == 0.01
    own = data["prime_hpc"]
    assert own["seed"] == 7 and own["null_keys"] == ["inference.max_model_len"]
    assert "data" not in data and "trainer" not in own.get("data", {})  # an RL run: no SFT-layout table
    assert own["trainer"]["micro_batch_size"] == 32  # only [data] micro_batch_size reaches it: SFT's layout
    assert "# [prime_hpc]" in text


def test_an_sft_run_is_written_in_the_sft_trainers_layout(tmp_path):
    run = dry_run(tmp_path, "sft", "+experiment=reverse_text_sft")
    data = tomllib.loads(round_trip(run, tmp_path)[2])
    assert data["data"]["name"] == "reverse_text:make_sft_dataset" and data["data"]["seq_len"] == 80
    assert data["optim"]["lr"] == 1e-3 and "optim" not in data.get("trainer", {})
    assert data["ckpt"] == {} or isinstance(data["ckpt"], dict)  # [ckpt] given: checkpoints on


def test_the_prime_hpc_table_takes_prime_hpc_keys_as_they_are(tmp_path):
    path = tmp_path / "own.toml"
    path.write_text(
        'max_steps = 3\n[prime_hpc]\nseed = 9\nnull_keys = ["inference.max_model_len"]\n'
        '[prime_hpc.orchestrator]\nadvantage = "opo"\n'
    )
    cfg = compose(toml_recipes.expand(["@", str(path)], {}), resolve=False)
    assert (cfg.max_steps, cfg.seed, cfg.orchestrator.advantage) == (3, 9, "opo")
    assert cfg.inference.max_model_len is None
    assert toml_recipes.origin("seed") == f"{path}: prime_hpc.seed"
    bad = tmp_path / "bad.toml"
    bad.write_text("[prime_hpc]\nsede = 9\n")
    with pytest.raises(UserError, match="sede"):
        compose(toml_recipes.expand(["@", str(bad)], {}), resolve=False)
    for text in ("prime_hpc = 3\n", "[prime_hpc]\nnull_keys = 3\n"):
        bad.write_text(text)
        with pytest.raises(UserError, match=f"{bad}: prime_hpc"):
            toml_recipes.expand(["@", str(bad)], {})


def test_the_emitter_round_trips_through_tomllib():
    tree = {
        "s": 'quote " back \\ tab \t nl \n cr \r ff \f bs \b nul \x00 del \x7f esc \x1b é 字 😀',
        "i": -3,
        "big": 2**62,
        "f": 1e-5,
        "whole": 32.0,
        "inf": float("inf"),
        "ninf": float("-inf"),
        "t": True,
        "no": False,
        "empty_list": [],
        "mixed": [1, "a", [2.5, False], {"k": "v", "n": {"m": 1}}],
        "a key.with dots": "q",
        "": "empty key",
        "sec": {"x": 1, "inner": {"deep": {"y": "z"}}, "blank": {}},
        "only_tables": {"sub": {"v": 1}},
        "arr": [{"id": "a", "args": {"n": 1, "l": [1, 2]}}, {"id": "b"}],
        "nested": {"arr": [{"q": 1}]},
    }
    text = toml_recipes.to_toml(tree)
    back = tomllib.loads(text)
    assert back == tree
    assert math.isnan(tomllib.loads(toml_recipes.to_toml({"n": float("nan")}))["n"])
    with pytest.raises(UserError, match="sec.x: null"):
        toml_recipes.to_toml({"sec": {"x": None}})


def test_the_cli_writes_the_file_and_submit_reads_it(tmp_path):
    run = dry_run(tmp_path, "run", "+experiment=reverse_text", "max_steps=12")
    out = tmp_path / "exported.toml"
    r = cli("config", "export", str(run), "--out", str(out))
    assert r.returncode == 0 and r.stdout == "", r.stderr
    assert tomllib.loads(out.read_text())["max_steps"] == 12
    r = cli("config", "export", str(run))
    assert r.returncode == 0 and r.stdout == out.read_text()
    again = tmp_path / "again"
    r = cli("submit", "--dry-run", "@", str(out), f"output_dir={again}")
    assert r.returncode == 0, r.stderr
    assert OmegaConf.load(again / "config.yaml").max_steps == 12


def one_line_exit_2(r: subprocess.CompletedProcess, *needles: str) -> None:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("prime-hpc: error: "), r.stderr
    for needle in needles:
        assert needle in lines[0], r.stderr
    assert r.stdout == ""


def test_bad_input_gets_one_line_and_exit_2(tmp_path):
    state = {"PRIME_HPC_STATE_DIR": str(tmp_path / "state")}
    one_line_exit_2(cli("config", "export", "no-such-run", env=state), "no job 'no-such-run'")
    run = dry_run(tmp_path, "run", "+experiment=reverse_text")
    cfg = run / "config.yaml"
    text = cfg.read_text()
    cfg.write_text(text.replace("seed: 42", "seed: ${oc.env:HOME}"))
    one_line_exit_2(cli("config", "export", str(run)), str(cfg), "seed holds an interpolation")
    cfg.write_text(text)
    os.chmod(cfg, 0o664)
    one_line_exit_2(cli("config", "export", str(run)), str(cfg), "writable by group or others")
    os.chmod(cfg, 0o644)
    out = tmp_path / "no-dir" / "x.toml"
    one_line_exit_2(cli("config", "export", str(run), "--out", str(out)), "--out")
    assert not out.exists()


def test_config_export_help_imports_no_config_machinery():
    code = (
        "import sys\n"
        "from prime_hpc.cli import build_parser\n"
        "build_parser('config')\n"
        "print(sorted(m for m in sys.modules if m.startswith(('omegaconf', 'hydra', 'torch', 'prime_hpc.config'))))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_keys_with_a_meaning_of_their_own_export_and_compose_back(tmp_path):
    """The async level is written as the reference counts it (prime-hpc's 1 is its 0); the
    trainer's W&B extras with W&B off and a partition with a local backend are not written in
    a table that would turn W&B or SLURM on (they go to [prime_hpc])."""
    run = dry_run(
        tmp_path,
        "run",
        "+experiment=reverse_text",
        "async_level=1",
        "wandb.log_extras.trainer.interval=3",
        "cluster.partition=gpu",
        "log.level=warning",
        "orchestrator.online_difficulty_filtering=true",
    )
    want, got, text = round_trip(run, tmp_path)
    assert got == want
    data = tomllib.loads(text)
    assert data["max_async_level"] == 0 and data["log"]["level"] == "warning"
    assert "slurm" not in data and data["wandb"] is False
    assert "wandb" not in data["trainer"] and "wandb" not in data["orchestrator"]
    assert data["prime_hpc"]["cluster"]["partition"] == "gpu"
    assert data["prime_hpc"]["wandb"]["log_extras"]["trainer"]["interval"] == 3
    assert data["orchestrator"]["buffer"]["online_difficulty_filtering"] is True


def test_an_env_setting_the_layout_has_not_keeps_the_env_list_whole_in_prime_hpc(tmp_path, monkeypatch):
    """An env entry with a setting `[[orchestrator.env]]` has no key for (here `name`, taken
    out of the layout's keys) and not at its default: the list goes to [prime_hpc] as it is."""
    run = dry_run(tmp_path, "run", "+experiment=reverse_text", "orchestrator.env=[{id:reverse_text,name:rt}]")
    monkeypatch.setattr(toml_recipes, "ENV_ENTRY", {k: v for k, v in toml_recipes.ENV_ENTRY.items() if v != "name"})
    want, got, text = round_trip(run, tmp_path)
    assert got == want
    data = tomllib.loads(text)
    assert "env" not in data["orchestrator"] and data["prime_hpc"]["orchestrator"]["env"][0]["name"] == "rt"
    assert [e["id"] for e in data["orchestrator"]["eval"]["env"]] == ["reverse_text"]  # at their defaults: the layout
