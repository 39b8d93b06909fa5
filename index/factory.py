"""`--factory auto`: a FAISS index type chosen from the catalogue's size and an optional
memory budget, in the spirit of autofaiss.

The rule (`choose_factory`), for n vectors of dimension d:

1. n < 100,000 and the exact index fits the budget (or there is none): `Flat`, exact
   search; a scan of 100k 512-d vectors is about 50 M multiply-adds, milliseconds per
   query.
2. Otherwise an inverted file with nlist = the power of two nearest 4 sqrt(n) (faiss's
   rule of thumb, 4 to 16 sqrt(n), at the cheap end), capped so that every list gets
   39 training points from the build's training sample (faiss warns below that), and
   so at most 4096 lists:
   - `IVF{nlist},Flat` (full vectors in the lists) when it fits the budget, with
     `IVF{nlist}_HNSW32,Flat` (an HNSW graph over the centroids) from 4096 lists on,
     where assigning every added vector to its list through a flat quantizer becomes
     the slow part of a build;
   - otherwise `IVF{nlist},PQ{m}` (same quantizer): m 8-bit codes per vector, m the
     largest divisor of d (at most d / 2) whose index fits the budget. PQ needs 9,984
     vectors to train its 256 centroids per sub-vector (39 each, as for the lists).
     With a target recall (`build --target-recall R`), `IVF{nlist},SQ8` (one byte per
     dimension) comes first when it fits: its candidates re-scored by the exact
     vectors reach a high recall with a small oversample (docs/benchmarks.md,
     "Compressed codes with re-scoring"); the build then tunes nprobe and oversample
     to R and prints the recall and latency it measured.
3. No candidate fits, or too few vectors for PQ: an error naming the smallest candidate
   and its size.

Sizes (`estimate_bytes`) are those of the serialised FAISS index (within 0.2% for the
factories above), which is what it occupies in memory once loaded, plus, for the
id-mapped layouts (Flat, PQ{m} without IVF), the reverse id map FAISS builds on load
(`memory_bytes`). They do not count the store's item table, which keeps every float32
vector as well (n x 4d bytes plus keys and labels) so that any index type can be
rebuilt from it.

This module imports neither FAISS nor anything heavy: `vitrieval-index build` decides
before it loads a model.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

AUTO = "auto"
FLAT_BELOW = 100_000
"""Catalogues smaller than this are searched exactly (when the budget allows)."""
MAX_TRAINING_VECTORS = 200_000
"""Vectors an IVF or PQ index is trained on at most (a random sample of the catalogue)."""
MIN_POINTS_PER_LIST = 39  # faiss warns when k-means has fewer training points per centroid
HNSW_QUANTIZER_FROM = 4096  # lists from which the coarse quantizer is an HNSW graph
HNSW_M = 32
PQ_CENTROIDS = 256  # 8-bit codes
PQ_MIN_VECTORS = MIN_POINTS_PER_LIST * PQ_CENTROIDS  # fewer: faiss warns, codes are poor
ID_BYTES = 8  # FAISS ids are int64
# FAISS's unordered_map from id to position (IndexIDMap2) costs about this per vector
# in memory (measured: 51 bytes with 1M ids); it is rebuilt on load, not serialised.
REVERSE_MAP_BYTES = 52

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class FactoryError(ValueError):
    """No factory fits, or a budget or size that cannot be used; the message says which."""


@dataclass(frozen=True)
class FactoryChoice:
    """The chosen factory string, its expected size and why it was chosen."""

    factory: str
    n: int
    dim: int
    file_bytes: int
    memory_bytes: int
    reason: str

    def summary(self) -> str:
        """One line: the choice, its expected memory and the reason."""
        return (
            f"factory auto: {self.factory} for {self.n:,} vectors of dimension {self.dim}, "
            f"a FAISS index of about {format_bytes(self.memory_bytes)} in memory ({self.reason})"
        )


def parse_bytes(text: str) -> int:
    """A size such as "4G", "512M", "1.5GiB", "800MB" or "1000000" in bytes.

    Units are binary (K = 1024 bytes, G = 1024**3); "B", "iB" suffixes are optional.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*", text.upper())
    if not match:
        raise FactoryError(f"cannot read {text!r} as a size; write e.g. 4G, 512M or 1000000")
    value = float(match.group(1)) * _UNITS[match.group(2)]
    if value < 1:
        raise FactoryError(f"a memory budget must be at least 1 byte, got {text!r}")
    return int(value)


def format_bytes(size: float) -> str:
    """`size` in bytes as "12.3 MiB" (binary units, three significant digits)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    return f"{size:.3g} {unit}" if size < 1000 else f"{size:.0f} {unit}"


def ivf_lists(n: int) -> int:
    """nlist for n vectors: the power of two nearest 4 sqrt(n), capped so that each list
    gets `MIN_POINTS_PER_LIST` points of the training sample (at least 1 list)."""
    nearest = 2 ** round(math.log2(max(4 * math.sqrt(max(n, 1)), 1)))
    trained_on = min(n, MAX_TRAINING_VECTORS)
    cap = 2 ** int(math.log2(max(trained_on // MIN_POINTS_PER_LIST, 1)))
    return max(1, min(nearest, cap))


def _hnsw_node_bytes() -> float:
    """HNSW graph bytes per node: 2M neighbour slots at level 0, M per level above (a
    node reaches level l with probability M^-l, so 1 / (M - 1) levels above 0 on
    average), int32 each, plus the node's level (int32) and offset (int64)."""
    slots = 2 * HNSW_M + HNSW_M / (HNSW_M - 1)
    return 4 * slots + 4 + 8


