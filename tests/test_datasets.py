"""Dataset readers: digits, ImageFolder, CSV lists, and miniature CUB / Cars196 / SOP layouts."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import scipy.io
from PIL import Image
from sklearn.datasets import load_digits

from vitrieval.index.evaluation.datasets import (
    DATASET_NAMES,
    DIGITS_MAX_SIZE,
    DatasetError,
    Item,
    Split,
    cars,
    csv_list,
    cub,
    digits,
    disjoint_split,
    image_folder,
    load_dataset,
    sop,
    stratified_split,
)
from vitrieval.index.runtime.images import ImageDecodeError


def write_image(path: Path, colour: tuple[int, int, int] = (200, 30, 60), size=(6, 4)) -> Path:
    """Write a small solid-colour image; the format follows the suffix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    return path


def keys(items: list[Item]) -> list[str]:
    return [item.key for item in items]


# ---------------------------------------------------------------- digits


@pytest.fixture(scope="module")
def digit_split() -> Split:
    return digits()


def test_digits_stratified_sizes_and_classes(digit_split: Split) -> None:
    assert digit_split.name == "digits/stratified"
    assert digit_split.protocol == "stratified"
    assert len(digit_split.train) + len(digit_split.test) == 1797
    assert digit_split.train_classes() == [str(d) for d in range(10)]
    assert digit_split.test_classes() == [str(d) for d in range(10)]
    assert not set(keys(digit_split.train)) & set(keys(digit_split.test))
    totals = Counter(item.label for item in digit_split.train + digit_split.test)
    tests = Counter(item.label for item in digit_split.test)
    for label, total in totals.items():
        assert abs(tests[label] - 0.3 * total) <= 1, label


def test_digits_split_is_deterministic_per_seed(digit_split: Split) -> None:
    again = digits(seed=0)
    other = digits(seed=1)
    assert keys(again.test) == keys(digit_split.test)
    assert keys(other.test) != keys(digit_split.test)
    assert len(other.test) == len(digit_split.test)  # same per-class counts


def test_digits_disjoint_classes() -> None:
    split = digits("disjoint")
    assert split.protocol == "class-disjoint"
    assert split.train_classes() == ["0", "1", "2", "3", "4"]
    assert split.test_classes() == ["5", "6", "7", "8", "9"]
    assert len(split.train) + len(split.test) == 1797


def test_digits_pixels_match_the_source_digit() -> None:
    source = load_digits()
    split = digits(image_size=32, test_fraction=0.5)
    by_key = {item.key: item for item in split.train + split.test}
    for index in (0, 1, 500, 1796):
        item = by_key[f"digits/{index:05d}"]
        assert item.label == str(source.target[index])
        image = item.open()
        assert image.mode == "RGB" and image.size == (32, 32)
        rgb = np.asarray(image)
        assert (rgb[..., 0] == rgb[..., 1]).all() and (rgb[..., 1] == rgb[..., 2]).all()
        grey = rgb[..., 0].astype(float)
        # Every digit's outer columns are blank in the source, so the upscaled edge is 0.
        assert source.images[index][:, 0].max() == 0
        assert grey[:, 0].max() == 0
        # Averaging 4x4 blocks gives back the 8x8 source on a 0..255 scale.
        blocks = grey.reshape(8, 4, 8, 4).mean(axis=(1, 3))
        expected = source.images[index] * 255 / 16
        assert np.abs(blocks - expected).mean() < 20
        assert np.corrcoef(blocks.ravel(), expected.ravel())[0, 1] > 0.95
        # Interpolated (bicubic), not blocky: far more grey levels than the 17 of the source.
        assert len(np.unique(grey)) > 17


def test_digits_at_native_size_are_the_scaled_source() -> None:
    source = load_digits()
    split = digits(image_size=8)
    item = split.train[5]
    index = int(item.key.split("/")[1])
    expected = np.round(source.images[index] * 255 / 16).astype(np.uint8)
    np.testing.assert_array_equal(item.pixels, expected)
    assert item.pixels.max() == 255  # every digit has full-ink (16) pixels


def test_digits_image_size_and_bad_split() -> None:
    split = digits(image_size=16)
    assert split.train[0].open().size == (16, 16)
    assert split.train[0].pixels.shape == (16, 16)
    with pytest.raises(DatasetError, match="unknown split 'random'"):
        digits("random")
    for size in (0, DIGITS_MAX_SIZE + 1, 100_000):  # all 1,797 are held in memory
        with pytest.raises(DatasetError, match=f"from 1 to {DIGITS_MAX_SIZE} pixels"):
            digits(image_size=size)


