"""Keys with dot segments (`.`, `..`) or empty segments (`a//b`, a `/` at either end)
are refused wherever items are added (the service, `vitrieval-index build` and `add`):
HTTP clients rewrite such URL paths, so the item could not be read or deleted by key,
and a request meant for it could reach another item (with httpx, `DELETE
/v1/items/v/.` deleted the item `v`). An index that already holds such keys still
opens, searches, and `vitrieval-index remove` deletes them."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
from urllib.parse import quote

import httpx
import numpy as np
import pytest
from index_cli_helpers import run
from serving import Server

from vitrieval.index.pipeline.embeddings_folder import write_part
from vitrieval.index.runtime.embedder import Embedder
from vitrieval.index.store import IndexStore
from vitrieval.index.store.validation import key_problem

KEY = "server-test-key-0123"
AUTH = {"X-API-Key": KEY}
REFUSED = [".", "..", "v/.", "v/..", "./v", "../v", "a/./b", "a/../b", "a//b", "//v", "v/", "/"]
REFUSED += ["/./v", "/../v"]
ACCEPTED = ["v", "shop/12", ".hidden/x", "..a/b..", "a/.b/c.", "...", "a.b/c"]
ACCEPTED += ["/data/photos/x.jpg"]  # a CSV list's path as written: a key, as before


def vector(i: int) -> list[float]:
    v = [0.0] * 128
    v[i % 128] = 1.0
    return v


@pytest.mark.parametrize("key", REFUSED)
def test_the_rule_refuses_dot_and_empty_segments(key: str) -> None:
    problem = key_problem(key)
    assert problem is not None and "segment" in problem


@pytest.mark.parametrize("key", ACCEPTED)
def test_the_rule_accepts_dots_inside_segments(key: str) -> None:
    assert key_problem(key) is None


def test_a_real_server_refuses_them_and_serves_every_key_it_accepts(
    digits_gallery, served_index
) -> None:
    """httpx and plain curl (no --path-as-is) as clients: every accepted key can be read
    and deleted by URL; every refused key is a 422 at add, before anything is stored."""
    curl = shutil.which("curl")
    env = {"VITRIEVAL_API_KEY": KEY}
    with Server(digits_gallery["model"], served_index, env=env) as server:
        http = httpx.Client(base_url=server.url, timeout=30)
        for key in REFUSED:
            for request in (
                {"json": {"key": key, "vector": vector(1)}},
                {"files": {"image": ("a.png", b"not read", "image/png")}, "data": {"key": key}},
            ):
                added = http.post("/v1/items", headers=AUTH, **request)
                assert added.status_code == 422, (key, added.text)
                assert added.json()["code"] == "invalid_request"
                assert "segment" in added.json()["detail"], added.text
        count = http.get("/v1/info").json()["index"]["count"]
        for i, key in enumerate(ACCEPTED):
            added = http.post("/v1/items", json={"key": key, "vector": vector(i)}, headers=AUTH)
            assert added.status_code == 201, (key, added.text)
        assert http.get("/v1/info").json()["index"]["count"] == count + len(ACCEPTED)
        for key in ACCEPTED:
            url = "/v1/items/" + quote(key)
            got = http.get(url)
            assert got.status_code == 200 and got.json()["key"] == key, (key, got.text)
            if curl is not None:
                shown = subprocess.run(
                    [curl, "-s", server.url + url], capture_output=True, text=True, check=True
                )
                assert json.loads(shown.stdout)["key"] == key
        for n, key in enumerate(ACCEPTED):
            url = server.url + "/v1/items/" + quote(key)
            if curl is not None and n % 2:
                deleted = subprocess.run(
                    [curl, "-s", "-X", "DELETE", "-H", f"X-API-Key: {KEY}", url],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
            else:
                deleted = http.delete(url, headers=AUTH).text
            assert json.loads(deleted) == {"key": key, "deleted": True}
        assert http.get("/v1/info").json()["index"]["count"] == count
    if curl is None:
        pytest.skip("curl is not installed: checked with httpx only")


def test_build_and_add_refuse_them_before_anything_is_written(
    tmp_path, capsys, digits_gallery, tiny_onnx
) -> None:
    images = sorted(digits_gallery["images"].rglob("*.png"))[:3]
    listing = tmp_path / "list.csv"
    with open(listing, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["path", "label", "key"])
        writer.writerows([[images[0], "x", "fine/1"], [images[1], "x", "photos/../secret"]])
    build = ("build", "--model", tiny_onnx, "--images", listing, "--out", tmp_path / "idx")
    code, _, err = run(capsys, *build)
    assert code == 2 and err.count("\n") == 1 and "'photos/../secret'" in err
    assert "a '..' segment" in err and not (tmp_path / "idx" / "manifest.json").exists()
    # an embeddings folder's keys: refused by the key pass, before any is added
    emb = tmp_path / "emb"
    write_part(emb / "part-00000.parquet", ["ok", "a//b"], np.eye(2, 128, dtype=np.float32))
    meta = {"dim": 128, "model_fingerprint": Embedder(tiny_onnx).fingerprint}
    (emb / "embeddings.json").write_text(json.dumps(meta))
    for shards in ((), ("--shards", "2")):
        out = tmp_path / f"from-emb{len(shards)}"
        code, _, err = run(
            capsys, "build", "--embeddings", emb, "--model", tiny_onnx, "--out", out, *shards
        )
        assert code == 2 and "key 'a//b'" in err and "empty" in err, err
        assert not (out / "manifest.json").exists() and not (out / "shards.json").exists()


def test_an_index_holding_such_keys_opens_searches_and_removes_them(
    tmp_path, capsys, digits_gallery
) -> None:
    """An index of an earlier version (the store's own add does not apply the rule, nor
    does its journal's replay): it opens, its odd keys are searchable and removable, and
    `add` of other items still works."""
    index = tmp_path / "idx"
    shutil.copytree(digits_gallery["index"], index)
    with IndexStore.open(index) as store:
        store.add(["v/.", "./w"], np.asarray([vector(3), vector(4)], np.float32))
        store.save()
    with IndexStore.open(index) as store:
        found = store.search(np.asarray([vector(3), vector(4)], np.float32), 1)
        assert [row[0].key for row in found] == ["v/.", "./w"]
    fresh = sorted(digits_gallery["images"].rglob("*.png"))[0]
    listing = tmp_path / "more.csv"
    listing.write_text(f"path,label,key\n{fresh},x,more/./1\n")
    code, _, err = run(capsys, "add", index, "--images", listing)
    assert code == 2 and "key 'more/./1'" in err and "a '.' segment" in err
    code, _, err = run(capsys, "add", index, fresh, "--key", "more/../1")
    assert code == 2 and "key 'more/../1'" in err and "a '..' segment" in err
    listing.write_text(f"path,label,key\n{fresh},x,more/1\n")
    assert run(capsys, "add", index, "--images", listing)[0] == 0
    code, out, err = run(capsys, "remove", index, "v/.", "./w")
    assert "removed 2 of 2 keys" in out
    assert code == 0, err
    with IndexStore.open(index) as store:
        assert "v/." not in store and "./w" not in store and "more/1" in store
