"""Several images as one query through POST /v1/search (in-process, the real app): the
multipart `image` field repeated or JSON `images_base64`, fused by mean (one search of
the normalised mean embedding) or max (exact: each item's best similarity to any of
the images), with filters and re-ranking; and the limits: too many images, a bad
fusion, a bad image among good ones, always a 4xx naming the problem."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest
from app_client import ODD, make_client
from fastapi.testclient import TestClient

from vitrieval.index.fusion import fuse_mean
from vitrieval.index.query import AQE, Where, search_store_fused
from vitrieval.service.inputs import MAX_FORM_FIELDS
from vitrieval.service.schemas import MAX_QUERY_IMAGES


def images_of(gallery, *indices: int) -> list[bytes]:
    return [Path(gallery[i].path).read_bytes() for i in indices]


def multipart(images: list[bytes], **fields) -> dict:
    """A multipart body with the `image` field repeated, one part per image."""
    files = [("image", (f"q{i}.png", data, "image/png")) for i, data in enumerate(images)]
    return {"files": files, "data": fields}


def as_json(images: list[bytes], **fields) -> dict:
    return {"json": {"images_base64": [base64.b64encode(d).decode() for d in images], **fields}}


def embeddings(client: TestClient, images: list[bytes]) -> np.ndarray:
    """What the service embeds each image as (POST /v1/embed)."""
    rows = []
    for data in images:
        body = client.post("/v1/embed", files={"image": ("q.png", data, "image/png")}).json()
        rows.append(body["embedding"])
    return np.asarray(rows, dtype=np.float32)


def keys_and_scores(hits: list[dict]) -> tuple[list[str], list[float]]:
    return [h["key"] for h in hits], [h["score"] for h in hits]


def assert_same(hits: list[dict], found) -> None:
    keys, scores = keys_and_scores(hits)
    assert keys == [h.key for _, h in found]
    np.testing.assert_allclose(scores, [h.score for _, h in found], atol=1e-5)


def test_mean_fusion_searches_the_normalised_mean(client, gallery, reference) -> None:
    images = images_of(gallery, 2, 15, 40)
    x = embeddings(client, images)
    for body in (multipart(images, k="10"), multipart(images, k="10", fusion="mean")):
        answer = client.post("/v1/search", **body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["query"] == "image" and len(answer.json()["hits"]) == 10
        want = reference.search(fuse_mean(x)[None, :], 10)[0]
        assert keys_and_scores(answer.json()["hits"])[0] == [h.key for h in want]
    by_json = client.post("/v1/search", **as_json(images, k=10, fusion="mean"))
    assert by_json.status_code == 200 and by_json.json()["hits"] == answer.json()["hits"]
    # the mean of the three as a vector query: the same hits
    by_vector = client.post("/v1/search", json={"vector": fuse_mean(x).tolist(), "k": 10})
    assert keys_and_scores(by_vector.json()["hits"])[0] == keys_and_scores(answer.json()["hits"])[0]


def test_max_fusion_is_each_items_best_similarity(client, gallery, reference) -> None:
    picked = (3, 27, 64, 101)
    images = images_of(gallery, *picked)
    x = embeddings(client, images)
    answer = client.post("/v1/search", **multipart(images, k="20", fusion="max"))
    assert answer.status_code == 200, answer.text
    hits = answer.json()["hits"]
    # brute force over every stored item: the max of its similarities to the images
    keys = reference.keys()
    stored = np.stack([reference.get(k).vector for k in keys]).astype(np.float64)
    best = (x.astype(np.float64) @ stored.T).max(axis=0)
    order = np.lexsort((np.arange(len(keys)), -best))[:20]
    np.testing.assert_allclose([h["score"] for h in hits], best[order], atol=1e-5)
    # (the four at about 1.0 differ in float rounding only: their order is not compared)
    assert {h["key"] for h in hits[:4]} == {keys[i] for i in order[:4]}
    assert [h["key"] for h in hits[4:]] == [keys[i] for i in order[4:]]
    # each query image is an indexed item: all four found at about 1.0, first
    assert {h["key"] for h in hits[:4]} == {gallery[i].key for i in picked}
    assert all(h["score"] == pytest.approx(1.0, abs=1e-5) for h in hits[:4])
    assert_same(hits, search_store_fused(reference, x, 20, fusion="max"))
    by_json = client.post("/v1/search", **as_json(images, k=20, fusion="max"))
    assert by_json.json()["hits"] == hits


def test_fusion_with_a_filter_a_label_and_aqe(client, gallery, reference) -> None:
    images = images_of(gallery, 5, 50, 90)
    x = embeddings(client, images)
    for fusion in ("mean", "max"):
        answer = client.post(
            "/v1/search",
            **as_json(images, k=12, fusion=fusion, filter=ODD, rerank={"method": "aqe", "n": 3}),
        )
        assert answer.status_code == 200, answer.text
        hits = answer.json()["hits"]
        assert hits and {h["label"] for h in hits} <= {"1", "3", "5", "7", "9"}
        want = search_store_fused(
            reference, x, 12, fusion=fusion, where=Where(filter=ODD), rerank=AQE(3)
        )
        assert_same(hits, want)
        form = client.post(
            "/v1/search",
            **multipart(images, k="12", fusion=fusion, label="7"),
        )
        assert form.status_code == 200 and {h["label"] for h in form.json()["hits"]} == {"7"}
        assert_same(
            form.json()["hits"],
            search_store_fused(reference, x, 12, fusion=fusion, where=Where(label="7")),
        )


def test_one_image_is_a_plain_search_whatever_the_fusion(client, gallery) -> None:
    image = images_of(gallery, 8)
    plain = client.post("/v1/search", **multipart(image, k="6")).json()["hits"]
    for fusion in ("mean", "max"):
        assert (
            client.post("/v1/search", **multipart(image, k="6", fusion=fusion)).json()["hits"]
            == plain
        )
        assert (
            client.post("/v1/search", **as_json(image, k=6, fusion=fusion)).json()["hits"] == plain
        )
    single = {"image_base64": base64.b64encode(image[0]).decode(), "k": 6}
    assert client.post("/v1/search", json=single).json()["hits"] == plain


def test_many_images_share_one_request_within_the_limits(client, gallery) -> None:
    images = images_of(gallery, *range(MAX_QUERY_IMAGES))
    answer = client.post("/v1/search", **multipart(images, k="5", fusion="max"))
    assert answer.status_code == 200, answer.text
    timings = answer.json()["timings_ms"]
    assert timings["decode"] > 0 and timings["embed"] > 0 and timings["search"] > 0

    too_many = images_of(gallery, *range(MAX_QUERY_IMAGES + 1))
    for body in (multipart(too_many, k="5"), as_json(too_many, k=5)):
        response = client.post("/v1/search", **body)
        assert response.status_code == 422, response.text
        assert str(MAX_QUERY_IMAGES) in response.json()["detail"]
    form = client.post("/v1/search", **multipart(too_many))
    assert form.json()["code"] == "too_many_images"
    # far too many file parts: the form parser's own limit, still a JSON 4xx
    tiny = [b"x"] * (MAX_FORM_FIELDS + 1)
    response = client.post("/v1/search", **multipart(tiny))
    assert 400 <= response.status_code < 500 and response.json()["detail"]


def test_images_over_the_body_limit_get_413(digits_gallery, served_index, gallery) -> None:
    images = images_of(gallery, *range(8))
    size = sum(len(d) for d in images)
    with make_client(
        digits_gallery["model"], served_index, max_body_bytes=max(1024, size // 2)
    ) as c:
        response = c.post("/v1/search", **multipart(images))
    assert response.status_code == 413 and response.json()["code"] == "request_too_large"


@pytest.mark.parametrize(
    ("body", "status", "code", "named"),
    [
        ({"images_base64": [], "k": 3}, 422, "invalid_request", "images_base64"),
        ({"images_base64": "abc", "k": 3}, 422, "invalid_request", "images_base64"),
        ({"images_base64": ["%%%"], "k": 3}, 422, "invalid_base64", "images_base64[0]"),
        ({"images_base64": [None], "k": 3}, 422, "invalid_request", "images_base64"),
        ({"image_base64": "aGk=", "images_base64": ["aGk="]}, 422, "invalid_request", "not both"),
        ({"images_base64": ["aGk="], "key": "digits/00001"}, 422, "invalid_request", "exactly one"),
        ({"images_base64": ["aGk="], "fusion": "median"}, 422, "invalid_request", "fusion"),
        ({"images_base64": ["aGk="], "fusion": None}, 422, "invalid_request", "fusion"),
        ({"key": "digits/00001", "fusion": 3}, 422, "invalid_request", "fusion"),
    ],
)
def test_bad_multi_image_requests_are_4xx(client, body, status, code, named) -> None:
    response = client.post("/v1/search", json=body)
    assert response.status_code == status, response.text
    assert response.json()["code"] == code and named in response.json()["detail"]


def test_a_bad_image_among_good_ones_is_named(client, gallery) -> None:
    good = images_of(gallery, 1, 2)
    files = [
        ("image", ("good1.png", good[0], "image/png")),
        ("image", ("broken.png", b"not an image at all", "image/png")),
        ("image", ("good2.png", good[1], "image/png")),
    ]
    response = client.post("/v1/search", files=files, data={"fusion": "max"})
    assert response.status_code == 415 and "broken.png" in response.json()["detail"]
    assert response.json()["code"] == "unsupported_image_format"
    encoded = [base64.b64encode(d).decode() for d in (good[0], b"nope", good[1])]
    response = client.post("/v1/search", json={"images_base64": encoded})
    assert response.status_code == 415 and "images_base64[1]" in response.json()["detail"]
    response = client.post("/v1/search", **multipart(good, fusion="average"))
    assert response.status_code == 422 and "fusion" in response.json()["detail"]
    # an image and a key: one query has one kind of input
    response = client.post("/v1/search", **multipart(good, key="digits/00001"))
    assert response.status_code == 422 and response.json()["code"] == "invalid_request"
    # the other routes still take one image: a second file part is refused
    response = client.post("/v1/embed", **multipart(good))
    assert 400 <= response.status_code < 500


def test_images_that_cancel_out_are_a_422_for_mean_fusion(client, monkeypatch) -> None:
    """Two images whose embeddings are opposite (made so by a stand-in model call)."""
    import vitrieval.service.routers.search as route

    async def opposite(state, images, timings):
        v = np.zeros(128, dtype=np.float32)
        v[0] = 1
        return np.stack([v, -v])

    monkeypatch.setattr(route, "_embed_images", opposite)
    body = {"images_base64": ["aGk=", "aGk="], "k": 3}
    response = client.post("/v1/search", json=body)
    assert response.status_code == 422 and "cancel" in response.json()["detail"]
    assert client.post("/v1/search", json={**body, "fusion": "max"}).status_code == 200
