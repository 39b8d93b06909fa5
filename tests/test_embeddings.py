"""Embeddings folders: `vitrieval-index embed`, `build --embeddings`, and the Parquet
contract another engine can write (index/pipeline/embeddings_folder.py,
index/pipeline/embed_folder.py)."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from index_cli_helpers import run  # tests/index_cli_helpers.py

from vitrieval.index.evaluation.datasets import load_dataset
from vitrieval.index.pipeline.embeddings_folder import EmbeddingsFolder, Reservoir, write_part
from vitrieval.index.runtime.model_metadata import read_model_metadata
from vitrieval.index.store import IndexStore

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    """38 digit images in 4 class folders plus 2 unreadable files."""
    root = tmp_path_factory.mktemp("photos")
    items = [item for item in load_dataset("digits").train if item.label in {"0", "1", "2", "3"}]
    for item in items[:38]:
        folder = root / f"class_{item.label}"
        folder.mkdir(exist_ok=True)
        item.open().save(folder / f"{item.key.replace('/', '_')}.png")
    (root / "class_0" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    (root / "class_1" / "notes.jpg").write_text("this is not an image")
    return root


@pytest.fixture(scope="module")
def many_photos(tmp_path_factory) -> Path:
    """400 digit images in one folder, two of them unreadable."""
    root = tmp_path_factory.mktemp("many")
    for item in load_dataset("digits").train[:398]:
        item.open().save(root / f"{item.key.replace('/', '_')}.png")
    (root / "zz_broken_a.png").write_bytes(b"not a png")
    (root / "digits_broken_b.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    return root


def read_rows(folder: Path) -> tuple[list[str], np.ndarray, list]:
    """Every row of an embeddings folder, as written: keys, float32 vectors, labels."""
    table = pa.concat_tables(pq.read_table(p) for p in sorted(folder.glob("*.parquet")))
    vectors = np.array(table.column("embedding").to_pylist(), dtype=np.float32)
    return table.column("key").to_pylist(), vectors, table.column("label").to_pylist()


def foreign_folder(
    root: Path,
    fingerprint: str,
    parts: list[dict],
    *,
    dim: int = 128,
    meta: dict | None = None,
) -> Path:
    """A folder as another engine writes it: pyarrow tables (one file per dict of
    columns), embeddings.json with only the contract's fields."""
    root.mkdir(parents=True)
    for i, columns in enumerate(parts):
        pq.write_table(pa.table(columns), root / f"part-{i}-c000.snappy.parquet")
    (root / "_SUCCESS").write_text("")
    body = {"dim": dim, "model_fingerprint": fingerprint} if meta is None else meta
    (root / "embeddings.json").write_text(json.dumps(body))
    return root


