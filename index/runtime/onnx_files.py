"""Writing ONNX model files: the weights inside the file, or in one external data file
beside it (a single protobuf cannot pass 2 GB). `vitrieval.index.runtime.optimize` and
`vitrieval.training.export`
write their models with these."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..atomic import fsync_dir


def save_onnx(proto: Any, path: Path, data_name: str | None) -> None:
    """Save the onnx.ModelProto `proto` to `path`; with `data_name`, its weights go to
    that one file beside it, where ONNX Runtime finds them."""
    import onnx  # not needed to serve an index: imported by the commands that write models

    if data_name is None:
        onnx.save(proto, str(path))
        return
    onnx.save(
        proto,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=data_name,
        size_threshold=1024,
    )


def publish(staged: Path, target: Path, mode: int) -> None:
    """Move a finished file into place durably (fsync, rename, fsync of the folder),
    with the permission bits `mode`."""
    with open(staged, "rb+") as fh:
        os.fchmod(fh.fileno(), mode)
        os.fsync(fh.fileno())
    os.replace(staged, target)
    fsync_dir(target.parent)
