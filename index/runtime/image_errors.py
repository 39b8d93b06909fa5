"""What every image decoder shares: the error it raises and the EXIF tag it reads.

Apart from index/runtime/images.py so that the decoders it dispatches to
(index/runtime/vips_decode.py) need not import it back.
"""

from __future__ import annotations

EXIF_ORIENTATION = 0x0112
"""The EXIF tag holding a photo's orientation (1-8)."""


class ImageDecodeError(ValueError):
    """An image could not be decoded safely; `str(error)` says why."""
