"""Training configuration: one dataclass, filled from a file and the command line.

Precedence: dataclass defaults < `--config FILE` (YAML or JSON) < command-line flags.
The merged result, with derived defaults resolved, is saved as `RUN/config.yaml`, so
a run folder always says exactly how it was trained.
"""

from __future__ import annotations

import argparse
import os
import types
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from vitrieval.index.atomic import atomic_write_text
from vitrieval.index.cli.arguments import ArgumentAdder
from vitrieval.index.json_text import parse_json

from .options import LOSSES, POOLINGS, FlagOption, flag_options
from .threads import MAX_AUTO_THREADS, THREADS_AUTO, normal_threads, resolve_threads

if (
    TYPE_CHECKING
):  # index.evaluation.datasets (numpy, PIL) is imported by the commands that read data
    from vitrieval.index.evaluation.datasets import Split


class ConfigError(ValueError):
    """A configuration file or value that cannot be used; the message says which."""


PAIR_LOSSES = ("triplet", "supcon")
"""Losses that compare embeddings within a batch (no class proxies)."""

METHODS = ("metric", "lacvit", "ce")
"""`--method`: metric learning with `--loss` (the default); LaCViT's two stages (SupCon
on two views, then a linear probe on the frozen encoder); plain cross-entropy training
of encoder + linear head (the baseline LaCViT is compared with). See training/lacvit.py."""

POOL_FLAGS: dict[str, FlagOption] = flag_options(POOLINGS)
LOSS_FLAGS: dict[str, FlagOption] = flag_options(LOSSES)
"""The config fields (and flags) that set options of the poolings and losses, derived
from their declarations in training/options.py: help, default and checks."""

POOL_OPTIONS: dict[str, dict[str, str]] = {
    pool: taken
    for pool in POOLINGS
    if (taken := {f.takers[pool]: f.name for f in POOL_FLAGS.values() if pool in f.takers})
}
"""Which config fields each pooling's factory takes, under which option name."""

LOSS_OPTIONS: dict[str, tuple[str, ...]] = {
    loss: taken
    for loss in LOSSES
    if (taken := tuple(f.name for f in LOSS_FLAGS.values() if loss in f.takers))
}
"""Which config fields each loss's factory takes as options: the trainer passes each
field as the option of the same name."""

DEFAULT_LOSS = "norm_softmax"
"""`--loss`'s default; a loss without a temperature resolves `temperature` to this
loss's (unused, and recorded in config.yaml as before)."""

SECOND_ORDER_POOLS = ("ccbp", "jcf")
LR = 2e-3
SECOND_ORDER_LR = 5e-4
"""`--lr`'s default: LR, and SECOND_ORDER_LR for SECOND_ORDER_POOLS, whose codebook
heads collapse from scratch at LR (docs/training.md, "Second-order pooling on digits")."""
PRETRAINED_LAYER_DECAY = 0.65
"""Layer-wise learning-rate decay when fine-tuning pretrained weights (1: none)."""
HFLIP = 0.5
"""Horizontal-flip probability, but for digits (0: a flipped digit is another glyph)."""
MAX_LOADER_WORKERS = 4
"""Data-loading processes at most, by default (digits, held in memory, use none)."""


def default_loader_workers() -> int:
    """`--workers`' default for image files: a process per core but one, at most
    MAX_LOADER_WORKERS."""
    return min(MAX_LOADER_WORKERS, max(1, (os.cpu_count() or 2) - 1))


DECODE_CACHE_MODES = ("auto", "memory", "disk", "off")
"""`--decode-cache`: how training keeps the images it decoded (training/decode_cache.py)."""
DECODE_CACHE_MEMORY_SHARE = 0.25
DECODE_CACHE_MEMORY_CAP = 8 * 2**30
"""`--decode-cache auto` keeps decoded images in memory up to this share of the
machine's RAM, at most the cap in bytes; the rest go to disk."""


def check_decode_cache(mode: str, folder: str | None) -> None:
    """`--decode-cache MODE` is a known mode; `--decode-cache-dir` only where a mode
    writes to disk (auto, for what exceeds the memory budget, and disk)."""
    if mode not in DECODE_CACHE_MODES:
        raise ConfigError(
            f"--decode-cache must be one of {', '.join(DECODE_CACHE_MODES)}, got {mode!r}"
        )
    if folder is not None and mode not in ("auto", "disk"):
        raise ConfigError(
            f"--decode-cache-dir is where auto and disk keep decoded images; "
            f"--decode-cache {mode} writes none"
        )


