"""What the `vitrieval-index` commands share: the runtime options and the embedder
they build from them."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path


def add_runtime_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--batch-size", type=int, default=64, help="images per model call")


def add_verbose_option(
    parser: argparse.ArgumentParser, commands: Iterable[argparse.ArgumentParser], help: str
) -> None:
    """-v/--verbose on `parser` and on each of its `commands`, so that it is accepted
    before and after the command name (`vitrieval-index` and `vitrieval-train`)."""
    targets = [(parser, False)] + [(command, argparse.SUPPRESS) for command in commands]
    for target, default in targets:
        # after the command too; SUPPRESS keeps a flag given before it
        target.add_argument("-v", "--verbose", action="store_true", default=default, help=help)


def checked_oversample_option(value: int | None) -> int | None:
    """An `--oversample N` checked before anything is opened (None: not given); out of
    range is a ValueError in the option's words (one line, exit 2)."""
    from ..store import StoreError
    from ..store.request import MAX_OVERSAMPLE, checked_oversample

    if value is None:
        return None
    try:
        return checked_oversample(value)  # the range, as every search checks it
    except StoreError:
        raise ValueError(f"--oversample must be from 1 to {MAX_OVERSAMPLE}, got {value}") from None


def checked_save_every(value: int | None, default: int | None = None) -> int | None:
    """`--save-every N` as given, or `default` when not given; below 1 is a ValueError
    in the option's words (one line, exit 2), not a commit after every batch."""
    if value is None:
        return default
    if value < 1:
        raise ValueError(f"--save-every must be at least 1, got {value}")
    return value


def embedder_from_args(model: Path, args: argparse.Namespace):
    """The Embedder of `model` with the command's --device and --batch-size."""
    from ..runtime.embedder import Embedder

    return Embedder(model_from_args(model), device=args.device, batch_size=args.batch_size)


def model_from_args(model: str | Path) -> Path:
    """A `--model`: the model file, or for an index folder the model copy it keeps
    (what it was built with); anything else is refused by `model_file`, saying why."""
    from ..shards import is_index
    from ..shards.layout import store_directories
    from ..store.manifest import MODEL_COPY_FILE

    model = Path(model)
    if model.is_dir() and is_index(model):
        copy = store_directories(model)[0] / MODEL_COPY_FILE
        if copy.is_file():
            return copy
    return model


def add_ray_options(parser: argparse.ArgumentParser, *, actors: bool = False) -> None:
    """--ray ADDRESS (distributed.cluster), and with `actors` the actor pool's size."""
    from vitrieval.distributed.cluster import ADDRESS_HELP, DEFAULT_ACTOR_THREADS

    parser.add_argument("--ray", metavar="ADDRESS", help=ADDRESS_HELP)
    if actors:
        parser.add_argument(
            "--actors",
            type=int,
            metavar="N",
            help="with --ray: actors embedding at once (default: one per GPU, or the "
            "cluster's CPUs // --actor-threads)",
        )
        parser.add_argument(
            "--actor-threads",
            type=int,
            metavar="T",
            help="with --ray: CPUs, ONNX Runtime and decoding threads per actor (default: "
            f"min({DEFAULT_ACTOR_THREADS}, a node's CPUs), or CPUs // --actors)",
        )


def open_index_with_model(index: Path, override: str | None):
    """Open (and verify) an index once, with the model to embed for it.

    The model is the index's own copy; `--model` may only name the same weights.
    Returns (store, model path).
    """
    from ..runtime.model_metadata import read_model_metadata
    from ..shards import open_index
    from ..store import StoreError

    store = open_index(index)
    if override:
        theirs = read_model_metadata(override).fingerprint
        if theirs != store.fingerprint:
            own = f" ({store.model_path})" if store.model_path else ""
            raise StoreError(
                f"--model {override} has fingerprint {theirs[:12]}, the index was built with "
                f"{(store.fingerprint or '')[:12]}: leave out --model to use the index's own "
                f"copy{own}, or rebuild the index with this model (`vitrieval-index build "
                f"--model {override} --images ... --out NEW_INDEX`)"
            )
        return store, Path(override)
    if store.model_path is None:
        raise StoreError(f"{index} holds no copy of its model; pass --model")
    return store, store.model_path
