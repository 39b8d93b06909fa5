"""Where images to index come from: a folder walked recursively, or a CSV list.

Both give `Item`s (see `vitrieval.index.evaluation.datasets`): the key is what the index stores and
what
search results return, so it must be stable across runs (a re-run of `build` skips
keys already indexed).

- Folder: every file with an image extension below DIR, in sorted order; the key is
  the path relative to DIR (posix), the label the first folder component when
  `labels_from_folders` (images directly in DIR then have no label).
- CSV: `vitrieval.index.evaluation.datasets.csv_list` (header row, `path,label[,key]`, relative
paths
  against the CSV's folder).
"""

from __future__ import annotations

import csv
import logging
from collections import Counter
from pathlib import Path

from ..atomic import atomic_path
from ..evaluation.datasets import (
    IMAGE_EXTENSIONS,
    DatasetError,
    Item,
    csv_list,
    file_key,
    is_image_file,
)

logger = logging.getLogger(__name__)


def walk_images(
    root: Path, labels_from_folders: bool = False, skipped: list[Path] | None = None
) -> list[Item]:
    """Items for every image file below `root` (hidden files and folders skipped).
    `skipped`, when given, receives the other files (no image suffix), sorted."""
    if not root.is_dir():
        raise DatasetError(f"image folder not found: {root}")
    items = []
    files = sorted(p for p in root.rglob("*") if p.is_file())
    if skipped is not None:
        skipped += [
            p
            for p in files
            if p.suffix.lower() not in IMAGE_EXTENSIONS
            and not any(part.startswith(".") for part in p.relative_to(root).parts)
        ]
    for path in (p for p in files if is_image_file(p, root)):
        key = file_key(path, root)
        relative = path.relative_to(root)
        label = relative.parts[0] if labels_from_folders and len(relative.parts) > 1 else None
        items.append(Item(key=key, label=label, path=path))
    return items


def read_sources(
    images: str | Path,
    labels_from_folders: bool = False,
    flag: str = "--images",
    skipped: list[Path] | None = None,
) -> list[Item]:
    """`images` is a folder or a `.csv` list; returns its items in a stable order.

    What `build`, `add` and `bench` (`--gallery`, `--queries`) read; `flag` names the
    option in error messages; `skipped` receives a folder's files without an image
    suffix (see `skipped_note`).
    """
    images = Path(images)
    if images.suffix.lower() == ".csv":
        if labels_from_folders:
            raise DatasetError("--labels-from-folders applies to folders; a CSV carries its labels")
        return csv_list(images)
    if not images.exists():
        raise DatasetError(f"{flag} path not found: {images}")
    return walk_images(images, labels_from_folders, skipped)


def skipped_note(skipped: list[Path]) -> str:
    """The end of a summary line counting the files a folder walk left out, by suffix
    (`-v` logs their names): a catalogue's SVGs otherwise vanish without a word."""
    if not skipped:
        return ""
    for path in skipped:
        logger.info("skipped (not an image suffix): %s", path)
    suffixes = Counter(path.suffix.lower() or "no suffix" for path in skipped)
    kinds = ", ".join(f"{count} {suffix}" for suffix, count in suffixes.most_common())
    return f"; {len(skipped)} file(s) without an image suffix skipped ({kinds}; -v names them)"


def write_image_folder(items: list[Item], root: Path) -> Path:
    """Save `items` as PNG files, one folder per label, plus `root/list.csv`.

    Materialises an in-memory dataset (digits) as files that `build --images DIR
    --labels-from-folders` or `bench --gallery root/list.csv` can read. Returns the CSV.
    An item's key in the CSV is its file's path relative to `root` (`7/digits_00017.png`
    for digit 17), the key a folder build of `root` gives it, so the two agree.
    """
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for item in items:
        label = item.label or "unlabelled"
        path = root / label / (item.key.replace("/", "_") + ".png")
        path.parent.mkdir(parents=True, exist_ok=True)
        item.open().save(path)
        relative = path.relative_to(root).as_posix()
        rows.append((relative, item.label or "", relative))
    listing = root / "list.csv"
    with atomic_path(listing) as tmp, open(tmp, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["path", "label", "key"])
        writer.writerows(rows)
    return listing
