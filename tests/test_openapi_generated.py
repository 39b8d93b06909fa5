"""A client generated from a real server's /openapi.json by openapi-python-client
(with docs/openapi-python-client.yaml, as docs/service.md says) imports and works
without a hand edit: add an item, search by an uploaded image and by key, read the
thumbnail, evaluate in both modes, delete, read the info and the metrics; the key
passed as docs/service.md shows, on writes and (on a server with a read key) reads."""

from __future__ import annotations

import base64
import importlib
import os
import pkgutil
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
from serving import REPO, Server

from vitrieval.index.evaluation.datasets import csv_list
from vitrieval.service.answers import API_KEY_HEADER

KEY = "generated-client-key-0123"
READ_KEY = "generated-client-read-key"
CONFIG = REPO / "docs" / "openapi-python-client.yaml"
PACKAGE = "vitrieval_api_client"  # package_name_override in CONFIG


def generate(url: str, out: Path) -> Path:
    """The client project for the server at `url`, generated as docs/service.md says."""
    spec = out.parent / "openapi.json"
    spec.write_bytes(httpx.get(f"{url}/openapi.json", timeout=10).content)
    bin_dir = Path(sys.executable).parent  # the generator and its post hook, ruff
    result = subprocess.run(
        [
            str(bin_dir / "openapi-python-client"),
            "generate",
            "--path",
            str(spec),
            "--config",
            str(CONFIG),
            "--output-path",
            str(out),
            "--fail-on-warning",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Warning" not in result.stdout + result.stderr, result.stdout + result.stderr
    return out


@pytest.fixture
def client_package(tmp_path: Path) -> Iterator[dict[str, ModuleType]]:
    """Filled by `load` with the generated package's modules; they leave sys.path and
    sys.modules afterwards."""
    yield {}
    sys.path[:] = [entry for entry in sys.path if not entry.startswith(str(tmp_path))]
    for name in [name for name in sys.modules if name.split(".")[0] == PACKAGE]:
        del sys.modules[name]


def load(project: Path, into: dict[str, ModuleType]) -> None:
    """Import every module of the generated package, by its name below the package."""
    sys.path.insert(0, str(project))
    package = importlib.import_module(PACKAGE)
    into[""] = package
    for module in pkgutil.walk_packages(package.__path__, f"{PACKAGE}."):
        into[module.name.removeprefix(f"{PACKAGE}.")] = importlib.import_module(module.name)


def test_a_generated_client_adds_searches_evaluates_and_deletes(
    digits_gallery, served_index, tmp_path, client_package
) -> None:
    item = csv_list(digits_gallery["list"])[3]
    image = Path(item.path).read_bytes()
    b64 = base64.b64encode(image).decode()
    env = {"VITRIEVAL_API_KEY": KEY}
    with Server(digits_gallery["model"], served_index, env=env) as server:
        load(generate(server.url, tmp_path / "project"), client_package)
        m = client_package
        assert {"api.items.add_item", "api.search.search", "models.item_create"} <= set(m)
        models = m["models"]
        writer = m[""].AuthenticatedClient(
            base_url=server.url,
            token=KEY,
            prefix="",
            auth_header_name=API_KEY_HEADER,
            raise_on_unexpected_status=True,
        )
        reader = m[""].Client(base_url=server.url, raise_on_unexpected_status=True)

        added = m["api.items.add_item"].sync(
            client=writer,
            body=models.ItemCreate(key="generated/one", label=item.label, image_base64=b64),
        )
        assert isinstance(added, models.ItemWritten), added
        assert (added.key, added.label, added.has_image) == ("generated/one", item.label, True)

        # a plain Client on a read route: no key is needed while the server has no read key
        found = m["api.search.search"].sync(
            client=reader, body=models.SearchRequest(image_base64=b64, k=3)
        )
        assert isinstance(found, models.SearchResponse), found
        assert found.query == "image" and len(found.hits) == 3
        assert {found.hits[0].key, found.hits[1].key} == {item.key, "generated/one"}
        assert found.hits[0].score == pytest.approx(1.0, abs=1e-4)
        raw = httpx.post(f"{server.url}/v1/search", json={"image_base64": b64, "k": 3}).json()
        assert [hit.key for hit in found.hits] == [hit["key"] for hit in raw["hits"]]

        by_key = m["api.search.search"].sync(
            client=reader, body=models.SearchRequest(key="generated/one", k=3)
        )
        assert isinstance(by_key, models.SearchResponse), by_key
        assert by_key.query == "key" and by_key.hits[0].key == item.key
        assert "generated/one" not in [hit.key for hit in by_key.hits]  # exclude_self

        thumbnail = m["api.items.get_thumbnail"].sync("generated/one", client=reader, size=32)
        assert thumbnail.payload.read()[:2] == b"\xff\xd8"  # a JPEG

        evaluated = m["api.evaluate.evaluate"].sync(
            client=reader, body=models.EvaluateRequest(ks=[1, 5])
        )
        assert isinstance(evaluated, models.EvaluateResponse), evaluated
        raw = httpx.post(f"{server.url}/v1/evaluate", json={"ks": [1, 5]}).json()
        assert evaluated.to_dict() == raw  # recall@K and precision@K included
        assert evaluated.n_items == 121 and "recall@5" in evaluated.additional_properties

        queried = m["api.evaluate.evaluate"].sync(
            client=reader,
            body=models.EvaluateRequest(
                mode=models.EvaluateRequestMode.QUERIES,
                queries=[models.LabelledQuery(label=item.label, image_base64=b64)],
                ks=[1],
            ),
        )
        assert isinstance(queried, models.EvaluateResponse), queried
        assert (queried.mode, queried.n_queries, queried["recall@1"]) == ("queries", 1, 1.0)

        refused: Any = m["api.items.delete_item"].sync_detailed("generated/one", client=reader)
        assert refused.status_code == 401 and refused.parsed.code == "unauthorized"
        deleted = m["api.items.delete_item"].sync("generated/one", client=writer)
        assert isinstance(deleted, models.ItemDeleted) and deleted.deleted, deleted
        gone = m["api.items.get_item"].sync("generated/one", client=reader)
        assert isinstance(gone, models.ErrorBody) and gone.code == "unknown_key", gone

        info = m["api.health.get_info"].sync(client=reader)
        assert isinstance(info, models.InfoResponse), info
        assert info.index.count == 120 and not info.service.read_key_required
        assert "vitrieval_requests_total" in m["api.health.get_metrics"].sync(client=reader)
    assert "Traceback" not in server.output()

    # with a read key the reads take it as the writes do; a plain Client is refused
    copy = Path(shutil.copytree(digits_gallery["index"], tmp_path / "read_key_index"))
    env = {"VITRIEVAL_READ_API_KEY": READ_KEY}
    with Server(digits_gallery["model"], copy, "--read-only", env=env) as server:
        query = models.SearchRequest(key=item.key, k=2)
        plain = m["api.search.search"].sync_detailed(
            client=m[""].Client(base_url=server.url), body=query
        )
        assert plain.status_code == 401 and plain.parsed.code == "unauthorized", plain
        keyed = m[""].AuthenticatedClient(
            base_url=server.url, token=READ_KEY, prefix="", auth_header_name=API_KEY_HEADER
        )
        found = m["api.search.search"].sync(client=keyed, body=query)
        assert isinstance(found, models.SearchResponse) and len(found.hits) == 2, found
