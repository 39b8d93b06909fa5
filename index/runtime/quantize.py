"""INT8 dynamic quantisation of an exported model, with a measured cost in agreement.

Dynamic quantisation stores the weights of every MatMul/Gemm as int8 and quantises
activations to uint8 per batch at run time (ONNX Runtime's `quantize_dynamic`). It
needs no calibration data, which suits embedding models: the input distribution of a
user's catalogue is unknown at export time. A transformer is almost all MatMul, so the
file shrinks about 3-4x and CPU inference gets faster on int8-capable cores.

Choices, and why:

- weights `QInt8` (signed), activations uint8: the U8S8 pairing ONNX Runtime's CPU
  kernels are fastest with on x86-64 (VNNI) and ARM64. U8U8 (`QUInt8` weights) ran
  1.7x slower than U8S8 on an AVX512-VNNI core (tiny test model, batch 64). On older AVX2 cores
  without VNNI, U8S8 can saturate; the agreement check below is what catches that.
- only MatMul and Gemm are quantised, and the fused attention blocks of a model
  `vitrieval-index optimize` wrote (Attention -> QAttention, int8 qkv projection): the
  patch-embedding Conv holds a tiny share of a ViT's weights, and int8 ConvInteger
  kernels are missing from some ORT versions.
- the symbolic-shape "pre-processing" the quantiser suggests fails on timm exports and
  changed nothing measurable, so it is skipped (and its hint silenced).

The result is another model, so it gets another fingerprint:
sha256(original fingerprint + ":int8-dynamic"). An index built with the FP32 model is
refused by the INT8 one and vice versa, as it must be: their vectors differ. The
original is kept in `vitrieval.source_fingerprint`, and `vitrieval.quantization`
records the scheme ("int8-dynamic"). A source rewritten by `vitrieval-index optimize`
(same fingerprint as its plain export) gives sha256(original + ":attention-fusion" +
":int8-dynamic"): its INT8 attention kernels round differently from the plain INT8
model's, so the two INT8 models are kept apart too.

FP16 (`scheme="fp16"`, `vitrieval-index quantize --to fp16`) is the GPU serving form:
every weight and activation in float16 (ONNX Runtime's float16 converter), input and
output kept float32 so the file keeps the model contract and runs in the Embedder
unchanged; half the file size, and tensor-core speed on a GPU (CPUs gain nothing). Its
fingerprint is sha256(original + ":fp16"), kept apart like INT8's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from ..atomic import atomic_path
from .model_metadata import PREFIX, ModelMetadataError, read_model_metadata

SCHEME = "int8-dynamic"
FP16 = "fp16"
SCHEMES = (SCHEME, FP16)  # what `quantize_model` writes; the first is the default
SCHEME_BY_NAME = {"int8": SCHEME, "fp16": FP16}  # `vitrieval-index quantize --to NAME`
QUANTIZATION_KEY = PREFIX + "quantization"
SOURCE_FINGERPRINT_KEY = PREFIX + "source_fingerprint"
OPTIMIZATION_KEY = PREFIX + "optimization"  # set by index.runtime.optimize
FINGERPRINT_KEY = PREFIX + "fingerprint"
QUANTIZED_OPS = ("MatMul", "Gemm", "Attention")
N_RANDOM_CHECK_IMAGES = 16


class QuantizeError(RuntimeError):
    """Quantisation is not possible here (missing package, model already quantised)."""


@dataclass
class QuantizeReport:
    """What quantisation produced and what it cost.

    `mean_cosine` / `min_cosine`: cosine similarity between the FP32 and INT8 embeddings
    of the same check image (1.0 = identical direction); `check_images` says how many
    images and whether they were the caller's or seeded random noise.
    """

    src: Path
    dst: Path
    scheme: str
    source_fingerprint: str
    fingerprint: str
    bytes_before: int
    bytes_after: int
    mean_cosine: float
    min_cosine: float
    n_check_images: int
    check_source: str  # "given" or "random"

    @property
    def size_ratio(self) -> float:
        """bytes_after / bytes_before."""
        return self.bytes_after / self.bytes_before

    def summary(self) -> str:
        """One line for a CLI."""
        return (
            f"quantised {self.src.name} -> {self.dst} ({self.scheme}): "
            f"{self.bytes_before / 1e6:.1f} MB -> {self.bytes_after / 1e6:.1f} MB "
            f"({self.size_ratio:.2f}x), cosine agreement with FP32 mean {self.mean_cosine:.4f} "
            f"min {self.min_cosine:.4f} on {self.n_check_images} {self.check_source} images"
        )


def quantized_fingerprint(
    source_fingerprint: str, optimization: str | None = None, scheme: str = SCHEME
) -> str:
    """The fingerprint of the `scheme` model made from a model with `source_fingerprint`
    (rewritten by `vitrieval-index optimize` with scheme `optimization`, if given: its
    kernels round differently, so its vectors differ from the plain model's)."""
    source = f"{source_fingerprint}:{optimization}" if optimization else source_fingerprint
    return hashlib.sha256(f"{source}:{scheme}".encode()).hexdigest()


def quantize_model(
    src: str | Path,
    dst: str | Path,
    *,
    check_images: Sequence[Image.Image] | None = None,
    scheme: str = SCHEME,
) -> QuantizeReport:
    """Write an INT8 dynamically quantised (or, `scheme="fp16"`, a float16) copy of the
    exported model `src` to `dst`.

    `dst` is replaced atomically and only after the INT8 model has loaded and been
    compared with the FP32 one on `check_images` (default: 16 seeded random images; pass
    real catalogue images for a meaningful number). Raises `ModelMetadataError` for a
    file that is not a vitrieval model and `QuantizeError` for one already quantised or
    when the `onnx` package is missing.
    """
    src, dst = Path(src), Path(dst)
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    if src.resolve() == dst.resolve():
        raise QuantizeError(f"refusing to overwrite the source model {src} with its INT8 copy")
    meta = read_model_metadata(src)
    onnx, quantize_dynamic, quant_type = _import_quantizer()
    source_props = {
        p.key: p.value for p in onnx.load(str(src), load_external_data=False).metadata_props
    }
    if QUANTIZATION_KEY in source_props:
        raise QuantizeError(
            f"{src} is already quantised ({json.loads(source_props[QUANTIZATION_KEY])})"
        )
    images = list(check_images) if check_images is not None else random_check_images()
    if not images:
        raise ValueError("check_images is empty; pass None to use random images")
    optimization = source_props.get(OPTIMIZATION_KEY)
    fingerprint = quantized_fingerprint(
        meta.fingerprint, json.loads(optimization) if optimization else None, scheme
    )
    with atomic_path(dst) as tmp:
        if scheme == FP16:
            from onnxruntime.transformers.float16 import convert_float_to_float16

            proto = convert_float_to_float16(onnx.load(str(src)), keep_io_types=True)
        else:
            with _quiet_quantizer():
                quantize_dynamic(
                    str(src),
                    str(tmp),
                    weight_type=quant_type.QInt8,
                    op_types_to_quantize=list(QUANTIZED_OPS),
                )
            proto = onnx.load(str(tmp))
        props = {p.key: p.value for p in proto.metadata_props}
        # The quantiser keeps metadata today; re-adding the source's vitrieval keys makes
        # that independent of its version.
        props.update({k: v for k, v in source_props.items() if k.startswith(PREFIX)})
        props[FINGERPRINT_KEY] = json.dumps(fingerprint)
        props[SOURCE_FINGERPRINT_KEY] = json.dumps(meta.fingerprint)
        props[QUANTIZATION_KEY] = json.dumps(scheme)
        del proto.metadata_props[:]
        for key, value in props.items():
            entry = proto.metadata_props.add()
            entry.key, entry.value = key, value
        onnx.save(proto, str(tmp))
        cosines = _agreement(src, tmp, images)
        bytes_after = tmp.stat().st_size
    return QuantizeReport(
        src=src,
        dst=dst,
        scheme=scheme,
        source_fingerprint=meta.fingerprint,
        fingerprint=fingerprint,
        **rewrite_figures(src, bytes_after, cosines),
        check_source="given" if check_images is not None else "random",
    )


def rewrite_figures(src: Path, bytes_after: int, cosines: np.ndarray) -> dict[str, Any]:
    """The figures the reports of a model rewrite share (quantising, optimising): the
    sizes of `src` and of the result, and the result's cosine agreement with `src` on
    each check image (`cosines`)."""
    return {
        "bytes_before": model_bytes(src),
        "bytes_after": bytes_after,
        "mean_cosine": float(cosines.mean()),
        "min_cosine": float(cosines.min()),
        "n_check_images": len(cosines),
    }


def model_bytes(path: str | Path) -> int:
    """Size of an ONNX model on disk: the file plus the external data files it names."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    path = Path(path)
    graph = onnx.load(str(path), load_external_data=False).graph
    tensors = [*graph.initializer]
    tensors += [a.t for node in graph.node for a in node.attribute if a.HasField("t")]
    locations = {ExternalDataInfo(t).location for t in tensors if uses_external_data(t)}
    return path.stat().st_size + sum((path.parent / name).stat().st_size for name in locations)


def random_check_images(count: int = N_RANDOM_CHECK_IMAGES, seed: int = 0) -> list[Image.Image]:
    """`count` seeded RGB noise images of varied sizes (so resizing is exercised too).

    Smooth noise (blocks upsampled) rather than i.i.d. pixels: closer to photo statistics,
    so the agreement is less pessimistic than on pure static.
    """
    rng = np.random.default_rng(seed)
    images = []
    for _ in range(count):
        coarse = rng.integers(0, 256, size=(8, 8, 3), dtype=np.uint8)
        width, height = (int(v) for v in rng.integers(48, 160, size=2))
        images.append(Image.fromarray(coarse).resize((width, height), Image.Resampling.BILINEAR))
    return images


def _agreement(fp32: Path, int8: Path, images: list[Image.Image]) -> np.ndarray:
    """Per-image cosine between the two models' embeddings: float32 (N,)."""
    from .embedder import Embedder

    reference = Embedder(fp32, device="cpu").embed_images(images)
    quantised = Embedder(int8, device="cpu").embed_images(images)
    return np.sum(reference * quantised, axis=1)


def _import_quantizer():
    """(onnx, quantize_dynamic, QuantType): optional dependencies, imported on use."""
    try:
        import onnx
        from onnxruntime.quantization import QuantType, quantize_dynamic
    except ImportError as exc:
        raise QuantizeError(
            f"INT8 quantisation needs the onnx package ({exc}); install it with "
            "`pip install onnx` or `pip install 'vitrieval[train]'`"
        ) from None
    return onnx, quantize_dynamic, QuantType


class _QuantizerChatter(logging.Filter):
    """Drops the quantiser's per-tensor INFO lines and its pre-processing hint.

    It logs through the root logger, so an application that shows INFO would get a
    screenful per model; its real warnings (other than the hint) still pass.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if f"onnxruntime{os.sep}quantization" not in record.pathname:
            return True
        hint = "pre-processing before quantization" in record.getMessage()
        return record.levelno >= logging.WARNING and not hint


@contextlib.contextmanager
def _quiet_quantizer() -> Iterator[None]:
    """Apply `_QuantizerChatter` to the root logger for the duration."""
    hint_filter = _QuantizerChatter()
    logging.getLogger().addFilter(hint_filter)
    try:
        yield
    finally:
        logging.getLogger().removeFilter(hint_filter)


__all__ = [
    "FP16",
    "SCHEME",
    "SCHEMES",
    "SCHEME_BY_NAME",
    "ModelMetadataError",
    "QuantizeError",
    "QuantizeReport",
    "quantize_model",
    "quantized_fingerprint",
    "random_check_images",
]
