"""The OpenAPI document is one a client generator reads: valid OpenAPI (checked by
openapi-spec-validator), a stable operationId on every operation, every request body
and JSON answer a named component, the API key declared where it is needed (always
for adds and deletes, optional for reads, never for probes), and the binary and text
answers typed. tests/test_openapi_generated.py generates a client from it."""

from __future__ import annotations

from typing import Any

import pytest
from openapi_spec_validator import validate

from vitrieval.service import answers
from vitrieval.service.app import create_app
from vitrieval.service.inputs import COMPONENTS, JSON
from vitrieval.service.metrics import CONTENT_TYPE
from vitrieval.service.openapi import finish
from vitrieval.service.settings import Settings

WRITE = [{"APIKeyHeader": []}]
READ = [{}, {"APIKeyHeader": []}]  # no key, or the key: needed when the server has a read key

OPERATIONS: dict[tuple[str, str], tuple[str, list[dict[str, list[str]]] | None]] = {
    ("post", "/v1/search"): ("search", READ),
    ("post", "/v1/embed"): ("embed", READ),
    ("post", "/v1/recommend"): ("recommend", READ),
    ("post", "/v1/items"): ("add_item", WRITE),
    ("get", "/v1/items/{key}"): ("get_item", READ),
    ("get", "/v1/items/{key}/thumbnail"): ("get_thumbnail", READ),
    ("delete", "/v1/items/{key}"): ("delete_item", WRITE),
    ("post", "/v1/scroll"): ("scroll", READ),
    ("get", "/v1/items/{key}/duplicates"): ("get_item_duplicates", READ),
    ("post", "/v1/duplicates"): ("start_duplicates", READ),
    ("get", "/v1/duplicates/{job}"): ("get_duplicates", READ),
    ("post", "/v1/evaluate"): ("evaluate", READ),
    ("get", "/v1/info"): ("get_info", READ),
    ("get", "/healthz"): ("healthz", None),
    ("get", "/readyz"): ("readyz", None),
    ("get", "/metrics"): ("get_metrics", None),
    ("get", "/"): ("get_page", None),
}
OPERATIONS |= {  # every /v1/... route again under a collection of its own
    (method, path.replace("/v1", "/v1/collections/{collection}", 1)): (f"{op}_in_collection", sec)
    for (method, path), (op, sec) in OPERATIONS.items()
    if path.startswith("/v1/")
}
OPERATIONS |= {
    ("get", "/v1/collections"): ("list_collections", READ),
    ("put", "/v1/collections/{collection}"): ("create_collection", WRITE),
    ("get", "/v1/collections/{collection}"): ("get_collection", READ),
    ("delete", "/v1/collections/{collection}"): ("delete_collection", WRITE),
    ("post", "/v1/collections/{collection}/snapshots"): ("create_snapshot", WRITE),
    ("get", "/v1/collections/{collection}/snapshots"): ("list_snapshots", READ),
    ("get", "/v1/collections/{collection}/snapshots/{snapshot}"): ("download_snapshot", READ),
    ("delete", "/v1/collections/{collection}/snapshots/{snapshot}"): ("delete_snapshot", WRITE),
    ("get", "/v1/aliases"): ("list_aliases", READ),
    ("put", "/v1/aliases/{alias}"): ("set_alias", WRITE),
    ("delete", "/v1/aliases/{alias}"): ("delete_alias", WRITE),
    ("post", "/v1/aliases/{alias}/promote"): ("promote", WRITE),
    ("post", "/v1/collections/{collection}/reembed"): ("start_reembed", WRITE),
    ("get", "/v1/collections/{collection}/reembed/{job}"): ("get_reembed", WRITE),
    ("delete", "/v1/collections/{collection}/reembed/{job}"): ("cancel_reembed", WRITE),
}
"""(method, path) -> (operationId, security); the generated client's function names"""


@pytest.fixture(scope="module")
def openapi() -> dict[str, Any]:
    return create_app(Settings(read_only=True)).openapi()


def operations(openapi: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {
        (method, path): operation
        for path, methods in openapi["paths"].items()
        for method, operation in methods.items()
    }


def test_the_document_is_valid_openapi(openapi) -> None:
    validate(openapi)


def test_every_operation_has_its_id_and_security(openapi) -> None:
    found = {
        where: (operation.get("operationId"), operation.get("security"))
        for where, operation in operations(openapi).items()
    }
    # the documentation pages and their assets are UI plumbing: not in the document
    assert found == OPERATIONS
    (name, scheme), *others = openapi["components"]["securitySchemes"].items()
    assert name == "APIKeyHeader" and not others
    assert (scheme["type"], scheme["in"], scheme["name"]) == ("apiKey", "header", "X-API-Key")


def test_every_json_body_and_answer_is_a_named_component(openapi) -> None:
    components = openapi["components"]["schemas"]
    for where, operation in operations(openapi).items():
        bodies = [operation["requestBody"]] if "requestBody" in operation else []
        for message in [*bodies, *operation["responses"].values()]:
            content = message.get("content", {})
            if JSON in content:
                name = content[JSON]["schema"]["$ref"].removeprefix("#/components/schemas/")
                assert name in components, (where, name)
        for status, response in operation["responses"].items():
            if status.startswith("2") and JSON in response.get("content", {}):
                name = response["content"][JSON]["schema"]["$ref"].split("/")[-1]
                assert isinstance(getattr(answers, name, None), type), (where, name)
        assert COMPONENTS not in operation  # moved under components by service.openapi


def test_the_thumbnail_and_the_metrics_are_typed(openapi) -> None:
    thumbnail = openapi["paths"]["/v1/items/{key}/thumbnail"]["get"]["responses"]["200"]
    assert thumbnail["content"] == {
        "image/jpeg": {"schema": {"type": "string", "format": "binary"}}
    }
    metrics = openapi["paths"]["/metrics"]["get"]["responses"]["200"]
    assert metrics["content"] == {CONTENT_TYPE: {"schema": {"type": "string"}}}


def test_two_models_of_one_name_are_refused() -> None:
    def operation(schema: dict[str, Any]) -> dict[str, Any]:
        return {"post": {COMPONENTS: {"Query": schema}, "responses": {}}}

    same = {"paths": {"/a": operation({"type": "object"}), "/b": operation({"type": "object"})}}
    finish(same)
    assert same["components"]["schemas"] == {"Query": {"type": "object"}}
    clash = {"paths": {"/a": operation({"type": "object"}), "/b": operation({"type": "string"})}}
    with pytest.raises(RuntimeError, match="'Query'"):
        finish(clash)
