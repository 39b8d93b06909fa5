"""`on_duplicate: reject` on POST /v1/items: an item whose vector scores at least
`duplicate_threshold` against an indexed one is refused with a 409 `duplicate` naming
it (nothing added, no upload left behind); a replace is not its own duplicate; the
rule's fields are checked (422); the client sends them."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from vitrieval.client import calls
from vitrieval.index.store import IndexStore
from vitrieval.index.store import manifest as mf
from vitrieval.service.app import create_app
from vitrieval.service.settings import Settings

KEY = "duplicates-test-key-01"
DIM = 128  # the tiny model's


def png(shade: int) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (48, 48), (shade, 255 - shade, 90)).save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture
def client(tiny_onnx, tmp_path):
    index = tmp_path / "index"
    store = IndexStore.create(index, dim=DIM, factory="Flat", model_path=tiny_onnx)
    store.save()
    store.close()
    settings = Settings(model=tiny_onnx, index=index, api_key=KEY)
    with TestClient(create_app(settings), headers={"X-API-Key": KEY}) as test_client:
        yield test_client, index


def test_a_near_duplicate_add_is_refused_and_names_the_item(client) -> None:
    http, index = client
    assert http.post("/v1/items", json={"key": "a", "image_base64": png(10)}).status_code == 201
    uploads = sorted((index / "uploads").rglob("*")) if (index / "uploads").exists() else []
    again = {"key": "b", "image_base64": png(10), "on_duplicate": "reject"}
    refused = http.post("/v1/items", json={**again, "duplicate_threshold": 0.99})
    assert refused.status_code == 409, refused.text
    assert refused.json()["code"] == "duplicate" and "'a'" in refused.json()["detail"]
    assert http.get("/v1/items/b").status_code == 404
    assert (sorted((index / "uploads").rglob("*")) if uploads else []) == uploads
    # another image scores below the threshold: added
    other = {"key": "c", "image_base64": png(250), "on_duplicate": "reject"}
    vector_a = np.asarray(http.get("/v1/items/a?vector=true").json()["vector"])
    added = http.post("/v1/items", json={**other, "duplicate_threshold": 0.9999})
    vector_c = np.asarray(http.get("/v1/items/c?vector=true").json()["vector"])
    assert added.status_code == 201 and float(vector_a @ vector_c) < 0.9999
    # allow (the default) adds the copy; a replace is not a duplicate of itself
    assert http.post("/v1/items", json={"key": "b", "image_base64": png(10)}).status_code == 201
    replace = {**again, "key": "a", "replace": True, "duplicate_threshold": 0.99}
    answer = http.post("/v1/items", json=replace)
    assert answer.status_code == 409 and "'b'" in answer.json()["detail"]  # b is the copy
    http.delete("/v1/items/b")
    assert http.post("/v1/items", json=replace).status_code == 201


@pytest.mark.parametrize(
    "fields",
    [
        {"on_duplicate": "reject"},
        {"on_duplicate": "reject", "duplicate_threshold": 1.5},
        {"on_duplicate": "sometimes", "duplicate_threshold": 0.9},
    ],
)
def test_the_rule_is_checked(client, fields) -> None:
    http, _ = client
    answer = http.post("/v1/items", json={"key": "x", "vector": [1.0] * DIM, **fields})
    assert answer.status_code == 422 and answer.json()["code"] == "invalid_request", answer.text


def test_the_client_sends_the_rule_only_when_given() -> None:
    assert "on_duplicate" not in calls.add("k", vector=[1.0]).json
    body = calls.add("k", vector=[1.0], duplicate_threshold=0.95).json
    assert (body["on_duplicate"], body["duplicate_threshold"]) == ("reject", 0.95)


def test_a_calibrated_index_rejects_at_its_threshold_by_default(tiny_onnx, tmp_path) -> None:
    index = tmp_path / "index"
    store = IndexStore.create(index, dim=DIM, factory="Flat", model_path=tiny_onnx)
    level = mf.CalibrationLevel(0.99, 0.97, True, 1.0, (0.9, 1.0), 0.5, (0.4, 0.6), 10)
    store.set_calibration(mf.CalibrationEntry(0.99, (level,), 20, 40, 0, 0, "2026-01-01"))
    store.save()
    store.close()
    settings = Settings(model=tiny_onnx, index=index, api_key=KEY)
    with TestClient(create_app(settings), headers={"X-API-Key": KEY}) as http:
        info = http.get("/v1/info").json()["index"]["calibration"]
        assert info["threshold"] == 0.97 and info["levels"][0]["pairs"] == 10
        v, w = np.zeros(DIM), np.zeros(DIM)
        v[0], w[0], w[1] = 1.0, 0.98, np.sqrt(1 - 0.98**2)  # v . w = 0.98
        assert http.post("/v1/items", json=calls.add("a", vector=v).json).status_code == 201
        body = calls.add("b", vector=w, reject_duplicates=True).json
        assert body["on_duplicate"] == "reject" and "duplicate_threshold" not in body
        refused = http.post("/v1/items", json=body)
        assert refused.status_code == 409 and "calibrated threshold 0.97" in refused.text
        # a threshold in the request wins
        assert http.post("/v1/items", json={**body, "duplicate_threshold": 0.99}).status_code == 201
