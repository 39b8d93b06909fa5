"""The OpenAPI document finished for client generators (openapi-python-client and the
like), after FastAPI has made it: the one hook on `app.openapi`.

- Validation errors are documented as the ErrorBody they are
  (`errors.document_error_body`).
- The request bodies, which routes read themselves (service/inputs.py) rather than
  through FastAPI, become named components: each operation carries its model's schema
  under `inputs.COMPONENTS`, moved here under components/schemas.
- The read routes' API key is optional: a key is needed only when the server has a
  read key. OpenAPI says so as `[{}, {"APIKeyHeader": []}]` (no scheme, or the key);
  FastAPI can only state one scheme, so the read routes name their own
  (`deps.OPTIONAL_KEY_SCHEME`), rewritten here and dropped from the schemes.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from .deps import KEY_SCHEME, OPTIONAL_KEY_SCHEME
from .errors import document_error_body
from .inputs import COMPONENTS


def finish_openapi(app: FastAPI) -> None:
    """Wrap FastAPI's `app.openapi` to finish its document once; later calls answer the
    cached document."""
    made = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = made()
        document_error_body(document)
        finish(document)
        app.openapi_schema = document
        return document

    app.openapi = openapi  # type: ignore[method-assign]


def finish(document: dict[str, Any]) -> None:
    """Finish FastAPI's `document` in place: its request bodies and key schemes (see
    the module's docstring)."""
    components = document.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for operations in document.get("paths", {}).values():
        for operation in operations.values():
            for name, schema in operation.pop(COMPONENTS, {}).items():
                # two models of one name would make one $ref mean either
                if schemas.setdefault(name, schema) != schema:
                    raise RuntimeError(f"two different OpenAPI schemas are named {name!r}")
            if operation.get("security") == [{OPTIONAL_KEY_SCHEME: []}]:
                operation["security"] = [{}, {KEY_SCHEME: []}]
    components.get("securitySchemes", {}).pop(OPTIONAL_KEY_SCHEME, None)
