"""Errors as the API shows them: a 4xx status with a JSON body that says what was wrong.

Every error response has the body `{"detail": "<what went wrong>", "code": "<machine
code>"}` (request validation adds `errors`, the list of failing fields). Handlers are
installed by `install_error_handlers`; nothing a client sends reaches the default 500
page, and an unexpected server fault answers a bare 500 JSON body without a traceback.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from vitrieval.index.collections import NameTaken, UnknownCollection
from vitrieval.index.runtime.images import (
    ImageDecodeError,
    ImageShapeError,
    ImageTooLargeError,
    UnsupportedFormatError,
)
from vitrieval.index.store import DamagedIndexError, JournalWriteError, StoreError

from .answers import ErrorBody

logger = logging.getLogger("vitrieval.service")

CLIENT_CLOSED_REQUEST = 499
"""The status given to a request whose client hung up (nobody receives it; the
metrics count it as a disconnect, not as an error)."""


class ApiError(Exception):
    """Raised anywhere in a request to answer `status` with an ErrorBody."""

    def __init__(self, status: int, code: str, detail: str, headers: dict | None = None) -> None:
        super().__init__(detail)
        self.status, self.code, self.detail, self.headers = status, code, detail, headers


def image_error(exc: Exception, name: str = "the image") -> ApiError:
    """The API error for an image that failed to decode (see index.runtime.images); the message
    calls the image `name` (the uploaded file's name, say)."""
    # index.runtime.images names an in-memory image "<bytes>"
    detail = str(exc).replace("<bytes>", name, 1)
    if isinstance(exc, ImageTooLargeError):
        return ApiError(413, "image_too_large", detail)
    if isinstance(exc, UnsupportedFormatError):
        return ApiError(415, "unsupported_image_format", detail)
    if isinstance(exc, ImageShapeError):
        return ApiError(422, "unsupported_image_shape", detail)
    if isinstance(exc, ImageDecodeError):
        return ApiError(422, "corrupt_image", detail)
    # hostile files can make PIL plugins raise odd types; still the client's input
    return ApiError(422, "corrupt_image", f"{name}: cannot decode image ({type(exc).__name__})")


STORAGE_FAILED = (
    "the server cannot write to its storage now (a full or failing disk): nothing was "
    "stored; retry later"
)
INDEX_DAMAGED = (
    "a segment of the index failed verification: the index takes no changes until it is "
    "restored from a backup"
)
INDEX_REFUSED = "the index refused the request (the server's log says why)"

# a server path in a message: "/" at the start of a word (a key such as "shop/12" has
# a word before its slash); what the store names its folder and files with
_SERVER_PATH = re.compile(r"(?:^|[\s'\"`(=])/[^\s/]")


def storage_error(exc: BaseException) -> ApiError:
    """503 `storage_unavailable` for a write the server's disk refused (an OSError such
    as ENOSPC, EDQUOT or EIO, or the journal's JournalWriteError): the server's fault,
    not the client's. The detail names files; it goes to the log, not to the client."""
    logger.error("a write failed, nothing was stored: %s", exc)
    return ApiError(503, "storage_unavailable", STORAGE_FAILED)


def store_error(exc: StoreError, status: int, code: str) -> ApiError:
    """The API error for a StoreError a route met: the storage failing (the journal, a
    damaged segment) is a 503 `storage_unavailable`; anything else `status` and `code`
    with the error's `public` sentence. The store's own message may name the index's
    folder (the command line's user owns the machine; a client does not): one that
    names a path and has no public sentence is answered with INDEX_REFUSED, and logged."""
    if isinstance(exc, JournalWriteError):
        return storage_error(exc)
    if isinstance(exc, DamagedIndexError):
        logger.warning("a change was refused: %s", exc)
        return ApiError(503, "storage_unavailable", INDEX_DAMAGED)
    if exc.public is not None:
        return ApiError(status, code, exc.public)
    message = str(exc)
    if _SERVER_PATH.search(message):
        logger.warning("refused with %d %s: %s", status, code, message)
        return ApiError(status, code, INDEX_REFUSED)
    return ApiError(status, code, message)


def error_response(status: int, code: str, detail: str, **extra: Any) -> JSONResponse:
    body = {"detail": detail, "code": code, **extra}
    return JSONResponse(body, status_code=status)


_HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    406: "not_acceptable",
    409: "conflict",
    413: "request_too_large",
    415: "unsupported_media_type",
}


def validation_message(error: dict[str, Any]) -> str:
    """A pydantic error's message without pydantic's "Value error, " prefix (the
    validators' own messages say what is wrong)."""
    return str(error.get("msg", "invalid")).removeprefix("Value error, ")


def _field_message(error: dict[str, Any]) -> str:
    where = ".".join(str(part) for part in error.get("loc", ()) if part != "body") or "body"
    return f"{where}: {error['msg']}"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        response = error_response(exc.status, exc.code, exc.detail)
        if exc.headers:
            response.headers.update(exc.headers)
        return response

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            {"loc": list(e.get("loc", ())), "msg": validation_message(e), "type": e.get("type")}
            for e in exc.errors()
        ]
        detail = "; ".join(_field_message(e) for e in errors) or "invalid request"
        return error_response(422, "invalid_request", detail, errors=errors)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code, "error")
        response = error_response(exc.status_code, code, str(exc.detail))
        if exc.headers:
            response.headers.update(exc.headers)
        return response

    @app.exception_handler(ClientDisconnect)
    async def _client_left(request: Request, exc: ClientDisconnect) -> Response:
        # nobody will read this answer; its status tells the metrics what happened
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, "internal_error", "internal server error")


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries for the error statuses a route can answer."""
    return {status: {"model": ErrorBody} for status in statuses}


def binary_responses(
    media_type: str, description: str, *statuses: int
) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` of a route answering bytes of `media_type` (200, described
    as `description`) or an error of `statuses`."""
    binary = {"schema": {"type": "string", "format": "binary"}}
    answer = {"description": description, "content": {media_type: binary}}
    return {200: answer, **error_responses(*statuses)}


def document_error_body(document: dict[str, Any]) -> None:
    """Make the OpenAPI `document` tell the truth about validation errors, in place:
    FastAPI documents every 422 as its own HTTPValidationError, but
    `install_error_handlers` answers them with ErrorBody like every other error."""
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    schemas["ErrorBody"] = ErrorBody.model_json_schema()
    ref = {"$ref": "#/components/schemas/ErrorBody"}
    for operations in document.get("paths", {}).values():
        for operation in operations.values():
            response = operation.get("responses", {}).get("422")
            if response is not None:
                response["content"] = {"application/json": {"schema": ref}}


def collection_error(exc: StoreError) -> ApiError:
    """A data folder's refusal as its HTTP answer: 404 unknown, 409 taken, else 422."""
    if isinstance(exc, UnknownCollection):
        return store_error(exc, 404, "not_found")
    if isinstance(exc, NameTaken):
        return store_error(exc, 409, "conflict")
    return store_error(exc, 422, "invalid_request")


def job_error(exc: Exception) -> str:
    """What a background job that failed with `exc` answers: a StoreError's public words
    (never a server path), else the exception's type; the details go to the log."""
    if isinstance(exc, StoreError):
        return store_error(exc, 500, "failed").detail
    return f"{type(exc).__name__} (the server's log has the details)"
