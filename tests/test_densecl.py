"""DenseCL++ pretraining: the losses against naive loops, the samplers' rules, and
`vitrieval-train pretrain` end to end (resume, export, index, fit --init, user errors)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from PIL import Image
from safetensors.torch import load_file

from vitrieval.index.cli import main as index_main
from vitrieval.index.runtime.model_metadata import read_model_metadata
from vitrieval.training.checkpoint import CheckpointError
from vitrieval.training.cli import build_parser, main
from vitrieval.training.config import FitConfig, config_from_args
from vitrieval.training.export import load_run_model
from vitrieval.training.losses import DenseContrastiveLoss, InfoNCELoss, SupConLoss
from vitrieval.training.run_folder import init_weights, model_from_config

B, T, C_PROJ, C_FEAT = 3, 4, 5, 6


def unit(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(*shape, generator=g, dtype=torch.float64), dim=-1)


def others(a: int, b: int) -> list[int]:
    """The views of images other than anchor view a's, ascending."""
    return [j for j in range(2 * b) if j % b != a % b]


def cos(x: torch.Tensor, y: torch.Tensor) -> float:
    return float(x @ y / (x.norm() * y.norm()))


def term(pos: float, negs: list[float], tau: float) -> float:
    """-log(exp(pos/tau) / (exp(pos/tau) + sum exp(neg/tau))), every exponent over tau."""
    return -math.log(
        math.exp(pos / tau) / (math.exp(pos / tau) + sum(math.exp(n / tau) for n in negs))
    )


# -- InfoNCE ------------------------------------------------------------------------------


def naive_info_nce(z: torch.Tensor, tau: float) -> float:
    n = z.shape[0]
    b = n // 2
    total = 0.0
    for i in range(n):
        p = (i + b) % n
        negs = [float(z[i] @ z[a]) for a in range(n) if a not in (i, p)]
        total += term(float(z[i] @ z[p]), negs, tau)
    return total / n


def angles(*degrees: float) -> torch.Tensor:
    return torch.tensor(
        [[math.cos(math.radians(d)), math.sin(math.radians(d))] for d in degrees],
        dtype=torch.float64,
    )


@pytest.mark.parametrize(("tau", "expected"), [(0.1, 0.0128721), (1.0, 0.632443)])
def test_info_nce_by_hand_on_two_images(tau, expected):
    # Image 0's views at 0 and 30 degrees are rows 0 and 2, image 1's at 90 and 120 are
    # rows 1 and 3. Anchor 0: positive cos 30 = sqrt3/2, negatives cos 90 = 0 and
    # cos 120 = -1/2, so l_0 = log(1 + e^(-sqrt3/(2 tau)) + e^(-(1 + sqrt3)/(2 tau)));
    # anchor 30: l_30 = log(1 + e^((1 - sqrt3)/(2 tau)) + e^(-sqrt3/(2 tau))); anchors
    # 120 and 90 mirror them, so L = (l_0 + l_30) / 2.
    s3 = math.sqrt(3.0)
    l0 = math.log(1 + math.exp(-s3 / (2 * tau)) + math.exp(-(1 + s3) / (2 * tau)))
    l30 = math.log(1 + math.exp((1 - s3) / (2 * tau)) + math.exp(-s3 / (2 * tau)))
    assert (l0 + l30) / 2 == pytest.approx(expected, abs=1e-6)
    z = angles(0, 90, 30, 120)
    assert InfoNCELoss(tau)(z).item() == pytest.approx(expected, abs=1e-6)


def test_info_nce_matches_naive_loop_and_supcon():
    z = unit(2 * B, C_PROJ, seed=1)
    got = InfoNCELoss(0.2)(z).item()
    assert got == pytest.approx(naive_info_nce(z, 0.2), rel=1e-5)
    # one positive per anchor: SupCon with the image index as the label is the same loss
    labels = torch.arange(2 * B) % B
    assert got == pytest.approx(SupConLoss(0.2)(z, labels).item(), rel=1e-5)
    # the pairing is i <-> i + B: swapping the halves' order changes the loss
    assert InfoNCELoss(0.2)(z[[0, 1, 2, 4, 3, 5]]).item() != pytest.approx(got, rel=1e-3)


# -- dense loss: naive reference ------------------------------------------------------------


