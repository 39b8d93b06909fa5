"""The search service in-process (FastAPI's TestClient runs the real app, lifespan
included): every endpoint, auth, evaluation against `vitrieval-index bench`, the
error contract (4xx with a JSON body, never a 5xx) and 500 fuzzed images."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
from app_client import AUTH, KEY, make_client
from fastapi.testclient import TestClient
from hostile_images import fuzzed, png_bomb
from PIL import Image
from pydantic import ValidationError

from vitrieval.index.runtime.embedder import Embedder
from vitrieval.service.layout import cpu_count
from vitrieval.service.settings import Settings


def upload(data: bytes, name: str = "q.png", **fields) -> dict:
    return {"files": {"image": (name, data, "application/octet-stream")}, "data": fields}


def photo_bytes(fmt: str, size: int = 96) -> bytes:
    """A real photo from scikit-image, encoded as `fmt`."""
    from skimage import data

    image = Image.fromarray(data.astronaut()).resize((size, size))
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


# -- health, info, page, metrics ---------------------------------------------------------


def test_health_ready_and_info(client, digits_gallery) -> None:
    assert client.get("/healthz").json() == {"status": "ok", "checks": {}}
    ready = client.get("/readyz").json()
    assert ready["status"] == "ready" and ready["checks"]["self_check"]["passed"] is True
    info = client.get("/v1/info").json()
    embedder = Embedder(digits_gallery["model"])
    assert info["model"]["fingerprint"] == embedder.fingerprint
    assert info["model"]["embedding_dim"] == 128 and info["model"]["input_size"] == [3, 32, 32]
    assert info["index"]["count"] == 120 and info["index"]["factory"] == "Flat"
    # on CPUs the default layout is model calls side by side, not dynamic batching
    assert info["service"]["mutations"] is True and info["service"]["batching"] is False
    assert info["service"]["model_calls_at_once"] == cpu_count()


def test_page_and_unknown_routes(client) -> None:
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'id="file"' in page.text and "/v1/search" in page.text
    missing = client.get("/v1/nothing")
    assert missing.status_code == 404 and missing.json()["code"] == "not_found"
    wrong_method = client.get("/v1/search")
    assert wrong_method.status_code == 405 and "detail" in wrong_method.json()


def test_metrics_count_requests_stages_and_items(client, gallery) -> None:
    image = Path(gallery[0].path).read_bytes()
    for _ in range(3):
        assert client.post("/v1/search", **upload(image, k="2")).status_code == 200
    client.post("/v1/search", json={"k": 0, "key": "x"})
    text = client.get("/metrics").text
    assert 'vitrieval_requests_total{method="POST",route="/v1/search",status="200"} 3.0' in text
    assert 'vitrieval_request_errors_total{route="/v1/search",status="422"} 1.0' in text
    for stage in ("decode", "embed", "search"):
        assert f'vitrieval_stage_duration_seconds_count{{stage="{stage}"}} 3.0' in text
    assert "vitrieval_index_items 120.0" in text
    assert "vitrieval_embed_batch_size_count" in text


# -- search and embed --------------------------------------------------------------------


def test_search_by_upload_finds_the_image_itself_first(client, gallery) -> None:
    item = gallery[7]
    response = client.post("/v1/search", **upload(Path(item.path).read_bytes(), k="5"))
    assert response.status_code == 200
    body = response.json()
    assert body["query"] == "image" and body["k"] == 5 and len(body["hits"]) == 5
    first = body["hits"][0]
    assert first["key"] == item.key and first["label"] == item.label
    assert first["score"] == pytest.approx(1.0, abs=1e-5)
    scores = [hit["score"] for hit in body["hits"]]
    assert scores == sorted(scores, reverse=True)
    assert set(body["hits"][1]) == {"key", "score", "label", "metadata"}
    assert set(body["timings_ms"]) == {"decode", "embed", "search"}
    assert all(value >= 0 for value in body["timings_ms"].values())


def test_base64_key_and_vector_queries_agree_with_the_upload(client, gallery) -> None:
    item = gallery[3]
    data = Path(item.path).read_bytes()
    by_upload = client.post("/v1/search", **upload(data, k="4")).json()["hits"]
    encoded = base64.b64encode(data).decode()
    by_base64 = client.post("/v1/search", json={"image_base64": encoded, "k": 4}).json()["hits"]
    assert by_base64 == by_upload
    data_url = client.post(
        "/v1/search", json={"image_base64": "data:image/png;base64," + encoded, "k": 4}
    ).json()["hits"]
    assert data_url == by_upload

    by_key = client.post("/v1/search", json={"key": item.key, "k": 3}).json()
    assert by_key["query"] == "key"
    assert [h["key"] for h in by_key["hits"]] == [h["key"] for h in by_upload[1:4]]
    with_self = client.post("/v1/search", json={"key": item.key, "k": 1, "exclude_self": False})
    assert with_self.json()["hits"][0]["key"] == item.key

    vector = client.get(f"/v1/items/{item.key}", params={"vector": "true"}).json()["vector"]
    by_vector = client.post("/v1/search", json={"vector": vector, "k": 4}).json()
    assert by_vector["query"] == "vector"
    assert [h["key"] for h in by_vector["hits"]] == [h["key"] for h in by_upload]
    # raw vectors need not be normalised: the direction is what counts
    scaled = client.post("/v1/search", json={"vector": [3 * v for v in vector], "k": 4}).json()
    assert [h["key"] for h in scaled["hits"]] == [h["key"] for h in by_upload]


def test_label_filter(client, gallery) -> None:
    data = Path(gallery[0].path).read_bytes()
    body = client.post("/v1/search", **upload(data, k="50", label="3")).json()
    wanted = sum(1 for item in gallery if item.label == "3")
    assert len(body["hits"]) == wanted and wanted < 50
    assert {hit["label"] for hit in body["hits"]} == {"3"}
    none = client.post("/v1/search", json={"key": gallery[0].key, "k": 5, "label": "nope"})
    assert none.status_code == 200 and none.json()["hits"] == []


@pytest.mark.parametrize(
    ("request_kwargs", "status", "code"),
    [
        ({"json": {"k": 0, "key": "digits/00001"}}, 422, "invalid_request"),
        ({"json": {"k": 1001, "key": "digits/00001"}}, 422, "invalid_request"),
        ({"json": {"k": "many", "key": "digits/00001"}}, 422, "invalid_request"),
        ({"json": {"k": 3}}, 422, "invalid_request"),
        ({"json": {"key": "digits/00001", "vector": [0.0] * 128}}, 422, "invalid_request"),
        ({"json": {"key": "no such key"}}, 404, "unknown_key"),
        ({"json": {"vector": [1.0, 0.0]}}, 422, "bad_vector"),
        ({"json": {"vector": [0.0] * 128}}, 422, "bad_vector"),
        ({"json": {"image_base64": "%%% not base64"}}, 422, "invalid_base64"),
        ({"json": {"key": "digits/00001", "surprise": 1}}, 422, "invalid_request"),
        ({"json": [1, 2]}, 422, "invalid_request"),
        ({"json": {"vector": [0.1] * 5000}}, 422, "invalid_request"),
        (
            {"content": b"[" * 50000, "headers": {"content-type": "application/json"}},
            400,
            "invalid_json",
        ),
        (
            {
                "content": b'{"k": ' + b"1" * 5000 + b"}",
                "headers": {"content-type": "application/json"},
            },
            400,
            "invalid_json",
        ),
        (
            {"content": b"{not json", "headers": {"content-type": "application/json"}},
            400,
            "invalid_json",
        ),
        (
            {"content": b"hello", "headers": {"content-type": "text/plain"}},
            415,
            "unsupported_media_type",
        ),
        (
            {"files": {"image": ("a.png", b"x", "image/png")}, "data": {"k": "0"}},
            422,
            "invalid_request",
        ),
        ({"data": {"image": "not a file", "k": "3"}}, 422, "invalid_request"),
        ({"files": {"photo": ("a.png", b"x", "image/png")}}, 422, "invalid_request"),
    ],
)
def test_search_rejects_bad_queries_with_json_4xx(client, request_kwargs, status, code) -> None:
    response = client.post("/v1/search", **request_kwargs)
    assert response.status_code == status, response.text
    body = response.json()
    assert body["code"] == code and isinstance(body["detail"], str) and body["detail"]


def test_embed_matches_the_offline_embedder_and_the_index(client, digits_gallery, gallery) -> None:
    item = gallery[11]
    data = Path(item.path).read_bytes()
    body = client.post("/v1/embed", **upload(data)).json()
    vector = np.asarray(body["embedding"], dtype=np.float32)
    assert body["dim"] == 128 and vector.shape == (128,)
    assert np.linalg.norm(vector) == pytest.approx(1.0, abs=1e-5)
    offline = Embedder(digits_gallery["model"]).embed_sources([data]).embeddings[0]
    np.testing.assert_allclose(vector, offline, atol=1e-6)
    stored = client.get(f"/v1/items/{item.key}", params={"vector": "true"}).json()["vector"]
    np.testing.assert_allclose(vector, stored, atol=1e-6)
    as_json = client.post("/v1/embed", json={"image_base64": base64.b64encode(data).decode()})
    np.testing.assert_allclose(as_json.json()["embedding"], body["embedding"], atol=1e-7)
    assert client.post("/v1/embed", json={}).status_code == 422


# -- items and auth -------------------------------------------------------------------


def test_item_lifecycle(client) -> None:
    photo = photo_bytes("JPEG")
    meta = {"sku": "A-1", "price": 3.5}
    created = client.post(
        "/v1/items",
        headers=AUTH,
        **upload(
            photo, "astronaut.jpg", key="shop/astronaut", label="people", metadata=json.dumps(meta)
        ),
    )
    assert created.status_code == 201, created.text
    assert created.json() | {"metadata": meta} == created.json()
    assert created.json()["replaced"] is False and created.json()["has_image"] is True

    got = client.get("/v1/items/shop/astronaut")
    assert got.status_code == 200
    assert got.json()["label"] == "people" and got.json()["metadata"] == meta

    hits = client.post("/v1/search", **upload(photo, k="3")).json()["hits"]
    assert hits[0]["key"] == "shop/astronaut" and hits[0]["metadata"] == meta
    assert hits[0]["score"] == pytest.approx(1.0, abs=1e-5)

    thumb = client.get("/v1/items/shop/astronaut/thumbnail", params={"size": 64})
    assert thumb.status_code == 200 and thumb.headers["content-type"] == "image/jpeg"
    assert max(Image.open(io.BytesIO(thumb.content)).size) == 64

    again = client.post("/v1/items", headers=AUTH, **upload(photo, key="shop/astronaut"))
    assert again.status_code == 409 and again.json()["code"] == "key_exists"
    other = photo_bytes("PNG", size=64)
    replaced = client.post(
        "/v1/items", headers=AUTH, **upload(other, key="shop/astronaut", replace="true")
    )
    assert replaced.status_code == 201 and replaced.json()["replaced"] is True
    assert client.get("/v1/items/shop/astronaut").json()["label"] is None

    assert client.get("/v1/info").json()["index"]["count"] == 121
    deleted = client.delete("/v1/items/shop/astronaut", headers=AUTH)
    assert deleted.status_code == 200 and deleted.json() == {
        "key": "shop/astronaut",
        "deleted": True,
    }
    assert client.delete("/v1/items/shop/astronaut", headers=AUTH).status_code == 404
    assert client.get("/v1/items/shop/astronaut").status_code == 404
    assert client.get("/v1/info").json()["index"]["count"] == 120


def test_items_by_vector_and_their_errors(client) -> None:
    rng = np.random.default_rng(0)
    vector = rng.standard_normal(128)
    made = client.post(
        "/v1/items", headers=AUTH, json={"key": "v1", "vector": vector.tolist(), "label": "vec"}
    )
    assert made.status_code == 201 and made.json()["has_image"] is False
    top = client.post("/v1/search", json={"vector": vector.tolist(), "k": 1}).json()["hits"][0]
    assert top["key"] == "v1" and top["score"] == pytest.approx(1.0, abs=1e-5)
    assert client.get("/v1/items/v1/thumbnail").json()["code"] == "no_image"
    bad = [
        {"key": "v2"},  # neither image nor vector
        {"key": "v2", "vector": [1.0]},  # wrong dimension
        {"key": "", "vector": vector.tolist()},  # empty key
        {"key": "bad\nkey", "vector": vector.tolist()},  # control character
        {"key": "v2", "vector": vector.tolist(), "metadata": [1]},  # metadata not an object
    ]
    for body in bad:
        response = client.post("/v1/items", headers=AUTH, json=body)
        assert response.status_code == 422, (body, response.text)
    form = client.post(
        "/v1/items", headers=AUTH, **upload(photo_bytes("PNG"), key="f", metadata="{oops")
    )
    assert form.status_code == 422 and "metadata" in form.json()["detail"]


def test_metadata_must_round_trip(client) -> None:
    """Metadata comes back with every hit: what could not be serialised is refused
    before it is stored, so one bad item cannot break searches."""
    vector = [1.0] + [0.0] * 127
    deep: dict = {}
    node = deep
    for _ in range(40):
        node["x"] = {}
        node = node["x"]
    bad = {
        "nan": '{"price": NaN}',
        "surrogate": '{"name": "\\ud800"}',
        "deep": json.dumps(deep),
        "huge": json.dumps({"blob": "x" * 70_000}),
        "not an object": "[1, 2]",
    }
    for name, metadata in bad.items():
        body = f'{{"key": "m", "vector": {json.dumps(vector)}, "metadata": {metadata}}}'
        response = client.post(
            "/v1/items", headers={**AUTH, "content-type": "application/json"}, content=body
        )
        assert response.status_code == 422, (name, response.text)
    assert client.get("/v1/items/m").status_code == 404
    hits = client.post("/v1/search", json={"vector": vector, "k": 3})
    assert hits.status_code == 200


def test_short_keys_are_refused() -> None:
    for key in ("", "   ", "short"):
        with pytest.raises(ValidationError, match="at least 12 characters"):
            Settings(api_key=key)


def test_odd_methods_share_one_metrics_label(client) -> None:
    for method in ("FOO1", "FOO2", "BAR"):
        assert client.request(method, "/v1/search").status_code in (400, 404, 405)
    text = client.get("/metrics").text
    assert 'method="OTHER"' in text and "FOO1" not in text


def test_mutations_need_the_key(client) -> None:
    photo = photo_bytes("PNG")
    for headers in ({}, {"X-API-Key": "wrong"}, {"X-API-Key": KEY + "x"}):
        added = client.post("/v1/items", headers=headers, **upload(photo, key="k"))
        assert added.status_code == 401 and added.json()["code"] == "unauthorized"
        assert added.headers["www-authenticate"] == "X-API-Key"
        removed = client.delete("/v1/items/1/digits_00001.png", headers=headers)
        assert removed.status_code == 401
    assert client.get("/v1/items/k").status_code == 404  # nothing was added
    assert client.get("/v1/items/1/digits_00001.png").status_code == 200  # nothing was removed


def test_read_key_and_read_only(digits_gallery, served_index, gallery) -> None:
    key = gallery[0].key
    with make_client(digits_gallery["model"], served_index, read_api_key="reader-key-0001") as c:
        assert c.post("/v1/search", json={"key": key}).status_code == 401
        assert c.get("/v1/info").status_code == 401
        assert c.post(
            "/v1/search", json={"key": key}, headers={"X-API-Key": "reader-key-0001"}
        ).is_success
        assert c.post("/v1/search", json={"key": key}, headers=AUTH).is_success
        assert c.get("/healthz").status_code == 200 and c.get("/readyz").status_code == 200
    with make_client(digits_gallery["model"], served_index, api_key=None, read_only=True) as c:
        refused = c.post("/v1/items", headers=AUTH, json={"key": "x", "vector": [1.0] * 128})
        assert refused.status_code == 403 and refused.json()["code"] == "read_only"
        assert c.post("/v1/search", json={"key": key}).status_code == 200


def test_mutations_without_a_key_refuse_to_start(digits_gallery, served_index, capsys) -> None:
    with pytest.raises(ValidationError, match="VITRIEVAL_API_KEY"):
        Settings(model=digits_gallery["model"], index=served_index)
    from vitrieval.service.cli import main

    code = main(["--model", str(digits_gallery["model"]), "--index", str(served_index)])
    err = capsys.readouterr().err
    assert code == 2 and "VITRIEVAL_API_KEY" in err and len(err.strip().splitlines()) == 1
    code = main(["--model", "missing.onnx", "--index", str(served_index), "--read-only"])
    err = capsys.readouterr().err
    assert code == 2 and "missing.onnx" in err and "Traceback" not in err


def test_an_index_of_another_model_is_refused(tiny_onnx_other, served_index, capsys) -> None:
    from vitrieval.service.cli import main

    code = main(["--model", str(tiny_onnx_other), "--index", str(served_index), "--read-only"])
    err = capsys.readouterr().err
    assert code == 2 and "fingerprint" in err


# -- evaluate ---------------------------------------------------------------------------


def test_leave_one_out_equals_the_offline_benchmark(client, digits_gallery, tmp_path) -> None:
    from vitrieval.index.cli import main as index_main

    out = tmp_path / "bench"
    assert (
        index_main(
            [
                "bench",
                "--model",
                str(digits_gallery["model"]),
                "--gallery",
                str(digits_gallery["list"]),
                "--ks",
                "1",
                "5",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    offline = json.loads((out / "report.json").read_text())
    response = client.post("/v1/evaluate", json={"mode": "leave-one-out", "ks": [1, 5]})
    assert response.status_code == 200
    online = response.json()
    assert online["n_items"] == 120 and online["n_queries"] == 120
    for name in ("recall@1", "recall@5", "map", "map_at_r", "r_precision"):
        assert online[name] == pytest.approx(offline[name], abs=1e-12), name
    assert 0 < online["recall@1"] <= online["recall@5"] <= 1


def test_evaluate_uploaded_queries(client, gallery) -> None:
    from vitrieval.index.evaluation.metrics import retrieval_metrics

    queries = gallery[:6]
    body = {
        "mode": "queries",
        "ks": [1, 3],
        "queries": [
            {"image_base64": base64.b64encode(Path(q.path).read_bytes()).decode(), "label": q.label}
            for q in queries
        ],
    }
    response = client.post("/v1/evaluate", json=body)
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["mode"] == "queries" and result["n_queries"] == 6
    # each query is itself in the gallery, with its own label: found at rank 1
    assert result["recall@1"] == 1.0
    stored = [client.get(f"/v1/items/{q.key}", params={"vector": "true"}).json() for q in queries]
    everything = [
        client.get(f"/v1/items/{i.key}", params={"vector": "true"}).json() for i in gallery
    ]
    expected = retrieval_metrics(
        np.asarray([s["vector"] for s in stored], np.float32),
        [q.label for q in queries],
        [1, 3],
        gallery_embeddings=np.asarray([e["vector"] for e in everything], np.float32),
        gallery_labels=[e["label"] for e in everything],
    )
    assert result["map"] == pytest.approx(expected["map"], abs=1e-6)


@pytest.mark.parametrize(
    "body",
    [
        {"mode": "queries"},
        {"mode": "leave-one-out", "ks": [0]},
        {"mode": "leave-one-out", "ks": []},
        {"mode": "sideways"},
        {"mode": "queries", "queries": [{"label": "1"}]},
    ],
)
def test_evaluate_rejects_bad_requests(client, body) -> None:
    response = client.post("/v1/evaluate", json=body)
    assert response.status_code == 422 and response.json()["code"] == "invalid_request"


# -- hostile input -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bomb() -> bytes:
    return png_bomb()


def test_hostile_uploads_get_4xx(client, bomb) -> None:
    jpeg = photo_bytes("JPEG")
    cases = {
        "bomb": (bomb, 413, "image_too_large"),
        "truncated JPEG": (jpeg[: len(jpeg) // 2], 422, "corrupt_image"),
        "text file": (b"name,label\nthis is not an image\n" * 20, 415, "unsupported_image_format"),
        "empty file": (b"", 415, "unsupported_image_format"),
        "PPM (not allowed)": (b"P6\n2 2\n255\n" + bytes(12), 415, "unsupported_image_format"),
    }
    for name, (data, status, code) in cases.items():
        for route in ("/v1/search", "/v1/embed"):
            response = client.post(route, **upload(data, "evil.png"))
            assert response.status_code == status, (name, route, response.text)
            assert response.json()["code"] == code, name
        added = client.post("/v1/items", headers=AUTH, **upload(data, key="evil"))
        assert added.status_code == status, name
    assert client.get("/v1/items/evil").status_code == 404


def test_bodies_over_the_limit_get_413(client) -> None:
    big = b"\0" * (30 * 2**20)
    response = client.post("/v1/search", **upload(big, "big.png"))
    assert response.status_code == 413 and response.json()["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit is enforced on the bytes received
        for _ in range(30):
            yield b"\0" * 2**20

    streamed = client.post(
        "/v1/search", content=chunks(), headers={"content-type": "application/json"}
    )
    assert streamed.status_code == 413
    small_limit = client.app.state.settings.max_body_bytes
    assert small_limit < 30 * 2**20


def test_500_fuzzed_images_never_get_a_5xx(client) -> None:
    originals = [photo_bytes(fmt, size=48) for fmt in ("JPEG", "PNG", "WEBP")]
    statuses: dict[int, int] = {}
    for seed in range(500):
        response = client.post("/v1/search", **upload(fuzzed(seed, originals), k="3"))
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert response.status_code < 500, (seed, response.text)
        if response.status_code != 200:
            assert response.json()["code"] in (
                "corrupt_image",
                "unsupported_image_format",
                "unsupported_image_shape",
                "image_too_large",
            )
    print("fuzzed statuses:", dict(sorted(statuses.items())))
    # the mutations must actually break images, and some survive them
    assert statuses.get(200, 0) > 0 and sum(v for k, v in statuses.items() if k != 200) > 100


def test_slow_requests_get_503_with_retry_after() -> None:
    import asyncio as aio

    from fastapi import FastAPI

    from vitrieval.service.middleware import LimitsMiddleware

    slow = FastAPI()

    @slow.get("/slow")
    async def _slow() -> dict:
        await aio.sleep(5)
        return {}

    @slow.get("/fast")
    async def _fast() -> dict:
        return {"ok": True}

    slow.add_middleware(LimitsMiddleware, max_body_bytes=1024, timeout_s=0.2)
    with TestClient(slow) as c:
        response = c.get("/slow")
        assert response.status_code == 503 and response.json()["code"] == "timeout"
        assert response.headers["retry-after"] == "1"
        assert c.get("/fast").json() == {"ok": True}


# -- docs pages, favicon, messages that name what went wrong -----------------------------------


def test_docs_pages_load_their_assets_from_the_service(client) -> None:
    import re

    for page in ("/docs", "/redoc"):
        html = client.get(page).text
        assert not re.findall(r"(?:src|href)=['\"]https?://", html), page
        for asset in re.findall(r"(?:src|href)=['\"](/docs/assets/[^'\"]+)", html):
            got = client.get(asset)
            assert got.status_code == 200 and len(got.content) > 10_000, asset
    assert client.get("/docs/assets/../../settings.py").status_code == 404
    assert client.get("/docs/assets/secret.js").json()["code"] == "not_found"
    favicon = client.get("/favicon.ico")
    assert favicon.status_code == 200 and favicon.headers["content-type"] == "image/svg+xml"
    metrics = client.get("/metrics").text
    assert 'route="/docs"' in metrics and 'route="/favicon.ico"' in metrics
    assert 'vitrieval_requests_total{method="GET",route="unmatched",status="200"}' not in metrics


def test_a_conflicting_add_says_what_to_do_once(client) -> None:
    item = {"key": "twice", "vector": [1.0] + [0.0] * 127}
    assert client.post("/v1/items", json=item, headers=AUTH).status_code == 201
    again = client.post("/v1/items", json=item, headers=AUTH)
    assert again.status_code == 409
    assert again.json()["detail"] == (
        "an item with key 'twice' exists; send replace=true to overwrite it"
    )


def test_image_errors_name_the_uploaded_file(client) -> None:
    response = client.post("/v1/search", **upload(b"not an image at all", name="holiday.jpg"))
    assert response.status_code == 415
    assert response.json()["detail"].startswith("'holiday.jpg': not a recognised image file")
    unnamed = client.post("/v1/search", **upload(b"not an image", name="\x1b[2Jx.png"))
    assert unnamed.json()["detail"].startswith("the 'image' upload: ")
    encoded = client.post("/v1/search", json={"image_base64": base64.b64encode(b"xx").decode()})
    assert encoded.json()["detail"].startswith("image_base64: ")
