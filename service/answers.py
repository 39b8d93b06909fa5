"""What the HTTP API answers: one pydantic model per response body, and the header the
API keys travel in.

The routes declare these as their response models (so /openapi.json names each one),
and `vitrieval.client` parses the server's answers into the same classes: a field is
defined here once for both. This module imports pydantic only (no FastAPI, FAISS or
ONNX Runtime), so the client can load it without the `serve` extra.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

API_KEY_HEADER = "X-API-Key"
"""The request header of the write and read keys. It sits here, with the answers, as the
one module of the HTTP API's terms that the client can import without FastAPI."""


class ErrorBody(BaseModel):
    """The body of every 4xx/5xx response."""

    detail: str = Field(description="what was wrong, in words")
    code: str = Field(description="a stable machine code, e.g. `not_found`")
    errors: list[dict[str, Any]] | None = Field(
        None, description="request validation only: the failing fields"
    )


class HitOut(BaseModel):
    """One search hit."""

    key: str
    score: float = Field(description="cosine similarity to the query")
    label: str | None
    metadata: dict[str, Any]


class GroupOut(BaseModel):
    """One group of a grouped search: the field's value and its best hits."""

    value: str | int | float | bool
    hits: list[HitOut]


class SearchResponse(BaseModel):
    """The hits of one search, best first, and where the time went."""

    hits: list[HitOut] = Field(description="best first; empty with `group_by` (see groups)")
    groups: list[GroupOut] | None = Field(
        None, description="with `group_by`: the groups, best first, each with its hits"
    )
    k: int
    query: Literal["image", "key", "vector", "recommend"]
    timings_ms: dict[str, float] = Field(description="decode, embed and search, milliseconds")


class EmbedResponse(BaseModel):
    """An image's embedding: L2-normalised, `dim` long."""

    embedding: list[float]
    dim: int
    fingerprint: str = Field(description="the model's fingerprint (sha256 of its weights)")
    timings_ms: dict[str, float]


class ItemOut(BaseModel):
    """An indexed item."""

    key: str
    label: str | None
    metadata: dict[str, Any]
    has_image: bool = Field(description="whether /v1/items/{key}/thumbnail can show it")
    vector: list[float] | None = Field(None, description="with `?vector=true` only")


class ListedItemOut(BaseModel):
    """An item as /v1/scroll lists it."""

    key: str
    label: str | None
    metadata: dict[str, Any]


class ScrollResponse(BaseModel):
    """One page of a filtered selection in ascending key order."""

    items: list[ListedItemOut]
    next: str | None = Field(
        description="the `after` of the next page; null when this page is the last"
    )


class ItemDuplicates(BaseModel):
    """The items scoring at least the threshold against one item, best first."""

    key: str
    threshold: float = Field(description="the threshold used (given, or the calibrated one)")
    duplicates: list[HitOut]


class DuplicateGroupOut(BaseModel):
    """One group of near-duplicates (single linkage) and the item it keeps."""

    keys: list[str] = Field(description="its members' keys, sorted")
    keep: str = Field(description="the key the `keep` rule suggests keeping")
    size: int
    best_score: float
    pairs: list[tuple[str, str, float]] = Field(description="the pairs linking it: key, key, score")


class DuplicateJobOut(BaseModel):
    """A duplicates job: running (with the items searched so far), done (with its
    groups, largest first), failed (with the error) or stopped (the server shut down)."""

    job: str
    status: Literal["running", "done", "failed", "stopped"]
    threshold: float
    searched: int = Field(description="items searched so far")
    started: str
    finished: str | None = None
    groups: list[DuplicateGroupOut] | None = None
    error: str | None = None


class ItemWritten(ItemOut):
    """An item as added (or replaced)."""

    replaced: bool = Field(False, description="an item with this key was overwritten")


class ItemDeleted(BaseModel):
    """An item's deletion: `deleted` is true when it is gone."""

    key: str
    deleted: bool


class Status(BaseModel):
    """/healthz (`ok`) and /readyz (`ready`, `degraded`, `loading` or `failing`), and
    the checks behind the answer."""

    status: str
    checks: dict[str, Any] = Field(default_factory=dict)


class EvaluateResponse(BaseModel):
    """Retrieval quality over the index's labelled items (`null`: no query had a
    relevant item). Besides the fields below, `recall@K` and `precision@K` for each K
    asked for, e.g. `recall@1`."""

    model_config = ConfigDict(extra="allow")
    # the type of the extra `recall@K` / `precision@K` fields, for the schema and parsing
    __pydantic_extra__: dict[str, float | None] = Field(init=False)

    mode: Literal["leave-one-out", "queries"]
    n_items: int = Field(description="labelled items ranked")
    n_queries: int = Field(description="queries counted")
    n_dropped: int = Field(description="queries without a relevant item, left out")
    map: float | None = Field(description="mean average precision")
    map_at_r: float | None = Field(description="MAP@R")
    r_precision: float | None = Field(description="R-Precision")

    def recall(self, k: int) -> float | None:
        """Recall@k (for a k the request asked for)."""
        return (self.model_extra or {})[f"recall@{k}"]


class ModelInfo(BaseModel):
    """The served model, as its file's metadata describes it."""

    file: str
    backbone: str | None
    pooling: str | None
    embedding_dim: int
    input_size: list[int]
    fingerprint: str
    provider: str = Field(description="the ONNX Runtime execution provider")


