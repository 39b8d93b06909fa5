"""`rescore` and `oversample` reach the store from every way a user searches: the
Python API (`vitrieval.search`), `POST /v1/search` (JSON and forms), the client
(`Client`, `AsyncClient`) and `vitrieval-index search`, and the Ray ingress hands them
to every shard; `vitrieval-index configure --oversample` saves the index's default.
Each answers exactly what the store answers with the same settings, on a small
compressed (IVF-PQ) index where the settings change the answer; a bad value is a 422
with the error body over HTTP, and one line with exit status 2 on the command line."""

from __future__ import annotations

import asyncio
import io
import json
import pickle
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
from index_cli_helpers import run
from PIL import Image
from ray_cluster import NO_RAY, ray_missing
from serving import Server
from store_helpers import build, unit_vectors

import vitrieval
from vitrieval.client import AsyncClient, Client, calls
from vitrieval.index.query import AQE, Where, search
from vitrieval.index.store import IndexStore, StoreError
from vitrieval.index.store.request import DEFAULT_OVERSAMPLE, MAX_OVERSAMPLE
from vitrieval.service.state import check_vector

FACTORY = "IVF4,PQ8x4"
"""Codes coarse enough (4-bit PQ on 128-d vectors) that re-scoring, and how widely,
changes the top 10."""
DIM = 128  # the tiny model's dimension: the service serves the index with it
K = 10
SCORINGS = [{"rescore": False}, {"oversample": 1}, {"oversample": 4}, {}]
"""Settings whose answers differ on this index (the last: the default oversampling)."""


def near(x: np.ndarray, rows: list[int], seed: int = 1) -> np.ndarray:
    """Unit queries near the items at `rows`."""
    q = x[rows] + 0.05 * np.random.default_rng(seed).standard_normal((len(rows), DIM))
    return (q / np.linalg.norm(q, axis=1, keepdims=True)).astype(np.float32)


def keys_scores(hits) -> list[tuple[str, float]]:
    return [(h.key, h.score) for h in hits]


