"""A serving install (`pip install -e '.[serve]'`, no torch) indexes, searches, benchmarks
and serves with an exported model.

The commands run in subprocesses that can import only what that install holds: the base
dependencies and the `serve` extra of pyproject.toml, and what they require in turn. A
`sitecustomize.py` on PYTHONPATH refuses every other installed package (torch,
torchvision, timm, onnx, matplotlib, scikit-image, the test tools...) with
ModuleNotFoundError, as if it were absent. With VITRIEVAL_SERVE_PYTHON naming the Python
of a real serving virtualenv (`make check-serve-install`), they run there instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import tomllib
from importlib import metadata
from pathlib import Path

import httpx
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from serving import free_port

REPO = Path(__file__).resolve().parents[1]
PYTHON = Path(os.environ.get("VITRIEVAL_SERVE_PYTHON") or sys.executable).absolute()
ALWAYS_BLOCKED = {"torch", "torchvision", "timm"}  # whatever the metadata says
# what every virtualenv has, and the editable install's start-up hooks use
ALWAYS_ALLOWED = {"pip", "setuptools", "wheel", "_distutils_hack"}


def serve_install() -> set[str]:
    """The distributions `pip install '.[serve]'` installs: the base dependencies and the
    serve extra from pyproject.toml, then their requirements from the installed metadata."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    todo = [Requirement(r) for r in project["dependencies"]]
    todo += [Requirement(r) for r in project["optional-dependencies"]["serve"]]
    names: set[str] = set()
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        extras = frozenset(requirement.extras) | {""}
        marker = requirement.marker
        if (name, extras) in seen or (
            marker and not any(marker.evaluate({"extra": e}) for e in extras)
        ):
            continue
        seen.add((name, extras))
        names.add(name)
        try:
            requires = metadata.distribution(name).requires or []
        except metadata.PackageNotFoundError:
            continue  # not installed here: nothing to block either
        for text in requires:
            required = Requirement(text)
            if required.marker is None or any(
                required.marker.evaluate({"extra": e}) for e in extras
            ):
                required.marker = None
                todo.append(required)
    return names


def blocked_modules() -> set[str]:
    """Top-level modules of the installed distributions a serving install lacks."""
    allowed = serve_install() | {"vitrieval"}
    blocked = set(ALWAYS_BLOCKED)
    for module, distributions in metadata.packages_distributions().items():
        if "/" in module or module in ALWAYS_ALLOWED:
            continue
        if not any(canonicalize_name(d) in allowed for d in distributions):
            blocked.add(module)
    return blocked


SITECUSTOMIZE = '''\
"""Only what `pip install .[serve]` installs can be imported (tests/test_serve_install.py)."""
import sys

BLOCKED = frozenset({blocked!r})


class NotInServeInstall:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(
                f"No module named {{name!r}} (not in a serving install)", name=name
            )
        return None


sys.meta_path.insert(0, NotInServeInstall)
'''


@pytest.fixture(scope="module")
def serve_env(tmp_path_factory) -> dict[str, str]:
    """The environment of a process that sees a serving install only."""
    folder = tmp_path_factory.mktemp("serve_install")
    (folder / "sitecustomize.py").write_text(
        SITECUSTOMIZE.format(blocked=sorted(blocked_modules()))
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("VITRIEVAL_")}
    env["PYTHONPATH"] = str(folder)
    return env