def unit_rows(n: int, dim: int = 128, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def embedding_column(x: np.ndarray) -> pa.Array:
    return pa.array([row.tolist() for row in x], type=pa.list_(pa.float32()))


def one_line(err: str) -> bool:
    return err.count("\n") == 1 and "Traceback" not in err


def test_embed_then_build_equals_build_from_images(tmp_path, capsys, photos, tiny_onnx):
    direct, emb, staged = tmp_path / "direct", tmp_path / "emb", tmp_path / "staged"
    images = ("--images", photos, "--labels-from-folders")
    code, _, err = run(
        capsys, "build", "--model", tiny_onnx, *images, "--out", direct, "--factory", "Flat"
    )
    assert code == 0, err
    code, out, err = run(
        capsys, "embed", "--model", tiny_onnx, *images, "--out", emb, "--part-size", "8"
    )
    assert code == 0, err
    assert "embedded 38 of 40 images, 2 unreadable skipped" in out
    assert f"{emb} holds 38 embeddings in 5 part(s)" in out
    assert sorted(p.name for p in emb.glob("*.parquet")) == [
        f"part-0000{i}.parquet" for i in range(5)
    ]

    meta = json.loads((emb / "embeddings.json").read_text())
    assert meta["dim"] == 128 and meta["complete"] is True
    assert meta["model_fingerprint"] == read_model_metadata(tiny_onnx).fingerprint
    assert meta["model"] == str(Path(tiny_onnx).resolve())
    assert (meta["inputs"], meta["count"], meta["unreadable"]) == (40, 38, 2)
    assert [(p["start"], p["stop"]) for p in meta["parts"]] == [
        (0, 8),
        (8, 16),
        (16, 24),
        (24, 32),
        (32, 40),
    ]

    # unreadable files are in the report with their reason
    with (emb / "errors.csv").open(newline="") as fh:
        errors = list(csv.DictReader(fh))
    assert sorted(Path(row["path"]).name for row in errors) == ["broken.png", "notes.jpg"]
    assert all(row["reason"] and row["part"].startswith("part-") for row in errors)

    # --model defaults to the one embeddings.json records
    code, out, err = run(capsys, "build", "--embeddings", emb, "--out", staged, "--factory", "Flat")
    assert code == 0, err
    assert "indexed 38 of 38 embeddings" in out

    a, b = IndexStore.open(direct), IndexStore.open(staged)
    keys = a.keys()
    assert keys == b.keys() and len(keys) == 38
    assert b.fingerprint == a.fingerprint and b.model_path is not None  # its model copy
    for key in keys:
        x, y = a.get(key), b.get(key)
        assert (x.label, x.path, x.metadata) == (y.label, y.path, y.metadata)
        np.testing.assert_allclose(x.vector, y.vector, atol=1e-6)
    queries = sorted(photos.glob("class_*/[!b]*.png"))[:8]
    args = ("-k", "10", "--json")
    results = [
        json.loads(run(capsys, "search", index, *queries, *args)[1]) for index in (direct, staged)
    ]
    for one, other in zip(*results, strict=True):
        assert [h["key"] for h in one["hits"]] == [h["key"] for h in other["hits"]]
        np.testing.assert_allclose(
            [h["score"] for h in one["hits"]], [h["score"] for h in other["hits"]], atol=1e-6
        )

    # building again skips what the index holds
    code, out, _ = run(capsys, "build", "--embeddings", emb, "--out", staged)
    assert code == 0 and "indexed 0 of 38 embeddings from" in out and "38 already present" in out


def test_a_folder_written_by_another_engine_builds(tmp_path, capsys, tiny_onnx):
    fingerprint = read_model_metadata(tiny_onnx).fingerprint
    x = unit_rows(60)
    x[5] *= 3.0  # not unit: normalised as it is read
    first = {
        "key": [f"item/{i}" for i in range(40)],
        "embedding": embedding_column(x[:40]),
        "label": [f"class_{i % 3}" if i % 7 else None for i in range(40)],
        "path": [f"/photos/{i}.jpg" for i in range(40)],
        "metadata": [json.dumps({"sku": i}) if i % 2 else None for i in range(40)],
    }
    # only the required columns, and one the contract does not know
    second = {
        "key": [f"item/{i}" for i in range(40, 60)],
        "embedding": embedding_column(x[40:]),
        "score": list(range(20)),
    }
    emb = foreign_folder(tmp_path / "emb", fingerprint, [first, second])
    (emb / ".part-9.parquet").write_text("hidden, skipped")

    # no model recorded: --model is needed to give the index its copy
    code, _, err = run(capsys, "build", "--embeddings", emb, "--out", tmp_path / "none")
    assert code == 2 and one_line(err) and "names no model" in err
    code, out, err = run(
        capsys, "build", "--embeddings", emb, "--model", tiny_onnx, "--out", tmp_path / "flat"
    )
    assert code == 0, err
    assert "factory auto: Flat for 60 vectors" in out
    store = IndexStore.open(tmp_path / "flat")
    assert len(store) == 60 and store.fingerprint == fingerprint
    record = store.get("item/3")
    assert (record.label, record.path, record.metadata) == ("class_0", "/photos/3.jpg", {"sku": 3})
    assert store.get("item/50").metadata == {} and store.get("item/50").label is None
    unit = x / np.linalg.norm(x, axis=1, keepdims=True)
    np.testing.assert_allclose(store.get("item/5").vector, unit[5], atol=1e-6)
    hits = store.search(unit[[5, 45]], 1)
    assert [h[0].key for h in hits] == ["item/5", "item/45"]
    assert [h[0].score for h in hits] == pytest.approx([1.0, 1.0], abs=1e-5)

    # a factory that needs training: trained on a sample drawn in a streaming pass
    code, _, err = run(
        capsys,
        "build",
        "--embeddings",
        emb,
        "--model",
        tiny_onnx,
        "--out",
        tmp_path / "ivf",
        "--factory",
        "IVF2,Flat",
    )
    assert code == 0, err
    ivf = IndexStore.open(tmp_path / "ivf")
    assert ivf.factory == "IVF2,Flat" and len(ivf) == 60


def test_embed_resumes_after_a_kill(tmp_path, capsys, many_photos, tiny_onnx):
    emb = tmp_path / "emb"
    options = ["--part-size", "4", "--batch-size", "2", "--device", "cpu"]
    argv = ["embed", "--model", tiny_onnx, "--images", many_photos, "--out", emb, *options]
    command = [sys.executable, "-m", "vitrieval.index.cli", *map(str, argv)]
    process = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )

    def parts_recorded() -> int:
        try:
            return len(json.loads((emb / "embeddings.json").read_text())["parts"])
        except (OSError, ValueError, KeyError):
            return 0

    deadline = time.monotonic() + 120
    try:
        while not parts_recorded() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        process.send_signal(signal.SIGKILL)
    finally:
        process.wait()
    assert (emb / "part-00000.parquet").exists(), "the embed did not finish a part in time"
    assert process.returncode == -signal.SIGKILL, "the embed finished before it was killed"
    meta = json.loads((emb / "embeddings.json").read_text())
    assert meta["complete"] is False and len(meta["parts"]) < 100
    kept = {name: os.stat(emb / name) for name in (p["file"] for p in meta["parts"])}

    # an interrupted folder is not built from
    code, _, err = run(capsys, "build", "--embeddings", emb, "--out", tmp_path / "index")
    assert code == 2 and one_line(err) and "incomplete" in err

    code, out, err = run(capsys, *argv)
    assert code == 0, err
    assert f"{len(kept)} part(s) already done" in out
    assert "2 unreadable skipped" in out and f"{emb} holds 398 embeddings in 100 part(s)" in out
    for name, before in kept.items():  # finished parts were skipped, not rewritten
        after = os.stat(emb / name)
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert not list(emb.glob(".*.tmp"))

    unbroken = tmp_path / "unbroken"
    code, _, err = run(
        capsys, "embed", "--model", tiny_onnx, "--images", many_photos, "--out", unbroken, *options
    )
    assert code == 0, err
    keys, vectors, labels = read_rows(emb)
    keys_, vectors_, labels_ = read_rows(unbroken)
    assert keys == keys_ and len(keys) == 398 and labels == labels_
    np.testing.assert_array_equal(vectors, vectors_)
    assert sorted(p.name for p in emb.glob("*.parquet")) == sorted(
        p.name for p in unbroken.glob("*.parquet")
    )
    assert (emb / "errors.csv").read_text() == (unbroken / "errors.csv").read_text()
    meta, meta_ = (json.loads((f / "embeddings.json").read_text()) for f in (emb, unbroken))
    assert meta["parts"] == meta_["parts"] and meta["count"] == 398


