"""Every API call as data: what to send and how to read the answer (sans I/O).

Each public function here builds one `Call` (method, path, query parameters, JSON
body, which key it needs, whether it may be retried, how its answer is parsed) and
is the single definition of a client method: `Client` and `AsyncClient` expose these
functions as their methods (vitrieval.client.methods), so a method's parameters,
types and docstring are written once, here, for both.

Bodies are JSON, images base64 (`image_base64`, `images_base64`): the server reads
multipart forms too, but JSON carries every field (vectors, lists, nested filters)
the same way. Base64 adds a third to an image's size, which the server's body limit
(the `max_body_bytes` setting, shown by `info()`) counts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel

from vitrieval._version import __version__
from vitrieval.service import answers

from .errors import IncompatibleServerError
from .inputs import ImageInput, VectorInput, image_base64, vector_list

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

Filter = Mapping[str, Any]
"""A metadata filter: `{"must": [...], "should": [...], "must_not": [...]}` with
`match`, `any` and `range` conditions (docs/index.md, "Metadata filters")."""
Rerank = Literal["aqe", "dba"] | Mapping[str, Any]
"""`"aqe"`, `"dba"`, or `{"method": "aqe", "n": 5, "alpha": 3.0}`."""
LabelledQuery = tuple[str, ImageInput | VectorInput]
"""(label, image or vector): a query of `evaluate(queries=...)`."""


@dataclass(frozen=True)
class Call(Generic[T]):
    """One request and how its answer becomes a `T`.

    `write`: sends the write key (else the read key). `idempotent`: sending it twice
    does what sending it once does, so a failed attempt may be repeated.
    `answer_statuses`: error statuses whose body is still the answer (/readyz's 503
    is a `Status`).
    """

    method: str
    path: str
    parse: Callable[[httpx.Response], T]
    params: dict[str, str] | None = None
    json: dict[str, Any] | None = None
    write: bool = False
    idempotent: bool = True
    answer_statuses: frozenset[int] = field(default_factory=frozenset)
    done_if_gone: Callable[[], T] | None = None
    """A retried call's result when the repeat finds nothing (404): a DELETE whose
    first attempt may have succeeded before its answer was lost."""


def _model(model: type[M]) -> Callable[[httpx.Response], M]:
    def parse(response: httpx.Response) -> M:
        return model.model_validate_json(response.content)

    return parse


def _item_path(key: str) -> str:
    # slashes stay: the item routes take the rest of the path as the key
    return "/v1/items/" + quote(key, safe="/")


def _given(**fields: Any) -> dict[str, Any]:
    """The fields that are set: the server's defaults apply to the others."""
    return {name: value for name, value in fields.items() if value is not None}


def search(
    *,
    image: ImageInput | None = None,
    images: Sequence[ImageInput] | None = None,
    vector: VectorInput | None = None,
    key: str | None = None,
    k: int = 10,
    label: str | None = None,
    filter: Filter | None = None,
    fusion: Literal["mean", "max"] | None = None,
    rerank: Rerank | None = None,
    exclude_self: bool | None = None,
    rescore: bool | None = None,
    oversample: int | None = None,
    offset: int | None = None,
    score_threshold: float | None = None,
    group_by: str | None = None,
    group_size: int | None = None,
) -> Call[answers.SearchResponse]:
    """The `k` indexed items most similar to one query, best first: an image,
    several `images` searched as one query (`fusion`: "mean", the default, or
    "max"), an indexed item's `key` (the item itself left out unless `exclude_self`
    is False) or a `vector`. `label` and `filter` narrow the hits; `rerank` re-ranks
    them (alpha query expansion, or the index's DBA vectors). On an index that
    scores from compressed codes (PQ, SQ), each segment ranks its `oversample` x k
    best candidates again by their exact vectors unless `rescore` is False (the
    range is in /openapi.json); exact indexes ignore both. `offset` skips the best
    hits (the next page of k starts at offset k), `score_threshold` leaves out hits
    scoring below it. With `group_by` (a field: "label" or a metadata path) the
    answer's `groups` hold the k best groups, each with its `group_size` best hits.
    An option left None takes the server's default."""
    # how the ranking is scored and cut: sent as given (None: the server's default)
    shaping = {"rescore": rescore, "oversample": oversample, "offset": offset}
    shaping |= {"score_threshold": score_threshold, "group_by": group_by, "group_size": group_size}
    body = _given(
        k=k,
        label=label,
        filter=dict(filter) if filter is not None else None,
        fusion=fusion,
        rerank={"method": rerank} if isinstance(rerank, str) else rerank,
        key=key,
        image_base64=image_base64(image) if image is not None else None,
        images_base64=[image_base64(i) for i in images] if images is not None else None,
        vector=vector_list(vector) if vector is not None else None,
        exclude_self=exclude_self,
        **shaping,
    )
    return Call("POST", "/v1/search", _model(answers.SearchResponse), json=body)