def check_run_folder(out: str | None) -> None:
    """`--out RUN`: given, and a folder (or nothing yet), not a file."""
    if not out:
        raise ConfigError("--out RUN is required")
    if Path(out).exists() and not Path(out).is_dir():
        raise ConfigError(f"--out {out} is a file; a run needs a folder")


def opt(help: str, default: Any = None, **extra: Any) -> Any:
    """A config field with its `--flag` help text (and extra flag names in `flags`)."""
    return field(default=default, metadata={"help": help, **extra})


def component_opt(flag: FlagOption) -> Any:
    """The config field of a pooling or loss option: help and default from its declaration."""
    return opt(flag.help, flag.default, component=flag.name)


def _short(number: float) -> str:
    """2e-3, not 0.002: how learning rates are written."""
    return f"{number:.0e}".replace("e-0", "e-")


def decode_cache_option() -> Any:
    """The `--decode-cache` field, the same in every training command's config."""
    return opt(
        "decode each image file once, shrunk to a working size, and reuse it every epoch: "
        f"auto (in memory up to {DECODE_CACHE_MEMORY_SHARE * 100:g}%% of RAM, at most "
        f"{DECODE_CACHE_MEMORY_CAP / 2**30:g} GiB; the rest on disk) | "
        "memory | disk (kept for later runs and --resume) | off",
        "auto",
    )


def threads_option() -> Any:
    """The `--threads` field, the same in every training command's config; resolved()
    turns `auto` into the count used, which config.yaml records."""
    return opt(
        "CPU threads of torch in the training process: auto (a core per --workers process "
        f"and one spare, the rest for training, 1 to {MAX_AUTO_THREADS}) or a number",
        THREADS_AUTO,
    )


def decode_cache_dir_option() -> Any:
    """The `--decode-cache-dir` field, the same in every training command's config."""
    return opt(
        "folder of the on-disk decode cache, may be shared by runs (default: RUN/decode-cache)"
    )


class TrainingConfig:
    """Base of the training commands' configs (FitConfig, PretrainConfig), whose
    `threads` is a `threads_option()` field: normalised on construction."""

    threads: str | int

    def __post_init__(self) -> None:
        self.threads = normal_threads(self.threads)


