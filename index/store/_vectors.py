"""The FAISS side of the store: one CPU index whose FAISS ids are the item ids.

Layouts (decided once from the factory string, and again from a loaded file):

- IVF indexes ("IVF256,Flat", "IVF256,PQ16") carry the item ids themselves. They are
  *not* wrapped in IndexIDMap2: IDMap2.remove_ids over an IVF renumbers its id map
  while the inverted lists keep the old internal ids, so later searches return the
  wrong items (checked with faiss 1.15).
- Everything else is wrapped in IndexIDMap2 (ids = item ids).
- Removal: native IVF and IDMap2 over a flat-codes index (Flat, SQ8, PQm) remove
  directly; the rest (HNSW, IVF behind a transform, ...) cannot, and the store keeps
  tombstones instead.

Search is exact about ties and filters whatever the index supports: results are
post-filtered (allowed / blocked ids) and ordered by (descending score, ascending
id); the search is repeated with a doubled candidate count for the queries where a
filter or a tie at the k-th place could hide a better item.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import faiss
import numpy as np

from ..gpu_notice import say_cpu_only
from ._filter_plans import contains, difference
from .errors import StoreError, faiss_reason

logger = logging.getLogger(__name__)

GPU_MODES = ("auto", "cpu", "cuda")
FACTORY_EXAMPLES = '"Flat", "IVF256,Flat", "IVF256,PQ16", "HNSW32"'
GPU_MAX_K = 2048  # FAISS GPU indexes reject larger k; such searches run on the CPU copy
DEFAULT_EF_SEARCH = 64  # faiss's default 16 gives poor recall@10; 64 costs ~4x a probe of 16
MAX_FILTERED_EF_SEARCH = 4096  # the widest a filtered HNSW search explores
Selector = faiss.IDSelector
FAISS_PARAMS = ("nprobe", "efSearch")  # the search settings FAISS itself keeps
OVERSAMPLE = "oversample"  # the store's own search setting (re-scoring, _rescore.py)
NO_IDS = np.empty(0, dtype=np.int64)
NO_IDS.flags.writeable = False  # shared ("no ids blocked", "no hits"): never written
_NO_SCORES = np.empty(0, dtype=np.float32)
_NO_SCORES.flags.writeable = False
NO_HITS = (NO_IDS, _NO_SCORES)
"""A query's TopK row when nothing was found."""

TopK = list[tuple[np.ndarray, np.ndarray]]
"""Per query, its hits best first (descending score, ties by ascending id) as int64
(m,) ids and float32 (m,) scores: arrays, so that merging and re-scoring create no
Python object per candidate."""


