"""docs/architecture.md's package table against the code: every package of `prime_hpc/`
has its row and every module is named in it, no import (at the top of a module or inside
a function) runs up the table, but for the one the doc names, and no circle of modules
imports itself back. Without this the table drifts from the code and an import up a layer
goes unnoticed until it makes a circle."""

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


def module_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def faces() -> dict[str, dict[str, str]]:
    """For each package's `__init__`: the names it takes from its own modules, and from
    which (`from prime_hpc.rundir import RunDir` is an arrow to `rundir.layout`)."""
    out: dict[str, dict[str, str]] = {}
    for init in PACKAGE.rglob("__init__.py"):
        package = module_of(init)
        names = out.setdefault(package, {})
        for node in ast.walk(ast.parse(init.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(package + "."):
                for a in node.names:
                    names[a.asname or a.name] = node.module
    return out


def arrows() -> dict[str, set[str]]:
    """Module -> the modules it imports (anywhere in it), names taken through a package's
    `__init__` followed to the module that defines them."""
    known = {module_of(p) for p in PACKAGE.rglob("*.py")}
    face = faces()
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        source = module_of(path)
        targets = graph.setdefault(source, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("prime_hpc"):
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    targets.add(sub if sub in known else face.get(node.module, {}).get(a.name, node.module))
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name in known)
        targets.discard(source)
        if path.name == "__init__.py":
            targets.clear()  # a package's face: its names are followed to their modules above
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_circle_of_modules_imports_itself_back():
    """Imports inside functions count: a lazy import back is still a circle a reader must
    hold in mind (launcher/launch <-> launcher/scale once)."""
    assert circles(arrows()) == []


def test_the_circle_check_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
