"""Metadata filters and alpha-QE re-ranking through the HTTP API (in-process, the real
app): POST /v1/search (JSON and multipart) answers exactly what the store answers with
the same filter, items added with metadata are found by it, /v1/evaluate takes a
filter, every bad filter or re-rank is a 4xx naming the problem; and the Ray Serve
ingress's index access (shards as replicas, called without a cluster) passes filters,
reads vectors and returns store errors as the single-process server does."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path

import numpy as np
import pytest
from app_client import AUTH, KEY, ODD
from fastapi.testclient import TestClient
from ray_cluster import NO_RAY, ray_missing

from vitrieval.index.evaluation.metrics import retrieval_metrics
from vitrieval.index.query import AQE, MAX_AQE_NEIGHBOURS, Where, search_store
from vitrieval.index.shards import open_index
from vitrieval.index.store import IndexStore, StoreError
from vitrieval.index.store.filters import MAX_FILTER_DEPTH
from vitrieval.service.app import create_app
from vitrieval.service.inputs import form_schemas
from vitrieval.service.routers.search import SEARCH_BODY
from vitrieval.service.settings import Settings
from vitrieval.service.state import check_vector


def keys_scores(hits: list[dict]) -> list[tuple[str, float]]:
    return [(h["key"], h["score"]) for h in hits]


def expected(store, vector, k: int, **where) -> list[tuple[str, float]]:
    """The store's answer to `vector` as the service reads it from a request: float32,
    normalised (a stored vector's norm is 1 only to within an ulp or two, and CPUs
    differ in where that last bit lands)."""
    query = check_vector(vector, store.dim)[None, :]
    return [(h.key, h.score) for h in store.search(query, k, **where)[0]]


def form(image: bytes, **fields) -> dict:
    """A multipart search: the image as the file part `image`, other fields as text."""
    return {"files": {"image": ("q.png", image, "image/png")}, "data": fields}


# -- filters on every kind of query ------------------------------------------------------


def test_a_filtered_search_answers_what_the_store_answers(client, gallery, reference) -> None:
    item = gallery[4]
    vector = reference.get(item.key).vector.tolist()
    filters = [
        ODD,
        {"must_not": [{"key": "label", "match": "1"}]},
        {"should": [{"key": "label", "match": "2"}, {"key": "label", "match": "8"}]},
        {"must": [{"key": "label", "match": "nothing has this label"}]},
        {},
    ]
    for flt in filters:
        body = client.post("/v1/search", json={"vector": vector, "k": 15, "filter": flt})
        assert body.status_code == 200, body.text
        hits = body.json()["hits"]
        want = expected(reference, vector, 15, filter=flt)
        assert [h for h, _ in keys_scores(hits)] == [h for h, _ in want]
        np.testing.assert_allclose([s for _, s in keys_scores(hits)], [s for _, s in want])
    hits = client.post("/v1/search", json={"vector": vector, "k": 50, "filter": ODD}).json()["hits"]
    assert len(hits) == 50 and {h["label"] for h in hits} <= {"1", "3", "5", "7", "9"}
    # by key (the item itself left out) and by an uploaded image, JSON and multipart
    by_key = client.post("/v1/search", json={"key": item.key, "k": 10, "filter": ODD}).json()
    want = expected(reference, vector, 10, filter=ODD, exclude_keys=[item.key])
    assert [h for h, _ in keys_scores(by_key["hits"])] == [k for k, _ in want]
    image = Path(item.path).read_bytes()
    encoded = base64.b64encode(image).decode()
    by_json = client.post("/v1/search", json={"image_base64": encoded, "k": 10, "filter": ODD})
    by_form = client.post("/v1/search", **form(image, k="10", filter=json.dumps(ODD)))
    assert by_form.status_code == 200, by_form.text
    assert by_form.json()["hits"] == by_json.json()["hits"]
    assert {h["label"] for h in by_form.json()["hits"]} <= {"1", "3", "5", "7", "9"}
    # a filter and a label together: both hold
    both = client.post(
        "/v1/search", json={"vector": vector, "k": 50, "filter": ODD, "label": "3"}
    ).json()["hits"]
    assert both and {h["label"] for h in both} == {"3"}


def test_items_added_with_metadata_are_found_by_it(client, gallery) -> None:
    rng = np.random.default_rng(0)
    colours = ["red", "blue", "green"]
    added = {}
    for i in range(30):
        vector = rng.standard_normal(128)
        metadata = {
            "colour": colours[i % 3],
            "price": i,
            "shop": {"city": "Oslo" if i < 10 else "Rome"},
        }
        key = f"shop/{i:02d}"
        made = client.post(
            "/v1/items",
            headers=AUTH,
            json={"key": key, "vector": vector.tolist(), "label": "shop", "metadata": metadata},
        )
        assert made.status_code == 201, made.text
        added[key] = (vector / np.linalg.norm(vector), metadata)
    # one more as the documented multipart form: image, key, label, metadata (JSON text)
    photo = Path(gallery[0].path).read_bytes()
    made = client.post(
        "/v1/items",
        headers=AUTH,
        files={"image": ("p.png", photo, "image/png")},
        data={
            "key": "shop/photo",
            "label": "shop",
            "metadata": json.dumps({"colour": "red", "price": 15.5}),
        },
    )
    assert made.status_code == 201, made.text
    stored = client.get("/v1/items/shop/photo", params={"vector": "true"}).json()
    added["shop/photo"] = (np.asarray(stored["vector"]), {"colour": "red", "price": 15.5})

    flt = {
        "must": [
            {"key": "colour", "match": {"any": ["red", "blue"]}},
            {"key": "price", "range": {"gte": 10, "lt": 20}},
        ],
        "must_not": [{"key": "shop.city", "match": "Oslo"}],
    }
    allowed = [
        k
        for k, (_, md) in added.items()
        if md["colour"] in ("red", "blue")
        and 10 <= md["price"] < 20
        and md.get("shop", {}).get("city") != "Oslo"
    ]
    query = rng.standard_normal(128)
    body = client.post("/v1/search", json={"vector": query.tolist(), "k": 50, "filter": flt})
    assert body.status_code == 200, body.text
    hits = body.json()["hits"]
    scores = {k: float(v @ query / np.linalg.norm(query)) for k, (v, _) in added.items()}
    want = sorted(allowed, key=lambda k: -scores[k])
    assert [h["key"] for h in hits] == want
    np.testing.assert_allclose([h["score"] for h in hits], [scores[k] for k in want], atol=1e-5)
    assert all(h["metadata"] == added[h["key"]][1] for h in hits)
    # a multipart search with the filter as a form field (JSON text)
    photo_hits = client.post(
        "/v1/search",
        **form(photo, k="5", filter=json.dumps({"must": [{"key": "colour", "match": "red"}]})),
    ).json()["hits"]
    assert photo_hits[0]["key"] == "shop/photo" and photo_hits[0]["score"] == pytest.approx(
        1, abs=1e-5
    )
    assert all(h["metadata"]["colour"] == "red" for h in photo_hits)


# -- bad filters --------------------------------------------------------------------------

BAD_FILTERS = [
    ({"mist": []}, "unknown field 'mist'"),
    ({"must": [{"key": "colour"}]}, "filter.must[0]"),
    ({"must": [{"key": "colour", "match": "red", "range": {"gt": 1}}]}, "filter.must[0]"),
    ({"must": [{"key": "price", "range": {"gte": "ten"}}]}, "filter.must[0]"),
    ({"must": [{"key": "price", "range": {}}]}, "filter.must[0]"),
    ({"must": [{"key": "colour", "match": {"any": "red"}}]}, "filter.must[0]"),
    ({"must": [{"key": "colour", "match": [1, 2]}]}, "filter.must[0]"),
    ({"must": [{"key": "", "match": "x"}]}, "filter.must[0]"),
    ({"must": [{"key": 5, "match": "x"}]}, "filter.must[0]"),
    ({"must": "colour"}, "filter.must"),
    ({"should": [{"match": "red"}]}, "filter.should[0]"),
    ({"must": [{"key": "price", "range": {"gt": float("inf")}}]}, "filter.must[0]"),
]


def nested(depth: int) -> dict:
    flt: dict = {"must": [{"key": "a", "match": 1}]}
    for _ in range(depth):
        flt = {"must": [flt]}
    return flt


@pytest.mark.parametrize(("flt", "named"), BAD_FILTERS)
def test_a_bad_filter_is_a_422_naming_the_problem(client, flt, named) -> None:
    vector = [1.0] + [0.0] * 127
    content = json.dumps({"vector": vector, "k": 3, "filter": flt}, allow_nan=True)
    response = client.post(
        "/v1/search", content=content, headers={"content-type": "application/json"}
    )
    assert response.status_code == 422, response.text
    body = response.json()
    assert body["code"] == "invalid_request" and "filter" in body["detail"]
    assert named in body["detail"], body["detail"]
    # the same filter as a form field, and on /v1/evaluate
    as_form = client.post(
        "/v1/search",
        files={"image": ("q.png", b"never decoded", "image/png")},
        data={"filter": json.dumps(flt, allow_nan=True)},
    )
    assert as_form.status_code == 422 and named in as_form.json()["detail"], as_form.text
    evaluated = client.post(
        "/v1/evaluate", content=json.dumps({"filter": flt}, allow_nan=True),
        headers={"content-type": "application/json"},
    )  # fmt: skip
    assert evaluated.status_code == 422 and named in evaluated.json()["detail"], evaluated.text


@pytest.mark.parametrize(
    "flt",
    [
        "red",
        [1, 2],
        7,
        None,
        nested(MAX_FILTER_DEPTH + 1),
        {"must": [{"key": "a", "match": "x"}] * 300},
    ],
)
def test_filters_of_the_wrong_shape_or_too_large_are_422(client, flt) -> None:
    vector = [1.0] + [0.0] * 127
    response = client.post("/v1/search", json={"vector": vector, "k": 3, "filter": flt})
    if flt is None:  # null: no filter
        assert response.status_code == 200
        return
    assert response.status_code == 422, response.text
    assert response.json()["code"] == "invalid_request" and "filter" in response.json()["detail"]


@pytest.mark.parametrize(
    "text", ["{oops", "[1, 2]", '"red"', "", '{"must": [{"key": "\\ud800", "match": 1}]}']
)
def test_a_form_filter_that_is_not_a_json_object_is_422(client, text) -> None:
    response = client.post(
        "/v1/search",
        files={"image": ("q.png", b"never decoded", "image/png")},
        data={"filter": text},
    )
    assert response.status_code == 422, response.text
    assert "filter" in response.json()["detail"]


# -- evaluate with a filter ---------------------------------------------------------------


def test_evaluate_takes_only_the_items_the_filter_allows(client, reference) -> None:
    keys, labels, vectors = reference.labelled_items(filter=ODD)
    assert 0 < len(keys) < len(reference)
    response = client.post("/v1/evaluate", json={"ks": [1, 5], "filter": ODD})
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["n_items"] == len(keys)
    offline = retrieval_metrics(vectors, labels, [1, 5])
    for name in ("recall@1", "recall@5", "map"):
        assert result[name] == pytest.approx(offline[name], abs=1e-12), name
    # uploaded queries are ranked against the allowed items only
    queries = [
        {"vector": reference.get(k).vector.tolist(), "label": lab}
        for k, lab in zip(keys[:4], labels[:4], strict=True)
    ]
    ranked = client.post(
        "/v1/evaluate", json={"mode": "queries", "ks": [1], "queries": queries, "filter": ODD}
    )
    assert ranked.status_code == 200 and ranked.json()["n_items"] == len(keys)
    few = client.post(
        "/v1/evaluate", json={"filter": {"must": [{"key": "label", "match": "none"}]}}
    )
    assert few.status_code == 422 and few.json()["code"] == "not_enough_items"
    assert "filter" in few.json()["detail"]


# -- alpha-QE ----------------------------------------------------------------------------


def test_aqe_answers_what_the_query_module_answers_on_the_store(client, gallery, reference) -> None:
    item = gallery[9]
    vector = reference.get(item.key).vector
    plain = client.post("/v1/search", json={"vector": vector.tolist(), "k": 10}).json()["hits"]
    for rerank, aqe in [
        ({"method": "aqe"}, AQE()),
        ({"method": "aqe", "n": 5, "alpha": 1.0}, AQE(5, 1.0)),
        ({"method": "aqe", "n": 3, "alpha": 0}, AQE(3, 0.0)),
    ]:
        body = client.post(
            "/v1/search", json={"vector": vector.tolist(), "k": 10, "rerank": rerank}
        )
        assert body.status_code == 200, body.text
        want = search_store(reference, vector[None, :], 10, rerank=aqe)[0]
        got = body.json()["hits"]
        assert [h["key"] for h in got] == [h.key for _, h in want]
        np.testing.assert_allclose([h["score"] for h in got], [h.score for _, h in want], atol=1e-5)
    assert got != plain  # expansion changed the answer (or the test would prove nothing)
    # with a filter, by key (the item itself out of both searches), multipart
    by_key = client.post(
        "/v1/search",
        json={"key": item.key, "k": 8, "filter": ODD, "rerank": {"method": "aqe", "n": 4}},
    ).json()["hits"]
    where = Where(filter=ODD, exclude_keys=[item.key])
    want = search_store(reference, vector[None, :], 8, where=where, rerank=AQE(4))[0]
    assert [h["key"] for h in by_key] == [h.key for _, h in want]
    image = Path(item.path).read_bytes()
    as_form = client.post(
        "/v1/search",
        **form(image, k="8", filter=json.dumps(ODD), rerank=json.dumps({"method": "aqe", "n": 4})),
    )
    assert as_form.status_code == 200, as_form.text
    by_image = client.post(
        "/v1/search",
        json={
            "image_base64": base64.b64encode(image).decode(),
            "k": 8,
            "filter": ODD,
            "rerank": {"method": "aqe", "n": 4},
        },
    )
    assert as_form.json()["hits"] == by_image.json()["hits"]


@pytest.mark.parametrize(
    ("rerank", "named"),
    [
        ({"method": "qe"}, "rerank.method"),
        ({"method": "AQE"}, "rerank.method"),
        ({}, "rerank.method"),
        ({"method": "aqe", "n": 0}, "rerank.n"),
        ({"method": "aqe", "n": MAX_AQE_NEIGHBOURS + 1}, "rerank.n"),
        ({"method": "aqe", "n": 2.5}, "rerank.n"),
        ({"method": "aqe", "alpha": -1}, "rerank.alpha"),
        ({"method": "aqe", "alpha": float("nan")}, "rerank.alpha"),
        ({"method": "aqe", "alpha": float("inf")}, "rerank.alpha"),
        ({"method": "aqe", "alpha": 1e9}, "rerank.alpha"),
        ({"method": "aqe", "beta": 1}, "rerank.beta"),
        ("aqe", "rerank"),
    ],
)
def test_bad_rerank_parameters_are_422(client, rerank, named) -> None:
    vector = [1.0] + [0.0] * 127
    content = json.dumps({"vector": vector, "rerank": rerank}, allow_nan=True)
    response = client.post(
        "/v1/search", content=content, headers={"content-type": "application/json"}
    )
    assert response.status_code == 422, response.text
    assert response.json()["code"] == "invalid_request" and named in response.json()["detail"]
    as_form = client.post(
        "/v1/search",
        files={"image": ("q.png", b"never decoded", "image/png")},
        data={"rerank": json.dumps(rerank, allow_nan=True)},
    )
    assert as_form.status_code == 422 and "rerank" in as_form.json()["detail"], as_form.text


def test_the_openapi_form_documents_filter_fusion_rerank_and_images(client) -> None:
    schema = client.get("/openapi.json").json()
    fields = form_schemas(SEARCH_BODY)["multipart/form-data"]["properties"]
    assert fields["filter"]["type"] == "string" and "must" in fields["filter"]["description"]
    assert fields["fusion"]["enum"] == ["mean", "max"]
    assert fields["image"]["type"] == "array" and fields["image"]["items"]["format"] == "binary"
    assert fields["image"]["maxItems"] == 16
    components = schema["components"]["schemas"]
    props = components["SearchRequest"]["properties"]
    assert {"filter", "rerank", "fusion", "images_base64"} <= set(props)
    assert "filter" in components["EvaluateRequest"]["properties"]


# -- the Ray Serve ingress's index access, without a cluster ------------------------------


class _Method:
    def __init__(self, call) -> None:
        self.call = call

    def remote(self, *args):
        return self.call(*args)


class _Handle:
    """A deployment handle's `handle.method.remote(...)`, on a replica in this process."""

    def __init__(self, replica) -> None:
        self.replica = replica

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self.replica, name))


