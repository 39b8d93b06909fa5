"""What a Ctrl-C of `vitrieval-index build/embed` keeps, and what it says it kept: a
small catalogue's embed keeps its finished parts, the last progress line and the stop
line give the count that is on disk, and a build stopped twice before its first commit
can be run again. Ctrl-C is raised from the model call, as the signal handler raises it
there (tests/test_index_stopping.py sends a real SIGINT)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from index_cli_helpers import run  # tests/index_cli_helpers.py
from PIL import Image

from vitrieval.index.runtime.embedder import Embedder
from vitrieval.index.store import FolderNotEmptyError, IndexStore


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """400 small noise images: 4 parts of 100 by the default part size."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for i in range(400):
        pixels = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / f"{i:03d}.png", compress_level=0)
    return root


def ctrl_c_at_model_call(monkeypatch, call: int) -> None:
    """The `call`-th model call (from 1) is interrupted by a Ctrl-C."""
    calls = [0]
    model = Embedder._run

    def run_model(self, chunk):
        calls[0] += 1
        if calls[0] == call:
            raise KeyboardInterrupt
        return model(self, chunk)

    monkeypatch.setattr(Embedder, "_run", run_model)


def last_progress(err: str) -> int:
    """The count of the last "embedding: N of T images" line."""
    counts = re.findall(r"^embedding: ([\d,]+) of ", err, re.M)
    assert counts, err
    return int(counts[-1].replace(",", ""))


def test_local_embed_of_a_small_catalogue_keeps_its_finished_parts(
    tmp_path, capsys, monkeypatch, images, tiny_onnx
):
    out = tmp_path / "emb"
    argv = ("embed", "--model", tiny_onnx, "--images", images, "--out", out)
    argv += ("--batch-size", "50", "--device", "cpu")
    ctrl_c_at_model_call(monkeypatch, 5)  # in the third part, two batches of 50 each
    code, _, err = run(capsys, *argv)
    assert code == 130, err
    meta = json.loads((out / "embeddings.json").read_text())
    # a single default part of 50,000 kept nothing here
    assert meta["part_size"] == 100 and len(meta["parts"]) == 2, meta
    stop = err.strip().splitlines()[-1]
    assert "2 of 4 part(s) done and kept" in stop and "(200 embeddings)" in stop, err
    assert last_progress(err) == 200  # not the 250 read when the Ctrl-C came
    monkeypatch.undo()
    code, said, _ = run(capsys, *argv)  # the re-run goes on from the kept parts
    assert code == 0 and "200 in 2 part(s) already done" in said, said
    assert "holds 400 embeddings in 4 part(s)" in said


def test_build_stop_line_and_last_progress_line_say_what_the_index_holds(
    tmp_path, capsys, monkeypatch, images, tiny_onnx
):
    out = tmp_path / "index"
    argv = ("build", "--model", tiny_onnx, "--images", images, "--out", out)
    argv += ("--batch-size", "32", "--device", "cpu")
    ctrl_c_at_model_call(monkeypatch, 4)  # three batches embedded, the fourth read
    code, _, err = run(capsys, *argv)
    assert code == 130, err
    stop = err.strip().splitlines()[-1]
    assert "96 new image(s) saved" in stop and f"{out} holds 96 items" in stop, err
    assert last_progress(err) == 96  # the line before said 128: the batch read, not kept
    assert len(IndexStore.open(out)) == 96


def test_build_stopped_twice_before_its_first_commit_runs_again(
    tmp_path, capsys, monkeypatch, images, tiny_onnx
):
    from vitrieval.index.store import _persist as persist

    out = tmp_path / "index"
    argv = ("build", "--model", tiny_onnx, "--images", images, "--out", out, "--device", "cpu")
    ctrl_c_at_model_call(monkeypatch, 2)

    def second_ctrl_c(*args, **kwargs):  # in the save the first Ctrl-C started
        raise KeyboardInterrupt

    monkeypatch.setattr(persist, "_write_model", second_ctrl_c)
    code, _, err = run(capsys, *argv)
    assert code == 130 and "run the same command again" in err, err
    assert [path.name for path in out.iterdir()] == [".lock"]
    monkeypatch.undo()
    code, said, err = run(capsys, *argv)  # what the stop line says to do
    assert code == 0 and f"{out} holds 400 items" in said, err
    assert sorted(path.name for path in out.iterdir() if path.name.startswith(".")) == [
        ".lock",
        ".readers",
    ]


def test_only_a_first_saves_leftovers_count_as_empty(tmp_path, capsys, tiny_onnx, images):
    leftovers = tmp_path / "leftovers"
    leftovers.mkdir()
    for name in (".lock", ".journal.lock", "seg.1.faiss", ".seg.1.items.sqlite.0a1b2c.tmp"):
        (leftovers / name).write_bytes(b"" if name.endswith("lock") else b"half written")
    shutil.copyfile(tiny_onnx, leftovers / "model.onnx")  # the copy a save makes first
    store = IndexStore.create(leftovers, dim=Embedder(tiny_onnx).dim, model_path=tiny_onnx)
    store.save()
    assert not (leftovers / ".seg.1.items.sqlite.0a1b2c.tmp").exists()
    assert len(IndexStore.open(leftovers)) == 0

    # anything the store does not make before its first commit is the user's
    for case, name, data in (
        ("notes", "notes.txt", b"mine"),
        ("model", "model.onnx", b"another model"),
        ("lock", ".lock", b"not empty: not the store's"),
    ):
        folder = tmp_path / case
        folder.mkdir()
        (folder / ".lock").touch()
        (folder / name).write_bytes(data)
        with pytest.raises(FolderNotEmptyError, match=re.escape(name)):
            IndexStore.create(folder, dim=8, model_path=tiny_onnx)
    code, _, err = run(capsys, "build", "--model", tiny_onnx, "--images", images, "--out", folder)
    assert code == 2 and "is not empty and holds no index" in err, err
    assert "build into a new or empty folder" in err and "overwrite=True" not in err


def test_build_from_embeddings_stopped_keeps_and_says_what_it_added(
    tmp_path, capsys, monkeypatch, images, tiny_onnx
):
    from vitrieval.index.pipeline.build_index import build_from_embeddings
    from vitrieval.index.pipeline.embeddings_folder import EmbeddingsFolder
    from vitrieval.index.stopping import Stopped

    folder = tmp_path / "emb"
    code, _, err = run(capsys, "embed", "--model", tiny_onnx, "--images", images, "--out", folder)
    assert code == 0, err
    out = tmp_path / "index"
    store = IndexStore.create(out, dim=Embedder(tiny_onnx).dim, model_path=tiny_onnx)
    calls = [0]
    add = IndexStore.add

    def add_then_ctrl_c(self, *args, **kwargs):  # the third batch of 100 meets a Ctrl-C
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt
        return add(self, *args, **kwargs)

    monkeypatch.setattr(IndexStore, "add", add_then_ctrl_c)
    with pytest.raises(Stopped, match=f"200 new vector\\(s\\) saved, {re.escape(str(out))} holds"):
        build_from_embeddings(EmbeddingsFolder.open(folder), out, store, batch_size=100)
    store.close()
    monkeypatch.undo()
    assert len(IndexStore.open(out)) == 200  # saved: the re-run skips them
    code, said, err = run(capsys, "build", "--embeddings", folder, "--out", out)
    assert code == 0, err
    assert "indexed 200 of 400 embeddings from" in said and "200 already present" in said
    assert f"{out} holds 400 items" in said
