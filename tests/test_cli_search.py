"""`vitrieval-index search` with --filter, --fuse and --rerank aqe: the same answers as
`vitrieval.index.query` on the opened index (what the HTTP service runs), one result block for
fused images, and every bad option one line on stderr with exit status 2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from index_cli_helpers import run  # tests/index_cli_helpers.py

from vitrieval.index.evaluation.datasets import csv_list
from vitrieval.index.query import AQE, Where, search_store, search_store_fused
from vitrieval.index.runtime.embedder import Embedder
from vitrieval.index.store import IndexStore
from vitrieval.index.store.filters import parse_filter

COLOURS = ("red", "blue", "green")
RED_OR_BLUE = {"must": [{"key": "colour", "match": {"any": ["red", "blue"]}}]}


@pytest.fixture(scope="module")
def catalogue(digits_gallery, tmp_path_factory) -> dict:
    """A copy of the digits gallery's index whose items carry a colour and a price."""
    import shutil

    index = Path(shutil.copytree(digits_gallery["index"], tmp_path_factory.mktemp("cli") / "i"))
    items = csv_list(digits_gallery["list"])
    with IndexStore.open(index) as store:
        records = [store.get(item.key) for item in items]
        store.add(
            [r.key for r in records],
            np.stack([r.vector for r in records]),
            labels=[r.label for r in records],
            paths=[r.path for r in records],
            metadata=[{"colour": COLOURS[i % 3], "price": i} for i in range(len(records))],
            replace=True,
        )
        store.save()
    queries = [Path(items[i].path) for i in (4, 33, 70)]
    vectors = Embedder(digits_gallery["model"]).embed_sources(queries).embeddings
    return {"index": index, "queries": queries, "vectors": vectors}


def hits_of(block: dict) -> list[tuple[str, float]]:
    return [(h["key"], h["score"]) for h in block["hits"]]


def expected(found) -> list[tuple[str, float]]:
    return [(h.key, h.score) for _, h in found]


def test_each_image_is_its_own_query_with_a_filter(capsys, catalogue) -> None:
    index, queries, vectors = catalogue["index"], catalogue["queries"], catalogue["vectors"]
    flt = json.dumps(RED_OR_BLUE)
    code, out, err = run(capsys, "search", index, *queries, "-k", "7", "--filter", flt, "--json")
    assert code == 0, err
    blocks = json.loads(out)
    assert [b["query"] for b in blocks] == [str(q) for q in queries]
    with IndexStore.open(index) as store:
        want = store.search(vectors, 7, filter=RED_OR_BLUE)
        for block, row in zip(blocks, want, strict=True):
            assert hits_of(block) == [(h.key, h.score) for h in row]
            assert all(
                store.get(k).metadata["colour"] in ("red", "blue") for k, _ in hits_of(block)
            )
    # the same filter from a file
    path = index.parent / "filter.json"
    path.write_text(flt)
    code, again, _ = run(
        capsys, "search", index, *queries, "-k", "7", "--filter", f"@{path}", "--json"
    )
    assert code == 0 and json.loads(again) == blocks
    # with a label too: both hold
    code, out, _ = run(
        capsys, "search", index, queries[0], "-k", "50", "--filter", flt, "--label", "3", "--json"
    )
    labels = {h["label"] for h in json.loads(out)[0]["hits"]}
    assert code == 0 and labels == {"3"}


@pytest.mark.parametrize("fusion", ["mean", "max"])
def test_fused_images_are_one_query(capsys, catalogue, fusion) -> None:
    index, queries, vectors = catalogue["index"], catalogue["queries"], catalogue["vectors"]
    code, out, err = run(capsys, "search", index, *queries, "-k", "9", "--fuse", fusion, "--json")
    assert code == 0, err
    blocks = json.loads(out)
    assert len(blocks) == 1
    assert blocks[0]["query"] == [str(q) for q in queries] and blocks[0]["fusion"] == fusion
    with IndexStore.open(index) as store:
        assert hits_of(blocks[0]) == expected(search_store_fused(store, vectors, 9, fusion=fusion))
        # with a filter and alpha-QE too
        code, out, err = run(
            capsys, "search", index, *queries, "-k", "9", "--fuse", fusion,
            "--filter", json.dumps(RED_OR_BLUE), "--rerank", "aqe", "--aqe-n", "4", "--json",
        )  # fmt: skip
        assert code == 0, err
        want = search_store_fused(
            store, vectors, 9, fusion=fusion, where=Where(filter=RED_OR_BLUE), rerank=AQE(4)
        )
        assert hits_of(json.loads(out)[0]) == expected(want)
    # text: one block headed by the images and the fusion
    code, out, _ = run(capsys, "search", index, *queries, "-k", "3", "--fuse", fusion)
    lines = out.splitlines()
    assert code == 0 and len(lines) == 2 + 3
    assert lines[0] == " + ".join(str(q) for q in queries) + f" ({fusion} of 3)"