@pytest.mark.skipif(ray_missing(), reason=NO_RAY)
def test_the_ray_ingress_index_passes_filters_and_reads_vectors(tmp_path) -> None:
    from vitrieval.distributed.serve.ingress import RemoteIndex
    from vitrieval.distributed.serve.replicas import ShardReplica
    from vitrieval.index.pipeline.embeddings_folder import write_part
    from vitrieval.index.shards.build import build_shard, build_sharded

    rng = np.random.default_rng(5)
    x = rng.standard_normal((200, 16)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    keys = [f"k{i:03d}" for i in range(len(x))]
    labels = [str(i % 4) for i in range(len(x))]
    metadata = [{"colour": ["red", "blue"][i % 2], "price": i} for i in range(len(x))]
    emb = tmp_path / "emb"
    write_part(emb / "part-00000.parquet", keys, x, labels=labels, metadata=metadata)
    (emb / "embeddings.json").write_text(json.dumps({"dim": 16, "model_fingerprint": "f" * 64}))
    jobs = lambda js: [build_shard(**job) for job in js]  # noqa: E731
    build_sharded(emb, tmp_path / "sharded", "", "Flat", 3, 1000, run_shards=jobs)
    flt = {"must": [{"key": "colour", "match": "red"}, {"key": "price", "range": {"lt": 150}}]}

    async def scenario(sharded, aqe) -> None:
        from vitrieval.index.query import search

        replicas = [
            ShardReplica(str(tmp_path / "sharded" / name), None, 16)
            for name in sharded.manifest.shards
        ]
        index = RemoteIndex([_Handle(r) for r in replicas], tmp_path / "sharded", 16)
        where = {"label": None, "exclude_keys": ["k000"], "filter": flt}
        got = await index.ranked_search(x[:3], 10, **where)
        assert got == sharded.ranked_search(x[:3], 10, **where)
        found = await index.vectors(["k005", "nope", "k100"])
        np.testing.assert_array_equal(found[0], sharded.get("k005").vector)
        assert found[1] is None
        np.testing.assert_array_equal(found[2], sharded.get("k100").vector)
        expanded = await search(index, x[:2], 5, where=Where(filter=flt), rerank=AQE(3))
        assert expanded == aqe
        labelled = await index.labelled_items(None, flt)
        want = sharded.labelled_items(None, filter=flt)
        assert labelled[0] == want[0] and labelled[1] == want[1]
        with pytest.raises(StoreError, match="more than the 5 allowed"):
            await index.labelled_items(5, flt)
        with pytest.raises(StoreError, match=r"filter\.must\[0\]"):
            await index.ranked_search(
                x[:1], 3, label=None, exclude_keys=[], filter={"must": [{"key": "a"}]}
            )

    with open_index(tmp_path / "sharded") as sharded:
        aqe = search_store(sharded, x[:2], 5, where=Where(filter=flt), rerank=AQE(3))
        asyncio.run(scenario(sharded, aqe))


def test_rerank_dba_ranks_against_the_index_dba_vectors(
    digits_gallery, served_index, gallery, reference
) -> None:
    vector = reference.get(gallery[4].key).vector.tolist()
    settings = Settings(model=digits_gallery["model"], index=served_index, api_key=KEY)
    with TestClient(create_app(settings)) as c:  # before: the index has no DBA vectors
        r = c.post("/v1/search", json={"vector": vector, "k": 5, "rerank": {"method": "dba"}})
        assert r.status_code == 422 and "has no DBA vectors" in r.json()["detail"]
    with IndexStore.open(served_index) as store:
        store.set_dba(3, 2.0)
        store.save()
        store.merge(everything=True, rewrite=True)
        want = expected(store, vector, 5, augmented=True, filter=ODD)
        plain = expected(store, vector, 5, filter=ODD)
    assert want != plain  # DBA changes this ranking: the comparison below can fail
    with TestClient(create_app(settings)) as c:
        body = {"vector": vector, "k": 5, "filter": ODD, "rerank": {"method": "dba"}}
        r = c.post("/v1/search", json=body)
        assert r.status_code == 200, r.text
        assert keys_scores(r.json()["hits"]) == want