Example = str | VectorInput | ImageInput
"""A recommendation example: an indexed item's key (a str), a vector or an image."""


def recommend(
    positive: Sequence[Example],
    negative: Sequence[Example] = (),
    *,
    strategy: Literal["average_vector", "best_score"] | None = None,
    k: int = 10,
    label: str | None = None,
    filter: Filter | None = None,
    **shaping: Any,
) -> Call[answers.SearchResponse]:
    """The `k` items most like the `positive` examples and unlike the `negative` ones
    (`strategy`: "average_vector", the default, or "best_score"; docs/index.md). An
    example is an indexed item's key (a str, left out of the hits), a vector (a numpy
    array or a list of floats) or an image (a path, bytes, a file object or a PIL
    image: wrap a path in `pathlib.Path`, as a str is a key). `shaping`: `search`'s
    `rescore`, `oversample`, `offset`, `score_threshold`, `group_by`, `group_size`."""
    body = _given(
        positive=[example_json(e) for e in positive],
        negative=[example_json(e) for e in negative],
        strategy=strategy,
        k=k,
        label=label,
        filter=dict(filter) if filter is not None else None,
        **shaping,
    )
    return Call("POST", "/v1/recommend", _model(answers.SearchResponse), json=body)


def example_json(example: Example) -> dict[str, Any]:
    """One recommendation example as the API takes it."""
    if isinstance(example, str):
        return {"key": example}
    if isinstance(example, list | tuple) or getattr(example, "ndim", None) == 1:
        return {"vector": vector_list(example)}
    return {"image_base64": image_base64(example)}


def scroll(
    *,
    filter: Filter | None = None,
    label: str | None = None,
    limit: int | None = None,
    after: str | None = None,
) -> Call[answers.ScrollResponse]:
    """One page of the items `filter` and `label` allow, in ascending key order: up to
    `limit` items (None: the server's default; the range is in /openapi.json) whose
    keys sort after `after`. The answer's `next` is the following page's `after`
    (None: no more), so every item of the selection is listed once."""
    body = _given(
        filter=dict(filter) if filter is not None else None,
        label=label,
        limit=limit,
        after=after,
    )
    return Call("POST", "/v1/scroll", _model(answers.ScrollResponse), json=body)


def item_duplicates(
    key: str,
    *,
    threshold: float | None = None,
    precision: float | None = None,
    limit: int | None = None,
) -> Call[answers.ItemDuplicates]:
    """The items scoring at least `threshold` against the item `key`, best first, at
    most `limit` (None: the server's default). Without `threshold`, the index's
    calibrated threshold (of the `precision` level when given; an index never
    calibrated answers an `InvalidRequestError`)."""
    params = _given(threshold=threshold, precision=precision, limit=limit)
    return Call(
        "GET",
        _item_path(key) + "/duplicates",
        _model(answers.ItemDuplicates),
        params={name: str(value) for name, value in params.items()} or None,
    )


def start_duplicates(
    threshold: float | None = None,
    *,
    precision: float | None = None,
    filter: Filter | None = None,
    label: str | None = None,
    keep: str | None = None,
) -> Call[answers.DuplicateJobOut]:
    """Start a server job listing every group of near-duplicates among the items
    `filter` and `label` allow (the threshold as in `item_duplicates`; `keep` the rule of the
    item each group keeps, "largest" by default). A `ConflictError` while another job
    runs. Poll `duplicates_job(job)` until its status is no longer "running"."""
    body = _given(
        threshold=threshold,
        precision=precision,
        filter=dict(filter) if filter is not None else None,
        label=label,
        keep=keep,
    )
    # not repeated: a retry of a start that did start would meet its own job (409)
    return Call(
        "POST", "/v1/duplicates", _model(answers.DuplicateJobOut), json=body, idempotent=False
    )


def duplicates_job(job: str) -> Call[answers.DuplicateJobOut]:
    """A duplicates job: its status, the items searched so far, and once "done" its
    groups (largest first)."""
    return Call("GET", "/v1/duplicates/" + quote(job, safe=""), _model(answers.DuplicateJobOut))


def embed(image: ImageInput) -> Call[answers.EmbedResponse]:
    """The served model's embedding of an image (a unit vector)."""
    body = {"image_base64": image_base64(image)}
    return Call("POST", "/v1/embed", _model(answers.EmbedResponse), json=body)


