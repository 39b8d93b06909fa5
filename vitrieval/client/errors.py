"""What a failed call raises: `APIError`, or the subclass of its HTTP status.

The server answers every error with `{"detail", "code", "errors"?}` (`ErrorBody`);
the exception carries those fields and the status. A failure without an HTTP answer
(the connection refused, reset or timed out, after the retries) is a
`ConnectionFailedError` with status 0, and a server of another release an
`IncompatibleServerError`, also status 0: catching `APIError` catches everything the
client raises on purpose.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from vitrieval.service.answers import ErrorBody

_DETAIL_CHARS = 300
"""How much of a body that is not an ErrorBody (a proxy's HTML page) the detail keeps."""


class APIError(Exception):
    """A call that failed: `status` (the HTTP status, 0 without one), `code` (the
    server's machine code, e.g. `not_found`), `detail` (in words) and `errors` (the
    failing fields of a request that did not validate, else None)."""

    def __init__(
        self,
        status: int,
        code: str,
        detail: str,
        errors: list[dict[str, Any]] | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(f"{status} {code}: {detail}" if status else f"{code}: {detail}")
        self.status = status
        self.code = code
        self.detail = detail
        self.errors = errors
        self.retry_after = retry_after
        """seconds the server asked to wait before trying again (429, 503), if it said"""


class AuthenticationError(APIError):
    """401: the API key is missing or wrong."""


class PermissionDeniedError(APIError):
    """403: the server takes no changes (started with `--read-only`)."""


class NotFoundError(APIError):
    """404: no item with that key (or it has no image, for a thumbnail)."""


class ConflictError(APIError):
    """409: an item with that key exists (add with `replace=True`), a near-duplicate
    is indexed (an add with `duplicate_threshold`; `code` "duplicate"), or the index
    refused the change."""


class PayloadTooLargeError(APIError):
    """413: the request body or an image is over the server's limits."""


class UnsupportedMediaTypeError(APIError):
    """415: an image format the server does not decode."""


class InvalidRequestError(APIError):
    """422 (and 400): the request did not validate; `errors` lists the fields when
    the server named them."""


class RateLimitedError(APIError):
    """429: the server is busy with this kind of call (an evaluation is running)."""


class ServiceUnavailableError(APIError):
    """503: overloaded, timed out, still loading, or its storage is failing."""


class ConnectionFailedError(APIError):
    """No HTTP answer: the connection failed or timed out (after the retries an
    idempotent call is allowed). Status 0; the httpx error is the `__cause__`."""


class IncompatibleServerError(APIError):
    """The server runs a vitrieval release whose major.minor differs from the
    client's (`Client.check_version`). Status 0."""

    def __init__(self, server_version: str, client_version: str) -> None:
        super().__init__(
            0,
            "incompatible_server",
            f"the server runs vitrieval {server_version}, this client is {client_version}: "
            f"install the client of the server's release (major.minor)",
        )
        self.server_version = server_version
        self.client_version = client_version


ERRORS: dict[int, type[APIError]] = {
    400: InvalidRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: ConflictError,
    413: PayloadTooLargeError,
    415: UnsupportedMediaTypeError,
    422: InvalidRequestError,
    429: RateLimitedError,
    503: ServiceUnavailableError,
}


def error_for(status: int, content: bytes, retry_after: float | None = None) -> APIError:
    """The exception for an error answer: its ErrorBody's fields, or (a body that is
    not one, e.g. from a proxy in front of the server) `http_<status>` and the start
    of the body as the detail."""
    cls = ERRORS.get(status, APIError)
    try:
        body = ErrorBody.model_validate_json(content)
    except ValidationError:
        text = content[:_DETAIL_CHARS].decode("utf-8", "replace").strip()
        return cls(status, f"http_{status}", text or "(no body)", retry_after=retry_after)
    return cls(status, body.code, body.detail, body.errors, retry_after=retry_after)
