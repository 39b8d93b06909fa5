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
from pathlib import Path
from typing import Any

from ._folders import SUBPACKAGE_FOLDERS
from ._version import __version__

# Run from a source checkout that was never installed (PYTHONPATH=checkout), the
# subpackages are the checkout's top-level folders: an install maps them into this
# package (setup.py), a bare checkout needs the folder above on the package's path.
_checkout = Path(__file__).resolve().parent.parent
if (_checkout / "setup.py").is_file() and all(
    (_checkout / folder / "__init__.py").is_file() for folder in SUBPACKAGE_FOLDERS
):
    __path__.append(str(_checkout))

# name -> the module that defines it, imported when the name is first used
_API: dict[str, str] = {}

__all__ = ["__version__", *_API]


def __getattr__(name: str) -> Any:
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'vitrieval' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_API})
