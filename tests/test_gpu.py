"""GPU paths and their CPU fallbacks: training on CUDA with AMP, ONNX Runtime's CUDA
(and TensorRT) provider, FAISS on the GPU.

The `gpu`-marked tests run where the GPU build of the library they exercise sees a
device; tests/conftest.py skips them otherwise and says what is missing (no CUDA
device, a CPU onnxruntime, faiss-cpu). The other tests run anywhere: a GPU that is
asked for but absent is reported in one log line and the work runs on the CPU (or, for
an explicit `cuda`, is refused with a clear error).
"""

from __future__ import annotations

import logging
from pathlib import Path

import faiss
import numpy as np
import onnxruntime as ort
import pytest
import torch
from PIL import Image
from skimage import data as skdata

import vitrieval.index.runtime.embedder as embedder_module
from vitrieval.index import gpu_notice
from vitrieval.index.runtime.embedder import CPU, CUDA, TENSORRT, Embedder
from vitrieval.index.store import IndexStore, StoreError
from vitrieval.training.config import ConfigError, FitConfig
from vitrieval.training.device import describe_device, pick_device
from vitrieval.training.losses import create_loss
from vitrieval.training.model import build_model


def photos() -> list[Image.Image]:
    arrays = [skdata.astronaut(), skdata.coffee(), skdata.chelsea(), skdata.camera()]
    return [Image.fromarray(a).convert("RGB") for a in arrays]