class SegmentInfo(BaseModel):
    """One sealed segment of the index: its rows, the live ones and the deleted ones."""

    number: int
    rows: int
    live: int
    deleted: int
    damaged: str | None = Field(None, description="a damaged segment's reason code")
    shard: str | None = Field(None, description="the shard it belongs to (sharded indexes)")


class TuningInfo(BaseModel):
    """What `vitrieval-index tune` measured and chose for the index."""

    target_recall: float
    recall: float = Field(description="recall@k measured on the index's own items")
    held_out_recall: float = Field(description="recall@k on as many other items")
    k: int
    queries: int
    params: dict[str, int] = Field(description="the settings chosen (nprobe, oversample...)")
    latency_ms: float = Field(description="a single query's median latency at those settings")
    items: int = Field(description="live items when it was measured")
    reached: bool = Field(description="whether any setting reached the target")
    tuned: str = Field(description="when (ISO 8601)")


class CalibrationLevelInfo(BaseModel):
    """The duplicate threshold of one precision level, and what it measured."""

    precision: float = Field(description="the precision asked for")
    threshold: float = Field(description="the least score reaching it (cosine)")
    reached: bool = Field(description="whether any threshold reached the precision")
    measured_precision: float
    precision_interval: list[float] = Field(description="95% Wilson interval")
    recall: float = Field(description="of the generated copies, at the threshold")
    recall_interval: list[float] = Field(description="95% Wilson interval")
    pairs: int = Field(description="(copy, item) pairs scoring at least the threshold")


class CalibrationInfo(BaseModel):
    """What `vitrieval-index calibrate` measured: the index's duplicate threshold
    (`on_duplicate: reject` without `duplicate_threshold` uses it)."""

    precision: float = Field(description="the level asked for; its threshold is the default")
    threshold: float
    levels: list[CalibrationLevelInfo]
    images: int = Field(description="the index's images that were copied")
    copies: int = Field(description="the generated copies searched")
    seed: int
    items: int = Field(description="live items when it was measured")
    calibrated: str = Field(description="when (ISO 8601)")


class IndexInfo(BaseModel):
    """The served index: its size, FAISS factory, generation and segments."""

    count: int = Field(description="live items")
    deleted: int
    factory: str = Field(description="the FAISS factory string")
    dim: int
    metric: str
    generation: int | list[int | None] | None = Field(
        description="the committed generation (a sharded index: one per shard)"
    )
    gpu: str = Field(description='where searches run: "cpu" or "<n> GPU(s)"')
    search_params: dict[str, int]
    tuning: TuningInfo | None = Field(None, description="the settings tuned to a target recall")
    calibration: CalibrationInfo | None = Field(
        None, description="the calibrated duplicate threshold"
    )
    journal_pending: int = Field(description="writes in the journal, not yet sealed")
    segments: list[SegmentInfo]


class ServiceInfo(BaseModel):
    """The service's settings that a client may need (limits, batching, mutations)."""

    batching: bool
    model_calls_at_once: int
    max_batch_size: int
    max_batch_wait_ms: float
    max_k: int
    max_body_bytes: int
    max_pixels: int
    mutations: bool = Field(description="whether items can be added and deleted")
    read_key_required: bool


class InfoResponse(BaseModel):
    """The served model, the index and the service's settings."""

    version: str = Field(description="vitrieval's version on the server")
    uptime_s: float
    model: ModelInfo
    index: IndexInfo
    service: ServiceInfo


class CollectionOut(BaseModel):
    """A collection: `count` and `dim` as its open store holds them, or as its last
    save does while it is closed; `model` its model's fingerprint; `status` damaged when
    it cannot be opened or a segment failed verification (the log says why)."""

    name: str
    status: Literal["ok", "damaged"]
    count: int | None
    dim: int | None
    model: str | None
    aliases: list[str] = Field(description="the aliases naming it")
    open: bool = Field(description="loaded now (closed when idle; reopened on use)")


class CollectionList(BaseModel):
    collections: list[CollectionOut]


class CollectionDeleted(BaseModel):
    collection: str
    deleted: bool


class AliasOut(BaseModel):
    """An alias and the collection it names (`previous`: the one it named before)."""

    alias: str
    collection: str
    previous: str | None = None


class AliasList(BaseModel):
    aliases: dict[str, str] = Field(description="alias -> collection")


class PromoteResponse(BaseModel):
    """Both evaluations, the rule and the decision of a promote."""

    alias: str
    switched: bool
    metric: str
    min_gain: float
    current_collection: str
    candidate_collection: str
    current: EvaluateResponse
    candidate: EvaluateResponse


class SnapshotOut(BaseModel):
    """A kept snapshot: its id, size, and the generation and count it holds."""

    snapshot: str
    collection: str
    bytes: int
    generation: int
    count: int = Field(description="items committed in its generation (the journal aside)")
    created: str


class SnapshotList(BaseModel):
    snapshots: list[SnapshotOut]


class SnapshotDeleted(BaseModel):
    snapshot: str
    deleted: bool


class ReembedJobOut(BaseModel):
    """A re-embedding job: running (`embedded`: images read so far), done (the new
    collection is served), failed (`error`) or stopped (cancelled, or the server shut
    down: what was embedded is kept, and the same request goes on from there).
    `no_image`: items added as vectors, `image_gone`: items whose image file is gone;
    neither can be carried over."""

    job: str
    source: str
    target: str
    model: str
    status: Literal["running", "done", "failed", "stopped"]
    embedded: int
    no_image: int
    image_gone: int
    started: str
    finished: str | None = None
    error: str | None = None
