"""C-CBP (eq. 10) and JCF (eq. 13): identity, parameter counts, naive references, export."""

from __future__ import annotations

import math

import numpy as np
import onnxruntime as ort
import pytest
import torch

from training.config import FitConfig
from training.export import export_model, model_metadata
from training.model import build_model
from training.pooling import CCBP, JCF, create_pooling, pooling_names

SMALL = {"in_dim": 12, "d": 8, "out_dim": 6, "codebook": 5}


def randomise(module: torch.nn.Module, seed: int = 0, scale: float = 3.7) -> None:
    """O(1) random values in every parameter, and a softmax scale other than the default."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=gen))
        module.log_scale.fill_(math.log(scale))


def naive_local(module, patches: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reduction, per-token L2 norm and h(x) = softmax_j(s cos(x, c_j)), float64."""
    w, b = module.reduce.weight.double(), module.reduce.bias.double()
    x = patches.double() @ w.t() + b
    x = x / x.norm(dim=-1, keepdim=True)
    c = module.codebook.double()
    cos = x @ (c / c.norm(dim=-1, keepdim=True)).t()
    logits = module.log_scale.double().exp() * cos
    h = logits.exp() / logits.exp().sum(dim=-1, keepdim=True)
    return x, h


def naive_tokens(module, patches: torch.Tensor) -> torch.Tensor:
    """z_i(x) by eq. (10) or (13), one token and one output dimension at a time."""
    x, h = naive_local(module, patches)
    batch, tokens, _ = x.shape
    out = torch.empty(batch, tokens, module.out_dim, dtype=torch.float64)
    for n in range(batch):
        for t in range(tokens):
            xt, ht = x[n, t], h[n, t]
            for i in range(module.out_dim):
                if isinstance(module, JCF):  # (h^T A U~_i^T x)(h^T B V~_i^T x)
                    ut, vt = module.U_tilde[:, i, :].double(), module.V_tilde[:, i, :].double()
                    left = ht @ module.A.double() @ ut.t() @ xt
                    right = ht @ module.B.double() @ vt.t() @ xt
                else:  # (h^T U_i^T x)(h^T V_i^T x)
                    left = ht @ module.U[:, i, :].double().t() @ xt
                    right = ht @ module.V[:, i, :].double().t() @ xt
                out[n, t, i] = left * right
    return out


def naive_pooled(module, patches: torch.Tensor) -> torch.Tensor:
    z = naive_tokens(module, patches).mean(dim=1)
    return z / z.norm(dim=-1, keepdim=True)


def ccbp_from_jcf(jcf: JCF, swap: bool = False) -> CCBP:
    """The C-CBP with U_i = U~_i A^T and V_i = V~_i B^T (A and B swapped if `swap`)."""
    ccbp = CCBP(jcf.in_dim, d=jcf.d, out_dim=jcf.out_dim, codebook=jcf.codebook_size)
    a, b = (jcf.B, jcf.A) if swap else (jcf.A, jcf.B)
    with torch.no_grad():
        ccbp.reduce.load_state_dict(jcf.reduce.state_dict())
        ccbp.codebook.copy_(jcf.codebook)
        ccbp.log_scale.copy_(jcf.log_scale)
        ccbp.U.copy_(torch.einsum("kir,jr->kij", jcf.U_tilde, a))
        ccbp.V.copy_(torch.einsum("kir,jr->kij", jcf.V_tilde, b))
    return ccbp


