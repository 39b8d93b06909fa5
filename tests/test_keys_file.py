"""The keys file of a collections server (service/keys.py): each key's collections and
write right, checked in full; a key reaches only what it is given."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vitrieval.service.keys import KeyRing, KeysFileError, Rights

SHOP = "shop-key-0123456789"
ALL = "all-reader-key-0123"


def test_rights_follow_the_file(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({
        SHOP: {"collections": ["shop", "staging"], "write": True},
        ALL: {"collections": "*"},
    }))  # fmt: skip
    ring = KeyRing.read(path)
    assert len(ring) == 2
    shop, reader = ring.rights(SHOP), ring.rights(ALL)
    assert shop == Rights(frozenset({"shop", "staging"}), True)
    assert shop.allows("shop", write=True) and not shop.allows("other")
    assert reader.allows("anything") and not reader.allows("anything", write=True)
    assert ring.rights("shop-key-012345678") is None and ring.rights(None) is None
    assert ring.rights(SHOP + "x") is None


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ([], "JSON object"),
        ({"short": {"collections": "*"}}, "key number 1 must be at least"),
        ({SHOP: {"collections": []}}, "non-empty list"),
        ({SHOP: {"collections": ["Shop"]}}, "not valid"),
        ({SHOP: {"collections": "*", "write": "yes"}}, "true or false"),
        ({SHOP: {"collections": "*", "admin": True}}, "must map to"),
    ],
)
def test_a_bad_file_is_one_clear_error(raw, message) -> None:
    with pytest.raises(KeysFileError, match=message) as caught:
        KeyRing.from_json(raw)
    assert SHOP not in str(caught.value)  # never quoted


def test_a_missing_or_broken_file(tmp_path: Path) -> None:
    with pytest.raises(KeysFileError, match="not found"):
        KeyRing.read(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(KeysFileError, match="cannot read"):
        KeyRing.read(tmp_path / "bad.json")
