"""ONNX embedder (parity, batching, order, bad inputs, devices) and INT8 quantisation."""

from __future__ import annotations

import hashlib
import io
import json
import logging
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper
from PIL import Image
from skimage import data as skdata

import vitrieval.index.runtime.embedder as embedder_module
from vitrieval.index.evaluation.datasets import Item
from vitrieval.index.runtime.embedder import Embedder, EmbedResult, select_providers
from vitrieval.index.runtime.images import open_image
from vitrieval.index.runtime.model_metadata import ModelMetadataError, read_model_metadata
from vitrieval.index.runtime.preprocess import Preprocessor
from vitrieval.index.runtime.quantize import QuantizeError, quantize_model, quantized_fingerprint
from vitrieval.training.model import build_model, weights_fingerprint

HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()


def photos() -> list[Image.Image]:
    """Four real photos of different sizes; `camera` is greyscale, so conversion is exercised."""
    arrays = [skdata.astronaut(), skdata.coffee(), skdata.chelsea(), skdata.camera()]
    return [Image.fromarray(a).convert("RGB") for a in arrays]


def distinct_images(count: int) -> list[Image.Image]:
    """`count` different crops of the photos: rows that would differ if order were lost."""
    base = photos()
    return [
        base[i % 4].crop((7 * i, 5 * i, 7 * i + 120 + 9 * i, 5 * i + 100 + 4 * i))
        for i in range(count)
    ]


