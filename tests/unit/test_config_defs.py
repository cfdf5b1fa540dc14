"""Everything about a run's config is defined once: each component's config is declared by
where its values come from in the run config (`prime_hpc.config.component`), and its
types are the schema's."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from prime_hpc.config import walk
from prime_hpc.config.component import CONFIGS, component_config, typed
from prime_hpc.config.compose import compose
from prime_hpc.config.schema import RunConfig
from prime_hpc.rundir import COMPONENTS, GROUPS
from tests.conftest import REPO

SCHEMA = {site.key: site for site in walk.schema_fields()}


def declared(cls: type, prefix: str = "") -> list[tuple[str, dataclasses.Field, object]]:
    """(key in the component's file, field, its source) of every projected field of `cls`."""
    out = []
    for f in dataclasses.fields(cls):
        if "src" not in f.metadata:
            continue
        where = f.metadata["src"]
        if where is None:
            out += declared(walk.section_type(walk.hints(cls)[f.name]), f"{prefix}{f.name}.")
        else:
            out.append((prefix + f.name, f, where))
    return out


def test_every_component_has_a_config():
    assert set(CONFIGS) == set(GROUPS)


@pytest.mark.parametrize("component", GROUPS)
def test_a_component_field_has_the_type_of_the_schema_key_it_comes_from(component):
    cls = CONFIGS[component]
    fields = declared(cls)
    assert len(fields) >= 8
    for key, f, where in fields:
        if callable(where):
            continue
        assert where in SCHEMA, f"{component}.{key}: src {where!r} is not a key of the schema"
        owner = cls if "." not in key else walk.section_at(key, cls)
        assert walk.hints(owner)[f.name] == SCHEMA[where].hint, (
            f"{component}.{key} is declared {walk.hints(owner)[f.name]}, the schema's {where} is {SCHEMA[where].hint}"
        )
    unprojected = [f.name for f in dataclasses.fields(cls) if "src" not in f.metadata]
    assert unprojected == ["log"], unprojected  # only resolves the sub-trees' ${log.level}


@pytest.mark.parametrize("component", COMPONENTS)
def test_a_projected_config_reads_back_with_the_run_configs_values(component, tmp_path):
    cfg = compose(
        [
            "+experiment=reverse_text",
            f"output_dir={tmp_path}/run",
            "cluster.address=10.0.0.1",
            "cluster.inference.nodes=3",
            "cluster.trainer.nodes=2",
            "trainer.model.lora.enabled=true",
            "trainer.model.lora.rank=4",
        ]
    )
    raw = component_config(cfg, component)
    back = OmegaConf.structured(typed(CONFIGS[component], raw, component))
    for key, _, where in declared(CONFIGS[component]):
        got = OmegaConf.select(back, key)
        got = OmegaConf.to_container(got) if OmegaConf.is_config(got) else got
        if callable(where):
            assert got == where(cfg), key
            continue
        want = OmegaConf.select(cfg, where)
        want = OmegaConf.to_container(want, resolve=True) if OmegaConf.is_config(want) else want
        assert got == want, f"{component}.{key} = {got!r}, the run's {where} = {want!r}"
    if component != "trainer":
        assert back.lora.enabled is True and back.lora.rank == 4
    if component == "orchestrator":
        assert back.trainer_ranks == 2 and back.inference_nodes == 3
    if component == "inference":
        assert back.address == "10.0.0.1" and back.nodes == 3


# ----------------------------------------------------------------------------- conf/ restates nothing
def _default(site: walk.Site) -> object:
    f = site.field
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]


def _same(value: object, default: object) -> bool:
    if isinstance(default, float) and isinstance(value, (str, int)) and not isinstance(value, bool):
        try:
            return float(value) == default  # YAML reads 5e-4 as a string
        except ValueError:
            return False
    if isinstance(default, tuple):
        default = list(default)
    return type(value) is type(default) and value == default


def restated(data: dict, root: type = RunConfig, prefix: str = "") -> list[str]:
    """The keys of a conf/ file's `data` (under package `prefix`) whose value is the
    schema's default."""
    fields = {site.name: site for site in walk.schema_fields(root) if "." not in site.key}
    out = []
    for name, value in data.items():
        site = fields.get(name)
        if site is None:  # `defaults`, or a key composition would refuse anyway
            continue
        key = prefix + name
        if site.section is not None and isinstance(value, dict):
            out += restated(value, site.section, key + ".")
        elif site.entries is not None and isinstance(value, list):
            out += [
                k for i, e in enumerate(value) if isinstance(e, dict) for k in restated(e, site.entries, f"{key}.{i}.")
            ]
        elif _same(value, _default(site)):
            out.append(key)
    return out


