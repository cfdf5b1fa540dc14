"""The one walk of the run schema (`prime_hpc.config.schema`): every field with its dotted
key and declared type, alone (`schema_fields`) or beside a config's values
(`config_fields`). What needs the schema's shape — the rules of `check_fields`, the
unknown-key check after composition, "valid keys here: ..." in an error, shell
completion, the docs' tables — asks here instead of walking the dataclasses itself.

A field whose type is a dataclass (`Optional` or not) is a *section*: the walk yields the
section's own field, then its fields. A `List[<dataclass>]` (the env lists) is entered
only beside a config, where it has entries (`orchestrator.env.0.id`); mappings
(`Dict[str, Any]`) are free-form and never entered.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterator, Optional


@lru_cache(maxsize=None)
def hints(cls: type) -> dict[str, Any]:
    """A dataclass's field types (the schema's annotations are strings: evaluating them is
    most of a walk's time, so once per class)."""
    return typing.get_type_hints(cls)


def bare(hint: Any) -> Any:
    """`X` of `Optional[X]`; any other type as it is."""
    if typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def section_type(hint: Any) -> Optional[type]:
    """The dataclass a field of type `hint` holds (a section), or None."""
    hint = bare(hint)
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def entry_type(hint: Any) -> Optional[type]:
    """The dataclass of each entry of a `List[<dataclass>]` field, or None."""
    hint = bare(hint)
    if typing.get_origin(hint) is list:
        args = typing.get_args(hint)
        if args and isinstance(args[0], type) and dataclasses.is_dataclass(args[0]):
            return args[0]
    return None


@dataclass(frozen=True)
class Site:
    """One field of the schema where a walk found it."""

    key: str
    """Dotted, from the root: `trainer.optim.lr`; in a config walk list entries are
    numbered (`orchestrator.env.0.id`)."""
    field: dataclasses.Field
    hint: Any
    """The declared type, `Optional` kept."""
    node: Any = None
    """The config section that holds the field (a config walk), else None."""

    @property
    def name(self) -> str:
        return self.field.name

    @property
    def section(self) -> Optional[type]:
        return section_type(self.hint)

    @property
    def entries(self) -> Optional[type]:
        return entry_type(self.hint)

    @property
    def missing(self) -> bool:
        """The config leaves this field `???` (a config walk)."""
        from omegaconf import OmegaConf

        return OmegaConf.is_missing(self.node, self.name)

    @property
    def value(self) -> Any:
        """The config's value of this field, interpolations resolved (a config walk)."""
        return self.node[self.name]


def _root() -> type:
    from prime_hpc.config.schema import RunConfig

    return RunConfig


def schema_fields(root: Optional[type] = None, prefix: str = "") -> Iterator[Site]:
    """Every field of `root` (default `RunConfig`) and of its sections, depth-first in
    declaration order, a section's own field before its fields; lists are not entered."""
    cls = root or _root()
    types = hints(cls)
    for f in dataclasses.fields(cls):
        site = Site(prefix + f.name, f, types[f.name])
        yield site
        if site.section is not None:
            yield from schema_fields(site.section, site.key + ".")


def config_fields(cfg: Any, root: Optional[type] = None, prefix: str = "") -> Iterator[Site]:
    """Every field of the schema beside config `cfg` (a DictConfig typed by `root`, default
    `RunConfig`), in `schema_fields`' order, entering each entry of a list of sections. A
    section or list that is missing or null is not entered; values are read only when
    asked for (`Site.value`)."""
    cls = root or _root()
    types = hints(cls)
    for f in dataclasses.fields(cls):
        site = Site(prefix + f.name, f, types[f.name], cfg)
        yield site
        if (site.section is None and site.entries is None) or site.missing:
            continue
        child = cfg[f.name]
        if child is None:
            continue
        if site.section is not None:
            yield from config_fields(child, site.section, site.key + ".")
        else:
            for i in range(len(child)):
                yield from config_fields(child[i], site.entries, f"{site.key}.{i}.")


def sections(cfg: Any) -> Iterator[tuple[str, type, Any]]:
    """(key prefix, schema class, config node) of the root and of every section and list
    entry of `cfg` the schema types."""
    yield "", _root(), cfg
    for site in config_fields(cfg):
        section, entries = site.section, site.entries
        if site.missing or (section is None and entries is None):
            continue
        child = site.value
        if child is None:
            continue
        if section is not None:
            yield site.key + ".", section, child
        elif entries is not None:
            for i in range(len(child)):
                yield f"{site.key}.{i}.", entries, child[i]


def unknown_key(cfg: Any) -> Optional[str]:
    """The first key of `cfg` the schema does not have (Hydra lets `+key=...` through, and
    OmegaConf's merge does not catch it either), or None."""
    for prefix, cls, node in sections(cfg):
        allowed = {f.name for f in dataclasses.fields(cls)}
        extra = sorted(set(node.keys()) - allowed - {"hydra"})
        if extra:
            return prefix + str(extra[0])
    return None


def section_at(dotted: str, root: Optional[type] = None) -> Optional[type]:
    """The schema class of the section that holds key `dotted` (`trainer.optim.lr` ->
    `OptimConfig`; list entries by index: `orchestrator.env.0.id` -> `EnvEntry`), or None
    when no section of the schema is there."""
    node: Optional[type] = root or _root()
    parts = dotted.split(".")[:-1]
    i = 0
    while i < len(parts):
        types = hints(node)
        if parts[i] not in types:
            return None
        hint = types[parts[i]]
        node = section_type(hint)
        if node is None and entry_type(hint) is not None and i + 1 < len(parts) and parts[i + 1].isdigit():
            node, i = entry_type(hint), i + 1
        if node is None:
            return None
        i += 1
    return node


def valid_keys(dotted: str) -> str:
    """'valid keys here: a, b, c' for the section that holds key `dotted`."""
    cls = section_at(dotted)
    if cls is None:
        return "no such section"
    return "valid keys here: " + ", ".join(sorted(f.name for f in dataclasses.fields(cls)))