@dataclass
class FitConfig(TrainingConfig):
    """Everything `vitrieval-train fit` needs."""

    out: str = opt("run folder (created; holds config, metrics, checkpoints, plots)", "")
    # data
    dataset: str = opt("digits | folder | csv | cub | cars | sop", "digits")
    data_root: str | None = opt("dataset folder or CSV file (all but digits)")
    val: str | None = opt(
        "validation folder or CSV (folder, csv): evaluated instead of a split held out of "
        "--data-root, which then trains whole"
    )
    split: str | None = opt("stratified | disjoint (default: the dataset's own protocol)")
    test_fraction: float = opt(
        "held-out share per class for stratified splits (0: train on all, no evaluation)", 0.3
    )
    # model
    backbone: str = opt(
        "preset name (tiny, small) or any timm ViT name", "tiny", flags=("--preset",)
    )
    pretrained: str | None = opt("weights file (safetensors or state dict), or 'timm' for the hub")
    init: str | None = opt("run folder whose model.safetensors initialises the whole model")
    freeze_backbone: bool = opt("train only the pooling/projection head (and the loss)", False)
    pool: str = opt(f"pooling head: {' | '.join(POOLINGS)}", "ggem")
    pool_p: float = component_opt(POOL_FLAGS["pool_p"])
    pool_groups: int | None = component_opt(POOL_FLAGS["pool_groups"])
    pool_dim: int | None = component_opt(POOL_FLAGS["pool_dim"])
    pool_out_dim: int | None = component_opt(POOL_FLAGS["pool_out_dim"])
    pool_codebook: int | None = component_opt(POOL_FLAGS["pool_codebook"])
    pool_rank: int | None = component_opt(POOL_FLAGS["pool_rank"])
    dim: int | None = opt("project the pooled vector to this many dimensions (default: none)")
    drop_path: float = opt("stochastic depth rate", 0.1)
    # loss
    loss: str = opt(f"training loss: {' | '.join(LOSSES)}", DEFAULT_LOSS)
    temperature: float | None = component_opt(LOSS_FLAGS["temperature"])
    margin: float = component_opt(LOSS_FLAGS["margin"])
    mining: str = component_opt(LOSS_FLAGS["mining"])
    sampler: str | None = opt("random | pk (default: pk for triplet and supcon, else random)")
    classes_per_batch: int = opt("P of the class-balanced P x K sampler", 8)
    samples_per_class: int = opt("K of the class-balanced P x K sampler", 8)
    # method (training/lacvit.py)
    method: str = opt("metric | lacvit | ce (lacvit: --epochs is stage 1)", "metric")
    probe_epochs: int = opt("lacvit stage 2: epochs of the linear probe (SGD)", 10)
    probe_lr: float = opt("lacvit stage 2: SGD learning rate of the linear probe", 0.1)
    proj_dim: int = opt("lacvit stage 1: output width of the projection head", 128)
    # optimisation
    epochs: int = opt("training epochs (0: evaluate and save the initial model)", 80)
    batch_size: int = opt("images per step", 64)
    lr: float | None = opt(
        f"peak learning rate of the network (AdamW) (default: {_short(LR)}, "
        f"{_short(SECOND_ORDER_LR)} for {' and '.join(SECOND_ORDER_POOLS)})"
    )
    proxy_lr_scale: float = opt("learning-rate multiplier of the loss's class proxies", 10.0)
    weight_decay: float = opt("AdamW weight decay (not on biases, norms, tokens, p)", 0.05)
    layer_decay: float | None = opt(
        f"layer-wise lr decay (default: {PRETRAINED_LAYER_DECAY} with pretrained weights, else 1)"
    )
    warmup_epochs: float = opt("linear warm-up length, in epochs", 2.0)
    min_lr_ratio: float = opt("final lr as a fraction of the peak (cosine schedule)", 0.01)
    clip_grad: float | None = opt("clip the gradient norm to this value (none: no clipping)", 1.0)
    # augmentation
    crop_scale: float = opt("smallest area share kept by the random resized crop", 0.8)
    hflip: float | None = opt(
        f"horizontal-flip probability (default: 0 for digits, {HFLIP} otherwise)"
    )
    auto_augment: str | None = opt(
        "timm auto-augment policy ('none' to turn it off)", "rand-m9-mstd0.5"
    )
    # machinery
    device: str = opt("auto | cpu | cuda", "auto")
    amp: bool = opt("mixed precision on CUDA", True)
    workers: int | None = opt(
        f"data-loading processes (default: 0 for digits, else up to {MAX_LOADER_WORKERS})"
    )
    decode_cache: str = decode_cache_option()
    decode_cache_dir: str | None = decode_cache_dir_option()
    threads: str | int = threads_option()
    seed: int = opt("random seed (data order, augmentation, initialisation)", 0)
    eval_batch_size: int = opt("images per step when embedding the held-out split", 256)

    def resolved(self) -> FitConfig:
        """A copy with the derived defaults filled in."""
        cfg = FitConfig(**asdict(self))
        if cfg.lr is None:
            cfg.lr = SECOND_ORDER_LR if cfg.pool in SECOND_ORDER_POOLS else LR
        if cfg.layer_decay is None:
            cfg.layer_decay = PRETRAINED_LAYER_DECAY if cfg.pretrained else 1.0
        if cfg.method == "lacvit":
            cfg.loss = "supcon"  # stage 1's loss is the method's, whatever --loss says
        elif cfg.method == "ce":
            cfg.loss = "cross_entropy"
        if cfg.temperature is None:
            temperature = LOSS_FLAGS["temperature"].defaults
            cfg.temperature = temperature.get(cfg.loss, temperature[DEFAULT_LOSS])
        if cfg.sampler is None:
            # pair-based losses need several images of a class in every batch
            # (LaCViT's two views of every image already give each anchor a positive)
            cfg.sampler = "pk" if cfg.loss in PAIR_LOSSES and cfg.method == "metric" else "random"
        if cfg.hflip is None:
            cfg.hflip = 0.0 if cfg.dataset == "digits" else HFLIP
        if cfg.workers is None:
            # digits live in memory and decode for free; files are worth a worker pool
            cfg.workers = 0 if cfg.dataset == "digits" else default_loader_workers()
        cfg.threads = resolve_threads(cfg.threads, cfg.workers)
        if cfg.auto_augment in ("", "none"):
            cfg.auto_augment = None
        return cfg

    def validate(self) -> None:
        check_run_folder(self.out)
        for name in ("batch_size", "lr", "eval_batch_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(
                    f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}"
                )
        self._check_bounds(LOSS_FLAGS)
        if self.epochs < 0:
            raise ConfigError(f"--epochs must be >= 0, got {self.epochs}")
        if not 0 <= self.test_fraction < 1:
            raise ConfigError(f"--test-fraction must lie in [0, 1), got {self.test_fraction}")
        self._check_held_out()
        if not 0 < self.crop_scale <= 1:
            raise ConfigError(f"--crop-scale must lie in (0, 1], got {self.crop_scale}")
        self.check_model_options()
        if self.workers is not None and self.workers < 0:
            raise ConfigError(f"--workers must be >= 0, got {self.workers}")
        check_decode_cache(self.decode_cache, self.decode_cache_dir)
        if self.sampler not in (None, "random", "pk"):
            raise ConfigError(f"--sampler must be random or pk, got {self.sampler!r}")
        if self.sampler == "pk" and self.classes_per_batch < 1:
            raise ConfigError(f"--classes-per-batch must be >= 1, got {self.classes_per_batch}")
        if self.sampler == "pk" and self.samples_per_class < 2:
            raise ConfigError(
                "--samples-per-class must be >= 2 (every image needs a positive), "
                f"got {self.samples_per_class}"
            )
        if self.method not in METHODS:
            raise ConfigError(
                f"unknown --method {self.method!r}; choose one of: {', '.join(METHODS)}"
            )
        for name in ("probe_epochs", "probe_lr", "proj_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(
                    f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}"
                )
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"--device must be auto, cpu or cuda, got {self.device!r}")

    def _check_held_out(self) -> None:
        """--val, --test-fraction 0 and --epochs 0 only where they mean something."""
        default_fraction = next(f.default for f in fields(self) if f.name == "test_fraction")
        if self.val is not None:
            if self.dataset not in ("folder", "csv"):
                raise ConfigError(
                    f"--val applies to --dataset folder and csv, not {self.dataset} "
                    "(it has its own split)"
                )
            given = [
                flag
                for flag, set_ in (
                    ("--split", self.split is not None),
                    ("--test-fraction", self.test_fraction != default_fraction),
                )
                if set_
            ]
            if given:
                raise ConfigError(
                    f"{' and '.join(given)}: not with --val (--data-root trains whole, "
                    "--val is the held-out set)"
                )
        elif self.test_fraction == 0 and (
            self.dataset in ("cub", "cars", "sop") or self.split in ("disjoint", "class-disjoint")
        ):
            raise ConfigError(
                "--test-fraction 0 applies to stratified splits; "
                f"{self.dataset} with a class-disjoint split holds out its own classes"
            )
        if self.method != "metric":
            if self.epochs == 0:
                raise ConfigError(
                    f"--epochs 0 applies to --method metric; --method {self.method} trains "
                    "its classifier on the trained encoder"
                )
            if self.val is None and self.test_fraction == 0:
                raise ConfigError(
                    f"--method {self.method} reports held-out results: give --val, or a "
                    "--test-fraction above 0"
                )

    def check_model_options(self) -> None:
        """--dim and the pooling's options: within their bounds, and only options the
        chosen pooling takes (another pooling's would do nothing)."""
        if self.dim is not None and self.dim < 1:
            raise ConfigError(f"--dim must be >= 1, got {self.dim}")
        self._check_bounds(POOL_FLAGS)
        defaults = {f.name: f.default for f in fields(self)}
        for name in sorted(POOL_FLAGS):
            flag = POOL_FLAGS[name]
            if self.pool not in flag.takers and getattr(self, name) != defaults[name]:
                raise ConfigError(
                    f"--{name.replace('_', '-')} is an option of --pool "
                    f"{' | '.join(sorted(flag.takers))}; --pool {self.pool} does not take it"
                )

    def _check_bounds(self, flags: dict[str, FlagOption]) -> None:
        """The values given for these pooling or loss options obey their declared bounds."""
        for name, flag in flags.items():
            broken = flag.violated(getattr(self, name))
            if broken:
                raise ConfigError(f"--{name.replace('_', '-')} {broken}")

    def save(self, path: Path) -> None:
        atomic_write_text(path, yaml.safe_dump(asdict(self), sort_keys=False))