# ---------------------------------------------------------------- splits


def make_items(counts: dict[str, int]) -> list[Item]:
    return [Item(key=f"{label}/{i}", label=label) for label, n in counts.items() for i in range(n)]


def test_stratified_split_keeps_every_class_on_both_sides() -> None:
    items = make_items({"a": 2, "b": 3, "c": 10, "solo": 1})
    train, test = stratified_split(items, test_fraction=0.3, seed=0)
    assert Counter(i.label for i in test) == {"a": 1, "b": 1, "c": 3}
    assert Counter(i.label for i in train) == {"a": 1, "b": 2, "c": 7, "solo": 1}
    # Input order is kept and the result does not depend on it.
    assert keys(train) == [k for k in keys(items) if k in set(keys(train))]
    _, test_rev = stratified_split(items[::-1], test_fraction=0.3, seed=0)
    assert set(keys(test_rev)) == set(keys(test))
    # Extreme fractions still leave one item of each class with 2+ on each side.
    _, tiny_test = stratified_split(items, test_fraction=0.01, seed=0)
    assert Counter(i.label for i in tiny_test) == {"a": 1, "b": 1, "c": 1}
    huge_train, _ = stratified_split(items, test_fraction=0.99, seed=0)
    assert Counter(i.label for i in huge_train) == {"a": 1, "b": 1, "c": 1, "solo": 1}
    with pytest.raises(DatasetError, match="test_fraction"):
        stratified_split(items, test_fraction=1.0, seed=0)


def test_disjoint_split_sorts_numbers_naturally() -> None:
    items = make_items({str(n): 2 for n in range(1, 12)})
    train, test = disjoint_split(items)
    assert {i.label for i in train} == {"1", "2", "3", "4", "5", "6"}
    assert {i.label for i in test} == {"7", "8", "9", "10", "11"}
    with pytest.raises(DatasetError, match="at least 2 classes"):
        disjoint_split(make_items({"only": 4}))


def test_item_open_errors() -> None:
    with pytest.raises(ImageDecodeError, match="neither a path nor pixels"):
        Item(key="k", label="l").open()
    with pytest.raises(ImageDecodeError, match="uint8"):
        Item(key="k", label="l", pixels=np.zeros((4, 4), dtype=np.float32)).open()
    colour = Item(key="k", label="l", pixels=np.full((3, 5, 3), (1, 2, 3), dtype=np.uint8))
    assert colour.open().getpixel((4, 2)) == (1, 2, 3)


# ---------------------------------------------------------------- image folder


def test_image_folder_labels_keys_and_order(tmp_path: Path) -> None:
    write_image(tmp_path / "cat" / "b.png")
    write_image(tmp_path / "cat" / "a.JPG")
    write_image(tmp_path / "cat" / "nested" / "c.webp")
    write_image(tmp_path / "dog" / "x.jpeg")
    write_image(tmp_path / "dog" / "y.PNG", colour=(0, 0, 255))
    write_image(tmp_path / "dog" / ".hidden.png")
    (tmp_path / "dog" / "notes.txt").write_text("not an image")
    write_image(tmp_path / "stray.png")  # outside any class folder: ignored
    items = image_folder(tmp_path)
    assert keys(items) == [
        "cat/a.JPG",
        "cat/b.png",
        "cat/nested/c.webp",
        "dog/x.jpeg",
        "dog/y.PNG",
    ]
    assert [i.label for i in items] == ["cat", "cat", "cat", "dog", "dog"]
    assert items[4].path == tmp_path / "dog" / "y.PNG"
    assert items[4].open().getpixel((0, 0)) == (0, 0, 255)


def test_image_folder_errors(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="not found"):
        image_folder(tmp_path / "missing")
    with pytest.raises(DatasetError, match="no class sub-folders"):
        image_folder(tmp_path)
    write_image(tmp_path / "cat" / "a.png")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "readme.txt").write_text("x")
    with pytest.raises(DatasetError, match=r"empty: class folder holds no images"):
        image_folder(tmp_path)