def test_aqe_reranks_each_query(capsys, catalogue) -> None:
    index, queries, vectors = catalogue["index"], catalogue["queries"], catalogue["vectors"]
    code, out, err = run(
        capsys, "search", index, *queries, "-k", "6", "--rerank", "aqe",
        "--aqe-n", "3", "--aqe-alpha", "1.5", "--json",
    )  # fmt: skip
    assert code == 0, err
    with IndexStore.open(index) as store:
        want = search_store(store, vectors, 6, rerank=AQE(3, 1.5))
        plain = store.search(vectors, 6)
    blocks = json.loads(out)
    assert [hits_of(b) for b in blocks] == [expected(row) for row in want]
    assert [hits_of(b) for b in blocks] != [[(h.key, h.score) for h in row] for row in plain]
    # defaults: n and alpha of index/rerank.py
    code, out, _ = run(capsys, "search", index, queries[0], "-k", "6", "--rerank", "aqe", "--json")
    with IndexStore.open(index) as store:
        assert hits_of(json.loads(out)[0]) == expected(
            search_store(store, vectors[:1], 6, rerank=AQE())[0]
        )


@pytest.mark.parametrize(
    ("options", "says"),
    [
        (["--filter", "{oops"], "--filter is not valid JSON"),
        (["--filter", '{"must": [{"key": "colour"}]}'], "filter.must[0]"),
        (["--filter", '{"mist": []}'], "unknown field 'mist'"),
        (["--filter", '"red"'], "filter must be an object"),
        (["--filter", "@/nonexistent/filter.json"], "/nonexistent/filter.json"),
        (["--aqe-n", "3"], "--aqe-n and --aqe-alpha need --rerank aqe"),
        (["--rerank", "aqe", "--aqe-n", "0"], "alpha-QE neighbours"),
        (["--rerank", "aqe", "--aqe-alpha", "-1"], "alpha-QE alpha"),
        (["--rerank", "aqe", "--aqe-alpha", "nan"], "alpha-QE alpha"),
    ],
)
def test_bad_options_are_one_line_and_exit_2(capsys, catalogue, options, says) -> None:
    code, out, err = run(capsys, "search", catalogue["index"], catalogue["queries"][0], *options)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("vitrieval-index search: error: ")
    assert says in err and "Traceback" not in err


@pytest.mark.parametrize("options", [["--fuse", "median"], ["--rerank", "qe"]])
def test_unknown_choices_are_usage_errors(capsys, catalogue, options) -> None:
    with pytest.raises(SystemExit) as exit_:
        run(capsys, "search", catalogue["index"], catalogue["queries"][0], *options)
    assert exit_.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_a_filter_is_checked_before_the_index_is_opened(capsys) -> None:
    code, _, err = run(capsys, "search", "/nonexistent/index", "q.png", "--filter", "[1]")
    assert code == 2 and "filter" in err and "/nonexistent/index" not in err
    parse_filter(RED_OR_BLUE)  # the filter the tests use is a valid one


def test_rerank_dba_ranks_against_the_dba_vectors(capsys, catalogue, tmp_path) -> None:
    import shutil

    index = Path(shutil.copytree(catalogue["index"], tmp_path / "i"))
    query, vectors = catalogue["queries"][0], catalogue["vectors"][:1]
    code, _, err = run(capsys, "search", index, query, "--rerank", "dba")
    assert code == 2 and err.count("\n") == 1 and "has no DBA vectors" in err
    code, _, err = run(capsys, "configure", index, "--dba", "3")
    assert code == 0, err
    code, out, err = run(capsys, "search", index, query, "-k", "6", "--rerank", "dba", "--json")
    assert code == 0, err
    with IndexStore.open(index) as store:
        want = store.search(vectors, 6, augmented=True)[0]
        assert hits_of(json.loads(out)[0]) == [(h.key, h.score) for h in want]
        assert want != store.search(vectors, 6)[0]  # DBA changes this ranking
