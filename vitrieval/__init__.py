"""vitrieval: train ViT image-embedding models, index catalogues with FAISS, serve search.

One import package. The subpackages are `vitrieval.index` (the retrieval library: the
embedder, the index store, metrics; no torch), `vitrieval.training` (torch, the `train`
extra), `vitrieval.service` (the HTTP service, the `serve` extra), `vitrieval.distributed`
(Ray, the `distributed` extra) and `vitrieval.client` (the HTTP client).

Nothing heavy is imported here: `import vitrieval.client` loads neither FAISS, ONNX
Runtime nor torch. The names of the Python API (docs/python.md) are loaded on first use.
"""

from __future__ import annotations

import importlib
import os

from ._folders import SUBPACKAGE_FOLDERS
from ._version import __version__

# This module runs before any console script can guard against an early Ctrl-C
# (index/cli/launch.py), so it imports as little as it can: no typing, no pathlib.
TYPE_CHECKING = False

# In a source checkout the subpackages are the checkout's top-level folders: an install
# maps them into this package (setup.py), and a checkout run with PYTHONPATH=checkout,
# or installed editable, finds them through the folder above the package. The folder is
# added only when it is a checkout of this project, never for an installed wheel.
_checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isfile(os.path.join(_checkout, "setup.py")) and all(
    os.path.isfile(os.path.join(_checkout, folder, "__init__.py")) for folder in SUBPACKAGE_FOLDERS
):
    __path__.append(_checkout)

# The Python API (docs/python.md): name -> "module:attribute" that defines it, imported
# when the name is first used.
_API: dict[str, str] = {
    # embedding with an exported model, the index, search and evaluation (base install)
    "Embedder": "vitrieval.index.runtime.embedder:Embedder",
    "open_index": "vitrieval.index.shards.store:open_index",
    "IndexStore": "vitrieval.index.store:IndexStore",
    "Hit": "vitrieval.index.store:Hit",
    "StoreError": "vitrieval.index.store:StoreError",
    "Item": "vitrieval.index.evaluation.datasets:Item",
    "image_folder": "vitrieval.index.evaluation.datasets:image_folder",
    "csv_list": "vitrieval.index.evaluation.datasets:csv_list",
    "build_index": "vitrieval.index.pipeline.build_index:build_index",
    "search": "vitrieval.index.query:search_index",
    "AQE": "vitrieval.index.query:AQE",
    "retrieval_metrics": "vitrieval.index.evaluation.metrics:retrieval_metrics",
    # training and export (the `train` extra: torch)
    "FitConfig": "vitrieval.training.config:FitConfig",
    "fit": "vitrieval.training.trainer:fit",
    "export_run": "vitrieval.training.export:export_run",
}
# the train extra's import names (pyproject.toml), for the message when one is missing
_NEEDS_TRAIN = {
    *("torch", "torchvision", "timm", "safetensors", "onnx", "onnxscript", "matplotlib", "skimage")
}

if TYPE_CHECKING:  # what a type checker and an IDE see for the lazily loaded names
    from vitrieval.index.evaluation.datasets import Item as Item
    from vitrieval.index.evaluation.datasets import csv_list as csv_list
    from vitrieval.index.evaluation.datasets import image_folder as image_folder
    from vitrieval.index.evaluation.metrics import retrieval_metrics as retrieval_metrics
    from vitrieval.index.pipeline.build_index import build_index as build_index
    from vitrieval.index.query import AQE as AQE
    from vitrieval.index.query import search_index as search  # noqa: F401
    from vitrieval.index.runtime.embedder import Embedder as Embedder
    from vitrieval.index.shards.store import open_index as open_index
    from vitrieval.index.store import Hit as Hit
    from vitrieval.index.store import IndexStore as IndexStore
    from vitrieval.index.store import StoreError as StoreError
    from vitrieval.training.config import FitConfig as FitConfig
    from vitrieval.training.export import export_run as export_run
    from vitrieval.training.trainer import fit as fit

__all__ = ["__version__", *_API]


def __getattr__(name: str) -> object:
    target = _API.get(name)
    if target is None:
        raise AttributeError(f"module 'vitrieval' has no attribute {name!r}")
    module_name, attribute = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in _NEEDS_TRAIN:
            raise
        raise ImportError(
            f"vitrieval.{name} needs the train extra ({exc.name} is not installed): "
            "pip install 'vitrieval[train]'"
        ) from exc
    value = getattr(module, attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_API})
