"""`vitrieval.client.Client` against real servers on loopback: every route, both keys,
and every error status raised as its exception with the server's code."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import numpy as np
import pytest
from client_servers import KEY, READ_KEY, limited_server, main_server, png, slot_held
from PIL import Image

import vitrieval
from vitrieval.client import (
    APIError,
    AsyncClient,
    AuthenticationError,
    Client,
    ConflictError,
    EvaluateResponse,
    InfoResponse,
    InvalidRequestError,
    ItemOut,
    ItemWritten,
    NotFoundError,
    PayloadTooLargeError,
    PermissionDeniedError,
    SearchResponse,
    ServiceUnavailableError,
    Status,
    UnsupportedMediaTypeError,
)

ODD = {"must": [{"key": "label", "match": {"any": ["1", "3", "5", "7", "9"]}}]}


@pytest.fixture(scope="module")
def server(digits_gallery, tmp_path_factory):
    with main_server(digits_gallery, tmp_path_factory.mktemp("client")) as running:
        yield running


@pytest.fixture(scope="module")
def limited(digits_gallery, tmp_path_factory):
    with limited_server(digits_gallery, tmp_path_factory.mktemp("client_limited")) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with Client(server.url, api_key=KEY) as c:
        yield c


@pytest.fixture(scope="module")
def item(gallery):
    """A gallery item: (key, path, label)."""
    found = gallery[7]
    return found.key, Path(found.path), found.label


def test_search_by_every_kind_of_image_finds_the_image_itself(client, item):
    key, path, label = item
    pil = Image.open(path)
    inputs = [str(path), path, path.read_bytes(), io.BytesIO(path.read_bytes()), pil]
    for image in inputs:
        answer = client.search(image=image, k=3)
        assert isinstance(answer, SearchResponse) and answer.query == "image"
        assert len(answer.hits) == answer.k == 3
        top = answer.hits[0]
        assert (top.key, top.label) == (key, label), type(image)
        assert top.score == pytest.approx(1.0, abs=1e-4)
        assert isinstance(top.metadata, dict)
    with path.open("rb") as opened:
        assert client.search(image=opened, k=1).hits[0].key == key


def test_search_by_vector_key_and_several_images(client, item, gallery):
    key, path, _ = item
    vector = client.get(key, vector=True).vector
    assert vector is not None
    by_list = client.search(vector=vector, k=5)
    by_array = client.search(vector=np.asarray(vector, dtype=np.float32), k=5)
    assert by_list.query == "vector" and by_list.hits[0].key == key
    assert [h.key for h in by_array.hits] == [h.key for h in by_list.hits]
    by_key = client.search(key=key, k=4)
    assert by_key.query == "key"
    assert [h.key for h in by_key.hits] == [h.key for h in by_list.hits[1:5]]
    with_self = client.search(key=key, k=4, exclude_self=False)
    assert with_self.hits[0].key == key
    other = Path(gallery[20].path)
    fused = client.search(images=[path, other], k=5, fusion="max")
    assert fused.query == "image"
    assert {h.key for h in fused.hits[:2]} == {key, gallery[20].key}


def test_search_narrowed_and_reranked(client, item):
    _, path, _ = item
    odd = client.search(image=path, k=10, filter=ODD)
    assert odd.hits and all(int(h.label) % 2 == 1 for h in odd.hits)
    sevens = client.search(image=path, k=5, label="7")
    assert sevens.hits and {h.label for h in sevens.hits} == {"7"}
    plain = client.search(image=path, k=10)
    for rerank in ("aqe", {"method": "aqe", "n": 3, "alpha": 2.0}):
        expanded = client.search(image=path, k=10, rerank=rerank)
        assert len(expanded.hits) == 10
        assert {h.key for h in expanded.hits} & {h.key for h in plain.hits}


def test_items_add_get_thumbnail_replace_delete(client, item):
    _, path, _ = item
    written = client.add("client/img", image=path, label="7", metadata={"price": 3})
    assert isinstance(written, ItemWritten)
    assert (written.key, written.label, written.metadata) == ("client/img", "7", {"price": 3})
    assert written.has_image and not written.replaced
    got = client.get("client/img")
    assert isinstance(got, ItemOut) and got.vector is None and got.metadata == {"price": 3}
    jpeg = client.thumbnail("client/img", size=24)
    assert jpeg[:3] == b"\xff\xd8\xff"
    assert max(Image.open(io.BytesIO(jpeg)).size) <= 24
    hits = client.search(image=path, k=2, filter={"must": [{"key": "price", "match": 3}]})
    assert [h.key for h in hits.hits] == ["client/img"]

    vector = [1.0] + [0.0] * (len(client.get("client/img", vector=True).vector) - 1)
    odd_key = "client/vec with space?&#%"
    added = client.add(odd_key, vector=np.asarray(vector), metadata={"a": {"b": [1, 2]}})
    assert not added.has_image and client.get(odd_key).metadata == {"a": {"b": [1, 2]}}
    with pytest.raises(ConflictError) as conflict:
        client.add(odd_key, vector=vector)
    assert (conflict.value.status, conflict.value.code) == (409, "key_exists")
    replaced = client.add(odd_key, vector=vector, label="x", replace=True)
    assert replaced.replaced and client.get(odd_key).label == "x"
    assert client.search(vector=vector, k=1).hits[0].key == odd_key
    with pytest.raises(NotFoundError) as no_image:
        client.thumbnail(odd_key)
    assert no_image.value.code == "no_image"

    for key in ("client/img", odd_key):
        deleted = client.delete(key)
        assert deleted.deleted and deleted.key == key
        with pytest.raises(NotFoundError) as gone:
            client.get(key)
        assert (gone.value.status, gone.value.code) == (404, "unknown_key")


def test_embed_is_the_indexed_vector(client, item):
    key, path, _ = item
    answer = client.embed(path)
    stored = client.get(key, vector=True).vector
    assert answer.dim == len(answer.embedding) == len(stored)
    assert np.allclose(answer.embedding, stored, atol=1e-4)
    assert answer.fingerprint == client.info().model.fingerprint


def test_evaluate_leave_one_out_queries_and_filter(client, gallery):
    loo = client.evaluate(ks=[1, 5])
    assert isinstance(loo, EvaluateResponse) and loo.mode == "leave-one-out"
    assert loo.n_items == 120 and 0 <= loo.recall(1) <= loo.recall(5) <= 1
    assert loo.model_extra is not None and "precision@5" in loo.model_extra
    filtered = client.evaluate(ks=[1], filter=ODD)
    assert filtered.n_items == sum(1 for g in gallery if int(g.label) % 2 == 1)
    vector = client.get(gallery[0].key, vector=True).vector
    queries = [(g.label, Path(g.path)) for g in gallery[:4]] + [(gallery[0].label, vector)]
    asked = client.evaluate(queries=queries, ks=[1])
    assert asked.mode == "queries" and asked.n_queries + asked.n_dropped == 5
    assert asked.recall(1) == 1.0  # each query image is in the gallery itself


def test_info_health_readiness_metrics_and_version(client):
    info = client.info()
    assert isinstance(info, InfoResponse)
    assert info.version == vitrieval.__version__
    assert info.service.mutations and info.service.read_key_required
    assert info.index.count >= 120
    assert client.health() == Status(status="ok")
    ready = client.readiness()
    assert ready.status == "ready" and ready.checks["model"] is True
    assert "vitrieval_requests_total" in client.metrics()
    assert client.check_version() == vitrieval.__version__


def test_the_keys(server, item):
    key = item[0]
    with Client(server.url, read_key=READ_KEY) as reader:
        assert reader.get(key).key == key
        with pytest.raises(AuthenticationError) as refused:
            reader.add("client/nope", vector=[1.0, 0.0])
        assert (refused.value.status, refused.value.code) == (401, "unauthorized")
    with Client(server.url) as anonymous:
        with pytest.raises(AuthenticationError):
            anonymous.info()
        assert anonymous.health().status == "ok"  # the probes need no key
    with Client(server.url, api_key="wrong-key-0123456") as wrong, pytest.raises(APIError) as bad:
        wrong.search(key=key)
    assert bad.value.status == 401 and isinstance(bad.value, AuthenticationError)


def test_request_errors(client, item):
    cases = [
        (lambda: client.search(image=item[1], filter={"must": [{"key": "x"}]}), 422),
        (lambda: client.search(k=3), 422),
        (lambda: client.search(key="no/such/key"), 404),
        (lambda: client.search(image=b"not an image at all"), 415),
        (lambda: client.embed(item[1].read_bytes()[:80]), 422),
    ]
    expected = {
        404: (NotFoundError, "unknown_key"),
        415: (UnsupportedMediaTypeError, "unsupported_image_format"),
        422: (InvalidRequestError, None),
    }
    for call, status in cases:
        with pytest.raises(APIError) as raised:
            call()
        cls, code = expected[status]
        assert type(raised.value) is cls and raised.value.status == status
        assert raised.value.code == (code or raised.value.code) and raised.value.detail
    with pytest.raises(InvalidRequestError) as bad_filter:
        client.search(vector=[1.0, 0.0], filter={"must": [{"key": "x"}]})
    assert bad_filter.value.code == "invalid_request"
    assert "filter.must[0]" in bad_filter.value.detail


def test_limits_read_only_and_overload(limited, item):
    with Client(limited.url, api_key=KEY, retries=0) as client:
        assert not client.info().service.mutations
        with pytest.raises(PermissionDeniedError) as read_only:
            client.add("client/x", vector=[1.0, 0.0])
        assert (read_only.value.status, read_only.value.code) == (403, "read_only")
        with pytest.raises(PermissionDeniedError):
            client.delete(item[0])
        with pytest.raises(PayloadTooLargeError) as body:
            client.search(vector=[0.5] * 1000)
        assert (body.value.status, body.value.code) == (413, "request_too_large")
        with pytest.raises(PayloadTooLargeError) as pixels:
            client.search(image=png(100, 100))
        assert pixels.value.code == "image_too_large"
        assert client.search(image=item[1], k=1).hits[0].key == item[0]
        with slot_held(limited.url), pytest.raises(ServiceUnavailableError) as overloaded:
            client.get(item[0])
        assert (overloaded.value.status, overloaded.value.code) == (503, "overloaded")
        assert overloaded.value.retry_after == 1.0


# -- AsyncClient -------------------------------------------------------------------------


def test_async_client_covers_the_routes(server, item, gallery):
    key, path, label = item

    async def run() -> None:
        async with AsyncClient(server.url, api_key=KEY) as client:
            assert (await client.search(image=path, k=2)).hits[0].key == key
            assert (await client.search(key=key, k=2, exclude_self=False)).hits[0].key == key
            fused = await client.search(images=[path, Path(gallery[3].path)], label=label)
            assert fused.hits and {h.label for h in fused.hits} == {label}
            written = await client.add("client/async", image=path, metadata={"n": 1})
            assert written.has_image
            got = await client.get("client/async", vector=True)
            embedded = await client.embed(path)
            assert np.allclose(got.vector, embedded.embedding, atol=1e-4)
            assert (await client.thumbnail("client/async"))[:2] == b"\xff\xd8"
            assert (await client.add("client/async", image=path, replace=True)).replaced
            assert (await client.delete("client/async")).deleted
            with pytest.raises(NotFoundError):
                await client.delete("client/async")
            assert (await client.evaluate(ks=[1])).n_items == 120
            assert (await client.info()).version == vitrieval.__version__
            assert (await client.health()).status == "ok"
            assert (await client.readiness()).status == "ready"
            assert "vitrieval_ready 1.0" in await client.metrics()
            assert await client.check_version() == vitrieval.__version__
        with pytest.raises(AuthenticationError):
            async with AsyncClient(server.url) as anonymous:
                await anonymous.info()

    asyncio.run(run())


def test_async_client_raises_every_error_class(server, limited, item):
    """The error statuses through AsyncClient, each as its exception with the server's
    code (the sync client's are above)."""
    key, path, _ = item

    async def expect(cls: type[APIError], code: str | None, call) -> None:
        with pytest.raises(cls) as raised:
            await call
        assert type(raised.value) is cls and (code is None or raised.value.code == code)

    async def run() -> None:
        async with AsyncClient(server.url, api_key=KEY) as client:
            await expect(ConflictError, "key_exists", client.add(key, image=path))
            await expect(NotFoundError, "unknown_key", client.get("no/such/key"))
            await expect(UnsupportedMediaTypeError, None, client.embed(b"not an image at all"))
            await expect(InvalidRequestError, "invalid_request", client.search(k=3))
        async with AsyncClient(server.url) as anonymous:
            await expect(AuthenticationError, "unauthorized", anonymous.delete(key))
        async with AsyncClient(limited.url, api_key=KEY, retries=0) as client:
            await expect(PermissionDeniedError, "read_only", client.delete(key))
            big = client.search(vector=[0.5] * 1000)
            await expect(PayloadTooLargeError, "request_too_large", big)
            with slot_held(limited.url):
                await expect(ServiceUnavailableError, "overloaded", client.get(key))

    asyncio.run(run())


def test_concurrent_async_searches_equal_the_sync_ones(client, server, gallery):
    queries = [Path(g.path) for g in gallery[:20]]
    expected = [client.search(image=q, k=5, filter=ODD) for q in queries]

    async def run() -> list[SearchResponse]:
        async with AsyncClient(server.url, read_key=READ_KEY) as concurrent:
            return await asyncio.gather(
                *(concurrent.search(image=q, k=5, filter=ODD) for q in queries)
            )

    answers = asyncio.run(run())
    for got, want in zip(answers, expected, strict=True):
        assert [h.key for h in got.hits] == [h.key for h in want.hits]
        assert [h.score for h in got.hits] == pytest.approx([h.score for h in want.hits])


def test_a_collection_name_is_one_quoted_part_of_the_path():
    with Client("http://127.0.0.1:9", collection="a/b ?") as client:
        assert client.addressed("/v1/search") == "/v1/collections/a%2Fb%20%3F/search"
        assert client.addressed("/v1/collections") == "/v1/collections"
        assert client.addressed("/healthz") == "/healthz"
        assert client.in_collection(None).addressed("/v1/search") == "/v1/search"
