"""Integers outside int64 (the store's integers) are the client's mistake, named where
they are, and never reach the journal: HTTP 422 for item metadata, a filter's match,
any and range bound, and /v1/evaluate's filter; one line and exit 2 from `build
--embeddings`; a journal row an older version wrote that cannot be applied stops the
open in one line, and `verify --repair` sets it aside keeping every other row; an
index holding such metadata (or a key clients rewrite) still opens, re-indexes its
fields, and `verify` lists them."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from app_client import AUTH

from vitrieval.index.pipeline.embeddings_folder import write_meta, write_part
from vitrieval.index.runtime.model_metadata import read_model_metadata
from vitrieval.index.store import IndexStore, StoreError
from vitrieval.index.store._journal import Journal

HUGE = [2**63, -(2**63) - 1, 10**400]
DIM = 8


def vector(seed: int, dim: int = 128) -> list[float]:
    v = np.random.default_rng(seed).standard_normal(dim)
    return (v / np.linalg.norm(v)).tolist()


def unit(seed: int) -> np.ndarray:
    return np.asarray(vector(seed, DIM), dtype=np.float32)[None, :]


def vitrieval_index(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vitrieval.index.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def one_line(err: str) -> bool:
    return err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("value", HUGE)
def test_metadata_integers_outside_int64_are_422_naming_the_field(client, value) -> None:
    body = {"key": "big", "vector": vector(0), "metadata": {"shop": {"id": [1, value]}}}
    made = client.post("/v1/items", headers=AUTH, json=body)
    assert made.status_code == 422, made.text
    assert "metadata.shop.id[1]" in made.json()["detail"]
    assert "64-bit" in made.json()["detail"]
    assert client.get("/v1/items/big").status_code == 404
    # the largest integers that fit are kept exactly
    body["metadata"] = {"shop": {"id": [2**63 - 1, -(2**63)]}}
    assert client.post("/v1/items", headers=AUTH, json=body).status_code == 201
    stored = client.get("/v1/items/big").json()["metadata"]
    assert stored == {"shop": {"id": [2**63 - 1, -(2**63)]}}
    assert client.get("/healthz").status_code == 200


@pytest.mark.parametrize(
    ("flt", "named"),
    [
        ({"must": [{"key": "n", "match": 2**63}]}, "filter.must[0].match"),
        ({"must": [{"key": "n", "match": {"any": [1, -(2**63) - 1]}}]}, "match.any[1]"),
        ({"must_not": [{"key": "n", "range": {"gt": 10**400}}]}, "range.gt"),
    ],
)
def test_filter_integers_outside_int64_are_422(client, flt, named) -> None:
    searched = client.post("/v1/search", json={"vector": vector(1), "k": 3, "filter": flt})
    assert searched.status_code == 422, searched.text
    assert named in searched.json()["detail"] and "64-bit" in searched.json()["detail"]
    evaluated = client.post("/v1/evaluate", json={"ks": [1], "filter": flt})
    assert evaluated.status_code == 422, evaluated.text
    assert "64-bit" in evaluated.json()["detail"]


def test_a_float_bound_beyond_int64_is_a_float(client) -> None:
    flt = {"must": [{"key": "label", "range": {"gt": -1e300}}]}
    searched = client.post("/v1/search", json={"vector": vector(1), "k": 3, "filter": flt})
    assert searched.status_code == 200, searched.text


def test_build_from_a_parquet_row_with_a_huge_integer_is_one_line(tmp_path, tiny_onnx) -> None:
    folder = tmp_path / "emb"
    x = np.asarray([vector(0), vector(1)], dtype=np.float32)
    write_part(folder / "part-00000.parquet", ["a", "b"], x, metadata=[{"id": 1}, {"id": 2**64}])
    fingerprint = read_model_metadata(tiny_onnx).fingerprint
    write_meta(folder, {"dim": 128, "model_fingerprint": fingerprint})
    out = str(tmp_path / "index")
    done = vitrieval_index(
        "build", "--embeddings", str(folder), "--model", str(tiny_onnx), "--out", out
    )
    assert done.returncode == 2, done.stderr
    assert one_line(done.stderr), done.stderr
    assert "'b'" in done.stderr and "metadata.id" in done.stderr


def test_an_index_already_holding_such_items_opens_and_verify_lists_them(
    tmp_path, monkeypatch
) -> None:
    directory = tmp_path / "index"
    with monkeypatch.context() as older:  # an older version did not check
        older.setattr(
            "vitrieval.index.store.validation.find_outside_int64", lambda value, where: None
        )
        store = IndexStore.create(directory, dim=DIM, factory="Flat")
        store.add(
            ["a", "b", "v/."],
            np.concatenate([unit(0), unit(1), unit(2)]),
            metadata=[{"id": 1}, {"id": 2**64}, {}],
        )
        store.save()
        store.close()
    with IndexStore.open(directory) as store:
        assert store.get("b").metadata == {"id": 2**64}
        hits = store.search(unit(1), 3, filter={"must": [{"key": "id", "range": {"gt": 0}}]})[0]
        assert [h.key for h in hits] == ["a"]  # filters do not see the huge value
    configured = vitrieval_index("configure", str(directory), "--filter-fields", "all")
    assert configured.returncode == 0, configured.stderr
    verified = vitrieval_index("verify", str(directory))
    assert verified.returncode == 0, verified.stderr
    assert "2 item(s)" in verified.stdout and "'b'" in verified.stdout
    removed = vitrieval_index("remove", str(directory), "b", "v/.")
    assert removed.returncode == 0, removed.stderr
    with IndexStore.open(directory) as store:
        assert store.keys() == ["a"]


def test_an_older_journal_row_stops_the_open_in_one_line_and_repair_sets_it_aside(
    tmp_path,
) -> None:
    directory = tmp_path / "index"
    store = IndexStore.create(directory, dim=DIM, factory="Flat")
    store.add(["a"], unit(0))
    store.save()
    store.close()
    # rows as an older version journalled them: the middle one cannot be applied
    journal = Journal(directory / "journal.sqlite", DIM)
    journal.append("add", ["b"], vectors=unit(1), metadata=[json.dumps({"n": 1})])
    journal.append("add", ["c"], vectors=unit(2), metadata=[json.dumps({"n": 2**70})])
    journal.append("add", ["d"], vectors=unit(3), metadata=[json.dumps({"n": 3})])
    journal.close()

    with pytest.raises(StoreError, match=r"journal row 2 \(add of key 'c'\).*--repair"):
        IndexStore.open(directory)
    info = vitrieval_index("info", str(directory))
    assert info.returncode == 2 and one_line(info.stderr), info.stderr
    assert "verify --repair" in info.stderr

    from vitrieval.index.store._journal_repair import REJECTED_FILE

    repaired = vitrieval_index("verify", "--repair", str(directory))
    assert repaired.returncode == 0, repaired.stderr
    assert "1 journal row(s)" in repaired.stdout
    (rejected,) = [
        json.loads(line) for line in (directory / REJECTED_FILE).read_text().splitlines()
    ]
    assert rejected["key"] == "c" and rejected["metadata"] == {"n": 2**70}
    assert "64-bit" in rejected["reason"]
    with IndexStore.open(directory) as reopened:
        assert sorted(reopened.keys()) == ["a", "b", "d"]
        assert reopened.get("d").metadata == {"n": 3}
