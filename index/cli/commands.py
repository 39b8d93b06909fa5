"""`vitrieval-index`: build, update, inspect, search and benchmark image indexes.

Every failure a user can cause (a missing path, a corrupt or foreign index, a model
with another fingerprint) ends with one line on stderr and exit status 2; no
traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from ..evaluation.datasets import DatasetError
from ..runtime.images import ImageDecodeError
from ..runtime.model_metadata import ModelMetadataError
from ..tuning import check_target
from .add import add_add_command
from .bench import add_bench_command
from .common import (
    add_ray_options,
    add_runtime_options,
    add_verbose_option,
    checked_save_every,
    embedder_from_args,
    open_index_with_model,
)
from .configure import (
    add_configure_command,
    add_index_settings,
    apply_index_settings,
    wants_settings,
)
from .duplicates import add_calibrate_command, add_duplicates_command
from .export_dataset import add_export_dataset_command
from .promote import add_promote_command
from .recommend import add_recommend_command
from .reembed import add_reembed_command
from .search import add_search_command
from .shards import (
    add_shards_option,
    build_sharded_from_args,
    check_shards_option,
    existing_shards,
    wants_shards,
)
from .snapshot import add_snapshot_commands
from .tune import add_target_recall_option, add_tune_command, tune_index

USER_ERRORS: tuple[type[Exception], ...] = (
    DatasetError,
    ImageDecodeError,
    ModelMetadataError,
    OSError,  # unreadable or unwritable paths the user named
    ValueError,
)


def _build(args: argparse.Namespace, items: list | None = None) -> int:
    """`build` (and `add`, which passes `items` when it was given one image)."""
    from ..pipeline.sources import read_sources

    if items is None and (args.images is None) == (getattr(args, "embeddings", None) is None):
        raise ValueError(
            "build needs exactly one of --images and --embeddings: image files to embed, "
            "or a folder of embeddings (from `vitrieval-index embed`, for one)"
        )
    check_shards_option(args)
    checked_save_every(args.save_every)  # before the build: its value is read later
    if getattr(args, "target_recall", None) is not None:
        check_target(args.target_recall)  # before the build, not after it
    if getattr(args, "ray", None) and (
        args.images is not None or not wants_shards(args, Path(args.out))
    ):
        raise ValueError("--ray builds the shards of a sharded index: --embeddings EMB --shards N")
    dba = getattr(args, "dba", None)  # `add` shares this path, without the settings
    if dba is not None and args.images is None and wants_shards(args, Path(args.out)):
        raise ValueError("--dba needs one store: a sharded index has no DBA vectors")
    if items is not None:
        code = _build_images(args, items)
    elif args.images is None:
        code = _build_embeddings(args)
    else:
        skipped: list[Path] = []
        items = read_sources(args.images, args.labels_from_folders, skipped=skipped)
        code = _build_images(args, items, skipped)
    if code == 0 and wants_settings(args):
        print(apply_index_settings(args, Path(args.out)))
    if code == 0 and getattr(args, "target_recall", None) is not None:
        print(tune_index(Path(args.out), args.target_recall))
    return code


def _build_images(args: argparse.Namespace, items: list, skipped: list | None = None) -> int:
    from ..pipeline.build_index import build_index
    from ..pipeline.sources import skipped_note

    out = Path(args.out)
    budget = _memory_budget(args)
    store = None
    if args.model:
        model = Path(args.model)
    else:
        store, model = open_index_with_model(out, None)
    embedder = embedder_from_args(model, args)
    report = build_index(
        items,
        out,
        embedder,
        factory=_factory(args, out, len(items), embedder.dim, budget),
        save_every=checked_save_every(args.save_every, 2048),
        store=store,
    )
    for failure in report.failed[:10]:
        print(f"  skipped {failure['key']}: {failure['reason']}")
    if len(report.failed) > 10:
        print(f"  ... and {len(report.failed) - 10} more")
    print(report.summary(out) + skipped_note(skipped or []))
    return 0


def _build_embeddings(args: argparse.Namespace) -> int:
    """`build --embeddings EMB`: the index of an embeddings folder, in bounded memory."""
    from ..pipeline.build_index import build_from_embeddings
    from ..pipeline.embeddings_folder import EmbeddingsError, EmbeddingsFolder
    from ..shards import is_index
    from ..store import IndexStore, StoreError

    if args.labels_from_folders:
        raise EmbeddingsError(
            "--labels-from-folders applies to --images; an embeddings folder carries its labels"
        )
    folder = EmbeddingsFolder.open(args.embeddings)
    out = Path(args.out)
    budget = _memory_budget(args)
    exists = is_index(out)
    model = Path(args.model) if args.model else folder.model
    if args.model or not exists:
        _check_embeddings_model(model, folder, given=bool(args.model))
    if wants_shards(args, out):
        keep = existing_shards(out) is not None and args.factory in (None, "auto")
        factory = None if keep else _factory(args, out, folder.count, folder.dim, budget)
        return build_sharded_from_args(args, folder, model, factory)
    if exists:
        store = IndexStore.open(out, fingerprint=folder.fingerprint, dim=folder.dim)
        if args.factory not in (None, "auto") and args.factory != store.factory:
            raise StoreError(
                f"{out} was built with factory {store.factory!r}, not {args.factory!r}"
            )
    else:
        store = IndexStore.create(
            out,
            dim=folder.dim,
            factory=_factory(args, out, folder.count, folder.dim, budget) or "Flat",
            fingerprint=folder.fingerprint,
            model_path=model,
        )
    save_every = checked_save_every(args.save_every, 1_000_000)
    report = build_from_embeddings(folder, out, store, save_every=save_every)
    print(report.summary(out, "embeddings", f" from {folder.folder}"))
    return 0


def _check_embeddings_model(model: Path | None, folder, *, given: bool) -> None:
    """The model an index of `folder` keeps must be the one that made its vectors."""
    from ..pipeline.embeddings_folder import META_FILE, EmbeddingsError
    from ..runtime.model_metadata import read_model_metadata

    meta_file = folder.folder / META_FILE
    if model is None:
        raise EmbeddingsError(
            f"{meta_file} names no model file: pass --model, the model that made the "
            f"embeddings (fingerprint {folder.fingerprint[:12]}); the index keeps a copy of it"
        )
    if not given and not model.is_file():
        raise EmbeddingsError(
            f"{meta_file} names the model {model}, which is not there: pass --model"
        )
    meta = read_model_metadata(model)
    if meta.fingerprint != folder.fingerprint:
        flag = f"--model {model}" if given else f"the model {model} (named in {meta_file})"
        raise EmbeddingsError(
            f"{flag} has fingerprint {meta.fingerprint[:12]}, but {folder.folder} was embedded "
            f"with {folder.fingerprint[:12]}: pass the model that made the embeddings, or "
            "embed the images again with this one"
        )
    if meta.embedding_dim != folder.dim:
        raise EmbeddingsError(
            f"{folder.folder} holds {folder.dim}-d embeddings, but {model} embeds "
            f"{meta.embedding_dim}-d vectors"
        )


def _embed(args: argparse.Namespace) -> int:
    from ..pipeline.embed_folder import embed_to_folder
    from ..pipeline.embeddings_folder import ERRORS_FILE, EmbeddingsError
    from ..pipeline.sources import read_sources, skipped_note

    if args.part_size is not None and args.part_size < 1:
        raise EmbeddingsError(f"--part-size must be at least 1, got {args.part_size}")
    skipped: list[Path] = []
    items = read_sources(args.images, args.labels_from_folders, skipped=skipped)
    out = Path(args.out)
    if args.ray:  # the same folder, its parts embedded by actors on a Ray cluster
        from vitrieval.distributed.embed import embed_from_args

        report = embed_from_args(items, out, args)
    else:
        report = embed_to_folder(
            items,
            out,
            embedder_from_args(Path(args.model), args),
            part_size=args.part_size,
            source=str(args.images),
        )
    for failure in report.failed[:10]:
        print(f"  skipped {failure['key']}: {failure['reason']}")
    if len(report.failed) > 10:
        print(f"  ... and {len(report.failed) - 10} more (all in {out / ERRORS_FILE})")
    print(report.summary(out) + skipped_note(skipped))
    return 0


def _memory_budget(args: argparse.Namespace) -> int | None:
    """--memory-budget in bytes (None without one); it chooses among factories."""
    from ..factory import AUTO, parse_bytes

    text = getattr(args, "memory_budget", None)
    if text is None:
        return None
    if args.factory not in (None, AUTO):
        raise ValueError(
            f"--memory-budget chooses the factory; it cannot be combined with "
            f"--factory {args.factory}"
        )
    return parse_bytes(text)


def _factory(
    args: argparse.Namespace, out: Path, n: int, dim: int, budget: int | None
) -> str | None:
    """The factory to create `out` with: `--factory auto` (or none) chooses one for n
    vectors (and `--target-recall`) and prints the choice; an existing index keeps its
    own (None), an explicit one is checked against it by the build."""
    from ..factory import AUTO, choose_factory

    factory = args.factory
    if factory not in (None, AUTO):
        return factory
    if (out / "manifest.json").exists():
        return None
    choice = choose_factory(n, dim, budget, getattr(args, "target_recall", None))
    print(choice.summary())
    return choice.factory


def _remove(args: argparse.Namespace) -> int:
    """Remove the keys that are present; name the missing ones and exit 2 if any."""
    from ..shards import open_index

    keys = list(args.keys)
    if args.keys_from:
        lines = Path(args.keys_from).read_text().splitlines()
        keys += [line.strip() for line in lines if line.strip()]
    keys = list(dict.fromkeys(keys))
    if not keys:
        raise ValueError("no keys given: name them (KEY...) or list them in --keys-from FILE")
    store = open_index(args.index)
    present = [key for key in keys if key in store]
    missing = [key for key in keys if key not in store]
    if present:
        store.remove(present)
        store.save()
    names = f": {_some(present)}" if present else ""
    print(
        f"removed {len(present)} of {len(keys)} keys{names}; {args.index} holds {len(store)} items"
    )
    if missing:
        print(
            f"vitrieval-index remove: error: {len(missing)} of {len(keys)} keys not in "
            f"{args.index}: {_some(missing)}",
            file=sys.stderr,
        )
        return 2
    return 0


def _some(keys: Sequence[str], shown: int = 10) -> str:
    """Up to `shown` keys, comma-separated, and how many more there are."""
    listed = ", ".join(keys[:shown])
    return f"{listed} and {len(keys) - shown} more" if len(keys) > shown else listed


def _info(args: argparse.Namespace) -> int:
    from ..shards import open_index

    info = open_index(args.index).info()
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    files = info.pop("files")
    info["bytes_on_disk"] = f"{info['bytes_on_disk']:,}"
    width = max(len(k) for k in info)
    for key, value in info.items():
        print(f"{key.ljust(width)}  {_info_value(value)}")
    print(f"{'files'.ljust(width)}  {len(files)} (size, sha256)")
    name_width = max((len(name) for name in files), default=0)
    size_width = max((len(f"{entry['bytes']:,}") for entry in files.values()), default=0)
    for name, entry in files.items():
        size = f"{entry['bytes']:,}".rjust(size_width)
        print(f"  {name.ljust(name_width)}  {size} bytes  {entry['sha256']}")
    return 0


def _info_value(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items()) or "-"
    if isinstance(value, list):  # the segments: one "number: rows, live, deleted" each
        return "; ".join(_info_value(v) for v in value) or "-"
    return str(value)


def _verify(args: argparse.Namespace) -> int:
    from ..shards import open_index
    from ..store import StoreError

    if args.repair:
        _repair_journals(args.index)
    with open_index(args.index, verify=True) as store:  # StoreError: one line, exit 2
        info = store.info()
        stores = getattr(store, "shards", [store])  # a sharded index: each shard's items
        legacy = [found for s in stores for found in s.legacy_items()]
        # a file changed since the checksums were read: the scan took it out of service
        damaged = store.damaged_segments()  # a sharded index's name their shards
    if damaged:
        number, reason = damaged[0]
        raise StoreError(f"{args.index}: segment {number} changed during the check: {reason}")
    files = len(info["files"])
    print(
        f"{args.index}: {files} files verified ({info['bytes_on_disk']:,} bytes, "
        f"{len(info['segments'])} segments, {info['count']} items): every checksum holds"
    )
    if legacy:
        key, problem = legacy[0]
        print(
            f"{args.index}: {len(legacy)} item(s) hold what this version refuses at add "
            f"(e.g. {key!r}: {problem}); they stay searchable and `vitrieval-index remove` "
            "deletes them"
        )
    return 0


def _repair_journals(index: str) -> None:
    """`verify --repair`: set aside the journal rows this version cannot apply."""
    from ..shards.layout import store_directories
    from ..store import REJECTED_FILE, repair_journal
    from ..store import manifest as mf

    for directory in store_directories(index):
        moved = repair_journal(directory, mf.read_manifest(directory).dim)
        if moved:
            print(
                f"{directory}: {moved} journal row(s) that cannot be applied set aside in "
                f"{directory / REJECTED_FILE}"
            )


def _upgrade(args: argparse.Namespace) -> int:
    """Each store of the index (every shard of a sharded one) converted in place."""
    from ..shards.layout import store_directories
    from ..store import upgrade
    from ..store.manifest import FORMAT_VERSION

    for directory in store_directories(args.index):
        found, items = upgrade(directory)
        if found == FORMAT_VERSION:
            print(f"{directory} is already in format {FORMAT_VERSION}; nothing to do")
        else:
            print(
                f"{directory}: converted from format {found} to format {FORMAT_VERSION} "
                f"({items} items)"
            )
    return 0


def _merge(args: argparse.Namespace) -> int:
    from ..shards import open_index

    with open_index(args.index) as store:
        before = len(store.info()["segments"])
        merged = store.merge(everything=args.all)
        after = len(store.info()["segments"])
    print(f"{args.index}: merged {merged} of {before} segments; {after} now")
    return 0


def _quantize(args: argparse.Namespace) -> int:
    from ..runtime.quantize import SCHEME_BY_NAME, quantize_model

    report = quantize_model(Path(args.model), Path(args.out), scheme=SCHEME_BY_NAME[args.to])
    print(report.summary())
    return 0


def _optimize(args: argparse.Namespace) -> int:
    from ..runtime.optimize import optimize_model

    report = optimize_model(Path(args.model), Path(args.out))
    print(report.summary())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vitrieval-index", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    build = sub.add_parser("build", help="embed images into a new or existing index")
    build.add_argument(
        "--model",
        help="exported .onnx model (default: the index's own copy; with --embeddings, the "
        "model its embeddings.json names)",
    )
    build.add_argument("--images", help="folder (walked recursively) or CSV list")
    build.add_argument(
        "--embeddings",
        metavar="EMB",
        help="instead of --images: a folder of Parquet embeddings (`vitrieval-index embed`, "
        "or any engine writing the same columns and embeddings.json)",
    )
    build.add_argument("--out", required=True, help="index directory")
    build.add_argument(
        "--factory",
        default="auto",
        help="FAISS index_factory string, or auto (the default: Flat below 100,000 images, "
        "an inverted file above, PQ codes when full vectors exceed --memory-budget)",
    )
    build.add_argument(
        "--memory-budget",
        metavar="SIZE",
        help="with --factory auto: memory the FAISS index may use, e.g. 4G or 512M",
    )
    build.add_argument("--labels-from-folders", action="store_true", help="label = top folder name")
    build.add_argument(
        "--save-every",
        type=int,
        help="commit every N images (default 2048; with --embeddings every 1,000,000 vectors)",
    )
    add_shards_option(build)
    add_index_settings(build)
    add_target_recall_option(build)
    add_ray_options(build)
    add_runtime_options(build)
    build.set_defaults(handler=_build)

    embed = sub.add_parser(
        "embed", help="embed images into a folder of Parquet parts (resumable), for build"
    )
    embed.add_argument("--model", required=True, help="exported .onnx model")
    embed.add_argument("--images", required=True, help="folder (walked recursively) or CSV list")
    embed.add_argument("--out", required=True, help="embeddings folder (EMB)")
    embed.add_argument("--labels-from-folders", action="store_true", help="label = top folder name")
    embed.add_argument(
        "--part-size",
        type=int,
        metavar="N",
        help="images per Parquet part (default: 16 parts of 100 to 50,000 images); a "
        "re-run keeps the finished parts",
    )
    add_runtime_options(embed)
    add_ray_options(embed, actors=True)
    embed.set_defaults(handler=_embed)

    add_add_command(sub, _build)

    remove = sub.add_parser("remove", help="remove items by key")
    remove.add_argument("index")
    remove.add_argument("keys", nargs="*")
    remove.add_argument("--keys-from", help="file with one key per line")
    remove.set_defaults(handler=_remove)

    info = sub.add_parser(
        "info", help="describe an index (checks file sizes and headers; `verify` reads all)"
    )
    info.add_argument("index")
    info.add_argument("--json", action="store_true")
    info.set_defaults(handler=_info)

    verify = sub.add_parser(
        "verify", help="check every file of an index against its checksums (exit 2 if not)"
    )
    verify.add_argument("index")
    verify.add_argument(
        "--repair",
        action="store_true",
        help="first move journal rows that cannot be applied (written by an older "
        "version) aside into a rejected-rows file beside the journal, keeping every other row",
    )
    verify.set_defaults(handler=_verify)

    upgrade = sub.add_parser(
        "upgrade", help="convert an index of format 1, 2 or 3 to format 4, in place"
    )
    upgrade.add_argument("index")
    upgrade.set_defaults(handler=_upgrade)

    merge = sub.add_parser(
        "merge", help="merge small or mostly deleted segments now (saves do it when due)"
    )
    merge.add_argument("index")
    merge.add_argument("--all", action="store_true", help="fold every segment into one")
    merge.set_defaults(handler=_merge)

    # the commands of their own modules
    for add in (add_search_command, add_recommend_command, add_duplicates_command,
                add_calibrate_command, add_bench_command, add_configure_command,
                add_tune_command, add_snapshot_commands, add_export_dataset_command,
                add_promote_command, add_reembed_command):  # fmt: skip
        add(sub)

    quantize = sub.add_parser(
        "quantize", help="INT8 dynamic quantisation of a model (or FP16 for GPU serving)"
    )
    quantize.add_argument("--model", required=True)
    quantize.add_argument("--out", required=True)
    from ..runtime.quantize import SCHEME_BY_NAME

    quantize.add_argument("--to", choices=list(SCHEME_BY_NAME), default="int8",
                          help="int8 (CPUs, the default) or fp16 (GPUs)")  # fmt: skip
    quantize.set_defaults(handler=_quantize)

    optimize = sub.add_parser(
        "optimize",
        help="fuse a model's attention blocks for ONNX Runtime (same embeddings, faster)",
        description="Rewrite every attention block of an exported ViT as one ONNX Runtime "
        "Attention operator; the result keeps the fingerprint and is checked to embed "
        "within cosine 0.9999 of the input. Quantise after optimising, not before.",
    )
    optimize.add_argument("--model", required=True, help="exported FP32 .onnx model")
    optimize.add_argument("--out", required=True, help="path of the optimised .onnx to write")
    optimize.set_defaults(handler=_optimize)

    verbose_help = "log which devices are used (before or after the command)"
    add_verbose_option(parser, sub.choices.values(), help=verbose_help)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from ..stopping import RESUMABLE_COMMANDS, stop_on_ctrl_c, stopped_message

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s"
    )
    from ..runtime.optimize import OptimizeError
    from ..runtime.quantize import QuantizeError
    from ..store import StoreError

    try:
        if args.command in RESUMABLE_COMMANDS:
            with stop_on_ctrl_c(args.command):
                return args.handler(args)
        return args.handler(args)
    except (*USER_ERRORS, OptimizeError, QuantizeError, StoreError) as exc:
        print(f"vitrieval-index {args.command}: error: {_in_cli_words(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        print(stopped_message(args.command, argv, exc), file=sys.stderr)
        return 130


def _in_cli_words(exc: Exception) -> str:
    """`exc`'s message, where the store's says what to do in Python (`overwrite=True`,
    which `build` has no option for) in this command's words."""
    from ..store.errors import FolderNotEmptyError, held_names

    if isinstance(exc, FolderNotEmptyError):
        return (
            f"{exc.directory} is not empty and holds no index (it holds "
            f"{held_names(exc.held)}): build into a new or empty folder, or move those "
            "files out of it"
        )
    return str(exc)