def assert_same(got: list[tuple[str, float]], want: list[tuple[str, float]]) -> None:
    assert [key for key, _ in got] == [key for key, _ in want]
    np.testing.assert_allclose([s for _, s in got], [s for _, s in want], rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def compressed(tiny_onnx, tmp_path_factory) -> dict:
    """An IVF-PQ index of 2,000 random unit vectors (keys "0".."1999") that keeps a copy
    of the tiny model, and the vectors."""
    x = unit_vectors(np.random.default_rng(0), 2000, DIM)
    path = tmp_path_factory.mktemp("rescore") / "index"
    with build(path, x, factory=FACTORY, model_path=tiny_onnx) as store:
        store.save()
    return {"index": path, "x": x}


@pytest.fixture(scope="module")
def store(compressed):
    """The index opened read-only: what every interface must answer."""
    with IndexStore.open(compressed["index"]) as opened:
        yield opened


@pytest.fixture(scope="module")
def server(tiny_onnx, compressed):
    """A real `vitrieval-serve` over the index (read-only: the tests open it too)."""
    with Server(tiny_onnx, compressed["index"], "--read-only") as running:
        yield running


def expected(store, vector: list[float], **scoring) -> list[tuple[str, float]]:
    """The store's answer to `vector` as the service reads it (float32, normalised)."""
    query = check_vector(vector, DIM)[None, :]
    return keys_scores(store.search(query, K, **scoring)[0])


# -- the Python API --------------------------------------------------------------------


def test_the_settings_change_the_answer_on_this_index(store, compressed) -> None:
    q = near(compressed["x"], [3])
    answers = [keys_scores(store.search(q, K, **scoring)[0]) for scoring in SCORINGS]
    assert all(a != b for i, a in enumerate(answers) for b in answers[i + 1 :])
    assert store.search_params()["oversample"] == DEFAULT_OVERSAMPLE


def test_the_python_api_answers_what_the_store_answers(store, compressed) -> None:
    q = near(compressed["x"], [3, 50, 700])
    for scoring in SCORINGS:
        want = [keys_scores(row) for row in store.search(q, K, **scoring)]
        got = [keys_scores(row) for row in vitrieval.search(store, q, K, **scoring)]
        assert got == want, scoring
        # several images as one query (max: each searched with the same settings, an
        # item scoring its best similarity to any of them)
        (fused,) = vitrieval.search(store, q, K, fusion="max", **scoring)
        best: dict[str, float] = {}
        for key, score in (pair for row in want for pair in row):
            best[key] = max(score, best.get(key, -np.inf))
        top = sorted(best.items(), key=lambda pair: (-pair[1], int(pair[0])))[:K]
        assert keys_scores(fused) == top, scoring
    for bad in (0, MAX_OVERSAMPLE + 1, 2.5, True):
        with pytest.raises(StoreError, match="oversample must be an integer"):
            vitrieval.search(store, q, K, oversample=bad)
    with pytest.raises(StoreError, match="rescore must be true or false"):
        vitrieval.search(store, q, K, rescore="no")


class RecordingShard:
    """A shard deployment's handle (`handle.ranked_search.remote(query)`) that keeps
    the queries it is sent, pickled and unpickled as Ray sends them, and finds nothing."""

    def __init__(self) -> None:
        self.queries: list = []
        self.ranked_search = self

    def remote(self, query):
        self.queries.append(pickle.loads(pickle.dumps(query)))

        async def nothing() -> list:
            return [[] for _ in query.vectors]

        return nothing()


@pytest.mark.skipif(ray_missing(), reason=NO_RAY)
def test_the_ray_ingress_hands_every_shard_the_settings(tmp_path) -> None:
    from vitrieval.distributed.serve.ingress import RemoteIndex

    shards = [RecordingShard(), RecordingShard()]
    index = RemoteIndex(shards, tmp_path, DIM)
    q = unit_vectors(np.random.default_rng(3), 2, DIM)
    where = Where(exclude_keys=["a", "b", "c"])  # split among the shards: a copy each
    found = search(index, q, K, where=where, rerank=AQE(3), rescore=False, oversample=7)
    assert asyncio.run(found) == [[], []]
    for shard in shards:
        # alpha-QE's first search (its n) and the final one (k), both with the settings
        assert [query.k for query in shard.queries] == [3, K]
        assert all((query.rescore, query.oversample) == (False, 7) for query in shard.queries)


# -- POST /v1/search -------------------------------------------------------------------


def test_the_http_search_answers_what_the_store_answers(server, store, compressed) -> None:
    vector = near(compressed["x"], [11])[0].tolist()
    for scoring in SCORINGS:
        answer = httpx.post(f"{server.url}/v1/search", json={"vector": vector, "k": K, **scoring})
        assert answer.status_code == 200, answer.text
        got = [(h["key"], h["score"]) for h in answer.json()["hits"]]
        assert_same(got, expected(store, vector, **scoring))
    # a form carries both as text fields (urlencoded: a query by key)
    form = {"key": "11", "k": str(K), "rescore": "false"}
    answer = httpx.post(f"{server.url}/v1/search", data=form)
    assert answer.status_code == 200, answer.text
    want = store.search(store.get("11").vector[None], K, exclude_keys=["11"], rescore=False)
    assert_same([(h["key"], h["score"]) for h in answer.json()["hits"]], keys_scores(want[0]))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("oversample", 0),
        ("oversample", MAX_OVERSAMPLE + 1),
        ("oversample", "x"),
        ("oversample", 2.5),
        ("rescore", "maybe"),
    ],
)
def test_bad_values_are_a_422_with_the_error_body(server, field, value) -> None:
    body = {"vector": [1.0] * DIM, field: value}
    answer = httpx.post(f"{server.url}/v1/search", json=body)
    assert answer.status_code == 422, answer.text
    error = answer.json()
    assert error["code"] == "invalid_request" and error["detail"].startswith(f"{field}:"), error
    form = httpx.post(f"{server.url}/v1/search", data={"key": "1", field: str(value)})
    assert form.status_code == 422 and form.json()["code"] == "invalid_request", form.text


