"""Pages and score thresholds (`offset`, `score_threshold`, index/store/request.py): a
page is ranks offset + 1 to offset + k of the whole ranking, and a threshold leaves out
the hits below it; checked against brute force on a store with exact ties, through the
Python API (also with alpha-QE and max fusion), `POST /v1/search`, the client's body and
`vitrieval-index search`, and refused out of range (StoreError, 422, exit 2)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from fastapi.testclient import TestClient
from index_cli_helpers import run
from PIL import Image
from ray_cluster import NO_RAY, ray_missing
from store_helpers import as_pairs, brute_force, build, exact_vectors, with_duplicates

import vitrieval
from vitrieval.client import calls
from vitrieval.index.query import AQE, search
from vitrieval.index.store import StoreError
from vitrieval.index.store.request import MAX_DEPTH, Query
from vitrieval.service.app import create_app
from vitrieval.service.settings import Settings

K = 7
DIM = 128  # the tiny model's: the HTTP test serves the index with it


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(30)
    x = with_duplicates(exact_vectors(rng, 400, 32), copies=4, originals=15)  # exact ties
    q = np.concatenate([x[:3], exact_vectors(rng, 5, 32)])
    return x, q


@pytest.fixture(scope="module")
def store(data, tmp_path_factory):
    x, _ = data
    with build(tmp_path_factory.mktemp("paging") / "flat", x) as opened:
        opened.save()
        yield opened


def test_pages_laid_end_to_end_are_the_whole_ranking(store, data) -> None:
    x, q = data
    pages = [as_pairs(store.search(q, K, offset=offset)) for offset in range(0, 4 * K, K)]
    joined = [[pair for page in pages for pair in page[row]] for row in range(len(q))]
    assert [[i for i, _ in r] for r in joined] == [
        [i for i, _ in r] for r in brute_force(q, x, 4 * K)
    ]
    # an offset need not be a multiple of k
    assert as_pairs(store.search(q, K, offset=3)) == [r[3 : 3 + K] for r in joined]


def test_a_page_past_the_end_is_short_then_empty(store, data) -> None:
    x, q = data
    last = as_pairs(store.search(q[:1], K, offset=len(x) - 3))
    assert [i for i, _ in last[0]] == [i for i, _ in brute_force(q[:1], x, len(x))[0][-3:]]
    assert store.search(q[:1], K, offset=len(x)) == [[]]


def test_a_score_threshold_leaves_out_exactly_the_hits_below_it(store, data) -> None:
    x, q = data
    truth = brute_force(q, x, 3 * K)
    threshold = float(np.median([row[K][1] for row in truth]))  # cuts some pages short
    got = as_pairs(store.search(q, 2 * K, score_threshold=threshold))
    want = [[p for p in row[: 2 * K] if p[1] >= threshold - 1e-6] for row in truth]
    assert [[i for i, _ in r] for r in got] == [[i for i, _ in r] for r in want]
    assert all(s >= threshold for row in got for _, s in row)
    assert any(len(row) < 2 * K for row in got) and any(len(row) == 2 * K for row in got)
    # with a page: the threshold applies to the page's ranks
    paged = as_pairs(store.search(q, K, offset=K, score_threshold=threshold))
    assert paged == [[p for p in row[K:] if p[1] >= threshold] for row in got]


def test_the_python_api_pages_fused_and_expanded_queries_too(store, data) -> None:
    _, q = data
    for options in ({}, {"fusion": "max"}, {"fusion": "mean"}, {"rerank": AQE(3)}):
        whole = vitrieval.search(store, q[:3], 3 * K, **options)
        page = vitrieval.search(store, q[:3], K, offset=K, **options)
        assert [[h.key for h in row] for row in page] == [
            [h.key for h in row[K : 2 * K]] for row in whole
        ], options
        low = whole[0][K].score
        cut = vitrieval.search(store, q[:3], 3 * K, score_threshold=low, **options)
        assert [[h.key for h in row] for row in cut] == [
            [h.key for h in row if h.score >= low] for row in whole
        ], options


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"offset": -1}, "offset must be an integer >= 0"),
        ({"offset": 1.5}, "offset must be an integer >= 0"),
        ({"offset": True}, "offset must be an integer >= 0"),
        ({"offset": MAX_DEPTH}, f"k \\+ offset must be at most {MAX_DEPTH}"),
        ({"score_threshold": float("nan")}, "score_threshold must be a finite number"),
        ({"score_threshold": "0.5"}, "score_threshold must be a finite number"),
    ],
)
def test_out_of_range_values_are_refused(options, message) -> None:
    with pytest.raises(StoreError, match=message):
        Query(np.zeros((1, 4), np.float32), K, **options)


def test_the_client_sends_them_only_when_given() -> None:
    assert not {"offset", "score_threshold"} & set(calls.search(key="a").json)
    body = calls.search(key="a", offset=20, score_threshold=0.5).json
    assert (body["offset"], body["score_threshold"]) == (20, 0.5)


# -- HTTP and the command line, over an index of the tiny model ---------------------------


@pytest.fixture(scope="module")
def served(tiny_onnx, tmp_path_factory) -> dict:
    """A Flat index of 300 unit vectors (keys "0".."299") with the tiny model's copy."""
    rng = np.random.default_rng(31)
    x = exact_vectors(rng, 300, DIM)
    path = tmp_path_factory.mktemp("served") / "index"
    with build(path, x, model_path=tiny_onnx) as opened:
        opened.save()
    return {"index": path, "x": x, "model": tiny_onnx}


