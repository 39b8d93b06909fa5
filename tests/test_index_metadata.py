"""Item metadata from files: a CSV list's `metadata` column (build, embed, add) and
`add INDEX IMAGE --key K --metadata JSON`, then filtered searches on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from index_cli_helpers import run  # tests/index_cli_helpers.py

from vitrieval.index.evaluation.datasets import DatasetError, csv_list, load_dataset

COLOURS = ("red", "blue")


@pytest.fixture(scope="module")
def listed(tmp_path_factory) -> Path:
    """8 digit images and a CSV list `path,label,key,metadata` (colour alternating)."""
    root = tmp_path_factory.mktemp("listed")
    items = load_dataset("digits").train[:9]
    lines = ["path,label,key,metadata"]
    for i, item in enumerate(items[:8]):
        item.open().save(root / f"{i}.png")
        meta = json.dumps({"colour": COLOURS[i % 2], "n": i}).replace('"', '""')
        lines.append(f'{i}.png,{item.label},k{i},"{meta}"')
    items[8].open().save(root / "extra.png")
    (root / "list.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root


def _hits(capsys, index: Path, query: Path, where: dict) -> list[dict]:
    code, out, err = run(
        capsys, "search", index, query, "-k", "8", "--json", "--filter", json.dumps(where)
    )
    assert code == 0, err
    return json.loads(out)[0]["hits"]


def test_build_from_csv_carries_metadata_into_filters(tmp_path, capsys, listed, tiny_onnx):
    index = tmp_path / "index"
    code, out, err = run(
        capsys, "build", "--model", tiny_onnx, "--images", listed / "list.csv", "--out", index
    )
    assert code == 0, err
    red = {"must": [{"key": "colour", "match": "red"}]}
    hits = _hits(capsys, index, listed / "0.png", red)
    assert sorted(hit["key"] for hit in hits) == ["k0", "k2", "k4", "k6"]
    # --json hits carry each item's metadata, as the HTTP API's do
    assert {hit["key"]: hit["metadata"] for hit in hits}["k2"] == {"colour": "red", "n": 2}
    big = {"must": [{"key": "n", "range": {"gte": 6}}]}
    assert sorted(hit["key"] for hit in _hits(capsys, index, listed / "0.png", big)) == [
        "k6",
        "k7",
    ]

    # one image, its key, label and metadata on the command line
    code, out, err = run(
        capsys,
        "add",
        index,
        listed / "extra.png",
        "--key",
        "extra",
        "--label",
        "x",
        "--metadata",
        '{"colour": "green"}',
    )
    assert code == 0, err
    assert "indexed 1 of 1 images" in out
    green = {"must": [{"key": "colour", "match": "green"}]}
    hits = _hits(capsys, index, listed / "0.png", green)
    assert [(hit["key"], hit["label"]) for hit in hits] == [("extra", "x")]


def test_embed_then_build_carries_metadata(tmp_path, capsys, listed, tiny_onnx):
    import pyarrow.parquet as pq

    emb, index = tmp_path / "emb", tmp_path / "index"
    code, _, err = run(
        capsys, "embed", "--model", tiny_onnx, "--images", listed / "list.csv", "--out", emb
    )
    assert code == 0, err
    table = pq.read_table(next(emb.glob("part-*.parquet")))
    assert json.loads(table.column("metadata")[1].as_py()) == {"colour": "blue", "n": 1}
    code, _, err = run(capsys, "build", "--embeddings", emb, "--out", index)
    assert code == 0, err
    blue = {"must": [{"key": "colour", "match": "blue"}]}
    assert sorted(h["key"] for h in _hits(capsys, index, listed / "1.png", blue)) == [
        "k1",
        "k3",
        "k5",
        "k7",
    ]


def test_unread_columns_and_bad_metadata_are_errors(tmp_path, capsys, listed, tiny_onnx):
    bad = tmp_path / "bad.csv"
    bad.write_text(f"path,label,meta\n{listed / '0.png'},a,{{}}\n")
    out = tmp_path / "x"
    code, _, err = run(capsys, "build", "--model", tiny_onnx, "--images", bad, "--out", out)
    assert code == 2 and "unknown column(s) meta" in err and "metadata" in err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()

    bad.write_text(f'path,label,metadata\n{listed / "0.png"},a,"[1, 2]"\n')
    with pytest.raises(DatasetError, match=r"bad.csv:2: metadata must be a JSON object"):
        csv_list(bad)
    bad.write_text(f'path,label,metadata\n{listed / "0.png"},a,"{{""id"": 9223372036854775808}}"\n')
    with pytest.raises(DatasetError, match=r"bad.csv:2: metadata.id: integers must lie within"):
        csv_list(bad)
    bad.write_text(f"path,label,metadata\n{listed / '0.png'},a,\n")
    assert csv_list(bad)[0].metadata is None  # an empty cell: no metadata


def test_add_one_image_needs_a_key(tmp_path, capsys, listed, tiny_onnx):
    index = tmp_path / "index"
    assert run(capsys, "build", "--model", tiny_onnx, "--images", listed, "--out", index)[0] == 0
    code, _, err = run(capsys, "add", index, listed / "extra.png")
    assert code == 2 and "needs --key" in err
    code, _, err = run(capsys, "add", index, listed / "extra.png", "--key", "e", "--metadata", "[]")
    assert code == 2 and "--metadata: metadata must be a JSON object" in err
    code, _, err = run(capsys, "add", index, "--images", listed, "--key", "e")
    assert code == 2 and "--key applies to one IMAGE" in err


def test_a_misspelt_filter_key_says_so(tmp_path, capsys, listed, tiny_onnx):
    index = tmp_path / "index"
    code, _, err = run(
        capsys, "build", "--model", tiny_onnx, "--images", listed / "list.csv", "--out", index
    )
    assert code == 0, err
    misspelt = {"must": [{"key": "color", "match": "red"}]}
    code, out, err = run(
        capsys, "search", index, listed / "0.png", "--json", "--filter", json.dumps(misspelt)
    )
    assert code == 0, err  # an empty answer is an answer
    assert json.loads(out)[0]["hits"] == []
    assert "none of the 8 nearest items has 'color' in its metadata" in err
    assert "(they have: colour, n)" in err

    # a key that exists but matches nothing is a plain empty answer, with no note
    absent = {"must": [{"key": "colour", "match": "purple"}]}
    code, out, err = run(
        capsys, "search", index, listed / "0.png", "--json", "--filter", json.dumps(absent)
    )
    assert code == 0 and json.loads(out)[0]["hits"] == [] and err == ""


def test_rebuilding_with_edited_metadata_says_the_index_keeps_its_own(
    tmp_path, capsys, listed, tiny_onnx
):
    index = tmp_path / "index"
    build = ("build", "--model", tiny_onnx, "--out", index, "--images")
    code, _, err = run(capsys, *build, listed / "list.csv")
    assert code == 0, err
    # the same list, k0's colour edited (paths made absolute: the copy lives elsewhere)
    header, *rows = (listed / "list.csv").read_text(encoding="utf-8").splitlines()
    rows[0] = rows[0].replace("red", "green")
    edited = tmp_path / "edited.csv"
    edited.write_text(
        "\n".join([header, *(f"{listed}/{row}" for row in rows)]) + "\n", encoding="utf-8"
    )
    code, out, err = run(capsys, *build, edited)
    assert code == 0, err
    assert out.startswith("already finished, nothing to do: indexed 0 of 8 images, 8 already")
    assert "(1 with another label or metadata here: the index keeps its own;" in out
    assert "img/s" not in out  # nothing was indexed: no rate
    red = {"must": [{"key": "colour", "match": "red"}]}
    assert "k0" in [hit["key"] for hit in _hits(capsys, index, listed / "0.png", red)]
