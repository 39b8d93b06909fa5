"""The collections of a data folder as one app serves them (service/catalogue.py), in
process: opened on use and closed when idle, one model shared by its collections, a
damaged collection reported by name while the others serve, the default collection,
and a server of one index seen as the collection `default`."""

from __future__ import annotations

import csv
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from app_client import AUTH, KEY, make_client  # tests/app_client.py
from fastapi.testclient import TestClient

from vitrieval.index.collections import MODELS_DIR, DataFolder
from vitrieval.index.store import IndexStore
from vitrieval.service.app import create_data_app
from vitrieval.service.settings import Settings


@pytest.fixture
def folder(tmp_path: Path, tiny_onnx: Path) -> DataFolder:
    """Collections a and b of one model, 5 items each."""
    (tmp_path / "data").mkdir()
    data = DataFolder(tmp_path / "data")
    shutil.copy(tiny_onnx, data.root / MODELS_DIR / "tiny.onnx")
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        data.create(name, "tiny.onnx")
        vectors = rng.standard_normal((5, 128)).astype(np.float32)
        with IndexStore.open(data.path(name)) as store:
            unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
            store.add([f"{name}{i}" for i in range(5)], unit)
            store.save()
    return data


def first_key(gallery: dict[str, Path]) -> str:
    """The first item of the digits gallery's list."""
    with open(gallery["list"], newline="") as fh:
        return next(csv.DictReader(fh))["key"]


def serve(folder: DataFolder, **settings) -> TestClient:
    return TestClient(create_data_app(Settings(data=folder.root, api_key=KEY, **settings)))


def search(client: TestClient, collection: str) -> list[str]:
    answer = client.post(f"/v1/collections/{collection}/search", json={"vector": [1.0] * 128})
    assert answer.status_code == 200, answer.text
    return [hit["key"] for hit in answer.json()["hits"]]


def listed(client: TestClient) -> dict[str, dict]:
    return {c["name"]: c for c in client.get("/v1/collections").json()["collections"]}