def test_a_changed_input_list_is_refused(tmp_path, capsys, photos, tiny_onnx, tiny_onnx_other):
    listing = tmp_path / "list.csv"
    files = sorted(photos.glob("class_*/*"))
    rows = [(str(p), p.parent.name) for p in files]

    def write(rows: list[tuple[str, str]]) -> None:
        with listing.open("w", newline="") as fh:
            csv.writer(fh).writerows([("path", "label"), *rows])

    write(rows)
    emb = tmp_path / "emb"
    argv = ("embed", "--model", tiny_onnx, "--images", listing, "--out", emb)
    assert run(capsys, *argv, "--part-size", "16")[0] == 0
    before = (emb / "embeddings.json").read_text()

    # the same list: nothing to do
    code, out, _ = run(capsys, *argv)
    assert code == 0 and "embedded 0 of 40 images, 38 in 3 part(s) already done" in out
    # another label in the second part's range
    write([*rows[:20], (rows[20][0], "relabelled"), *rows[21:]])
    code, _, err = run(capsys, *argv)
    assert code == 2 and one_line(err)
    assert "part-00001.parquet was embedded from inputs 16 to 32 of another list" in err
    # fewer images
    write(rows[:30])
    code, _, err = run(capsys, *argv)
    assert code == 2 and one_line(err) and "another list" in err
    write(rows)
    code, _, err = run(capsys, *argv, "--part-size", "8")
    assert code == 2 and one_line(err) and "--part-size 16" in err
    code, _, err = run(capsys, *argv[:2], tiny_onnx_other, *argv[3:])
    assert code == 2 and one_line(err) and "fingerprint" in err
    assert (emb / "embeddings.json").read_text() == before  # nothing was written

    # a folder that is not an embed's is not written into
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "file.txt").write_text("mine")
    code, _, err = run(capsys, *argv[:-1], tmp_path / "other")
    assert code == 2 and one_line(err) and "not an embeddings folder" in err