def dataset_split(options: Any, image_size: int) -> Split:
    """The split of the dataset `options` names in its dataset, data_root, split,
    test_fraction, seed and val: a FitConfig, or the arguments of `analyze`."""
    from vitrieval.index.evaluation.datasets import load_dataset

    return load_dataset(
        options.dataset,
        options.data_root,
        split=options.split,
        test_fraction=options.test_fraction,
        seed=options.seed,
        image_size=image_size,
        val=options.val,
    )


def _field_type(tp: Any) -> tuple[type, bool]:
    """(base type, optional?) of an annotation like `int | None`."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def add_config_arguments(
    parser: ArgumentAdder,
    cls: type = FitConfig,
    only: tuple[str, ...] | None = None,
) -> None:
    """One `--flag` per dataclass field; defaults are left unset so the file can fill them.

    With `only`, the flags of those fields and no `--config` (export's model options).
    """
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if only is not None and f.name not in only:
            continue
        base, _ = _field_type(hints[f.name])
        flags = (f"--{f.name.replace('_', '-')}", *f.metadata.get("flags", ()))
        default_text = "" if f.default in (MISSING, None, "") else f" (default: {f.default})"
        help_text = f.metadata.get("help", "") + default_text
        if base is bool:
            parser.add_argument(
                *flags,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text,
            )
        else:
            parser.add_argument(*flags, dest=f.name, type=base, default=None, help=help_text)
    if only is None:
        parser.add_argument("--config", type=Path, help="YAML or JSON file of the same options")


def load_config_file(path: Path, cls: type | None = FitConfig) -> dict[str, Any]:
    """A YAML or JSON mapping; with `cls`, its keys must be fields of `cls`."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
        data = parse_json(text) if path.suffix == ".json" else yaml.safe_load(text)
    # ValueError: not UTF-8 text, or malformed JSON; RecursionError: YAML nested too deep
    except (ValueError, RecursionError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot parse {path}: {exc}") from None
    data = data or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of option names to values")
    if cls is None:
        return data
    return typed_options(str(path), data, cls)


def typed_options(source: str, data: dict[str, Any], cls: type = FitConfig) -> dict[str, Any]:
    """Options read from a file (`source` names it in errors): every key a field of
    `cls`, every value converted to the field's type, or a one-line ConfigError."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{source}: unknown options {', '.join(unknown)}")
    hints = typing.get_type_hints(cls)
    return {name: _typed_value(source, name, value, hints[name]) for name, value in data.items()}


def _typed_value(path: str, name: str, value: Any, annotation: Any) -> Any:
    """A file's value converted to the field's type as its flag would be (YAML reads
    `1e-4` as a string), or a ConfigError naming the option."""
    base, optional = _field_type(annotation)
    if value is None and optional:
        return None
    if base is bool and isinstance(value, bool):
        return value
    if base in (int, float, str, Path) and not isinstance(value, (bool, dict, list)):
        try:
            converted = base(value)
            if base is int and isinstance(value, float) and value != converted:
                raise ValueError
            return converted
        except (TypeError, ValueError):
            pass
    if base not in (bool, int, float, str, Path):
        return value  # a type the flags do not parse: left to the config's own checks
    kind = {bool: "true or false", int: "an integer", float: "a number"}.get(base, "text")
    raise ConfigError(f"{path}: {name} must be {kind}, got {value!r}")


def config_from_args(args: argparse.Namespace, cls: type = FitConfig) -> Any:
    """Defaults, then the `--config` file, then explicit flags."""
    values: dict[str, Any] = {}
    if getattr(args, "config", None):
        values.update(load_config_file(args.config, cls))
    for f in fields(cls):
        given = getattr(args, f.name, None)
        if given is not None:
            values[f.name] = given
    return cls(**values)
