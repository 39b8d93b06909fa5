"""Near-duplicate groups: vitrieval's models against perceptual hashes, and `duplicates`
over a million vectors.

Part 1, the photos. Every photograph scikit-image and scikit-learn ship (19, their
short side scaled to 256 px) gets 12 edited copies (`make_copy`, the copy-detection
edits): 2 of each single edit kind (crop, rotate, resize, colour, jpeg) and 2 with the
benchmark's composite plan (2 to 4 edits). The 247 pictures are mixed with
`--distractors` of scikit-learn's digits (upscaled to 64 px): the catalogue holds 19
true groups of 13. Each method lists its groups:

- vitrieval's models, through the product: `vitrieval-index build`, then `calibrate
  --precision 0.99` (copies of the catalogue's own images, other edits than the
  planted ones), then `duplicates --precision 0.99`. The models: the untrained `tiny`
  encoder as pretraining starts it, the `tiny` digits model (`vitrieval-train fit
  --dataset digits`), and DenseCL++ (random dense negatives) pretrained without labels
  on tiles of the same photos (bench/densecl_experiment.py's catalogue);
- `imagehash`'s pHash and dHash (64 bits), pairs at Hamming distance <= `--hash-distance`
  (10, imagededup's default), grouped by single linkage like `duplicates` groups.

Scored per method: pair precision and recall (the pairs inside predicted groups
against the pairs inside true groups), the share of predicted groups that are pure,
the recall of each edit kind (a copy is found when it lands in its original's group),
and the seconds per image (embedding or hashing, plus the grouping); and, as a second
table, the same at each method's best pair F1 over its thresholds, chosen knowing the
truth (what the method could do, where the first table is what a user gets).

Part 2, scale (`--vectors N`, default 1,000,000): N random unit vectors (384-d) with
1% of them planted as near copies of others (cosine about 0.97), in an `IVF4096,Flat`
store (nprobe 16); `find_duplicates` at threshold 0.9 in a child process: its time,
peak RSS, and the planted pairs found.

    .venv/bin/pip install -e '.[bench]'   # imagehash, this benchmark's own dependency
    .venv/bin/python bench/duplicates.py --out runs/duplicates [--vectors 1000000]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from densecl_experiment import (
    METHODS,
    bin_path,
    make_catalogue,
    random_init_run,
    run_logged,
    shipped_photos,
)
from machine import describe, load_average
from PIL import Image

from vitrieval.index.duplicates import single_linkage
from vitrieval.index.evaluation.copy_detection import KINDS, make_copy

COPY_PLAN: tuple[tuple[str, ...] | None, ...] = (
    *((kind,) for kind in KINDS for _ in range(2)),
    None,
    None,
)
"""Each photo's copies: two of each single kind, two of the composite plan (None)."""
SEED = 11  # the planted copies' edits; calibration draws its own (seed 0)
PRECISION = 0.99


# -- the catalogue -------------------------------------------------------------------


def make_photo_catalogue(folder: Path, distractors: int) -> dict[str, tuple[str, str]]:
    """Write originals, copies and distractors as PNG files; returns key -> (true group,
    edit kind) for every planted picture ("original" for the photo itself)."""
    from sklearn.datasets import load_digits

    folder.mkdir(parents=True, exist_ok=True)
    truth: dict[str, tuple[str, str]] = {}
    for name, array in shipped_photos().items():
        photo = Image.fromarray(array)
        scale = 256 / min(photo.size)
        photo = photo.resize(
            (round(photo.width * scale), round(photo.height * scale)), Image.Resampling.BICUBIC
        )
        photo.save(folder / f"{name}.png")
        truth[f"{name}.png"] = (name, "original")
        for q, kinds in enumerate(COPY_PLAN):
            copy, _ = make_copy(photo, SEED, name, q, kinds)
            key = f"{name}.copy{q}.png"
            copy.save(folder / key)
            truth[key] = (name, kinds[0] if kinds else "composite")
    digits = load_digits().images[:distractors]
    for i, image in enumerate(digits):
        pixels = (image * (255 / 16)).astype(np.uint8)
        Image.fromarray(pixels).resize((64, 64), Image.Resampling.BICUBIC).convert("RGB").save(
            folder / f"digit{i:04d}.png"
        )
    return truth


# -- scoring -------------------------------------------------------------------------


