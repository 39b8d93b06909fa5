"""Shared fixtures: small exported models made once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest


def export_tiny(seed: int, path: Path) -> Path:
    """Export an untrained `tiny` ViT + GGeM (32 px input, 128-d output) built from `seed`."""
    import torch

    from training.config import FitConfig
    from training.export import export_model, model_metadata
    from training.model import build_model

    torch.manual_seed(seed)
    model = build_model("tiny", "ggem")
    export_model(model, model_metadata(model, FitConfig(out="unused")), path)
    return path


@pytest.fixture(scope="session")
def tiny_onnx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An untrained but deterministic exported model: embeddings are a fixed function of
    the image, which is all indexing, search round-trips and parity tests need."""
    return export_tiny(0, tmp_path_factory.mktemp("models") / "tiny.onnx")


@pytest.fixture(scope="session")
def tiny_onnx_other(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture as `tiny_onnx`, other weights: another fingerprint."""
    return export_tiny(1, tmp_path_factory.mktemp("models") / "tiny_other.onnx")


@pytest.fixture(scope="session")
def digits_gallery(tmp_path_factory: pytest.TempPathFactory, tiny_onnx: Path) -> dict[str, Path]:
    """120 held-out digits as PNG files (a folder per class, list.csv) and a Flat index of
    them built with `tiny_onnx`: what the service tests serve. Treat as read-only; use
    `served_index` for a copy a test may change."""
    from index.build import build_index
    from index.datasets import csv_list, load_dataset
    from index.embedder import Embedder
    from index.sources import write_image_folder

    root = tmp_path_factory.mktemp("digits_gallery")
    split = load_dataset("digits", image_size=32)
    listing = write_image_folder(split.test[:120], root / "images")
    build_index(csv_list(listing), root / "index", Embedder(tiny_onnx), progress=False)
    return {"model": tiny_onnx, "images": root / "images", "list": listing, "index": root / "index"}


@pytest.fixture
def served_index(digits_gallery: dict[str, Path], tmp_path: Path) -> Path:
    """A private copy of the digits gallery's index."""
    import shutil

    return Path(shutil.copytree(digits_gallery["index"], tmp_path / "index"))