@pytest.mark.parametrize(
    "sizes",
    [{**SMALL, "rank": 3}, {"in_dim": 64, "d": 256, "out_dim": 512, "codebook": 32, "rank": 8}],
)
def test_jcf_equals_ccbp_with_composed_projectors(sizes):
    torch.manual_seed(0)
    jcf = JCF(**sizes)
    randomise(jcf)
    with torch.no_grad():  # implied U, V of variance 1/d, as at the default initialisation
        jcf.U_tilde.mul_(1 / math.sqrt(sizes["d"] * sizes["rank"]))
        jcf.V_tilde.mul_(1 / math.sqrt(sizes["d"] * sizes["rank"]))
    patches = torch.randn(3, 11, sizes["in_dim"])
    out = jcf(patches)
    torch.testing.assert_close(ccbp_from_jcf(jcf)(patches), out, atol=1e-5, rtol=0)
    # The check can fail: with A and B exchanged the C-CBP is a different function.
    assert (ccbp_from_jcf(jcf, swap=True)(patches) - out).abs().max() > 1e-2


def test_parameter_counts_match_the_formulas():
    n, r, d, dim, in_dim = 32, 8, 256, 512, 384
    jcf, ccbp = JCF(in_dim), CCBP(in_dim)
    assert jcf.factorised_parameters() == 2 * (r * d * dim + n * r) == 2_097_664
    assert ccbp.factorised_parameters() == 2 * n * d * dim == 8_388_608
    rest = n * d + in_dim * d + d + 1  # codebook, reduction layer, s
    assert sum(p.numel() for p in jcf.parameters()) == 2_097_664 + rest
    assert sum(p.numel() for p in ccbp.parameters()) == 8_388_608 + rest
    # The factorised part shrinks by about R/N (exactly R/N + R/(dD)).
    ratio = jcf.factorised_parameters() / ccbp.factorised_parameters()
    assert ratio == pytest.approx(r / n + r / (d * dim))
    # A small case, and the shapes the paper gives: U, V (d, D, N); U~, V~ (d, D, R); A, B (N, R).
    n, r, d, dim, in_dim = 4, 2, 6, 5, 10
    jcf = JCF(in_dim, d=d, out_dim=dim, codebook=n, rank=r)
    ccbp = CCBP(in_dim, d=d, out_dim=dim, codebook=n)
    assert jcf.factorised_parameters() == 2 * (r * d * dim + n * r) == 136
    assert ccbp.factorised_parameters() == 2 * n * d * dim == 240
    rest = n * d + in_dim * d + d + 1
    assert sum(p.numel() for p in jcf.parameters()) == 136 + rest
    assert sum(p.numel() for p in ccbp.parameters()) == 240 + rest
    assert ccbp.U.shape == ccbp.V.shape == (d, dim, n)
    assert jcf.U_tilde.shape == jcf.V_tilde.shape == (d, dim, r)
    assert jcf.A.shape == jcf.B.shape == (n, r)
    assert jcf.codebook.shape == ccbp.codebook.shape == (n, d)


@pytest.mark.parametrize("cls", [CCBP, JCF])
def test_matches_naive_reference(cls):
    torch.manual_seed(1)
    module = cls(**SMALL, **({"rank": 3} if cls is JCF else {}))
    randomise(module, seed=2)
    patches = torch.randn(2, 7, SMALL["in_dim"])
    with torch.no_grad():
        tokens = module.token_features(patches).double()
        pooled = module(patches).double()
    expected = naive_tokens(module, patches)
    assert expected.abs().max() > 1.0  # order-one values, so the tolerance means something
    torch.testing.assert_close(tokens, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pooled, naive_pooled(module, patches), atol=1e-6, rtol=0)


