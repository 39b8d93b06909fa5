"""No import circle among the product packages' modules; and the rules the same reading
answers: `index` and `service` never import torch (the serving install has none), no
product module is over 600 lines.

The graph is read from the source with `ast`, without importing anything: every
`import` and `from ... import` statement counts, at module level or inside a function
(a deferred import still ties the two modules together), and those under `if
TYPE_CHECKING:` too: they never run, but a module that names another's class in its
annotations depends on that module as much as one that imports it (a helper
naming the class it serves is a circle: give it the smaller type it needs). Relative
imports are
resolved against the importing module's package; `from pkg import name` is an edge to
the module `pkg.name` when there is one, else to `pkg`. Imports of anything outside
the product packages are left out.
"""

from __future__ import annotations

import ast
from collections.abc import Collection
from pathlib import Path

import pytest
from test_serve_install import ALWAYS_BLOCKED as TORCH_PACKAGES

from vitrieval._folders import SUBPACKAGE_FOLDERS

ROOT = Path(__file__).resolve().parents[1]
# the repository's product folders and the package each installs as (setup.py)
PACKAGES = {"vitrieval": "vitrieval", **{f: f"vitrieval.{f}" for f in SUBPACKAGE_FOLDERS}}


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name (as installed) -> source file, for every product module."""
    modules = {}
    for folder, package in PACKAGES.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root / folder).with_suffix("").parts
            if "__pycache__" in parts:
                continue
            if parts and parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


def folder_of(path: Path, root: Path) -> str:
    """The product folder a module's source lies in."""
    return path.relative_to(root).parts[0]


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The product modules that module `name` (source at `path`) imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def add(target: str) -> None:
        # the longest prefix that is a module: `import a.b.c` reaches a.b.c
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)

    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join([*base, *([node.module] if node.module else [])])
            else:
                origin = node.module or ""
            for alias in node.names:
                submodule = f"{origin}.{alias.name}"
                add(submodule if submodule in modules else origin)
    return found


def _runtime_nodes(tree: ast.AST):
    """Every node of `tree` but those inside an `if TYPE_CHECKING:` block."""
    pending = [tree]
    while pending:
        node = pending.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                pending.extend(child.orelse)
                continue
            pending.append(child)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = module_files(root)
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
    return components


def shortest_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest circle through the component's first module: [a, b, ..., a]."""
    start, members = component[0], set(component)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & members):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if nxt not in previous:
                    previous[nxt] = node
                    following.append(nxt)
        frontier = following
    return [start, start]


def cycles(folder: str, root: Path = ROOT) -> list[str]:
    """Every import circle that passes through a module of `folder`, one line each."""
    graph = import_graph(root)
    files = module_files(root)
    found = []
    for component in strongly_connected(graph):
        if len(component) > 1 and any(folder_of(files[m], root) == folder for m in component):
            found.append(" -> ".join(shortest_cycle(graph, component)))
    return found


@pytest.mark.parametrize("folder", PACKAGES)
def test_no_import_cycle(folder):
    found = cycles(folder)
    for line in found:
        print(f"import cycle: {line}")
    assert not found, f"import cycles through {folder}/: " + "; ".join(found)


def test_the_graph_sees_every_kind_of_import(tmp_path):
    """The reader itself: module-level, function-level, relative, `from pkg import
    module` and type-checking imports are edges, and a circle among them is found and
    printed in order."""
    pkg = tmp_path / "training"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .. import a\n")
    (pkg / "a.py").write_text("import os\n\ndef f():\n    from .sub import b\n")
    (pkg / "sub" / "b.py").write_text(
        "from vitrieval.training import c\nfrom vitrieval.training.a import f\n"
    )
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\n\nfrom .sub.b import name\n\n"
        "if TYPE_CHECKING:\n    from .a import f\n"
    )
    for folder in PACKAGES:
        (tmp_path / folder).mkdir(exist_ok=True)
    (tmp_path / "vitrieval" / "__init__.py").write_text("")
    graph = {name[len("vitrieval.") :]: edges for name, edges in import_graph(tmp_path).items()}
    short = {name: {e[len("vitrieval.") :] for e in edges} for name, edges in graph.items()}
    assert short == {
        "": set(),
        "training": set(),
        "training.a": {"training.sub.b"},
        "training.c": {"training.a", "training.sub.b"},
        "training.sub": {"training.a"},
        "training.sub.b": {"training.a", "training.c"},
    }
    assert cycles("training", tmp_path) == [
        "vitrieval.training.a -> vitrieval.training.sub.b -> vitrieval.training.a"
    ]
    assert cycles("index", tmp_path) == []


# -- the house rules the graph also answers -----------------------------------------------

TORCH_FREE = ("index", "service")
MAX_PRODUCT_LINES = 600


def absolute_imports(
    source: str, packages: Collection[str], *, type_checking: bool = True
) -> list[tuple[int, str]]:
    """(line, module) of the absolute imports in `source` of modules whose top-level
    name is in `packages`, function-level ones included, and those under `if
    TYPE_CHECKING:` unless `type_checking` is False."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree) if type_checking else _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        found += [(node.lineno, n) for n in names if n.split(".")[0] in packages]
    return sorted(found)


def torch_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) of the torch-family imports a module's source runs."""
    return absolute_imports(source, TORCH_PACKAGES, type_checking=False)


def test_index_and_service_never_import_torch():
    found = [
        f"{path.relative_to(ROOT)}:{line} {module}"
        for path in module_files(ROOT).values()
        if folder_of(path, ROOT) in TORCH_FREE
        for line, module in torch_imports(path.read_text())
    ]
    assert not found, found


def test_the_torch_check_sees_deferred_imports():
    source = (
        "import numpy\n"
        "def f():\n"
        "    import torch.nn\n"
        "    from timm import create_model\n"
        "if TYPE_CHECKING:\n"
        "    import torchvision\n"
    )
    assert torch_imports(source) == [(3, "torch.nn"), (4, "timm")]


def test_no_product_file_is_over_600_lines():
    over = {
        str(path.relative_to(ROOT)): n
        for path in module_files(ROOT).values()
        if (n := len(path.read_text().splitlines())) > MAX_PRODUCT_LINES
    }
    assert not over, over