def test_the_http_search_pages_and_thresholds(served) -> None:
    x = served["x"]
    vector = x[5].tolist()
    truth = brute_force(x[5:6], x, 3 * K)[0]
    settings = Settings(model=served["model"], index=served["index"], read_only=True)
    with TestClient(create_app(settings)) as client:

        def keys(**body) -> list[str]:
            answer = client.post("/v1/search", json={"vector": vector, "k": K, **body})
            assert answer.status_code == 200, answer.text
            return [h["key"] for h in answer.json()["hits"]]

        assert keys(offset=K) == [str(i) for i, _ in truth[K : 2 * K]]
        threshold = truth[3][1] - 1e-6
        assert keys(score_threshold=threshold) == [str(i) for i, _ in truth[:4]]
        form = client.post("/v1/search", data={"key": "5", "k": str(K), "offset": "2"})
        assert form.status_code == 200, form.text
        want = [str(i) for i, _ in truth[1:] if i != 5][2 : 2 + K]  # the key left out
        assert [h["key"] for h in form.json()["hits"]] == want
        bad = [{"offset": -1}, {"offset": MAX_DEPTH}, {"offset": MAX_DEPTH - K + 1}]
        bad.append({"score_threshold": "high"})
        bodies = [json.dumps({"vector": vector, "k": K, **fields}) for fields in bad]
        bodies.append(json.dumps({"vector": vector, "score_threshold": 1}).replace("1}", "1e400}"))
        for body in bodies:  # the last: JSON's 1e400 is an infinite float
            answer = client.post(
                "/v1/search", content=body, headers={"Content-Type": "application/json"}
            )
            assert answer.status_code == 422, (body[-40:], answer.text)
            assert answer.json()["code"] == "invalid_request", answer.text
        schema = client.get("/openapi.json").json()["components"]["schemas"]["SearchRequest"]
        assert schema["properties"]["offset"]["maximum"] == MAX_DEPTH - 1


def test_the_command_line_prints_the_page_with_its_ranks(served, tmp_path, capsys) -> None:
    image = tmp_path / "query.png"
    Image.fromarray(np.full((40, 40, 3), 90, np.uint8)).save(image)
    code, whole, _ = run(capsys, "search", served["index"], image, "-k", 3 * K, "--json")
    assert code == 0
    hits = json.loads(whole)[0]["hits"]
    code, out, _ = run(capsys, "search", served["index"], image, "-k", K, "--offset", K)
    assert code == 0
    ranks = [line.split() for line in out.splitlines()[2:]]
    assert [int(r[0]) for r in ranks] == list(range(K + 1, 2 * K + 1))
    assert [r[-1] for r in ranks] == [h["key"] for h in hits[K : 2 * K]]
    low = hits[2]["score"]
    code, out, _ = run(capsys, "search", served["index"], image, "--score-threshold", low, "--json")
    assert code == 0 and [h["key"] for h in json.loads(out)[0]["hits"]] == [
        h["key"] for h in hits if h["score"] >= low
    ]
    code, _, err = run(capsys, "search", served["index"], image, "--offset", -2)
    assert code == 2 and err.count("\n") == 1 and "offset must be an integer >= 0" in err


class HalfShard:
    """A shard deployment's handle answering as `store` does for its half of the items
    (item ids of one parity), keeping the queries it is sent."""

    def __init__(self, store, parity: int) -> None:
        self.store, self.parity, self.queries = store, parity, []
        self.ranked_search = self

    def remote(self, query):
        self.queries.append(query)

        async def answer() -> list:
            ranked = self.store.ranked_search(query)
            return [[(i, h) for i, h in row if i % 2 == self.parity] for row in ranked]

        return answer()


@pytest.mark.skipif(ray_missing(), reason=NO_RAY)
def test_the_ray_ingress_asks_every_shard_for_the_depth_then_cuts_the_page(
    store, data, tmp_path
) -> None:
    from vitrieval.distributed.serve.ingress import RemoteIndex

    _, q = data
    shards = [HalfShard(store, 0), HalfShard(store, 1)]
    index = RemoteIndex(shards, tmp_path, q.shape[1])
    found = asyncio.run(search(index, q, K, offset=K, score_threshold=0.1))
    assert [[h.key for _, h in row] for row in found] == [
        [h.key for h in row] for row in store.search(q, K, offset=K, score_threshold=0.1)
    ]
    for shard in shards:
        assert [(s.k, s.offset, s.score_threshold) for s in shard.queries] == [(2 * K, 0, 0.1)]