def test_build_embeddings_refuses_another_model_and_bad_arguments(
    tmp_path, capsys, photos, tiny_onnx, tiny_onnx_other
):
    emb = tmp_path / "emb"
    assert run(capsys, "embed", "--model", tiny_onnx, "--images", photos, "--out", emb)[0] == 0
    out = tmp_path / "index"
    code, stdout, err = run(
        capsys, "build", "--embeddings", emb, "--model", tiny_onnx_other, "--out", out
    )
    assert code == 2 and one_line(err), err
    other = read_model_metadata(tiny_onnx_other).fingerprint
    assert f"--model {tiny_onnx_other} has fingerprint {other[:12]}" in err
    assert not out.exists() and stdout == ""

    for argv, needle in [
        (("--out", out), "exactly one of --images and --embeddings"),
        (("--images", photos, "--embeddings", emb, "--out", out), "exactly one of"),
        (("--embeddings", emb, "--labels-from-folders", "--out", out), "carries its labels"),
        (("--embeddings", tmp_path / "nowhere", "--out", out), "embeddings folder not found"),
    ]:
        code, _, err = run(capsys, "build", *argv)
        assert code == 2 and one_line(err) and needle in err, err

    # a built index refuses embeddings of another model
    assert (
        run(capsys, "build", "--model", tiny_onnx_other, "--images", photos, "--out", out)[0] == 0
    )
    code, _, err = run(capsys, "build", "--embeddings", emb, "--out", out)
    assert code == 2 and one_line(err) and "was built with model fingerprint" in err


def _bad_folders(fingerprint: str) -> list[tuple[str, list[dict], dict | None, str]]:
    x = unit_rows(6)
    ok = {"key": [f"k{i}" for i in range(6)], "embedding": embedding_column(x)}
    nan, zero = x.copy(), x.copy()
    nan[2, 7], zero[4] = np.nan, 0.0
    short = [row.tolist() for row in x]
    short[3] = short[3][:127]
    meta = {"dim": 128, "model_fingerprint": fingerprint}
    return [
        (
            "missing column",
            [{"key": ok["key"], "vector": ok["embedding"]}],
            None,
            "missing column(s) embedding",
        ),
        (
            "wrong length",
            [{"key": ok["key"], "embedding": pa.array(short, pa.list_(pa.float32()))}],
            None,
            "row 3 (key 'k3') has an embedding of length 127, not 128",
        ),
        (
            "non-finite",
            [{**ok, "embedding": embedding_column(nan)}],
            None,
            "row 2 (key 'k2') has a NaN or infinite value",
        ),
        (
            "zero vector",
            [{**ok, "embedding": embedding_column(zero)}],
            None,
            "row 4 (key 'k4') has an all-zero embedding",
        ),
        (
            "duplicate key",
            [ok, {"key": ["k9", "k2"], "embedding": embedding_column(x[:2])}],
            None,
            "key 'k2' appears more than once",
        ),
        (
            "dim mismatch",
            [{"key": ["a"], "embedding": embedding_column(unit_rows(1, 64))}],
            {**meta, "dim": 64},
            "holds 64-d embeddings",
        ),
        (
            "wrong type",
            [{"key": ok["key"], "embedding": pa.array([["x"]] * 6)}],
            None,
            "column embedding must be a list of float32, got list<element: string>",
        ),
        (
            "bad metadata",
            [{**ok, "metadata": ["{}", "{", None, "1", "{}", "{}"]}],
            None,
            "key 'k1': metadata is not JSON",
        ),
        (
            "metadata nested too deep",
            [{**ok, "metadata": ["{}", "[" * 20_000 + "]" * 20_000, None, "1", "{}", "{}"]}],
            None,
            "key 'k1': metadata is not JSON",
        ),
        (
            "null key",
            [{**ok, "key": ["a", None, "c", "d", "e", "f"]}],
            None,
            "row 1 has an empty or null key",
        ),
        ("no fingerprint", [ok], {"dim": 128}, "'model_fingerprint' must be"),
        ("incomplete", [ok], {**meta, "complete": False}, "is incomplete"),
    ]


def test_invalid_folders_are_refused_in_one_line(tmp_path, capsys, tiny_onnx):
    fingerprint = read_model_metadata(tiny_onnx).fingerprint
    for n, (what, parts, meta, needle) in enumerate(_bad_folders(fingerprint)):
        emb = foreign_folder(tmp_path / f"emb{n}", fingerprint, parts, meta=meta)
        out = tmp_path / f"index{n}"
        code, _, err = run(capsys, "build", "--embeddings", emb, "--model", tiny_onnx, "--out", out)
        assert code == 2, what
        assert one_line(err) and needle in err, (what, err)
    (tmp_path / "empty").mkdir()
    code, _, err = run(capsys, "build", "--embeddings", tmp_path / "empty", "--out", tmp_path / "x")
    assert code == 2 and one_line(err) and "has no embeddings.json" in err