def suggest_factory(n: int, dim: int) -> str:
    """A FAISS factory string for about `n` vectors of dimension `dim`.

    Below 50,000 vectors exact search ("Flat") is fast enough (a few ms per query on
    CPU) and needs no training. Above, an inverted file "IVF{nlist},Flat" with nlist
    the power of two nearest to 4 * sqrt(n) (faiss's rule of thumb 4-16 * sqrt(n),
    at the cheap end), capped so that every list gets >= 39 training points (faiss
    warns below that). `dim` does not change the choice; it is validated only.
    """
    if n < 0 or dim < 1:
        raise StoreError(f"suggest_factory needs n >= 0 and dim >= 1, got n={n}, dim={dim}")
    if n < 50_000:
        return "Flat"
    nlist = 2 ** round(math.log2(4 * math.sqrt(n)))
    cap = 2 ** int(math.log2(n // 39))
    return f"IVF{min(nlist, cap)},Flat"


def default_nprobe(nlist: int) -> int:
    """Inverted lists probed per query: nlist / 16, at least 8 (never more than nlist).

    faiss's default of 1 probe loses much recall; 1/16 of the lists keeps recall@10
    high on embedding data while searching ~6% of the vectors.
    """
    return min(nlist, max(8, nlist // 16))


def core_index(index: faiss.Index) -> faiss.Index:
    """The index that does the work: the one inside an IndexIDMap2, else `index` itself."""
    if isinstance(index, faiss.IndexIDMap):
        return faiss.downcast_index(index.index)
    return index


def _wrap(inner: faiss.Index) -> faiss.Index:
    """IndexIDMap2 around `inner`, owning it (so the C++ object outlives the Python proxy)."""
    wrapped = faiss.IndexIDMap2(inner)
    wrapped.own_fields = True
    inner.this.disown()
    return wrapped


def new_faiss_index(dim: int, factory: str) -> faiss.Index:
    """A new, empty CPU index for `factory` with inner-product metric, in its store layout."""
    try:
        index = faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as exc:
        raise StoreError(
            f"invalid FAISS factory {factory!r} for dimension {dim}: {faiss_reason(exc)}; "
            f"examples: {FACTORY_EXAMPLES}"
        ) from None
    if isinstance(index, faiss.IndexIDMap):
        raise StoreError(
            f"invalid FAISS factory {factory!r}: the store adds the id map itself; drop the "
            f"IDMap prefix (examples: {FACTORY_EXAMPLES})"
        )
    if index.metric_type != faiss.METRIC_INNER_PRODUCT:
        # FAISS builds some indexes (HNSW over PQ codes) with L2 whatever it is asked
        # for: their scores are distances, best lowest, and would rank backwards here
        raise StoreError(
            f"invalid FAISS factory {factory!r}: FAISS builds it for L2 distance only, and "
            "the store ranks by inner product; for a graph over compressed codes use SQ "
            f'("HNSW32,SQ8"), or PQ codes under IVF ("IVF4096,PQ48")'
        )
    if isinstance(index, faiss.IndexPQ | faiss.IndexIVFPQ):
        # The factory turns on polysemous training: a code permutation (seconds of
        # annealing, whatever n) that only polysemous Hamming search uses; this store's
        # searches use PQ distances, which it does not change.
        index.do_polysemous_training = False
    if isinstance(index, faiss.IndexIVF):
        index.nprobe = default_nprobe(index.nlist)
        return index
    if isinstance(index, faiss.IndexHNSW):
        index.hnsw.efSearch = DEFAULT_EF_SEARCH
    return _wrap(index)


def start_template(dim: int, factory: str, data: bytes | None = None) -> faiss.Index:
    """The empty index a new store's segments start from: a fresh one, or the trained
    one serialised in `data` (faiss.serialize_index bytes), checked to be `factory`'s."""
    if data is None:
        return new_faiss_index(dim, factory)
    index = VectorIndex.from_bytes(data, Path(f"the {factory} quantizer"), dim, "cpu").cpu
    expected = new_faiss_index(dim, factory)
    if type(index) is not type(expected) or not index.is_trained or index.ntotal:
        raise StoreError(f"the quantizer given is not a trained, empty {factory!r} index")
    return index


def _gpu_count() -> int:
    getter = getattr(faiss, "get_num_gpus", None)
    return int(getter()) if getter else 0


def faiss_cpu_reason() -> str:
    """Why gpu="auto" builds and searches on the CPU (`vitrieval.index.gpu_notice`)."""
    if hasattr(faiss, "StandardGpuResources"):
        return "a GPU build, but no CUDA device"
    return "a CPU-only build (faiss-gpu in place of faiss-cpu enables the GPU)"


def check_gpu_mode(gpu: str) -> bool:
    """Whether to use GPUs: "auto" if any, "cpu" never, "cuda" always (error without one)."""
    if gpu not in GPU_MODES:
        raise StoreError(f"gpu must be one of {', '.join(GPU_MODES)}, not {gpu!r}")
    if gpu == "cuda" and _gpu_count() == 0:
        raise StoreError('gpu="cuda" was requested but FAISS sees no GPU (is faiss-gpu installed?)')
    return gpu != "cpu" and _gpu_count() > 0


class VectorIndex:
    """A FAISS index in the store's layout, with an optional GPU copy for search.

    The CPU index is authoritative and is what gets saved; the GPU copy (when GPUs are
    in use) follows adds, and is dropped and re-copied lazily after anything else.
    """

    def __init__(self, index: faiss.Index, gpu: str) -> None:
        self.cpu = index  # the property below: its kind is read once here
        self.gpu_mode = gpu
        self._want_gpu = check_gpu_mode(gpu)
        if gpu == "auto" and not self._want_gpu:
            # the GPU path announces itself when the copy is made ("FAISS index on N GPU(s)");
            # the CPU fallback is said once per process, not once per segment
            say_cpu_only({"FAISS": faiss_cpu_reason()})
        self._gpu: faiss.Index | None = None
        self._gpu_failed = False
        # where ("cpu" / "gpu") -> whether SearchParameters with an IDSelector work there
        self._selectors: dict[str, bool] = {}

    @classmethod
    def create(cls, dim: int, factory: str, gpu: str) -> VectorIndex:
        return cls(new_faiss_index(dim, factory), gpu)

    @classmethod
    def from_bytes(cls, data: bytes, source: Path, dim: int, gpu: str) -> VectorIndex:
        """Deserialize verified bytes of index.<g>.faiss and check they fit the manifest."""
        try:
            index = faiss.deserialize_index(np.frombuffer(data, dtype=np.uint8))
        except RuntimeError as exc:
            reason = faiss_reason(exc)
            raise StoreError(f"{source} is not a readable FAISS index: {reason}") from None
        if not isinstance(index, faiss.IndexIDMap2 | faiss.IndexIVF):
            raise StoreError(f"{source} holds a {type(index).__name__}, not a vitrieval index")
        if index.d != dim or index.metric_type != faiss.METRIC_INNER_PRODUCT:
            raise StoreError(
                f"{source} holds a {index.d}-d index with metric {index.metric_type}; "
                f"the manifest says {dim}-d inner product"
            )
        return cls(index, gpu)

    def write(self, path: Path) -> None:
        faiss.write_index(self.cpu, str(path))

    # -- properties -------------------------------------------------------------------

    @property
    def cpu(self) -> faiss.Index:
        """The CPU index (what is saved, and searched without a GPU)."""
        return self._cpu

    @cpu.setter
    def cpu(self, index: faiss.Index) -> None:
        # what kind of index it is, worked out once: searches ask on every call, and
        # training or rebuilding replaces it with one of the same kind
        self._cpu = index
        core = core_index(index)
        self._exact = isinstance(core, faiss.IndexFlat)
        if isinstance(core, faiss.IndexHNSW):
            self._scores_exact = isinstance(faiss.downcast_index(core.storage), faiss.IndexFlat)
        else:
            self._scores_exact = isinstance(core, faiss.IndexFlat | faiss.IndexIVFFlat)

    @property
    def ntotal(self) -> int:
        return int(self._cpu.ntotal)

    @property
    def is_trained(self) -> bool:
        return bool(self._cpu.is_trained)

    @property
    def exact(self) -> bool:
        """Whether a search here is exhaustive and exact (a flat float32 index)."""
        return self._exact

    @property
    def scores_exact(self) -> bool:
        """Whether its scores are the float32 inner products (Flat, IVF-Flat, HNSW over
        flat storage); an index that scores from codes (PQ, SQ, a transform) does not,
        and its candidates are worth re-scoring (_rescore.py)."""
        return self._scores_exact

    @property
    def removable(self) -> bool:
        """Whether remove_ids works correctly here (else the store keeps tombstones)."""
        return isinstance(self.cpu, faiss.IndexIVF) or isinstance(
            core_index(self.cpu), faiss.IndexFlatCodes
        )

    def search_settings(self) -> dict[str, int]:
        core = core_index(self.cpu)
        if isinstance(core, faiss.IndexIVF):
            return {"nprobe": int(core.nprobe), "nlist": int(core.nlist)}
        if isinstance(core, faiss.IndexHNSW):
            return {"efSearch": int(core.hnsw.efSearch)}
        return {}

    @property
    def gpu_in_use(self) -> str:
        """Where searches run: "cpu", or "<n> GPU(s)" (the copy is made at the first search)."""
        return f"{_gpu_count()} GPU(s)" if self._want_gpu and not self._gpu_failed else "cpu"

    # -- mutations --------------------------------------------------------------------

    def add(self, vectors: np.ndarray, ids: np.ndarray) -> None:
        """Add float32 (n, dim) `vectors` under int64 (n,) `ids`; mirrored to the GPU copy."""
        self.cpu.add_with_ids(vectors, ids)
        if self._gpu is not None:
            try:
                self._gpu.add_with_ids(vectors, ids)
            except RuntimeError:
                self._gpu = None  # re-copied from the CPU index at the next search

    def remove(self, ids: np.ndarray) -> None:
        """Remove int64 `ids` (only for `removable` layouts)."""
        self.cpu.remove_ids(faiss.IDSelectorBatch(ids))
        self._gpu = None

    def train(self, vectors: np.ndarray) -> None:
        """Train on float32 (n, dim) vectors, on a GPU copy when GPUs are in use."""
        try:
            gpu_index = self._to_gpu()
            if gpu_index is not None:
                gpu_index.train(vectors)
                self.cpu = faiss.index_gpu_to_cpu(gpu_index)
            else:
                self.cpu.train(vectors)
        except RuntimeError as exc:
            raise StoreError(f"training the index failed: {faiss_reason(exc)}") from None
        self._gpu = None

    def rebuild(self, batches: Iterable[tuple[np.ndarray, np.ndarray]]) -> None:
        """Replace the contents by `batches` of (ids, vectors), keeping training and settings."""
        fresh = faiss.clone_index(self.cpu)
        fresh.reset()
        for ids, vectors in batches:
            fresh.add_with_ids(vectors, ids)
        self.cpu = fresh
        self._gpu = None

    def copy_settings(self, other: VectorIndex) -> None:
        """Take over `other`'s nprobe / efSearch (e.g. when retraining into a fresh index)."""
        for name, value in other.search_settings().items():
            if name in ("nprobe", "efSearch"):
                self.set_parameter(name, value)

    def set_parameter(self, name: str, value: int) -> None:
        try:
            faiss.ParameterSpace().set_index_parameter(self.cpu, name, value)
        except RuntimeError:
            raise StoreError(
                f"search parameter {name!r} does not apply to this index "
                f"(its settings: {self.search_settings() or 'none'})"
            ) from None
        self._gpu = None

    def set_saved_parameters(self, params: Mapping[str, int]) -> None:
        """FAISS's own settings among a commit's search settings (`FAISS_PARAMS`:
        nprobe, efSearch; the store's, such as the oversample, are not FAISS's)."""
        for name, value in params.items():
            if name in FAISS_PARAMS:
                self.set_parameter(name, value)

    # -- GPU ---------------------------------------------------------------------------

    def _to_gpu(self) -> faiss.Index | None:
        """A GPU copy of the CPU index, or None (no GPU wanted, or this type has none)."""
        if not self._want_gpu or self._gpu_failed:
            return None
        try:
            gpu_index = faiss.index_cpu_to_all_gpus(self.cpu)
        except (RuntimeError, AttributeError) as exc:
            if self.gpu_mode == "cuda":
                raise StoreError(
                    f"this index type cannot run on the GPU: {faiss_reason(exc)}"
                ) from None
            logger.info("no GPU version of this index (%s); using the CPU", faiss_reason(exc))
            self._gpu_failed = True
            return None
        self._copy_settings_to_gpu(gpu_index)
        logger.info("FAISS index on %d GPU(s)", _gpu_count())
        return gpu_index

    def _copy_settings_to_gpu(self, gpu_index: faiss.Index) -> None:
        """Carry nprobe over: GPU searches without SearchParameters use the GPU index's own."""
        space = getattr(faiss, "GpuParameterSpace", None)
        nprobe = self.search_settings().get("nprobe")
        if space is None or nprobe is None:
            return
        try:
            space().set_index_parameter(gpu_index, "nprobe", nprobe)
        except RuntimeError as exc:
            logger.info("could not set nprobe on the GPU index: %s", faiss_reason(exc))

    def _search_target(self, fetch: int) -> tuple[faiss.Index, str]:
        if self._gpu is None and self._want_gpu and self.ntotal:
            self._gpu = self._to_gpu()
        if self._gpu is not None and fetch <= GPU_MAX_K:
            return self._gpu, "gpu"
        return self.cpu, "cpu"

    # -- search ------------------------------------------------------------------------

    def _params(
        self, index: faiss.Index, selector: Selector, widen: float
    ) -> faiss.SearchParameters:
        """SearchParameters of the type `index` demands, carrying its own nprobe/efSearch
        (a bare SearchParametersIVF would silently reset nprobe to 1), widened by
        `widen` for a filter that allows a fraction 1 / widen of the items."""
        core = core_index(index)
        if isinstance(core, faiss.IndexIVF):
            nprobe = capped(core.nprobe, widen, core.nlist)
            return faiss.SearchParametersIVF(sel=selector, nprobe=nprobe)
        if isinstance(core, faiss.IndexHNSW):
            ef = capped(core.hnsw.efSearch, widen, max(MAX_FILTERED_EF_SEARCH, core.hnsw.efSearch))
            return faiss.SearchParametersHNSW(sel=selector, efSearch=ef)
        return faiss.SearchParameters(sel=selector)

    def selector_works(self) -> bool:
        where = "gpu" if self._gpu is not None else "cpu"
        return self._selectors.get(where, True)

    def raw_search(
        self, queries: np.ndarray, fetch: int, selector: Selector | None, widen: float = 1.0
    ) -> tuple[np.ndarray, np.ndarray]:
        """FAISS search: (scores float32 (q, fetch), ids int64 (q, fetch), -1 = none).

        Uses `selector` where the index supports it; where it does not, returns
        unfiltered results (the caller post-filters either way).
        """
        index, where = self._search_target(fetch)
        # faiss.contrib.torch_utils (imported by some torch libraries) replaces `search`
        # with a wrapper that drops `params`; the numpy method it keeps is the real one.
        search = getattr(index, "search_numpy", index.search)
        if selector is not None and self._selectors.get(where, True):
            try:
                return search(queries, fetch, params=self._params(index, selector, widen))
            except RuntimeError as exc:
                logger.info("ID selectors unsupported on %s here (%s)", where, faiss_reason(exc))
                self._selectors[where] = False
        return search(queries, fetch)

    def top_k_arrays(
        self,
        queries: np.ndarray,
        k: int,
        *,
        allowed: np.ndarray | None,
        blocked: np.ndarray,
        widen: float = 1.0,
        ordered: bool = True,
    ) -> TopK:
        """Per query, up to k ids by descending score, ties by ascending id (TopK).
        `ordered=False`: the same k ids (a tie at the k-th place settled by id, as
        ever), in FAISS's order: by descending score, equal scores in any order (what
        re-scoring asks for: it orders them itself).

        queries: float32 (q, dim). allowed: sorted int64 ids that may be returned (None:
        all); blocked: int64 ids that never may (tombstones, exclusions). widen: how much
        wider than its own nprobe / efSearch an IVF or HNSW search looks (a filter's
        1 / selectivity, _filter_plans.py).
        """
        results = [NO_HITS] * len(queries)
        if allowed is not None:
            allowed = difference(allowed, blocked)
            if allowed.size == 0:
                return results
        ntotal = self.ntotal
        candidates = ntotal if allowed is None else allowed.size
        if ntotal == 0 or candidates == 0:
            return results
        selector, keep = _selector(allowed, blocked)
        glance = not ordered and keep is None
        fetch = self._initial_fetch(k, ntotal, candidates, blocked.size, selector)
        pending = range(len(queries))
        batch = queries
        while pending:
            scores, ids = self.raw_search(batch, fetch, selector, widen)
            kept = None
            unfinished = []
            for row, query in enumerate(pending):
                hits = _unordered_row(scores[row], ids[row], k, fetch, ntotal) if glance else None
                if hits is None:
                    if kept is None:  # the glance did not settle it: the full check
                        kept = ids >= 0 if keep is None else keep(ids) & (ids >= 0)
                    hits = _finish_row(scores[row], ids[row], kept[row], k, fetch, ntotal)
                if hits is None:
                    unfinished.append(query)
                else:
                    results[query] = hits
            if not unfinished:
                break
            pending = unfinished
            batch = queries[np.asarray(unfinished, dtype=np.int64)]
            fetch = min(ntotal, fetch * 2)
        return results

    def _initial_fetch(
        self, k: int, ntotal: int, candidates: int, n_blocked: int, selector: object
    ) -> int:
        """k + 1 (the +1 reveals a tie at the k-th place), more when post-filtering;
        `ntotal`: the index's (read once per search: a call into FAISS each time)."""
        fetch = k + 1
        if selector is not None and not self.selector_works():
            fetch = (k + 1) * math.ceil(ntotal / candidates) + n_blocked
        return min(ntotal, fetch)


def _selector(
    allowed: np.ndarray | None, blocked: np.ndarray
) -> tuple[Selector | None, Callable[[np.ndarray], np.ndarray] | None]:
    """An IDSelector for FAISS and the same rule as a numpy mask for post-filtering
    (None, None: every id is kept)."""
    if allowed is not None:
        return _id_selector(allowed), lambda ids: contains(allowed, ids)
    if blocked.size:
        # IDSelectorNot keeps a Python reference to the selector it wraps
        selector = faiss.IDSelectorNot(_id_selector(blocked))
        return selector, lambda ids: ~contains(blocked, ids)
    return None, None


def capped(value: int, widen: float, limit: int) -> int:
    """`value` widened by `widen`, at most `limit` (and never below `value`)."""
    return int(min(limit, max(value, math.ceil(value * widen))))


def exact_top_k(queries: np.ndarray, ids: np.ndarray, vectors: np.ndarray, k: int) -> TopK:
    """Brute force over candidates: per query of float32 (q, d), its top k (TopK) among
    `ids` (m,) with float32 `vectors` (m, d), ranked as `VectorIndex.top_k_arrays` ranks.

    A flat FAISS index over the subset computes the scores with the kernels a "Flat"
    index uses, so an item scores the same whichever way a segment was searched.
    """
    flat = faiss.IndexFlatIP(vectors.shape[1])
    subset = VectorIndex(_wrap(flat), "cpu")
    subset.add(np.ascontiguousarray(vectors, dtype=np.float32), ids)
    return subset.top_k_arrays(queries, k, allowed=None, blocked=NO_IDS)


def merge_top_k(
    parts: Sequence[tuple[np.ndarray, np.ndarray]], k: int
) -> tuple[np.ndarray, np.ndarray]:
    """The top k (ids, scores) of one query's `parts`, each a TopK row over ids no other
    part holds: by descending score, ties by ascending id, as one index ranks them."""
    if len(parts) == 1:
        ids, scores = parts[0]
        return ids[:k], scores[:k]
    if not parts:
        return NO_HITS
    ids = np.concatenate([part[0] for part in parts])
    scores = np.concatenate([part[1] for part in parts])
    order = np.lexsort((ids, -scores))[:k]
    return ids[order], scores[order]


def _id_selector(ids: np.ndarray) -> Selector:
    """A membership test for sorted int64 `ids`: a bitmap over [0, max id] when that is
    no larger than a hash set of them (large filters), else FAISS's batch selector."""
    top = int(ids[-1]) + 1 if ids.size else 0
    if ids.size and ids[0] >= 0 and top <= 64 * ids.size:
        bits = np.zeros(top, dtype=bool)
        bits[ids] = True
        packed = np.packbits(bits, bitorder="little")
        selector = faiss.IDSelectorBitmap(packed.size, faiss.swig_ptr(packed))  # n in bytes
        selector.referenced = packed  # the bitmap must outlive the selector
        return selector
    return faiss.IDSelectorBatch(ids)


def _unordered_row(
    scores: np.ndarray, ids: np.ndarray, k: int, fetch: int, ntotal: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """One unfiltered query's top k ids in FAISS's order when a glance settles them,
    else None (`_finish_row` does): FAISS answers by descending score with its -1
    padding last, so the first k are the top k when the k-th scores strictly above the
    (k + 1)-th, and every id found is when at most k came back and the index had no
    more (fewer than `fetch`, or all `ntotal`)."""
    found = ids.size if ids[-1] >= 0 else int(np.count_nonzero(ids >= 0))
    if found > k:
        return (ids[:k], scores[:k]) if scores[k - 1] > scores[k] else None
    if found < fetch or fetch >= ntotal:
        return ids[:found], scores[:found]
    return None


def _finish_row(
    scores: np.ndarray, ids: np.ndarray, kept: np.ndarray, k: int, fetch: int, ntotal: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """One query's top k (ids, scores) when these `fetch` candidates settle it, else None.

    Settled when the index had nothing more to give (fewer valid results than asked,
    or everything fetched), or when the lowest fetched score is strictly below the
    k-th kept score: then every item scoring at least that much has been seen, so
    neither the filter nor a tie can hide a better one.
    """
    valid = ids >= 0
    kept_ids, kept_scores = ids[kept], scores[kept]
    order = np.lexsort((kept_ids, -kept_scores))
    kept_ids, kept_scores = kept_ids[order][:k], kept_scores[order][:k]
    exhausted = fetch >= ntotal or int(valid.sum()) < fetch
    settled = len(kept_ids) == k and float(scores[valid].min()) < float(kept_scores[-1])
    if not (exhausted or settled):
        return None
    return kept_ids, kept_scores