def test_a_file_name_that_is_not_utf8_is_named_not_a_failed_write(tmp_path: Path) -> None:
    from vitrieval.index.pipeline.sources import walk_images

    write_image(tmp_path / "cat" / "a.png")
    odd = os.fsdecode(bytes(tmp_path / "cat") + b"/caf\xe9.png")  # Latin-1, as some tools write
    write_image(Path(odd))
    for walk in (image_folder, walk_images):
        with pytest.raises(DatasetError, match=r"caf\\xe9\.png: the path is not UTF-8"):
            walk(tmp_path)


def test_load_folder_stratified_and_disjoint(tmp_path: Path) -> None:
    for label in ("a", "b", "c"):
        for i in range(4):
            write_image(tmp_path / label / f"{i}.png")
    split = load_dataset("folder", tmp_path, seed=3)
    assert split.name == "folder/stratified"
    assert Counter(i.label for i in split.test) == {"a": 1, "b": 1, "c": 1}
    disjoint = load_dataset("folder", tmp_path, split="disjoint")
    assert disjoint.train_classes() == ["a", "b"] and disjoint.test_classes() == ["c"]


def test_load_folder_all_singletons_is_an_error(tmp_path: Path) -> None:
    write_image(tmp_path / "a" / "0.png")
    write_image(tmp_path / "b" / "0.png")
    with pytest.raises(DatasetError, match="empty side"):
        load_dataset("folder", tmp_path)


# ---------------------------------------------------------------- CSV lists


def test_csv_list_paths_keys_and_columns(tmp_path: Path) -> None:
    write_image(tmp_path / "data" / "imgs" / "one.png", colour=(10, 20, 30))
    absolute = write_image(tmp_path / "elsewhere" / "two.png")
    (tmp_path / "data" / "list.csv").write_text(
        f'label,metadata,path\nred,"{{""a"": 1}}",imgs/one.png\nblue,,{absolute}\n\n',
        encoding="utf-8",
    )
    items = csv_list(tmp_path / "data" / "list.csv")
    assert keys(items) == ["imgs/one.png", str(absolute)]
    assert [i.metadata for i in items] == [{"a": 1}, None]
    assert [i.label for i in items] == ["red", "blue"]
    assert items[0].path == tmp_path / "data" / "imgs" / "one.png"
    assert items[1].path == absolute
    assert items[0].open().getpixel((0, 0)) == (10, 20, 30)


def test_csv_list_key_column_and_missing_files_allowed(tmp_path: Path) -> None:
    (tmp_path / "list.csv").write_text(
        "\ufeffPath, Label ,key\nmissing.png,x,first\nalso-missing.png,y,\n", encoding="utf-8"
    )
    items = csv_list(tmp_path / "list.csv")
    assert keys(items) == ["first", "also-missing.png"]  # empty key falls back to path
    assert [i.label for i in items] == ["x", "y"]
    with pytest.raises(ImageDecodeError, match="cannot read file"):
        items[0].open()


def test_csv_list_errors(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="CSV list not found"):
        csv_list(tmp_path / "nope.csv")
    bad = tmp_path / "bad.csv"
    bad.write_text("file,label\na.png,x\n")
    with pytest.raises(DatasetError, match=r"lacks column.*path"):
        csv_list(bad)
    bad.write_text("a.png,x\nb.png,y\n")  # no header row
    with pytest.raises(DatasetError, match="path, label"):
        csv_list(bad)
    bad.write_text("path,label,key\na.png,x,k\nb.png,y,k\n")
    with pytest.raises(DatasetError, match="duplicate key 'k'"):
        csv_list(bad)
    bad.write_text("path,label\na.png,x\na.png,y\n")
    with pytest.raises(DatasetError, match=r"duplicate key 'a\.png'"):
        csv_list(bad)
    bad.write_text("path,label\na.png\n")
    with pytest.raises(DatasetError, match=r"bad.csv:2: row has 1 columns"):
        csv_list(bad)
    bad.write_text("path,label\nshop,a.png,x\n")  # a path with an unquoted comma: shifted
    with pytest.raises(DatasetError, match=r"bad.csv:2: row has 3 columns.*quote a value"):
        csv_list(bad)
    bad.write_text("path,label,path\na.png,x,b.png\n")
    with pytest.raises(DatasetError, match="column\\(s\\) path named twice"):
        csv_list(bad)
    bad.write_text("path,label,extra\na.png,x,y\n")  # a column nothing reads
    with pytest.raises(DatasetError, match=r"unknown column\(s\) extra"):
        csv_list(bad)
    bad.write_text("path,label\n")
    with pytest.raises(DatasetError, match="lists no images"):
        csv_list(bad)
    deep = "[" * 20_000 + "]" * 20_000  # nested past the parser's depth
    bad.write_text(f'path,label,metadata\na.png,x,"{deep}"\n')
    with pytest.raises(DatasetError, match=r"bad.csv:2: metadata is not JSON"):
        csv_list(bad)


