"""`vitrieval.client`: a typed client of vitrieval's HTTP API (docs/python.md,
"The HTTP client").

`Client` blocks, `AsyncClient` has the same methods as coroutines. Answers are the
service's own response models (vitrieval.service.answers, re-exported here); a failed
call raises `APIError` or the subclass of its status. Needs httpx and pydantic (the
`client` extra); importing it loads neither FAISS, ONNX Runtime, torch nor FastAPI,
and numpy or PIL only when given their objects.

    from vitrieval.client import Client

    with Client("http://127.0.0.1:8000", api_key="...") as client:
        client.add("shop/1", image="shoe.jpg", label="shoes", metadata={"price": 30})
        hits = client.search(image="query.jpg", k=5).hits
"""

from vitrieval.service.answers import (
    EmbedResponse,
    ErrorBody,
    EvaluateResponse,
    HitOut,
    InfoResponse,
    ItemDeleted,
    ItemOut,
    ItemWritten,
    SearchResponse,
    Status,
)

from .aio import AsyncClient
from .errors import (
    APIError,
    AuthenticationError,
    ConflictError,
    ConnectionFailedError,
    IncompatibleServerError,
    InvalidRequestError,
    NotFoundError,
    PayloadTooLargeError,
    PermissionDeniedError,
    RateLimitedError,
    ServiceUnavailableError,
    UnsupportedMediaTypeError,
)
from .sync import Client

__all__ = [
    "APIError",
    "AsyncClient",
    "AuthenticationError",
    "Client",
    "ConflictError",
    "ConnectionFailedError",
    "EmbedResponse",
    "ErrorBody",
    "EvaluateResponse",
    "HitOut",
    "IncompatibleServerError",
    "InfoResponse",
    "InvalidRequestError",
    "ItemDeleted",
    "ItemOut",
    "ItemWritten",
    "NotFoundError",
    "PayloadTooLargeError",
    "PermissionDeniedError",
    "RateLimitedError",
    "SearchResponse",
    "ServiceUnavailableError",
    "Status",
    "UnsupportedMediaTypeError",
]
