"""A segment's exact vectors file (seg.<n>.vectors.npy), memory-mapped for random reads.

A search re-scores a few dozen candidates per query (_rescore.py), scattered over the
file. Through a plain mapping each of those reads faults in the kernel's readahead
window around it (128 kB and more), so a few thousand cold queries read nearly the
whole file into the page cache: 438 MB for 2,000 random rows of a 460 MB file, against
11 MB with the mapping advised random (MADV_RANDOM; measured on Linux 6.18). Reads
that do want the neighbourhood (a merge or a rebuild copying every row in order)
ask for it first (`prefetch`).
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np

PAGE = mmap.PAGESIZE


class MappedVectors:
    """float32 (rows, dim) vectors of a .npy file, mapped read-only, advised random."""

    def __init__(self, path: Path) -> None:
        with path.open("rb") as fh:
            version = np.lib.format.read_magic(fh)
            read_header = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, fortran, dtype = read_header(fh)
            self._offset = fh.tell()
            self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        if fortran or len(shape) != 2:
            raise ValueError(f"holds a {'Fortran-ordered ' if fortran else ''}{shape} array")
        if hasattr(mmap, "MADV_RANDOM"):  # Linux and macOS; elsewhere the kernel's default
            self._map.madvise(mmap.MADV_RANDOM)
        self._row_bytes = int(shape[1]) * np.dtype(dtype).itemsize
        self.array = np.ndarray(shape, dtype=dtype, buffer=self._map, offset=self._offset)

    def prefetch(self, first_row: int, stop_row: int) -> None:
        """Ask the kernel to read rows [first_row, stop_row) ahead, for an in-order pass."""
        if not hasattr(mmap, "MADV_WILLNEED") or stop_row <= first_row:
            return
        start = self._offset + first_row * self._row_bytes
        end = min(self._offset + stop_row * self._row_bytes, len(self._map))
        aligned = start - start % PAGE
        self._map.madvise(mmap.MADV_WILLNEED, aligned, end - aligned)
