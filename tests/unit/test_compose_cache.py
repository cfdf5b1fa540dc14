"""The per-user composition cache: a cached composition is the one Hydra makes, and anything
it depends on (config tree, environment at resolve time, the file's trust) is honoured."""

from __future__ import annotations

import importlib
import os
import pickle
import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from prime_hpc.config import compose_cache
from prime_hpc.config.compose import compose
from prime_hpc.config.dump import to_yaml
from prime_hpc.core.errors import ConfigError
from tests.conftest import REPO

compose_module = importlib.import_module("prime_hpc.config.compose")  # the module, not the function


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("PRIME_HPC_COMPOSE_CACHE", raising=False)
    return tmp_path / "xdg" / "prime-hpc" / "compose"


def no_hydra(monkeypatch):
    def fail(*_a, **_k):
        raise AssertionError("composed with Hydra although the composition was cached")

    monkeypatch.setattr(compose_module, "_compose_hydra", fail)


def test_a_cached_composition_is_hydras(cache, tmp_path, monkeypatch):
    overrides = ["+experiment=reverse_text", f"output_dir={tmp_path}/run", "trainer.optim.lr=3e-6"]
    monkeypatch.setenv("PRIME_HPC_COMPOSE_CACHE", "0")
    reference = compose(overrides)
    monkeypatch.delenv("PRIME_HPC_COMPOSE_CACHE")
    first = compose(overrides)
    assert len(list(cache.glob("*.pkl"))) == 1
    no_hydra(monkeypatch)
    again = compose(overrides)
    assert to_yaml(again) == to_yaml(first) == to_yaml(reference)
    assert again.trainer.optim.lr == 3e-6
    with pytest.raises(ValidationError):  # still on the typed schema
        again.max_steps = "many"


def test_the_cache_is_the_users_own(cache, tmp_path):
    compose([f"output_dir={tmp_path}/run"])
    assert (cache.stat().st_mode & 0o777) == 0o700
    assert all((p.stat().st_mode & 0o777) == 0o600 for p in cache.glob("*.pkl"))


def test_interpolations_resolve_in_the_current_environment(cache, tmp_path, monkeypatch):
    overrides = ["output_dir=run"]  # relative: made absolute where the command runs
    monkeypatch.setenv("PRIME_HPC_CACHE", str(tmp_path / "a"))
    monkeypatch.chdir(tmp_path)
    first = compose(overrides)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    monkeypatch.setenv("PRIME_HPC_CACHE", str(tmp_path / "b"))
    no_hydra(monkeypatch)
    again = compose(overrides)
    assert first.cluster.cache_dir == str(tmp_path / "a") and again.cluster.cache_dir == str(tmp_path / "b")
    assert first.output_dir == str(tmp_path / "run") and again.output_dir == str(tmp_path / "elsewhere" / "run")


def test_a_changed_config_tree_composes_anew(cache, tmp_path, monkeypatch):
    conf = tmp_path / "conf"
    shutil.copytree(REPO / "conf", conf)
    monkeypatch.setenv("PRIME_HPC_CONF_DIR", str(conf))
    overrides = ["+experiment=reverse_text", f"output_dir={tmp_path}/run"]
    before = compose(overrides).max_steps
    exp = conf / "experiment" / "reverse_text.yaml"
    text = exp.read_text()
    assert f"max_steps: {before}" in text
    exp.write_text(text.replace(f"max_steps: {before}", f"max_steps: {before + 7}"))
    assert compose(overrides).max_steps == before + 7
    assert len(list(cache.glob("*.pkl"))) == 2


