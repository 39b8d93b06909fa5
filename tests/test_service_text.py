"""Text at the service's edge: lone surrogates, NUL and control characters are a 422
with the JSON error body in every place a string enters (JSON, multipart and
urlencoded bodies, path and query), never a 500; keys cannot shadow a sub-route."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from vitrieval.service.app import create_app
from vitrieval.service.settings import Settings
from vitrieval.service.text import checked_key, find_unencodable, text_problem

KEY = "test-write-key"
AUTH = {"X-API-Key": KEY}
DIM = 128
VECTOR = [1.0] + [0.0] * (DIM - 1)
VECTOR_JSON = json.dumps(VECTOR)


@pytest.fixture
def client(digits_gallery, served_index):
    settings = Settings(model=digits_gallery["model"], index=served_index, api_key=KEY)
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        yield c


def raw_json(client: TestClient, path: str, text: str, **kwargs):
    """POST a JSON body given as text, so escapes like \\ud800 reach the server as sent."""
    headers = {"content-type": "application/json", **kwargs.pop("headers", {})}
    return client.post(path, content=text.encode("ascii"), headers=headers, **kwargs)


def assert_422(response, code: str = "invalid_text") -> None:
    assert response.status_code == 422, response.text
    body = response.json()
    assert body["code"] == code, body
    assert body["detail"]


@pytest.mark.parametrize(
    "body",
    [
        '{"vector": ' + VECTOR_JSON + ', "label": "\\ud800"}',
        '{"key": "\\ud800", "k": 3}',
        '{"key": "a\\udfffb", "k": 3}',
        '{"key": "a\\u0000b", "k": 3}',
        '{"vector": ' + VECTOR_JSON + ', "label": "x\\u0000"}',
        '{"vector": ' + VECTOR_JSON + ', "\\ud800": 1}',  # a field name
    ],
    ids=["label-surrogate", "key-surrogate", "key-low-surrogate", "key-nul", "label-nul", "name"],
)
def test_search_json_with_unencodable_text_is_422(client, body) -> None:
    assert_422(raw_json(client, "/v1/search", body))


@pytest.mark.parametrize(
    "body",
    [
        '{"key": "k\\ud83d", "vector": %s}',
        '{"key": "ok", "label": "\\udc00", "vector": %s}',
        '{"key": "ok", "metadata": {"note": "\\ud800"}, "vector": %s}',
        '{"key": "ok", "metadata": {"\\ud800": 1}, "vector": %s}',
        '{"key": "ok", "metadata": {"deep": [{"x": "a\\u0000"}]}, "vector": %s}',
    ],
    ids=["key", "label", "metadata-value", "metadata-name", "metadata-nul"],
)
def test_item_json_with_unencodable_text_is_422(client, body) -> None:
    response = raw_json(client, "/v1/items", body % json.dumps(VECTOR), headers=AUTH)
    assert_422(response)
    assert client.get("/v1/items/ok").status_code == 404  # nothing was stored


def test_evaluate_labels_with_unencodable_text_are_422(client) -> None:
    body = '{"mode": "queries", "queries": [{"label": "\\ud800", "vector": %s}]}'
    assert_422(raw_json(client, "/v1/evaluate", body % json.dumps(VECTOR)))


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        ({"key": "a\x00b", "k": "3"}, "invalid_text"),
        ({"key": "tab\there", "k": "3"}, "invalid_request"),  # control character in a key
        ({"label": "\x85", "key": "1/digits_00001.png"}, "invalid_request"),  # C1 control
    ],
    ids=["nul", "tab-in-key", "c1-in-label"],
)
def test_multipart_text_fields_are_checked(client, fields, code) -> None:
    files = {"unused": (None, "")}  # forces multipart/form-data
    response = client.post("/v1/search", data=fields, files=files)
    assert response.status_code == 422 and response.json()["code"] in (code, "invalid_request")
    if code == "invalid_text":
        assert response.json()["code"] == code


@pytest.mark.parametrize(
    "body",
    [b"key=%ED%A0%80&k=3", b"key=%FF%FE&k=3", b"label=%C3&vector=1"],
    ids=["encoded-surrogate", "not-utf8", "truncated-utf8"],
)
def test_urlencoded_bodies_that_are_not_utf8_are_422(client, body) -> None:
    headers = {"content-type": "application/x-www-form-urlencoded"}
    assert_422(client.post("/v1/search", content=body, headers=headers))


def test_urlencoded_nul_is_422(client) -> None:
    headers = {"content-type": "application/x-www-form-urlencoded"}
    assert_422(client.post("/v1/search", content=b"key=a%00b&k=3", headers=headers))


@pytest.mark.parametrize(
    "path",
    ["/v1/items/%ED%A0%80", "/v1/items/a%FFb", "/v1/items/k?vector=%ED%A0%80"],
    ids=["path-surrogate", "path-not-utf8", "query-not-utf8"],
)
def test_paths_and_queries_that_are_not_utf8_are_422(client, path) -> None:
    assert_422(client.get(path))


def test_path_keys_with_nul_or_controls_are_422(client) -> None:
    for path in ("/v1/items/a%00b", "/v1/items/a%1Fb"):
        response = client.get(path)
        assert response.status_code == 422, (path, response.text)
        assert response.json()["code"] == "invalid_request"
        assert client.delete(path, headers=AUTH).status_code == 422


def test_keys_ending_in_a_sub_route_are_refused(client) -> None:
    response = client.post("/v1/items", json={"key": "x/thumbnail", "vector": VECTOR}, headers=AUTH)
    assert_422(response, "invalid_request")
    assert "/thumbnail" in response.json()["detail"]
    files = {"image": ("q.png", b"unused", "image/png")}
    form = client.post("/v1/items", data={"key": "a/b/thumbnail"}, files=files, headers=AUTH)
    assert_422(form, "invalid_request")
    # a key that merely contains the word is fine
    fine = client.post("/v1/items", json={"key": "thumbnails/1", "vector": VECTOR}, headers=AUTH)
    assert fine.status_code == 201, fine.text


def test_valid_unicode_keys_labels_and_metadata_round_trip(client) -> None:
    item = {
        "key": "café/😀/1",
        "label": "çà",
        "metadata": {"note": "line\nbreak\ttab", "emoji": "😀"},
        "vector": VECTOR,
    }
    assert client.post("/v1/items", json=item, headers=AUTH).status_code == 201
    got = client.get("/v1/items/café/😀/1").json()
    assert got["label"] == "çà" and got["metadata"] == item["metadata"]
    hits = client.post("/v1/search", json={"vector": VECTOR, "label": "çà"}).json()["hits"]
    assert [h["key"] for h in hits] == ["café/😀/1"]


def test_text_rules() -> None:
    assert text_problem("plain ✓ 😀") is None
    assert "surrogate (U+D800) at position 1" in text_problem("a\ud800")
    assert "NUL" in text_problem("a\x00")
    assert text_problem("a\tb") is None and "U+0009" in text_problem("a\tb", controls=True)
    assert "U+009F" in text_problem("\x9f", controls=True)
    with pytest.raises(ValueError, match="1 to 512"):
        checked_key("x" * 513)
    assert find_unencodable({"a": [1, {"b": "ok"}, {"c": ["\udc80"]}]}) == (
        "body.a[2].c[0]: contains a lone UTF-16 surrogate (U+DC80) at position 0: "
        "not valid Unicode text"
    )
    assert find_unencodable({"a": [{"b": "fine"}]}) is None
    nested: list = []
    for _ in range(100_000):  # deeper than the interpreter's stack: walked without recursion
        nested = [nested]
    assert find_unencodable(nested) is None
