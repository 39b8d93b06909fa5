"""The OpenAPI document states the limits the service enforces, from the constants.

Every request body is in the document as JSON, a named component generated from the
request model; the forms a route also reads (multipart, urlencoded) are generated from
the same model by `inputs.form_schemas` and listed in the operation's description.
Here every numeric limit and pattern stated, in the JSON components and in every form,
is compared with the constant the validation uses: none may be missing, differ, or
appear without a constant behind it.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from vitrieval.index.collections import NAME_REGEX
from vitrieval.index.grouping import MAX_GROUP_SIZE
from vitrieval.index.query import MAX_AQE_ALPHA, MAX_AQE_NEIGHBOURS
from vitrieval.index.recommend import MAX_EXAMPLES
from vitrieval.index.store.filters import MAX_KEY_LENGTH as MAX_FILTER_KEY_LENGTH
from vitrieval.index.store.request import MAX_DEPTH, MAX_OVERSAMPLE, MAX_SCROLL_LIMIT
from vitrieval.service.app import create_app
from vitrieval.service.inputs import JSON, MULTIPART, URLENCODED, RequestBody, form_schemas
from vitrieval.service.routers.aliases import ALIAS_BODY, PROMOTE_BODY
from vitrieval.service.routers.collections import CREATE_BODY
from vitrieval.service.routers.duplicates import DUPLICATES_BODY
from vitrieval.service.routers.evaluate import EVALUATE_BODY
from vitrieval.service.routers.items import ITEM_BODY, MAX_THUMBNAIL_SIZE, MIN_THUMBNAIL_SIZE
from vitrieval.service.routers.recommend import RECOMMEND_BODY
from vitrieval.service.routers.reembed import REEMBED_BODY
from vitrieval.service.routers.scroll import SCROLL_BODY
from vitrieval.service.routers.search import EMBED_BODY, SEARCH_BODY
from vitrieval.service.schemas import (
    KEY_PATTERN,
    MAX_EVALUATE_KS,
    MAX_EVALUATE_QUERIES,
    MAX_FACTORY_LENGTH,
    MAX_FILE_NAME,
    MAX_FILTER_FIELDS,
    MAX_K,
    MAX_METADATA_BYTES,
    MAX_METADATA_DEPTH,
    MAX_METRIC_NAME,
    MAX_QUERY_IMAGES,
    MAX_URL_LENGTH,
    MAX_VECTOR_LENGTH,
    SNAPSHOT_SOURCE,
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
OVERSAMPLE = {"minimum": 1, "maximum": MAX_OVERSAMPLE}
OFFSET = {"minimum": 0, "maximum": MAX_DEPTH - 1}
SCORE = {"minimum": -1, "maximum": 1}  # a cosine
GROUP_BY = {"maxLength": MAX_FILTER_KEY_LENGTH}
GROUP_SIZE = {"minimum": 1, "maximum": MAX_GROUP_SIZE}

EXPECTED: dict[str, dict[str, dict[str, dict[str, Any]]]] = {
    "/v1/search": {
        JSON: {
            "k": K,
            "label": LABEL,
            "images_base64": IMAGES,
            "rerank.n": RERANK_N,
            "rerank.alpha": RERANK_ALPHA,
            "vector": VECTOR,
            "oversample": OVERSAMPLE,
            "offset": OFFSET,
            "group_by": GROUP_BY,
            "group_size": GROUP_SIZE,
        },
        MULTIPART: {
            "image": IMAGES,
            "k": K,
            "label": LABEL,
            "rerank.n": RERANK_N,
            "rerank.alpha": RERANK_ALPHA,
            "oversample": OVERSAMPLE,
            "offset": OFFSET,
            "group_by": GROUP_BY,
            "group_size": GROUP_SIZE,
        },
        URLENCODED: {
            "k": K,
            "label": LABEL,
            "rerank.n": RERANK_N,
            "rerank.alpha": RERANK_ALPHA,
            "oversample": OVERSAMPLE,
            "offset": OFFSET,
            "group_by": GROUP_BY,
            "group_size": GROUP_SIZE,
        },
    },
    "/v1/items": {
        JSON: {
            "key": {"pattern": KEY_PATTERN},
            "label": LABEL,
            "vector": VECTOR,
            "duplicate_threshold": SCORE,
        },
        MULTIPART: {"key": {"pattern": KEY_PATTERN}, "label": LABEL, "duplicate_threshold": SCORE},
    },
    "/v1/embed": {JSON: {}, MULTIPART: {}},
    "/v1/evaluate": {
        content_type: {
            "ks": {"minItems": 1, "maxItems": MAX_EVALUATE_KS},
            "ks[]": K,
            "queries": {"maxItems": MAX_EVALUATE_QUERIES},
            "queries[].label": LABEL,
            "queries[].vector": VECTOR,
        }
        for content_type in (JSON, MULTIPART, URLENCODED)
    },
}
EXPECTED["/v1/recommend"] = {
    content_type: {
        "k": K,
        "label": LABEL,
        "oversample": OVERSAMPLE,
        "offset": OFFSET,
        "group_by": GROUP_BY,
        "group_size": GROUP_SIZE,
        "positive": {"minItems": 1, "maxItems": MAX_EXAMPLES},
        "positive[].vector": VECTOR,
        "negative": {"maxItems": MAX_EXAMPLES},
        "negative[].vector": VECTOR,
    }
    for content_type in (JSON, MULTIPART, URLENCODED)
}
EXPECTED["/v1/scroll"] = {
    content_type: {
        "label": LABEL,
        "limit": {"minimum": 1, "maximum": MAX_SCROLL_LIMIT},
    }
    for content_type in (JSON, MULTIPART, URLENCODED)
}
EXPECTED["/v1/duplicates"] = {
    content_type: {
        "threshold": SCORE,
        "precision": {"exclusiveMinimum": 0, "exclusiveMaximum": 1},
        "label": LABEL,
    }
    for content_type in (JSON, MULTIPART, URLENCODED)
}
NAME = {"pattern": NAME_REGEX}
EXPECTED["/v1/collections/{collection}"] = {
    content_type: {
        "model": {"maxLength": MAX_FILE_NAME},
        "snapshot": {"pattern": SNAPSHOT_SOURCE, "maxLength": MAX_URL_LENGTH},
        "factory": {"maxLength": MAX_FACTORY_LENGTH},
        "filter_fields": {"maxItems": MAX_FILTER_FIELDS},
        "filter_fields[]": {"maxLength": MAX_FILTER_KEY_LENGTH},
    }
    for content_type in (JSON, MULTIPART, URLENCODED)
}
EXPECTED["/v1/aliases/{alias}"] = {
    content_type: {"collection": NAME} for content_type in (JSON, MULTIPART, URLENCODED)
}
EXPECTED["/v1/aliases/{alias}/promote"] = {
    content_type: {
        "collection": NAME,
        **{f"evaluation.{field}": limit for field, limit in EXPECTED["/v1/evaluate"][JSON].items()},
        "metric": {"maxLength": MAX_METRIC_NAME},
        "min_gain": SCORE,
    }
    for content_type in (JSON, MULTIPART, URLENCODED)
}
EXPECTED["/v1/collections/{collection}/reembed"] = {
    content_type: {"model": {"maxLength": MAX_FILE_NAME}, "collection": NAME}
    for content_type in (JSON, MULTIPART, URLENCODED)
}
COLLECTION_ROUTES = [path for path in EXPECTED if path.startswith("/v1/") and path.count("/") == 2]
EXPECTED |= {  # every body route again under a collection of its own, the same body
    path.replace("/v1", "/v1/collections/{collection}", 1): EXPECTED[path]
    for path in COLLECTION_ROUTES
}
"""route -> content type -> field (dotted; `[]` an array's items) -> keyword -> value"""


BODIES: dict[str, RequestBody[Any]] = {
    "/v1/search": SEARCH_BODY,
    "/v1/items": ITEM_BODY,
    "/v1/embed": EMBED_BODY,
    "/v1/evaluate": EVALUATE_BODY,
    "/v1/scroll": SCROLL_BODY,
    "/v1/recommend": RECOMMEND_BODY,
    "/v1/duplicates": DUPLICATES_BODY,
    "/v1/collections/{collection}": CREATE_BODY,
    "/v1/aliases/{alias}": ALIAS_BODY,
    "/v1/aliases/{alias}/promote": PROMOTE_BODY,
    "/v1/collections/{collection}/reembed": REEMBED_BODY,
}
BODIES |= {path.replace("/v1", "/v1/collections/{collection}", 1): BODIES[path]
           for path in COLLECTION_ROUTES}  # fmt: skip


@pytest.fixture(scope="module")
def openapi() -> dict[str, Any]:
    return create_app(Settings(read_only=True)).openapi()


def documented_limits(
    schema: Any, components: dict[str, Any], path: str = ""
) -> dict[str, dict[str, Any]]:
    """Every limit keyword in `schema`, by the field it constrains: object properties
    extend the path, array items add `[]`; anyOf branches, a `$ref`'s component and a
    JSON-text form field's decoded value (contentSchema) constrain the same field."""
    found: dict[str, dict[str, Any]] = {}

    def walk(node: Any, where: str) -> None:
        if isinstance(node, list):
            for child in node:
                walk(child, where)
            return
        if not isinstance(node, dict):
            return
        if "$ref" in node:
            walk(components[node["$ref"].removeprefix("#/components/schemas/")], where)
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


def body_schemas(openapi: dict[str, Any], path: str) -> dict[str, dict[str, Any]]:
    """The route's body schema by content type: the JSON component and the forms."""
    ref = request_bodies(openapi)[path][JSON]["schema"]["$ref"]
    component = openapi["components"]["schemas"][ref.removeprefix("#/components/schemas/")]
    return {JSON: component, **form_schemas(BODIES[path])}


def test_every_request_body_is_one_json_component_and_its_forms(openapi) -> None:
    bodies = request_bodies(openapi)
    assert set(bodies) == set(EXPECTED) == set(BODIES)
    for path, content in bodies.items():
        name = BODIES[path].model.__name__
        # one content type: client generators cannot read a body offered in several
        assert content == {JSON: {"schema": {"$ref": f"#/components/schemas/{name}"}}}
        assert set(body_schemas(openapi, path)) == set(EXPECTED[path]), path


def test_each_operation_describes_its_forms_fields(openapi) -> None:
    for path, operations in openapi["paths"].items():
        for operation in operations.values():
            if "requestBody" not in operation:
                continue
            for content_type, form in form_schemas(BODIES[path]).items():
                (line,) = [
                    line
                    for line in operation["description"].splitlines()
                    if line.startswith(f"- `{content_type}`:")
                ]
                for name in form["properties"]:
                    assert f"`{name}` (" in line, (path, content_type, name)


@pytest.mark.parametrize(
    ("path", "content_type"),
    [(path, content_type) for path, types in EXPECTED.items() for content_type in types],
)
def test_the_documented_limits_are_the_constants(openapi, path, content_type) -> None:
    schema = body_schemas(openapi, path)[content_type]
    components = openapi["components"]["schemas"]
    assert documented_limits(schema, components) == EXPECTED[path][content_type]


def test_forms_document_their_fields_as_the_models_do(openapi) -> None:
    search = body_schemas(openapi, "/v1/search")
    for content_type in (MULTIPART, URLENCODED):
        fields = search[content_type]["properties"]
        assert {"image_base64", "images_base64", "vector"}.isdisjoint(fields)
        assert fields["k"] == search[JSON]["properties"]["k"]
        assert fields["rerank"]["type"] == "string"
        assert fields["rerank"]["contentMediaType"] == "application/json"
    image = search[MULTIPART]["properties"]["image"]
    assert image["items"]["format"] == "binary"
    items = body_schemas(openapi, "/v1/items")[MULTIPART]
    assert items["required"] == ["image", "key"]
    assert items["properties"]["image"]["format"] == "binary"
    assert body_schemas(openapi, "/v1/embed")[MULTIPART]["required"] == ["image"]
    evaluate = body_schemas(openapi, "/v1/evaluate")
    for content_type in (MULTIPART, URLENCODED):  # mode `queries` works from a form too
        fields = evaluate[content_type]["properties"]
        assert {"mode", "ks", "queries", "filter"} == set(fields)
        assert fields["queries"]["contentMediaType"] == "application/json"


def test_metadata_size_and_depth_are_the_constants(openapi) -> None:
    items = body_schemas(openapi, "/v1/items")
    for content_type, schema in items.items():
        description = schema["properties"]["metadata"]["description"]
        assert f"at most {MAX_METADATA_BYTES // 1024} KiB" in description, content_type
        assert f"{MAX_METADATA_DEPTH} levels deep" in description, content_type


def test_the_thumbnail_size_and_max_k_setting_are_the_constants(openapi) -> None:
    (size,) = [
        parameter
        for parameter in openapi["paths"]["/v1/items/{key}/thumbnail"]["get"]["parameters"]
        if parameter["name"] == "size"
    ]
    assert documented_limits(size["schema"], {}) == {
        "": {"minimum": MIN_THUMBNAIL_SIZE, "maximum": MAX_THUMBNAIL_SIZE}
    }
    max_k = Settings.model_json_schema()["properties"]["max_k"]
    assert max_k["default"] == MAX_K and max_k["maximum"] == MAX_K


def test_a_field_a_form_cannot_carry_must_be_marked() -> None:
    class Unmarked(BaseModel):
        values: list[int] = []

    with pytest.raises(TypeError, match=r"Unmarked\.values"):
        RequestBody(Unmarked).openapi()  # what a route's declaration calls, at import