def test_load_csv(tmp_path: Path) -> None:
    rows = "".join(f"{label}/{i}.png,{label}\n" for label in "pq" for i in range(5))
    (tmp_path / "list.csv").write_text("path,label\n" + rows)
    split = load_dataset("csv", tmp_path / "list.csv", test_fraction=0.4)
    assert split.name == "csv/stratified"
    assert Counter(i.label for i in split.test) == {"p": 2, "q": 2}
    assert split.test[0].path.parent.parent == tmp_path


# ---------------------------------------------------------------- CUB-200-2011


def make_cub(root: Path) -> None:
    """Four classes straddling the 100/101 boundary, two images each."""
    classes = {1: "001.Albatross", 100: "100.Pelican", 101: "101.Tern", 200: "200.Warbler"}
    (root / "classes.txt").parent.mkdir(parents=True, exist_ok=True)
    (root / "classes.txt").write_text("".join(f"{c} {n}\n" for c, n in classes.items()))
    images, labels = [], []
    image_id = 0
    for class_id, name in classes.items():
        for j in range(2):
            image_id += 1
            relative = f"{name}/{name}_{j}.jpg"
            write_image(root / "images" / relative, colour=(class_id, j, 0))
            images.append(f"{image_id} {relative}\n")
            labels.append(f"{image_id} {class_id}\n")
    (root / "images.txt").write_text("".join(images))
    (root / "image_class_labels.txt").write_text("".join(labels))


def test_cub_split_labels_and_images(tmp_path: Path) -> None:
    make_cub(tmp_path / "CUB_200_2011")
    for root in (tmp_path, tmp_path / "CUB_200_2011"):  # parent or dataset folder
        split = cub(root)
        assert split.name == "cub" and split.protocol == "class-disjoint"
        assert split.train_classes() == ["001.Albatross", "100.Pelican"]
        assert split.test_classes() == ["101.Tern", "200.Warbler"]
        assert len(split.train) == 4 and len(split.test) == 4
    first = split.test[2]
    assert first.key == "200.Warbler/200.Warbler_0.jpg"
    assert first.path == tmp_path / "CUB_200_2011" / "images" / first.key
    red, green, _ = first.open().getpixel((0, 0))
    assert abs(red - 200) <= 3 and green <= 3  # JPEG is lossy


def test_cub_missing_files(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"images.txt: file not found.*CUB-200-2011"):
        cub(tmp_path)
    make_cub(tmp_path)
    (tmp_path / "image_class_labels.txt").unlink()
    with pytest.raises(DatasetError, match=r"image_class_labels.txt: file not found"):
        cub(tmp_path)
    with pytest.raises(DatasetError, match="not found"):
        cub(tmp_path / "missing")


# ---------------------------------------------------------------- Cars196


def make_cars(root: Path, with_names: bool = True) -> None:
    """Four classes at ids 1, 98, 99 and 196, so the 98/99 boundary is exercised."""
    fields = ["relative_im_path", "bbox_x1", "bbox_y1", "bbox_x2", "bbox_y2", "class", "test"]
    records = []
    for n, class_id in enumerate((1, 98, 99, 196, 196)):
        relative = f"car_ims/{n + 1:06d}.jpg"
        write_image(root / relative, colour=(0, class_id, 0))
        records.append((relative, 0, 0, 5, 3, class_id, n % 2))
    annotations = np.array(records, dtype=[(f, "O") for f in fields])
    variables = {"annotations": annotations}
    if with_names:
        names = [f"Car {i}" for i in range(1, 197)]
        variables["class_names"] = np.array(names, dtype=object)
    scipy.io.savemat(root / "cars_annos.mat", variables)


def test_cars_split_labels_and_images(tmp_path: Path) -> None:
    make_cars(tmp_path)
    split = cars(tmp_path)
    assert split.name == "cars" and split.protocol == "class-disjoint"
    assert split.train_classes() == ["Car 1", "Car 98"]
    assert split.test_classes() == ["Car 196", "Car 99"]
    assert keys(split.train) == ["car_ims/000001.jpg", "car_ims/000002.jpg"]
    assert keys(split.test) == ["car_ims/000003.jpg", "car_ims/000004.jpg", "car_ims/000005.jpg"]
    _, green, _ = split.test[0].open().getpixel((1, 1))
    assert abs(green - 99) <= 3
    assert cars(tmp_path / "cars_annos.mat").test_classes() == split.test_classes()


