"""Re-embedding: a new index of an existing one's items, embedded by another model
(`vitrieval-index reembed SRC --model NEW.onnx --out DST`).

Every item of SRC keeps its key, label and metadata and is embedded again from the
image it was added from: its file path, or the upload a server kept for it under
SRC/uploads (copied into DST/uploads first, so that DST stands alone once SRC is
gone). The embedding and the adds are `build_index`'s: chunks committed as they go, so
a run that is stopped or killed and started again goes on after the last commit and
ends with the index an unbroken run makes; unreadable files are listed in DST's
build report. Items that have no image (added as vectors) or whose file is gone cannot
be embedded again: they are listed in DST/REPORT_FILE and left out. DST is created
with SRC's factory and filter fields.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .atomic import atomic_write_text
from .evaluation.datasets import Item
from .pipeline.build_index import BuildReport, build_index
from .runtime.embedder import Embedder
from .shards import open_index
from .store import IndexStore, StoreError
from .store.manifest import UPLOADS_DIR

REPORT_FILE = "reembed_report.json"
SCROLL_PAGE = 10_000


@dataclass
class ReembedReport:
    """What a re-embedding could not carry over, and the build's own report."""

    source: str
    items: int = 0
    no_image: list[str] = field(default_factory=list)  # keys added as vectors
    image_gone: list[dict] = field(default_factory=list)  # {"key", "path"}
    uploads_copied: int = 0
    build: BuildReport | None = None

    def to_json(self) -> dict:
        return {
            "source": self.source,
            "items": self.items,
            "no_image": self.no_image,
            "image_gone": self.image_gone,
            "uploads_copied": self.uploads_copied,
        }


def source_items(src: Path, out: Path, report: ReembedReport) -> list[Item]:
    """SRC's items with an image to embed (kept uploads copied into OUT's uploads), in
    key order; the others are recorded in `report`."""
    items: list[Item] = []
    uploads = (src / UPLOADS_DIR).resolve()
    with open_index(src) as store:
        after = None
        while True:
            page = store.scroll(None, SCROLL_PAGE, after)
            for listed in page.items:
                report.items += 1
                if listed.path is None:
                    report.no_image.append(listed.key)
                    continue
                path = Path(listed.path)
                if not path.is_file():
                    report.image_gone.append({"key": listed.key, "path": listed.path})
                    continue
                if path.resolve().is_relative_to(uploads):
                    path = _copy_upload(path.resolve(), uploads, out / UPLOADS_DIR, report)
                items.append(Item(listed.key, listed.label, path, metadata=listed.metadata))
            after = page.next
            if after is None:
                return items


def _copy_upload(path: Path, uploads: Path, target: Path, report: ReembedReport) -> Path:
    copy = target / path.relative_to(uploads)
    if not (copy.is_file() and copy.stat().st_size == path.stat().st_size):
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, copy)
        report.uploads_copied += 1
    return copy.resolve()


def reembed(src: Path, out: Path, embedder: Embedder, **build: Any) -> ReembedReport:
    """Build OUT from SRC's items with `embedder` (module docstring); resumable. `build`:
    `build_index`'s `save_every`, `progress`, `on_image` and `should_stop` (a job's
    progress and cancel)."""
    if src.resolve() == out.resolve():
        raise StoreError("reembed writes a new index: --out must be another folder than SRC")
    with open_index(src) as store:
        if store.fingerprint == embedder.fingerprint:
            raise StoreError(f"{src} was built with this model already (same fingerprint)")
        factory, fields = store.factory, store.info()["filter_fields"]  # None: every field
    target = None
    if not (out / "manifest.json").exists():  # a new index (a re-run opens the one begun)
        target = IndexStore.create(
            out,
            dim=embedder.dim,
            factory=factory,
            fingerprint=embedder.fingerprint,
            model_path=embedder.model_path,
            filter_fields=fields,
        )
    report = ReembedReport(str(src))
    items = source_items(src, out, report)
    report.build = build_index(items, out, embedder, factory=factory, store=target, **build)
    atomic_write_text(out / REPORT_FILE, json.dumps(report.to_json(), indent=2) + "\n")
    return report
