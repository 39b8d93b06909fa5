"""Progress of `vitrieval-index build/embed/add`: plain rate-limited lines off a
terminal, and "already finished" when a re-run has nothing left to do."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from index_cli_helpers import run  # tests/index_cli_helpers.py

from vitrieval.index import progress
from vitrieval.index.evaluation.datasets import load_dataset


def test_line_progress_is_rate_limited(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    stream = io.StringIO()
    bar = progress.LineProgress(1000, "images", "embedding", interval=10.0, stream=stream)
    for _ in range(999):  # 999 images over 99.9 s
        bar.update(1)
        clock[0] += 0.1
    bar.update(1)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert lines[0] == "embedding: 1 of 1,000 images (0%)"
    assert lines[-1] == "embedding: 1,000 of 1,000 images (100%)"
    assert 10 <= len(lines) <= 12  # one line per 10 s, not one per image


@pytest.fixture(scope="module")
def small_folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("small")
    for item in load_dataset("digits").train[:6]:
        item.open().save(root / f"{item.key.replace('/', '_')}.png")
    return root


def test_rerun_with_nothing_left_says_already_finished(tmp_path, capsys, small_folder, tiny_onnx):
    index, emb = tmp_path / "index", tmp_path / "emb"
    build = ("build", "--model", tiny_onnx, "--images", small_folder, "--out", index)
    assert "already finished" not in run(capsys, *build)[1]
    code, out, _ = run(capsys, *build)
    assert code == 0 and out.startswith("already finished, nothing to do: indexed 0 of 6")
    embed = ("embed", "--model", tiny_onnx, "--images", small_folder, "--out", emb)
    assert "already finished" not in run(capsys, *embed)[1]
    code, out, err = run(capsys, *embed)
    assert code == 0 and out.startswith("already finished, nothing to do: embedded 0 of 6")
    assert "embedding:" not in err  # no progress line when nothing is embedded


def test_embed_cuts_a_small_catalogue_into_several_parts():
    from vitrieval.index.pipeline.embed_folder import (
        DEFAULT_PARTS,
        MAX_PART_SIZE,
        default_part_size,
    )

    # with one fixed size of 50,000 every catalogue below it was one part: `embed --ray`
    # showed 0 until it ended, and a Ctrl-C of the local embed kept nothing
    assert default_part_size(300) == 100  # 3 parts
    assert default_part_size(10_000) == 625  # DEFAULT_PARTS parts
    assert 10_000 / default_part_size(10_000) == DEFAULT_PARTS
    assert default_part_size(10_000_000) == MAX_PART_SIZE
