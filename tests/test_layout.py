"""The layout of the package is the table in docs/layout.md, and the code keeps to it.

The table ("Allowed imports") lists, for each top-level package or module of vitlab, the
others it imports; each row imports only rows above it.  The imports are read from the
source with ``ast``: every ``import`` and ``from ... import`` of the file, inside functions
too, relative ones resolved.  An import the table lacks fails, and so does a row the code no
longer uses, so that the table stays the truth; the packages import one another one way (no
cycle); and docs/layout.md names every module file of the package, and no other.
"""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "vitlab"
DOC = ROOT / "docs" / "layout.md"


# ----------------------------------------------------------------------------- the code's imports


def module_name(path: Path, package: Path) -> str:
    """``vitlab/train/build.py`` -> ``vitlab.train.build``; a package's ``__init__.py`` names the package."""
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str, package: Path) -> bool:
    path = package.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imported_modules(path: Path, package: Path) -> list[tuple[str, int]]:
    """(module of the package, line) for every import in ``path``: ``from vitlab import fast``
    imports ``vitlab.fast``, ``from vitlab.data import stratified_split`` imports ``vitlab.data``."""
    name = module_name(path, package)
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # from . import x (level 1: this package), from ..b import y (level 2: its parent)
                base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub if is_module(sub, package) else base, node.lineno))
    return sorted({(m, line) for m, line in found if m == package.name or m.startswith(package.name + ".")},
                  key=lambda found_at: (found_at[1], found_at[0]))


def unit(module: str) -> str:
    """The top-level package or module of the table a module belongs to: ``vitlab.train.build`` ->
    ``train``; the package's own ``__init__.py`` is ``vitlab``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def code_units(package: Path) -> set[str]:
    return {unit(module_name(p, package)) for p in package.rglob("*.py")}


def code_edges(package: Path) -> dict[tuple[str, str], list[str]]:
    """{(importer, imported): ["file:line", ...]} over every import between two units."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(package.rglob("*.py")):
        source = unit(module_name(path, package))
        for module, line in imported_modules(path, package):
            if unit(module) != source:
                edges.setdefault((source, unit(module)), []).append(f"{path.relative_to(package.parent)}:{line}")
    return edges


def find_cycle(edges) -> list[str] | None:
    """A cycle of the directed graph ``edges`` (pairs) as [a, b, ..., a], or None."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    state: dict[str, str] = {}  # "open" while on the path, "done" after

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [node, nxt] if nxt in path else [node, nxt]
            if nxt not in state and (cycle := visit(nxt, path + [node])):
                return cycle
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [])):
            return cycle
    return None


# ----------------------------------------------------------------------------- the doc


def section(text: str, title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"docs/layout.md has no section '## {title}'"
    return match.group(1)


def doc_table(text: str) -> dict[str, list[str]]:
    """The rows of the "Allowed imports" table, in order: package -> the packages it imports
    (the names in backquotes of its two cells; the header row has none)."""
    rows: dict[str, list[str]] = {}
    for line in section(text, "Allowed imports").splitlines():
        cells = line.strip().strip("|").split("|") if line.lstrip().startswith("|") else []
        names = re.findall(r"`([\w.]+)`", cells[0]) if len(cells) >= 2 else []
        if names:
            assert len(names) == 1 and names[0] not in rows, f"docs/layout.md: a row must name one new package: {line}"
            rows[names[0]] = re.findall(r"`([\w.]+)`", cells[1])
    return rows


def doc_modules(text: str) -> set[str]:
    """The module files the "Modules" section names: ``- `build.py`: ...`` under ``### `vitlab/train/` ``."""
    named, folder = set(), None
    for line in section(text, "Modules").splitlines():
        if heading := re.match(r"^### `(vitlab/(?:\w+/)*)`", line):
            folder = heading.group(1)
        elif item := re.match(r"^- `(\w+\.py)`", line):
            assert folder, f"docs/layout.md names {item.group(1)} before any ### `vitlab/...` heading"
            named.add(folder + item.group(1))
    return named


