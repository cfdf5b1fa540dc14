"""The docs' tables of keys and defaults (`| key | default | meaning |`, in
docs/configuration.md and the pages it links) are the schema's: every key a table names
exists in `RunConfig`, every default it gives is the schema's, and every field of the
schema has a row. A field added, renamed or given another default without its row fails
here, naming the page and line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from prime_hpc.config.schema import EnvEntry, RunConfig
from prime_hpc.config.walk import schema_fields

DOCS = Path(__file__).resolve().parents[2] / "docs"
GROUPS = ("orchestrator", "inference", "trainer", "teacher")  # `cluster.<group>.*`
# defaults given in words, where the schema's value is not the whole story
IN_WORDS = ("from `", "as `", "if set, else")
MISSING = object()


def schema() -> dict:
    return OmegaConf.to_container(OmegaConf.structured(RunConfig), resolve=False)


def lookup(tree: dict, key: str) -> object:
    node: object = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return MISSING
        node = node[part]
    return node


def key_rows() -> list[tuple[str, str, str]]:
    """(page:line, key cell, default cell) of every row of a `| key | default | meaning |` table."""
    rows, in_table = [], False
    for page in sorted(DOCS.glob("*.md")):
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if line.startswith("| key | default |"):
                in_table = True
            elif not line.startswith("|"):
                in_table = False
            elif in_table and not line.startswith(("| ---", "|---")):
                cells = [c.strip() for c in line.strip("|").split(" | ")]
                rows.append((f"docs/{page.name}:{n}", cells[0], cells[1]))
    return rows


def expand_keys(cell: str) -> list[str]:
    """`a.b` / `c` and `a.b`, `c` name siblings of `a.b`; `{x,y}` alternatives; `<group>` each
    component; `.*` every field under it; `[i]` an entry of a list of envs."""
    names = re.findall(r"`([^`]+)`", cell)
    first = names[0]
    parent = first.rsplit(".", 1)[0] if "." in first else ""
    keys = [first] + [n if "." in n or not parent else f"{parent}.{n}" for n in names[1:]]
    out: list[str] = []
    for key in keys:
        out += _alternatives(key)
    return [k.replace("<group>", g) for k in out for g in (GROUPS if "<group>" in k else ("",))]


def _alternatives(key: str) -> list[str]:
    m = re.search(r"\{([^}]*)\}", key)
    if not m:
        return [key]
    return [k for alt in m.group(1).split(",") for k in _alternatives(key[: m.start()] + alt + key[m.end() :])]


def expand_defaults(cell: str, n: int) -> list[object] | None:
    """The literal defaults of a cell, one per key (a single one for all), or None where
    the cell gives the default in words."""
    if any(w in cell for w in IN_WORDS) or "`" not in cell:
        return None
    literals = re.findall(r"`([^`]*)`", cell.split(" (")[0])
    values = [literal(v) for v in literals]
    return values * n if len(values) == 1 else values


def literal(text: str) -> object:
    """A default as written: YAML, with `027` an octal string (a umask) and `1e-6` a float."""
    if text.startswith("${") or (len(text) > 1 and text.startswith("0") and text.isdigit()):
        return text
    value = yaml.safe_load(text)
    try:
        return float(value) if isinstance(value, str) else value
    except ValueError:
        return value


def schema_default(tree: dict, key: str) -> object:
    if "[i]." in key:  # an entry of orchestrator.env / orchestrator.eval.env
        return OmegaConf.to_container(OmegaConf.structured(EnvEntry)).get(key.split("[i].")[1], MISSING)
    return lookup(tree, key.removesuffix(".*"))


def same(doc: object, value: object) -> bool:
    if isinstance(doc, (int, float)) and not isinstance(doc, bool) and isinstance(value, (int, float)):
        return float(doc) == float(value)
    return doc == value


ROWS = key_rows()


def test_the_tables_are_found():
    assert len(ROWS) > 80, ROWS


@pytest.mark.parametrize("line,keys,defaults", ROWS, ids=[where for where, _, _ in ROWS])
def test_a_documented_key_exists_with_the_schemas_default(line, keys, defaults):
    tree = schema()
    names = expand_keys(keys)
    values = expand_defaults(defaults, len(names))
    for i, key in enumerate(names):
        value = schema_default(tree, key)
        assert value is not MISSING, f"{line}: `{key}` is not a key of the schema"
        if values is None or key.endswith(".*") or key.startswith("model.name"):
            continue
        if "<group>" in keys:
            doc = values[0]
        else:
            assert len(values) == len(names), f"{line}: {len(names)} keys, defaults {values}"
            doc = values[i]
        assert same(doc, value), f"{line}: `{key}` defaults to {value!r} in the schema, the table says {doc!r}"


def test_every_field_of_the_schema_has_a_row():
    documented = {k.removesuffix(".*") for _, keys, _ in ROWS for k in expand_keys(keys)}
    fields = [site.key for site in schema_fields() if site.section is None]
    undocumented = [k for k in fields if not any(k == d or k.startswith(d + ".") for d in documented)]
    assert not undocumented, f"fields of the schema without a row in a table of docs/: {undocumented}"