def encode(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def direct_run(model: Path, images: list[Image.Image]) -> np.ndarray:
    """Reference: a bare ONNX Runtime session on the documented preprocessing."""
    meta = read_model_metadata(model)
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    (out,) = session.run(["embeddings"], {"images": Preprocessor(meta).batch(images)})
    return out


@pytest.fixture(scope="module")
def embedder(tiny_onnx: Path) -> Embedder:
    return Embedder(tiny_onnx, device="cpu")


def test_loads_model_and_describes_itself(embedder, tiny_onnx):
    meta = read_model_metadata(tiny_onnx)
    assert embedder.dim == 128 == meta.embedding_dim
    assert embedder.provider == "CPUExecutionProvider"
    assert embedder.fingerprint == meta.fingerprint
    assert len(embedder.fingerprint) == 64
    assert embedder.metadata == meta


def test_photos_match_bare_onnxruntime_and_pytorch(embedder, tiny_onnx):
    images = photos()
    got = embedder.embed_images(images)
    assert got.shape == (4, 128) and got.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    np.testing.assert_allclose(got, direct_run(tiny_onnx, images), atol=1e-6)
    # The fixture's weights rebuilt in PyTorch (same seed): the fingerprint proves it.
    torch.manual_seed(0)
    model = build_model("tiny", "ggem").eval()
    assert weights_fingerprint(model) == embedder.fingerprint
    batch = torch.from_numpy(Preprocessor(embedder.metadata).batch(images))
    with torch.no_grad():
        np.testing.assert_allclose(got, model(batch).numpy(), atol=1e-4)
    # Different photos give different embeddings (a constant output would pass the rest).
    similarity = got @ got.T
    assert similarity[np.triu_indices(4, 1)].max() < 0.9999


def test_embed_arrays_chunks_and_validates(embedder):
    batch = Preprocessor(embedder.metadata).batch(distinct_images(5))
    small = Embedder(embedder.model_path, device="cpu", batch_size=2)
    np.testing.assert_allclose(small.embed_arrays(batch), embedder.embed_arrays(batch), atol=1e-6)
    assert embedder.embed_arrays(batch[:0]).shape == (0, 128)
    with pytest.raises(ValueError, match=r"\(B, 3, 32, 32\)"):
        embedder.embed_arrays(np.zeros((2, 3, 64, 64), np.float32))


def test_small_batches_and_threads_keep_rows_and_order(tiny_onnx):
    images = distinct_images(10)
    reference = Embedder(tiny_onnx, device="cpu", batch_size=64, decode_threads=1)
    pipelined = Embedder(tiny_onnx, device="cpu", batch_size=3, decode_threads=4)
    expected = reference.embed_images(images)
    got = pipelined.embed_images(images)
    np.testing.assert_allclose(got, expected, atol=1e-6)
    np.testing.assert_allclose(got, direct_run(tiny_onnx, images), atol=1e-6)
    # One at a time gives the same rows: nothing depends on the batch a row landed in.
    one_by_one = np.concatenate([reference.embed_images([im]) for im in images])
    np.testing.assert_allclose(got, one_by_one, atol=1e-6)
    assert np.abs(got[0] - got[1]).max() > 1e-3  # rows are distinct, so order is tested


def test_empty_inputs(embedder):
    assert embedder.embed_images([]).shape == (0, 128)
    result = embedder.embed_sources([])
    assert result.embeddings.shape == (0, 128) and result.embeddings.dtype == np.float32
    assert result.indices == [] and result.errors == []


def test_sources_mix_paths_bytes_and_failures(tmp_path, tiny_onnx):
    astronaut, coffee, chelsea, camera = photos()
    (tmp_path / "astronaut.jpg").write_bytes(encode(astronaut, "JPEG"))
    (tmp_path / "broken.jpg").write_bytes(encode(coffee, "JPEG")[:3000])  # truncated
    (tmp_path / "notes.txt").write_text("not an image\n")
    (tmp_path / "camera.png").write_bytes(encode(camera, "PNG"))
    sources = [
        tmp_path / "astronaut.jpg",  # 0 ok
        encode(chelsea, "PNG"),  # 1 ok (bytes)
        tmp_path / "broken.jpg",  # 2 truncated
        str(tmp_path / "notes.txt"),  # 3 text
        tmp_path / "missing.jpg",  # 4 missing
        str(tmp_path / "camera.png"),  # 5 ok
        b"\xff\xd8\xff garbage",  # 6 corrupt bytes
    ]
    result = Embedder(
        tiny_onnx, device="cpu", batch_size=2, decode_threads=3, exact_decode=True
    ).embed_sources(sources)
    assert isinstance(result, EmbedResult)
    assert result.indices == [0, 1, 5]
    assert [pos for pos, _ in result.errors] == [2, 3, 4, 6]
    reasons = dict(result.errors)
    assert "broken.jpg" in reasons[2] and "truncated" in reasons[2]
    assert "notes.txt" in reasons[3] and "not a recognised image" in reasons[3]
    assert "missing.jpg" in reasons[4] and "cannot read" in reasons[4]
    good = [open_image(sources[i]) for i in result.indices]
    np.testing.assert_allclose(result.embeddings, direct_run(tiny_onnx, good), atol=1e-6)


def test_sources_respect_pixel_limit_and_reject_non_sources(tiny_onnx):
    embedder = Embedder(tiny_onnx, device="cpu", max_pixels=100 * 100)
    result = embedder.embed_sources(
        [encode(photos()[0], "PNG"), encode(Image.new("RGB", (50, 50)), "PNG")]
    )
    assert result.indices == [1]
    assert result.errors[0][0] == 0 and "exceeds the limit" in result.errors[0][1]
    with pytest.raises(TypeError, match="source 1 is a int"):
        embedder.embed_sources([b"x", 3])


def test_items_and_progress_bar(embedder, tmp_path, capsys):
    images = distinct_images(3)
    images[1].save(tmp_path / "b.png")
    items = [
        Item("a", "x", pixels=np.asarray(images[0])),
        Item("b", "x", path=tmp_path / "b.png"),
        Item("c", "y", path=tmp_path / "gone.png"),
        Item("d", "y", pixels=np.asarray(images[2])),
        Item("e", "y", pixels=np.zeros((4, 4, 4), np.uint8)),  # bad shape
    ]
    result = embedder.embed_items(items, progress=True)
    assert result.indices == [0, 1, 3]
    assert [pos for pos, _ in result.errors] == [2, 4]
    expected = direct_run(embedder.model_path, [images[0], images[1], images[2]])
    np.testing.assert_allclose(result.embeddings, expected, atol=1e-6)
    # off a terminal: plain lines, the first image at once, then the end
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["embedding: 1 of 5 images (20%)", "embedding: 5 of 5 images (100%)"]
    # image by image, not batch by batch
    seen: list[int] = []
    list(embedder.iter_items(items, on_image=seen.append))
    assert seen == [1] * 5 and embedder.batch_size > 1


def test_streaming_batches_carry_global_positions(tiny_onnx):
    sources = [encode(im, "PNG") for im in distinct_images(5)]
    sources.insert(3, b"junk")
    embedder = Embedder(tiny_onnx, device="cpu", batch_size=2)
    parts = list(embedder.iter_sources(sources))
    assert [p.indices for p in parts] == [[0, 1], [2], [4, 5]]
    assert [p.errors[0][0] for p in parts if p.errors] == [3]
    whole = embedder.embed_sources(sources)
    np.testing.assert_allclose(
        np.concatenate([p.embeddings for p in parts]), whole.embeddings, atol=0
    )


@pytest.mark.skipif(HAS_CUDA, reason="onnxruntime has CUDA here; the error path cannot occur")
def test_cuda_without_cuda_is_a_clear_error(tiny_onnx):
    with pytest.raises(ValueError, match=r"CUDAExecutionProvider.*onnxruntime-gpu"):
        Embedder(tiny_onnx, device="cuda")
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        Embedder(tiny_onnx, device="tpu")


def test_provider_selection(monkeypatch):
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    assert [p for p, _ in select_providers("auto")] == ["CPUExecutionProvider"]
    gpu = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    monkeypatch.setattr(ort, "get_available_providers", lambda: gpu)
    # TensorRT is present but only used when asked for: its engine build takes minutes.
    assert [p for p, _ in select_providers("auto")] == gpu[1:]
    assert [p for p, _ in select_providers("tensorrt")] == gpu
    assert select_providers("cuda:1")[0] == ("CUDAExecutionProvider", {"device_id": 1})
    assert select_providers("cpu") == [("CPUExecutionProvider", {})]


def test_cuda_session_failure_falls_back_to_cpu(tiny_onnx, monkeypatch, caplog):
    monkeypatch.setattr(
        ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"]
    )
    real_session = ort.InferenceSession

    def failing_on_cuda(path, options, providers):
        if providers[0][0] == "CUDAExecutionProvider":
            raise RuntimeError("CUDA driver version is insufficient")
        return real_session(path, options, providers=providers)

    monkeypatch.setattr(embedder_module.ort, "InferenceSession", failing_on_cuda)
    with caplog.at_level(logging.INFO, logger="vitrieval.embedder"):
        embedder = Embedder(tiny_onnx, device="auto")
    assert embedder.provider == "CPUExecutionProvider"
    assert "falling back to CPU" in caplog.text and "driver version" in caplog.text
    assert "on CPUExecutionProvider" in caplog.text  # the one-line provider report
    assert embedder.embed_images(photos()[:1]).shape == (1, 128)


def plain_onnx_model(path: Path, props: dict[str, str] | None = None, out: str = "embeddings"):
    """A non-vitrieval model: images (B, 3, 32, 32) -> Flatten -> (B, 3072)."""
    graph = helper.make_graph(
        [helper.make_node("Flatten", ["images"], [out], axis=1)],
        "plain",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["B", 3, 32, 32])],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, ["B", 3072])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    for key, value in (props or {}).items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.save(model, str(path))
    return path


