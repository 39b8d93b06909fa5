"""`scroll` (index/store/_scroll.py): every live item a filter allows, page by page in
ascending key order, each once; checked against a plain sorted list of the expected
keys on a store with sealed and growing segments, tombstones and replaced keys, the
shards' merge by hand, `POST /v1/scroll` and the client's body; limits refused."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from fastapi.testclient import TestClient
from ray_cluster import NO_RAY, ray_missing
from store_helpers import exact_vectors

from vitrieval.client import calls
from vitrieval.index.shards.routing import merge_scrolled
from vitrieval.index.store import IndexStore, ListedItem, ScrollPage, StoreError
from vitrieval.index.store.request import MAX_SCROLL_LIMIT
from vitrieval.service.app import create_app
from vitrieval.service.settings import Settings

DIM = 128  # the tiny model's: the HTTP test serves the index with it
# keys whose code-point order differs from a naive one: upper before lower case,
# "a/b" before "a0", accents after every ASCII letter
KEYS = [
    f"{prefix}{i:03d}" for prefix in ("item/", "Item-", "zz", "é", "a/b", "a0") for i in range(30)
]


def everything(store, limit: int, **selection) -> tuple[list[str], list[ScrollPage]]:
    """The keys of every page of a scroll, laid end to end, and the pages."""
    pages, after = [], None
    while True:
        page = store.scroll(limit=limit, after=after, **selection)
        pages.append(page)
        if page.next is None:
            break
        assert page.next == page.items[-1].key and len(page.items) == limit
        after = page.next
    return [item.key for page in pages for item in page.items], pages


@pytest.fixture
def store(tmp_path) -> IndexStore:
    """Three sealed segments and a growing one; some items removed, some replaced."""
    rng = np.random.default_rng(40)
    x = exact_vectors(rng, len(KEYS), DIM)
    store = IndexStore.create(tmp_path / "index", dim=DIM, factory="Flat")
    for part in range(3):
        rows = range(part, len(KEYS), 4)
        store.add(
            [KEYS[i] for i in rows],
            x[list(rows)],
            labels=[f"l{i % 3}" for i in rows],
            metadata=[{"n": i, "odd": bool(i % 2)} for i in rows],
        )
        store.save()
    rows = range(3, len(KEYS), 4)
    store.add([KEYS[i] for i in rows], x[list(rows)], labels=[f"l{i % 3}" for i in rows],
              metadata=[{"n": i, "odd": bool(i % 2)} for i in rows])  # fmt: skip
    store.remove(KEYS[::7])
    store.add(KEYS[1:40:5], x[1:40:5], replace=True, metadata=[{"n": -1}] * 8)  # moved
    return store


def live(store: IndexStore) -> dict[str, dict]:
    return {key: store.get(key).metadata for key in KEYS if key in store}


@pytest.mark.parametrize("limit", [1, 7, 100, MAX_SCROLL_LIMIT])
def test_pages_end_to_end_list_every_live_item_once_in_key_order(store, limit) -> None:
    keys, pages = everything(store, limit)
    assert keys == sorted(live(store))
    assert len(pages) == max(1, -(-len(keys) // limit))
    first = pages[0].items[0]
    record = store.get(first.key)
    assert (first.label, first.path, first.metadata) == (record.label, record.path, record.metadata)


def test_a_filter_and_a_label_narrow_the_selection(store) -> None:
    odd = {"must": [{"key": "odd", "match": True}]}
    keys, _ = everything(store, 9, filter=odd)
    assert keys == sorted(k for k, m in live(store).items() if m.get("odd") is True)
    odd_l1 = {"must": [{"key": "odd", "match": True}, {"key": "label", "match": "l1"}]}
    keys, _ = everything(store, 9, filter=odd_l1)
    assert keys == sorted(
        k for k, m in live(store).items() if m.get("odd") is True and store.get(k).label == "l1"
    )
    negated = {"must_not": [{"key": "odd", "match": True}]}
    keys, _ = everything(store, 11, filter=negated)
    assert keys == sorted(k for k, m in live(store).items() if m.get("odd") is not True)


def test_after_starts_past_any_key_and_saved_or_not_the_answer_is_the_same(store) -> None:
    expected = sorted(live(store))
    assert [i.key for i in store.scroll(limit=5, after="b").items] == [
        k for k in expected if k > "b"
    ][:5]
    assert store.scroll(after="\U0010ffff") == ScrollPage([], None)
    before = everything(store, 13)[0]
    store.save()
    assert everything(store, 13)[0] == before


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"limit": 0}, "limit must be an integer from 1"),
        ({"limit": MAX_SCROLL_LIMIT + 1}, "limit must be an integer from 1"),
        ({"limit": True}, "limit must be an integer from 1"),
        ({"after": 3}, "after must be a key"),
    ],
)
def test_bad_arguments_are_refused(store, options, message) -> None:
    with pytest.raises(StoreError, match=message):
        store.scroll(**options)


def item(key: str) -> ListedItem:
    return ListedItem(key, None, None, {})


def test_the_shards_pages_merge_by_key() -> None:
    a = ScrollPage([item("a"), item("c"), item("e")], "e")  # had more
    b = ScrollPage([item("b"), item("d")], None)
    merged = merge_scrolled([a, b], 3)
    assert ([i.key for i in merged.items], merged.next) == (["a", "b", "c"], "c")
    merged = merge_scrolled([ScrollPage([item("a")], None), b], 3)
    assert ([i.key for i in merged.items], merged.next) == (["a", "b", "d"], None)
    merged = merge_scrolled([a, ScrollPage([], None)], 3)
    assert ([i.key for i in merged.items], merged.next) == (["a", "c", "e"], "e")
    assert merge_scrolled([ScrollPage([], None)] * 2, 3) == ScrollPage([], None)


class ShardOf:
    """A shard deployment's handle answering `scroll` as `store` does for its keys of
    one parity of length."""

    def __init__(self, store: IndexStore, parity: int) -> None:
        self.store, self.parity = store, parity
        self.scroll = self

    def remote(self, flt, limit, after):
        async def answer() -> ScrollPage:
            page = self.store.scroll(flt, limit=10**4, after=after)
            items = [i for i in page.items if len(i.key) % 2 == self.parity][:limit]
            rest = [i for i in page.items if len(i.key) % 2 == self.parity][limit:]
            return ScrollPage(items, items[-1].key if rest else None)

        return answer()


@pytest.mark.skipif(ray_missing(), reason=NO_RAY)
def test_the_ray_ingress_scrolls_as_one_store(store, tmp_path) -> None:
    from vitrieval.distributed.serve.ingress import RemoteIndex

    index = RemoteIndex([ShardOf(store, 0), ShardOf(store, 1)], tmp_path, DIM)
    keys, after = [], None
    while True:
        page = asyncio.run(index.scroll(None, 6, after))
        keys += [i.key for i in page.items]
        if page.next is None:
            break
        after = page.next
    assert keys == sorted(live(store))


def test_the_http_scroll_pages_through_a_filtered_selection(store, tiny_onnx, tmp_path) -> None:
    store.save()
    store.close()
    # the index needs its model beside it to be served: build one that has it
    served = IndexStore.create(tmp_path / "served", dim=DIM, model_path=tiny_onnx)
    x = exact_vectors(np.random.default_rng(41), 60, DIM)
    served.add([f"k{i:02d}" for i in range(60)], x, metadata=[{"n": i} for i in range(60)])
    served.save()
    served.close()
    settings = Settings(model=tiny_onnx, index=tmp_path / "served", read_only=True)
    small = {"must": [{"key": "n", "range": {"lt": 25}}]}
    with TestClient(create_app(settings)) as client:
        keys, after = [], None
        while True:
            body = {"filter": small, "limit": 10, **({"after": after} if after else {})}
            answer = client.post("/v1/scroll", json=body)
            assert answer.status_code == 200, answer.text
            keys += [i["key"] for i in answer.json()["items"]]
            after = answer.json()["next"]
            if after is None:
                break
        assert keys == [f"k{i:02d}" for i in range(25)]
        form = client.post("/v1/scroll", data={"limit": "3", "after": "k10"})
        assert [i["key"] for i in form.json()["items"]] == ["k11", "k12", "k13"]
        assert form.json()["items"][0]["metadata"] == {"n": 11}
        for bad in ({"limit": 0}, {"limit": MAX_SCROLL_LIMIT + 1}, {"filter": {"must": 3}}):
            answer = client.post("/v1/scroll", json=bad)
            assert answer.status_code == 422, (bad, answer.text)
            assert answer.json()["code"] == "invalid_request"


def test_the_client_sends_only_what_is_given() -> None:
    assert calls.scroll().json == {}
    body = calls.scroll(filter={"must": []}, label="a", limit=5, after="k").json
    assert body == {"filter": {"must": []}, "label": "a", "limit": 5, "after": "k"}
