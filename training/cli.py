"""`vitrieval-train`: fit, pretrain, export and analyze embedding models.

Errors a user can cause (bad names, missing paths, unusable data) end with a one-line
message and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from vitrieval.index.cli.common import add_verbose_option

# Parsing the command line (and --help) imports no torch or timm: the modules that do
# are imported inside the commands, so `vitrieval-train --help` answers at once.
from .config import (
    POOL_FLAGS,
    ConfigError,
    FitConfig,
    add_config_arguments,
    config_from_args,
    load_config_file,
    typed_options,
)
from .progress import finished_line, line_buffered, preparing_line

FIT_FIELDS = {f.name for f in fields(FitConfig)}


def user_errors() -> tuple[type[Exception], ...]:
    """The exceptions a user can cause (bad names, paths, data): one line, exit 2.

    Imported when needed: backbones, checkpoints and poolings import torch and timm.
    """
    from vitrieval.index.evaluation.datasets import DatasetError
    from vitrieval.index.runtime.images import ImageDecodeError
    from vitrieval.index.runtime.model_metadata import ModelMetadataError

    from .backbones import BackboneError
    from .checkpoint import CheckpointError
    from .pooling import PoolingOptionError
    from .registry import UnknownNameError
    from .threads import ThreadsError

    return (
        BackboneError,
        CheckpointError,
        ConfigError,
        DatasetError,
        ImageDecodeError,
        ModelMetadataError,
        PoolingOptionError,
        ThreadsError,
        UnknownNameError,
    )


def _fit(args: argparse.Namespace) -> int:
    from .run_folder import CONFIG_FILE

    if args.list_backbones:
        from .backbones import backbone_listing

        print(backbone_listing())
        return 0
    if args.recipe:
        return _fit_recipe(args)
    if args.resume:
        cfg = _resumed_config(args, FitConfig, CONFIG_FILE)
        if cfg.method == "metric" and _already_finished(cfg, None):
            return 0
    else:
        cfg = config_from_args(args)
    # the first line within seconds: importing the trainer (torch, timm) takes a while
    print(preparing_line("fit", cfg, args.resume))
    from .trainer import fit

    return _run(fit, cfg, args.resume)


def _run(train: Callable[..., object], cfg: Any, resume: bool) -> int:
    """`train(cfg, resume=resume)` (fit or pretrain): if it fails, the run folder it
    created goes (`removed_if_failed`) and a TrainingError is the user's (one line)."""
    from .run_folder import TrainingError

    try:
        with removed_if_failed(cfg.out):
            train(cfg, resume=resume)
    except TrainingError as exc:
        raise ConfigError(str(exc)) from None
    return 0


@contextlib.contextmanager
def removed_if_failed(out: str | None) -> Iterator[None]:
    """Run the block; if it fails and it created the run folder `out` (or parents of it),
    remove what it created unless it holds something of value.

    Of value is any file but the run's saved configuration: a checkpoint, metrics,
    weights, or the list of skipped images that explains the failure. A folder that
    existed before is never touched.
    """
    created = _first_missing(Path(out)) if out else None
    try:
        yield
    except BaseException:
        if created is not None and created.is_dir() and not _holds_value(created):
            shutil.rmtree(created, ignore_errors=True)
        raise


def _first_missing(path: Path) -> Path | None:
    """The outermost of `path` and its parents that does not exist yet (None: it exists)."""
    missing = None
    for candidate in (path.absolute(), *path.absolute().parents):
        if candidate.exists():
            break
        missing = candidate
    return missing


def _holds_value(folder: Path) -> bool:
    from .run_folder import CONFIG_FILE, PRETRAIN_FILE

    worthless = {CONFIG_FILE, PRETRAIN_FILE}
    return any(not path.is_dir() and path.name not in worthless for path in folder.rglob("*"))


def _resumed_config(args: argparse.Namespace, cls: type, filename: str) -> Any:
    """`--resume`: the run's saved config (RUN/`filename`), with the flags given now on top."""
    if not args.out:
        raise ConfigError("--resume needs --out RUN, the run to continue")
    saved = Path(args.out) / filename
    if not saved.is_file():
        raise ConfigError(f"{args.out} has no {filename}; nothing to resume")
    base = load_config_file(saved, cls)
    given = vars(config_from_args(args, cls)).items()
    overrides = {k: v for k, v in given if getattr(args, k, None) is not None}
    return cls(**{**base, **overrides})