def package_of(path: Path) -> str:
    """A conf/ file's package: its `# @package` line, else its group."""
    m = re.search(r"^# @package (\S+)", path.read_text(), re.M)
    package = m.group(1) if m else path.parent.name
    return "" if package == "_global_" else package


CONF_FILES = sorted(p for p in (REPO / "conf").rglob("*.yaml") if p.parent != REPO / "conf")


def test_the_check_finds_a_restated_default():
    assert restated({"cluster": {"device": "cpu", "time": "01:00:00"}, "seq_len": 80}) == ["cluster.device"]
    assert restated({"orchestrator": {"env": [{"id": "x", "ratio": 1.0}]}}) == ["orchestrator.env.0.ratio"]
    assert restated({"trainer": {"optim": {"lr": "1e-6", "betas": [0.9, 0.999]}}}) == [
        "trainer.optim.lr",
        "trainer.optim.betas",
    ]


@pytest.mark.parametrize("path", CONF_FILES, ids=[str(p.relative_to(REPO)) for p in CONF_FILES])
def test_no_conf_file_restates_a_schema_default(path):
    data = yaml.safe_load(path.read_text()) or {}
    package = package_of(path)
    for part in reversed(package.split(".") if package else []):
        data = {part: data}
    found = restated(data)
    assert not found, f"{path.relative_to(REPO)} sets {found} to the schema's default: drop the line"


# ----------------------------------------------------------------------------- field documentation
@pytest.mark.parametrize("module", ["prime_hpc/config/schema.py", "prime_hpc/config/component.py"])
def test_fields_are_documented_by_docstrings_not_trailing_comments(module):
    """A field's documentation is the attribute docstring under it; a trailing comment would
    wrap onto the next field's line."""
    import ast
    import io
    import tokenize

    text = (REPO / module).read_text()
    field_lines = {
        n
        for cls in ast.walk(ast.parse(text))
        if isinstance(cls, ast.ClassDef)
        for stmt in cls.body
        if isinstance(stmt, ast.AnnAssign)
        for n in range(stmt.lineno, stmt.end_lineno + 1)
    }
    trailing = [
        f"{module}:{tok.start[0]}: {tok.line.strip()}"
        for tok in tokenize.generate_tokens(io.StringIO(text).readline)
        if tok.type == tokenize.COMMENT and tok.start[0] in field_lines and not tok.string.startswith("# type:")
    ]
    assert len(field_lines) > 100 or "component" in module
    assert not trailing, trailing


def test_the_teachers_servers_get_the_inference_config_of_the_teacher_model_on_its_own_nodes(tmp_path):
    """`configs/teacher.yaml`: what the run's inference servers get, but the teacher's model,
    the teacher's group and nodes, no adapter and no weight group (it is never updated)."""
    cfg = compose(
        [
            "+experiment=reverse_text",
            f"output_dir={tmp_path}/run",
            "orchestrator.training_mode=opd",
            "orchestrator.teacher.model=tiny-35m",
            "cluster.inference.nodes=3",
            "cluster.teacher.nodes=2",
            "trainer.model.lora.enabled=true",
            "weights.transport=broadcast",
        ]
    )
    teacher = typed(CONFIGS["teacher"], component_config(cfg, "teacher"), "teacher")
    inference = typed(CONFIGS["inference"], component_config(cfg, "inference"), "inference")
    assert (teacher.group, inference.group) == ("teacher", "inference")
    assert teacher.model.name == teacher.inference.model.name == "tiny-35m"
    assert inference.model.name == "tiny"
    assert (teacher.nodes, inference.nodes) == (2, 3)
    assert teacher.lora.enabled is False and inference.lora.enabled is True
    assert teacher.weights.transport == "filesystem" and inference.weights.transport == "broadcast"
    assert teacher.inference.max_restarts == inference.inference.max_restarts
    assert teacher.inference.max_model_len == inference.inference.max_model_len + 1  # a full sequence + 1 token
    assert teacher.output_dir == inference.output_dir and teacher.address == inference.address