# -- the client ------------------------------------------------------------------------


def test_the_client_sends_the_settings_only_when_given() -> None:
    assert "rescore" not in calls.search(key="a").json
    assert "oversample" not in calls.search(key="a").json
    body = calls.search(key="a", rescore=False, oversample=3).json
    assert (body["rescore"], body["oversample"]) == (False, 3)


def test_the_clients_search_with_the_settings(server, store, compressed) -> None:
    vector = near(compressed["x"], [42])[0]
    with Client(server.url) as client:
        for scoring in SCORINGS:
            got = keys_scores(client.search(vector=vector, k=K, **scoring).hits)
            assert_same(got, expected(store, vector.tolist(), **scoring))

    async def asynchronous() -> list[tuple[str, float]]:
        async with AsyncClient(server.url) as client:
            answer = await client.search(vector=vector, k=K, oversample=16)
            return keys_scores(answer.hits)

    assert_same(asyncio.run(asynchronous()), expected(store, vector.tolist(), oversample=16))


# -- vitrieval-index search and configure ---------------------------------------------


def png(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def test_the_cli_search_takes_the_settings(capsys, tiny_onnx, store, compressed, tmp_path) -> None:
    image = tmp_path / "q.png"
    image.write_bytes(png(5))
    query = vitrieval.Embedder(tiny_onnx).embed_sources([image]).embeddings  # (1, d)
    for options, scoring in [
        (["--no-rescore"], {"rescore": False}),
        (["--oversample", "16"], {"oversample": 16}),
    ]:
        code, out, err = run(capsys, "search", compressed["index"], image, "--json", *options)
        assert code == 0, err
        (result,) = json.loads(out)
        got = [(h["key"], h["score"]) for h in result["hits"]]
        assert_same(got, keys_scores(store.search(query, K, **scoring)[0]))


@pytest.mark.parametrize(
    ("options", "says"),
    [
        (["--oversample", "0"], f"--oversample must be from 1 to {MAX_OVERSAMPLE}, got 0"),
        (["--oversample", str(MAX_OVERSAMPLE + 1)], "--oversample must be from 1 to"),
        (["--oversample", "8", "--no-rescore"], "drop --no-rescore"),
    ],
)
def test_bad_cli_settings_are_one_line_and_exit_2(capsys, options, says) -> None:
    # checked before the index is opened: it need not exist
    code, out, err = run(capsys, "search", "/nonexistent/index", "q.png", *options)
    assert (code, out) == (2, "") and err.count("\n") == 1 and says in err, err


def test_configure_saves_the_oversampling(capsys, compressed, tmp_path) -> None:
    index = Path(shutil.copytree(compressed["index"], tmp_path / "index"))
    code, out, err = run(capsys, "configure", index, "--oversample", "8")
    assert code == 0, err
    assert out == f"{index}: oversample 8 (each compressed segment re-scores 8 x k candidates)\n"
    with IndexStore.open(index) as store:
        assert store.search_params()["oversample"] == 8
        q = near(compressed["x"], [9])
        assert keys_scores(store.search(q, K)[0]) == keys_scores(
            store.search(q, K, oversample=8)[0]
        )
    manifest = json.loads((index / "manifest.json").read_text())
    assert manifest["search_params"]["oversample"] == 8
    code, out, err = run(capsys, "info", index, "--json")
    assert code == 0 and json.loads(out)["search_params"]["oversample"] == 8, err
    for bad in ("0", str(MAX_OVERSAMPLE + 1)):
        code, _, err = run(capsys, "configure", index, "--oversample", bad)
        assert code == 2 and err.count("\n") == 1 and "--oversample must be from 1" in err


def test_configure_refuses_oversampling_an_exact_index(capsys, tmp_path) -> None:
    x = unit_vectors(np.random.default_rng(2), 50, 8)
    with build(tmp_path / "flat", x) as store:
        store.save()
    code, out, err = run(capsys, "configure", tmp_path / "flat", "--oversample", "8")
    assert (code, out) == (2, "") and err.count("\n") == 1, err
    assert "oversample does not apply to a Flat index" in err