def naive_match(f: torch.Tensor) -> list[list[int]]:
    """k+ for every (view, token): argmax over the partner view's tokens of the cosine."""
    n, t = f.shape[:2]
    b = n // 2
    match = []
    for a in range(n):
        p = (a + b) % n
        match.append(
            [max(range(t), key=lambda m, a=a, k=k: cos(f[a, k], f[p, m])) for k in range(t)]
        )
    return match


def naive_dense(
    z: torch.Tensor,
    match: list[list[int]],
    tau: float,
    negatives: str,
    tokens: torch.Tensor | None = None,
    cross_n: int = 0,
) -> float:
    """Eq. 1 / eq. 2 token by token; `tokens[a, jj]` is the sampled token of view
    others(a)[jj] (random / guided)."""
    n, t = z.shape[:2]
    b = n // 2
    total = 0.0
    for a in range(n):
        p = (a + b) % n
        views = others(a, b)
        if negatives == "densecl":
            neg_vecs = [F.normalize(z[j].mean(0), dim=0) for j in views]
        else:
            neg_vecs = [z[j, int(tokens[a, jj])] for jj, j in enumerate(views)]
        for k in range(t):
            pos = float(z[a, k] @ z[p, match[a][k]])
            negs = [float(z[a, k] @ v) for v in neg_vecs]  # the same set for every k
            if cross_n:
                candidates = [m for m in range(t) if m != match[a][k]]
                far = sorted(candidates, key=lambda m, a=a, k=k, p=p: float(z[a, k] @ z[p, m]))
                negs += [float(z[a, k] @ z[p, m]) for m in far[:cross_n]]
            total += term(pos, negs, tau)
    return total / (n * t)


def permuted_features(seed: int) -> tuple[torch.Tensor, list[list[int]]]:
    """Backbone features whose matches are known: view i + B holds view i's tokens in a
    per-image permuted order, plus a little noise."""
    g = torch.Generator().manual_seed(seed)
    first = torch.randn(B, T, C_FEAT, generator=g, dtype=torch.float64)
    perms = [torch.randperm(T, generator=g) for _ in range(B)]
    second = torch.stack([first[i][perms[i]] for i in range(B)])
    f = torch.cat([first, second]) + 0.01 * torch.randn(2 * B, T, C_FEAT, generator=g)
    match = []
    for i in range(B):  # token k of view i sits at position perm^-1(k) of view i + B
        inverse = torch.argsort(perms[i])
        match.append([int(inverse[k]) for k in range(T)])
    for i in range(B):  # token k of view i + B is token perm(k) of view i
        match.append([int(perms[i][k]) for k in range(T)])
    return f, match


def test_correspondence_is_the_argmax_of_backbone_features():
    f, expected = permuted_features(seed=2)
    loss = DenseContrastiveLoss()
    assert loss.correspondence(f).tolist() == expected
    assert naive_match(f) == expected
    # the projections play no part in matching: z's own argmax would differ
    z = unit(2 * B, T, C_PROJ, seed=3)
    assert naive_match(z) != expected


@pytest.mark.parametrize("tau", [0.1, 0.5])
def test_densecl_negatives_match_naive_loop(tau):
    f, match = permuted_features(seed=4)
    z = unit(2 * B, T, C_PROJ, seed=5).requires_grad_()
    f.requires_grad_()
    loss = DenseContrastiveLoss("densecl", temperature=tau)
    value = loss(z, f)
    assert value.item() == pytest.approx(naive_dense(z.detach(), match, tau, "densecl"), rel=1e-6)
    value.backward()
    assert z.grad is not None and z.grad.abs().sum() > 0
    assert f.grad is None  # nothing flows through the matching


def test_random_negatives_obey_the_rules():
    loss = DenseContrastiveLoss("random")
    z = unit(2 * B, T, C_PROJ, seed=6)
    views = loss.other_views(2 * B)
    for a in range(2 * B):  # other images only, each of their views exactly once
        assert views[a].tolist() == others(a, B)
    tokens = loss.negative_tokens(z, torch.Generator().manual_seed(0))
    assert tokens.shape == (2 * B, 2 * (B - 1))  # one token per other-image view, per anchor
    assert int(tokens.min()) >= 0 and int(tokens.max()) < T
    again = loss.negative_tokens(z, torch.Generator().manual_seed(0))
    assert torch.equal(tokens, again)  # reproducible from the generator
    # uniform over the tokens: every token is drawn across a few batches
    drawn = torch.cat([loss.negative_tokens(z, torch.Generator().manual_seed(s)) for s in range(5)])
    assert set(drawn.flatten().tolist()) == set(range(T))


