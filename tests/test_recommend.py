"""Recommendation (index/recommend.py): the strategies by hand, against brute force on a
Flat store (best_score also where the first reading is too shallow), only positives as
a fused search, pages and groups; `POST /v1/recommend`, the client's body and
`vitrieval-index recommend`; bad requests refused."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from fastapi.testclient import TestClient
from index_cli_helpers import run
from PIL import Image
from store_helpers import exact_vectors

from vitrieval.client import calls
from vitrieval.index.contract import LocalIndex, Where
from vitrieval.index.query import search_fused
from vitrieval.index.recommend import MAX_EXAMPLES, average_query, best_scores, recommend
from vitrieval.index.store import IndexStore, StoreError
from vitrieval.service.app import create_app
from vitrieval.service.settings import Settings

DIM = 128  # the tiny model's: the HTTP and command-line tests serve the index with it


def test_the_strategies_by_hand() -> None:
    p = np.array([[1.0, 0.0, 0.0]], np.float32)
    n = np.array([[0.0, 1.0, 0.0]], np.float32)
    # average_vector: 2 p - n = (2, -1, 0), normalised
    np.testing.assert_allclose(average_query(p, n), np.array([2, -1, 0]) / np.sqrt(5), rtol=1e-6)
    np.testing.assert_allclose(average_query(p, n[:0]), [1, 0, 0])
    two = np.array([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]], np.float32)
    np.testing.assert_allclose(average_query(two, n[:0]), np.array([1, 0, 1]) / np.sqrt(2))
    # best_score: a is as near p as b is, and nearer p than n: its positive score;
    # c is nearer n than p: minus the square of its negative score
    items = np.array([[0.8, 0.6, 0.0], [0.8, -0.6, 0.0], [0.3, 0.9, 0.3]], np.float32)
    np.testing.assert_allclose(best_scores(items, p, n), [0.8, 0.8, -0.81], rtol=1e-6)
    np.testing.assert_allclose(best_scores(items, p, n[:0]), [0.8, 0.8, 0.3], rtol=1e-6)


def store_of(path, x: np.ndarray, metadata=None, **create) -> IndexStore:
    store = IndexStore.create(path, dim=x.shape[1], factory="Flat", **create)
    store.add([str(i) for i in range(len(x))], x, metadata=metadata)
    store.save()
    return store


def test_negatives_move_the_answer_as_each_strategy_defines(tmp_path) -> None:
    x = np.array([[0.8, 0.6, 0.0], [0.8, -0.6, 0.0], [0.3, 0.9, 0.3], [0.0, 0.0, 1.0]], np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    store = store_of(tmp_path / "three", x)
    index = LocalIndex(store)
    p = np.array([[1.0, 0.0, 0.0]], np.float32)
    n = np.array([[0.0, 1.0, 0.0]], np.float32)

    def keys(negative, strategy):
        found = asyncio.run(recommend(index, p, negative, 4, strategy=strategy))
        return [(h.key, round(h.score, 4)) for _, h in found]

    # without negatives items 0 and 1 tie (0.8): by id
    assert keys(n[:0], "average_vector")[:2] == [("0", 0.8), ("1", 0.8)]
    # q = (2, -1, 0)/sqrt(5): item 1 (1.6 + 0.6) / sqrt(5) before item 0 (1.6 - 0.6) / sqrt(5)
    assert keys(n, "average_vector")[:2] == [("1", 0.9839), ("0", 0.4472)]
    # best_score: 0 and 1 keep 0.8, item 3 (0 to both) is 0, item 2 is -(0.9/|x2|)^2
    c = float(x[2, 1])
    assert keys(n, "best_score") == [("0", 0.8), ("1", 0.8), ("3", 0.0), ("2", round(-c * c, 4))]


def test_best_score_reads_on_while_any_positive_could_still_lift_an_unseen_item(tmp_path):
    # positive e0's neighbours a3, x; positive e1's b1, b2 (far below); a1 is the
    # negative and scores -a1^2 for items nearer it. Read 2 deep, e1's ranking ends
    # low (0.3) while e0's could still hold x (0.95): the bound is the highest of the
    # rankings' last scores, not the lowest
    e = np.eye(5, dtype=np.float32)

    def u(v):
        return (v / np.linalg.norm(v)).astype(np.float32)

    a1 = u(0.99 * e[0] + 0.14 * e[2])
    x = np.stack([a1, u(0.985 * e[0] + 0.17 * e[4]), u(0.95 * e[0] - 0.31 * e[2]),
                  u(0.3 * e[1] + 0.95 * e[3]), u(0.2 * e[1] + 0.98 * e[3])])  # fmt: skip
    index = LocalIndex(store_of(tmp_path / "five", x))
    positive, negative = e[:2], a1[None, :]
    got = asyncio.run(recommend(index, positive, negative, 2, strategy="best_score"))
    assert [h.key for _, h in got] == brute_force(x, positive, negative, 2) == ["1", "2"]


def test_examples_that_cancel_out_are_refused(tmp_path) -> None:
    x = np.eye(4, dtype=np.float32)
    index = LocalIndex(store_of(tmp_path / "four", x))
    with pytest.raises(StoreError, match="the examples cancel out"):
        asyncio.run(recommend(index, np.stack([x[0], -x[0]]), x[:0], 2))


@pytest.fixture(scope="module")
def catalogue(tmp_path_factory) -> dict:
    rng = np.random.default_rng(60)
    x = exact_vectors(rng, 500, DIM)
    metadata = [{"shop": f"s{i % 7}"} for i in range(500)]
    store = store_of(tmp_path_factory.mktemp("reco") / "flat", x, metadata)
    return {"x": x, "store": store, "metadata": metadata}


def brute_force(x, positive, negative, k, left_out=(), offset=0):
    """Every item's best_score in float64, ranked (score, then id), the page cut."""
    scores = best_scores(x.astype(np.float64), positive.astype(np.float64),
                         negative.astype(np.float64)).astype(np.float64)  # fmt: skip
    rows = [i for i in range(len(x)) if str(i) not in left_out]
    ranked = sorted(rows, key=lambda i: (-scores[i], i))
    return [str(i) for i in ranked[offset : offset + k]]


