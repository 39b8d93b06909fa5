"""C-CBP (eq. 10) and JCF (eq. 13): identity, parameter counts, references, FLOPs, CLI, export."""

from __future__ import annotations

import math

import numpy as np
import onnxruntime as ort
import pytest
import torch
import yaml
from safetensors.torch import load_file
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from vitrieval.training.cli import build_parser, main
from vitrieval.training.config import FitConfig, config_from_args
from vitrieval.training.export import export_model, model_metadata
from vitrieval.training.flops import counted_flops, model_flops, pooling_flops
from vitrieval.training.model import build_model
from vitrieval.training.pooling import CCBP, JCF, create_pooling, pooling_names
from vitrieval.training.run_folder import model_from_config

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


def profiler_counted(fn) -> int:
    """FlopCounterMode's count, attention on the math backend (plain batched matmuls)."""
    with sdpa_kernel([SDPBackend.MATH]), FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize("cls", [CCBP, JCF])
def test_analytic_flops_match_the_flop_counter(cls):
    # 2 FLOPs per multiply-add of every matrix product, counted as torch dispatches them.
    torch.manual_seed(8)
    module = cls(**SMALL, **({"rank": 3} if cls is JCF else {}))
    batch, prefix, tokens = 3, 2, 7
    patches = torch.randn(batch, prefix + tokens, SMALL["in_dim"], requires_grad=True)
    formula = pooling_flops(module, tokens, SMALL["in_dim"])
    t, c, d, dim, n = tokens, SMALL["in_dim"], SMALL["d"], SMALL["out_dim"], SMALL["codebook"]
    by_hand = 2 * t * c * d + 2 * t * d * n  # reduction, assignment
    if cls is JCF:  # A^T h and B^T h, two Kronecker products with x, two factors
        by_hand += 4 * t * n * 3 + 4 * t * 3 * d + 4 * t * 3 * d * dim
    else:  # one Kronecker product h ⊗ x, two factors
        by_hand += 2 * t * n * d + 4 * t * n * d * dim
    assert formula["total"] == by_hand == 2 * 7 * 12 * 8 + 2 * 7 * 8 * 5 + formula["factorised"]
    with torch.no_grad():
        forward = counted_flops(lambda: module(patches, num_prefix_tokens=prefix))
    assert forward == batch * formula["total"]
    # Training: every product also gives both input gradients, 3x the forward in all.
    assert counted_flops(lambda: module(patches, prefix).sum().backward()) == 3 * forward


def test_analytic_model_flops_match_the_flop_counter():
    options = {"d": 16, "out_dim": 24, "codebook": 4, "rank": 2}
    images = torch.randn(2, 3, 32, 32)
    totals = {}
    for pool, dim in (("jcf", None), ("jcf", 20), ("avg", None)):
        model = build_model("tiny", pool, dim=dim, pool_options=options if pool == "jcf" else {})
        with torch.no_grad():
            assert counted_flops(lambda m=model: m(images)) == 2 * model_flops(model)["total"]
        totals[pool, dim] = model_flops(model)
    # tiny: 64 patches of 4x4x3, 65 tokens of width 128, 4 blocks with MLP width 256.
    per_block = 2 * 65 * 128 * 384 + 4 * 65 * 65 * 128 + 2 * 65 * 128 * 128 + 4 * 65 * 128 * 256
    assert totals["avg", None]["backbone"] == 2 * 64 * 48 * 128 + 4 * per_block
    assert totals["avg", None]["pool"] == 0 and totals["jcf", 20]["proj"] == 2 * 24 * 20


def test_the_counter_counts_what_flop_counter_mode_counts():
    # Both count the same dispatched products once attention is plain batched matmuls:
    # convolution, addmm, bmm, mm, forward and backward (grad of the patch-embedding weight).
    options = {"d": 16, "out_dim": 24, "codebook": 4, "rank": 2}
    model = build_model("tiny", "jcf", dim=20, pool_options=options)
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        forward = counted_flops(lambda: model(images))
        assert forward == profiler_counted(lambda: model(images))
    train = counted_flops(lambda: model(images).sum().backward())
    assert train == profiler_counted(lambda: model(images).sum().backward())
    # backward: grad of the input and of the weight of every product but the patch
    # embedding's, whose input (the images) needs none
    patch_embed = 2 * 2 * 64 * 48 * 128
    assert train == 3 * forward - patch_embed


def test_the_counter_refuses_products_it_cannot_count():
    # A fused kernel left out of the count would make the analytic formulas look wrong
    # (or, worse, right): the counter stops instead.
    a, v = torch.randn(3, 4), torch.randn(4)
    with pytest.raises(NotImplementedError, match="mv"):
        counted_flops(lambda: torch.mv(a, v))
    with pytest.raises(NotImplementedError, match="_addmm_activation"):
        counted_flops(
            lambda: torch.ops.aten._addmm_activation(torch.randn(5), a, torch.randn(4, 5))
        )
    assert counted_flops(lambda: a @ a.t()) == 2 * 3 * 4 * 3
    # scaled_dot_product_attention: QK^T and AV, whichever kernel the default would pick
    q, k, val = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 4)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    assert counted_flops(lambda: sdpa(q, k, val)) == 2 * 2 * 3 * 5 * 7 * (8 + 4)


