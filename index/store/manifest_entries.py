"""The entries of manifest.json (manifest.py), as frozen dataclasses: one committed
generation (`Manifest`) and the files it names with their checksums.

Kept apart from the parsing, checking and writing in manifest.py, which names every
one of them too (`mf.Manifest`, ...).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

FORMAT_VERSION = 4
METRIC = "inner_product"


@dataclass(frozen=True)
class FileEntry:
    """Checksum and size of one file of a generation."""

    sha256: str
    bytes: int

    def to_json(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "bytes": self.bytes}


@dataclass(frozen=True)
class ModelEntry:
    """The model the vectors came from: its fingerprint, and the copy kept beside them.

    `file` is None when the store was created from a fingerprint alone (no model file).
    """

    fingerprint: str | None
    file: str | None = None
    checksum: FileEntry | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "fingerprint": self.fingerprint,
            "sha256": self.checksum.sha256 if self.checksum else None,
            "bytes": self.checksum.bytes if self.checksum else None,
        }


@dataclass(frozen=True)
class NamedFile:
    """A file of the index and its checksum (the quantizer, a tombstone list)."""

    name: str
    checksum: FileEntry

    def to_json(self) -> dict[str, Any]:
        return {"file": self.name, **self.checksum.to_json()}


@dataclass(frozen=True)
class TombstoneEntry(NamedFile):
    count: int = 0

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "count": self.count}


@dataclass(frozen=True)
class SegmentEntry:
    """A sealed segment: its files (checksummed when sealed, never rewritten), its row
    count, and the tombstones committed for it since. `rows_in_id_order`: written by a
    version that refuses rows out of ascending id order (_id_order.py); a segment
    without it is checked once when first read (an older merge could interleave)."""

    number: int
    rows: int
    files: dict[str, FileEntry]
    tombstones: TombstoneEntry | None = None
    rows_in_id_order: bool = False

    @property
    def live(self) -> int:
        return self.rows - (self.tombstones.count if self.tombstones else 0)

    def listed_files(self) -> dict[str, FileEntry]:
        files = dict(self.files)
        if self.tombstones:
            files[self.tombstones.name] = self.tombstones.checksum
        return files

    def to_json(self) -> dict[str, Any]:
        return {
            "number": self.number,
            "rows": self.rows,
            "files": {name: entry.to_json() for name, entry in self.files.items()},
            "tombstones": self.tombstones.to_json() if self.tombstones else None,
            **({"rows_in_id_order": True} if self.rows_in_id_order else {}),
        }


@dataclass(frozen=True)
class DbaEntry:
    """The derived DBA index (_dba.py): its settings, the generation it was computed
    at, how many items it holds, and its two files."""

    neighbours: int
    alpha: float
    generation: int
    count: int
    ids: NamedFile
    vectors: NamedFile

    def to_json(self) -> dict[str, Any]:
        return {
            "neighbours": self.neighbours,
            "alpha": self.alpha,
            "generation": self.generation,
            "count": self.count,
            "ids": self.ids.to_json(),
            "vectors": self.vectors.to_json(),
        }


@dataclass(frozen=True)
class TuningEntry:
    """What `vitrieval-index tune` measured and chose (index/tuning.py): the search
    settings (`params`: nprobe or efSearch, and oversample) that reached
    `target_recall` at the least measured latency; `recall` (recall@k on `queries`
    of the index's own items, each one's own item left out) and `held_out_recall`
    (on as many other items); `latency_ms` a single query's median at that setting;
    `items` the live items when it was measured; `reached`: whether any setting
    reached the target (else `params` is the best recall found)."""

    target_recall: float
    recall: float
    held_out_recall: float
    k: int
    queries: int
    params: dict[str, int]
    latency_ms: float
    items: int
    reached: bool
    tuned: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)  # every field is JSON already (params: a fresh dict)

    @classmethod
    def from_json(cls, raw: Any) -> TuningEntry | None:
        """The entry of decoded JSON; None when it is not one (the caller says where)."""
        floats = ("target_recall", "recall", "held_out_recall", "latency_ms")
        ints = ("k", "queries", "items")
        if not (
            isinstance(raw, dict)
            and all(isinstance(raw.get(f), int | float) for f in floats)
            and all(isinstance(raw.get(f), int) and not isinstance(raw[f], bool) for f in ints)
            and isinstance(raw.get("params"), dict)
            and all(isinstance(v, int) for v in raw["params"].values())
            and isinstance(raw.get("reached"), bool)
            and isinstance(raw.get("tuned"), str)
        ):
            return None
        return cls(
            **{f: float(raw[f]) for f in floats},
            **{f: int(raw[f]) for f in ints},
            params={str(k): int(v) for k, v in raw["params"].items()},
            reached=raw["reached"],
            tuned=raw["tuned"],
        )


@dataclass(frozen=True)
class CalibrationLevel:
    """One precision level of a duplicate-threshold calibration (index/calibration.py):
    the least `threshold` whose (copy, item) pairs reached `precision` on the generated
    copies (`reached`; else the threshold of the best precision measured), with the
    measured precision and recall and their 95% Wilson intervals, and `pairs`, the
    pairs scoring at least the threshold."""

    precision: float
    threshold: float
    reached: bool
    measured_precision: float
    precision_interval: tuple[float, float]
    recall: float
    recall_interval: tuple[float, float]
    pairs: int

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "precision_interval": list(self.precision_interval),
                "recall_interval": list(self.recall_interval)}  # fmt: skip

    @classmethod
    def from_json(cls, raw: Any) -> CalibrationLevel | None:
        floats = ("precision", "threshold", "measured_precision", "recall")
        spans = ("precision_interval", "recall_interval")
        if not (
            isinstance(raw, dict)
            and all(_is_number(raw.get(f)) for f in floats)
            and all(
                isinstance(raw.get(f), list) and len(raw[f]) == 2 and all(map(_is_number, raw[f]))
                for f in spans
            )
            and isinstance(raw.get("reached"), bool)
            and _is_int(raw.get("pairs"))
        ):
            return None
        shares = [raw["measured_precision"], raw["recall"], *raw[spans[0]], *raw[spans[1]]]
        if not (
            0 < raw["precision"] < 1
            and abs(raw["threshold"]) <= 1 + 1e-3  # a cosine, float32 rounding allowed
            and all(0 <= v <= 1 for v in shares)
            and raw["pairs"] >= 0
        ):
            return None
        return cls(
            **{f: float(raw[f]) for f in floats},
            **{f: (float(raw[f][0]), float(raw[f][1])) for f in spans},
            reached=raw["reached"],
            pairs=int(raw["pairs"]),
        )


@dataclass(frozen=True)
class CalibrationEntry:
    """What `vitrieval-index calibrate` measured (index/calibration.py): a level per
    precision, `precision` the one asked for (its threshold is the index's duplicate
    threshold), on `copies` generated copies of `images` of the index's own images
    (copy seed `seed`), when the index held `items` live items, at `calibrated`."""

    precision: float
    levels: tuple[CalibrationLevel, ...]
    images: int
    copies: int
    seed: int
    items: int
    calibrated: str

    def level(self, precision: float) -> CalibrationLevel | None:
        """The level calibrated for `precision`, if there is one."""
        return next((lv for lv in self.levels if abs(lv.precision - precision) < 1e-9), None)

    @property
    def threshold(self) -> float:
        """The duplicate threshold: the asked precision's."""
        level = self.level(self.precision)
        assert level is not None  # from_json and the calibration keep it there
        return level.threshold

    def to_json(self) -> dict[str, Any]:
        return {
            "precision": self.precision,
            "threshold": self.threshold,
            "levels": [level.to_json() for level in self.levels],
            **{f: getattr(self, f) for f in ("images", "copies", "seed", "items", "calibrated")},
        }

    @classmethod
    def from_json(cls, raw: Any) -> CalibrationEntry | None:
        """The entry of decoded JSON; None when it is not one (the caller says where)."""
        if not (isinstance(raw, dict) and isinstance(raw.get("levels"), list)):
            return None
        levels = tuple(CalibrationLevel.from_json(level) for level in raw["levels"])
        ints = ("images", "copies", "seed", "items")
        if not (
            _is_number(raw.get("precision"))
            and all(_is_int(raw.get(f)) for f in ints)
            and isinstance(raw.get("calibrated"), str)
            and None not in levels
            and 0 < raw["precision"] < 1
            and all(raw[f] >= 0 for f in ints)
            and len({level.precision for level in levels}) == len(levels)  # type: ignore[union-attr]
        ):
            return None
        entry = cls(
            float(raw["precision"]),
            levels,  # type: ignore[arg-type]  # None was ruled out above
            **{f: int(raw[f]) for f in ints},
            calibrated=raw["calibrated"],
        )
        return entry if entry.level(entry.precision) is not None else None