@pytest.mark.parametrize("negatives", [0, 1, 3, 12])
def test_best_score_equals_brute_force_on_flat(catalogue, negatives) -> None:
    x, index = catalogue["x"], LocalIndex(catalogue["store"])
    positive, negative = x[[3, 40, 41]], x[100 : 100 + negatives]
    left_out = [str(i) for i in (3, 40, 41, *range(100, 100 + negatives))]
    where = Where(exclude_keys=left_out)
    for k, offset in ((10, 0), (7, 5)):
        got = asyncio.run(
            recommend(
                index, positive, negative, k, strategy="best_score", where=where, offset=offset
            )
        )
        assert [h.key for _, h in got] == brute_force(x, positive, negative, k, left_out, offset)


def test_best_score_reads_deeper_when_negatives_claim_the_positives_neighbours(catalogue):
    x, index = catalogue["x"], LocalIndex(catalogue["store"])
    positive = x[[7]]
    near = np.argsort(-(x @ x[7]))[1:60]  # the positive's 59 nearest are all nearer a negative
    negative = x[near]
    got = asyncio.run(recommend(index, positive, negative, 5, strategy="best_score"))
    assert [h.key for _, h in got] == brute_force(x, positive, negative, 5)


def test_only_positives_is_a_fused_mean_search(catalogue) -> None:
    x, index = catalogue["x"], LocalIndex(catalogue["store"])
    positive = x[[5, 9, 77]]
    got = asyncio.run(recommend(index, positive, x[:0], 10))
    want = asyncio.run(search_fused(index, positive, 10, fusion="mean"))
    assert [(h.key, round(h.score, 5)) for _, h in got] == [
        (h.key, round(h.score, 5)) for _, h in want
    ]


