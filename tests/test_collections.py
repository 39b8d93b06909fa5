"""The data folder of collections and aliases (index/collections.py): names share one
namespace, aliases always name a collection (also after SIGKILL during a switch), a
collection an alias names cannot be deleted, an index folder moved in is a collection."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vitrieval.index.collections import (
    ALIASES_FILE,
    COLLECTIONS_DIR,
    MODELS_DIR,
    DataFolder,
    NameTaken,
    UnknownCollection,
)
from vitrieval.index.store import IndexStore, StoreError


@pytest.fixture
def data(tmp_path: Path, tiny_onnx: Path, tiny_onnx_other: Path) -> DataFolder:
    folder = DataFolder(tmp_path)
    shutil.copy(tiny_onnx, tmp_path / MODELS_DIR / "tiny.onnx")
    shutil.copy(tiny_onnx_other, tmp_path / MODELS_DIR / "other.onnx")
    return folder


def test_collections_of_two_models_side_by_side(data: DataFolder, tiny_onnx: Path) -> None:
    data.create("shop", "tiny.onnx")
    data.create("staging", "other.onnx", factory="HNSW32")
    assert data.names() == ["shop", "staging"]
    with IndexStore.open(data.path("shop")) as a, IndexStore.open(data.path("staging")) as b:
        assert a.fingerprint != b.fingerprint and a.dim == b.dim == 128
        assert a.info()["factory"] == "Flat" and b.info()["factory"] == "HNSW32"
        assert Path(a.model_path).parent == data.path("shop")  # its own model copy
    with pytest.raises(NameTaken):
        data.create("shop", "tiny.onnx")
    for bad in ("Shop", "-x", "a/b", "", "x" * 65, ".."):
        with pytest.raises(StoreError, match="not valid"):
            data.create(bad, "tiny.onnx")
    for missing in ("nope.onnx", "../tiny.onnx", f"{MODELS_DIR}/tiny.onnx"):
        with pytest.raises(StoreError, match="no model file"):
            data.create("third", missing)
    # an index folder moved in is a collection
    moved = data.root / COLLECTIONS_DIR / "moved"
    shutil.copytree(data.path("shop"), moved)
    assert "moved" in data.names()


def test_aliases_share_the_namespace_and_always_name_a_collection(data: DataFolder) -> None:
    data.create("v1", "tiny.onnx")
    data.create("v2", "other.onnx")
    assert data.set_alias("prod", "v1") is None
    assert data.resolve("prod") == "v1" and data.path("prod") == data.path("v1")
    assert data.set_alias("prod", "v2") == "v1"  # a switch
    assert data.resolve("prod") == "v2"
    with pytest.raises(NameTaken):
        data.set_alias("v1", "v2")  # a collection's name
    with pytest.raises(NameTaken):
        data.create("prod", "tiny.onnx")  # an alias's name
    with pytest.raises(UnknownCollection):
        data.set_alias("dev", "v3")
    with pytest.raises(NameTaken, match="named by alias prod"):
        data.delete("v2")
    data.delete("v1")
    assert data.names() == ["v2"] and not list((data.root / COLLECTIONS_DIR).glob(".*"))
    assert data.delete_alias("prod") == "v2"
    with pytest.raises(UnknownCollection):
        data.resolve("prod")
    data.delete("v2")
    assert data.names() == [] and data.aliases() == {}


SWITCHER = """
import sys
from vitrieval.index.collections import DataFolder
folder = DataFolder(sys.argv[1])
print("ready", flush=True)
i = 0
while True:
    folder.set_alias("live", "a" if i % 2 else "b")
    i += 1
"""


def test_sigkill_during_alias_switches_leaves_one_collection_named(data: DataFolder) -> None:
    data.create("a", "tiny.onnx")
    data.create("b", "tiny.onnx")
    data.set_alias("live", "a")
    for delay in (0.05, 0.13, 0.21, 0.34, 0.55):
        child = subprocess.Popen(
            [sys.executable, "-c", SWITCHER, str(data.root)], stdout=subprocess.PIPE, text=True
        )
        assert child.stdout.readline().strip() == "ready"
        time.sleep(delay)
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        child.stdout.close()
        raw = json.loads((data.root / ALIASES_FILE).read_text())
        assert raw == {"aliases": {"live": data.resolve("live")}}
        assert data.resolve("live") in ("a", "b")
    # the next switch removes the temporary files the killed writers left
    data.set_alias("live", "a")
    assert sorted(p.name for p in data.root.iterdir() if "alias" in p.name) == [
        ".aliases.lock",
        ALIASES_FILE,
    ]
