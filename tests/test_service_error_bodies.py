"""What the service answers when its storage fails or the index refuses a request: a
full or failing disk is a 503 `storage_unavailable` on every kind of add (an image
kept under INDEX/uploads as much as a journalled vector), and no answer names a
server path or a command that does not exist; the details go to the log. The
command line, whose user owns the machine, keeps the paths in its messages."""

from __future__ import annotations

import errno
import io
import json
import logging
import pathlib
import sqlite3

import numpy as np
import pytest
from app_client import AUTH, make_client
from PIL import Image

from vitrieval.index.pipeline.embeddings_folder import write_part
from vitrieval.index.runtime.embedder import Embedder
from vitrieval.index.shards.build import build_shard, build_sharded
from vitrieval.index.store import IndexStore, StoreError

VECTOR = [1.0] + [0.0] * 127


def png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (40, 40), (200, 30, 90)).save(buffer, format="PNG")
    return buffer.getvalue()


def assert_names_no_path(text: str, *paths: pathlib.Path) -> None:
    for path in paths:
        assert str(path) not in text and str(path.resolve()) not in text, text
    assert "/tmp" not in text and ".sqlite" not in text, text


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EIO])
def test_an_image_add_on_a_full_disk_is_a_503_and_stores_nothing(
    digits_gallery, served_index, monkeypatch, caplog, code: int
) -> None:
    write_bytes = pathlib.Path.write_bytes

    def full_disk(self: pathlib.Path, data: bytes) -> int:
        if "uploads" in self.parts:  # where the service keeps an added image
            raise OSError(code, "simulated", str(self))
        return write_bytes(self, data)

    monkeypatch.setattr(pathlib.Path, "write_bytes", full_disk)
    with make_client(digits_gallery["model"], served_index) as client:
        files = {"image": ("new.png", png(), "image/png")}
        with caplog.at_level(logging.ERROR, logger="vitrieval.service"):
            added = client.post("/v1/items", files=files, data={"key": "new"}, headers=AUTH)
        assert added.status_code == 503, added.text
        assert added.json()["code"] == "storage_unavailable"
        assert "nothing was stored" in added.json()["detail"]
        assert_names_no_path(added.text, served_index)
        assert client.get("/v1/items/new").status_code == 404
        # the detail, with the file it concerns, is in the log
        assert any("uploads" in record.getMessage() for record in caplog.records)
    assert not [p for p in (served_index / "uploads").rglob("*") if p.is_file()]


