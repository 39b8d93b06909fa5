"""Dataset readers: labelled image lists and their train/test splits.

Every reader returns `Item`s (unique key, class label, file path or in-memory pixels)
so that training, indexing and evaluation see one shape of data whatever the source:

- `digits`: scikit-learn's bundled handwritten digits, upscaled; needs no files.
- `image_folder`: one sub-folder per class (the torchvision ImageFolder layout).
- `csv_list`: a CSV with a header and columns `path,label[,key][,metadata]`.
- `cub`, `cars`, `sop`: the on-disk layouts of CUB-200-2011, Cars196 and Stanford
  Online Products, with their standard class-disjoint splits (the metric-learning
  protocol: the test classes are never seen in training).

Image files are not opened or checked for existence here: a catalogue of 100k images
should list in a second, and a broken file is reported by `Item.open` (through
`vitrieval.index.runtime.images.open_image`) when it is actually read.
"""

from __future__ import annotations

import csv
import os
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from vitrieval.index.runtime.images import DEFAULT_MAX_PIXELS, ImageDecodeError, open_image

from ..json_text import parse_json

DATASET_NAMES: tuple[str, ...] = ("digits", "folder", "csv", "cub", "cars", "sop")
"""Names accepted by `load_dataset`."""

IMAGE_EXTENSIONS: frozenset[str] = frozenset(
    {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"}
)
"""File suffixes (lower-cased) that `image_folder` treats as images."""

CSV_COLUMNS: tuple[str, ...] = ("path", "label", "key", "metadata")
"""The columns a CSV list may have (`path` and `label` required); any other is an error,
so that a misspelt column is not silently dropped. `metadata` is a JSON object as text,
carried into an index (and its filters) by `vitrieval-index build`, `embed` and `add`."""

STRATIFIED = "stratified"
DISJOINT = "class-disjoint"
GIVEN = "given"
"""The protocol of a split given as two sets (`load_dataset(..., val=...)`), or of a
stratified split that holds nothing out (`test_fraction=0`)."""
_SPLIT_ALIASES = {"stratified": STRATIFIED, "disjoint": DISJOINT, "class-disjoint": DISJOINT}

# Class ids (1-based, as in the datasets' own files) at or below which a class is
# a training class in the standard metric-learning splits.
CUB_LAST_TRAIN_CLASS = 100
CARS_LAST_TRAIN_CLASS = 98


class DatasetError(ValueError):
    """A dataset could not be read or split; `str(error)` names the path or the problem."""


@dataclass(frozen=True)
class Item:
    """One image: on disk (`path`) or in memory (`pixels`, uint8 HxW or HxWx3).

    `label` is the class name; None only for unlabelled catalogue images being indexed
    (every dataset reader sets it). `metadata`: the JSON object an index stores with
    the item (a CSV list's `metadata` column), None for none.
    """

    key: str
    label: str | None
    path: Path | None = None
    pixels: np.ndarray | None = field(default=None, compare=False, repr=False)
    # compare=False: a dict is unhashable, and Items are frozen (hashable) values
    metadata: dict | None = field(default=None, compare=False)

    def open(
        self, max_pixels: int = DEFAULT_MAX_PIXELS, draft_size: int | None = None
    ) -> Image.Image:
        """Return the image as RGB; raises `ImageDecodeError` if it cannot be read.

        `max_pixels` and `draft_size` apply to files, as in
        `vitrieval.index.runtime.images.open_image`.
        """
        if self.pixels is not None:
            return _pixels_to_image(self.pixels, self.key)
        if self.path is None:
            raise ImageDecodeError(f"item {self.key!r} has neither a path nor pixels")
        return open_image(self.path, max_pixels, draft_size)


@dataclass
class Split:
    """A named train/test partition of a dataset and the protocol that made it."""

    name: str
    train: list[Item]
    test: list[Item]
    protocol: str  # STRATIFIED (same classes on both sides), DISJOINT (no class shared), GIVEN

    def train_classes(self) -> list[str]:
        """Sorted unique labels of the training items."""
        return sorted({item.label for item in self.train})

    def test_classes(self) -> list[str]:
        """Sorted unique labels of the test items."""
        return sorted({item.label for item in self.test})


def _pixels_to_image(pixels: np.ndarray, key: str) -> Image.Image:
    if pixels.dtype != np.uint8 or not (
        pixels.ndim == 2 or (pixels.ndim == 3 and pixels.shape[2] == 3)
    ):
        raise ImageDecodeError(
            f"item {key!r}: pixels must be uint8 HxW or HxWx3, "
            f"got {pixels.dtype} with shape {pixels.shape}"
        )
    return Image.fromarray(pixels).convert("RGB")


def load_dataset(
    name: str,
    root: str | Path | None = None,
    *,
    split: str | None = None,
    test_fraction: float = 0.3,
    seed: int = 0,
    image_size: int = 32,
    val: str | Path | None = None,
) -> Split:
    """Read dataset `name` (one of `DATASET_NAMES`) and split it into train and test.

    `split` is "stratified" or "disjoint" (None: the dataset's default, stratified for
    digits/folder/csv, disjoint for cub/cars/sop, which only have their standard
    class-disjoint split). `root` is the folder (or CSV file) and is required for all
    but digits; `test_fraction` and `seed` apply to stratified splits only, and
    `test_fraction=0` holds nothing out (every item trains, the test side is empty).

    `val` (folder and csv only): a second folder or CSV, read as `root` is, that is the
    test side as it stands, while every item of `root` trains (protocol GIVEN); `split`,
    `test_fraction` and `seed` do not apply then.
    """
    if name not in DATASET_NAMES:
        raise DatasetError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASET_NAMES)}")
    if val is not None:
        if name not in ("folder", "csv"):
            raise DatasetError(
                f"a separate validation set applies to the folder and csv datasets, not {name!r}"
            )
        if root is None:
            raise DatasetError(f"dataset {name!r} needs a root path (its folder or file)")
        read = image_folder if name == "folder" else csv_list
        return Split(name=f"{name}/val", train=read(root), test=read(val), protocol=GIVEN)
    if name == "digits":
        return digits(
            split or STRATIFIED, test_fraction=test_fraction, seed=seed, image_size=image_size
        )
    if root is None:
        raise DatasetError(f"dataset {name!r} needs a root path (its folder or file)")
    if name in ("cub", "cars", "sop"):
        if split is not None and _protocol(split) != DISJOINT:
            raise DatasetError(
                f"dataset {name!r} only has its standard class-disjoint split, not {split!r}"
            )
        return {"cub": cub, "cars": cars, "sop": sop}[name](root)
    items = image_folder(root) if name == "folder" else csv_list(root)
    return _split_items(name, items, split or STRATIFIED, test_fraction, seed)


