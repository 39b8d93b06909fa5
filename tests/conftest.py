"""Shared fixtures: small exported models made once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest
from ray_cluster import ray_address  # noqa: F401  (the session's Ray cluster, a fixture)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--filter-cases",
        type=int,
        default=None,
        help="random filters per plan in tests/test_filter_differential.py (default 2000)",
    )
    parser.addoption(
        "--many-processes-s",
        type=float,
        default=None,
        help="seconds tests/test_many_processes.py runs its writer and readers (default 12)",
    )


def export_tiny(seed: int, path: Path, dim: int | None = None) -> Path:
    """Export an untrained `tiny` ViT + GGeM (32 px input, 128-d output, or `dim`) built
    from `seed`."""
    import torch

    from vitrieval.training.config import FitConfig
    from vitrieval.training.export import export_model, model_metadata
    from vitrieval.training.model import build_model

    torch.manual_seed(seed)
    model = build_model("tiny", "ggem", dim)
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
def tiny_onnx_64(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another model of another embedding size: 64-d."""
    return export_tiny(2, tmp_path_factory.mktemp("models") / "tiny_64.onnx", dim=64)


@pytest.fixture(scope="session")
def digits_gallery(tmp_path_factory: pytest.TempPathFactory, tiny_onnx: Path) -> dict[str, Path]:
    """120 held-out digits as PNG files (a folder per class, list.csv) and a Flat index of
    them built with `tiny_onnx`: what the service tests serve. Treat as read-only; use
    `served_index` for a copy a test may change."""
    from vitrieval.index.evaluation.datasets import csv_list, load_dataset
    from vitrieval.index.pipeline.build_index import build_index
    from vitrieval.index.pipeline.sources import write_image_folder
    from vitrieval.index.runtime.embedder import Embedder

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


@pytest.fixture
def client(digits_gallery: dict[str, Path], served_index: Path):
    """The service in-process over a private copy of the digits gallery's index."""
    from app_client import make_client

    with make_client(digits_gallery["model"], served_index) as c:
        yield c


@pytest.fixture(scope="module")
def gallery(digits_gallery: dict[str, Path]) -> list:
    """The digits gallery's items (key, path, label), in list order."""
    from vitrieval.index.evaluation.datasets import csv_list

    return csv_list(digits_gallery["list"])


@pytest.fixture(scope="module")
def reference(digits_gallery: dict[str, Path]):
    """The gallery's index opened read-only: what the service must answer."""
    from vitrieval.index.store import IndexStore

    with IndexStore.open(digits_gallery["index"]) as store:
        yield store


# -- GPU tests -----------------------------------------------------------------------
# `@pytest.mark.gpu("torch")`, `("onnxruntime")` or `("faiss")` names what a test runs
# on the GPU; without a usable GPU build of that library it is skipped with the reason.


def _gpu_missing(need: str) -> str | None:
    """Why a test that needs the GPU through `need` cannot run here (None: it can).
    The library's own GPU support is checked first: it is the more precise reason."""
    import torch

    if need == "onnxruntime":
        import onnxruntime as ort

        providers = ort.get_available_providers()
        if "CUDAExecutionProvider" not in providers:
            return (
                f"onnxruntime {ort.__version__} has no CUDAExecutionProvider "
                f"({', '.join(providers)}): install onnxruntime-gpu in place of onnxruntime"
            )
    elif need == "faiss":
        import faiss

        if not hasattr(faiss, "StandardGpuResources"):
            return f"faiss {faiss.__version__} is a CPU build: install faiss-gpu for faiss-cpu"
        if faiss.get_num_gpus() == 0:
            return f"faiss {faiss.__version__} (GPU build) sees no GPU"
        return None
    elif need != "torch":
        raise ValueError(f"unknown gpu marker argument {need!r}: torch, onnxruntime or faiss")
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return f"no CUDA device: torch {torch.__version__} ({build}) sees none"
    return None


def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker("gpu")
    if marker is None:
        return
    for need in marker.args or ("torch",):
        reason = _gpu_missing(need)
        if reason:
            pytest.skip(reason)