class FullJournal:
    """The journal's SQLite connection on a full disk: every write transaction fails as
    SQLite reports it."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def execute(self, sql: str, *args):
        if sql.startswith("BEGIN"):
            raise sqlite3.OperationalError("database or disk is full")
        return self.db.execute(sql, *args)

    def __getattr__(self, name: str):
        return getattr(self.db, name)


def test_a_failing_journal_is_a_503_that_names_no_file(digits_gallery, served_index) -> None:
    with make_client(digits_gallery["model"], served_index) as client:
        journal = client.app.state.service.store._state.journal
        journal._db = FullJournal(journal._db)
        answers = [
            client.post("/v1/items", json={"key": "v", "vector": VECTOR}, headers=AUTH),
            client.delete("/v1/items/1/digits_00001.png", headers=AUTH),
        ]
        for answer in answers:
            assert answer.status_code == 503 and answer.json()["code"] == "storage_unavailable"
            assert_names_no_path(answer.text, served_index)
        journal._db = journal._db.db
        assert client.get("/v1/items/v").status_code == 404
        assert client.get("/v1/items/1/digits_00001.png").status_code == 200


def test_a_damaged_index_refuses_changes_without_naming_its_files(
    digits_gallery, served_index
) -> None:
    with make_client(digits_gallery["model"], served_index) as client:
        store = client.app.state.service.store
        store._state._damaged = {1: f"{served_index}/seg.1.items.sqlite: checksum mismatch"}
        added = client.post("/v1/items", json={"key": "v", "vector": VECTOR}, headers=AUTH)
        assert added.status_code == 503 and added.json()["code"] == "storage_unavailable"
        assert "restored from a backup" in added.json()["detail"]
        assert_names_no_path(added.text, served_index)


def test_dba_without_dba_vectors_names_the_real_command_and_no_path(
    digits_gallery, served_index
) -> None:
    with make_client(digits_gallery["model"], served_index) as client:
        found = client.post("/v1/search", json={"vector": VECTOR, "rerank": {"method": "dba"}})
        assert found.status_code == 422, found.text
        detail = found.json()["detail"]
        assert "no DBA vectors" in detail and "`vitrieval-index configure INDEX --dba`" in detail
        assert "vitrieval-index dba" not in detail
        assert_names_no_path(found.text, served_index)
    # the command line's user owns the machine: its message names the folder
    with IndexStore.open(served_index) as store, pytest.raises(StoreError) as raised:
        store.search(np.asarray([VECTOR], np.float32), 1, augmented=True)
    assert f"vitrieval-index configure {served_index} --dba" in str(raised.value)


def test_dba_on_a_sharded_index_says_it_cannot_have_any(tiny_onnx, tmp_path) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((30, 128)).astype(np.float32)
    emb = tmp_path / "emb"
    write_part(emb / "part-00000.parquet", [f"k{i}" for i in range(len(x))], x)
    meta = {"dim": 128, "model_fingerprint": Embedder(tiny_onnx).fingerprint}
    (emb / "embeddings.json").write_text(json.dumps(meta))
    jobs = lambda js: [build_shard(**job) for job in js]  # noqa: E731
    build_sharded(emb, tmp_path / "sharded", tiny_onnx, "Flat", 2, 256, run_shards=jobs)
    with make_client(tiny_onnx, tmp_path / "sharded", read_only=True) as client:
        found = client.post("/v1/search", json={"vector": VECTOR, "rerank": {"method": "dba"}})
        assert found.status_code == 422, found.text
        assert "this index is sharded" in found.json()["detail"]
        assert "no DBA vectors" in found.json()["detail"]
        assert_names_no_path(found.text, tmp_path)


def test_store_errors_answer_their_public_sentence_or_none_naming_a_path(caplog) -> None:
    from vitrieval.service.errors import INDEX_REFUSED, store_error

    plain = store_error(StoreError("k must be an integer >= 1, got 0"), 422, "invalid_request")
    assert (plain.status, plain.detail) == (422, "k must be an integer >= 1, got 0")
    public = StoreError("/srv/idx/shard-001 must be trained first", public="not trained yet")
    assert store_error(public, 409, "index_refused").detail == "not trained yet"
    with caplog.at_level(logging.WARNING, logger="vitrieval.service"):
        hidden = store_error(StoreError("/srv/idx: cannot read seg.3"), 409, "index_refused")
    assert (hidden.status, hidden.code, hidden.detail) == (409, "index_refused", INDEX_REFUSED)
    assert "/srv/idx: cannot read seg.3" in caplog.text
    keyed = store_error(StoreError("key 'shop/12' is odd"), 422, "invalid_request")
    assert keyed.detail == "key 'shop/12' is odd"  # a key's slash is not a server path


def test_an_add_to_an_untrained_index_names_a_command_not_a_python_call(
    digits_gallery, tmp_path
) -> None:
    index = tmp_path / "untrained"
    store = IndexStore.create(
        index, dim=128, factory="IVF4,Flat", model_path=digits_gallery["model"]
    )
    store.save()
    store.close()
    with make_client(digits_gallery["model"], index) as client:
        added = client.post("/v1/items", json={"key": "k", "vector": VECTOR}, headers=AUTH)
    assert added.status_code == 409, added.text
    assert "not trained yet" in added.json()["detail"]
    assert "vitrieval-index build" in added.json()["detail"]
    assert "train(vectors)" not in added.text
    assert_names_no_path(added.text, index)
