"""`vitrieval-index build --embeddings EMB --shards N --ray ADDRESS`: the shards built as
Ray tasks give the index the local processes give (distributed/build.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from index_cli_helpers import run  # tests/index_cli_helpers.py
from test_distributed_embed import run_without_ray
from test_embeddings import one_line

from vitrieval.index.cli import main
from vitrieval.index.evaluation.datasets import load_dataset
from vitrieval.index.shards import SHARDS_FILE


@pytest.fixture(scope="module")
def embedded(tmp_path_factory, tiny_onnx) -> dict[str, Path]:
    """90 digit images in class folders and their embeddings folder (tiny_onnx)."""
    root = tmp_path_factory.mktemp("ray_build")
    for item in load_dataset("digits").train[:90]:
        folder = root / "photos" / f"class_{item.label}"
        folder.mkdir(parents=True, exist_ok=True)
        item.open().save(folder / f"{item.key.replace('/', '_')}.png")
    emb = root / "emb"
    argv = ["embed", "--model", tiny_onnx, "--images", root / "photos", "--out", emb]
    assert main([str(a) for a in [*argv, "--labels-from-folders", "--device", "cpu"]]) == 0
    return {"photos": root / "photos", "emb": emb}


@pytest.mark.ray
def test_shards_built_as_ray_tasks_search_as_the_local_build(
    tmp_path, capsys, embedded, tiny_onnx, ray_address
):
    common = ("build", "--embeddings", embedded["emb"], "--model", tiny_onnx, "--factory", "Flat")
    local, on_ray = tmp_path / "local", tmp_path / "ray"
    code, out, err = run(capsys, *common, "--shards", "3", "--out", local)
    assert code == 0, err
    # in this process, `local` runs on the session's cluster (a connected process keeps it)
    code, out, err = run(capsys, *common, "--shards", "3", "--out", on_ray, "--ray", "local")
    assert code == 0, err
    assert "indexed 90 of 90 embeddings" in out and f"{on_ray} holds 90 items in 3 shards" in out
    assert (on_ray / SHARDS_FILE).is_file()

    queries = sorted(embedded["photos"].glob("class_*/*.png"))[::9]
    results = [
        json.loads(run(capsys, "search", index, *queries, "-k", "10", "--json")[1])
        for index in (local, on_ray)
    ]
    for a, b in zip(*results, strict=True):
        assert [h["key"] for h in a["hits"]] == [h["key"] for h in b["hits"]]
        np.testing.assert_array_equal(
            [h["score"] for h in a["hits"]], [h["score"] for h in b["hits"]]
        )
    # a re-run on Ray finds every shard done
    code, out, err = run(capsys, *common, "--out", on_ray, "--ray", "local")
    assert code == 0 and "indexed 0 of 90" in out and "90 already present" in out, err


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (("--ray", "nowhere", "--shards", "2"), "is not a Ray address"),
        (("--ray", "local"), "--ray builds the shards of a sharded index"),
    ],
)
def test_bad_ray_builds_are_one_line(tmp_path, capsys, embedded, tiny_onnx, options, message):
    argv = ["build", "--embeddings", embedded["emb"], "--model", tiny_onnx, "--factory", "Flat"]
    code, _, err = run(capsys, *argv, "--out", tmp_path / "index", *options)
    assert code == 2 and one_line(err) and message in err, err
    code, _, err = run(
        capsys, "build", "--images", embedded["photos"], "--model", tiny_onnx,
        "--out", tmp_path / "index", "--ray", "local",
    )  # fmt: skip
    assert code == 2 and one_line(err) and "--ray builds the shards" in err


def test_without_ray_a_ray_build_is_one_line_naming_the_extra(tmp_path, embedded, tiny_onnx):
    argv = ["build", "--embeddings", embedded["emb"], "--model", tiny_onnx, "--factory", "Flat"]
    argv += ["--shards", "2", "--out", tmp_path / "index", "--ray", "local"]
    done = run_without_ray(*argv)
    assert done.returncode == 2 and one_line(done.stderr), done.stderr
    assert "pip install -c constraints.txt -e '.[distributed]'" in done.stderr
    assert not (tmp_path / "index").exists()
