"""`vitrieval-index bench`: the offline benchmark's command (a labelled gallery and
queries, a dataset, or copy detection on a folder of photos), apart from cli.py."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..evaluation.datasets import DatasetError
from ..rerank import (
    DEFAULT_AQE_ALPHA,
    DEFAULT_AQE_NEIGHBOURS,
    DEFAULT_DBA_ALPHA,
    DEFAULT_DBA_NEIGHBOURS,
    METHODS,
    RerankSettings,
)
from .arguments import Subcommands
from .common import add_runtime_options, embedder_from_args


def add_bench_command(sub: Subcommands) -> None:
    bench = sub.add_parser("bench", help="embed, index and evaluate a labelled set")
    bench.add_argument("--model", required=True)
    bench.add_argument(
        "--dataset",
        help="digits (the default when no other source is given)|cub|cars|sop|folder|csv",
    )
    bench.add_argument("--data-root", help="dataset folder or CSV (all but digits)")
    bench.add_argument(
        "--gallery", help="gallery folder or CSV (path,label[,key]), read as build reads --images"
    )
    bench.add_argument(
        "--queries", help="query folder or CSV; without it, leave-one-out over the gallery"
    )
    bench.add_argument(
        "--labels-from-folders",
        action="store_true",
        help="--gallery/--queries folders: label = top folder name; --copy-detection: "
        "photos in the original's top folder (other versions of it) count as found too",
    )
    bench.add_argument(
        "--copy-detection",
        metavar="DIR",
        help="copy-detection benchmark: every photo below DIR is a gallery item and edited "
        "copies of it (crop, rotate, resize, colour, JPEG) are its queries",
    )
    bench.add_argument(
        "--queries-per-image",
        type=int,
        metavar="N",
        help="copy detection: edited copies per photo (default 5)",
    )
    bench.add_argument(
        "--save-copies",
        metavar="DIR",
        help="copy detection: also write every copy as a PNG file below DIR "
        "(REPORT/ranks.csv names each copy's file, original, rank and score)",
    )
    bench.add_argument(
        "--distractors",
        action="append",
        metavar="DIR",
        help="copy detection: more gallery photos that are nobody's original (repeatable)",
    )
    bench.add_argument("--ks", type=int, nargs="+", help="Recall@K cut-offs")
    bench.add_argument("--factory", default="Flat", help="FAISS index_factory string")
    bench.add_argument(
        "--seed",
        type=int,
        default=0,
        help="split seed (digits, folder, csv); copy seed (--copy-detection)",
    )
    bench.add_argument("--out", required=True, help="report folder")
    _add_rerank_options(bench)
    add_runtime_options(bench)
    bench.set_defaults(handler=_bench)


def _add_rerank_options(bench: argparse.ArgumentParser) -> None:
    bench.add_argument(
        "--rerank",
        action="append",
        choices=(*METHODS, "all"),
        metavar="METHOD",
        help="also measure the exact search re-ranked with METHOD and report it beside "
        "the plain search (repeatable): aqe = alpha query expansion (each query plus its "
        "top --aqe-neighbours hits weighted by similarity^--aqe-alpha, normalised, "
        "searched again); dba = database-side augmentation (every gallery vector plus "
        "its top --dba-neighbours other gallery vectors, weighted alike; plain queries); "
        "dba+aqe = both; all = the three",
    )
    for method, n, alpha in (
        ("aqe", DEFAULT_AQE_NEIGHBOURS, DEFAULT_AQE_ALPHA),
        ("dba", DEFAULT_DBA_NEIGHBOURS, DEFAULT_DBA_ALPHA),
    ):
        bench.add_argument(
            f"--{method}-neighbours",
            type=int,
            metavar="N",
            help=f"--rerank {method}: neighbours averaged in (default {n})",
        )
        bench.add_argument(
            f"--{method}-alpha",
            type=float,
            metavar="A",
            help=f"--rerank {method}: similarity exponent, 0 = plain average (default {alpha:g})",
        )


def _rerank_args(args: argparse.Namespace) -> tuple[tuple[str, ...], RerankSettings]:
    """The re-rankings asked for, in METHODS order, and their n and alpha."""
    asked = set(args.rerank or ())
    methods = METHODS if "all" in asked else tuple(m for m in METHODS if m in asked)
    values = {}
    for method in ("aqe", "dba"):
        for what in ("neighbours", "alpha"):
            value = getattr(args, f"{method}_{what}")
            if value is None:
                continue
            if not any(method in m.split("+") for m in methods):
                raise DatasetError(f"--{method}-{what} needs --rerank {method}, dba+aqe or all")
            if not (value >= 1 if what == "neighbours" else 0 <= value < float("inf")):
                wanted = "at least 1" if what == "neighbours" else "a number >= 0"
                raise DatasetError(f"--{method}-{what} must be {wanted}, got {value:g}")
            values[f"{method}_{what}"] = value
    settings = RerankSettings(**values)
    return methods, settings


def _bench_embedder(args: argparse.Namespace):
    """The benchmark's embedder, once the options that would otherwise fail only after
    every image is embedded (--ks, --out, --factory) are checked."""
    if args.ks and min(args.ks) < 1:
        raise DatasetError(f"--ks must all be >= 1, got {' '.join(map(str, args.ks))}")
    _rerank_args(args)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise DatasetError(f"--out {out} is a file; the report needs a folder")
    embedder = embedder_from_args(Path(args.model), args)
    if args.factory:
        from ..store import new_faiss_index

        new_faiss_index(embedder.dim, args.factory)  # StoreError names the problem
    return embedder


def _bench(args: argparse.Namespace) -> int:
    from ..evaluation.benchmark import (
        DEFAULT_KS,
        SOP_KS,
        format_rerank,
        format_table,
        run_benchmark,
        write_report,
    )
    from ..evaluation.datasets import load_dataset

    if args.copy_detection is not None:
        return _bench_copy_detection(args)
    if args.queries_per_image is not None or args.distractors or args.save_copies:
        raise DatasetError(
            "--queries-per-image, --distractors and --save-copies apply to --copy-detection only"
        )
    if args.gallery:
        sources = [path for path in (args.gallery, args.queries) if path]
        if args.labels_from_folders and all(_is_csv(path) for path in sources):
            raise DatasetError("--labels-from-folders applies to folders; a CSV carries its labels")
        gallery = _labelled_sources(args.gallery, args.labels_from_folders, "--gallery")
        queries = None
        if args.queries:
            queries = _labelled_sources(args.queries, args.labels_from_folders, "--queries")
        name = f"{'csv' if _is_csv(args.gallery) else 'folder'}:{args.gallery}"
    elif args.queries:
        raise DatasetError("--queries needs --gallery")
    elif args.labels_from_folders:
        raise DatasetError("--labels-from-folders applies to --gallery and --queries folders")
    embedder = _bench_embedder(args)
    if not args.gallery:
        # digits are rendered at the model's input size, as training rendered them
        split = load_dataset(
            args.dataset or "digits", args.data_root, seed=args.seed, image_size=embedder.input_size
        )
        gallery, queries, name = split.test, None, split.name
    ks = tuple(args.ks) if args.ks else (SOP_KS if args.dataset == "sop" else DEFAULT_KS)
    methods, settings = _rerank_args(args)
    report = run_benchmark(
        embedder,
        gallery,
        queries,
        ks=ks,
        factory=args.factory,
        name=name,
        rerank=methods,
        rerank_settings=settings,
    )
    write_report(report, Path(args.out))
    print(format_table(report))
    if methods:
        print(format_rerank(report))
    print(f"report written to {Path(args.out) / 'report.json'}")
    return 0


def _is_csv(path: str) -> bool:
    return Path(path).suffix.lower() == ".csv"


def _labelled_sources(path: str, labels_from_folders: bool, flag: str) -> list:
    """A folder or CSV read as `build --images` reads it; every image needs a label.
    `labels_from_folders` applies to a folder (a CSV carries its labels)."""
    from ..pipeline.sources import read_sources

    items = read_sources(path, labels_from_folders and not _is_csv(path), flag)
    if not items:
        raise DatasetError(f"{flag} {path} holds no images")
    unlabelled = [item.key for item in items if item.label is None]
    if unlabelled:
        how = "with a folder per class" if labels_from_folders else "add --labels-from-folders"
        raise DatasetError(
            f"{flag} {path}: {len(unlabelled)} of {len(items)} images have no label "
            f"(e.g. {unlabelled[0]}); the benchmark needs one per image ({how})"
        )
    return items


def _bench_copy_detection(args: argparse.Namespace) -> int:
    from ..evaluation.benchmark import (
        DEFAULT_KS,
        format_rerank,
        format_table,
        run_copy_detection,
        write_report,
    )
    from ..evaluation.copy_detection import DEFAULT_PER_IMAGE, read_photos

    others = {
        "--gallery": args.gallery,
        "--queries": args.queries,
        "--dataset": args.dataset,
        "--data-root": args.data_root,
    }
    clash = [flag for flag, value in others.items() if value is not None]
    if clash:
        raise DatasetError(
            f"--copy-detection cannot be combined with {', '.join(clash)}: "
            "it makes its own gallery and queries from the photos"
        )
    per_image = DEFAULT_PER_IMAGE if args.queries_per_image is None else args.queries_per_image
    if per_image < 1:
        raise DatasetError(f"--queries-per-image must be at least 1, got {per_image}")
    if args.seed < 0:
        raise DatasetError(f"--seed must be >= 0 for --copy-detection, got {args.seed}")
    photos = read_photos(args.copy_detection, labels_from_folders=args.labels_from_folders)
    distractors = []
    for folder in args.distractors or []:
        distractors += read_photos(folder, "--distractors")
    shared = {p.path.resolve() for p in photos} & {d.path.resolve() for d in distractors}
    if shared:
        raise DatasetError(
            f"{len(shared)} distractor file(s) are also photos (e.g. {min(shared)}); "
            "a distractor must be nobody's original"
        )
    save_copies = _save_copies_folder(args.save_copies, args.copy_detection)
    embedder = _bench_embedder(args)
    methods, settings = _rerank_args(args)
    out = Path(args.out)
    report = run_copy_detection(
        embedder,
        photos,
        distractors,
        per_image=per_image,
        seed=args.seed,
        ks=tuple(args.ks) if args.ks else DEFAULT_KS,
        factory=args.factory,
        name=f"copy-detection:{args.copy_detection}",
        relevant="label" if args.labels_from_folders else "original",
        rerank=methods,
        rerank_settings=settings,
        save_copies=save_copies,
        ranks_path=out / "ranks.csv",
    )
    write_report(report, out)
    for failure in report["unreadable"][:10]:
        print(f"  skipped {failure['key']}: {failure['reason']}")
    if len(report["unreadable"]) > 10:
        print(f"  ... and {len(report['unreadable']) - 10} more")
    # the times first: the table, the re-ranked rows and the summary end the output
    print(
        f"decoding {report['copies_photo_decodes']} photos for their copies took "
        f"{report['copies_decode_seconds']:.2f} s, editing "
        f"{report['copies_edit_seconds']:.2f} s, saving {report['copies_save_seconds']:.2f} s "
        f"(summed over decoding threads); the model {report['gallery_model_seconds']:.2f} s "
        f"on the gallery and {report['copies_model_seconds']:.2f} s on the copies"
    )
    print(format_table(report))
    for kind, part in report["by_transform"].items():
        print(
            f"  with {kind:<7} recall@1 {part['recall@1']:.4f}  map {part['map']:.4f}  "
            f"({part['n_queries']} queries)"
        )
    if methods:
        print(format_rerank(report))
    siblings = (
        f" (a photo of the original's folder counts as found; {report['n_labels']} labels)"
        if args.labels_from_folders
        else ""
    )
    first = f"recall@{min(args.ks or DEFAULT_KS)}"  # --ks may leave 1 out
    print(
        f"copy detection: {report['n_queries']} copies of {report['n_originals']} photos "
        f"against {report['n_gallery']} gallery images: {first} {report[first]:.4f}, "
        f"map {report['map']:.4f}{siblings}; report written to {out / 'report.json'}"
    )
    return 0


def _save_copies_folder(save: str | None, photos: str) -> Path | None:
    """--save-copies as a folder, refused when it is a file or lies below the photos
    (the copies would be photos of the next run)."""
    if save is None:
        return None
    folder = Path(save)
    if folder.exists() and not folder.is_dir():
        raise DatasetError(f"--save-copies {folder} is a file; the copies need a folder")
    if folder.resolve().is_relative_to(Path(photos).resolve()):
        raise DatasetError(
            f"--save-copies {folder} is inside --copy-detection {photos}: "
            "the copies would become photos of the next run; choose a folder outside it"
        )
    return folder
