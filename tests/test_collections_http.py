"""`vitrieval-serve --data DIR` on loopback: collections of models of different sizes
side by side, keys per collection, aliases switched by a promote while clients search,
and snapshots taken over HTTP while writes go on (docs/collections.md)."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from serving import Server  # tests/serving.py

from vitrieval.client import (
    AuthenticationError,
    Client,
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
)
from vitrieval.index.collections import MODELS_DIR, DataFolder
from vitrieval.index.store import IndexStore
from vitrieval.index.store.snapshot import restore_snapshot

ADMIN = "admin-key-0123456789"
SHOP_KEY = "shop-writer-0123456789"
TINY_READER = "tiny-reader-0123456789"
KEYS = {
    SHOP_KEY: {"collections": ["shop"], "write": True},
    TINY_READER: {"collections": ["tiny"], "write": False},
}
LABELS = [f"c{i % 4}" for i in range(80)]


def noise_png(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_onnx: Path, tiny_onnx_64: Path):
    """A data folder server: models a.onnx (128-d) and b.onnx (64-d); collections v1
    (random vectors: a poor model) and v2 (the same labels, vectors clustered by label:
    a good one), alias prod -> v1; the keys file KEYS."""
    root = tmp_path_factory.mktemp("collections") / "data"
    root.mkdir()
    folder = DataFolder(root)
    shutil.copy(tiny_onnx, root / MODELS_DIR / "a.onnx")
    shutil.copy(tiny_onnx_64, root / MODELS_DIR / "b.onnx")
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((4, 128))
    clustered = np.stack([centres[i % 4] for i in range(80)]) + 0.3 * rng.standard_normal((80, 128))
    for name, vectors in (("v1", rng.standard_normal((80, 128))), ("v2", clustered)):
        folder.create(name, "a.onnx")
        with IndexStore.open(folder.path(name)) as store:
            store.add([f"{name}/{i:03d}" for i in range(80)], unit(vectors), labels=LABELS)
            store.save()
    folder.set_alias("prod", "v1")
    keys = root.parent / "keys.json"
    keys.write_text(json.dumps(KEYS))
    env = {"VITRIEVAL_API_KEY": ADMIN}
    # at info, the log holds the promote decisions
    args = ("--keys", str(keys), "--log-level", "info")
    with Server(None, None, *args, env=env, data=root) as running:
        yield running


def test_two_models_of_different_sizes_answer_side_by_side(server: Server) -> None:
    with Client(server.url, ADMIN) as admin:
        assert admin.readiness().status == "ready"
        assert admin.create_collection("shop", model="a.onnx").dim == 128
        assert admin.create_collection("tiny", model="b.onnx", factory="Flat").dim == 64
        with pytest.raises(ConflictError):
            admin.create_collection("tiny", model="a.onnx")
        shop, tiny = admin.in_collection("shop"), admin.in_collection("tiny")
        for i in range(6):
            shop.add(f"s{i}", image=noise_png(i), label="shop")
            tiny.add(f"t{i}", image=noise_png(i), label="tiny")
        for client, prefix, dim in ((shop, "s", 128), (tiny, "t", 64)):
            found = client.search(image=noise_png(3), k=3)
            assert found.hits[0].key == f"{prefix}3" and found.hits[0].score > 0.999
            assert {hit.key[0] for hit in found.hits} == {prefix}
            assert len(client.embed(noise_png(3)).embedding) == dim
            assert client.info().index.count == 6
        listed = {c.name: c for c in admin.collections().collections}
        assert (listed["shop"].dim, listed["tiny"].dim, listed["v1"].aliases) == (128, 64, ["prod"])
        models = {listed["shop"].model, listed["tiny"].model}
        assert len(models) == 2  # two models, each collection embedded by its own


def test_a_key_never_touches_a_collection_it_is_not_given(server: Server) -> None:
    with Client(server.url, ADMIN) as admin:
        for name, model in (("shop", "a.onnx"), ("tiny", "b.onnx")):
            if name not in {c.name for c in admin.collections().collections}:
                admin.create_collection(name, model=model)
    shop_writer = Client(server.url, SHOP_KEY, collection="shop")
    vector = np.ones(128, np.float32)
    shop_writer.add("by-key", vector=vector)
    assert shop_writer.get("by-key").key == "by-key"
    assert [c.name for c in shop_writer.collections().collections] == ["shop"]
    other = shop_writer.in_collection("tiny")
    for attempt in (
        lambda: other.search(vector=np.ones(64), k=1),
        lambda: other.add("x", vector=np.ones(64)),
        lambda: other.info(),
        lambda: shop_writer.create_snapshot("tiny"),
        lambda: shop_writer.create_collection("mine", model="a.onnx"),
        lambda: shop_writer.set_alias("prod", "shop"),
    ):
        with pytest.raises(PermissionDeniedError):
            attempt()
    reader = Client(server.url, TINY_READER, collection="tiny")
    assert reader.search(vector=np.ones(64), k=1).k == 1
    with pytest.raises(PermissionDeniedError):
        reader.add("x", vector=np.ones(64))
    with pytest.raises(PermissionDeniedError):
        reader.in_collection("shop").get("by-key")
    with pytest.raises(AuthenticationError):
        Client(server.url, "no-such-key-0123456789", collection="shop").get("by-key")
    with pytest.raises(AuthenticationError):  # with a keys file, reads need a key
        Client(server.url, collection="shop").get("by-key")
    with pytest.raises(NotFoundError):
        Client(server.url, ADMIN, collection="nowhere").info()
    # the aliases a key lists are those of the collections it may read
    assert reader.aliases().aliases == {}
    assert Client(server.url, ADMIN).aliases().aliases["prod"] in ("v1", "v2")


def test_the_client_quotes_names_into_one_path_segment(server: Server) -> None:
    """A name with a slash or dots stays one segment: it never reaches another route."""
    admin = Client(server.url, ADMIN)
    admin.create_collection("quoted", model="a.onnx")
    admin.in_collection("quoted").add("x", vector=np.ones(128))
    with pytest.raises((NotFoundError, InvalidRequestError)):
        admin.delete_collection("../quoted/items/x")
    assert admin.in_collection("quoted").get("x").key == "x"


def test_a_losing_promote_keeps_the_alias_and_a_winning_one_switches_it_under_searches(
    server: Server,
) -> None:
    admin = Client(server.url, ADMIN)
    kept = admin.promote("prod", "v2", min_gain=1.0, ks=[1])  # better, but not by 1.0
    assert not kept.switched and admin.aliases().aliases["prod"] == "v1"
    assert kept.candidate.map > kept.current.map and kept.current.n_items == 80
    stop, answers, errors = threading.Event(), [], []

    def searcher(seed: int) -> None:
        client = Client(server.url, ADMIN, collection="prod")
        vector = np.random.default_rng(seed).standard_normal(128)
        while not stop.is_set():
            try:
                hits = client.search(vector=vector, k=5).hits
                answers.append({hit.key.split("/")[0] for hit in hits})
            except Exception as exc:  # any failure fails the test
                errors.append(exc)

    with ThreadPoolExecutor(8) as pool:
        for seed in range(8):
            pool.submit(searcher, seed)
        while len(answers) < 40:
            threading.Event().wait(0.05)
        won = admin.promote("prod", "v2", ks=[1])
        seen = len(answers)
        while len(answers) < seen + 40:
            threading.Event().wait(0.05)
        stop.set()
    assert won.switched and won.current_collection == "v1" and won.candidate_collection == "v2"
    assert admin.aliases().aliases["prod"] == "v2"
    assert not errors
    assert all(found in ({"v1"}, {"v2"}) for found in answers)  # one collection each
    assert answers[0] == {"v1"} and answers[-1] == {"v2"}
    lost = admin.promote("prod", "v1", metric="recall@1")
    assert not lost.switched and admin.aliases().aliases["prod"] == "v2"
    server_log = server.output()
    assert "promote prod: recall@1 v2" in server_log and "kept v2" in server_log


def test_a_snapshot_taken_during_writes_restores_exactly_the_acknowledged_items(
    server: Server, tmp_path: Path
) -> None:
    admin = Client(server.url, ADMIN)
    admin.create_collection("busy", model="a.onnx")
    busy = admin.in_collection("busy")
    acknowledged: list[str] = []
    rng = np.random.default_rng(1)

    def writer(start: int) -> None:
        for i in range(start, start + 60):
            busy.add(f"w{i}", vector=rng.standard_normal(128))
            acknowledged.append(f"w{i}")

    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(writer, n * 1000) for n in range(3)]
        while len(acknowledged) < 30:
            threading.Event().wait(0.01)
        before = set(acknowledged)  # acknowledged before the snapshot was asked for
        taken = admin.create_snapshot("busy")
        after = set(acknowledged)  # those the snapshot may hold as well
        for future in futures:
            future.result()
    assert [s.snapshot for s in admin.snapshots("busy").snapshots] == [taken.snapshot]
    data = admin.download_snapshot("busy", taken.snapshot)
    assert len(data) == taken.bytes and tarfile.is_tarfile(io.BytesIO(data))
    restore_snapshot(io.BytesIO(data), tmp_path / "restored")
    with IndexStore.open(tmp_path / "restored") as store:
        held = set(store.keys())
    assert before <= held <= after
    again = admin.create_collection("busy-copy", snapshot=taken.snapshot)
    copied = admin.in_collection("busy-copy").scroll(limit=1000).items
    assert again.name == "busy-copy" and {item.key for item in copied} == held
    assert admin.delete_snapshot("busy", taken.snapshot).deleted
    assert admin.snapshots("busy").snapshots == []


def test_sigkill_during_snapshots_leaves_each_whole_or_absent(
    tmp_path: Path, tiny_onnx: Path
) -> None:
    """The server is killed while it writes a snapshot, at several moments: after each
    restart every snapshot listed restores, and the ones killed part way are absent."""
    root = tmp_path / "data"
    root.mkdir()
    folder = DataFolder(root)
    shutil.copy(tiny_onnx, root / MODELS_DIR / "a.onnx")
    folder.create("big", "a.onnx")
    vectors = unit(np.random.default_rng(0).standard_normal((60_000, 128)))
    with IndexStore.open(folder.path("big")) as store:  # about 31 MB of sealed segment
        store.add([f"k{i}" for i in range(len(vectors))], vectors)
        store.save()
    env = {"VITRIEVAL_API_KEY": ADMIN}
    outcomes = []
    for delay in (0.0, 0.05, 0.15, 5.0):
        server = Server(None, None, env=env, data=root).wait_ready()
        admin = Client(server.url, ADMIN, retries=0)
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(admin.create_snapshot, "big")
            threading.Event().wait(delay)
            finished = pending.done()
            server.kill()
            try:
                pending.result()
            except Exception:
                finished = False
        outcomes.append(finished)
        server.stop()
    with Server(None, None, env=env, data=root) as server:
        kept = Client(server.url, ADMIN).snapshots("big").snapshots
    assert outcomes[-1] and not outcomes[0]  # the last had time to finish, the first not
    # every acknowledged snapshot is kept (one killed after its rename may be too)
    assert len(kept) >= sum(outcomes)
    files = sorted((root / "snapshots" / "big").glob("*.tar"))
    assert [f.stem for f in files] == [s.snapshot for s in kept]  # no partial tar file
    for file in files:
        with file.open("rb") as fh:
            restore_snapshot(fh, tmp_path / "restored" / file.stem)
        with IndexStore.open(tmp_path / "restored" / file.stem) as store:
            assert len(store) == len(vectors)