def test_the_key_covers_every_module_a_composition_loads(tmp_path):
    """A change to any code a composition runs (the schema, its vocabularies, the walker that
    refuses unknown keys) composes anew: every module of the package it imports is hashed."""
    import subprocess
    import sys

    probe = (
        "import sys; from prime_hpc.config.compose import compose; "
        f"compose(['+experiment=reverse_text', 'output_dir={tmp_path}/run']); "
        "print('\\n'.join(m.__file__ for n, m in sys.modules.items() if n.startswith('prime_hpc')))"
    )
    env = {**os.environ, "PRIME_HPC_COMPOSE_CACHE": "0", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout
    package = REPO / "prime_hpc"
    loaded = {str(Path(f).relative_to(package)) for f in out.split()}
    assert "config/schema.py" in loaded and "config/walk.py" in loaded
    assert loaded <= set(compose_cache._CODE), (
        f"not in compose_cache._CODE: {sorted(loaded - set(compose_cache._CODE))}"
    )


def test_errors_come_from_hydra_and_are_not_cached(cache, tmp_path):
    for _ in range(2):
        with pytest.raises(ConfigError, match="max_stepz"):
            compose([f"output_dir={tmp_path}/run", "+max_stepz=3"])
    assert not list(cache.glob("*.pkl"))


@pytest.mark.parametrize("spoil", ["group-writable", "truncated", "not a config"])
def test_a_spoiled_or_foreign_entry_is_never_loaded(cache, tmp_path, monkeypatch, spoil):
    overrides = [f"output_dir={tmp_path}/run", "max_steps=11"]
    compose(overrides)
    (entry,) = cache.glob("*.pkl")
    if spoil == "group-writable":
        os.chmod(entry, 0o664)
    elif spoil == "truncated":
        entry.write_bytes(entry.read_bytes()[:100])
    else:
        entry.write_bytes(pickle.dumps({"max_steps": 99}))
    assert compose_cache.load(entry) is None
    assert compose(overrides).max_steps == 11  # composed again by Hydra


def test_switched_off_it_neither_reads_nor_writes(cache, tmp_path, monkeypatch):
    monkeypatch.setenv("PRIME_HPC_COMPOSE_CACHE", "0")
    compose([f"output_dir={tmp_path}/run"])
    assert not cache.exists()


def test_yaml_reads_back_as_written():
    """The libyaml writer keeps OmegaConf's rule: a string that would read back as another
    type is quoted."""
    data = {
        "a": "true",
        "b": "1",
        "c": "1e-3",
        "d": "off",
        "e": "text with: colon",
        "f": "ünï",
        "g": 1e-06,
        "h": None,
        "i": [1, "2"],
        "j": "two\nlines",
        "k": "${x.y}",
        "l": "",
    }
    text = to_yaml(data)
    assert text == OmegaConf.to_yaml(OmegaConf.create(data))
    assert OmegaConf.to_container(OmegaConf.create(text)) == data


CHANGES = [
    ["output_dir=/x/run", "trainer.optim.lr=3e-6", "max_steps=7", "name='my run'", "seed=-3"],
    ["orchestrator.sampling.temperature=1", "wandb.enabled=True", "max_steps='12'", "ckpt.interval=null"],
    ["model.name=/models/a-b.c", "trainer.optim.lr=.5", "cluster=dev", "orchestrator.batch_size=16"],
    ["trainer.optim.lr=2e-5", "trainer.optim={lr: 1.0e-3}"],  # one key twice: Hydra's order
    ["warmup.experiment=null", "output_dir='/x/run/warmup'", "name=x_warmup", "async_level=1"],
]


@pytest.mark.parametrize("changes", CHANGES, ids=range(len(CHANGES)))
def test_plain_changes_apply_to_the_cached_composition_as_hydra_applies_them(cache, monkeypatch, changes):
    overrides = ["+experiment=reverse_text", *changes]
    monkeypatch.setenv("PRIME_HPC_COMPOSE_CACHE", "0")
    reference = compose(overrides, resolve=False)
    monkeypatch.delenv("PRIME_HPC_COMPOSE_CACHE")
    compose(["+experiment=reverse_text", *(c for c in changes if c.startswith("cluster="))])  # the shape, cached
    if all("{" not in c for c in changes):
        no_hydra(monkeypatch)  # plain changes of a cached shape: no Hydra at all
    assert to_yaml(compose(overrides, resolve=False), resolve=False) == to_yaml(reference, resolve=False)


@pytest.mark.parametrize(
    "bad, needle", [("max_steps=many", "max_steps"), ("max_stepz=3", "max_stepz"), ("trainer.optim=3", "trainer.optim")]
)
def test_a_change_that_does_not_apply_gets_hydras_error(cache, monkeypatch, bad, needle):
    overrides = ["+experiment=reverse_text", bad]
    compose(["+experiment=reverse_text"])  # the shape, cached
    with pytest.raises(ConfigError) as cached_error:
        compose(overrides)
    monkeypatch.setenv("PRIME_HPC_COMPOSE_CACHE", "0")
    with pytest.raises(ConfigError) as hydra_error:
        compose(overrides)
    assert str(cached_error.value) == str(hydra_error.value) and needle in str(hydra_error.value)


def test_a_cache_that_cannot_be_written_is_no_error(cache, tmp_path, monkeypatch):
    def refuse(*_a, **_k):
        raise PermissionError(13, "Read-only file system")

    monkeypatch.setattr(compose_cache.os, "replace", refuse)
    assert compose([f"output_dir={tmp_path}/run", "max_steps=5"]).max_steps == 5
    assert not list(cache.iterdir())  # nothing stored, no temporary file left
