"""The OpenAPI document states the limits the service enforces, from the constants.

Every request body is documented for each content type its route reads (JSON, a
multipart form, a urlencoded form), generated from the request models. Here the
generated document is walked and every numeric limit and pattern it states, in every
content type, is compared with the constant the validation uses: none may be missing,
differ, or appear without a constant behind it.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from vitrieval.index.query import MAX_AQE_ALPHA, MAX_AQE_NEIGHBOURS
from vitrieval.service.app import create_app
from vitrieval.service.inputs import JSON, MULTIPART, URLENCODED, RequestBody, openapi_body
from vitrieval.service.routers.items import MAX_THUMBNAIL_SIZE, MIN_THUMBNAIL_SIZE
from vitrieval.service.schemas import (
    KEY_PATTERN,
    MAX_EVALUATE_KS,
    MAX_EVALUATE_QUERIES,
    MAX_K,
    MAX_METADATA_BYTES,
    MAX_METADATA_DEPTH,
    MAX_QUERY_IMAGES,
    MAX_VECTOR_LENGTH,
)
from vitrieval.service.settings import Settings
from vitrieval.service.text import MAX_LABEL_LENGTH

LIMIT_KEYWORDS = (
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
)

K = {"minimum": 1, "maximum": MAX_K}
LABEL = {"maxLength": MAX_LABEL_LENGTH}
VECTOR = {"maxItems": MAX_VECTOR_LENGTH}
RERANK_N = {"minimum": 1, "maximum": MAX_AQE_NEIGHBOURS}
RERANK_ALPHA = {"minimum": 0, "maximum": MAX_AQE_ALPHA}
IMAGES = {"minItems": 1, "maxItems": MAX_QUERY_IMAGES}

EXPECTED: dict[str, dict[str, dict[str, dict[str, Any]]]] = {
    "/v1/search": {
        JSON: {
            "k": K,
            "label": LABEL,
            "images_base64": IMAGES,
            "rerank.n": RERANK_N,
            "rerank.alpha": RERANK_ALPHA,
            "vector": VECTOR,
        },
        MULTIPART: {
            "image": IMAGES,
            "k": K,
            "label": LABEL,
            "rerank.n": RERANK_N,
            "rerank.alpha": RERANK_ALPHA,
        },
        URLENCODED: {"k": K, "label": LABEL, "rerank.n": RERANK_N, "rerank.alpha": RERANK_ALPHA},
    },
    "/v1/items": {
        JSON: {"key": {"pattern": KEY_PATTERN}, "label": LABEL, "vector": VECTOR},
        MULTIPART: {"key": {"pattern": KEY_PATTERN}, "label": LABEL},
    },
    "/v1/embed": {JSON: {}, MULTIPART: {}},
    "/v1/evaluate": {
        JSON: {
            "ks": {"minItems": 1, "maxItems": MAX_EVALUATE_KS},
            "ks[]": K,
            "queries": {"maxItems": MAX_EVALUATE_QUERIES},
            "queries[].label": LABEL,
            "queries[].vector": VECTOR,
        },
        MULTIPART: {},
        URLENCODED: {},
    },
}
"""route -> content type -> field (dotted; `[]` an array's items) -> keyword -> value"""


@pytest.fixture(scope="module")
def openapi() -> dict[str, Any]:
    return create_app(Settings(read_only=True)).openapi()


def documented_limits(schema: Any, path: str = "") -> dict[str, dict[str, Any]]:
    """Every limit keyword in `schema`, by the field it constrains: object properties
    extend the path, array items add `[]`; anyOf branches and a JSON-text form field's
    decoded value (contentSchema) constrain the same field."""
    found: dict[str, dict[str, Any]] = {}

    def walk(node: Any, where: str) -> None:
        if isinstance(node, list):
            for child in node:
                walk(child, where)
            return
        if not isinstance(node, dict):
            return
        for keyword in LIMIT_KEYWORDS:
            if keyword in node:
                limits = found.setdefault(where, {})
                assert keyword not in limits, f"{where}: {keyword} stated twice"
                limits[keyword] = node[keyword]
        for name, child in node.get("properties", {}).items():
            walk(child, f"{where}.{name}" if where else name)
        if "items" in node:
            walk(node["items"], f"{where}[]")
        for keyword in ("anyOf", "oneOf", "allOf", "contentSchema"):
            walk(node.get(keyword), where)

    walk(schema, path)
    return found


def request_bodies(openapi: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        path: operation["requestBody"]["content"]
        for path, operations in openapi["paths"].items()
        for operation in operations.values()
        if "requestBody" in operation
    }


def test_every_request_body_and_content_type_is_covered(openapi) -> None:
    bodies = request_bodies(openapi)
    assert set(bodies) == set(EXPECTED)
    for path, content in bodies.items():
        assert set(content) == set(EXPECTED[path]), path


@pytest.mark.parametrize(
    ("path", "content_type"),
    [(path, content_type) for path, types in EXPECTED.items() for content_type in types],
)
def test_the_documented_limits_are_the_constants(openapi, path, content_type) -> None:
    schema = request_bodies(openapi)[path][content_type]["schema"]
    assert documented_limits(schema) == EXPECTED[path][content_type]


def test_forms_document_their_fields_as_the_models_do(openapi) -> None:
    bodies = request_bodies(openapi)
    search = bodies["/v1/search"]
    for content_type in (MULTIPART, URLENCODED):
        fields = search[content_type]["schema"]["properties"]
        assert {"image_base64", "images_base64", "vector"}.isdisjoint(fields)
        assert fields["k"] == search[JSON]["schema"]["properties"]["k"]
        assert fields["rerank"]["type"] == "string"
        assert fields["rerank"]["contentMediaType"] == "application/json"
    image = search[MULTIPART]["schema"]["properties"]["image"]
    assert image["items"]["format"] == "binary"
    items = bodies["/v1/items"][MULTIPART]["schema"]
    assert items["required"] == ["image", "key"]
    assert items["properties"]["image"]["format"] == "binary"
    assert bodies["/v1/embed"][MULTIPART]["schema"]["required"] == ["image"]


def test_metadata_size_and_depth_are_the_constants(openapi) -> None:
    items = request_bodies(openapi)["/v1/items"]
    for content_type, content in items.items():
        description = content["schema"]["properties"]["metadata"]["description"]
        assert f"at most {MAX_METADATA_BYTES // 1024} KiB" in description, content_type
        assert f"{MAX_METADATA_DEPTH} levels deep" in description, content_type


def test_the_thumbnail_size_and_max_k_setting_are_the_constants(openapi) -> None:
    (size,) = [
        parameter
        for parameter in openapi["paths"]["/v1/items/{key}/thumbnail"]["get"]["parameters"]
        if parameter["name"] == "size"
    ]
    assert documented_limits(size["schema"]) == {
        "": {"minimum": MIN_THUMBNAIL_SIZE, "maximum": MAX_THUMBNAIL_SIZE}
    }
    max_k = Settings.model_json_schema()["properties"]["max_k"]
    assert max_k["default"] == MAX_K and max_k["maximum"] == MAX_K


def test_a_field_a_form_cannot_carry_must_be_marked() -> None:
    class Unmarked(BaseModel):
        values: list[int] = []

    with pytest.raises(TypeError, match=r"Unmarked\.values"):
        openapi_body(RequestBody(Unmarked))
