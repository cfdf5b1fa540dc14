"""docs/architecture.md's package table against the code: every package of `prime_hpc/`
has its row and every module is named in it, and no import (at the top of a module or
inside a function) runs up the table, but for the one the doc names. Without this the
table drifts from the code and an import up a layer goes unnoticed until it makes a
circle."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "prime_hpc"
DOC = ROOT / "docs" / "architecture.md"
# (importing module, imported module): the imports up the table the doc names
UP_BY_DESIGN = {("job/attempt", "launcher.scale")}


def rows() -> list[tuple[str, str]]:
    """(package, its row's text), in the table's order."""
    return re.findall(r"^\| `prime_hpc/(\w+)/` \| (.*) \|$", DOC.read_text(), re.M)


def packages() -> list[str]:
    return sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())


def modules(package: str) -> list[str]:
    return sorted(p.stem for p in (PACKAGE / package).glob("*.py") if p.stem not in ("__init__", "__main__"))


def imports(path: Path) -> list[str]:
    """Every `prime_hpc.*` module `path` imports, anywhere in it."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}: a relative import (the layers are checked on absolute ones)")
    return [m for m in found if m.startswith("prime_hpc.")]


def test_every_package_has_its_row_and_every_module_is_named_in_it():
    table = rows()
    assert sorted(p for p, _ in table) == packages(), "docs/architecture.md's table and prime_hpc/ differ"
    assert len(table) == len({p for p, _ in table}), "a package has two rows"
    unnamed = []
    for package, text in table:
        named = {n.split(".")[0] for n in re.findall(r"`([\w.]+)`", text)}
        unnamed += [f"{package}/{m}" for m in modules(package) if m not in named]
    assert not unnamed, f"modules docs/architecture.md's table does not name: {unnamed}"


def test_no_import_runs_up_the_table_but_the_one_it_names():
    order = [p for p, _ in rows()]
    up, seen = [], set()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).with_suffix("")
        if len(rel.parts) < 2:
            continue
        source = rel.parts[0]
        for target in imports(path):
            room = target.split(".")[1]
            if room == source or room not in order:
                continue
            if order.index(room) < order.index(source):
                edge = ("/".join(rel.parts), target.removeprefix("prime_hpc."))
                seen.add(edge)
                if edge not in UP_BY_DESIGN:
                    up.append(f"{edge[0]} -> {edge[1]}")
    assert not up, f"imports up docs/architecture.md's table: {up}"
    # the exception is still there (once it is gone, so is its line here and in the doc)
    assert seen == UP_BY_DESIGN, seen
    text = DOC.read_text()
    assert all(f"`{a}`" in text and f"`{b.replace('.', '/')}`" in text for a, b in UP_BY_DESIGN)


def test_the_layer_check_sees_an_import_up_inside_a_function(tmp_path):
    """The walk finds imports inside functions too (most of the package's lazy ones)."""
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from prime_hpc.cli.submit import main\n    import prime_hpc.core.net\n")
    assert imports(path) == ["prime_hpc.cli.submit", "prime_hpc.core.net"]