@pytest.fixture(scope="module")
def table() -> dict[str, list[str]]:
    return doc_table(DOC.read_text())


@pytest.fixture(scope="module")
def edges() -> dict[tuple[str, str], list[str]]:
    return code_edges(PACKAGE)


# ----------------------------------------------------------------------------- the checks


def test_the_import_reader_sees_every_kind_of_import(tmp_path):
    """Relative imports resolved, imports inside functions and under TYPE_CHECKING, a module
    imported by ``from package import module``, and imports within one package left out."""
    package = tmp_path / "vitlab"
    files = {
        "__init__.py": "from . import a\n",
        "a/__init__.py": "",
        "a/x.py": ("from typing import TYPE_CHECKING\nimport torch\nfrom . import y\nfrom ..b import z\n"
                   "if TYPE_CHECKING:\n    from vitlab.c import K\n\n\ndef f():\n    from vitlab import d\n"),
        "a/y.py": "import vitlab.b.z\nfrom vitlab.b.z import name\n",
        "b/__init__.py": "", "b/z.py": "", "c.py": "K = 1\n", "d.py": "",
    }
    for name, text in files.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    assert imported_modules(package / "a/x.py", package) == [("vitlab.a.y", 3), ("vitlab.b.z", 4), ("vitlab.c", 6),
                                                              ("vitlab.d", 10)]
    assert code_edges(package) == {("vitlab", "a"): ["vitlab/__init__.py:1"],
                                   ("a", "b"): ["vitlab/a/x.py:4", "vitlab/a/y.py:1", "vitlab/a/y.py:2"],
                                   ("a", "c"): ["vitlab/a/x.py:6"], ("a", "d"): ["vitlab/a/x.py:10"]}
    assert find_cycle(code_edges(package)) is None
    assert find_cycle({("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")}) == ["a", "b", "c", "a"]
    assert find_cycle({("a", "b"), ("b", "c"), ("a", "c")}) is None


def test_the_table_has_a_row_for_every_package_and_module(table):
    assert set(table) == code_units(PACKAGE), (
        f"docs/layout.md's table lacks {sorted(code_units(PACKAGE) - set(table))} "
        f"and names {sorted(set(table) - code_units(PACKAGE))}, which vitlab does not hold")


def test_every_import_between_packages_is_in_the_table(table, edges):
    allowed = {(a, b) for a, imports in table.items() for b in imports}
    unlisted = {edge: where for edge, where in edges.items() if edge not in allowed}
    found = "; ".join(f"{a} -> {b} at {', '.join(where)}" for (a, b), where in sorted(unlisted.items()))
    assert not unlisted, ("imports docs/layout.md's table does not allow (add the edge if it runs down the table; "
                          f"one that runs back up is a bug to fix): {found}")


def test_the_table_allows_no_import_the_code_does_not_make(table, edges):
    unused = sorted((a, b) for a, imports in table.items() for b in imports if (a, b) not in edges)
    assert not unused, f"docs/layout.md's table allows imports that no module makes: {unused}"


def test_each_row_of_the_table_imports_only_rows_above_it(table):
    order = list(table)
    upward = [(a, b) for a, imports in table.items() for b in imports if b not in order[:order.index(a)]]
    assert not upward, f"docs/layout.md's table: rows importing a row below them (or one it lacks): {upward}"


def test_no_cycle_between_packages(edges):
    assert find_cycle(edges) is None, f"the packages import one another in a circle: {' -> '.join(find_cycle(edges))}"


def test_the_doc_names_every_module_file_and_no_other():
    files = {str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")}
    named = doc_modules(DOC.read_text())
    assert named == files, (f"docs/layout.md's Modules section lacks {sorted(files - named)} "
                            f"and names {sorted(named - files)}, which do not exist")
