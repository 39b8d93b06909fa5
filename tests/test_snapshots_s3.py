"""Snapshots to and from object storage (index/remote_files.py): `vitrieval-index
snapshot INDEX --out s3://...` and `restore s3://... --out DIR` against moto's S3 server
on loopback, a real S3 API; a failed upload leaves no object."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import numpy as np
import pytest
from index_cli_helpers import run  # tests/index_cli_helpers.py
from store_helpers import unit_vectors

from vitrieval.index.remote_files import writing
from vitrieval.index.store import IndexStore

BUCKET = "vitrieval-backups"


@pytest.fixture(scope="module")
def s3() -> str:
    """moto's S3 server on a free loopback port, the AWS settings pointing at it, and
    the bucket BUCKET; the endpoint's URL."""
    import boto3
    from moto.server import ThreadedMotoServer

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    settings = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
    }
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
    try:
        yield endpoint
    finally:
        server.stop()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def objects(endpoint: str) -> list[str]:
    import boto3

    listed = boto3.client("s3", endpoint_url=endpoint).list_objects_v2(Bucket=BUCKET)
    return sorted(entry["Key"] for entry in listed.get("Contents", []))


def test_snapshot_to_s3_and_restore_from_it(s3: str, tmp_path: Path, capsys) -> None:
    rng = np.random.default_rng(0)
    store = IndexStore.create(tmp_path / "index", dim=16)
    store.add([f"a{i}" for i in range(50)], unit_vectors(rng, 50, 16), labels=["x"] * 50)
    store.save()
    store.close()
    with IndexStore.open(tmp_path / "index", journal=True) as live:  # rows in the journal
        live.add([f"b{i}" for i in range(7)], unit_vectors(rng, 7, 16))
        live.remove(["a0"])
    url = f"s3://{BUCKET}/shop/backup.tar"
    code, _, err = run(capsys, "snapshot", tmp_path / "index", "--out", url)
    assert code == 0, err
    assert objects(s3) == ["shop/backup.tar"]
    code, _, err = run(capsys, "restore", url, "--out", tmp_path / "restored")
    assert code == 0, err
    with IndexStore.open(tmp_path / "index") as a, IndexStore.open(tmp_path / "restored") as b:
        assert sorted(a.keys()) == sorted(b.keys()) and len(b) == 56
        assert np.array_equal(a.get("b3").vector, b.get("b3").vector)
    code, _, err = run(capsys, "restore", f"s3://{BUCKET}/nothing.tar", "--out", tmp_path / "x")
    assert code == 2 and "not found" in err and len(err.strip().splitlines()) == 1


def test_an_upload_that_fails_part_way_leaves_no_object(s3: str) -> None:
    url = f"s3://{BUCKET}/broken.tar"
    with pytest.raises(RuntimeError), writing(url) as fh:
        fh.write(b"x" * (6 * 2**20))  # past one part: a multipart upload has begun
        raise RuntimeError("the snapshot failed")
    assert "broken.tar" not in objects(s3)


def test_a_collection_is_created_from_a_snapshot_on_s3(
    s3: str, tmp_path: Path, tiny_onnx: Path, capsys
) -> None:
    """PUT /v1/collections/{name} {"snapshot": "s3://..."}: the server restores it."""
    import shutil

    from app_client import AUTH, KEY  # tests/app_client.py
    from fastapi.testclient import TestClient

    from vitrieval.index.collections import MODELS_DIR, DataFolder
    from vitrieval.service.app import create_data_app
    from vitrieval.service.settings import Settings

    (tmp_path / "data").mkdir()
    folder = DataFolder(tmp_path / "data")
    shutil.copy(tiny_onnx, folder.root / MODELS_DIR / "tiny.onnx")
    folder.create("shop", "tiny.onnx")
    with IndexStore.open(folder.path("shop")) as store:
        store.add([f"s{i}" for i in range(9)], unit_vectors(np.random.default_rng(1), 9, 128))
        store.save()
    url = f"s3://{BUCKET}/shop.tar"
    assert run(capsys, "snapshot", folder.path("shop"), "--out", url)[0] == 0
    with TestClient(create_data_app(Settings(data=folder.root, api_key=KEY))) as client:
        made = client.put("/v1/collections/copy", json={"snapshot": url}, headers=AUTH)
        assert made.status_code == 201, made.text
        assert made.json()["count"] == 9 and made.json()["dim"] == 128
        scrolled = client.post("/v1/collections/copy/scroll", json={"limit": 100}).json()
        assert [item["key"] for item in scrolled["items"]] == sorted(f"s{i}" for i in range(9))
        missing = {"snapshot": f"s3://{BUCKET}/none.tar"}
        gone = client.put("/v1/collections/other", json=missing, headers=AUTH)
        assert gone.status_code == 422 and "copy" in {c["name"] for c in
            client.get("/v1/collections").json()["collections"]}  # fmt: skip
        assert "other" not in {
            c["name"] for c in client.get("/v1/collections").json()["collections"]
        }