def _protocol(split: str) -> str:
    try:
        return _SPLIT_ALIASES[split]
    except KeyError:
        raise DatasetError(f"unknown split {split!r}; choose 'stratified' or 'disjoint'") from None


def _split_items(
    name: str, items: list[Item], split: str, test_fraction: float, seed: int
) -> Split:
    protocol = _protocol(split)
    if protocol == STRATIFIED and test_fraction == 0:
        return Split(name=f"{name}/all", train=list(items), test=[], protocol=GIVEN)
    if protocol == STRATIFIED:
        train, test = stratified_split(items, test_fraction, seed)
    else:
        train, test = disjoint_split(items)
    if not train or not test:
        raise DatasetError(
            f"{name}: the {split} split leaves an empty side "
            f"({len(train)} train, {len(test)} test items); every class needs 2+ images"
        )
    short = "stratified" if protocol == STRATIFIED else "disjoint"
    return Split(name=f"{name}/{short}", train=train, test=test, protocol=protocol)


def stratified_split(
    items: list[Item], test_fraction: float, seed: int
) -> tuple[list[Item], list[Item]]:
    """Split each class into train and test in proportion `test_fraction`.

    Deterministic for a given `seed` and set of items (each class is shuffled from its
    key order, so the input order does not matter). A class with 2+ items gets at
    least one on each side; a single-item class goes to train. Both lists keep the
    input order.
    """
    if not 0.0 < test_fraction < 1.0:
        raise DatasetError(f"test_fraction must be between 0 and 1, got {test_fraction}")
    by_class: dict[str, list[int]] = defaultdict(list)
    for index, item in enumerate(items):
        by_class[item.label].append(index)
    rng = np.random.default_rng(seed)
    test_indices: set[int] = set()
    for label in sorted(by_class):
        members = sorted(by_class[label], key=lambda i: items[i].key)
        if len(members) < 2:
            continue
        n_test = min(max(round(len(members) * test_fraction), 1), len(members) - 1)
        chosen = rng.permutation(len(members))[:n_test]
        test_indices.update(members[j] for j in chosen)
    train = [item for i, item in enumerate(items) if i not in test_indices]
    test = [item for i, item in enumerate(items) if i in test_indices]
    return train, test


