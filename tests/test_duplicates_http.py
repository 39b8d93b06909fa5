"""Near-duplicates over HTTP: GET /v1/items/{key}/duplicates against brute force, and
the POST /v1/duplicates job against `find_duplicates` on the same index, with the
calibrated threshold as the default and the client's calls."""

from __future__ import annotations

import time

import numpy as np
import pytest
from fastapi.testclient import TestClient

from vitrieval.client import calls
from vitrieval.index.duplicates import find_duplicates
from vitrieval.index.store import IndexStore
from vitrieval.index.store import manifest as mf
from vitrieval.index.store.request import Where
from vitrieval.service.app import create_app
from vitrieval.service.settings import Settings

KEY = "duplicates-http-key-01"
DIM = 128  # the tiny model's


def planted(rng: np.random.Generator) -> tuple[list[str], np.ndarray]:
    """40 random items and near copies of 6 of them (one with two copies, chained)."""
    x = rng.standard_normal((40, DIM))
    keys = [f"item/{i:02d}" for i in range(40)]
    copies, names = [], []
    for i, n in ((0, 1), (3, 1), (7, 2), (12, 1), (20, 1), (33, 1)):
        for c in range(n):
            copies.append(x[i] + 0.15 * (c + 1) * rng.standard_normal(DIM))
            names.append(f"copy/{i:02d}-{c}")
    vectors = np.concatenate([x, np.asarray(copies)])
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    return keys + names, vectors.astype(np.float32)


def serve(tiny_onnx, tmp_path, calibration: mf.CalibrationEntry | None = None):
    keys, vectors = planted(np.random.default_rng(3))
    store = IndexStore.create(tmp_path / "index", dim=DIM, model_path=tiny_onnx)
    # labels: the originals alternate a / b, each copy takes its original's
    labels = ["ab"[int(key[-4:-2] if key.startswith("copy") else key[-2:]) % 2] for key in keys]
    store.add(keys, vectors, labels=labels)
    if calibration is not None:
        store.set_calibration(calibration)
    store.save()
    store.close()
    settings = Settings(model=tiny_onnx, index=tmp_path / "index", api_key=KEY)
    return TestClient(create_app(settings), headers={"X-API-Key": KEY}), keys, vectors


def send(http: TestClient, call: calls.Call):
    return http.request(call.method, call.path, params=call.params, json=call.json)


def calibrated(threshold: float) -> mf.CalibrationEntry:
    level = mf.CalibrationLevel(0.99, threshold, True, 1.0, (0.9, 1.0), 0.5, (0.4, 0.6), 9)
    return mf.CalibrationEntry(0.99, (level,), 20, 100, 0, 47, "2026-01-01T00:00:00Z")


def test_one_items_duplicates_equal_brute_force(tiny_onnx, tmp_path) -> None:
    http, keys, vectors = serve(tiny_onnx, tmp_path)
    with http:
        for threshold in (0.9, 0.97):
            for row in (7, 40, 5):
                answer = send(http, calls.item_duplicates(keys[row], threshold=threshold))
                assert answer.status_code == 200, answer.text
                scores = vectors @ vectors[row]
                expected = [
                    keys[i]
                    for i in np.argsort(-scores, kind="stable")
                    if i != row and scores[i] >= threshold
                ]
                body = answer.json()
                assert body["threshold"] == threshold
                assert [hit["key"] for hit in body["duplicates"]] == expected
        assert (
            send(http, calls.item_duplicates("item/07", threshold=0.9, limit=1))
            .json()["duplicates"][0]["key"]
            .startswith("copy/07")
        )
        missing = send(http, calls.item_duplicates("nobody", threshold=0.9))
        assert missing.status_code == 404 and missing.json()["code"] == "unknown_key"
        uncalibrated = send(http, calls.item_duplicates("item/07"))
        assert uncalibrated.status_code == 422 and "calibrate" in uncalibrated.json()["detail"]
        wrong = http.get("/v1/items/item/07/duplicates", params={"threshold": "2"})
        assert wrong.status_code == 422
        # a key ending in the sub-route's name cannot be added: it would be unreachable
        refused = http.post("/v1/items", json={"key": "a/duplicates", "vector": [1.0] * DIM})
        assert refused.status_code == 422 and "sub-route" in refused.text


