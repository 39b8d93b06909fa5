"""Route dependencies as typed aliases: the loaded service state and the API keys."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, Request, Security
from fastapi.security import APIKeyHeader

from .answers import API_KEY_HEADER
from .errors import ApiError
from .settings import Settings
from .state import ServiceState

KEY_SCHEME = "APIKeyHeader"
OPTIONAL_KEY_SCHEME = "OptionalAPIKeyHeader"
"""The read routes' scheme as FastAPI names it; the OpenAPI document states it as
KEY_SCHEME made optional (service/openapi.py), since OpenAPI has no optional scheme."""

_key_header = APIKeyHeader(
    name=API_KEY_HEADER,
    scheme_name=KEY_SCHEME,
    auto_error=False,
    description="the API key: always for adds and deletes, for reads when the server "
    "has a read key (VITRIEVAL_READ_API_KEY)",
)
_read_key_header = APIKeyHeader(
    name=API_KEY_HEADER, scheme_name=OPTIONAL_KEY_SCHEME, auto_error=False
)


def get_state(request: Request) -> ServiceState:
    state: ServiceState | None = getattr(request.app.state, "service", None)
    if state is None or not state.ready:
        raise ApiError(503, "not_ready", "the model and index are still loading")
    return state


ServiceDep = Annotated[ServiceState, Depends(get_state)]


def _settings(request: Request) -> Settings:
    return request.app.state.settings


def _matches(given: str | None, expected: str) -> bool:
    """Constant-time comparison, so response timing says nothing about the key."""
    if given is None:
        return False
    return secrets.compare_digest(given.encode(), expected.encode())


def require_write_key(
    request: Request, key: Annotated[str | None, Security(_key_header)] = None
) -> None:
    settings = _settings(request)
    if settings.read_only:
        raise ApiError(403, "read_only", "this server is read-only (started with --read-only)")
    assert settings.api_key is not None  # Settings refuses mutations without a key
    if not _matches(key, settings.api_key.get_secret_value()):
        raise ApiError(
            401,
            "unauthorized",
            f"a valid API key is required in the {API_KEY_HEADER} header",
            headers={"WWW-Authenticate": API_KEY_HEADER},
        )


def require_read_key(
    request: Request, key: Annotated[str | None, Security(_read_key_header)] = None
) -> None:
    settings = _settings(request)
    if settings.read_api_key is None:
        return
    accepted = [settings.read_api_key] + ([settings.api_key] if settings.api_key else [])
    # compare against every accepted key (no early exit) to keep the timing flat
    results = [_matches(key, expected.get_secret_value()) for expected in accepted]
    if not any(results):
        raise ApiError(
            401,
            "unauthorized",
            f"a valid API key is required in the {API_KEY_HEADER} header",
            headers={"WWW-Authenticate": API_KEY_HEADER},
        )


WriteAccess = Depends(require_write_key)
ReadAccess = Depends(require_read_key)