@pytest.mark.parametrize(
    ("positive", "negative", "strategy", "message"),
    [
        (0, 1, "average_vector", "at least one positive"),
        (1, MAX_EXAMPLES, "best_score", f"at most {MAX_EXAMPLES} examples"),
        (1, 0, "sum_scores", "strategy must be one of"),
    ],
)
def test_bad_recommendations_are_refused(catalogue, positive, negative, strategy, message):
    x, index = catalogue["x"], LocalIndex(catalogue["store"])
    with pytest.raises(StoreError, match=message):
        asyncio.run(recommend(index, x[:positive], x[:negative], 5, strategy=strategy))


def test_the_client_body() -> None:
    body = calls.recommend(["a", [0.5, 0.5]], ["b"], strategy="best_score", k=3, offset=2).json
    assert body["positive"] == [{"key": "a"}, {"vector": [0.5, 0.5]}]
    assert body["negative"] == [{"key": "b"}]
    assert (body["strategy"], body["k"], body["offset"]) == ("best_score", 3, 2)
    assert "image_base64" in calls.recommend([Image.new("RGB", (4, 4))]).json["positive"][0]


@pytest.fixture(scope="module")
def served(catalogue, tiny_onnx, tmp_path_factory):
    path = tmp_path_factory.mktemp("served") / "index"
    store_of(path, catalogue["x"], catalogue["metadata"], model_path=tiny_onnx).close()
    return path


def test_the_http_recommendation(served, catalogue, tiny_onnx) -> None:
    x = catalogue["x"]
    settings = Settings(model=tiny_onnx, index=served, read_only=True)
    with TestClient(create_app(settings)) as client:

        def post(**body):
            return client.post("/v1/recommend", json=body)

        body = {"positive": [{"key": "3"}, {"vector": x[40].tolist()}],
                "negative": [{"key": "100"}], "strategy": "best_score", "k": 8}  # fmt: skip
        answer = post(**body)
        assert answer.status_code == 200, answer.text
        want = brute_force(x, x[[3, 40]], x[[100]], 8, left_out=("3", "100"))
        assert [h["key"] for h in answer.json()["hits"]] == want
        assert answer.json()["query"] == "recommend"
        grouped = post(**body, group_by="shop", group_size=2).json()
        assert grouped["hits"] == [] and len(grouped["groups"]) == 7
        image = post(positive=[{"image_base64": calls.image_base64(Image.new("RGB", (32, 32)))}])
        assert image.status_code == 200 and len(image.json()["hits"]) == 10, image.text
        form = client.post("/v1/recommend", data={"positive": '[{"key": "3"}]', "k": "4"})
        assert form.status_code == 200 and "3" not in [h["key"] for h in form.json()["hits"]]
        missing = post(positive=[{"key": "nope"}])
        assert missing.status_code == 404 and missing.json()["code"] == "unknown_key"
        bad_bodies = [
            {"positive": []},
            {"positive": [{"key": "1", "vector": [1.0]}]},
            {"positive": [{"key": "1"}], "strategy": "sum_scores"},
            {"positive": [{"key": "1"}] * 40, "negative": [{"key": "2"}] * 40},
        ]
        for bad in bad_bodies:
            answer = post(**bad)
            assert answer.status_code == 422, (bad, answer.text)
            assert answer.json()["code"] == "invalid_request"


def test_the_command_line_recommends(served, catalogue, tmp_path, capsys) -> None:
    x = catalogue["x"]
    argv = ["recommend", served, "--positive", "3", "40", "--negative", "100", "-k", 6]
    code, out, _ = run(capsys, *argv, "--strategy", "best_score", "--json")
    assert code == 0, out
    answer = json.loads(out)
    want = brute_force(x, x[[3, 40]], x[[100]], 6, left_out=("3", "40", "100"))
    assert [h["key"] for h in answer["hits"]] == want
    image = tmp_path / "like.png"
    Image.fromarray(np.full((32, 32, 3), 200, np.uint8)).save(image)
    code, out, _ = run(capsys, "recommend", served, "--positive", image, "3", "--group-by", "shop")
    assert code == 0 and "group 1: shop = " in out
    code, _, err = run(capsys, "recommend", served, "--positive", "no-such-key")
    assert code == 2 and err.count("\n") == 1 and "neither a key of the index" in err
