"""Everything about a run's config is defined once: each component's config is declared by
where its values come from in the run config (`prime_hpc.config.component`), and its
types are the schema's."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from prime_hpc.config import walk
from prime_hpc.config.component import CONFIGS, component_config, typed
from prime_hpc.config.compose import compose
from prime_hpc.rundir import COMPONENTS

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
    assert set(CONFIGS) == set(COMPONENTS)


@pytest.mark.parametrize("component", COMPONENTS)
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
