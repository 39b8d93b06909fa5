"""Files vitrieval writes get the normal mode under the umask (0644 under 022), not 0600:
an index, a model or a run folder can be shared with other users and read by the serving
container's non-root user."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import pytest

from vitrieval.index.atomic import atomic_path, atomic_write_text


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def modes(folder: Path) -> dict[str, int]:
    """Permission bits of every file and folder under `folder` (itself included)."""
    found = {".": stat.S_IMODE(folder.stat().st_mode)}
    for path in sorted(folder.rglob("*")):
        found[str(path.relative_to(folder))] = stat.S_IMODE(path.stat().st_mode)
    return found


def assert_shared(folder: Path) -> None:
    """Files 0644, folders 0755: what `open()` and `mkdir()` give under umask 022."""
    found = modes(folder)
    wrong = {
        name: oct(mode)
        for name, mode in found.items()
        if mode != (0o755 if (folder / name).is_dir() else 0o644)
    }
    assert not wrong, wrong
    assert len(found) > 1


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077, 0o002])
def test_atomic_writes_take_the_mode_of_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        atomic_write_text(tmp_path / "a.txt", "a")
        atomic_write_text(tmp_path / "a.txt", "again")  # replacing: same rule
        with atomic_path(tmp_path / "b.bin") as tmp:
            # a writer that swaps in a file of its own, owner-only
            fd = os.open(tmp.with_suffix(".own"), os.O_WRONLY | os.O_CREAT, 0o600)
            os.write(fd, b"b")
            os.close(fd)
            os.replace(tmp.with_suffix(".own"), tmp)
        # and the process umask is left as it was
        assert os.umask(umask) == umask
    finally:
        os.umask(old)
    expected = oct(0o666 & ~umask)
    assert {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in tmp_path.iterdir()} == {
        "a.txt": expected,
        "b.bin": expected,
    }
    assert (tmp_path / "a.txt").read_text() == "again"


def test_index_directory_is_readable_by_others(tmp_path, tiny_onnx, umask_022):
    from vitrieval.index.evaluation.datasets import csv_list, load_dataset
    from vitrieval.index.pipeline.build_index import build_index
    from vitrieval.index.pipeline.sources import write_image_folder
    from vitrieval.index.runtime.embedder import Embedder
    from vitrieval.index.store import IndexStore

    split = load_dataset("digits", image_size=32)
    listing = write_image_folder(split.test[:20], tmp_path / "images")
    build_index(csv_list(listing), tmp_path / "index", Embedder(tiny_onnx), progress=False)
    with IndexStore.open(tmp_path / "index") as store:  # a second save: new generation
        store.add(["extra"], np.eye(1, store.dim, dtype=np.float32))
        store.save()
    assert_shared(tmp_path / "index")
    assert_shared(tmp_path / "images")
    assert "manifest.json" in modes(tmp_path / "index")


def test_run_folder_and_exported_model_are_readable_by_others(tmp_path, umask_022):
    from vitrieval.training.config import FitConfig
    from vitrieval.training.export import export_run
    from vitrieval.training.trainer import fit

    run = tmp_path / "run"
    fit(FitConfig(out=str(run), dataset="digits", epochs=1, batch_size=256, workers=0))
    export_run(run, run / "model.onnx")
    found = modes(run)
    assert {"config.yaml", "metrics.jsonl", "curves.png", "model.safetensors"} <= set(found)
    assert {"model.onnx", "model.export.json", "checkpoint/state.json"} <= set(found)
    assert_shared(run)