@pytest.mark.parametrize("cross_n", [0, 2])
def test_random_negatives_loss_matches_naive_loop(cross_n):
    f, match = permuted_features(seed=7)
    z = unit(2 * B, T, C_PROJ, seed=8)
    loss = DenseContrastiveLoss("random", temperature=0.2, cross_view_negatives=cross_n)
    tokens = loss.negative_tokens(z, torch.Generator().manual_seed(11))
    value = loss(z, f, torch.Generator().manual_seed(11)).item()
    # the anchor's T tokens share one set: the reference uses tokens[a] for every k
    expected = naive_dense(z, match, 0.2, "random", tokens, cross_n)
    assert value == pytest.approx(expected, rel=1e-6)


def naive_guided_scores(z: torch.Tensor, sets: torch.Tensor, beta: float) -> torch.Tensor:
    n, t = z.shape[:2]
    b = n // 2
    scores = torch.zeros(n, sets.shape[1], dtype=torch.float64)
    for a in range(n):
        views = others(a, b)
        for s in range(sets.shape[1]):
            qs = []
            for k in range(t):
                for jj, j in enumerate(views):
                    q = float(z[a, k] @ z[j, int(sets[a, s, jj])])
                    qs.append(-1.0 if q <= beta else q)  # eq. 3
            scores[a, s] = sum(qs) / len(qs)
    return scores


def test_guided_picks_the_set_with_highest_thresholded_mean():
    z = unit(2 * B, T, C_PROJ, seed=9)
    loss = DenseContrastiveLoss("guided", candidates=16, beta=0.5)
    sets = loss.candidate_sets(2 * B, T, 16, torch.Generator().manual_seed(3))
    assert sets.shape == (2 * B, 16, 2 * (B - 1))
    expected = naive_guided_scores(z, sets, 0.5)
    torch.testing.assert_close(loss.guided_scores(z, sets), expected.to(z.dtype))
    chosen = loss.negative_tokens(z, torch.Generator().manual_seed(3))
    best = expected.argmax(dim=1)
    assert torch.equal(chosen, sets[torch.arange(2 * B), best])
    # the threshold matters here: the raw mean (beta = -1) prefers other sets
    raw = naive_guided_scores(z, sets, -1.0).argmax(dim=1)
    assert not torch.equal(raw, best)


def test_cross_view_negatives_are_the_least_similar_tokens_of_the_positive_view():
    _, match = permuted_features(seed=10)
    z = unit(2 * B, T, C_PROJ, seed=11)
    loss = DenseContrastiveLoss("guided", cross_view_negatives=2)
    far = loss.cross_view_tokens(z, torch.tensor(match))
    assert far.shape == (2 * B, T, 2)
    for a in range(2 * B):
        p = (a + B) % (2 * B)
        for k in range(T):
            rest = [m for m in range(T) if m != match[a][k]]  # the positive is never a negative
            ranked = sorted(rest, key=lambda m, a=a, k=k, p=p: float(z[a, k] @ z[p, m]))
            assert far[a, k].tolist() == ranked[:2]
    # N is clipped to T - 1: every token but the positive
    wide = DenseContrastiveLoss("guided", cross_view_negatives=64)
    assert wide.cross_view_negatives == 64
    assert wide.cross_view_tokens(z, torch.tensor(match)).shape == (2 * B, T, T - 1)


def test_guided_loss_matches_naive_loop_with_paper_defaults():
    f, match = permuted_features(seed=12)
    z = unit(2 * B, T, C_PROJ, seed=13)
    loss = DenseContrastiveLoss("guided", temperature=0.3)  # M 256, beta 0.5, N 64
    assert (loss.candidates, loss.beta, loss.cross_view_negatives) == (256, 0.5, 64)
    assert loss.num_candidates(2 * B, T) == 256  # 4^4 distinct sets: not clipped
    assert loss.num_candidates(2 * B, 3) == 81  # 3^4 distinct sets: clipped
    assert loss.num_candidates(4, 2) == 4  # B = 2, T = 2
    tokens = loss.negative_tokens(z, torch.Generator().manual_seed(5))
    value = loss(z, f, torch.Generator().manual_seed(5)).item()
    expected = naive_dense(z, match, 0.3, "guided", tokens, cross_n=T - 1)
    assert value == pytest.approx(expected, rel=1e-6)