def run(env: dict[str, str], *command: str, cwd: Path) -> subprocess.CompletedProcess:
    """A console script of the serving install (`vitrieval-index` ...), or `-c CODE`."""
    exe = [str(PYTHON)] if command[0] == "-c" else [str(PYTHON.parent / command[0])]
    args = command if command[0] == "-c" else command[1:]
    result = subprocess.run(
        [*exe, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, f"{command}: {result.stdout}\n{result.stderr}"
    return result


def test_the_serving_install_has_no_torch(serve_env, tmp_path):
    code = (
        "import importlib, sys\n"
        "for name in ('torch', 'torchvision', 'timm', 'vitrieval.training.model', 'onnx',\n"
        "             'matplotlib'):\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ModuleNotFoundError:\n"
        "        continue\n"
        "    sys.exit(f'{name} imports')\n"
    )
    run(serve_env, "-c", code, cwd=tmp_path)
    if "VITRIEVAL_SERVE_PYTHON" in os.environ:  # a real serving virtualenv: not installed
        bare = {k: v for k, v in serve_env.items() if k != "PYTHONPATH"}
        code = "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)"
        run(bare, "-c", code, cwd=tmp_path)


def test_the_serving_install_decodes_large_png_and_webp_with_libvips(serve_env, tmp_path):
    """The serve extra brings the vips extra: a large PNG is libvips's to decode."""
    code = (
        "import io\n"
        "from PIL import Image\n"
        "from vitrieval.index.runtime import vips_decode\n"
        "from vitrieval.index.runtime.images import plan_decode\n"
        "buffer = io.BytesIO()\n"
        "Image.new('RGB', (640, 480), 'teal').save(buffer, format='PNG')\n"
        "plan = plan_decode(buffer.getvalue(), draft_size=128)\n"
        "print(vips_decode.active_decoder(), plan.decoder)\n"
    )
    assert run(serve_env, "-c", code, cwd=tmp_path).stdout.split() == ["vips", "vips"]


def test_every_index_and_service_module_imports_without_torch(serve_env, tmp_path):
    code = (
        "import importlib, pkgutil\n"
        "import vitrieval.index as index, vitrieval.service as service\n"
        "for package in (index, service):\n"
        "    for info in pkgutil.walk_packages(package.__path__, package.__name__ + '.'):\n"
        "        importlib.import_module(info.name)\n"
        "print('imported')\n"
    )
    assert run(serve_env, "-c", code, cwd=tmp_path).stdout.strip() == "imported"


def test_index_and_serve_without_torch(serve_env, tmp_path, tiny_onnx):
    images, index, bench = tmp_path / "images", tmp_path / "index", tmp_path / "bench"
    done = run(
        serve_env,
        *("vitrieval-index", "export-dataset", "--dataset", "digits", "--split", "test"),
        *("--out", str(images)),
        cwd=tmp_path,
    )
    assert "wrote 539 images" in done.stdout
    query = images / "7" / "digits_00017.png"

    model = str(tiny_onnx)
    command = ("vitrieval-index", "build", "--model", model, "--images", str(images))
    done = run(serve_env, *command, "--labels-from-folders", "--out", str(index), cwd=tmp_path)
    assert "indexed 539 of 539 images" in done.stdout

    done = run(
        serve_env, "vitrieval-index", "search", str(index), str(query), "-k", "3", cwd=tmp_path
    )
    hits = [line.split() for line in done.stdout.splitlines()[2:]]
    assert len(hits) == 3 and hits[0][1] == "1.0000"
    assert ["7", "7/digits_00017.png"] in [hit[2:] for hit in hits]

    done = run(serve_env, "vitrieval-index", "info", str(index), "--json", cwd=tmp_path)
    assert json.loads(done.stdout)["count"] == 539

    command = ("vitrieval-index", "bench", "--model", model, "--gallery", str(images / "list.csv"))
    run(serve_env, *command, "--out", str(bench), cwd=tmp_path)
    report = json.loads((bench / "report.json").read_text())
    assert report["n_queries"] == 539 and 0 < report["recall@1"] <= 1

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    server = (PYTHON.parent / "vitrieval-serve", "--model", model, "--index", str(index))
    with open(log, "w") as out:
        process = subprocess.Popen(
            [*map(str, server), "--host", "127.0.0.1", "--port", str(port), "--read-only"],
            env=serve_env,
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"not ready after 120 s: {log.read_text()}"
            try:
                if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        found = httpx.post(
            f"{url}/v1/search",
            files={"image": ("q.png", query.read_bytes(), "image/png")},
            data={"k": "5"},
            timeout=30,
        )
        assert found.status_code == 200, found.text
        assert "7/digits_00017.png" in [hit["key"] for hit in found.json()["hits"]]
        for path in ("/", "/docs", "/docs/assets/swagger-ui-bundle.js", "/metrics"):
            assert httpx.get(f"{url}{path}", timeout=10).status_code == 200, path
    finally:
        process.terminate()
        process.wait(30)
    assert "ModuleNotFoundError" not in log.read_text()
