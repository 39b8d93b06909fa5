"""`vitrieval-index embed`: embed a list of images into an embeddings folder, part by part.

The folder's format is `vitrieval.index.pipeline.embeddings_folder`. The job cuts the image
list (a folder walk or a CSV, read as `build --images` reads it) into parts of
`part_size` images (by default `default_part_size`: about `DEFAULT_PARTS` parts,
whatever the runner); part i
holds the readable images among inputs [i * part_size, (i + 1) * part_size) and is
written as `part-0000i.parquet` atomically. After each part, `errors.csv` (path,
reason, key and part of every unreadable file) and then `embeddings.json` (the commit
point) are replaced atomically; `embeddings.json` records each finished part's input
range and a SHA-256 of the keys and labels of its inputs.

Resuming: run the same command again. Parts recorded in `embeddings.json` whose file
is there are kept and skipped; the first unrecorded part is embedded again (a kill
loses at most one part). The inputs are checked first: if a finished part's range of
the list now holds other keys or labels, or the model or `--part-size` differ, the
run stops with one line before anything is written. `complete` turns true when every
part is done; until then `build --embeddings` refuses the folder.

`start_job` and `EmbedJob` hold that bookkeeping for every runner: `embed_to_folder`
embeds the parts in order in this process; `vitrieval.distributed.embed` embeds them on a Ray
cluster, several at once, and commits each as it finishes (a kill there loses the
parts in flight).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from ..atomic import atomic_write_text
from ..evaluation.datasets import Item
from ..progress import LineProgress, progress_bar
from ..runtime.embedder import Embedder
from ..stopping import Stopped
from .embeddings_folder import (
    ERRORS_FILE,
    FORMAT,
    META_FILE,
    VERSION,
    EmbeddingsError,
    list_parts,
    part_name,
    read_meta,
    write_meta,
    write_part,
)

MAX_PART_SIZE = 50_000
"""The largest default part: a part's vectors are held in memory until it is written
(50,000 768-d float32 vectors: 150 MB), and a kill loses at most one part."""
DEFAULT_PARTS = 16
"""Parts a new folder is cut into by default (see `default_part_size`)."""
MIN_PART_SIZE = 100
"""The smallest default part: a part is one Parquet file (and one Ray task)."""
ERROR_COLUMNS = ("path", "reason", "key", "part")
_PART_NAME = re.compile(r"part-(\d{5})\.parquet")


@dataclass
class EmbedReport:
    inputs: int = 0
    parts: int = 0
    embedded: int = 0  # rows written by this run
    parts_done_before: int = 0
    rows_done_before: int = 0
    count: int = 0  # rows in the folder
    unreadable: int = 0  # unreadable inputs, over every part
    failed: list[dict] = field(default_factory=list)  # this run's unreadable inputs
    seconds: float = 0.0

    def summary(self, out: Path) -> str:
        notes = ""
        if self.parts_done_before:
            notes += f", {self.rows_done_before} in {self.parts_done_before} part(s) already done"
        if self.unreadable:
            notes += f", {self.unreadable} unreadable skipped (see {out / ERRORS_FILE})"
        rate = (
            f" ({self.embedded / self.seconds:.0f} img/s)" if self.embedded and self.seconds else ""
        )
        finished = self.parts and self.parts_done_before == self.parts
        return ("already finished, nothing to do: " if finished else "") + (
            f"embedded {self.embedded} of {self.inputs} images{notes} in {self.seconds:.1f}s"
            f"{rate}; {out} holds {self.count} embeddings in {self.parts} part(s)"
        )


def default_part_size(inputs: int) -> int:
    """The part size of a new folder of `inputs` images without `--part-size`, in this
    process or on Ray: `DEFAULT_PARTS` parts of `MIN_PART_SIZE` to `MAX_PART_SIZE`
    images. Parts are what a Ctrl-C or a kill keeps, and Ray's unit of work and of
    progress: with one fixed size of 50,000, every catalogue below it was one part, so
    a stop kept nothing and `--ray` showed 0 until the end."""
    return min(MAX_PART_SIZE, max(MIN_PART_SIZE, math.ceil(inputs / DEFAULT_PARTS)))


def inputs_checksum(items: Sequence[Item]) -> str:
    """SHA-256 of the keys, labels and metadata of `items`, in order: what a part was
    made from. An item without metadata adds nothing for it, so a folder embedded from
    a list without metadata keeps its checksums."""
    digest = hashlib.sha256()
    for item in items:
        label = "\x00" if item.label is None else "=" + item.label
        if item.metadata is not None:
            label += "\x00" + json.dumps(item.metadata, sort_keys=True)
        digest.update(f"{item.key}\x00{label}\n".encode("utf-8", "surrogatepass"))
    return digest.hexdigest()


def embed_to_folder(
    items: Sequence[Item], out: Path, embedder: Embedder, *, progress: bool = True, **options: Any
) -> EmbedReport:
    """Embed `items` into the embeddings folder `out`, resuming a run that stopped
    (`options`: `start_job`'s part_size and source)."""
    job = start_job(items, out, embedder, **options)
    bar = job.progress_bar(progress)
    try:
        for number in job.todo:
            start, stop = job.ranges[number]
            part = embed_part(embedder, items[start:stop], part_name(number), on_image=bar.update)
            part.write(job.out / part_name(number))
            job.commit(number, part.rows, part.failed)
    except KeyboardInterrupt:
        # the bar counted the inputs of the part under way as they were read; its last
        # line must show what the stop keeps, the committed parts
        bar.update(job.done_inputs() - bar.n)
        raise job.stopped() from None
    finally:
        bar.close()
    return job.finish()


@dataclass
class EmbeddedPart:
    """One part's rows (the readable inputs, in list order) and its unreadable inputs."""

    keys: list[str]
    labels: list[str | None]
    paths: list[str | None]
    embeddings: np.ndarray
    failed: list[dict]  # rows of errors.csv
    metadata: list[dict | None] = field(default_factory=list)  # empty: none for any row

    @property
    def rows(self) -> int:
        return len(self.keys)

    def write(self, target: Path) -> None:
        """The part file, written atomically."""
        write_part(
            target,
            self.keys,
            self.embeddings,
            labels=self.labels,
            paths=self.paths,
            metadata=self.metadata or None,
        )


def embed_part(
    embedder: Embedder,
    chunk: Sequence[Item],
    name: str,
    *,
    read: Sequence[Item] | None = None,
    on_image: Callable[[int], object] | None = None,
) -> EmbeddedPart:
    """Embed the inputs of part `name`. `read`, when given, holds the same inputs at the
    same positions with the paths to open (absolute ones, on another machine); the part
    records `chunk`'s. `on_image(1)` is called as each input is read."""
    keys: list[str] = []
    labels: list[str | None] = []
    paths: list[str | None] = []
    metadata: list[dict | None] = []
    vectors: list[np.ndarray] = []
    failed: list[dict] = []
    for result in embedder.iter_items(chunk if read is None else read, on_image=on_image):
        for position in result.indices:
            item = chunk[position]
            keys.append(item.key)
            labels.append(item.label)
            paths.append(str(item.path) if item.path else None)
            metadata.append(item.metadata)
        vectors.append(result.embeddings)
        for position, reason in result.errors:
            item = chunk[position]
            opened = read[position].path if read is not None else None
            if opened and item.path:  # the reason names the file as the list does
                reason = reason.replace(str(opened), str(item.path))
            failed.append(
                {"path": str(item.path or ""), "reason": reason, "key": item.key, "part": name}
            )
    matrix = np.concatenate(vectors) if vectors else np.zeros((0, embedder.dim), np.float32)
    if all(value is None for value in metadata):
        metadata = []
    return EmbeddedPart(keys, labels, paths, matrix, failed, metadata)


@dataclass
class EmbedJob:
    """An embed under way: what every runner (this process, or actors on a Ray cluster,
    see distributed/embed.py) shares. `todo` lists the part numbers left to embed; each
    part, once its file is written, is recorded with `commit` (in any order), and
    `finish` marks the folder complete."""

    out: Path
    items: Sequence[Item]
    meta: dict
    ranges: list[tuple[int, int]]
    done: dict[str, dict]
    todo: list[int]
    errors: list[dict]
    report: EmbedReport
    started: float

    def progress_bar(self, progress: bool = True) -> tqdm | LineProgress:
        """One bar for the whole list (plain lines off a terminal), starting from the
        parts done before."""
        return progress_bar(
            len(self.items), "images", "embedding", initial=self.done_inputs(), enabled=progress
        )

    def done_inputs(self) -> int:
        """Inputs (readable or not) of the parts committed so far."""
        return sum(entry["stop"] - entry["start"] for entry in self.done.values())

    def commit(self, number: int, rows: int, failed: list[dict]) -> None:
        """Record part `number`, whose file holds `rows` rows: its unreadable inputs go
        to errors.csv, then embeddings.json (the commit point) is replaced."""
        name = part_name(number)
        start, stop = self.ranges[number]
        # sorted by part (stably: each part's rows stay in list order), whatever order
        # the parts finish in
        errors = [row for row in self.errors if row["part"] != name] + failed
        self.errors = sorted(errors, key=lambda row: row["part"])
        _write_errors(self.out, self.errors)
        self.done[name] = {
            "file": name,
            "start": start,
            "stop": stop,
            "inputs_sha256": inputs_checksum(self.items[start:stop]),
            "rows": rows,
            "unreadable": len(failed),
        }
        _record(self.meta, self.done)
        write_meta(self.out, self.meta)  # the commit point of this part
        self.report.embedded += rows
        self.report.failed += failed

    def stopped(self) -> Stopped:
        """What a Ctrl-C keeps: the parts committed (a re-run skips them)."""
        rows = sum(entry["rows"] for entry in self.done.values())
        return Stopped(
            f"{len(self.done)} of {len(self.ranges)} part(s) done and kept in {self.out} "
            f"({rows} embeddings); the part under way is embedded again"
        )

    def finish(self) -> EmbedReport:
        """Mark the folder complete, remove what stopped runs left, and report."""
        self.meta["complete"] = True
        _record(self.meta, self.done)
        write_meta(self.out, self.meta)
        _remove_leftovers(self.out, self.done)
        self.report.count = self.meta["count"]
        self.report.unreadable = self.meta["unreadable"]
        self.report.seconds = time.perf_counter() - self.started
        return self.report


def start_job(
    items: Sequence[Item],
    out: Path,
    embedder: Embedder,
    *,
    part_size: int | None = None,
    source: str | None = None,
) -> EmbedJob:
    """Open (or create) the folder `out` for embedding `items` with `embedder`: checked
    against a previous run (model, part size, the inputs of its finished parts) before
    anything is written, with the parts left to do."""
    started = time.perf_counter()
    out = Path(out)
    if part_size is not None and part_size < 1:
        raise EmbeddingsError(f"--part-size must be at least 1, got {part_size}")
    meta = _start(out, embedder, part_size, len(items), source)
    size: int = meta["part_size"]
    ranges = [(start, min(start + size, len(items))) for start in range(0, len(items), size)]
    done = _check_done(out, meta, items, ranges)
    meta["inputs"] = len(items)
    report = EmbedReport(inputs=len(items), parts=len(ranges))
    # a recorded part whose file is gone is embedded again
    done = {name: entry for name, entry in done.items() if (out / name).is_file()}
    report.parts_done_before = len(done)
    report.rows_done_before = sum(entry["rows"] for entry in done.values())
    todo = [number for number in range(len(ranges)) if part_name(number) not in done]
    return EmbedJob(out, items, meta, ranges, done, todo, _read_errors(out), report, started)


def _start(
    out: Path, embedder: Embedder, part_size: int | None, inputs: int, source: str | None
) -> dict:
    """The folder's embeddings.json: the one a previous run left, checked against this
    run, or a new one (written at once, so the folder is known as an embed's). Without
    --part-size a resumed folder keeps its own, and a new one takes the default for
    its `inputs` images."""
    model = str(embedder.model_path.resolve())
    if (out / META_FILE).is_file():
        meta = read_meta(out)
        if meta.get("format") != FORMAT or not isinstance(meta.get("part_size"), int):
            raise EmbeddingsError(
                f"{out} holds embeddings that `vitrieval-index embed` did not write; "
                "embed into a new --out"
            )
        if meta["model_fingerprint"] != embedder.fingerprint:
            raise EmbeddingsError(
                f"{out} was started with model fingerprint {meta['model_fingerprint'][:12]} "
                f"({meta.get('model')}), --model has {embedder.fingerprint[:12]}: embed into a "
                "new --out, or resume with the model it was started with"
            )
        if meta["dim"] != embedder.dim:
            raise EmbeddingsError(f"{out} holds {meta['dim']}-d embeddings, not {embedder.dim}-d")
        if part_size is not None and part_size != meta["part_size"]:
            raise EmbeddingsError(
                f"{out} was started with --part-size {meta['part_size']}, not {part_size}: "
                f"resume with --part-size {meta['part_size']} (or without it), or embed into "
                "a new --out"
            )
        meta["model"] = model
        return meta
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise EmbeddingsError(
            f"{out} exists and is not an embeddings folder (no {META_FILE}); "
            "embed into a new or empty folder"
        )
    out.mkdir(parents=True, exist_ok=True)
    meta: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "dim": embedder.dim,
        "model_fingerprint": embedder.fingerprint,
        "model": model,
        "source": source,
        "part_size": part_size or default_part_size(inputs),
        "inputs": None,
        "count": 0,
        "unreadable": 0,
        "complete": False,
        "parts": [],
    }
    write_meta(out, meta)
    return meta