def unit_vectors(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    x = rng.standard_normal((n, dim))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


# -- CPU fallbacks (any machine) -------------------------------------------------------


def test_training_auto_without_cuda_logs_the_cpu_fallback(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.INFO, logger="vitrieval.train"):
        device = pick_device("auto")
    assert device.type == "cpu"
    assert "device auto: torch " in caplog.text and "training on the CPU" in caplog.text
    assert "no CUDA device" in caplog.text or "CPU-only build" in caplog.text
    # an explicit request is refused rather than silently run on the CPU
    with pytest.raises(ConfigError, match="--device cuda asked for, but no CUDA device"):
        pick_device("cuda")
    assert describe_device(torch.device("cpu")) == "cpu"
    assert describe_device(torch.device("cpu"), torch.bfloat16) == "cpu with AMP bfloat16"


def test_embedder_auto_without_cuda_logs_the_cpu_fallback(tiny_onnx, monkeypatch, caplog):
    monkeypatch.setattr(ort, "get_available_providers", lambda: [CPU])
    monkeypatch.setattr(gpu_notice, "_said", set())  # said once per process
    caplog.set_level(logging.INFO, logger="vitrieval.devices")
    with caplog.at_level(logging.INFO, logger="vitrieval.embedder"):
        embedder = Embedder(tiny_onnx, device="auto")
    assert embedder.provider == CPU
    assert f"onnxruntime: no {CUDA} (it has {CPU}; onnxruntime-gpu" in caplog.text
    assert "running on the CPU" in caplog.text
    assert "on CPUExecutionProvider" in caplog.text  # the provider report


def test_tensorrt_failure_falls_back_to_cuda_then_cpu(tiny_onnx, monkeypatch, caplog):
    """A TensorRT session that cannot be made (TensorRT libraries missing) falls back to
    CUDA before the CPU, each step logged."""
    monkeypatch.setattr(ort, "get_available_providers", lambda: [TENSORRT, CUDA, CPU])
    real_session = ort.InferenceSession
    attempts: list[list[str]] = []

    def session(path, options, providers):
        attempts.append([name for name, _ in providers])
        if providers[0][0] == TENSORRT:
            raise RuntimeError("libnvinfer.so.10: cannot open shared object file")
        if providers[0][0] == CUDA:
            raise RuntimeError("CUDA failure 100: no CUDA-capable device is detected")
        return real_session(path, options, providers=providers)

    monkeypatch.setattr(embedder_module.ort, "InferenceSession", session)
    with caplog.at_level(logging.INFO, logger="vitrieval.embedder"):
        embedder = Embedder(tiny_onnx, device="tensorrt")
    assert attempts == [[TENSORRT, CUDA, CPU], [CUDA, CPU], [CPU]]
    assert f"{TENSORRT} session (libnvinfer" in caplog.text
    assert f"falling back to {CUDA}" in caplog.text and "falling back to CPU" in caplog.text
    assert embedder.provider == CPU
    monkeypatch.undo()
    reference = Embedder(tiny_onnx, device="cpu").embed_images(photos())
    np.testing.assert_allclose(embedder.embed_images(photos()), reference, atol=1e-6)


def test_faiss_without_gpu_logs_the_cpu_fallback(tmp_path: Path, monkeypatch, caplog):
    monkeypatch.setattr(faiss, "get_num_gpus", lambda: 0, raising=False)
    monkeypatch.setattr(gpu_notice, "_said", set())  # said once per process
    with caplog.at_level(logging.INFO, logger="vitrieval.devices"):
        store = IndexStore.create(tmp_path / "idx", dim=8)
        IndexStore.create(tmp_path / "again", dim=8)
    assert caplog.text.count("FAISS: ") == 1 and "running on the CPU" in caplog.text
    assert store.info()["gpu"] == "cpu"
    with pytest.raises(StoreError, match="no GPU"):
        IndexStore.create(tmp_path / "gpu", dim=8, gpu="cuda")


# -- on a GPU ----------------------------------------------------------------------------


@pytest.mark.gpu("torch")
@pytest.mark.parametrize("amp_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cuda_training_steps_with_amp(amp_dtype):
    """The training loops' step (training.amp.MixedPrecision: autocast, GradScaler enabled
    for float16 only, clipping) on CUDA: finite losses, every trainable tensor finite, the
    weights moved."""
    from vitrieval.training.amp import MixedPrecision

    if amp_dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bfloat16")
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = build_model("tiny", "ggem").to(device)
    loss_fn = create_loss("norm_softmax", model.embedding_dim, 4).to(device)
    params = [*model.parameters(), *loss_fn.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    amp = MixedPrecision(True, device, amp_dtype)
    assert amp.scaler.is_enabled() == (amp_dtype == torch.float16)
    before = [p.detach().clone() for p in params]
    images = torch.randn(32, 3, 32, 32, device=device)
    labels = torch.arange(32, device=device) % 4
    losses = []
    for _ in range(8):  # float16: the GradScaler may skip the first steps (overflow)
        with amp.autocast():
            loss = loss_fn(model(images), labels)
        amp.optimizer_step(loss, optimizer, params, 1.0)
        losses.append(loss.item())
    assert all(np.isfinite(losses)), losses
    assert losses[-1] < losses[0]  # the same batch again and again: the loss must fall
    assert all(torch.isfinite(p).all() for p in params)
    moved = sum(int(not torch.equal(b, p.detach())) for b, p in zip(before, params, strict=True))
    assert moved >= len(params) // 2


@pytest.mark.gpu("torch")
def test_fit_on_cuda_with_amp(tmp_path: Path, capsys):
    """One epoch of the real `fit` loop on digits on the GPU: AMP on, finite loss,
    weights different from the initialisation, the device line printed."""
    from safetensors.torch import load_file

    from vitrieval.training.epochs import seed_everything
    from vitrieval.training.run_folder import model_from_config
    from vitrieval.training.trainer import fit

    cfg = FitConfig(out=str(tmp_path / "run"), dataset="digits", epochs=1, device="cuda")
    row = fit(cfg)
    printed = capsys.readouterr().out
    assert "on cuda:" in printed and "with AMP " in printed
    assert np.isfinite(row["loss"]) and 0 <= row["recall@1"] <= 1
    seed_everything(cfg.seed)
    initial = model_from_config(cfg.resolved()).state_dict()
    trained = load_file(str(tmp_path / "run" / "model.safetensors"))
    changed = [name for name in initial if not torch.equal(initial[name], trained[name].cpu())]
    assert len(changed) > len(initial) // 2


@pytest.mark.gpu("onnxruntime")
def test_cuda_provider_matches_cpu(tiny_onnx):
    # CUDA and cuDNN from pip wheels (onnxruntime-gpu[cuda,cudnn]) are off the loader's
    # path until preloaded; a CUDA base image has them on it already
    getattr(ort, "preload_dlls", lambda: None)()
    cpu = Embedder(tiny_onnx, device="cpu")
    gpu = Embedder(tiny_onnx, device="cuda")
    assert gpu.provider == CUDA
    images = photos()
    expected, got = cpu.embed_images(images), gpu.embed_images(images)
    assert got.shape == expected.shape == (4, 128)
    assert np.abs(got - expected).max() < 1e-3
    # batches of several sizes go through the same session (dynamic batch axis)
    batch = np.stack([cpu.prepare(_png(im)) for im in images * 5])
    np.testing.assert_allclose(gpu.embed_arrays(batch), cpu.embed_arrays(batch), atol=1e-3)


def _png(image: Image.Image) -> bytes:
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.gpu("faiss")
@pytest.mark.parametrize("factory", ["Flat", "IVF64,Flat"])
def test_gpu_faiss_search_equals_brute_force(tmp_path: Path, factory: str):
    """FAISS on the GPU (built, trained and searched there) returns the exact top-k:
    Flat always, IVF when every list is probed."""
    rng = np.random.default_rng(0)
    dim, k = 64, 10
    x = unit_vectors(rng, 6000, dim)
    queries = unit_vectors(rng, 100, dim)
    store = IndexStore.create(tmp_path / "idx", dim=dim, factory=factory, gpu="cuda")
    if store.needs_training():
        store.train(x)
        store.set_search_params(nprobe=64)
    store.add([str(i) for i in range(len(x))], x)
    hits = store.search(queries, k)
    assert store.info()["gpu"] != "cpu"
    scores = queries.astype(np.float64) @ x.astype(np.float64).T
    expected = np.argsort(-scores, axis=1)[:, :k]
    assert [[int(h.key) for h in row] for row in hits] == expected.tolist()
    got_scores = np.array([[h.score for h in row] for row in hits])
    np.testing.assert_allclose(got_scores, np.take_along_axis(scores, expected, 1), atol=1e-5)
    # and the saved index (the CPU copy) answers the same
    store.save()
    reopened = IndexStore.open(tmp_path / "idx", gpu="cpu")
    assert [[h.key for h in row] for row in reopened.search(queries, k)] == [
        [h.key for h in row] for row in hits
    ]
