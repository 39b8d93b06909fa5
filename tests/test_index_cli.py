"""`vitrieval-index` end to end: build, resume, search, info, remove, bench, bad input."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from index_cli_helpers import run  # tests/index_cli_helpers.py

from vitrieval.index.evaluation.datasets import load_dataset


@pytest.fixture(scope="module")
def photo_folder(tmp_path_factory) -> Path:
    """38 real digit images in 4 class folders plus 2 corrupt files (5%)."""
    root = tmp_path_factory.mktemp("catalogue")
    items = [item for item in load_dataset("digits").train if item.label in {"0", "1", "2", "3"}]
    for item in items[:38]:
        folder = root / f"class_{item.label}"
        folder.mkdir(exist_ok=True)
        item.open().save(folder / f"{item.key.replace('/', '_')}.png")
    (root / "class_0" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    (root / "class_1" / "notes.jpg").write_text("this is not an image")
    return root


def test_build_search_info_remove(tmp_path, capsys, photo_folder, tiny_onnx):
    index = tmp_path / "index"
    build = ("build", "--model", tiny_onnx, "--images", photo_folder, "--out", index)
    code, out, _ = run(capsys, *build, "--labels-from-folders")
    assert code == 0
    # --factory auto (the default) says what it chose: exact search for a small catalogue
    assert out.startswith("factory auto: Flat for 40 vectors of dimension 128, a FAISS index")
    assert "indexed 38 of 40 images" in out and "2 unreadable" in out
    report = json.loads((index / "build_report.json").read_text())
    assert sorted(Path(f["key"]).name for f in report["failed"]) == ["broken.png", "notes.jpg"]

    # re-running skips what is there
    code, out, _ = run(capsys, *build, "--labels-from-folders")
    assert code == 0 and "indexed 0 of 40" in out and "38 already present" in out
    assert "factory auto" not in out  # the index has its factory

    code, out, _ = run(capsys, "info", index, "--json")
    info = json.loads(out)
    assert code == 0 and info["count"] == 38 and info["dim"] == 128

    # every indexed image finds itself first (Flat, exact)
    queries = sorted(photo_folder.glob("class_*/*.png"))
    queries = [q for q in queries if q.name != "broken.png"][:6]
    code, out, _ = run(capsys, "search", index, *queries, "-k", "3", "--json")
    assert code == 0
    for query, result in zip(queries, json.loads(out), strict=True):
        top = result["hits"][0]
        assert top["key"] == query.relative_to(photo_folder).as_posix()
        assert top["score"] == pytest.approx(1.0, abs=1e-5)
        assert top["label"] == query.parent.name
        assert len(result["hits"]) == 3

    victim = queries[0].relative_to(photo_folder).as_posix()
    code, out, _ = run(capsys, "remove", index, victim)
    assert code == 0 and "removed 1 of 1" in out
    code, out, _ = run(capsys, "search", index, queries[0], "-k", "5", "--json")
    assert victim not in [h["key"] for h in json.loads(out)[0]["hits"]]


def test_text_output_of_search_info_and_remove(tmp_path, capsys, photo_folder, tiny_onnx):
    index = tmp_path / "index"
    build = ("build", "--model", tiny_onnx, "--images", photo_folder, "--out", index)
    assert run(capsys, *build, "--labels-from-folders")[0] == 0
    query = (
        photo_folder / "class_2" / sorted(p.name for p in (photo_folder / "class_2").iterdir())[0]
    )
    key = query.relative_to(photo_folder).as_posix()

    # search: the query, a column header, then one line per hit
    code, out, _ = run(capsys, "search", index, query, "-k", "2")
    lines = out.splitlines()
    assert code == 0 and lines[0] == str(query)
    assert lines[1].split() == ["rank", "score", "label", "key"]
    assert lines[2].split() == ["1", "1.0000", "class_2", key]
    assert len(lines) == 4

    # info: one line per file with its size, not a Python dict
    code, out, _ = run(capsys, "info", index)
    assert code == 0 and "{" not in out
    files = json.loads(run(capsys, "info", index, "--json")[1])["files"]
    for name, entry in files.items():
        assert f"  {name}  " in out
        line = next(line for line in out.splitlines() if line.strip().startswith(name))
        assert f"{entry['bytes']:,} bytes" in line and entry["sha256"] in line

    # remove: the keys that exist go, the missing ones are named, exit status 2
    other = sorted(p for p in photo_folder.glob("class_3/*.png"))[0]
    other_key = other.relative_to(photo_folder).as_posix()
    code, out, err = run(capsys, "remove", index, key, "no/such.png", other_key, "nope")
    assert code == 2
    assert out == f"removed 2 of 4 keys: {key}, {other_key}; {index} holds 36 items\n"
    assert err == f"vitrieval-index remove: error: 2 of 4 keys not in {index}: no/such.png, nope\n"
    assert json.loads(run(capsys, "info", index, "--json")[1])["count"] == 36
    code, out, err = run(capsys, "remove", index, key)
    assert code == 2 and "removed 0 of 1 keys;" in out and err.endswith(f": {key}\n")
    code, _, err = run(capsys, "remove", index)
    assert code == 2 and "no keys given" in err and err.count("\n") == 1


def test_build_factory_auto_and_memory_budget(
    tmp_path, capsys, photo_folder, tiny_onnx, monkeypatch
):
    import vitrieval.index.factory as factory_module

    build = ("build", "--model", tiny_onnx, "--images", photo_folder)
    # as if 40 images were a large catalogue: an inverted file (40 // 39 -> 1 list)
    monkeypatch.setattr(factory_module, "FLAT_BELOW", 10)
    code, out, err = run(capsys, *build, "--out", tmp_path / "ivf")
    assert code == 0, err
    assert out.splitlines()[0].startswith("factory auto: IVF1,Flat for 40 vectors of dimension")
    assert json.loads(run(capsys, "info", tmp_path / "ivf", "--json")[1])["factory"] == "IVF1,Flat"
    # re-running keeps the index's factory; naming another one is refused
    code, out, _ = run(capsys, *build, "--out", tmp_path / "ivf")
    assert code == 0 and "factory auto" not in out and "38 already present" in out
    code, _, err = run(capsys, *build, "--out", tmp_path / "ivf", "--factory", "Flat")
    assert code == 2 and "was built with factory 'IVF1,Flat', not 'Flat'" in err

    # --factory Flat is exact search whatever the size, and says nothing about a choice
    code, out, _ = run(capsys, *build, "--out", tmp_path / "flat", "--factory", "Flat")
    assert code == 0 and "factory auto" not in out
    info = json.loads(run(capsys, "info", tmp_path / "flat", "--json")[1])
    assert info["factory"] == "Flat"
    queries = sorted(photo_folder.glob("class_*/[!b]*.png"))[:5]
    code, out, _ = run(capsys, "search", tmp_path / "flat", *queries, "-k", "1", "--json")
    assert [r["hits"][0]["score"] for r in json.loads(out)] == pytest.approx([1.0] * 5, abs=1e-6)

    for extra, needle in [
        (["--memory-budget", "1K"], "over the 1 KiB budget, and are too few to train PQ"),
        (["--memory-budget", "4x"], "cannot read '4x' as a size"),
        (["--memory-budget", "1G", "--factory", "Flat"], "cannot be combined with --factory"),
    ]:
        code, out, err = run(capsys, *build, "--out", tmp_path / "refused", *extra)
        assert code == 2 and needle in err and err.count("\n") == 1, err
        assert not (tmp_path / "refused").exists()


def test_csv_build_and_model_override(tmp_path, capsys, photo_folder, tiny_onnx, tiny_onnx_other):
    listing = tmp_path / "list.csv"
    with open(listing, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["path", "label"])
        for path in sorted(photo_folder.glob("class_*/*.png"))[:10]:
            writer.writerow([path, path.parent.name])
    index = tmp_path / "index"
    code, _, err = run(capsys, "build", "--model", tiny_onnx, "--images", listing, "--out", index)
    assert code == 0, err
    query = sorted(photo_folder.glob("class_*/*.png"))[0]
    code, _, err = run(capsys, "search", index, query, "--model", tiny_onnx_other)
    assert code == 2 and "fingerprint" in err and err.count("\n") == 1
    # the error says what to do: the index's own model copy, or a rebuild
    assert f"leave out --model to use the index's own copy ({index / 'model.onnx'})" in err
    assert "rebuild the index with this model" in err
    code, _, err = run(
        capsys, "build", "--model", tiny_onnx_other, "--images", listing, "--out", index
    )
    assert code == 2 and "Traceback" not in err and err.count("\n") == 1
    assert "rebuild the index with this model (into a new folder)" in err
    assert (
        f"use the model it was built with (the index keeps a copy: {index / 'model.onnx'})" in err
    )


def test_corrupt_index_is_refused(tmp_path, capsys, photo_folder, tiny_onnx):
    index = tmp_path / "index"
    assert (
        run(capsys, "build", "--model", tiny_onnx, "--images", photo_folder, "--out", index)[0] == 0
    )
    faiss_file = next(index.glob("*.faiss"))
    data = bytearray(faiss_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    faiss_file.write_bytes(bytes(data))
    # opening checks sizes and headers only (docs/index.md): verify reads every byte
    code, _, err = run(capsys, "verify", index)
    assert code == 2 and "checksum" in err and "Traceback" not in err
    faiss_file.write_bytes(bytes(data[:-10]))  # a truncation is seen at every open
    for command in ("info", "search"):
        argv = (command, index) if command == "info" else (command, index, faiss_file)
        code, _, err = run(capsys, *argv)
        assert code == 2 and "truncated" in err and "Traceback" not in err


def test_bench_with_csv_gallery(tmp_path, capsys, photo_folder, tiny_onnx):
    gallery = tmp_path / "gallery.csv"
    with open(gallery, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["path", "label"])
        for path in sorted(photo_folder.glob("class_*/*.png")):
            writer.writerow([path, path.parent.name])
    out = tmp_path / "report"
    code, _, err = run(capsys, "bench", "--model", tiny_onnx, "--gallery", gallery, "--out", out)
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    for key in (
        "recall@1",
        "recall@8",
        "map",
        "map_at_r",
        "r_precision",
        "n_queries",
        "n_dropped",
        "embed_images_per_s",
        "search_qps",
        "index_bytes",
    ):
        assert key in report
    # 39 PNG files listed, broken.png among them: 38 embedded
    assert report["n_queries"] + report["n_dropped"] == report["n_gallery"] == 38
    assert report["unreadable_images"] == 1
    assert 0.0 <= report["map"] <= report["recall@1"] <= 1.0
    assert (out / "report.md").read_text().startswith("| metric | value |")


def test_bench_reads_a_folder_as_build_does(tmp_path, capsys, photo_folder, tiny_onnx):
    """--gallery DIR --labels-from-folders gives the numbers of a CSV of the same files."""
    listing = tmp_path / "gallery.csv"
    with open(listing, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["path", "label"])
        for path in sorted(photo_folder.glob("class_*/*")):
            writer.writerow([path, path.parent.name])
    bench = ("bench", "--model", tiny_onnx)
    code, out, err = run(
        capsys, *bench, "--gallery", photo_folder, "--labels-from-folders", "--out", tmp_path / "a"
    )
    assert code == 0, err
    assert f"folder:{photo_folder}" in out
    assert run(capsys, *bench, "--gallery", listing, "--out", tmp_path / "b")[0] == 0
    by_folder = json.loads((tmp_path / "a" / "report.json").read_text())
    by_csv = json.loads((tmp_path / "b" / "report.json").read_text())
    assert by_folder["n_gallery"] == 38 and by_folder["unreadable_images"] == 2
    for key in ("n_gallery", "unreadable_images", "recall@1", "recall@8", "map", "n_queries"):
        assert by_folder[key] == by_csv[key], key
    # a folder as queries against a CSV gallery: every query finds itself
    code, _, err = run(
        capsys,
        *bench,
        "--gallery",
        listing,
        "--queries",
        photo_folder,
        "--labels-from-folders",
        "--out",
        tmp_path / "c",
    )
    assert code == 0, err
    crossed = json.loads((tmp_path / "c" / "report.json").read_text())
    assert crossed["protocol"] == "queries-vs-gallery" and crossed["recall@1"] == 1.0

    # without labels there is nothing to measure: one line, exit status 2
    code, _, err = run(capsys, *bench, "--gallery", photo_folder, "--out", tmp_path / "d")
    assert code == 2 and "40 of 40 images have no label" in err and err.count("\n") == 1
    assert "--labels-from-folders" in err
    code, _, err = run(capsys, *bench, "--gallery", tmp_path / "nope", "--out", tmp_path / "d")
    assert code == 2 and err.endswith(f"--gallery path not found: {tmp_path / 'nope'}\n")


def test_bench_without_anything_to_measure_fails(tmp_path, capsys, photo_folder, tiny_onnx):
    broken = tmp_path / "broken"
    (broken / "x").mkdir(parents=True)
    (broken / "x" / "a.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    (broken / "x" / "b.png").write_text("not an image")
    (broken / "list.csv").write_text("path,label\nx/a.png,x\nx/b.png,x\n")
    bench = ("bench", "--model", tiny_onnx, "--out", tmp_path / "report")
    for gallery in (
        ["--gallery", broken / "list.csv"],
        ["--gallery", broken, "--labels-from-folders"],
    ):
        code, out, err = run(capsys, *bench, *gallery)
        assert code == 2 and out == "" and "nan" not in err
        # (above the error line: the embedding progress bar)
        last = err.splitlines()[-1]
        assert last.startswith("vitrieval-index bench: error: none of the 2 gallery images")
        assert "could be read (first: " in last and err.count("error") == 1
    # readable, but no image shares its label with another: every metric would be NaN
    unique = tmp_path / "unique.csv"
    rows = [f"{path},{i}" for i, path in enumerate(sorted(photo_folder.glob("class_2/*.png")))]
    unique.write_text("path,label\n" + "\n".join(rows) + "\n")
    code, out, err = run(capsys, *bench, "--gallery", unique)
    last = err.splitlines()[-1]
    assert code == 2 and out == "" and err.count("error") == 1
    assert last.startswith("vitrieval-index bench: error: no query has another gallery image")
    assert last.endswith("there is nothing to measure")
    assert not (tmp_path / "report" / "report.json").exists()


def test_bench_ivf_reports_fidelity(tmp_path, capsys, tiny_onnx):
    out = tmp_path / "report"
    code, _, err = run(
        capsys,
        "bench",
        "--model",
        tiny_onnx,
        "--dataset",
        "digits",
        "--factory",
        "IVF4,Flat",
        "--out",
        out,
    )
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    assert report["n_gallery"] == 539 and report["protocol"] == "leave-one-out"
    assert 0.0 < report["recall@10_vs_exact"] <= 1.0
    vectors_ok = np.isfinite([report["recall@1"], report["map"]]).all()
    assert vectors_ok


def test_export_dataset_keys_are_those_of_a_folder_build(tmp_path, capsys, tiny_onnx):
    """list.csv and a folder build of the same export give every image the same key."""
    images = tmp_path / "images"
    code, out, _ = run(capsys, "export-dataset", "--dataset", "digits", "--out", images)
    assert code == 0 and out.startswith("wrote 539 images of digits/stratified (test)")
    with open(images / "list.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert {"path": "7/digits_00017.png", "label": "7", "key": "7/digits_00017.png"} in rows
    build = ("build", "--model", tiny_onnx, "--images")
    assert run(capsys, *build, images, "--labels-from-folders", "--out", tmp_path / "a")[0] == 0
    assert run(capsys, *build, images / "list.csv", "--out", tmp_path / "b")[0] == 0
    from vitrieval.index.store import IndexStore

    by_folder, by_csv = IndexStore.open(tmp_path / "a"), IndexStore.open(tmp_path / "b")
    assert len(by_folder) == len(by_csv) == 539
    assert sorted(by_folder.keys()) == sorted(by_csv.keys()) == sorted(r["key"] for r in rows)
    for key in ("7/digits_00017.png", rows[0]["key"]):
        assert by_folder.get(key).label == by_csv.get(key).label == key.split("/")[0]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["info", "/nonexistent/index"], "/nonexistent/index"),
        (
            ["build", "--images", "/nonexistent/photos", "--out", "X", "--model", "M.onnx"],
            "not found",
        ),
        (["search", "/nonexistent/index", "q.jpg"], "/nonexistent/index"),
        (["add", "/nonexistent/index", "--images", "."], "not an index"),
    ],
)
def test_user_errors_one_line(capsys, argv, needle):
    code, _, err = run(capsys, *argv)
    assert code == 2 and needle in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    "argv",
    [
        ["info", "I"],
        ["search", "I", "q.jpg"],
        ["remove", "I", "k"],
        ["build", "--images", "d", "--out", "o"],
        ["add", "I", "--images", "d"],
        ["bench", "--model", "m", "--out", "o"],
        ["export-dataset", "--out", "o"],
        ["quantize", "--model", "m", "--out", "o"],
    ],
)
def test_global_flags_before_and_after_the_command(argv):
    from vitrieval.index.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(argv).verbose is False
    for flag in ("-v", "--verbose"):
        assert parser.parse_args([flag, *argv]).verbose is True
        assert parser.parse_args([*argv, flag]).verbose is True
    assert parser.parse_args([argv[0], "-v", *argv[1:]]).verbose is True


def test_indexed_jpeg_finds_itself_with_score_one(tmp_path, capsys, tiny_onnx):
    """Queries are decoded exactly as the catalogue was (reduced-scale JPEG decoding)."""
    from PIL import Image
    from skimage import data as skdata

    folder = tmp_path / "photos"
    folder.mkdir()
    for name in ("astronaut", "coffee", "chelsea", "rocket"):
        Image.fromarray(getattr(skdata, name)()).save(folder / f"{name}.jpg", quality=90)
    index = tmp_path / "index"
    assert run(capsys, "build", "--model", tiny_onnx, "--images", folder, "--out", index)[0] == 0
    code, out, err = run(capsys, "search", index, folder / "coffee.jpg", "-k", "2", "--json")
    assert code == 0, err
    top = json.loads(out)[0]["hits"][0]
    assert top["key"] == "coffee.jpg"
    # the same pixels give the same vector: full decoding of the query would give 1 - 2e-6
    assert top["score"] == pytest.approx(1.0, abs=5e-7)
    code, _, err = run(capsys, "search", index, tmp_path / "missing.jpg")
    assert code == 2 and "missing.jpg" in err and "Traceback" not in err
