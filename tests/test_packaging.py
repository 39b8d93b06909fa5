"""One import name: the wheel installs `vitrieval` and nothing else at the top level of
site-packages, no module is ever loaded under two names, and Dask's `distributed`
imports beside `vitrieval.distributed`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from test_import_graph import absolute_imports, module_files

import vitrieval
from vitrieval._folders import SUBPACKAGE_FOLDERS

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`pip wheel --no-deps .` of a copy of the checkout's files (a build in the checkout
    itself would leave build/ and egg-info behind in it)."""
    source = tmp_path_factory.mktemp("source")
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    for name in listed:
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(source)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (found,) = out.glob("vitrieval-*.whl")
    return found


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel installed (without dependencies) into a folder of its own."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "-q",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return target


def test_the_wheel_holds_the_vitrieval_package_only(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top == {"vitrieval"}
    assert f"vitrieval-{vitrieval.__version__}-" in wheel.name
    for folder in SUBPACKAGE_FOLDERS:
        assert f"vitrieval/{folder}/__init__.py" in names
    # the package data and the typing marker travel with it
    assert "vitrieval/py.typed" in names
    assert "vitrieval/service/static/index.html" in names
    assert "vitrieval/index/store/_index_store.py" in names
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    scripts = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "vitrieval-index = vitrieval.index.cli.launch:index_main" in scripts


def run_outside(code: str, site: Path, cwd: Path) -> subprocess.CompletedProcess:
    """`code` in a Python that finds vitrieval in `site` (the wheel's install) first."""
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("dask_first", [True, False])
def test_dask_distributed_imports_beside_vitrieval(installed, tmp_path, dask_first):
    imports = ["import distributed", "import vitrieval.distributed.cluster"]
    code = "\n".join(
        [
            *(imports if dask_first else imports[::-1]),
            "import distributed.client, vitrieval.index.store, vitrieval.service.app",
            "assert hasattr(distributed, 'Client'), distributed.__file__",
            "assert hasattr(vitrieval.distributed.cluster, 'plan_actors')",
            f"assert vitrieval.__file__.startswith({str(installed)!r}), vitrieval.__file__",
            "assert not distributed.__file__.startswith(" + repr(str(installed)) + ")",
            "for name in ('index', 'training', 'service'):",
            "    try:",
            "        __import__(name)",
            "    except ImportError:",
            "        continue",
            "    raise SystemExit(f'import {name} succeeded outside the checkout')",
            "print('ok')",
        ]
    )
    result = run_outside(code, installed, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_no_module_is_loaded_under_two_names():
    """Every product module imported, from the checkout itself (where a bare `import index`
    would find the folder): each is in sys.modules once, under its `vitrieval.` name."""
    names = sorted(n for n in module_files(ROOT) if not n.endswith(".__main__"))
    code = (
        "import importlib, sys\n"
        f"names = {names!r}\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        f"folders = {SUBPACKAGE_FOLDERS!r}\n"
        "bare = sorted(m for m in sys.modules if m.split('.')[0] in folders)\n"
        "files = {}\n"
        "for name, module in list(sys.modules.items()):\n"
        "    f = getattr(module, '__file__', None)\n"
        "    if f and name.startswith('vitrieval'):\n"
        "        files.setdefault(f, []).append(name)\n"
        "twice = {f: n for f, n in files.items() if len(n) > 1}\n"
        "print(len(names), bare, twice)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[0] == str(len(names))
    assert result.stdout.strip() == f"{len(names)} [] {{}}"


def bare_imports(source: str) -> list[tuple[int, str]]:
    """Absolute imports of a repository folder by its bare name (`from index import x`)."""
    return absolute_imports(source, SUBPACKAGE_FOLDERS)


def test_every_import_is_vitrieval_qualified_or_relative():
    """Product code, tests and benchmarks alike (Dask's `distributed` is never imported
    by name here, so the rule has no exception)."""
    files = [
        *module_files(ROOT).values(),
        *sorted((ROOT / "tests").glob("*.py")),
        *sorted((ROOT / "bench").glob("*.py")),
    ]
    found = [
        f"{path.relative_to(ROOT)}:{line} {name}"
        for path in files
        for line, name in bare_imports(path.read_text())
    ]
    assert not found, found
    assert bare_imports("import index.store\nfrom training import x\nfrom . import y\n") == [
        (1, "index.store"),
        (2, "training"),
    ]
