"""Sharded indexes (index/shards): the key-to-shard rule, ShardedStore against one store,
the sharded build (quantiser trained once, resumable after a kill), the command line
and the service on a sharded index."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from index_cli_helpers import run  # tests/index_cli_helpers.py
from store_helpers import brute_force, exact_vectors, unit_vectors, with_duplicates

from vitrieval.index.evaluation.datasets import csv_list
from vitrieval.index.pipeline.build_index import build_from_embeddings
from vitrieval.index.pipeline.embeddings_folder import EmbeddingsFolder, write_part
from vitrieval.index.runtime.model_metadata import read_model_metadata
from vitrieval.index.shards import ShardedStore, open_index, shard_of
from vitrieval.index.shards.build import build_shard, build_sharded
from vitrieval.index.shards.layout import SHARDS_FILE, shard_name
from vitrieval.index.store import IndexStore, KeyExistsError
from vitrieval.index.store import manifest as mf
from vitrieval.index.store._vectors import VectorIndex
from vitrieval.service.app import create_app
from vitrieval.service.settings import Settings

REPO = Path(__file__).resolve().parents[1]
FINGERPRINT = "f" * 64
KEY = "shards-test-key-0123"


def in_process(jobs: list[dict]) -> list[dict]:
    """`run_shards` without processes: the same build_shard calls, one after another."""
    return [build_shard(**job) for job in jobs]


def one_line(err: str) -> bool:
    return err.count("\n") == 1 and "Traceback" not in err


def write_folder(
    root: Path,
    x: np.ndarray,
    keys: list[str],
    labels: list | None = None,
    fingerprint: str = FINGERPRINT,
    parts: int = 2,
) -> Path:
    """An embeddings folder of `x` in `parts` Parquet files (small row groups)."""
    bounds = np.linspace(0, len(x), parts + 1).astype(int)
    for i, (start, stop) in enumerate(itertools.pairwise(bounds)):
        write_part(
            root / f"part-{i:05d}.parquet",
            keys[start:stop],
            x[start:stop],
            labels=None if labels is None else labels[start:stop],
            row_group_size=64,
        )
    (root / "embeddings.json").write_text(
        json.dumps({"dim": x.shape[1], "model_fingerprint": fingerprint})
    )
    return root


def unsharded(folder: Path, out: Path, factory: str = "Flat") -> IndexStore:
    emb = EmbeddingsFolder.open(folder)
    store = IndexStore.create(out, dim=emb.dim, factory=factory, fingerprint=emb.fingerprint)
    build_from_embeddings(emb, out, store, progress=False, batch_size=64)
    return store


def same_hits(a: list, b: list) -> None:
    """Same keys, order and scores (exact) for every query."""
    assert [[(h.key, h.score) for h in row] for row in a] == [
        [(h.key, h.score) for h in row] for row in b
    ]


@pytest.fixture(scope="module")
def tied(tmp_path_factory) -> dict:
    """640 exactly representable vectors, 40 of them copies (exact ties), labelled, under
    shuffled keys (file order is not key order), as an embeddings folder."""
    root = tmp_path_factory.mktemp("tied")
    rng = np.random.default_rng(0)
    x = with_duplicates(exact_vectors(rng, 600, 32), copies=4, originals=10)
    keys = [f"item/{v:06d}" for v in rng.permutation(len(x))]
    labels = [f"class_{i % 5}" for i in range(len(x))]
    return {
        "x": x,
        "keys": keys,
        "labels": labels,
        "emb": write_folder(root / "emb", x, keys, labels),
    }


def test_the_key_to_shard_rule_is_stable():
    # sha256("photos/cat.jpg") starts 9c4712116d1c1877: 0x9c4712116d1c1877 mod 3 = 2, mod 7 = 3
    assert shard_of("photos/cat.jpg", 3) == 2
    assert shard_of("photos/cat.jpg", 7) == 3
    assert shard_of("a", 2) == 0 and shard_of("photos/cat.jpg", 1) == 0
    # the same in another process with another string-hash seed
    code = "from vitrieval.index.shards import shard_of; print(shard_of('photos/cat.jpg', 3))"
    for seed in ("1", "12345"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            cwd=REPO,
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert out.strip() == "2"
    counts = np.bincount([shard_of(f"k{i}", 4) for i in range(4000)], minlength=4)
    assert counts.min() > 900  # an even spread


def test_a_compressed_sharded_index_re_scores_as_one_exact_store(tmp_path, tied):
    # every list probed and 64 x k candidates per shard: re-scoring sees every item
    build_sharded(tied["emb"], tmp_path / "sharded", "", "IVF4,PQ8", 3, 100, in_process)
    sharded = open_index(tmp_path / "sharded")
    sharded.set_search_params(nprobe=4)
    queries = tied["x"][::80]
    one = unsharded(tied["emb"], tmp_path / "one")
    same_hits(sharded.search(queries, 5, oversample=64), one.search(queries, 5))
    assert sharded.search(queries, 5, rescore=False) != one.search(queries, 5)


def test_a_flat_sharded_index_answers_as_one_store(tmp_path, tied):
    x, keys = tied["x"], tied["keys"]
    one = unsharded(tied["emb"], tmp_path / "one")
    report = build_sharded(tied["emb"], tmp_path / "sharded", "", "Flat", 3, 100, in_process)
    assert report["index_size"] == len(x) and len(report["shards"]) == 3
    sharded = open_index(tmp_path / "sharded")
    assert isinstance(sharded, ShardedStore) and len(sharded) == len(x)
    for shard, store in enumerate(sharded.shards):  # every key in the shard that owns it
        assert store.keys() and all(shard_of(key, 3) == shard for key in store)

    queries = x[:60]  # the first 10 have 4 exact copies each: ties across shards
    same_hits(one.search(queries, 15), sharded.search(queries, 15))
    same_hits(one.search(queries, 7, label="class_2"), sharded.search(queries, 7, label="class_2"))
    excluded = keys[:25]
    same_hits(
        one.search(queries, 9, exclude_keys=excluded),
        sharded.search(queries, 9, exclude_keys=excluded),
    )
    # pages and thresholds: each shard's top k + offset, merged, then cut (ties across
    # shards included)
    for offset in (2, 15, 33):
        same_hits(one.search(queries, 6, offset=offset), sharded.search(queries, 6, offset=offset))
    low = float(np.median([row[6].score for row in one.search(queries, 12)]))
    same_hits(
        one.search(queries, 9, offset=3, score_threshold=low),
        sharded.search(queries, 9, offset=3, score_threshold=low),
    )
    # scroll: the shards' keys merged in key order, page by page
    listed, after = [], None
    class_2 = {"must": [{"key": "label", "match": "class_2"}]}
    while True:
        page = sharded.scroll(class_2, limit=37, after=after)
        listed += page.items
        if (after := page.next) is None:
            break
    assert listed == one.scroll(class_2, limit=len(x)).items
    assert len(listed) == len(x) // 5
    # ties are there, and ordered by insertion (file order), not by key
    top = sharded.search(x[:1], 5)[0]
    assert len({h.score for h in top}) == 1 and [h.key for h in top] != sorted(h.key for h in top)
    reference = brute_force(queries, x, 5)
    assert [[keys[r] for r, _ in row] for row in reference] == [
        [h.key for h in row] for row in sharded.search(queries, 5)
    ]

    assert sharded.keys() == one.keys()
    ours, theirs = sharded.labelled_items(), one.labelled_items()
    assert ours[:2] == theirs[:2]
    np.testing.assert_array_equal(ours[2], theirs[2])
    record = sharded.get(keys[3])
    assert record.label == tied["labels"][3]
    np.testing.assert_array_equal(record.vector, one.get(keys[3]).vector)
    assert keys[3] in sharded and "absent" not in sharded
    info = sharded.info()
    assert info["count"] == len(x) and info["shards"] == 3 and SHARDS_FILE in info["files"]
    assert any(name.startswith("shard-002/seg.") for name in info["files"])
    sharded.verify()


def test_an_ivf_quantiser_is_trained_once_for_every_shard(tmp_path, monkeypatch):
    rng = np.random.default_rng(1)
    x = unit_vectors(rng, 3000, 32)
    keys = [f"v{i}" for i in range(len(x))]
    emb = write_folder(tmp_path / "emb", x, keys)
    trainings = []
    real_train = VectorIndex.train

    def counted(self, vectors):
        trainings.append(len(vectors))
        return real_train(self, vectors)

    monkeypatch.setattr(VectorIndex, "train", counted)
    factory = "IVF16,Flat"
    one = unsharded(emb, tmp_path / "one", factory)
    build_sharded(emb, tmp_path / "sharded", "", factory, 3, 1000, in_process)
    assert trainings == [3000, 3000]  # the unsharded build once, the sharded build once
    quantizers = set()
    for i in range(3):
        manifest = mf.read_manifest(tmp_path / "sharded" / f"shard-00{i}")
        quantizers.add(
            (tmp_path / "sharded" / f"shard-00{i}" / manifest.quantizer.name).read_bytes()
        )
    assert len(quantizers) == 1  # byte for byte the same quantiser

    sharded = open_index(tmp_path / "sharded")
    queries = unit_vectors(np.random.default_rng(2), 200, 32)
    exact = [{keys[r] for r, _ in row} for row in brute_force(queries, x, 10)]

    def recall(store) -> float:
        found = store.search(queries, 10)
        return np.mean(
            [len(e & {h.key for h in row}) / 10 for e, row in zip(exact, found, strict=True)]
        )

    print(f"recall@10 unsharded {recall(one):.3f}, sharded {recall(sharded):.3f}")
    assert recall(sharded) > 0.5 and abs(recall(sharded) - recall(one)) < 0.05


def test_mutations_go_to_the_owning_shard_and_survive_a_reopen(tmp_path, tied):
    build_sharded(tied["emb"], tmp_path / "sharded", "", "Flat", 3, 100, in_process)
    one = unsharded(tied["emb"], tmp_path / "one")
    sharded = open_index(tmp_path / "sharded")
    x = tied["x"]
    new = [f"new/{i}" for i in range(12)]
    vectors = np.repeat(x[:1], 12, axis=0)  # ties with the first item and its copies
    for store in (one, sharded):
        store.add(new, vectors, labels=["fresh"] * 12, metadata=[{"i": i} for i in range(12)])
        store.remove([tied["keys"][1], tied["keys"][2], "absent"])
        store.add(["new/0"], x[5:6], replace=True)
        with pytest.raises(KeyExistsError):
            store.add(["new/1", "new/99"], x[:2])
    for key in new:
        owner = shard_of(key, 3)
        assert [key in s for s in sharded.shards] == [i == owner for i in range(3)]
    assert "new/99" not in sharded  # a refused add changes no shard
    same_hits(one.search(x[:12], 20), sharded.search(x[:12], 20))
    sharded.save()
    one.save()
    sharded.close()

    again = open_index(tmp_path / "sharded")
    assert len(again) == len(one) and again.get("new/3").metadata == {"i": 3}
    assert tied["keys"][1] not in again
    same_hits(one.search(x[:12], 20), again.search(x[:12], 20))
    same_hits(one.search(x[:12], 5, label="fresh"), again.search(x[:12], 5, label="fresh"))
    assert again.keys() == one.keys()
    assert again.remove(new) == 12 and len(again) == len(one) - 12


def test_a_shard_of_an_older_format_is_reported_and_upgraded(tmp_path, tied, capsys):
    """A sharded index reports its oldest shard's format, and `upgrade` converts every
    shard that is behind."""
    build_sharded(tied["emb"], tmp_path / "sharded", "", "Flat", 3, 100, in_process)
    behind = tmp_path / "sharded" / shard_name(1)
    manifest = json.loads((behind / mf.MANIFEST).read_text())
    manifest["format_version"] = mf.COLUMNLESS_FORMAT_VERSION
    for segment in manifest["segments"]:
        for name in [n for n in segment["files"] if n.endswith(".columns")]:
            del segment["files"][name]
            (behind / name).unlink()
    (behind / mf.MANIFEST).write_text(json.dumps(manifest))
    with open_index(tmp_path / "sharded") as old:
        assert old.format_version == mf.COLUMNLESS_FORMAT_VERSION
        assert old.info()["format_version"] == mf.COLUMNLESS_FORMAT_VERSION
    code, out, _ = run(capsys, "upgrade", tmp_path / "sharded")
    lines = out.strip().splitlines()
    assert code == 0 and len(lines) == 3
    assert f"{shard_name(1)}: converted from format {mf.COLUMNLESS_FORMAT_VERSION}" in lines[1]
    assert f"{shard_name(0)} is already in format" in lines[0]
    with open_index(tmp_path / "sharded") as new:
        assert new.format_version == new.info()["format_version"] == mf.FORMAT_VERSION


def test_verify_names_the_shard_of_a_segment_changed_during_the_check(
    tmp_path, tied, capsys, monkeypatch
):
    build_sharded(tied["emb"], tmp_path / "sharded", "", "Flat", 2, 100, in_process)
    items = sorted((tmp_path / "sharded" / shard_name(1)).glob("seg.*.items.sqlite"))[0]
    number = items.name.split(".")[1]
    scan = IndexStore.legacy_items

    def truncated_meanwhile(store: IndexStore) -> list[tuple[str, str]]:
        with items.open("r+b") as fh:  # after the checksums were read
            fh.truncate(4096)
        return scan(store)

    monkeypatch.setattr(IndexStore, "legacy_items", truncated_meanwhile)
    code, out, err = run(capsys, "verify", tmp_path / "sharded")
    assert code == 2 and out == "" and one_line(err)
    assert f"segment {shard_name(1)}/{number} changed during the check" in err


@pytest.fixture(scope="module")
def digit_photos(tmp_path_factory) -> Path:
    """60 digit images in class folders, and their embeddings folder (tiny_onnx)."""
    from vitrieval.index.evaluation.datasets import load_dataset

    root = tmp_path_factory.mktemp("digit_photos")
    for item in load_dataset("digits").train[:60]:
        folder = root / "photos" / f"class_{item.label}"
        folder.mkdir(parents=True, exist_ok=True)
        item.open().save(folder / f"{item.key.replace('/', '_')}.png")
    return root / "photos"


def test_the_command_line_builds_and_searches_a_sharded_index(
    tmp_path, capsys, digit_photos, tiny_onnx
):
    emb, one, sharded = tmp_path / "emb", tmp_path / "one", tmp_path / "sharded"
    code, _, err = run(
        capsys, "embed", "--model", tiny_onnx, "--images", digit_photos, "--out", emb,
        "--labels-from-folders",
    )  # fmt: skip
    assert code == 0, err
    common = ("--embeddings", emb, "--model", tiny_onnx, "--factory", "Flat")
    code, out, err = run(capsys, "build", *common, "--shards", "3", "--out", sharded)
    assert code == 0, err
    assert "indexed 60 of 60 embeddings" in out and f"{sharded} holds 60 items in 3 shards" in out
    code, _, err = run(capsys, "build", *common, "--out", one)
    assert code == 0, err
    assert (one / "manifest.json").is_file() and not (one / SHARDS_FILE).exists()  # unchanged
    assert json.loads((sharded / SHARDS_FILE).read_text())["shards"] == [
        "shard-000", "shard-001", "shard-002",
    ]  # fmt: skip

    queries = sorted(digit_photos.glob("class_*/*.png"))[:6]
    results = [
        json.loads(run(capsys, "search", i, *queries, "-k", "8", "--json")[1])
        for i in (one, sharded)
    ]
    for a, b in zip(*results, strict=True):
        assert [h["key"] for h in a["hits"]] == [h["key"] for h in b["hits"]]
        np.testing.assert_allclose(
            [h["score"] for h in a["hits"]], [h["score"] for h in b["hits"]], atol=1e-6
        )
    code, out, _ = run(
        capsys, "search", sharded, queries[0], "-k", "3", "--label", "class_1", "--json"
    )
    assert code == 0 and {h["label"] for h in json.loads(out)[0]["hits"]} == {"class_1"}

    # re-running the build skips what the shards hold
    code, out, err = run(capsys, "build", *common, "--out", sharded)
    assert code == 0 and "indexed 0 of 60" in out and "60 already present" in out, err

    code, out, _ = run(capsys, "info", sharded, "--json")
    info = json.loads(out)
    assert code == 0 and info["count"] == 60 and info["shards"] == 3
    assert info["model_file"] == str(sharded / "shard-000" / "model.onnx")
    code, out, err = run(capsys, "verify", sharded)
    assert code == 0 and "every checksum holds" in out, err

    victim = results[1][0]["hits"][0]["key"]
    code, out, err = run(capsys, "remove", sharded, victim, "nope")
    assert code == 2 and "removed 1 of 2 keys" in out and "nope" in err
    assert victim not in open_index(sharded)
    extra = tmp_path / "extra"
    extra.mkdir()
    shutil.copy(queries[0], extra / "again.png")
    code, out, err = run(capsys, "add", sharded, "--images", extra)
    assert code == 0 and f"{sharded} holds 60 items" in out, err
    assert "again.png" in open_index(sharded)
    code, out, err = run(capsys, "merge", sharded, "--all")
    assert code == 0, err


def test_bad_sharded_builds_are_refused_in_one_line(tmp_path, capsys, tied, tiny_onnx):
    fingerprint = read_model_metadata(tiny_onnx).fingerprint
    rng = np.random.default_rng(3)
    emb = write_folder(
        tmp_path / "emb",
        unit_vectors(rng, 40),
        [f"k{i}" for i in range(40)],
        fingerprint=fingerprint,
    )
    build = ("build", "--embeddings", emb, "--model", tiny_onnx, "--factory", "Flat")
    cases = [
        (("--shards", "0", "--out", tmp_path / "a"), "--shards must be at least 1"),
        (("--shards", "-2", "--out", tmp_path / "a"), "--shards must be at least 1"),
        (("--save-every", "0", "--out", tmp_path / "a"), "--save-every must be at least 1"),
        (("--shards", "2", "--save-every", "-3", "--out", tmp_path / "a"), "--save-every must"),
    ]
    code, _, err = run(
        capsys,
        "build",
        "--images",
        tmp_path,
        "--model",
        tiny_onnx,
        "--shards",
        "2",
        "--out",
        tmp_path / "b",
    )
    assert code == 2 and one_line(err) and "embed" in err and "--embeddings" in err, err
    code, _, err = run(capsys, *build, "--out", tmp_path / "single")
    assert code == 0, err
    cases.append((("--shards", "3", "--out", tmp_path / "single"), "one store"))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    cases.append((("--shards", "3", "--out", tmp_path / "other"), "not empty"))
    code, _, err = run(capsys, *build, "--shards", "3", "--out", tmp_path / "three")
    assert code == 0, err
    cases.append((("--shards", "4", "--out", tmp_path / "three"), "3 shards, not 4"))
    cases.append(
        (("--shards", "3", "--factory", "IVF4,Flat", "--out", tmp_path / "three"), "factory")
    )
    for args, needle in cases:
        code, _, err = run(capsys, *build, *args)
        assert code == 2 and one_line(err) and needle in err, (args, err)
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"

    # a damaged shards.json (cut short, or nested past the parser's depth): every
    # command that opens the index says so in one line
    for damaged in ('{"format": "vitrieval-shards", "version": 1,', "[" * 20_000 + "]" * 20_000):
        (tmp_path / "three" / SHARDS_FILE).write_text(damaged)
        for argv in (
            ("info", tmp_path / "three"),
            ("verify", tmp_path / "three"),
            ("remove", tmp_path / "three", "k1"),
        ):
            code, _, err = run(capsys, *argv)
            assert code == 2 and one_line(err) and "shards.json is damaged" in err, err
    (tmp_path / "three" / SHARDS_FILE).write_text(
        json.dumps(
            {"format": "vitrieval-shards", "version": 1, "shards": ["shard-000", "shard-002"],
             "rule": "sha256-64-mod", "dim": 128, "factory": "Flat"}
        )
    )  # fmt: skip
    code, _, err = run(capsys, "info", tmp_path / "three")
    assert code == 2 and one_line(err) and "shards" in err


def test_a_killed_sharded_build_resumes_to_the_same_index(tmp_path, capsys, tiny_onnx):
    fingerprint = read_model_metadata(tiny_onnx).fingerprint
    rng = np.random.default_rng(4)
    x = with_duplicates(exact_vectors(rng, 3000), copies=3, originals=20)
    keys = [f"row/{i:05d}" for i in rng.permutation(len(x))]
    emb = write_folder(tmp_path / "emb", x, keys, fingerprint=fingerprint, parts=6)
    out = tmp_path / "index"
    argv = ["build", "--embeddings", emb, "--model", tiny_onnx, "--factory", "Flat",
            "--shards", "3", "--save-every", "40", "--out", out]  # fmt: skip
    process = subprocess.Popen(
        [sys.executable, "-m", "vitrieval.index.cli", *map(str, argv)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a process group of its own: the shard workers are in it
    )
    deadline = time.monotonic() + 120
    try:
        while process.poll() is None and time.monotonic() < deadline:
            if any((out / f"shard-00{i}" / "manifest.json").exists() for i in range(3)):
                break
            time.sleep(0.002)
        process.kill()  # the build process alone: its shard workers must die with it
        process.wait()
        workers_gone = time.monotonic() + 10
        while _group_alive(process.pid) and time.monotonic() < workers_gone:
            time.sleep(0.05)
        orphans = _group_alive(process.pid)
    finally:
        if _group_alive(process.pid):
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == -signal.SIGKILL, "the build finished before it was killed"
    assert not orphans, "shard workers outlived the killed build"
    assert not (out / SHARDS_FILE).exists()  # not committed
    code, _, err = run(capsys, "search", out, "x.png")
    assert code == 2 and one_line(err) and "has not finished" in err

    code, out_text, err = run(capsys, *argv)
    assert code == 0, err
    assert f"{out} holds {len(x)} items in 3 shards" in out_text
    resumed = open_index(out)
    unbroken_dir = tmp_path / "unbroken"
    build_sharded(emb, unbroken_dir, str(tiny_onnx), "Flat", 3, 40, in_process)
    unbroken = open_index(unbroken_dir)
    assert resumed.keys() == unbroken.keys() and len(resumed) == len(x)
    same_hits(unbroken.search(x[:40], 10), resumed.search(x[:40], 10))
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in unbroken_dir.iterdir())


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def served_pair(tmp_path_factory, digits_gallery) -> dict[str, Path]:
    """The digits gallery as an embeddings folder, built as one store and as 3 shards."""
    root = tmp_path_factory.mktemp("served_pair")
    source = IndexStore.open(digits_gallery["index"])
    keys = source.keys()
    records = [source.get(key) for key in keys]
    emb = root / "emb"
    write_part(
        emb / "part-00000.parquet",
        keys,
        np.stack([r.vector for r in records]),
        labels=[r.label for r in records],
        paths=[r.path for r in records],
    )
    (emb / "embeddings.json").write_text(
        json.dumps({"dim": source.dim, "model_fingerprint": source.fingerprint})
    )
    one = unsharded(emb, root / "one")
    one.close()
    build_sharded(emb, root / "sharded", str(digits_gallery["model"]), "Flat", 3, 50, in_process)
    return {"one": root / "one", "sharded": root / "sharded"}


def test_the_service_serves_a_sharded_index_as_one_store(tmp_path, served_pair, digits_gallery):
    answers = {}
    gallery = csv_list(digits_gallery["list"])
    image = Path(gallery[7].path).read_bytes()
    for name in ("one", "sharded"):
        index = Path(shutil.copytree(served_pair[name], tmp_path / name))
        settings = Settings(model=digits_gallery["model"], index=index, api_key=KEY)
        auth = {"X-API-Key": KEY}
        with TestClient(create_app(settings)) as client:
            got = answers[name] = {}
            assert client.get("/readyz").status_code == 200
            got["upload"] = client.post(
                "/v1/search", files={"image": ("q.png", image, "image/png")}, data={"k": "6"}
            ).json()["hits"]
            got["key"] = client.post("/v1/search", json={"key": gallery[3].key, "k": 5}).json()[
                "hits"
            ]
            got["label"] = client.post(
                "/v1/search", json={"key": gallery[3].key, "k": 5, "label": "4"}
            ).json()["hits"]
            vector = [0.0] * 128
            vector[3] = 1.0
            added = client.post(
                "/v1/items", json={"key": "api/1", "vector": vector, "label": "x"}, headers=auth
            )
            assert added.status_code == 201, added.text
            again = client.post("/v1/items", json={"key": "api/1", "vector": vector}, headers=auth)
            got["conflict"] = again.status_code
            got["item"] = client.get("/v1/items/api/1").json()
            got["after_add"] = client.post("/v1/search", json={"vector": vector, "k": 3}).json()[
                "hits"
            ]
            got["delete"] = client.delete(f"/v1/items/{gallery[5].key}", headers=auth).status_code
            got["missing"] = client.get(f"/v1/items/{gallery[5].key}").status_code
            got["evaluate"] = client.post("/v1/evaluate", json={"ks": [1, 4]}).json()
            info = client.get("/v1/info").json()["index"]
            got["count"] = info["count"]
            got["pending"] = info["journal_pending"]
            metrics = client.get("/metrics").text
            got["metrics"] = "vitrieval_index_items 120.0" in metrics
        reopened = open_index(index)  # the shutdown saved the journalled mutations
        got["saved"] = (len(reopened), "api/1" in reopened, gallery[5].key in reopened)
        reopened.close()
    one, sharded = answers["one"], answers["sharded"]
    assert one["upload"] and one["upload"] == sharded["upload"]
    assert one == sharded
    assert sharded["conflict"] == 409 and sharded["missing"] == 404 and sharded["pending"] == 2
    assert sharded["saved"] == (120, True, False) and sharded["metrics"]