def test_foreign_and_malformed_models_are_refused(tmp_path, tiny_onnx):
    plain = plain_onnx_model(tmp_path / "plain.onnx")
    with pytest.raises(ModelMetadataError, match=r"not a vitrieval model.*vitrieval\.input_size"):
        Embedder(plain)
    # Right metadata, wrong output name: still not the contract.
    props = read_model_metadata(tiny_onnx).to_properties()
    renamed = plain_onnx_model(tmp_path / "renamed.onnx", props, out="features")
    with pytest.raises(ModelMetadataError, match="one output 'embeddings'"):
        Embedder(renamed)
    # Right names, graph width (3072) disagreeing with the declared 128-d embedding.
    wide = plain_onnx_model(tmp_path / "wide.onnx", props)
    with pytest.raises(ModelMetadataError, match="disagree with the metadata"):
        Embedder(wide)
    (tmp_path / "junk.onnx").write_bytes(b"not a model")
    with pytest.raises(ModelMetadataError, match="not a loadable ONNX model"):
        Embedder(tmp_path / "junk.onnx")
    with pytest.raises(ModelMetadataError, match="not found"):
        Embedder(tmp_path / "absent.onnx")


@pytest.fixture(scope="module")
def quantized(tiny_onnx, tmp_path_factory):
    dst = tmp_path_factory.mktemp("int8") / "tiny.int8.onnx"
    return dst, quantize_model(tiny_onnx, dst, check_images=photos())