def _already_finished(cfg: Any, stage: str | None) -> bool:
    """`--resume` of a run whose checkpoint (of `stage`) holds all of `cfg.epochs`: say
    so in one line and do nothing (no torch, no data, no file touched)."""
    from .interrupt import checkpoint_epoch
    from .run_folder import read_metrics

    run = Path(cfg.out)
    saved = checkpoint_epoch(run)
    if saved is None or saved[1] != stage or saved[0] < cfg.epochs:
        return False
    rows = [row for row in read_metrics(run) if row.get("epoch") == saved[0]]
    print(finished_line(run, saved[0], cfg.epochs, rows[-1] if rows else None))
    return True


def _pretrain(args: argparse.Namespace) -> int:
    from .pretrain import pretrain
    from .pretrain_config import PretrainConfig
    from .run_folder import PRETRAIN_FILE

    if args.resume:
        cfg = _resumed_config(args, PretrainConfig, PRETRAIN_FILE)
        if _already_finished(cfg, "pretrain"):
            return 0
    else:
        cfg = config_from_args(args, PretrainConfig)
    print(preparing_line("pretrain", cfg, args.resume))
    return _run(pretrain, cfg, args.resume)


def _fit_recipe(args: argparse.Namespace) -> int:
    """Run the stages of a recipe file in order, each initialised from the one before."""
    from .run_folder import TrainingError

    recipe = _load_recipe(args.recipe)
    if not args.out:
        raise ConfigError("--recipe needs --out RUN (each stage writes RUN/<stage name>)")
    flags = {k: v for k, v in vars(args).items() if k in FIT_FIELDS and v is not None}
    previous = flags.pop("init", None)
    names = ", ".join(str(stage["name"]) for stage in recipe["stages"])
    # the first line within seconds: importing the trainer (torch, timm) takes a while
    print(f"fit: recipe {args.recipe}, stages {names} into {args.out}: loading torch ...")
    from .trainer import fit

    with removed_if_failed(args.out):
        for stage in recipe["stages"]:
            stage = dict(stage)
            name = str(stage.pop("name"))
            out = str(Path(args.out) / name)
            values = {**recipe.get("common", {}), **stage, **flags, "out": out}
            if previous:
                values["init"] = previous
                values.pop("pretrained", None)  # the previous stage's weights replace them
            print(f"recipe stage {name}")
            try:
                with removed_if_failed(out):
                    fit(FitConfig(**values))
            except TrainingError as exc:
                raise ConfigError(f"stage {name}: {exc}") from None
            previous = out
    return 0


def _load_recipe(path: Path) -> dict:
    recipe = load_config_file(path, None)
    stages = recipe.get("stages")
    common = recipe.get("common") or {}
    if (
        not isinstance(stages, list)
        or not stages
        or not all(isinstance(s, dict) and "name" in s for s in stages)
        or not isinstance(common, dict)
    ):
        raise ConfigError(
            f"{path}: a recipe needs a list of `stages`, each a mapping with a `name` "
            "(and optionally a `common` mapping)"
        )
    return {
        "common": typed_options(str(path), common),
        "stages": [
            {"name": s["name"], **typed_options(f"{path}, stage {s['name']}", _without_name(s))}
            for s in stages
        ],
    }


def _without_name(stage: dict) -> dict:
    return {k: v for k, v in stage.items() if k != "name"}


EXPORT_MODEL_FIELDS = ("backbone", "pool", "dim", "pretrained", "seed", *POOL_FLAGS)
"""The FitConfig fields `export --init-only` takes: what builds the model, no training."""


def _export(args: argparse.Namespace) -> int:
    given = [name for name in EXPORT_MODEL_FIELDS if getattr(args, name, None) is not None]
    if bool(args.run) == bool(args.init_only):
        raise ConfigError(
            "give exactly one of --run RUN (a trained run) and --init-only (a model built "
            "from --backbone, --pool, --dim, --pretrained and --seed)"
        )
    if args.run and given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise ConfigError(f"{flags}: options of --init-only; a --run exports as it was trained")

    from .export import ExportError, export_init_only, export_run

    try:
        if args.run:
            report = export_run(
                Path(args.run), Path(args.out), opset=args.opset, check=not args.no_check
            )
        else:
            cfg = _init_only_config(args, given)
            report, taken = export_init_only(
                cfg, Path(args.out), opset=args.opset, check=not args.no_check
            )
            print(_init_only_note(cfg, taken))
    except ExportError as exc:
        print(f"vitrieval-train export: error: {exc}", file=sys.stderr)
        return 2
    print(report.summary())
    return 0


def _init_only_config(args: argparse.Namespace, given: list[str]) -> FitConfig:
    """`--init-only`: a FitConfig of the model flags (the rest at fit's defaults)."""
    cfg = FitConfig(out="", **{name: getattr(args, name) for name in given})
    cfg.check_model_options()
    if cfg.pretrained and cfg.pretrained != "timm" and not Path(cfg.pretrained).is_file():
        raise ConfigError(f"--pretrained {cfg.pretrained}: no such file")
    return cfg


