"""Images and vectors as the JSON body carries them, without importing numpy or PIL.

An image is a path (str or os.PathLike), bytes, a binary file object, or a PIL image
(saved as PNG); its bytes travel base64-encoded. A vector is a sequence of numbers
or anything with `.tolist()` (a numpy array). Duck typing keeps numpy and PIL out of
`import vitrieval.client`: they are only ever touched when the caller passes one of
their objects, which they have already imported.
"""

from __future__ import annotations

import base64
import io
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, Protocol, TypeAlias, runtime_checkable


@runtime_checkable
class _SavesImages(Protocol):
    """What a PIL image offers (PIL.Image.Image), checked without importing PIL."""

    def save(self, fp: Any, format: str | None = None) -> None: ...

    def getbands(self) -> tuple[str, ...]: ...

    def convert(self, mode: str) -> Any: ...


PNG_MODES = frozenset({"1", "L", "LA", "I", "I;16", "P", "RGB", "RGBA"})
"""The PIL modes a PNG holds as they are; other images are converted to RGB(A)."""

ImageInput: TypeAlias = str | os.PathLike[str] | bytes | bytearray | memoryview | IO[bytes] | Any
"""A path, bytes, a binary file object or a PIL image."""
VectorInput: TypeAlias = Sequence[float] | Any
"""A sequence of numbers or a numpy array (anything with `.tolist()`)."""


def image_bytes(image: ImageInput) -> bytes:
    """The bytes of an image input (a PIL image saved as PNG, losslessly)."""
    if isinstance(image, str | os.PathLike):
        return Path(image).read_bytes()
    if isinstance(image, bytes | bytearray | memoryview):
        return bytes(image)
    if isinstance(image, _SavesImages):
        if getattr(image, "mode", "RGB") not in PNG_MODES:  # CMYK, YCbCr, LAB, HSV, F
            image = image.convert("RGBA" if "A" in image.getbands() else "RGB")
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return buffer.getvalue()
    read = getattr(image, "read", None)
    if callable(read):
        data = read()
        if isinstance(data, bytes):
            return data
        raise TypeError("an image file object must be opened in binary mode ('rb')")
    raise TypeError(
        f"an image is a path, bytes, a binary file object or a PIL image, "
        f"not {type(image).__name__}"
    )


def image_base64(image: ImageInput) -> str:
    """An image input as the base64 text of `image_base64`."""
    return base64.b64encode(image_bytes(image)).decode("ascii")


def vector_list(vector: VectorInput) -> list[float]:
    """A vector input as a list of floats (`.tolist()` of a numpy array: one row)."""
    values = vector.tolist() if hasattr(vector, "tolist") else vector
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise TypeError(f"a vector is a sequence of numbers, not {type(vector).__name__}")
    if values and isinstance(values[0], list):
        if len(values) != 1:
            raise ValueError(f"a vector is one row, not an array of {len(values)} rows")
        values = values[0]
    floats = [float(value) for value in values]
    if not all(math.isfinite(value) for value in floats):
        raise ValueError("a vector's values must be finite numbers (no NaN or infinity)")
    return floats