def test_jcf_factorised_flops_are_r_over_n_of_ccbp():
    jcf, ccbp = JCF(192), CCBP(192)  # the paper's sizes: d 256, D 512, N 32, R 8
    f_jcf, f_ccbp = pooling_flops(jcf, 64, 192), pooling_flops(ccbp, 64, 192)
    assert f_jcf["project"] / f_ccbp["project"] == 8 / 32
    # A^T h, B^T h and the Kronecker products move the whole ratio in the fourth digit only.
    ratio = (4 * 8 * 256 * 512 + 4 * 32 * 8 + 4 * 8 * 256) / (4 * 32 * 256 * 512 + 2 * 32 * 256)
    assert f_jcf["factorised"] / f_ccbp["factorised"] == pytest.approx(ratio, rel=1e-12)
    assert 0.250 < ratio < 0.251
    assert f_jcf["reduce"] == f_ccbp["reduce"] and f_jcf["assign"] == f_ccbp["assign"]


SIZE_FLAGS = ["--pool-dim", "16", "--pool-out-dim", "24", "--pool-codebook", "6"]


def test_pool_size_flags_reach_the_head(tmp_path):
    args = build_parser().parse_args(
        ["fit", "--out", "x", "--pool", "jcf", *SIZE_FLAGS, "--pool-rank", "3"]
    )
    model = model_from_config(config_from_args(args))
    pool = model.pool
    assert isinstance(pool, JCF) and model.embedding_dim == 24
    assert pool.U_tilde.shape == pool.V_tilde.shape == (16, 24, 3)
    assert pool.A.shape == (6, 3) and pool.codebook.shape == (6, 16)
    assert pool.reduce.weight.shape == (16, 128)  # tiny preset tokens are 128 wide
    args = build_parser().parse_args(["fit", "--out", "x", "--pool", "ccbp", *SIZE_FLAGS])
    model = model_from_config(config_from_args(args))
    assert isinstance(model.pool, CCBP) and model.pool.U.shape == (16, 24, 6)
    # From a config file too; without the flags, the paper's sizes.
    config = tmp_path / "c.yaml"
    config.write_text("pool: jcf\npool_rank: 2\npool_dim: 8\n")
    args = build_parser().parse_args(["fit", "--out", "x", "--config", str(config)])
    assert model_from_config(config_from_args(args)).pool.U_tilde.shape == (8, 512, 2)
    pool = model_from_config(FitConfig(out="x", pool="jcf")).pool
    assert pool.U_tilde.shape == (256, 512, 8) and pool.A.shape == (32, 8)


def test_fit_saves_and_uses_pool_size_flags(tmp_path):
    run = tmp_path / "run"
    fast = ["--epochs", "1", "--batch-size", "256", "--workers", "0", "--warmup-epochs", "0"]
    args = ["fit", "--dataset", "digits", "--pool", "jcf", *SIZE_FLAGS, "--pool-rank", "3"]
    assert main([*args, *fast, "--out", str(run)]) == 0
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert (saved["pool_dim"], saved["pool_out_dim"], saved["pool_codebook"]) == (16, 24, 6)
    assert saved["pool_rank"] == 3
    weights = load_file(str(run / "model.safetensors"))
    assert weights["pool.U_tilde"].shape == (16, 24, 3) and weights["pool.A"].shape == (6, 3)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--pool", "ggem", "--pool-rank", "4"], "--pool-rank is an option of --pool jcf;"),
        (["--pool", "ccbp", "--pool-rank", "4"], "--pool ccbp does not take it"),
        (["--pool", "avg", "--pool-dim", "64"], "--pool-dim is an option of --pool ccbp | jcf"),
        (["--pool", "jcf", "--pool-groups", "3"], "--pool-groups is an option of --pool ggem"),
        (["--pool", "jcf", "--pool-codebook", "0"], "--pool-codebook must be >= 1, got 0"),
    ],
)
def test_pool_size_flags_refused_where_they_do_nothing(tmp_path, capsys, args, needle):
    run = tmp_path / "r"
    assert main(["fit", "--out", str(run), *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert err.count("\n") == 1
    assert not run.exists()


def test_codebook_heads_default_to_the_lower_learning_rate():
    """At 2e-3 the codebook heads collapse from scratch (docs/training.md); 5e-4 trains."""
    for pool, lr in (("jcf", 5e-4), ("ccbp", 5e-4), ("ggem", 2e-3), ("avg", 2e-3)):
        args = build_parser().parse_args(["fit", "--out", "x", "--pool", pool])
        assert config_from_args(args).resolved().lr == lr
    args = build_parser().parse_args(["fit", "--out", "x", "--pool", "jcf", "--lr", "1e-3"])
    assert config_from_args(args).resolved().lr == 1e-3
