"""`vitrieval-index` errors and summaries that say what to do next: an index of another
dimension, a training checkpoint or a folder as --model, files a folder walk skips."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from index_cli_helpers import run  # tests/index_cli_helpers.py

from vitrieval.index.evaluation.datasets import load_dataset


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    """4 digit images and 2 SVG drawings (no image suffix a build reads)."""
    root = tmp_path_factory.mktemp("photos")
    for item in load_dataset("digits").train[:4]:
        item.open().save(root / f"{item.key.replace('/', '_')}.png")
    for name in ("logo.svg", "icon.SVG"):
        (root / name).write_text("<svg xmlns='http://www.w3.org/2000/svg'/>")
    (root / ".DS_Store").write_bytes(b"\0")  # hidden: an OS dropping, not counted
    return root


def test_an_index_of_another_dimension_says_what_to_do(tmp_path, capsys, photos, tiny_onnx):
    from vitrieval.index.store import IndexStore

    index = tmp_path / "idx"
    IndexStore.create(index, dim=384, fingerprint="f" * 64).save()
    code, _, err = run(capsys, "build", "--model", tiny_onnx, "--images", photos, "--out", index)
    assert code == 2 and err.count("\n") == 1
    assert "holds 384-d vectors, but 128-d were expected: rebuild the index with this model" in err
    assert "or use the model it was built with" in err


def test_checkpoints_and_folders_as_model(tmp_path, capsys, photos, tiny_onnx):
    run_folder = tmp_path / "run"
    run_folder.mkdir()
    (run_folder / "model.safetensors").write_bytes(b"not an onnx file")
    (run_folder / "config.yaml").write_text("epochs: 1\n")
    out = tmp_path / "index"
    build = ("build", "--images", photos, "--out", out, "--model")

    code, _, err = run(capsys, *build, run_folder / "model.safetensors")
    assert code == 2 and err.count("\n") == 1
    assert "is a training checkpoint, not an exported model" in err
    assert f"vitrieval-train export --run {run_folder} --out MODEL.onnx" in err
    code, _, err = run(capsys, *build, run_folder)
    assert code == 2 and "is a training run folder, not an exported model" in err
    assert f"vitrieval-train export --run {run_folder} --out MODEL.onnx" in err
    code, _, err = run(capsys, *build, tmp_path)
    assert code == 2 and f"{tmp_path} is a folder, not a model file" in err
    assert not out.exists()
    # a run folder after `export` (the demo's runs/demo): the file to pass is named
    (run_folder / "model.onnx").write_bytes(b"exported")
    code, _, err = run(capsys, *build, run_folder)
    assert code == 2 and err.count("\n") == 1
    assert f"holds the exported model {run_folder / 'model.onnx'}: pass that file" in err
    assert "export it first" not in err
    (run_folder / "model.onnx").unlink()

    # an index folder stands for the model it keeps
    assert run(capsys, *build, tiny_onnx)[0] == 0
    other = tmp_path / "other"
    code, out_text, err = run(capsys, "build", "--images", photos, "--out", other, "--model", out)
    assert code == 0, err
    assert "indexed 4 of 4 images" in out_text


def test_files_without_an_image_suffix_are_counted(tmp_path, capsys, caplog, photos, tiny_onnx):
    caplog.set_level(logging.INFO, logger="vitrieval.index.pipeline.sources")
    out = tmp_path / "index"
    code, text, err = run(
        capsys, "build", "--model", tiny_onnx, "--images", photos, "--out", out, "-v"
    )
    assert code == 0, err
    assert "indexed 4 of 4 images" in text
    assert "2 file(s) without an image suffix skipped (2 .svg; -v names them)" in text
    named = sorted(Path(r.args[0]).name for r in caplog.records if "not an image" in r.message)
    assert named == ["icon.SVG", "logo.svg"]
    code, text, _ = run(
        capsys, "embed", "--model", tiny_onnx, "--images", photos, "--out", tmp_path / "emb"
    )
    assert code == 0 and "2 file(s) without an image suffix skipped" in text