def _check_done(
    out: Path, meta: dict, items: Sequence[Item], ranges: list[tuple[int, int]]
) -> dict[str, dict]:
    """The finished parts, by file name, once each is checked to hold the inputs now at
    its position in the list."""
    done: dict[str, dict] = {}
    for entry in meta.get("parts") or []:
        match = _PART_NAME.fullmatch(str(entry.get("file")))
        number = int(match.group(1)) if match else -1
        expected = ranges[number] if 0 <= number < len(ranges) else None
        recorded = (entry.get("start"), entry.get("stop"))
        if (
            expected is None
            or recorded != expected
            or entry.get("inputs_sha256") != inputs_checksum(items[slice(*expected)])
        ):
            raise EmbeddingsError(
                f"{out / str(entry.get('file'))} was embedded from inputs {recorded[0]} to "
                f"{recorded[1]} of another list: the images changed since "
                f"(now {len(items)}); embed into a new --out, or delete {out} to start over"
            )
        done[entry["file"]] = entry
    return done


def _record(meta: dict, done: dict[str, dict]) -> None:
    meta["parts"] = [done[name] for name in sorted(done)]
    meta["count"] = sum(entry["rows"] for entry in done.values())
    meta["unreadable"] = sum(entry["unreadable"] for entry in done.values())


def _read_errors(out: Path) -> list[dict]:
    path = out / ERRORS_FILE
    if not path.is_file():
        return []
    with path.open(newline="", encoding="utf-8") as fh:
        return [dict(row) for row in csv.DictReader(fh)]


def _write_errors(out: Path, errors: list[dict]) -> None:
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=ERROR_COLUMNS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(errors)
    atomic_write_text(out / ERRORS_FILE, text.getvalue())


def _remove_leftovers(out: Path, done: dict[str, dict]) -> None:
    """Parts a stopped run renamed but never recorded (beyond today's list), and the
    temporary files of writes a kill interrupted."""
    for path in list_parts(out):
        if _PART_NAME.fullmatch(path.name) and path.name not in done:
            path.unlink(missing_ok=True)
    for path in out.glob(".*.tmp"):
        path.unlink(missing_ok=True)
