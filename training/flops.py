"""Analytic FLOPs per image of an EmbeddingModel, and a counter of the FLOPs a call runs.

Convention (that of `torch.utils.flop_counter.FlopCounterMode`): 2 FLOPs per
multiply-add of a matrix product (linear layers, matmuls, the patch-embedding
convolution, the two products of attention, and the second-order heads' Kronecker
products, computed as batched outer products); bias additions and element-wise work
(normalisation, softmax, GELU, the Hadamard product of the two factors, token averaging)
are not counted.
Forward pass only; a training step's backward pass costs two more of each product whose
input needs a gradient (about 3x the forward in all).

`counted_flops` checks the formulas against what torch actually runs. It counts the
matrix products as they are dispatched, by their operand shapes, with attention computed
by its math backend (two batched products, QK^T and AV). FlopCounterMode on its own is
not a stable reference across torch versions: which fused attention kernel the default
backend picks, and whether the counter has a formula for it, change between releases
(torch 2.14 has none for `_scaled_dot_product_flash_attention_for_cpu` and leaves the
attention products out; 2.15 counts them).

For an image of T patch tokens of width C (P prefix tokens besides), a head of
reduction width d, codebook size N, output width D and (JCF) R shared projectors:

    reduction x = W t          2 T C d
    assignment cos(x, c_j)     2 T d N
    C-CBP (eq. 10)             2 T N d              h ⊗ x, shared by both factors
                             + 2 * 2 T (N d) D      the factors h^T U_i^T x, h^T V_i^T x
    JCF (eq. 13)               2 * 2 T N R          f_p(h) = A^T h, f_q(h) = B^T h
                             + 2 * 2 T R d          (A^T h) ⊗ x, (B^T h) ⊗ x
                             + 2 * 2 T (R d) D      the factors over the shared projectors

The Kronecker products are batched outer products (`torch.bmm` over an inner dimension
of 1), which the profiler counts as matrix products, 2 FLOPs per element. The products
with U, V (U~, V~) dominate, so the factorised part of JCF costs about R/N of C-CBP's,
the paper's "factor R/N" (its sec. 3.3), while the reduction and the assignment do not
shrink. First-order poolings (cls, avg, max, gem, ggem) have no matrix product: 0 by
this convention.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

from .pooling import CCBP, JCF
from .pooling.ccbp import CodebookPooling


def pooling_flops(pool: nn.Module, tokens: int, width: int) -> dict[str, int]:
    """Forward FLOPs per image of a pooling head on `tokens` patch tokens of `width`.

    Returns the parts `reduce`, `assign`, `mix` (JCF's A^T h and B^T h), `kron` (the
    Kronecker products with x), `project` (the products with U, V or U~, V~),
    `factorised` (= mix + kron + project: eq. 10 or 13 given x and h, what the paper
    factorises) and `total`.
    """
    parts = dict.fromkeys(("reduce", "assign", "mix", "kron", "project"), 0)
    if isinstance(pool, CodebookPooling):
        t, d, n, dim = tokens, pool.d, pool.codebook_size, pool.out_dim
        parts["reduce"] = 2 * t * width * d
        parts["assign"] = 2 * t * d * n
        if isinstance(pool, JCF):
            r = pool.rank
            parts["mix"] = 2 * (2 * t * n * r)
            parts["kron"] = 2 * (2 * t * r * d)
            parts["project"] = 2 * (2 * t * r * d * dim)
        elif isinstance(pool, CCBP):
            parts["kron"] = 2 * t * n * d
            parts["project"] = 2 * (2 * t * n * d * dim)
        else:
            raise TypeError(f"no FLOP formula for {type(pool).__name__}")
    parts["factorised"] = parts["mix"] + parts["kron"] + parts["project"]
    parts["total"] = parts["reduce"] + parts["assign"] + parts["factorised"]
    return parts


def vit_flops(backbone: nn.Module) -> int:
    """Forward FLOPs per image of a timm VisionTransformer's `forward_features`.

    With T patches of p x p x c_in pixels, T' = T + P tokens of width C, and per block
    an MLP of hidden width H:

        patch embedding   2 T (c_in p^2) C
        per block         2 T' C 3C  (qkv) + 2 * 2 T'^2 C  (QK^T, AV) + 2 T' C C  (proj)
                          + 2 * 2 T' C H  (fc1, fc2)
    """
    proj = backbone.patch_embed.proj
    patches = backbone.patch_embed.num_patches
    width = proj.out_channels
    total = 2 * patches * proj.in_channels * proj.kernel_size[0] * proj.kernel_size[1] * width
    seq = patches + int(getattr(backbone, "num_prefix_tokens", 0))
    for block in backbone.blocks:
        hidden = block.mlp.fc1.out_features
        total += 2 * seq * width * block.attn.qkv.out_features
        total += 2 * 2 * seq * seq * width
        total += 2 * seq * width * block.attn.proj.out_features
        total += 2 * 2 * seq * width * hidden
    return total


def model_flops(model: nn.Module) -> dict[str, int]:
    """Forward FLOPs per image of an EmbeddingModel: `backbone`, `pool`, `proj`, `total`."""
    backbone = model.backbone
    width = int(backbone.num_features)
    tokens = backbone.patch_embed.num_patches
    pool = pooling_flops(model.pool, tokens, width)["total"]
    proj = 0
    if isinstance(model.proj, nn.Linear):
        proj = 2 * model.proj.in_features * model.proj.out_features
    parts = {"backbone": vit_flops(backbone), "pool": pool, "proj": proj}
    parts["total"] = sum(parts.values())
    return parts


def _product_flops(func: Any, args: tuple, out: Any) -> int | None:
    """FLOPs of one dispatched matrix product, None for an op that is not one we count."""
    name = func.overloadpacket.__name__
    if name in ("mm", "addmm", "bmm", "baddbmm"):
        a, b = (args[0], args[1]) if name in ("mm", "bmm") else (args[1], args[2])
        # (..., m, k) @ (..., k, n): 2 m k n per matrix of the batch
        return 2 * math.prod(a.shape) * b.shape[-1]
    if name in ("convolution", "_convolution"):
        x, w, transposed = args[0], args[1], args[6]
        # every output (input, if transposed) element: C_in / groups x kernel multiply-adds
        return 2 * math.prod((x if transposed else out).shape) * math.prod(w.shape[1:])
    if name == "convolution_backward":
        grad_out, x, w, transposed, mask = args[0], args[1], args[2], args[7], args[10]
        forward = 2 * math.prod((x if transposed else grad_out).shape) * math.prod(w.shape[1:])
        return forward * (int(mask[0]) + int(mask[1]))  # grad_input, grad_weight
    return None


# Ops that multiply matrices (or fuse attention) but that _product_flops does not count:
# met, they stop the count rather than leave their FLOPs out.
_UNCOUNTED_PRODUCT = re.compile(r"attention|matmul|mm(_|$)|conv(?!ert)|linear$|dot$|^(add)?mv$")


class _ProductCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flops = _product_flops(func, args, out)
        if flops is not None:
            self.total += flops
        elif _UNCOUNTED_PRODUCT.search(func.overloadpacket.__name__):
            raise NotImplementedError(f"counted_flops: no FLOP count for {func}")
        return out


def counted_flops(fn: Callable[[], Any]) -> int:
    """FLOPs of the matrix products that run while `fn()` runs, by the convention above.

    Matrix products (mm, addmm, bmm, baddbmm) and convolutions, forward and backward, are
    counted from their operand shapes as torch dispatches them; attention runs on the
    math backend, so its two products are batched matmuls too. A product op outside
    that list (a fused attention kernel, `_addmm_activation`, mv ...) raises
    NotImplementedError instead of being left out of the count.
    """
    counter = _ProductCounter()
    with sdpa_kernel([SDPBackend.MATH]), counter:
        fn()
    return counter.total