def _init_only_note(cfg: FitConfig, taken: list[str]) -> str:
    if not cfg.pretrained:
        return f"{cfg.backbone} + {cfg.pool}: random initialisation, seed {cfg.seed}"
    head = (
        f", head from the file too ({', '.join(taken)})"
        if taken
        else f"; head initialised with seed {cfg.seed}"
    )
    return f"{cfg.backbone} + {cfg.pool}: backbone weights from {cfg.pretrained}{head}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vitrieval-train", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    fit = sub.add_parser(
        "fit", help="train an embedding model", description="Train a ViT embedding model."
    )
    add_config_arguments(fit)
    fit.add_argument(
        "--resume", action="store_true", help="continue the run in --out from its checkpoint"
    )
    fit.add_argument(
        "--list-backbones",
        action="store_true",
        help="print the presets (tiny, small), then timm's ViT names, and exit",
    )
    fit.add_argument(
        "--recipe", type=Path, help="YAML file of stages run in order (e.g. recipes/*.yaml)"
    )
    fit.set_defaults(handler=_fit)

    from .pretrain_config import PretrainConfig

    pretrain = sub.add_parser(
        "pretrain",
        help="self-supervised pretraining on unlabelled images (DenseCL++, SimCLR, DenseCL)",
        description="Pretrain a ViT embedding model without labels on a folder of images: "
        "DenseCL++ (global + dense contrastive losses with dense negatives), SimCLR or "
        "DenseCL. The run folder exports like a `fit` run.",
    )
    add_config_arguments(pretrain, PretrainConfig)
    pretrain.add_argument(
        "--resume", action="store_true", help="continue the run in --out from its checkpoint"
    )
    pretrain.set_defaults(handler=_pretrain)

    export = sub.add_parser(
        "export",
        help="export a run, or an untrained model, to a self-describing ONNX model",
        description="Export a trained run (--run), or a model built without training "
        "(--init-only: seeded random weights, or backbone weights from --pretrained), to "
        "ONNX (input `images`, output `embeddings`, vitrieval.* metadata) and check ONNX "
        "Runtime against PyTorch. Weights over 1.8 GB go to NAME.onnx.data beside the file.",
    )
    export.add_argument("--run", help="run folder written by `fit` or `pretrain`")
    export.add_argument(
        "--init-only",
        action="store_true",
        help="export without training: the model the options below describe",
    )
    export.add_argument("--out", required=True, help="path of the .onnx file to write")
    export.add_argument("--opset", type=int, default=18, help="ONNX opset (default: 18)")
    export.add_argument(
        "--no-check", action="store_true", help="skip the ONNX Runtime parity check"
    )
    add_config_arguments(
        export.add_argument_group("--init-only model (fit's options)"),
        only=EXPORT_MODEL_FIELDS,
    )
    export.set_defaults(handler=_export)

    from .analyze import add_analyze_parser

    add_analyze_parser(sub)
    add_verbose_option(
        parser,
        sub.choices.values(),
        help="also log the libraries' INFO lines (ONNX Runtime, FAISS) and vitrieval's "
        "debug lines (before or after the command)",
    )
    return parser


class _StdoutHandler(logging.StreamHandler):
    """Log lines to whatever sys.stdout is at the time (with the progress lines)."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:
        pass


def _show_log_lines(verbose: bool = False) -> None:
    """The training packages' INFO lines (which device, and why not the GPU) on stdout;
    with `verbose`, their DEBUG lines too, and other libraries' INFO lines on stderr."""
    logger = logging.getLogger("vitrieval.train")
    if not any(isinstance(h, _StdoutHandler) for h in logger.handlers):
        handler = _StdoutHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.DEBUG if verbose else logging.INFO)
    if verbose:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    line_buffered()
    _show_log_lines(args.verbose)
    from .interrupt import exit_status, stop_on_signals

    try:
        with stop_on_signals():  # SIGTERM stops a run as Ctrl-C does
            return args.handler(args)
    except Exception as exc:
        missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
        if missing and missing.split(".")[0] in TRAINING_PACKAGES:
            print(
                f"vitrieval-train {args.command}: error: {missing} is not installed; training "
                "needs pip install -c constraints.txt -e '.[train,serve]'",
                file=sys.stderr,
            )
            return 2
        if not isinstance(exc, user_errors()):
            raise
        print(f"vitrieval-train {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        return exit_status(args.command, exc)


TRAINING_PACKAGES = frozenset(
    {"torch", "torchvision", "timm", "safetensors", "onnx", "onnxscript", "matplotlib", "skimage"}
)
"""What the `train` extra installs and a serving install lacks."""


if __name__ == "__main__":
    sys.exit(main())
