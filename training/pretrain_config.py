"""The configuration of `vitrieval-train pretrain` (training/pretrain.py): one dataclass.

As for `fit` (training/config.py): dataclass defaults < `--config FILE` < flags. The
merged result, per-method defaults resolved, is saved as RUN/pretrain.yaml; the
embedding model it produces is described by a FitConfig in RUN/config.yaml
(`embedding_config`), the file `export`, `analyze` and `fit --init` read.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path

import yaml

from vitrieval.index.atomic import atomic_write_text

from .config import (
    HFLIP,
    MAX_LOADER_WORKERS,
    ConfigError,
    FitConfig,
    TrainingConfig,
    check_decode_cache,
    check_run_folder,
    decode_cache_dir_option,
    decode_cache_option,
    default_loader_workers,
    opt,
    threads_option,
)
from .options import (
    NEGATIVES,
    DenseContrastiveOptions,
    InfoNCEOptions,
    default_cross_view_negatives,
)
from .threads import resolve_threads

FIT_FIELDS_KEPT = (
    "out",
    "backbone",
    "pretrained",
    "drop_path",
    "epochs",
    "batch_size",
    "lr",
    "weight_decay",
    "warmup_epochs",
    "min_lr_ratio",
    "clip_grad",
    "crop_scale",
    "hflip",
    "device",
    "amp",
    "workers",
    "threads",
    "seed",
)
"""The options `embedding_config` hands on to the FitConfig as they are (same names)."""

PRETRAIN_METHODS = ("densecl++", "simclr", "densecl")
DENSE_WEIGHT = {"densecl++": 0.9, "densecl": 0.3, "simclr": 0.0}
"""lambda per method: DenseCL++'s best (Fig. 3), DenseCL's best in the paper's sweep."""
DENSECL_PP_NEGATIVES = tuple(n for n in NEGATIVES if n != "densecl")
"""The dense negatives `--method densecl++` takes; densecl's are its own ("densecl")."""
METHOD_NEGATIVES = {"densecl++": DENSECL_PP_NEGATIVES, "densecl": ("densecl",), "simclr": (None,)}
"""The --negatives each method allows (simclr: none)."""


def _dense_help(name: str) -> str:
    """The help of DenseContrastiveOptions' option `name`, declared in training/options.py."""
    return next(f.metadata["help"] for f in fields(DenseContrastiveOptions) if f.name == name)


