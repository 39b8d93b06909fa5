"""Fused attention for ONNX Runtime: an exported model rewritten to run faster on the CPU.

The exporter writes each ViT attention block as some twenty small operators: the qkv
MatMul and bias Add, a Reshape and Transpose into heads, a Split into q, k and v, the
scaling, QK^T, Softmax, the product with V, and a Transpose and Reshape back, plus the
Shape arithmetic feeding the Reshapes. ONNX Runtime's own graph optimiser fuses the
LayerNorms, the GELUs and the skip connections at load time, but not this pattern
(neither does its `transformers` optimiser, whose ViT fusion expects another
exporter's graph). `optimize_model` replaces every such block by one
`com.microsoft.Attention` node (ONNX Runtime's contrib operator: the qkv projection,
scaled dot-product attention per head and the concatenation of the heads, with the
same weights), and drops what only fed it.

Measured on ViT-S/16 at 224 px (docs/benchmarks.md, "ViT-S/16 at 224 px"), the fused
graph is faster, and `vitrieval-index quantize` then quantises the fused blocks too
(QAttention). The fused model computes the same function up to float rounding, so it
keeps the fingerprint: an index built with either model is searched with the other.
Before the file is written, both models embed real photos and seeded random images and
every embedding must agree within cosine `COSINE_FLOOR`; otherwise nothing is written.

The result needs ONNX Runtime (CPU or CUDA; other runtimes lack the contrib operator),
so the plain export stays the portable file. `vitrieval.optimization` records the
rewrite ("attention-fusion").
"""

from __future__ import annotations

import json
import stat
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from .model_metadata import PREFIX, read_model_metadata
from .onnx_files import publish, save_onnx

SCHEME = "attention-fusion"
OPTIMIZATION_KEY = PREFIX + "optimization"
QUANTIZATION_KEY = PREFIX + "quantization"
COSINE_FLOOR = 0.9999
CONTRIB_DOMAIN = "com.microsoft"
EXTERNAL_DATA_THRESHOLD = 1_800_000_000  # as training.export: a protobuf is capped at 2 GiB


class OptimizeError(RuntimeError):
    """The model cannot be optimised (nothing to fuse, already done) or disagrees after."""


@dataclass
class OptimizeReport:
    """What `optimize_model` wrote: how many attention blocks it fused, and the agreement
    (per-image cosine between the two models' embeddings) it checked."""

    src: Path
    dst: Path
    fused: int
    bytes_before: int
    bytes_after: int
    mean_cosine: float
    min_cosine: float
    n_check_images: int

    def summary(self) -> str:
        return (
            f"optimised {self.src.name} -> {self.dst} ({SCHEME}): {self.fused} attention "
            f"blocks fused, {self.bytes_after / 1e6:.1f} MB, cosine agreement with the plain "
            f"model mean {self.mean_cosine:.6f} min {self.min_cosine:.6f} on "
            f"{self.n_check_images} images"
        )