def test_dense_loss_input_errors():
    loss = DenseContrastiveLoss()
    z = unit(2, T, C_PROJ, seed=0)
    with pytest.raises(ValueError, match="at least 2 images"):
        loss(z, z)
    with pytest.raises(ValueError, match="two views"):
        loss(unit(5, T, C_PROJ, seed=0), unit(5, T, C_PROJ, seed=0))
    with pytest.raises(ValueError, match="unknown negatives"):
        DenseContrastiveLoss("hard")


# -- vitrieval-train pretrain ---------------------------------------------------------------

FAST = ["--preset", "tiny", "--batch-size", "4", "--workers", "0", "--warmup-epochs", "1"]


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> object:
    """8 small coloured images in two folders (one nested) and one broken file."""
    root = tmp_path_factory.mktemp("densecl") / "photos"
    rng = np.random.default_rng(0)
    for i in range(8):
        folder = root / ("red" if i < 4 else "blue") / ("deep" if i % 3 == 2 else "")
        folder.mkdir(parents=True, exist_ok=True)
        colour = (200, 40, 40) if i < 4 else (40, 40, 200)
        pixels = np.clip(rng.normal(colour, 40, (40, 48, 3)), 0, 255).astype(np.uint8)
        pixels[8 * (i % 4) : 8 * (i % 4) + 10, 10:30] = 255  # a white bar at varying height
        Image.fromarray(pixels).save(folder / f"img{i}.png")
    (root / "red" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 truncated")
    return root


def _rows(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_pretrain_resume_export_index_and_init(tmp_path, photos, capsys):
    run = tmp_path / "run"
    args = ["pretrain", "--images", str(photos), *FAST]
    assert main([*args, "--out", str(run), "--epochs", "1"]) == 0
    assert (run / "skipped.txt").read_text().startswith("red/broken.jpg\t")
    row = _rows(run)[0]
    assert row["epoch"] == 1 and row["recon_loss"] is None
    assert row["loss"] == pytest.approx(0.1 * row["global_loss"] + 0.9 * row["dense_loss"])
    assert {"lr", "train_seconds", "train_images_per_s"} <= set(row)
    saved = yaml.safe_load((run / "pretrain.yaml").read_text())
    assert saved["method"] == "densecl++" and saved["negatives"] == "random"
    assert saved["dense_weight"] == 0.9 and saved["temperature"] == 0.1
    assert saved["head_hidden_dim"] == 512  # 4 x the tiny preset's 128 channels
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["pool"] == "avg" and config["backbone"] == "tiny" and config["dim"] is None
    assert all(k.startswith("backbone.") for k in load_file(str(run / "model.safetensors")))

    # resume to epoch 2 == two epochs straight (same batches, views, negatives)
    assert main(["pretrain", "--out", str(run), "--resume", "--epochs", "2"]) == 0
    assert [r["epoch"] for r in _rows(run)] == [1, 2]
    straight = tmp_path / "straight"
    assert main([*args, "--out", str(straight), "--epochs", "2"]) == 0
    a, b = load_file(str(run / "model.safetensors")), load_file(str(straight / "model.safetensors"))
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=0, rtol=0, msg=key)
    assert _rows(run)[1]["loss"] == pytest.approx(_rows(straight)[1]["loss"], rel=1e-6)
    assert main(["pretrain", "--out", str(run), *args[1:3], "--epochs", "2"]) == 2
    assert "--resume" in capsys.readouterr().err

    # the embedding is the backbone's mean patch token, L2-normalised
    model, _ = load_run_model(run)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        tokens = model.backbone.forward_features(x)
        expected = F.normalize(tokens[:, model.num_prefix_tokens :].mean(1), dim=-1)
        torch.testing.assert_close(model(x), expected)

    onnx_path = tmp_path / "m.onnx"
    assert main(["export", "--run", str(run), "--out", str(onnx_path)]) == 0
    meta = read_model_metadata(onnx_path)
    assert meta.pooling == "avg" and meta.embedding_dim == 128
    index = tmp_path / "index"
    argv = ["build", "--model", str(onnx_path), "--images", str(photos), "--out", str(index)]
    assert index_main(argv) == 0
    assert json.loads((index / "manifest.json").read_text())["count"] == 8

    # fit starts from the pretrained backbone, with the same pooling or a new head
    fit_run = tmp_path / "fit"
    fit_args = ["--dataset", "folder", "--data-root", str(photos), "--pool", "avg"]
    argv = ["fit", *fit_args, "--init", str(run), "--out", str(fit_run), "--epochs", "1", *FAST]
    assert main(argv) == 0
    capsys.readouterr()
    fit_args = ["--dataset", "folder", "--data-root", str(photos), "--dim", "16"]  # ggem + proj
    argv = ["fit", *fit_args, "--init", str(run), "--out", str(tmp_path / "fit2"), "--epochs", "1"]
    assert main([*argv, *FAST]) == 0
    assert "pool, proj newly initialised (3 tensors)" in capsys.readouterr().out
    cfg = config_from_args(build_parser().parse_args(["fit", "--out", "x", "--dim", "16"]))
    fresh = model_from_config(cfg)
    p_before = fresh.pool.p.detach().clone()
    init_weights(fresh, str(run))
    saved = load_file(str(run / "model.safetensors"))
    for name, tensor in fresh.state_dict().items():
        if name.startswith("backbone."):
            torch.testing.assert_close(tensor, saved[name], rtol=0, atol=0)
    torch.testing.assert_close(fresh.pool.p, p_before)
    # a run of another backbone is refused in one line
    small = model_from_config(FitConfig(out="x", backbone="small"))
    with pytest.raises(CheckpointError, match="does not hold this backbone"):
        init_weights(small, str(run))


@pytest.mark.parametrize(
    ("flags", "dense", "recon"),
    [
        (["--method", "simclr"], None, None),
        (["--method", "densecl", "--lambda", "0.5"], 0.5, None),
        (["--negatives", "guided", "--candidates", "8", "--recon-weight", "0.1"], 0.9, 0.1),
    ],
)
def test_pretrain_methods(tmp_path, photos, flags, dense, recon):
    run = tmp_path / "run"
    argv = ["pretrain", "--images", str(photos), *FAST, "--epochs", "1", "--out", str(run)]
    assert main([*argv, *flags]) == 0
    row = _rows(run)[0]
    saved = yaml.safe_load((run / "pretrain.yaml").read_text())
    if dense is None:
        assert row["dense_loss"] is None and saved["dense_weight"] == 0.0
        assert row["loss"] == pytest.approx(row["global_loss"])
        return
    assert saved["dense_weight"] == dense
    expected = (1 - dense) * row["global_loss"] + dense * row["dense_loss"]
    if recon:
        assert row["recon_loss"] > 0 and saved["cross_view_negatives"] == 64
        expected += recon * row["recon_loss"]
    assert row["loss"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--images", "/nonexistent/photos"], "/nonexistent/photos"),
        (["--method", "moco"], "unknown --method 'moco'; choose one of: densecl++, simclr"),
        (["--method", "simclr", "--negatives", "guided"], "does not apply to --method simclr"),
        (["--negatives", "hard"], "--negatives hard does not apply"),
        (["--lambda", "1.5"], "--lambda must lie in [0, 1]"),
        (["--preset", "huge"], "unknown backbone 'huge'"),
        (["--batch-size", "1"], "--batch-size must be >= 2"),
    ],
)
def test_user_errors_are_one_line(tmp_path, photos, capsys, args, needle):
    argv = ["pretrain", "--out", str(tmp_path / "r"), "--images", str(photos), *args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert err.count("\n") == 1


def test_empty_folder_is_a_user_error(tmp_path, capsys):
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    (tmp_path / "empty" / "notes.txt").write_text("not an image")
    argv = ["pretrain", "--out", str(tmp_path / "r"), "--images", str(tmp_path / "empty")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "no images found" in err and err.count("\n") == 1
    assert not (tmp_path / "r").exists()