def test_reading_is_bounded_by_the_batch_size(tmp_path, tiny_onnx, monkeypatch):
    from vitrieval.index.pipeline.build_index import build_from_embeddings

    folder = tmp_path / "emb"
    x = unit_rows(28)
    write_part(
        folder / "part-00000.parquet", [f"a{i}" for i in range(23)], x[:23], row_group_size=10
    )
    write_part(folder / "part-00001.parquet", [f"b{i}" for i in range(5)], x[23:])
    fingerprint = read_model_metadata(tiny_onnx).fingerprint
    (folder / "embeddings.json").write_text(
        json.dumps({"dim": 128, "model_fingerprint": fingerprint})
    )
    emb = EmbeddingsFolder.open(folder)
    assert emb.count == 28 and emb.rows == [23, 5]
    sizes = [len(batch.keys) for batch in emb.iter_batches(4)]
    assert max(sizes) <= 4 and sum(sizes) == 28
    assert [len(keys) for _, keys in emb.iter_keys(6)] == [6, 6, 6, 5, 5]

    added, saves = [], []
    real_add, real_save = IndexStore.add, IndexStore.save

    def add(self, keys, vectors, **kwargs):
        added.append(len(keys))
        return real_add(self, keys, vectors, **kwargs)

    def save(self):
        saves.append(len(self))
        return real_save(self)

    monkeypatch.setattr(IndexStore, "add", add)
    monkeypatch.setattr(IndexStore, "save", save)
    out = tmp_path / "index"
    store = IndexStore.create(out, dim=128, fingerprint=fingerprint, model_path=tiny_onnx)
    report = build_from_embeddings(emb, out, store, save_every=8, batch_size=4, progress=False)
    assert report.indexed == 28 and max(added) <= 4 and sum(added) == 28
    assert saves == [8, 16, 27, 28]  # once 8 vectors were added since the last, and at the end


def test_the_reservoir_sample_is_uniform():
    # every one of 50 rows fed in uneven batches lands in a 10-row sample with
    # probability 1/5
    counts = np.zeros(50)
    rows = np.arange(50, dtype=np.float32)[:, None]
    for seed in range(3000):
        reservoir = Reservoir(10, 1, seed)
        for start, stop in [(0, 7), (7, 8), (8, 30), (30, 50)]:
            reservoir.add(rows[start:stop])
        sample = reservoir.sample[:, 0].astype(int)
        assert len(set(sample.tolist())) == 10
        counts[sample] += 1
    np.testing.assert_allclose(counts / 3000, 0.2, atol=0.035)
    small = Reservoir(10, 1)
    small.add(rows[:4])
    assert small.sample[:, 0].tolist() == [0, 1, 2, 3]


def test_the_training_sample_follows_the_factory():
    from vitrieval.index.factory import MAX_TRAINING_VECTORS, training_sample_size

    assert training_sample_size("Flat") == MAX_TRAINING_VECTORS == 200_000
    assert training_sample_size("IVF1024,Flat") == 200_000  # 39 x 1024 fewer
    assert training_sample_size("IVF8192,Flat") == 39 * 8192
    assert training_sample_size("IVF65536_HNSW32,PQ16") == 39 * 65536
    assert training_sample_size("PQ16x12") == 200_000  # 39 x 4096 fewer
    assert training_sample_size("PQ16x14") == 39 * 2**14


def test_a_build_tunes_to_a_target_recall(tmp_path, capsys, tiny_onnx):
    fingerprint = read_model_metadata(tiny_onnx).fingerprint
    rng = np.random.default_rng(3)
    centres = rng.standard_normal((8, 128))
    x = (centres[rng.integers(0, 8, 400)] + 0.5 * rng.standard_normal((400, 128))).astype(
        np.float32
    )  # few items: the tuning draws (400 - 11) // 2 queries, not 1,000
    part = {"key": [f"item/{i}" for i in range(len(x))], "embedding": embedding_column(x)}
    emb = foreign_folder(tmp_path / "emb", fingerprint, [part])
    out = tmp_path / "index"
    common = ("build", "--embeddings", emb, "--model", tiny_onnx, "--out", out)
    code, _, err = run(capsys, *common, "--target-recall", "1.2")
    assert code == 2 and one_line(err) and "target recall must be a number in (0, 1]" in err
    assert not out.exists()  # refused before building anything
    code, printed, err = run(capsys, *common, "--factory", "IVF4,SQ4", "--target-recall", "0.9")
    assert code == 0, err
    assert "target recall@10 0.9 reached" in printed.splitlines()[-1]
    tuning = IndexStore.open(out).info()["tuning"]
    assert tuning["recall"] >= 0.9 and set(tuning["params"]) == {"nprobe", "oversample"}