def test_cars_without_class_names_uses_ids(tmp_path: Path) -> None:
    make_cars(tmp_path, with_names=False)
    split = cars(tmp_path)
    assert split.train_classes() == ["1", "98"]
    assert split.test_classes() == ["196", "99"]


def test_cars_errors(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"cars_annos.mat: file not found.*Cars196"):
        cars(tmp_path)
    scipy.io.savemat(tmp_path / "cars_annos.mat", {"other": np.zeros(3)})
    with pytest.raises(DatasetError, match="no 'annotations' variable"):
        cars(tmp_path)
    (tmp_path / "cars_annos.mat").write_bytes(b"not a mat file at all")
    with pytest.raises(DatasetError, match="cannot read MATLAB file"):
        cars(tmp_path)


# ---------------------------------------------------------------- Stanford Online Products


def make_sop(root: Path) -> None:
    header = "image_id class_id super_class_id path\n"
    train = [
        "1 1 1 bicycle_final/111_0.JPG",
        "2 1 1 bicycle_final/111_1.JPG",
        "3 2 2 chair/222.JPG",
    ]
    test = ["4 3 1 bicycle_final/333_0.JPG", "5 3 1 bicycle_final/333_1.JPG"]
    for line in train + test:
        write_image(root / line.split()[3])
    (root / "Ebay_train.txt").write_text(header + "\n".join(train) + "\n")
    (root / "Ebay_test.txt").write_text(header + "\n".join(test) + "\n")


def test_sop_split_labels_and_images(tmp_path: Path) -> None:
    make_sop(tmp_path / "Stanford_Online_Products")
    split = sop(tmp_path)
    assert split.name == "sop" and split.protocol == "class-disjoint"
    assert split.train_classes() == ["1", "2"] and split.test_classes() == ["3"]
    assert keys(split.train) == [
        "bicycle_final/111_0.JPG",
        "bicycle_final/111_1.JPG",
        "chair/222.JPG",
    ]
    assert split.test[1].path == tmp_path / "Stanford_Online_Products/bicycle_final/333_1.JPG"
    assert split.test[1].open().size == (6, 4)


def test_sop_errors(tmp_path: Path) -> None:
    make_sop(tmp_path)
    (tmp_path / "Ebay_test.txt").unlink()
    with pytest.raises(DatasetError, match=r"Ebay_test.txt: file not found.*Stanford Online"):
        sop(tmp_path)
    (tmp_path / "Ebay_test.txt").write_text("id class path\n1 1 a.jpg\n")
    with pytest.raises(DatasetError, match="first line must be the header"):
        sop(tmp_path)
    (tmp_path / "Ebay_train.txt").unlink()
    with pytest.raises(DatasetError, match=r"Ebay_train.txt: file not found"):
        sop(tmp_path)


# ---------------------------------------------------------------- load_dataset


def test_load_dataset_dispatch(tmp_path: Path) -> None:
    assert DATASET_NAMES == ("digits", "folder", "csv", "cub", "cars", "sop")
    split = load_dataset("digits", split="disjoint", image_size=12)
    assert split.name == "digits/disjoint" and split.test_classes()[0] == "5"
    assert split.train[0].open().size == (12, 12)
    make_sop(tmp_path / "sop")
    assert load_dataset("sop", tmp_path / "sop").test_classes() == ["3"]
    assert load_dataset("sop", tmp_path / "sop", split="disjoint").train_classes() == ["1", "2"]
    make_cub(tmp_path / "cub")
    assert load_dataset("cub", tmp_path / "cub").name == "cub"
    make_cars(tmp_path / "cars")
    assert load_dataset("cars", str(tmp_path / "cars")).name == "cars"


def test_load_dataset_errors(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"unknown dataset 'imagenet'.*digits, folder, csv, cub"):
        load_dataset("imagenet")
    with pytest.raises(DatasetError, match="needs a root"):
        load_dataset("folder")
    make_sop(tmp_path)
    with pytest.raises(DatasetError, match="only has its standard class-disjoint split"):
        load_dataset("sop", tmp_path, split="stratified")
    with pytest.raises(DatasetError, match="unknown split"):
        load_dataset("folder", tmp_path, split="random")