def _is_number(value: Any) -> bool:
    """A finite int or float (JSON as Python reads it may hold NaN and Infinity)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Manifest:
    """One committed generation, exactly as manifest.json states it.

    `segments`, `quantizer` (the trained empty index new segments start from, for
    factories that train) and `next_id`. The upgrade of format 1 (_upgrade_format1.py)
    states its generation as one of these without segments.
    """

    generation: int
    dim: int
    factory: str
    count: int
    model: ModelEntry | None
    created: str
    updated: str
    format_version: int = FORMAT_VERSION
    segments: tuple[SegmentEntry, ...] = ()
    quantizer: NamedFile | None = None
    next_id: int = 0
    search_params: dict[str, int] = field(default_factory=dict)
    filter_fields: tuple[str, ...] | None = None  # metadata paths indexed; None: every one
    dba: tuple[int, float] | None = None  # DBA (neighbours, alpha) commits compute; None: off
    dba_index: DbaEntry | None = None  # the derived DBA index (format 4; _dba.py)
    journal: tuple[int, int] | None = None  # (journal id, last row this commit holds)
    tuning: TuningEntry | None = None  # what `vitrieval-index tune` chose and measured
    calibration: CalibrationEntry | None = None  # what `vitrieval-index calibrate` measured

    @property
    def fingerprint(self) -> str | None:
        return self.model.fingerprint if self.model else None

    def listed_files(self) -> dict[str, FileEntry]:
        """Every file this generation consists of (the model copy aside)."""
        files: dict[str, FileEntry] = {}
        for segment in self.segments:
            files.update(segment.listed_files())
        if self.quantizer:
            files[self.quantizer.name] = self.quantizer.checksum
        if self.dba_index:
            for named in (self.dba_index.ids, self.dba_index.vectors):
                files[named.name] = named.checksum
        return files

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "generation": self.generation,
            "model": self.model.to_json() if self.model else None,
            "dim": self.dim,
            "metric": METRIC,
            "factory": self.factory,
            "count": self.count,
            "next_id": self.next_id,
            "search_params": dict(self.search_params),
            "tuning": self.tuning.to_json() if self.tuning else None,
            "calibration": self.calibration.to_json() if self.calibration else None,
            "filter_fields": None if self.filter_fields is None else list(self.filter_fields),
            "dba": self._dba_json(),
            "journal": ({"id": self.journal[0], "upto": self.journal[1]} if self.journal else None),
            "quantizer": self.quantizer.to_json() if self.quantizer else None,
            "segments": [segment.to_json() for segment in self.segments],
            "created": self.created,
            "updated": self.updated,
        }

    def _dba_json(self) -> dict[str, Any] | None:
        if self.dba_index is not None:
            return self.dba_index.to_json()
        return None if self.dba is None else {"neighbours": self.dba[0], "alpha": self.dba[1]}