def components(pairs: Iterable[tuple[str, str]]) -> list[list[str]]:
    """Single-linkage groups (size >= 2) of `pairs`, as `duplicates` groups them."""
    groups: dict[str, list[str]] = {}
    for key, root in single_linkage(pairs).items():
        groups.setdefault(root, []).append(key)
    return [sorted(g) for g in groups.values() if len(g) > 1]


def score(groups: list[list[str]], truth: dict[str, tuple[str, str]]) -> dict:
    """Pair precision and recall, pure groups, and recall per edit kind (module doc)."""
    group_of = {key: n for n, members in enumerate(groups) for key in members}
    true_group = {key: g for key, (g, _) in truth.items()}
    predicted = sum(len(g) * (len(g) - 1) // 2 for g in groups)
    correct = sum(
        1
        for members in groups
        for i, a in enumerate(members)
        for b in members[i + 1 :]
        if a in true_group and true_group.get(b) == true_group[a]
    )
    sizes: dict[str, int] = {}
    for g in true_group.values():
        sizes[g] = sizes.get(g, 0) + 1
    true_pairs = sum(n * (n - 1) // 2 for n in sizes.values())
    originals = {g: key for key, (g, kind) in truth.items() if kind == "original"}
    per_kind: dict[str, list[bool]] = {}
    for key, (g, kind) in truth.items():
        if kind != "original":
            home = group_of.get(originals[g])
            per_kind.setdefault(kind, []).append(home is not None and group_of.get(key) == home)
    pure = sum(1 for members in groups if len({true_group.get(k, k) for k in members}) == 1)
    return {
        "groups": len(groups),
        "pure_groups": pure / len(groups) if groups else 1.0,
        "pair_precision": correct / predicted if predicted else 1.0,
        "pair_recall": correct / true_pairs,
        "recall_by_kind": {kind: float(np.mean(found)) for kind, found in per_kind.items()},
    }


# -- the methods ---------------------------------------------------------------------


def hash_similarity(folder: Path, kind: str) -> tuple[list[str], np.ndarray, float]:
    """Every picture's key, minus the Hamming distance between every two hashes (so
    that, as for scores, higher is closer), and the seconds hashing took."""
    import imagehash

    function = {"phash": imagehash.phash, "dhash": imagehash.dhash}[kind]
    started = time.perf_counter()
    keys = sorted(p.name for p in folder.glob("*.png"))
    bits = []
    for key in keys:
        with Image.open(folder / key) as image:
            bits.append(function(image).hash.ravel())
    codes = np.asarray(bits, dtype=np.uint8)  # (n, 64) bits
    hamming = (codes[:, None, :] != codes[None, :, :]).sum(axis=2)  # all pairs: 10^5 here
    return keys, -hamming.astype(np.float64), time.perf_counter() - started


def groups_at(keys: list[str], similarity: np.ndarray, threshold: float) -> list[list[str]]:
    rows, cols = np.nonzero(np.triu(similarity >= threshold, k=1))
    return components((keys[a], keys[b]) for a, b in zip(rows, cols, strict=True))


def best_f1(
    keys: list[str], similarity: np.ndarray, truth: dict, thresholds: Iterable[float]
) -> dict:
    """The threshold with the best pair F1, chosen knowing the truth: what the method
    can do at its best, not what a user without labels would pick."""
    best: dict = {"f1": -1.0}
    for threshold in thresholds:
        found = score(groups_at(keys, similarity, threshold), truth)
        p, r = found["pair_precision"], found["pair_recall"]
        f1 = 2 * p * r / (p + r) if p + r else 0.0
        if f1 > best["f1"]:
            best = found | {"f1": f1, "threshold": float(threshold)}
    return best


def model_similarity(index: Path) -> tuple[list[str], np.ndarray]:
    from vitrieval.index.store import IndexStore

    with IndexStore.open(index) as store:
        keys = sorted(store.keys())
        vectors = np.stack([store.get(key).vector for key in keys]).astype(np.float64)
    return keys, vectors @ vectors.T


def model_groups(model: Path, folder: Path, work: Path) -> tuple[list[list[str]], float, dict]:
    """Build, calibrate and list duplicates with the CLI; the groups, the seconds per
    image of build + duplicates, and the calibration's level."""
    index = work / "index"
    seconds = run_logged(
        [bin_path("vitrieval-index"), "build", "--model", str(model), "--images", str(folder),
         "--out", str(index)], work / "build.log",
    )  # fmt: skip
    run_logged(
        [bin_path("vitrieval-index"), "calibrate", str(index), "--precision", str(PRECISION),
         "--images", "200", "--copies", "5"], work / "calibrate.log",
    )  # fmt: skip
    out = work / "groups.json"
    seconds += run_logged(
        [bin_path("vitrieval-index"), "duplicates", str(index), "--precision", str(PRECISION),
         "--out", str(out)], work / "duplicates.log",
    )  # fmt: skip
    manifest = json.loads((index / "manifest.json").read_text())
    calibration = manifest["calibration"]
    level = next(lv for lv in calibration["levels"] if lv["precision"] == PRECISION)
    groups = [g["keys"] for g in json.loads(out.read_text())]
    return groups, seconds, level


def train_models(out: Path, epochs: int) -> dict[str, Path]:
    """The three models (module doc), exported; reused when already there."""
    models = {}
    tiles = out / "tiles"
    if not tiles.is_dir():
        make_catalogue(tiles)
    runs = {
        "untrained tiny": None,
        "digits tiny": [bin_path("vitrieval-train"), "fit", "--dataset", "digits", "--preset",
                        "tiny", "--epochs", "20"],
        "DenseCL++ tiny (photo tiles)": [bin_path("vitrieval-train"), "pretrain",
                                         *METHODS["densecl++ random"], "--images", str(tiles),
                                         "--preset", "tiny", "--epochs", str(epochs)],
    }  # fmt: skip
    for name, command in runs.items():
        folder = out / "models" / name.split()[0].lower().replace("+", "p")
        model = folder / "model.onnx"
        if not model.is_file():
            if command is None:
                random_init_run(folder, 0, argparse.Namespace(catalogue=tiles, preset="tiny"))
            else:
                folder.mkdir(parents=True, exist_ok=True)
                run_logged([*command, "--out", str(folder)], folder.with_suffix(".train.log"))
            export = [bin_path("vitrieval-train"), "export", "--run", str(folder)]
            run_logged([*export, "--out", str(model)], folder.with_suffix(".export.log"))
        models[name] = model
    return models


# -- part 2: scale -------------------------------------------------------------------


def scale_build(work: Path, n: int) -> dict:
    """Child 1: the store of N vectors, the last 1% near copies of first-chunk rows."""
    from vitrieval.index.store import IndexStore

    rng = np.random.default_rng(0)
    planted = n // 100
    chunk = min(200_000, n - planted)
    store = IndexStore.create(work / "index", dim=384, factory="IVF4096,Flat")
    started = time.perf_counter()
    first = None
    for start in range(0, n - planted, chunk):
        x = rng.standard_normal((min(chunk, n - planted - start), 384)).astype(np.float32)
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        if first is None:
            first = x
            store.train(x)
        store.add([f"v{i:08d}" for i in range(start, start + len(x))], x)
    sources = rng.choice(len(first), planted, replace=False)
    # noise of norm ~0.25 on a unit vector: cosine ~0.97 with the source
    copies = first[sources] + (0.25 / np.sqrt(384)) * rng.standard_normal((planted, 384))
    copies = (copies / np.linalg.norm(copies, axis=1, keepdims=True)).astype(np.float32)
    store.add([f"v{i:08d}" for i in range(n - planted, n)], copies)
    store.set_search_params(nprobe=16)
    store.save()
    store.close()
    return {"vectors": n, "planted_pairs": planted, "build_s": time.perf_counter() - started}


def scale_find(work: Path) -> dict:
    """Child 2: `find_duplicates` at 0.9 over the saved store; time and peak RSS."""
    from vitrieval.index.duplicates import find_duplicates
    from vitrieval.index.store import IndexStore

    store = IndexStore.open(work / "index")
    opened = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    started = time.perf_counter()
    groups = find_duplicates(store, 0.9)
    return {
        "duplicates_s": time.perf_counter() - started,
        "groups": len(groups),
        "pairs_found": sum(len(g.pairs) for g in groups),
        "largest_group": max((len(g.keys) for g in groups), default=0),
        "peak_rss_mb_open": opened,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def child(*arguments: str) -> dict:
    done = subprocess.run([sys.executable, __file__, *arguments], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stderr)
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- main ----------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/duplicates"))
    parser.add_argument("--distractors", type=int, default=400)
    parser.add_argument("--hash-distance", type=int, default=10)
    parser.add_argument("--pretrain-epochs", type=int, default=100)
    parser.add_argument("--vectors", type=int, default=1_000_000, help="0: skip part 2")
    parser.add_argument("--skip-photos", action="store_true")
    parser.add_argument("--build-child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--find-child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.build_child or args.find_child:
        work = args.build_child or args.find_child
        found = scale_build(work, args.vectors) if args.build_child else scale_find(work)
        print(json.dumps(found))
        return
    try:
        import imagehash
    except ImportError:
        raise SystemExit(
            "this benchmark needs imagehash: .venv/bin/pip install imagehash"
        ) from None
    print(json.dumps(describe(imagehash=imagehash.__version__, load=load_average())), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    if not args.skip_photos:
        folder = args.out / "catalogue"
        truth = make_photo_catalogue(folder, args.distractors)
        count = len(list(folder.glob("*.png")))
        true_groups = len({group for group, _ in truth.values()})
        print(f"catalogue: {count} pictures, {len(truth)} in {true_groups} true groups")
        for kind in ("phash", "dhash"):
            keys, similarity, seconds = hash_similarity(folder, kind)
            name = f"{kind} <= {args.hash_distance}"
            groups = groups_at(keys, similarity, -args.hash_distance)
            results[name] = score(groups, truth) | {
                "ms_per_image": 1e3 * seconds / count, "load": load_average(),
                "best_f1": best_f1(keys, similarity, truth, range(0, -33, -1))}  # fmt: skip
            print(kind, json.dumps(results[name]), flush=True)
        for name, model in train_models(args.out, args.pretrain_epochs).items():
            work = args.out / "runs" / model.parent.name
            if work.exists():
                subprocess.run(["rm", "-rf", str(work)], check=True)
            work.mkdir(parents=True)
            groups, seconds, level = model_groups(model, folder, work)
            keys, similarity = model_similarity(work / "index")
            candidates = np.unique(np.quantile(similarity, np.linspace(0.9, 1.0, 401)))
            results[name] = score(groups, truth) | {
                "ms_per_image": 1e3 * seconds / count, "threshold": level["threshold"],
                "calibrated_precision": level["measured_precision"],
                "calibrated_recall": level["recall"], "load": load_average(),
                "best_f1": best_f1(keys, similarity, truth, candidates)}  # fmt: skip
            print(name, json.dumps(results[name]), flush=True)
        print_table(results)
    if args.vectors:
        work = args.out / "scale"
        subprocess.run(["rm", "-rf", str(work)], check=True)
        work.mkdir(parents=True)
        built = child("--build-child", str(work), "--vectors", str(args.vectors))
        results["scale"] = built | child("--find-child", str(work)) | {"load": load_average()}
        print("scale", json.dumps(results["scale"]), flush=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")


def print_table(results: dict) -> None:
    kinds = [*KINDS, "composite"]
    head = ("| method | threshold | pair precision | pair recall | pure groups | "
            + " | ".join(f"recall {k}" for k in kinds))  # fmt: skip
    print(f"\n{head} | ms / image |\n" + "|---" * (6 + len(kinds)) + "|")
    for name, r in results.items():
        threshold = f"{r['threshold']:.4f}" if "threshold" in r else name.split()[-1] + " bits"
        print(row(name, threshold, r, kinds, f"{r['ms_per_image']:.1f}"))
    print(f"\nAt the best pair F1 (threshold chosen knowing the truth)\n\n{head} | F1 |")
    print("|---" * (6 + len(kinds)) + "|")
    for name, r in results.items():
        best = r["best_f1"]
        hashed = "threshold" not in r
        threshold = f"{-best['threshold']:.0f} bits" if hashed else f"{best['threshold']:.4f}"
        print(row(name, threshold, best, kinds, f"{best['f1']:.3f}"))


def row(name: str, threshold: str, r: dict, kinds: list[str], last: str) -> str:
    rates = [r["pair_precision"], r["pair_recall"], r["pure_groups"]]
    per_kind = [f"{r['recall_by_kind'][k]:.2f}" for k in kinds]
    cells = [name, threshold, *(f"{v:.3f}" for v in rates), *per_kind, last]
    return "| " + " | ".join(cells) + " |"


if __name__ == "__main__":
    main()