def disjoint_split(items: list[Item]) -> tuple[list[Item], list[Item]]:
    """Put the first half of the class names in train and the second half in test.

    Names are sorted numbers-aware ("2" before "10") so numeric labels split as a
    person would expect; with an odd count train gets the extra class.
    """
    classes = sorted({item.label for item in items}, key=_natural_key)
    if len(classes) < 2:
        raise DatasetError(f"a class-disjoint split needs at least 2 classes, found {len(classes)}")
    train_classes = set(classes[: (len(classes) + 1) // 2])
    train = [item for item in items if item.label in train_classes]
    test = [item for item in items if item.label not in train_classes]
    return train, test


def _natural_key(text: str) -> list[tuple[int, int | str]]:
    # Tuples keep numbers and text comparable: (0, n) sorts before (1, "text").
    return [
        (0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", text) if part
    ]


DIGITS_MAX_SIZE = 1024
"""The largest side digits are upscaled to: all 1,797 are held in memory, 1.9 GB at
this size (a side of 100,000 pixels asked for 18 TB)."""


def digits(
    split: str = "stratified", *, test_fraction: float = 0.3, seed: int = 0, image_size: int = 32
) -> Split:
    """scikit-learn's 1,797 handwritten 8x8 digits, upscaled to `image_size` (bicubic).

    Bundled with scikit-learn, so it works offline: the default demo and quality-test
    dataset. "stratified" splits every digit by `test_fraction`; "disjoint" trains on
    digits 0-4 and tests on 5-9.
    """
    from sklearn.datasets import load_digits  # deferred: sklearn import is slow

    if not 1 <= image_size <= DIGITS_MAX_SIZE:
        raise DatasetError(
            f"image_size must be from 1 to {DIGITS_MAX_SIZE} pixels for digits, got {image_size}"
        )
    _protocol(split)  # fail on a bad name before the work
    data = load_digits()
    items = []
    for i, (image, target) in enumerate(zip(data.images, data.target, strict=True)):
        small = np.round(image * (255.0 / 16.0)).astype(np.uint8)
        large = Image.fromarray(small).resize((image_size, image_size), Image.Resampling.BICUBIC)
        pixels = np.asarray(large, dtype=np.uint8).copy()
        pixels.setflags(write=False)  # Items are frozen; keep their pixels so too
        items.append(Item(key=f"digits/{i:05d}", label=str(int(target)), pixels=pixels))
    return _split_items("digits", items, split, test_fraction, seed)


def image_folder(root: str | Path) -> list[Item]:
    """List the images under `root`, one sub-folder per class (searched recursively).

    Keys are paths relative to `root` (posix), labels the class folder names, order
    sorted by key. Hidden files and folders (".name") are skipped: they are OS or tool
    droppings, not images. A class folder without images is an error rather than a
    silently missing class.
    """
    root = _existing(root, "image folder")
    if not root.is_dir():
        raise DatasetError(f"{root}: expected a folder with one sub-folder per class")
    class_dirs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not class_dirs:
        raise DatasetError(f"{root}: no class sub-folders found (expected root/<class>/<image>)")
    items = []
    for class_dir in class_dirs:
        files = [p for p in class_dir.rglob("*") if is_image_file(p, class_dir)]
        if not files:
            raise DatasetError(
                f"{class_dir}: class folder holds no images ({', '.join(sorted(IMAGE_EXTENSIONS))})"
            )
        items += [Item(key=file_key(p, root), label=class_dir.name, path=p) for p in files]
    return sorted(items, key=lambda item: item.key)


def file_key(path: Path, root: Path) -> str:
    """The key of image file `path` below `root`: its relative path, posix. DatasetError
    when the path is not UTF-8 text (a name written in another encoding): keys and
    paths are stored as text, so the file is named rather than failing the write."""
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        shown = os.fsencode(path).decode("utf-8", "backslashreplace")
        raise DatasetError(
            f"{shown}: the path is not UTF-8 text (keys and paths are stored as text): "
            "rename the file or its folder"
        ) from None
    return path.relative_to(root).as_posix()


def is_image_file(path: Path, root: Path) -> bool:
    """A file below `root` with an image extension and no hidden part in its path."""
    relative = path.relative_to(root)
    return (
        path.suffix.lower() in IMAGE_EXTENSIONS
        and not any(part.startswith(".") for part in relative.parts)
        and path.is_file()
    )


def csv_list(path: str | Path) -> list[Item]:
    """Read a CSV list of images: a header row naming `path` and `label` (and optionally
    `key` and `metadata`, a JSON object as text).

    Column order is free; a column outside `CSV_COLUMNS` is an error naming it (a
    misspelt `metadata` would otherwise be dropped without a word). Relative paths
    resolve against the CSV file's folder; the key defaults to the path as written.
    Listed files are not checked here (they are decoded later).
    """
    path = _existing(path, "CSV list")
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:  # -sig: Excel writes a BOM
            rows = list(csv.reader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise DatasetError(f"{path}: cannot read CSV ({exc})") from None
    shape = ",".join(CSV_COLUMNS[:2]) + "".join(f"[,{name}]" for name in CSV_COLUMNS[2:])
    if not rows:
        raise DatasetError(f"{path}: CSV is empty; expected a header row '{shape}'")
    header = [name.strip().lower() for name in rows[0]]
    missing = [name for name in CSV_COLUMNS[:2] if name not in header]
    if missing:
        raise DatasetError(
            f"{path}: header lacks column(s) {', '.join(missing)}; "
            f"found {rows[0]} (the first row must name {shape})"
        )
    unknown = [rows[0][i].strip() for i, name in enumerate(header) if name not in CSV_COLUMNS]
    if unknown:
        raise DatasetError(
            f"{path}: unknown column(s) {', '.join(unknown)}; a CSV list has the columns "
            f"{shape} (metadata: a JSON object as text); remove the others"
        )
    repeated = sorted({name for name in header if header.count(name) > 1})
    if repeated:
        raise DatasetError(f"{path}: column(s) {', '.join(repeated)} named twice in the header")
    col = {name: header.index(name) for name in CSV_COLUMNS if name in header}
    base = path.parent.absolute()
    items: list[Item] = []
    for line, row in enumerate(rows[1:], start=2):
        if not any(cell.strip() for cell in row):
            continue
        # more cells than the header names (trailing empty ones aside): an unquoted
        # comma in a path or in metadata, which would otherwise be read shifted
        extra = any(cell.strip() for cell in row[len(header) :])
        if len(row) <= max(col.values()) or extra:
            raise DatasetError(
                f"{path}:{line}: row has {len(row)} columns, header has {len(header)}"
                + (" (quote a value holding a comma)" if extra else "")
            )
        written, label = row[col["path"]].strip(), row[col["label"]].strip()
        if not written or not label:
            raise DatasetError(f"{path}:{line}: empty path or label")
        key = row[col["key"]].strip() if "key" in col else ""
        metadata = row[col["metadata"]] if "metadata" in col else ""
        items.append(
            Item(
                key=key or written,
                label=label,
                path=base / written,
                metadata=parse_metadata(metadata, f"{path}:{line}") if metadata.strip() else None,
            )
        )
    if not items:
        raise DatasetError(f"{path}: CSV lists no images")
    _check_unique_keys(items, path)
    return items


def parse_metadata(text: str, where: str) -> dict:
    """`text` as an item's metadata: a JSON object whose integers fit int64 (what an
    index stores and filters on); DatasetError naming `where` otherwise."""
    # deferred: the index.store package loads FAISS, which training never needs
    from vitrieval.index.store.filters import find_outside_int64, int64_message

    try:
        value = parse_json(text)
    except ValueError as exc:
        raise DatasetError(f"{where}: metadata is not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise DatasetError(
            f'{where}: metadata must be a JSON object such as {{"colour": "red"}}, '
            f"got {type(value).__name__}"
        )
    place = find_outside_int64(value, "metadata")
    if place is not None:
        raise DatasetError(f"{where}: {int64_message(place)}")
    return value


def _check_unique_keys(items: list[Item], source: Path) -> None:
    seen: set[str] = set()
    for item in items:
        if item.key in seen:
            raise DatasetError(f"{source}: duplicate key {item.key!r}; keys must be unique")
        seen.add(item.key)


def _existing(path: str | Path, what: str) -> Path:
    path = Path(path).expanduser()
    if not path.exists():
        raise DatasetError(f"{path}: {what} not found")
    return path.absolute()


def cub(root: str | Path) -> Split:
    """CUB-200-2011 (200 bird species) with its class-disjoint split: classes 1-100 train.

    `root` is the folder holding images.txt, image_class_labels.txt, classes.txt and
    images/, or its parent holding CUB_200_2011/. Labels are the class names as
    written in classes.txt (e.g. "001.Black_footed_Albatross").
    """
    layout = "CUB-200-2011 layout (images.txt, image_class_labels.txt, classes.txt, images/)"
    root = _layout_root(root, "images.txt", "CUB_200_2011", layout)
    paths = _id_table(root / "images.txt", layout)
    image_class = _id_table(root / "image_class_labels.txt", layout)
    class_names = _id_table(root / "classes.txt", layout)
    train: list[Item] = []
    test: list[Item] = []
    for image_id, relative in paths.items():
        class_id = image_class.get(image_id, "")
        if not class_id.isdigit() or class_id not in class_names:
            raise DatasetError(
                f"{root}: image {image_id} ({relative}) has no numeric class id listed in "
                "both image_class_labels.txt and classes.txt"
            )
        item = Item(key=relative, label=class_names[class_id], path=root / "images" / relative)
        (train if int(class_id) <= CUB_LAST_TRAIN_CLASS else test).append(item)
    return _standard_split("cub", train, test, root)


def _id_table(path: Path, layout: str) -> dict[str, str]:
    """Read '<id> <value>' lines (the format of CUB's text files) into a dict."""
    table: dict[str, str] = {}
    for line_number, line in enumerate(_read_layout_file(path, layout).splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.strip().split(maxsplit=1)
        if len(parts) != 2:
            raise DatasetError(f"{path}:{line_number}: expected '<id> <value>', got {line!r}")
        table[parts[0]] = parts[1].strip()
    return table


def cars(root: str | Path) -> Split:
    """Cars196 (Stanford Cars) with its class-disjoint split: classes 1-98 train.

    `root` holds cars_annos.mat (struct array `annotations` with `relative_im_path`
    and `class`, optional cell array `class_names`) and the images it names; it may
    also be the .mat file itself. Without `class_names` the label is the class id.
    """
    layout = "Cars196 layout (cars_annos.mat with 'annotations', and car_ims/)"
    root = Path(root).expanduser()
    mat_path = root if root.suffix == ".mat" else root / "cars_annos.mat"
    if not mat_path.is_file():
        raise DatasetError(f"{mat_path}: file not found; expected the {layout}")
    mat_path = mat_path.absolute()
    records, names = _read_cars_mat(mat_path)
    train: list[Item] = []
    test: list[Item] = []
    for record in records:
        try:
            relative, class_id = str(record.relative_im_path), int(getattr(record, "class"))
        except (AttributeError, TypeError, ValueError):
            raise DatasetError(
                f"{mat_path}: annotations need fields relative_im_path and class"
            ) from None
        count = len(names) if names is not None else class_id
        if not 1 <= class_id <= count:
            raise DatasetError(f"{mat_path}: {relative} has class {class_id}, not in 1..{count}")
        label = str(names[class_id - 1]) if names is not None else str(class_id)
        item = Item(key=relative, label=label, path=mat_path.parent / relative)
        (train if class_id <= CARS_LAST_TRAIN_CLASS else test).append(item)
    return _standard_split("cars", train, test, mat_path)


def _read_cars_mat(path: Path) -> tuple[np.ndarray, np.ndarray | None]:
    import scipy.io  # deferred: only Cars needs it

    try:
        mat = scipy.io.loadmat(path, squeeze_me=True, struct_as_record=False)
    except Exception as exc:  # scipy raises many types (IndexError, MatReadError...) on bad files
        raise DatasetError(f"{path}: cannot read MATLAB file ({exc})") from None
    if "annotations" not in mat:
        raise DatasetError(f"{path}: no 'annotations' variable (found {sorted(mat)})")
    # squeeze_me turns a one-element array into a scalar; atleast_1d undoes that.
    records = np.atleast_1d(mat["annotations"])
    names = np.atleast_1d(mat["class_names"]) if "class_names" in mat else None
    return records, names


def sop(root: str | Path) -> Split:
    """Stanford Online Products: Ebay_train.txt is train, Ebay_test.txt is test.

    `root` holds both files (header "image_id class_id super_class_id path") and the
    image folders, or is their parent holding Stanford_Online_Products/. The two
    files share no class, so the split is class-disjoint. Labels are the class ids.
    """
    layout = "Stanford Online Products layout (Ebay_train.txt, Ebay_test.txt)"
    root = _layout_root(root, "Ebay_train.txt", "Stanford_Online_Products", layout)
    train = _read_ebay_list(root / "Ebay_train.txt", root, layout)
    test = _read_ebay_list(root / "Ebay_test.txt", root, layout)
    return _standard_split("sop", train, test, root)


def _read_ebay_list(path: Path, root: Path, layout: str) -> list[Item]:
    lines = [line for line in _read_layout_file(path, layout).splitlines() if line.strip()]
    expected = ["image_id", "class_id", "super_class_id", "path"]
    if not lines or lines[0].split() != expected:
        raise DatasetError(f"{path}: first line must be the header '{' '.join(expected)}'")
    items = []
    for line_number, line in enumerate(lines[1:], start=2):
        parts = line.split(maxsplit=3)
        if len(parts) != 4:
            raise DatasetError(f"{path}:{line_number}: expected 4 fields, got {line!r}")
        relative = parts[3].strip()
        items.append(Item(key=relative, label=parts[1], path=root / relative))
    return items


def _layout_root(root: str | Path, marker: str, subfolder: str, layout: str) -> Path:
    """Accept either the dataset folder itself or its parent holding `subfolder`."""
    root = _existing(root, "dataset folder")
    if (root / marker).is_file():
        return root
    if (root / subfolder / marker).is_file():
        return root / subfolder
    raise DatasetError(
        f"{root / marker}: file not found; expected the {layout} in {root} or {root / subfolder}"
    )


def _read_layout_file(path: Path, layout: str) -> str:
    if not path.is_file():
        raise DatasetError(f"{path}: file not found; expected the {layout}")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"{path}: cannot read ({exc})") from None


def _standard_split(name: str, train: list[Item], test: list[Item], source: Path) -> Split:
    _check_unique_keys(train + test, source)
    if not train or not test:
        raise DatasetError(
            f"{source}: the standard split has {len(train)} train and "
            f"{len(test)} test images; both sides must be non-empty"
        )
    return Split(name=name, train=train, test=test, protocol=DISJOINT)
