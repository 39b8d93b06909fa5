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