@dataclass
class PretrainConfig(TrainingConfig):
    """Everything `vitrieval-train pretrain` needs (saved as RUN/pretrain.yaml)."""

    out: str = opt("run folder (created; config, metrics, checkpoints, model weights)", "")
    images: str = opt("folder of unlabelled images, searched recursively", "")
    method: str = opt("densecl++ | simclr | densecl", "densecl++")
    # model
    backbone: str = opt(
        "preset name (tiny, small) or any timm ViT name", "tiny", flags=("--preset",)
    )
    pretrained: str | None = opt("weights file (safetensors or state dict), or 'timm'")
    global_pool: str = opt("global representation, also the exported embedding: avg | cls", "avg")
    proj_dim: int = opt("output width of the global and dense heads", 128)
    head_hidden_dim: int | None = opt("hidden width of the heads (default: 4x backbone width)")
    drop_path: float = opt("stochastic depth rate", 0.1)
    # objective
    dense_weight: float | None = opt(
        "lambda of (1 - lambda) L_g + lambda L_d (default: densecl++ 0.9, densecl 0.3, simclr 0)",
        flags=("--lambda",),
    )
    temperature: float = opt(
        "tau of the global and dense InfoNCE losses", InfoNCEOptions.temperature
    )
    negatives: str | None = opt(
        f"densecl++ dense negatives: {' | '.join(DENSECL_PP_NEGATIVES)} "
        f"(default: {DenseContrastiveOptions.negatives})"
    )
    candidates: int = opt(_dense_help("candidates"), DenseContrastiveOptions.candidates)
    beta: float = opt(_dense_help("beta"), DenseContrastiveOptions.beta)
    cross_view_negatives: int | None = opt(_dense_help("cross_view_negatives"))
    recon_weight: float = opt("gamma of the auxiliary L1 reconstruction loss (0: off)", 0.0)
    # optimisation
    epochs: int = opt("training epochs", 100)
    batch_size: int = opt("images per step (2x as many views)", 64)
    lr: float = opt("peak learning rate (AdamW)", 2e-3)
    weight_decay: float = opt("AdamW weight decay (not on biases, norms, tokens)", 0.05)
    warmup_epochs: float = opt("linear warm-up length, in epochs", 10.0)
    min_lr_ratio: float = opt("final lr as a fraction of the peak (cosine schedule)", 0.01)
    clip_grad: float | None = opt("clip the gradient norm to this value", 1.0)
    # augmentation
    crop_scale: float = opt("smallest area share kept by the random resized crop", 0.2)
    hflip: float = opt("horizontal-flip probability", HFLIP)
    # machinery
    device: str = opt("auto | cpu | cuda", "auto")
    amp: bool = opt("mixed precision on CUDA", True)
    workers: int | None = opt(f"data-loading processes (default: up to {MAX_LOADER_WORKERS})")
    decode_cache: str = decode_cache_option()
    decode_cache_dir: str | None = decode_cache_dir_option()
    threads: str | int = threads_option()
    seed: int = opt("random seed (data order, augmentation, negatives, initialisation)", 0)

    def resolved(self) -> PretrainConfig:
        """A copy with the per-method defaults filled in."""
        cfg = PretrainConfig(**asdict(self))
        if cfg.dense_weight is None:
            cfg.dense_weight = DENSE_WEIGHT.get(cfg.method, 0.0)
        if cfg.negatives is None:
            cfg.negatives = {
                "densecl++": DenseContrastiveOptions.negatives,
                "densecl": "densecl",
            }.get(cfg.method)
        if cfg.cross_view_negatives is None:
            cfg.cross_view_negatives = default_cross_view_negatives(cfg.negatives)
        if cfg.workers is None:
            cfg.workers = default_loader_workers()
        cfg.threads = resolve_threads(cfg.threads, cfg.workers)
        return cfg

    def validate(self) -> None:
        check_run_folder(self.out)
        if not self.images:
            raise ConfigError("--images DIR is required (a folder of images)")
        if self.method not in PRETRAIN_METHODS:
            raise ConfigError(
                f"unknown --method {self.method!r}; choose one of: {', '.join(PRETRAIN_METHODS)}"
            )
        if self.negatives not in METHOD_NEGATIVES[self.method]:
            raise ConfigError(
                f"--negatives {self.negatives} does not apply to --method {self.method}"
                + (f" ({' | '.join(DENSECL_PP_NEGATIVES)})" if self.method == "densecl++" else "")
            )
        if self.method == "simclr" and (self.dense_weight or self.recon_weight):
            raise ConfigError("simclr has no dense head: --lambda and --recon-weight must be 0")
        if self.global_pool not in ("avg", "cls"):
            raise ConfigError(f"--global-pool must be avg or cls, got {self.global_pool!r}")
        for name in ("epochs", "lr", "temperature", "proj_dim", "candidates"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{_flag(name)} must be > 0, got {getattr(self, name)}")
        if self.batch_size < 2:
            raise ConfigError(
                f"--batch-size must be >= 2 (in-batch negatives), got {self.batch_size}"
            )
        checks = [
            ("dense_weight", 0 <= self.dense_weight <= 1, "lie in [0, 1]"),
            ("beta", -1 <= self.beta <= 1, "lie in [-1, 1]"),
            ("crop_scale", 0 < self.crop_scale <= 1, "lie in (0, 1]"),
            ("hflip", 0 <= self.hflip <= 1, "lie in [0, 1]"),
            ("recon_weight", self.recon_weight >= 0, "be >= 0"),
            ("cross_view_negatives", self.cross_view_negatives >= 0, "be >= 0"),
            ("warmup_epochs", self.warmup_epochs >= 0, "be >= 0"),
            (
                "head_hidden_dim",
                self.head_hidden_dim is None or self.head_hidden_dim >= 1,
                "be >= 1",
            ),
            ("workers", (self.workers or 0) >= 0, "be >= 0"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ConfigError(f"--{_flag(name)} must {rule}, got {getattr(self, name)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        check_decode_cache(self.decode_cache, self.decode_cache_dir)

    def embedding_config(self) -> FitConfig:
        """The embedding model as a FitConfig: what `export`, `analyze` and `fit --init`
        read from RUN/config.yaml."""
        return FitConfig(
            dataset="folder",
            data_root=self.images,
            pool=self.global_pool,
            layer_decay=1.0,
            auto_augment=None,
            **{name: getattr(self, name) for name in FIT_FIELDS_KEPT},
        )

    def save(self, path: Path) -> None:
        atomic_write_text(path, yaml.safe_dump(asdict(self), sort_keys=False))


def _flag(name: str) -> str:
    return "lambda" if name == "dense_weight" else name.replace("_", "-")