def wait(http: TestClient, job: str) -> dict:
    for _ in range(600):
        body = send(http, calls.duplicates_job(job)).json()
        if body["status"] != "running":
            return body
        time.sleep(0.05)
    raise AssertionError(f"job {job} still running")


@pytest.mark.parametrize("by", ["threshold", "calibrated"])
def test_the_job_finds_the_groups_the_command_finds(tiny_onnx, tmp_path, by) -> None:
    http, keys, _ = serve(tiny_onnx, tmp_path, calibrated(0.9))
    call = calls.start_duplicates(threshold=0.9) if by == "threshold" else calls.start_duplicates()
    with http:
        started = send(http, call)
        assert started.status_code == 202, started.text
        body = started.json()
        assert body["threshold"] == 0.9 and body["status"] in ("running", "done")
        done = wait(http, body["job"])
        assert done["status"] == "done" and done["searched"] == len(keys), done
    with IndexStore.open(tmp_path / "index") as store:
        expected = [group.as_json() for group in find_duplicates(store, 0.9)]
    got = [{**g, "pairs": [list(p) for p in g["pairs"]]} for g in done["groups"]]
    assert got == expected
    # the planted copies, and nothing else: each original with its copies
    assert sorted(tuple(g["keys"]) for g in got) == sorted(
        tuple(sorted([k, *[c for c in keys if c.startswith(f"copy/{k[5:]}-")]]))
        for k in ("item/00", "item/03", "item/07", "item/12", "item/20", "item/33")
    )


def test_unknown_jobs_and_bad_rules_are_clear(tiny_onnx, tmp_path) -> None:
    http, _, _ = serve(tiny_onnx, tmp_path)
    with http:
        answer = send(http, calls.duplicates_job("0123456789abcdef"))
        assert answer.status_code == 404 and answer.json()["code"] == "unknown_job"
        assert send(http, calls.start_duplicates()).status_code == 422  # never calibrated
        bad = send(http, calls.start_duplicates(threshold=0.9, keep="newest"))
        assert bad.status_code == 422 and "keep must be one of" in bad.text
        precision = send(http, calls.start_duplicates(precision=0.99))
        assert precision.status_code == 422 and "no calibrated" in precision.text
        both = send(http, calls.start_duplicates(0.9, precision=0.99))
        assert both.status_code == 422 and "not both" in both.text
        both = send(http, calls.item_duplicates("item/07", threshold=0.9, precision=0.99))
        assert both.status_code == 422 and "not both" in both.text


def test_the_default_limit_follows_a_lower_max_k(tiny_onnx, tmp_path) -> None:
    keys, vectors = planted(np.random.default_rng(3))
    store = IndexStore.create(tmp_path / "index", dim=DIM, model_path=tiny_onnx)
    store.add(keys, vectors)
    store.save()
    store.close()
    settings = Settings(model=tiny_onnx, index=tmp_path / "index", api_key=KEY, max_k=1)
    with TestClient(create_app(settings), headers={"X-API-Key": KEY}) as http:
        answer = send(http, calls.item_duplicates("item/07", threshold=0.5))
        assert answer.status_code == 200 and len(answer.json()["duplicates"]) == 1
        assert (
            send(http, calls.item_duplicates("item/07", threshold=0.5, limit=2)).status_code == 422
        )


def test_a_job_over_one_label_finds_that_labels_groups(tiny_onnx, tmp_path) -> None:
    http, _, _ = serve(tiny_onnx, tmp_path)
    with http:
        body = send(http, calls.start_duplicates(0.9, label="b")).json()
        done = wait(http, body["job"])
    with IndexStore.open(tmp_path / "index") as store:
        expected = [
            g.as_json() for g in find_duplicates(store, 0.9, filter=Where(label="b").allowed)
        ]
    assert [g["keys"] for g in done["groups"]] == [g["keys"] for g in expected]
    # the odd originals (03, 07, 33) and their copies
    assert sorted(g["keys"][-1] for g in done["groups"]) == ["item/03", "item/07", "item/33"]
