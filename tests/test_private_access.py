"""No module reaches into another module's private state: `obj._name` (obj not `self`
or `cls`) is allowed only in the module that defines a class having `_name` (assigned
as `self._name`, or a method or class attribute `_name`). Dunder names are public.

Read from the source with `ast`, without importing anything, over the product
packages; annotations count like any other expression (`argparse._SubParsersAction`
in a signature ties the code to argparse's internals as much as a call does).
"""

from __future__ import annotations

import ast
from pathlib import Path

from vitrieval._folders import SUBPACKAGE_FOLDERS

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("vitrieval", *SUBPACKAGE_FOLDERS)

# documented stdlib functions whose names happen to start with an underscore
ALLOWED = {
    ("os", "_exit"),  # leave without running atexit handlers or flushing (a forked child)
    ("sys", "_getframe"),
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def defined_private_names(tree: ast.AST) -> set[str]:
    """The private attribute names the classes of a module define: methods, class
    attributes, and `self._name = ...` assignments in their methods."""
    names: set[str] = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in cls.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                names.add(node.name)
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        for node in ast.walk(cls):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            ):
                names.add(node.attr)
    return {name for name in names if _private(name)}


def violations(source: str) -> list[tuple[int, str]]:
    """(line, `obj._name`) of the private accesses a module makes to others' state."""
    tree = ast.parse(source)
    own = defined_private_names(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not _private(node.attr):
            continue
        value = node.value
        name = value.id if isinstance(value, ast.Name) else None
        if name in ("self", "cls") or (name, node.attr) in ALLOWED or node.attr in own:
            continue
        found.append((node.lineno, f"{ast.unparse(value)}.{node.attr}"))
    return sorted(found)


def product_files(root: Path = ROOT) -> list[Path]:
    return [
        path
        for package in PACKAGES
        for path in sorted((root / package).rglob("*.py"))
        if "__pycache__" not in path.parts
    ]


def test_no_module_reads_another_modules_private_state():
    found = [
        f"{path.relative_to(ROOT)}:{line} {what}"
        for path in product_files()
        for line, what in violations(path.read_text())
    ]
    assert not found, "\n".join(found)


def test_the_check_sees_what_it_should():
    source = (
        "import argparse, os\n"
        "class A:\n"
        "    _shared = 1\n"
        "    def __init__(self):\n"
        "        self._mine = 2\n"
        "    def _helper(self):\n"
        "        return self._mine\n"
        "def f(a, store, sub: argparse._SubParsersAction):\n"
        "    a._mine, a._helper(), A._shared, a.__class__\n"
        "    os._exit(1)\n"
        "    return store._lock\n"
    )
    assert violations(source) == [(8, "argparse._SubParsersAction"), (11, "store._lock")]
