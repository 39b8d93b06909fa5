"""Grouped search (index/grouping.py): the k best groups of a field, each with its best
hits, checked by hand on a small ranking and against brute force (the full exact
ranking grouped by first appearance) on a store, also when the first reading is too
shallow; `offset` counts groups, `score_threshold` drops hits; over HTTP, the client's
body and `vitrieval-index search --group-by`; bad values refused."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from fastapi.testclient import TestClient
from index_cli_helpers import run
from PIL import Image
from store_helpers import brute_force, exact_vectors

from vitrieval.client import calls
from vitrieval.index import grouping
from vitrieval.index.contract import LocalIndex
from vitrieval.index.grouping import MAX_GROUP_SIZE, Grouping, describe_grouping, group
from vitrieval.index.query import search_fused, search_groups
from vitrieval.index.store import Hit, IndexStore, StoreError
from vitrieval.service.app import create_app
from vitrieval.service.settings import Settings

DIM = 128  # the tiny model's: the HTTP and command-line tests serve the index with it


def hit(key: str, score: float, **metadata) -> tuple[int, Hit]:
    return int(key), Hit(key, score, metadata.pop("label", None), None, metadata)


def test_groups_by_hand() -> None:
    ranking = [
        hit("1", 0.9, shop="a"),
        hit("2", 0.8, shop="b"),
        hit("3", 0.7),  # no shop: in no group
        hit("4", 0.6, shop="a"),
        hit("5", 0.5, shop=["c", "b"]),  # in both c and b
        hit("6", 0.4, shop="a"),
        hit("7", 0.3, shop=1),
        hit("8", 0.2, shop=True),  # True and 1 are two groups
    ]
    groups, full = group(ranking, Grouping("shop", 2), 3)
    assert [(g.value, [i for i, _ in g.hits]) for g in groups] == [
        ("a", [1, 4]),
        ("b", [2, 5]),
        ("c", [5]),
    ]
    assert not full  # c has one hit of two
    groups, full = group(ranking, Grouping("shop", 1), 5)
    assert [(g.value, [i for i, _ in g.hits]) for g in groups] == [
        ("a", [1]), ("b", [2]), ("c", [5]), (1, [7]), (True, [8])
    ]  # fmt: skip
    assert [type(g.value) for g in groups][-2:] == [int, bool] and full
    by_label, _ = group([hit("1", 0.9, label="x"), hit("2", 0.8)], Grouping("label", 3), 2)
    assert [(g.value, len(g.hits)) for g in by_label] == [("x", 1)]


@pytest.fixture(scope="module")
def catalogue(tmp_path_factory) -> dict:
    """400 items in 40 shops; shop "big" holds the 150 items nearest the first query,
    so a grouped search must read far past its first depth to fill the other groups."""
    rng = np.random.default_rng(50)
    x = exact_vectors(rng, 400, DIM)
    q = exact_vectors(rng, 4, DIM)
    near = np.argsort(-(x @ q[0]))[:150]
    shops = [f"s{i % 40}" for i in range(400)]
    for i in near:
        shops[i] = "big"
    # every ninth item has no shop
    metadata = [
        {"shop": shop, "colour": ["red", "blue"][i % 2]} if i % 9 else {}
        for i, shop in enumerate(shops)
    ]
    return {"x": x, "q": q, "metadata": metadata}


def reference(q, x, metadata, k, size, offset=0, low=None) -> list[list[tuple[str, list[int]]]]:
    """Brute force: every item ranked exactly, grouped by first appearance."""
    answers = []
    for ranking in brute_force(q, x, len(x)):
        groups: dict[str, list[int]] = {}
        for row, score in ranking:
            shop = metadata[row].get("shop")
            if shop is None or (low is not None and score < low):
                continue
            if shop not in groups and len(groups) == k + offset:
                continue
            members = groups.setdefault(shop, [])
            if len(members) < size:
                members.append(row)
        answers.append(list(groups.items())[offset:])
    return answers


def grouped(store, q, k, size, **shaping) -> list[list[tuple[str, list[int]]]]:
    index = LocalIndex(store)
    return [
        [(g.value, [int(h.key) for _, h in g.hits]) for g in found]
        for found in (
            asyncio.run(search_groups(index, row[None], k, Grouping("shop", size), **shaping))
            for row in q
        )
    ]


def with_metadata(path, catalogue: dict, **create) -> IndexStore:
    """A saved Flat store of the catalogue (keys str(row)) with its metadata."""
    x = catalogue["x"]
    store = IndexStore.create(path, dim=DIM, factory="Flat", **create)
    store.add([str(i) for i in range(len(x))], x, metadata=catalogue["metadata"])
    store.save()
    return store


@pytest.fixture(scope="module")
def store(catalogue, tmp_path_factory):
    with with_metadata(tmp_path_factory.mktemp("grouped") / "flat", catalogue) as opened:
        yield opened


@pytest.mark.parametrize(("k", "size"), [(3, 2), (5, 4), (12, 1)])
def test_grouped_search_equals_brute_force(store, catalogue, k, size) -> None:
    x, q, metadata = catalogue["x"], catalogue["q"], catalogue["metadata"]
    got = grouped(store, q, k, size)
    assert got == reference(q, x, metadata, k, size)
    assert got[0][0][0] == "big" and all(len(g) == k for g in got)  # deepened past "big"


def test_offset_counts_groups_and_a_threshold_drops_hits(store, catalogue) -> None:
    x, q, metadata = catalogue["x"], catalogue["q"], catalogue["metadata"]
    assert grouped(store, q, 4, 3, offset=4) == reference(q, x, metadata, 4, 3, offset=4)
    low = float(np.median(x @ q[1]))
    got = grouped(store, q, 6, 3, score_threshold=low)
    assert got == reference(q, x, metadata, 6, 3, low=low)


@pytest.mark.parametrize(
    ("by", "size", "message"),
    [
        ("", 3, "group_by must be a non-empty string"),
        ("a..b", 3, "not a dot path"),
        ("shop", 0, "group_size must be an integer from 1"),
        ("shop", MAX_GROUP_SIZE + 1, "group_size must be an integer from 1"),
    ],
)
def test_bad_groupings_are_refused(by, size, message) -> None:
    with pytest.raises(StoreError, match=message):
        Grouping(by, size)


def test_a_grouped_page_checks_its_offset(store, catalogue) -> None:
    index, q = LocalIndex(store), catalogue["q"][:1]
    for offset, message in ((-1, "offset must be an integer >= 0"), (9_999, "k \\+ offset")):
        with pytest.raises(StoreError, match=message):
            rank = lambda d: search_fused(index, q, d)  # noqa: E731
            asyncio.run(grouping.grouped(rank, 2, Grouping("shop"), offset))
    with pytest.raises(StoreError, match="group_size needs group_by"):
        describe_grouping(None, 3)


def test_the_client_sends_them_only_when_given() -> None:
    assert not {"group_by", "group_size"} & set(calls.search(key="a").json)
    body = calls.search(key="a", group_by="shop", group_size=2).json
    assert (body["group_by"], body["group_size"]) == ("shop", 2)


@pytest.fixture(scope="module")
def served(catalogue, tiny_onnx, tmp_path_factory):
    path = tmp_path_factory.mktemp("served") / "index"
    with_metadata(path, catalogue, model_path=tiny_onnx).close()
    return path


def test_the_http_search_answers_groups(served, catalogue, tiny_onnx) -> None:
    x, q, metadata = catalogue["x"], catalogue["q"], catalogue["metadata"]
    settings = Settings(model=tiny_onnx, index=served, read_only=True)
    with TestClient(create_app(settings)) as client:
        body = {"vector": q[0].tolist(), "k": 3, "group_by": "shop", "group_size": 2}
        answer = client.post("/v1/search", json=body)
        assert answer.status_code == 200, answer.text
        groups = answer.json()["groups"]
        assert answer.json()["hits"] == []
        want = reference(q[:1], x, metadata, 3, 2)[0]
        assert [(g["value"], [int(h["key"]) for h in g["hits"]]) for g in groups] == want
        form = client.post("/v1/search", data={"key": "7", "group_by": "shop", "offset": "1"})
        assert form.status_code == 200 and len(form.json()["groups"]) == 10, form.text
        for bad in ({"group_by": "a..b"}, {"group_by": "shop", "group_size": 0},
                    {"group_size": 2}, {"group_by": "shop", "k": 10, "offset": 9_995}):  # fmt: skip
            answer = client.post("/v1/search", json={"vector": q[0].tolist(), **bad})
            assert answer.status_code == 422, answer.text
            assert answer.json()["code"] == "invalid_request"


def test_the_command_line_prints_groups(served, tmp_path, capsys) -> None:
    image = tmp_path / "query.png"
    Image.fromarray(np.full((40, 40, 3), 120, np.uint8)).save(image)
    code, out, _ = run(
        capsys, "search", served, image, "-k", 4, "--group-by", "shop", "--group-size", 2, "--json"
    )
    assert code == 0
    (answer,) = json.loads(out)
    assert len(answer["groups"]) == 4 and all(len(g["hits"]) == 2 for g in answer["groups"])
    assert len({g["value"] for g in answer["groups"]}) == 4
    code, out, _ = run(capsys, "search", served, image, "-k", 2, "--group-by", "colour")
    assert code == 0 and "group 1: colour = " in out and "group 2: colour = " in out
    code, _, err = run(capsys, "search", served, image, "--group-size", 2)
    assert code == 2 and err.count("\n") == 1 and "--group-size needs --group-by" in err
    code, _, err = run(capsys, "search", served, image, "--group-by", "shop", "--group-size", 0)
    assert code == 2 and err.count("\n") == 1 and "group_size must be an integer" in err


def test_a_sharded_index_groups_as_one_store(catalogue, tmp_path) -> None:
    """By label, over 3 shards: the same groups as one store of the same items."""
    from test_shards import in_process, write_folder

    from vitrieval.index.shards import open_index
    from vitrieval.index.shards.build import build_sharded

    x, q = catalogue["x"], catalogue["q"]
    keys = [str(i) for i in range(len(x))]
    labels = [m.get("shop", "none") for m in catalogue["metadata"]]
    one = IndexStore.create(tmp_path / "one", dim=DIM)
    one.add(keys, x, labels=labels)
    emb = write_folder(tmp_path / "emb", x, keys, labels)
    build_sharded(emb, tmp_path / "sharded", "", "Flat", 3, 500, in_process)

    def by_label(store) -> list:
        index = LocalIndex(store)
        return [
            [(g.value, [h.key for _, h in g.hits]) for g in asyncio.run(
                search_groups(index, row[None], 5, Grouping("label", 3), offset=1)
            )]
            for row in q
        ]  # fmt: skip

    with open_index(tmp_path / "sharded") as sharded:
        assert by_label(sharded) == by_label(one)
    assert by_label(one)[0][0][0] != "big"  # offset 1: "big" was the first group