def test_quantize_shrinks_and_keeps_metadata(tiny_onnx, quantized):
    dst, report = quantized
    assert dst.is_file() and not list(dst.parent.glob(".*.tmp"))
    assert report.bytes_before == tiny_onnx.stat().st_size
    assert report.bytes_after == dst.stat().st_size < 0.5 * report.bytes_before
    source = {p.key: p.value for p in onnx.load(str(tiny_onnx)).metadata_props}
    props = {p.key: p.value for p in onnx.load(str(dst)).metadata_props}
    for key, value in source.items():
        if key != "vitrieval.fingerprint":
            assert props[key] == value, key
    original = json.loads(source["vitrieval.fingerprint"])
    expected = hashlib.sha256(f"{original}:int8-dynamic".encode()).hexdigest()
    assert json.loads(props["vitrieval.fingerprint"]) == expected == report.fingerprint
    assert expected == quantized_fingerprint(original) != original
    assert json.loads(props["vitrieval.source_fingerprint"]) == original
    assert json.loads(props["vitrieval.quantization"]) == "int8-dynamic"
    ops = {node.op_type for node in onnx.load(str(dst)).graph.node}
    assert {"DynamicQuantizeLinear", "MatMulInteger"} <= ops


def test_quantized_model_agrees_with_fp32(tiny_onnx, quantized):
    dst, report = quantized
    assert report.n_check_images == 4 and report.check_source == "given"
    int8 = Embedder(dst, device="cpu")
    assert int8.fingerprint == report.fingerprint and int8.dim == 128
    images = photos()
    got = int8.embed_images(images)
    reference = Embedder(tiny_onnx, device="cpu").embed_images(images)
    cosines = np.sum(got * reference, axis=1)
    assert 0.9 < report.min_cosine <= report.mean_cosine <= 1.0 + 1e-6
    assert report.mean_cosine == pytest.approx(float(cosines.mean()), abs=1e-6)
    assert report.min_cosine == pytest.approx(float(cosines.min()), abs=1e-6)
    assert not np.array_equal(got, reference)  # it really is another model
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    assert "int8-dynamic" in report.summary()


def test_quantize_refusals_leave_no_file(tmp_path, quantized):
    dst, _ = quantized
    with pytest.raises(QuantizeError, match="already quantised"):
        quantize_model(dst, tmp_path / "twice.onnx")
    with pytest.raises(ModelMetadataError, match="vitrieval"):
        quantize_model(plain_onnx_model(tmp_path / "plain.onnx"), tmp_path / "q.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain.onnx"]


def test_quantize_defaults_to_random_check_images(tiny_onnx, tmp_path):
    report = quantize_model(tiny_onnx, tmp_path / "q.onnx")
    assert report.n_check_images == 16 and report.check_source == "random"
    assert 0.9 < report.min_cosine <= 1.0 + 1e-6


def test_draft_decoding_matches_exact_decoding(tmp_path, tiny_onnx):
    """JPEGs decoded at reduced DCT scale embed like fully decoded ones."""
    from skimage import data as skdata

    from vitrieval.index.runtime.images import open_image

    paths = []
    for i, photo in enumerate([skdata.astronaut(), skdata.coffee(), skdata.chelsea()]):
        paths.append(tmp_path / f"{i}.jpg")
        Image.fromarray(photo).save(paths[-1], quality=92)
    fast = Embedder(tiny_onnx)
    exact = Embedder(tiny_onnx, exact_decode=True)
    assert exact.draft_size is None and fast.draft_size == 64
    # the draft really engages: a 512 px JPEG decodes at 1/8 scale for a 32 px model
    assert open_image(paths[0], draft_size=fast.draft_size).size == (64, 64)
    a = fast.embed_sources(paths).embeddings
    b = exact.embed_sources(paths).embeddings
    cosines = np.sum(a * b, axis=1)
    assert cosines.min() >= 0.999
    assert not np.array_equal(a, b)