def test_collections_open_on_use_close_when_idle_and_reopen(folder: DataFolder) -> None:
    with serve(folder, collection_idle_s=0.3) as client:
        assert client.get("/readyz").json()["status"] == "ready"
        assert not any(c["open"] for c in listed(client).values())
        assert set(search(client, "a")) == {f"a{i}" for i in range(5)}
        assert set(search(client, "b")) == {f"b{i}" for i in range(5)}
        opened = listed(client)
        assert opened["a"]["open"] and opened["b"]["open"]
        assert opened["a"]["model"] == opened["b"]["model"]  # one model for both
        added = client.post(
            "/v1/collections/a/items", json={"key": "new", "vector": [1.0] * 128}, headers=AUTH
        )
        assert added.status_code == 201
        deadline = time.monotonic() + 10
        while any(c["open"] for c in listed(client).values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        closed = listed(client)
        assert not any(c["open"] for c in closed.values())
        assert closed["a"]["count"] == 6  # saved when it closed
        assert search(client, "a")[0] == "new"  # reopened on use, the add kept


def test_a_damaged_collection_is_reported_by_name_and_the_others_serve(
    folder: DataFolder,
) -> None:
    (folder.path("b") / "manifest.json").write_text("{not json")
    with serve(folder) as client:
        assert search(client, "a")
        broken = client.post("/v1/collections/b/search", json={"vector": [1.0] * 128})
        assert broken.status_code == 503 and broken.json()["code"] == "collection_damaged"
        assert "manifest" not in broken.text  # the reason is in the log, not the answer
        ready = client.get("/readyz")
        assert ready.status_code == 200 and ready.json()["status"] == "degraded"
        assert ready.json()["checks"]["damaged_collections"] == ["b"]
        assert listed(client)["b"]["status"] == "damaged"
        assert listed(client)["a"]["status"] == "ok"
        metrics = client.get("/metrics").text
        assert 'vitrieval_collection_damaged_segments{collection="b"} -1.0' in metrics
        assert 'vitrieval_collection_items{collection="a"} 5.0' in metrics
        refused = client.post(
            "/v1/collections/b/items", json={"key": "x", "vector": [1.0] * 128}, headers=AUTH
        )
        assert refused.status_code == 503


def test_the_plain_routes_address_the_default_collection(folder: DataFolder) -> None:
    with serve(folder) as client:
        missing = client.post("/v1/search", json={"vector": [1.0] * 128})
        assert missing.status_code == 404 and missing.json()["code"] == "no_default_collection"
        put = client.put("/v1/aliases/default", json={"collection": "b"}, headers=AUTH)
        assert put.status_code == 200 and put.json()["previous"] is None
        assert client.get("/v1/info").json()["index"]["count"] == 5
        assert search(client, "default")[0].startswith("b")
        refused = client.delete("/v1/collections/b", headers=AUTH)
        assert refused.status_code == 409  # an alias names it
        assert client.delete("/v1/aliases/default", headers=AUTH).json()["collection"] == "b"
        assert client.delete("/v1/collections/b", headers=AUTH).status_code == 200
        assert set(listed(client)) == {"a"}
        assert client.post("/v1/collections/b/search", json={"k": 1}).status_code == 404
    with serve(folder, default_collection="a") as client:
        assert client.get("/v1/info").json()["index"]["count"] == 5


def test_bad_names_and_bodies_are_4xx(folder: DataFolder) -> None:
    with serve(folder) as client:
        create = client.put
        assert (
            create("/v1/collections/Bad", json={"model": "tiny.onnx"}, headers=AUTH).status_code
            == 422
        )
        assert (
            create("/v1/collections/c", json={"model": "nope.onnx"}, headers=AUTH).status_code
            == 422
        )
        both = {"model": "tiny.onnx", "snapshot": "20260101t000000z-00000000"}
        assert create("/v1/collections/c", json=both, headers=AUTH).status_code == 422
        assert create("/v1/collections/c", json={"model": "tiny.onnx"}).status_code == 401
        unknown = create(
            "/v1/collections/c", json={"snapshot": "20260101t000000z-00000000"}, headers=AUTH
        )
        assert unknown.status_code == 404
        assert (
            client.put("/v1/aliases/a", json={"collection": "b"}, headers=AUTH).status_code == 409
        )
        assert (
            client.put("/v1/aliases/x", json={"collection": "zz"}, headers=AUTH).status_code == 404
        )
        assert client.get("/v1/collections/%C2%84/info").status_code == 422
        promote = {"collection": "b", "metric": "ndcg"}  # refused before any evaluation
        assert client.post("/v1/aliases/x/promote", json=promote, headers=AUTH).status_code == 422
        promote["metric"] = "recall@1"
        assert client.post("/v1/aliases/x/promote", json=promote, headers=AUTH).status_code == 404


def test_a_server_of_one_index_is_the_collection_default(
    digits_gallery: dict[str, Path], served_index: Path
) -> None:
    key = first_key(digits_gallery)
    with make_client(digits_gallery["model"], served_index) as client:
        one = client.post("/v1/collections/default/search", json={"key": key, "k": 3})
        plain = client.post("/v1/search", json={"key": key, "k": 3})
        assert one.status_code == plain.status_code == 200
        assert one.json()["hits"] == plain.json()["hits"] and len(plain.json()["hits"]) == 3
        assert client.post("/v1/collections/other/search", json={"k": 1}).status_code == 404
        listing = client.get("/v1/collections")
        assert listing.status_code == 400 and listing.json()["code"] == "no_data_folder"


def test_a_reembed_job_builds_a_new_collection_and_a_cancelled_one_goes_on(
    digits_gallery: dict[str, Path], tiny_onnx_other: Path, tmp_path: Path
) -> None:
    """The digits gallery (built from image files) moved in as a collection, embedded
    again by another model over HTTP: a cancelled job keeps nothing served, the same
    request goes on to the whole collection, which then answers searches."""
    (tmp_path / "data").mkdir()
    data = DataFolder(tmp_path / "data")
    shutil.copytree(digits_gallery["index"], data.root / "collections" / "digits")
    shutil.copy(tiny_onnx_other, data.root / MODELS_DIR / "other.onnx")
    body = {"model": "other.onnx", "collection": "digits-v2"}

    def finish(client: TestClient, job: str) -> dict:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            answer = client.get(f"/v1/collections/digits/reembed/{job}", headers=AUTH).json()
            if answer["status"] != "running":
                return answer
            time.sleep(0.05)
        raise AssertionError("the job did not end")

    with serve(data) as client:
        assert client.post("/v1/collections/digits/reembed", json=body).status_code == 401
        started = client.post("/v1/collections/digits/reembed", json=body, headers=AUTH)
        assert started.status_code == 202, started.text
        cancelled = client.delete(
            f"/v1/collections/digits/reembed/{started.json()['job']}", headers=AUTH
        )
        assert cancelled.status_code == 200
        first = finish(client, started.json()["job"])
        assert first["status"] in ("stopped", "done")
        if first["status"] == "stopped":
            assert "digits-v2" not in listed(client)  # nothing served half built
            again = client.post("/v1/collections/digits/reembed", json=body, headers=AUTH)
            assert finish(client, again.json()["job"])["status"] == "done"
        after = listed(client)
        assert after["digits-v2"]["count"] == after["digits"]["count"] == 120
        assert after["digits-v2"]["model"] != after["digits"]["model"]
        taken = client.post("/v1/collections/digits/reembed", json=body, headers=AUTH)
        assert taken.status_code == 409  # the name is a collection now
        bad = {"model": "nope.onnx", "collection": "digits-v3"}
        assert (
            client.post("/v1/collections/digits/reembed", json=bad, headers=AUTH).status_code == 422
        )
        key = first_key(digits_gallery)
        found = client.post("/v1/collections/digits-v2/search", json={"key": key, "k": 1})
        assert found.status_code == 200, found.text
        assert found.json()["hits"][0]["key"] != key  # the item itself left out


def test_a_deleted_collections_snapshots_stay_out_of_reach_of_its_name(
    folder: DataFolder,
) -> None:
    """A new collection under a deleted one's name cannot list or restore the old
    one's snapshots (another tenant's backups); they stay on disk, moved aside."""
    with serve(folder) as client:
        taken = client.post("/v1/collections/b/snapshots", headers=AUTH).json()["snapshot"]
        assert client.delete("/v1/collections/b", headers=AUTH).status_code == 200
        made = client.put("/v1/collections/b", json={"model": "tiny.onnx"}, headers=AUTH)
        assert made.status_code == 201
        assert client.get("/v1/collections/b/snapshots").json()["snapshots"] == []
        again = client.put("/v1/collections/c", json={"snapshot": taken}, headers=AUTH)
        assert again.status_code == 404
        kept = list((folder.root / "snapshots").glob(f".deleted-b-*/{taken}.tar"))
        assert len(kept) == 1