def estimate_bytes(factory: str, n: int, dim: int) -> tuple[int, int]:
    """(serialised size, memory once loaded) in bytes of `factory` holding n vectors of
    dimension d, in the store's layout. Knows the factories `choose_factory` picks:
    Flat, IVF{nlist}[_HNSW32],Flat, IVF{nlist}[_HNSW32],SQ8, IVF{nlist},PQ{m} and PQ{m}."""
    match = re.fullmatch(r"(?:IVF(\d+)(_HNSW32)?,)?(Flat|SQ8|PQ(\d+))", factory)
    if not match:
        raise FactoryError(f"no size estimate for factory {factory!r}")
    nlist, hnsw, codes, m = match.groups()
    code_bytes = {"Flat": 4 * dim, "SQ8": dim}.get(codes) or int(m)
    size = n * (code_bytes + ID_BYTES)  # codes and ids, in the lists or in the id map
    if m:
        size += PQ_CENTROIDS * dim * 4  # the PQ codebooks: 256 centroids of d / m floats each
    if codes == "SQ8":
        size += 2 * dim * 4  # each dimension's trained range (min, width)
    if nlist is None:
        return size, size + n * REVERSE_MAP_BYTES
    nlist = int(nlist)
    size += nlist * dim * 4 + nlist * ID_BYTES  # centroids, list sizes
    if hnsw:
        size += round(nlist * _hnsw_node_bytes())
    return size, size


def _pq_m(dim: int) -> list[int]:
    """Sub-quantizer counts for dimension `dim`, largest first: divisors of dim, at most
    dim / 2 (so every sub-vector has 2+ dimensions)."""
    return [m for m in range(dim // 2, 0, -1) if dim % m == 0]


def choose_factory(
    n: int, dim: int, memory_budget: int | None = None, target_recall: float | None = None
) -> FactoryChoice:
    """The factory for n vectors of dimension `dim` under an optional memory budget
    (bytes, for the FAISS index); see the module docstring for the rule. With a
    `target_recall`, 8-bit scalar codes are tried before PQ (re-scored, they reach a
    high recall with few candidates), and the reason says the build tunes to it."""
    if n < 0 or dim < 1:
        raise FactoryError(f"choosing a factory needs n >= 0 and dim >= 1, got n={n}, dim={dim}")
    budget = math.inf if memory_budget is None else memory_budget
    within = "no budget" if memory_budget is None else f"within the {format_bytes(budget)} budget"

    def choice(factory: str, reason: str) -> FactoryChoice:
        file_bytes, memory_bytes = estimate_bytes(factory, n, dim)
        return FactoryChoice(factory, n, dim, file_bytes, memory_bytes, reason)

    flat = choice("Flat", f"exact search below {FLAT_BELOW:,} vectors, {within}")
    if n < FLAT_BELOW and flat.memory_bytes <= budget:
        return flat
    nlist = ivf_lists(n)
    quantizer = f"IVF{nlist}_HNSW{HNSW_M}" if nlist >= HNSW_QUANTIZER_FROM else f"IVF{nlist}"
    why = (
        f"an inverted file from {FLAT_BELOW:,} vectors"
        if n >= FLAT_BELOW
        else f"Flat ({format_bytes(flat.memory_bytes)}) exceeds the budget"
    )
    ivf = choice(f"{quantizer},Flat", f"{why}, {within}")
    if ivf.memory_bytes <= budget:
        return ivf
    full = format_bytes(min(flat.memory_bytes, ivf.memory_bytes))
    if n < PQ_MIN_VECTORS:
        raise FactoryError(
            f"{n:,} vectors of dimension {dim} need about {full} as full vectors, over the "
            f"{format_bytes(budget)} budget, and are too few to train PQ codes "
            f"({PQ_MIN_VECTORS:,} needed): raise --memory-budget"
        )
    smallest = ivf
    over = f"full vectors ({full}) exceed the {format_bytes(budget)} budget"
    tuned = (
        ""
        if target_recall is None
        else f"; re-scored by the exact vectors and tuned to recall@10 {target_recall:g}"
    )
    codes = [(f"{quantizer},SQ8", f"{dim} bytes per vector")] if target_recall else []
    codes += [(f"{quantizer},PQ{m}", f"{m} bytes per vector") for m in _pq_m(dim)]
    for factory, size in codes:
        compressed = choice(factory, f"{over}; {size}{tuned}")
        if compressed.memory_bytes <= budget:
            return compressed
        smallest = compressed
    raise FactoryError(
        f"no index of {n:,} vectors of dimension {dim} fits a memory budget of "
        f"{format_bytes(budget)}: the smallest, {smallest.factory}, needs about "
        f"{format_bytes(smallest.memory_bytes)}"
    )


def training_sample_size(factory: str) -> int:
    """How many vectors to train `factory` on: `MAX_TRAINING_VECTORS`, or more where its
    k-means needs them, `MIN_POINTS_PER_LIST` per centroid (IVF lists, PQ codes of
    2^nbits centroids per sub-vector). A build from an embeddings folder draws a
    sample of this size in one streaming pass."""
    centroids = [int(n) for n in re.findall(r"IVF(\d+)", factory)]
    centroids += [2 ** int(bits or 8) for bits in re.findall(r"PQ\d+(?:x(\d+))?", factory)]
    return max([MAX_TRAINING_VECTORS] + [MIN_POINTS_PER_LIST * k for k in centroids])