def optimize_model(
    src: str | Path, dst: str | Path, *, check_images: Sequence[Image.Image] | None = None
) -> OptimizeReport:
    """Write `src` with its attention blocks fused to `dst`, after checking agreement.

    `check_images`: images both models embed (default: three scikit-image photos and 16
    seeded random images); every cosine must reach `COSINE_FLOOR`. Raises
    `ModelMetadataError` for a file that is not a vitrieval model and `OptimizeError`
    for one already optimised or quantised, one without a fusable attention block, or
    a disagreement.
    """
    import onnx

    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        raise OptimizeError(f"refusing to overwrite the source model {src} with its optimised copy")
    read_model_metadata(src)  # a vitrieval model, or ModelMetadataError
    proto = onnx.load(str(src))
    props = {p.key: p.value for p in proto.metadata_props}
    if OPTIMIZATION_KEY in props:
        raise OptimizeError(f"{src} is already optimised ({json.loads(props[OPTIMIZATION_KEY])})")
    if QUANTIZATION_KEY in props:
        raise OptimizeError(
            f"{src} is quantised; optimise the FP32 model, then quantise the optimised one"
        )
    fused = fuse_attention(proto)
    if not fused:
        raise OptimizeError(
            f"{src} has no attention block of the pattern an exported timm ViT has "
            "(qkv MatMul, Split into q/k/v, Softmax); nothing to optimise"
        )
    entry = proto.metadata_props.add()
    entry.key, entry.value = OPTIMIZATION_KEY, json.dumps(SCHEME)
    images = list(check_images) if check_images is not None else default_check_images()
    if not images:
        raise ValueError("check_images is empty; pass None for the default images")
    with tempfile.TemporaryDirectory(prefix=f".{dst.name}.", dir=_parent(dst)) as work:
        staged = Path(work) / dst.name
        data_name = _save(proto, staged)
        cosines = _agreement(src, staged, images)
        if cosines.min() < COSINE_FLOOR:
            raise OptimizeError(
                f"the optimised model disagrees with {src}: cosine {cosines.min():.6f} < "
                f"{COSINE_FLOOR} on one of {len(images)} check images; nothing written"
            )
        size = staged.stat().st_size
        mode = stat.S_IMODE(staged.stat().st_mode)
        if data_name:
            size += (Path(work) / data_name).stat().st_size
            publish(Path(work) / data_name, dst.with_name(data_name), mode)
        publish(staged, dst, mode)
    from .quantize import rewrite_figures

    return OptimizeReport(src=src, dst=dst, fused=fused, **rewrite_figures(src, size, cosines))


def fuse_attention(model) -> int:
    """Replace every attention block of the exported-timm pattern in `model` (an
    onnx.ModelProto, changed in place) by one com.microsoft.Attention node; returns the
    number replaced. Blocks that deviate from the pattern in any way are left alone."""
    from onnx import TensorProto, helper

    graph = _Graph(model.graph)
    replacements = {}
    for softmax in graph.nodes_of("Softmax"):
        found = _match_attention(graph, softmax)
        if found is None:
            continue
        end, inputs, heads, scale = found
        attrs = {"num_heads": heads}
        if scale is not None:
            attrs["scale"] = scale
        prefix = end.name.rsplit("/", 1)[0] if "/" in end.name else end.name
        replacements[id(end)] = helper.make_node(
            "Attention",
            inputs,
            [end.output[0]],
            name=f"{prefix}/Attention",
            domain=CONTRIB_DOMAIN,
            **attrs,
        )
    if not replacements:
        return 0
    g = model.graph
    nodes = [replacements.get(id(node), node) for node in g.node]
    nodes = _live_nodes(nodes, {o.name for o in g.output})
    del g.node[:]
    g.node.extend(nodes)
    used = {name for node in nodes for name in node.input}
    initializers = [t for t in g.initializer if t.name in used]
    del g.initializer[:]
    g.initializer.extend(initializers)
    produced = {name for node in nodes for name in node.output}
    value_info = [v for v in g.value_info if v.name in produced]
    del g.value_info[:]
    g.value_info.extend(value_info)
    # The fused outputs' type, which shape inference cannot derive through a contrib
    # operator (the quantiser needs it)
    for node in replacements.values():
        g.value_info.append(helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT, None))
    if not any(o.domain == CONTRIB_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(CONTRIB_DOMAIN, 1))
    return len(replacements)


