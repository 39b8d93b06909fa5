"""The Python API's names (`vitrieval.<name>`, docs/python.md): each one the object its
module defines, loaded on first use, and a clear error for the training names without
the train extra."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import vitrieval


def test_every_api_name_is_its_modules_object():
    for name, target in vitrieval._API.items():
        module, attribute = target.split(":")
        assert getattr(vitrieval, name) is getattr(importlib.import_module(module), attribute)
    assert set(vitrieval.__all__) == {"__version__", *vitrieval._API}
    assert set(vitrieval._API) <= set(dir(vitrieval))
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        vitrieval.nonsense  # noqa: B018


def test_the_type_checking_imports_match_the_table():
    """What a type checker sees for each lazy name is what `__getattr__` loads."""
    tree = ast.parse(Path(vitrieval.__file__).read_text())
    (block,) = [
        node
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
    ]
    seen = {
        alias.asname or alias.name: f"{node.module}:{alias.name}"
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert seen == vitrieval._API


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_import_vitrieval_loads_nothing_heavy():
    result = run(
        "import sys, vitrieval\n"
        "heavy = sorted(m for m in ('faiss', 'onnxruntime', 'torch', 'fastapi', 'numpy')"
        " if m in sys.modules)\n"
        "print(vitrieval.__version__, heavy)\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [vitrieval.__version__, "[]"]


def test_the_training_names_without_torch_name_the_extra():
    """torch made unimportable, as in an install without the train extra."""
    result = run(
        "import sys\n"
        "class NoTorch:\n"
        "    @staticmethod\n"
        "    def find_spec(name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'torch':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, NoTorch)\n"
        "import vitrieval\n"
        "assert vitrieval.Embedder.__name__ == 'Embedder'\n"
        "try:\n"
        "    vitrieval.fit\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    assert result.returncode == 0, result.stderr
    assert "vitrieval.fit needs the train extra" in result.stdout
    assert "pip install 'vitrieval[train]'" in result.stdout