def test_ccbp_hard_assignment_uses_the_nearest_codewords_projectors():
    # With s huge, h(x) is one-hot on the nearest codeword j and eq. (10) reduces to
    # z_i(x) = <u_ij ; x> <v_ij ; x>, a rank-one bilinear feature (eq. 6) per codeword.
    torch.manual_seed(3)
    module = CCBP(**SMALL, scale=1e4)
    patches = torch.randn(1, 9, SMALL["in_dim"])
    with torch.no_grad():
        x, h = module.local_features(patches)
        nearest = (x @ torch.nn.functional.normalize(module.codebook, dim=-1).t()).argmax(-1)
        assert torch.equal(h.argmax(-1), nearest) and h.amax(-1).min() > 0.999
        u = module.U.permute(2, 1, 0)[nearest[0]]  # (T, D, d): u_ij for each token's j
        v = module.V.permute(2, 1, 0)[nearest[0]]
        expected = (u @ x[0, :, :, None]).squeeze(-1) * (v @ x[0, :, :, None]).squeeze(-1)
        torch.testing.assert_close(module.token_features(patches)[0], expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("cls", [CCBP, JCF])
def test_shape_unit_norm_gradients_and_prefix_tokens(cls):
    torch.manual_seed(4)
    module = cls(**SMALL)
    tokens = torch.randn(3, 2 + 10, SMALL["in_dim"])
    tokens[:, :2] = 100.0  # prefix tokens that must not leak in
    out = module(tokens, num_prefix_tokens=2)
    assert out.shape == (3, SMALL["out_dim"]) and out.dtype == torch.float32
    torch.testing.assert_close(out.norm(dim=-1), torch.ones(3))
    torch.testing.assert_close(out, module(tokens[:, 2:]))
    assert (module(tokens) - out).abs().max() > 1e-3  # with the prefix counted it differs
    # Not degenerate at the default initialisation: images get different directions.
    assert (out @ out.t()).fill_diagonal_(0).abs().max() < 0.99
    weights = torch.randn(3, SMALL["out_dim"])
    (out * weights).sum().backward()
    for name, param in module.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


@pytest.mark.parametrize("cls", [CCBP, JCF])
def test_head_computes_in_fp32_under_autocast(cls):
    torch.manual_seed(5)
    module = cls(**SMALL)
    patches = torch.randn(2, 6, SMALL["in_dim"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = module(patches.bfloat16())
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, module(patches.bfloat16().float()), atol=1e-6, rtol=0)


def test_registry_defaults_and_options():
    assert {"ccbp", "jcf"} <= set(pooling_names())  # so test_export checks their parity too
    pool, out_dim = create_pooling("jcf", in_dim=128, num_heads=4)
    assert isinstance(pool, JCF) and out_dim == 512
    assert (pool.d, pool.codebook_size, pool.rank) == (256, 32, 8)
    assert pool.scale.item() == pytest.approx(10.0)
    pool, out_dim = create_pooling("ccbp", in_dim=128, num_heads=4)
    assert isinstance(pool, CCBP) and out_dim == 512 and pool.U.shape == (256, 512, 32)
    pool, out_dim = create_pooling("jcf", 16, 2, d=8, out_dim=24, codebook=4, rank=2)
    assert out_dim == 24 and pool.U_tilde.shape == (8, 24, 2) and pool.A.shape == (4, 2)
    pool, out_dim = create_pooling("ccbp", 16, 2, d=8, out_dim=24, codebook=4)
    assert out_dim == 24 and pool.U.shape == (8, 24, 4)
    with pytest.raises(ValueError, match="rank"):
        JCF(16, rank=0)
    with pytest.raises(ValueError, match="codebook"):
        CCBP(16, codebook=0)


@pytest.mark.parametrize("pool", ["ccbp", "jcf"])
def test_onnx_export_parity_with_options(tmp_path, pool):
    torch.manual_seed(6)
    options = {"d": 32, "out_dim": 48, "codebook": 8, **({"rank": 4} if pool == "jcf" else {})}
    model = build_model("tiny", pool, pool_options=options)
    report = export_model(
        model, model_metadata(model, FitConfig(out="x", pool=pool)), tmp_path / "m.onnx"
    )
    assert max(report.max_abs_diff.values()) <= 1e-4
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(7).standard_normal((4, 3, 32, 32)).astype(np.float32)
    (out,) = session.run(["embeddings"], {"images": x})
    assert out.shape == (4, 48)
    with torch.no_grad():
        np.testing.assert_allclose(out, model(torch.from_numpy(x)).numpy(), atol=1e-4)