class _Graph:
    """Who produces and who consumes each tensor of an onnx.GraphProto."""

    def __init__(self, graph) -> None:
        self.graph = graph
        self.initializers = {t.name: t for t in graph.initializer}
        self.producer = {out: node for node in graph.node for out in node.output}
        self.consumers: dict[str, list] = {}
        for node in graph.node:
            for name in node.input:
                self.consumers.setdefault(name, []).append(node)
        self.outputs = {o.name for o in graph.output}

    def nodes_of(self, op: str) -> list:
        return [node for node in self.graph.node if node.op_type == op]

    def made_by(self, name: str, op: str):
        node = self.producer.get(name)
        return node if node is not None and node.op_type == op else None

    def sole_user(self, name: str, op: str):
        """The one node that reads `name`, if it is an `op` (and `name` is internal)."""
        users = self.consumers.get(name, [])
        if len(users) != 1 or users[0].op_type != op or name in self.outputs:
            return None
        return users[0]

    def initializer(self, name: str) -> str | None:
        """The initializer `name` is, or is an Identity of (the exporter shares equal
        weights that way); None for a computed tensor."""
        while name not in self.initializers:
            node = self.made_by(name, "Identity")
            if node is None:
                return None
            name = node.input[0]
        return name

    def constant(self, name: str) -> np.ndarray | None:
        from onnx import numpy_helper

        init = self.initializer(name)
        if init is not None:
            return numpy_helper.to_array(self.initializers[init])
        node = self.made_by(name, "Constant")
        if node is not None and len(node.attribute) == 1 and node.attribute[0].name == "value":
            return numpy_helper.to_array(node.attribute[0].t)
        return None


def _match_attention(graph: _Graph, softmax):
    """For a Softmax inside an exported timm attention block: (the block's last node,
    the Attention inputs [x, W, b], number of heads, scale or None for the default
    1/sqrt(head size)); None if anything deviates from the pattern

        x -> MatMul(W) -> Add(b) -> Reshape(B, N, 3, H, d) -> Transpose(2, 0, 3, 1, 4)
          -> Split(axis 0) -> Squeeze: q, k, v
        q [* s1], Transpose(k) [* s2] -> MatMul -> Softmax(-1) -> MatMul(v)
          -> Transpose(0, 2, 1, 3) -> Reshape(B, N, H d)

    where s1 * s2 is the scale: either both are the exporter's square roots of
    1/sqrt(d) (computed from shapes, so the default) or only q is scaled by a constant.
    """
    axis = _attr(softmax, "axis", -1)
    scores = graph.made_by(softmax.input[0], "MatMul")
    context = graph.sole_user(softmax.output[0], "MatMul")
    if scores is None or context is None or context.input[0] != softmax.output[0]:
        return None
    if axis not in (-1, 3) or graph.sole_user(scores.output[0], "Softmax") is None:
        return None
    merge = graph.sole_user(context.output[0], "Transpose")
    end = graph.sole_user(merge.output[0], "Reshape") if merge is not None else None
    if end is None or _attr(merge, "perm") != [0, 2, 1, 3]:
        return None
    q, q_factor = _unscaled(graph, scores.input[0])
    k_t, k_factor = _unscaled(graph, scores.input[1])
    transpose_k = graph.made_by(k_t, "Transpose")
    if transpose_k is None or _attr(transpose_k, "perm") != [0, 1, 3, 2]:
        return None
    squeezes = [graph.made_by(name, "Squeeze") for name in (q, transpose_k.input[0])]
    squeezes.append(graph.made_by(context.input[1], "Squeeze"))
    if any(s is None for s in squeezes):
        return None
    split = graph.made_by(squeezes[0].input[0], "Split")
    if split is None or list(split.output) != [s.input[0] for s in squeezes]:
        return None
    if _attr(split, "axis", 0) != 0:
        return None
    heads_first = graph.made_by(split.input[0], "Transpose")
    if heads_first is None or _attr(heads_first, "perm") != [2, 0, 3, 1, 4]:
        return None
    unpack = graph.made_by(heads_first.input[0], "Reshape")
    bias_add = graph.made_by(unpack.input[0], "Add") if unpack is not None else None
    if bias_add is None:
        return None
    bias_input = next((n for n in bias_add.input if graph.initializer(n)), None)
    other = [n for n in bias_add.input if n != bias_input]
    qkv = graph.made_by(other[0], "MatMul") if bias_input and len(other) == 1 else None
    weight = graph.initializer(qkv.input[1]) if qkv is not None else None
    if weight is None:
        return None
    shape = _reshape_target(graph, unpack)
    w = graph.constant(weight)
    b = graph.constant(bias_input)
    if shape is None or len(shape) != 5 or w is None or b is None:
        return None
    three, heads, head_dim = shape[2:]
    if three != 3 or w.ndim != 2 or w.shape[1] != 3 * heads * head_dim or b.shape != (w.shape[1],):
        return None
    scale = _scale(graph, q_factor, k_factor)
    if scale is False:
        return None
    return end, [qkv.input[0], weight, graph.initializer(bias_input)], heads, scale