def add(
    key: str,
    *,
    image: ImageInput | None = None,
    vector: VectorInput | None = None,
    label: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    replace: bool = False,
    duplicate_threshold: float | None = None,
    reject_duplicates: bool = False,
) -> Call[answers.ItemWritten]:
    """Add an item under `key`: an image (embedded by the server, kept for its
    thumbnail) or a vector, with an optional label and metadata. An existing key is
    a `ConflictError` unless `replace`. With `duplicate_threshold`, an item scoring at
    least that against an indexed one (another key) is refused: a `ConflictError` whose
    code is "duplicate" and whose message names it; `reject_duplicates=True` alone
    refuses at the index's calibrated threshold (`vitrieval-index calibrate`; an index
    without one answers an `InvalidRequestError`). Needs the write key. Only an add
    with `replace=True` is retried (a plain add sent twice would conflict with itself)."""
    body = _given(
        key=key,
        label=label,
        metadata=dict(metadata) if metadata is not None else None,
        image_base64=image_base64(image) if image is not None else None,
        vector=vector_list(vector) if vector is not None else None,
    )
    if replace:
        body["replace"] = True
    if duplicate_threshold is not None or reject_duplicates:
        body["on_duplicate"] = "reject"
    if duplicate_threshold is not None:
        body["duplicate_threshold"] = duplicate_threshold
    return Call(
        "POST", "/v1/items", _model(answers.ItemWritten), json=body, write=True, idempotent=replace
    )


def get(key: str, *, vector: bool = False) -> Call[answers.ItemOut]:
    """An item's label, metadata and whether it has an image; with `vector=True`
    its stored vector too."""
    params = {"vector": "true"} if vector else None
    return Call("GET", _item_path(key), _model(answers.ItemOut), params=params)


def thumbnail(key: str, *, size: int | None = None) -> Call[bytes]:
    """A JPEG of the item's image, at most `size` pixels on its longest side (None: the
    server's default; the range is in /openapi.json); a `NotFoundError` for an item
    added without an image."""
    return Call(
        "GET",
        _item_path(key) + "/thumbnail",
        lambda response: response.content,
        params=None if size is None else {"size": str(size)},
    )


def delete(key: str) -> Call[answers.ItemDeleted]:
    """Delete an item (a `NotFoundError` if there is none). Needs the write key."""
    return Call(
        "DELETE",
        _item_path(key),
        _model(answers.ItemDeleted),
        write=True,
        done_if_gone=lambda: answers.ItemDeleted(key=key, deleted=True),
    )


def evaluate(
    *,
    queries: Sequence[LabelledQuery] | None = None,
    ks: Sequence[int] | None = None,
    filter: Filter | None = None,
) -> Call[answers.EvaluateResponse]:
    """Retrieval quality over the index's labelled items: Recall@K and
    Precision@K for each of `ks` (None: the server's), mAP, MAP@R, R-Precision. Without `queries`
    (leave-one-out) every labelled item queries the others; with `queries`, each
    (label, image or vector) pair is ranked against the labelled items. `filter`:
    only the labelled items it allows take part."""
    body: dict[str, Any] = {"mode": "leave-one-out", **_given(ks=None if ks is None else list(ks))}
    if queries is not None:
        body["mode"] = "queries"
        body["queries"] = [_labelled_query(label, query) for label, query in queries]
    if filter is not None:
        body["filter"] = dict(filter)
    return Call("POST", "/v1/evaluate", _model(answers.EvaluateResponse), json=body)


def _labelled_query(label: str, query: ImageInput | VectorInput) -> dict[str, Any]:
    # a sequence of numbers or an array is a vector; anything else must be an image
    if isinstance(query, bytes | bytearray | memoryview):  # a memoryview has .tolist() too
        return {"label": label, "image_base64": image_base64(query)}
    if hasattr(query, "tolist") or isinstance(query, list | tuple):
        return {"label": label, "vector": vector_list(query)}
    return {"label": label, "image_base64": image_base64(query)}


def info() -> Call[answers.InfoResponse]:
    """The served model, the index (count, generation, segments) and the service's
    settings and version."""
    return Call("GET", "/v1/info", _model(answers.InfoResponse))


def health() -> Call[answers.Status]:
    """/healthz: `status` "ok" while the process runs."""
    return Call("GET", "/healthz", _model(answers.Status))


def readiness() -> Call[answers.Status]:
    """/readyz: `status` "ready" or "degraded" (serving), "loading" or "failing"
    (not serving: returned too, not raised) and the `checks`."""
    return Call("GET", "/readyz", _model(answers.Status), answer_statuses=frozenset({503}))


def metrics() -> Call[str]:
    """The Prometheus metrics, as text."""
    return Call("GET", "/metrics", lambda response: response.text)


def check_version() -> Call[str]:
    """The server's vitrieval version, after checking that its major.minor release
    is the client's (`IncompatibleServerError` if not)."""

    def parse(response: httpx.Response) -> str:
        server = answers.InfoResponse.model_validate_json(response.content).version
        if not compatible(server, __version__):
            raise IncompatibleServerError(server, __version__)
        return server

    return Call("GET", "/v1/info", parse)


def compatible(server: str, client: str) -> bool:
    """Whether two releases share their major.minor (the API changes only with those)."""
    return server.split(".")[:2] == client.split(".")[:2]