def _unscaled(graph: _Graph, name: str) -> tuple[str, str | None]:
    """(the tensor before a Mul, the other factor's name) or (name, None) without one."""
    mul = graph.made_by(name, "Mul")
    if mul is None:
        return name, None
    data, factor = mul.input
    if graph.constant(data) is not None:
        data, factor = factor, data
    return data, factor


def _scale(graph: _Graph, q_factor: str | None, k_factor: str | None) -> float | bool | None:
    """The Attention `scale` for how q and k were scaled before QK^T.

    Both scaled by computed factors (the exporter's decomposition of
    scaled_dot_product_attention: sqrt(1/sqrt(d)) each): None, the operator's default
    1/sqrt(d), which the agreement check confirms. Only q, by a constant (timm's
    non-fused path, q * scale): that constant. Anything else: False (no match).
    """
    if q_factor is not None and k_factor is not None:
        computed = graph.constant(q_factor) is None and graph.constant(k_factor) is None
        return None if computed else False
    if q_factor is not None and k_factor is None:
        value = graph.constant(q_factor)
        if value is not None and np.asarray(value).size == 1:
            return float(np.asarray(value).reshape(-1)[0])
    return False


def _reshape_target(graph: _Graph, reshape) -> list[int] | None:
    """The static trailing sizes of a Reshape's target shape, batch and tokens
    (computed from Shape ops by the exporter) as -1."""
    shape = graph.constant(reshape.input[1])
    if shape is not None:
        return [int(v) for v in np.asarray(shape).reshape(-1)]
    concat = graph.made_by(reshape.input[1], "Concat")
    if concat is None:
        return None
    dims = []
    for name in concat.input:
        value = graph.constant(name)
        if value is None:
            dims.append(-1)
        elif np.asarray(value).size == 1:
            dims.append(int(np.asarray(value).reshape(-1)[0]))
        else:
            return None
    return dims


def _attr(node, name: str, default=None):
    from onnx import helper

    for attribute in node.attribute:
        if attribute.name == name:
            value = helper.get_attribute_value(attribute)
            return list(value) if isinstance(value, list | tuple) else value
    return default


def _live_nodes(nodes: list, outputs: set[str]) -> list:
    """`nodes` without those whose outputs nothing reads (repeated until none is left)."""
    while True:
        read = {name for node in nodes for name in node.input} | outputs
        live = [node for node in nodes if any(out in read for out in node.output)]
        if len(live) == len(nodes):
            return live
        nodes = live


def default_check_images() -> list[Image.Image]:
    """Three photos scikit-image ships and 16 seeded random images."""
    from skimage import data

    from .quantize import random_check_images

    photos = [data.astronaut(), data.coffee(), data.chelsea()]
    return [Image.fromarray(p).convert("RGB") for p in photos] + random_check_images()


def _agreement(plain: Path, optimised: Path, images: list[Image.Image]) -> np.ndarray:
    """Per-image cosine between the two models' embeddings: float32 (N,)."""
    from .embedder import Embedder

    reference = Embedder(plain, device="cpu").embed_images(images)
    candidate = Embedder(optimised, device="cpu").embed_images(images)
    return np.sum(reference * candidate, axis=1)


def _parent(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.parent


def _save(proto, path: Path) -> str | None:
    """Save `proto` to `path`; weights too big for one file go to `NAME.data` beside it
    (returns that name, else None)."""
    weights = sum(t.ByteSize() for t in proto.graph.initializer)
    data_name = path.name + ".data" if weights > EXTERNAL_DATA_THRESHOLD else None
    save_onnx(proto, path, data_name)
    return data_name


__all__ = ["COSINE_FLOOR", "SCHEME", "OptimizeError", "OptimizeReport", "optimize_model"]
