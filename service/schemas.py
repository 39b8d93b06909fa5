"""Request models of the HTTP API: the OpenAPI document's request-body components (the
answers' models are in answers.py)."""

from __future__ import annotations

import json
from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from vitrieval.index.collections import DEFAULT_FACTORY, NAME_REGEX, SNAPSHOT_ID
from vitrieval.index.duplicates import DEFAULT_KEEP, KEEP_RULES, check_keep_rule
from vitrieval.index.evaluation.metrics import metric_names
from vitrieval.index.fusion import DEFAULT_FUSION, Fusion
from vitrieval.index.grouping import DEFAULT_GROUP_SIZE, MAX_GROUP_SIZE
from vitrieval.index.promotion import DEFAULT_METRIC
from vitrieval.index.query import MAX_AQE_ALPHA, MAX_AQE_NEIGHBOURS
from vitrieval.index.recommend import DEFAULT_STRATEGY, MAX_EXAMPLES, STRATEGIES
from vitrieval.index.rerank import DEFAULT_AQE_ALPHA, DEFAULT_AQE_NEIGHBOURS, SEARCH_METHODS
from vitrieval.index.store import StoreError
from vitrieval.index.store.filters import MAX_KEY_LENGTH as MAX_FILTER_KEY_LENGTH
from vitrieval.index.store.filters import (
    Filter,
    FilterError,
    find_outside_int64,
    int64_message,
    parse_filter,
)
from vitrieval.index.store.request import (
    DEFAULT_OVERSAMPLE,
    MAX_DEPTH,
    MAX_OVERSAMPLE,
    MAX_SCROLL_LIMIT,
    SCROLL_LIMIT,
    SHAPING,
)

from .text import (
    MAX_KEY_LENGTH,
    MAX_LABEL_LENGTH,
    checked_key,
    checked_label,
    checked_lookup_key,
    find_unencodable,
)

MAX_K = 1000
Score = Annotated[float, Field(ge=-1, le=1, allow_inf_nan=False)]
"""A score threshold: a cosine, from -1 to 1."""
MAX_VECTOR_LENGTH = 4096
MAX_METADATA_BYTES = 64 * 1024
MAX_METADATA_DEPTH = 16
MAX_QUERY_IMAGES = 16
"""Images one search may fuse into one query (each is decoded and embedded; together
they stay within the request's body limit)."""
MAX_EVALUATE_KS = 16
MAX_EVALUATE_QUERIES = 10_000
# no control characters, 1-512 characters (the schema's half of `text.checked_key`)
KEY_PATTERN = rf"^[^\x00-\x1f\x7f-\x9f]{{1,{MAX_KEY_LENGTH}}}$"

ItemKey = Annotated[str, Field(pattern=KEY_PATTERN), AfterValidator(checked_key)]
"""A key to store: text without control characters, not ending in a sub-route, with no
empty, '.' or '..' segment (index.store.validation.key_problem: clients rewrite such URLs)."""
LookupKey = Annotated[str, AfterValidator(checked_lookup_key)]
Label = Annotated[str, Field(max_length=MAX_LABEL_LENGTH), AfterValidator(checked_label)]


def _parsed_filter(value: dict[str, Any]) -> Filter:
    """A metadata filter (JSON, checked against the language of index/store/filters.py)
    parsed here, once: the typed `Filter` is what travels to the store and to every
    shard. The schema still shows the JSON object (the annotation's type)."""
    try:
        return parse_filter(value)
    except FilterError as exc:
        raise ValueError(str(exc)) from None


FILTER_DESCRIPTION = (
    "only items whose metadata satisfy this filter: "
    '{"must": [...], "should": [...], "must_not": [...]}, each condition '
    '{"key": "colour", "match": "red"}, {"key": "colour", "match": {"any": ["red", "blue"]}} '
    'or {"key": "price", "range": {"gte": 10, "lt": 20}} (the key "label" is the label)'
)
FILTER_EXAMPLE = {"must": [{"key": "label", "match": {"any": ["1", "7"]}}]}
MetadataFilter = Annotated[
    dict[str, Any],
    AfterValidator(_parsed_filter),
    Field(description=FILTER_DESCRIPTION, examples=[FILTER_EXAMPLE]),
]


RerankMethod = Literal[SEARCH_METHODS]  # type: ignore[valid-type]
RecommendStrategy = Literal[STRATEGIES]  # type: ignore[valid-type]


class FormField(Enum):
    """How a request model's field travels in a multipart or urlencoded form, marked on
    the field (`Annotated[..., FormField.JSON_TEXT]`); an unmarked field is one text
    field, validated as pydantic validates strings. `vitrieval.service.inputs` reads forms and
    documents them (the operations' descriptions) from these marks."""

    JSON_TEXT = "json-text"
    """a JSON value (an object, a list) sent as JSON text, decoded before validation"""
    JSON_ONLY = "json-only"
    """not a form field: a base64 image (a form sends the file part instead) or a list"""


JsonOnly = FormField.JSON_ONLY
JsonText = FormField.JSON_TEXT


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Rerank(Strict):
    """Re-ranking after the first search. `aqe`: alpha query expansion, the query
    replaced by the normalised sum of itself and its top `n` hits' vectors, each
    weighted by its score to the power `alpha`, then searched again. `dba`: rank
    against the index's DBA vectors (each item averaged with its nearest items when the
    index was configured with `vitrieval-index configure --dba`); `n` and `alpha` are
    alpha-QE's only."""

    method: RerankMethod = Field(
        description="aqe: alpha query expansion; dba: the index's DBA vectors"
    )
    n: int = Field(
        DEFAULT_AQE_NEIGHBOURS, ge=1, le=MAX_AQE_NEIGHBOURS, description="hits the query takes in"
    )
    alpha: float = Field(
        DEFAULT_AQE_ALPHA,
        ge=0,
        le=MAX_AQE_ALPHA,
        allow_inf_nan=False,
        description="the hits' weights are their scores to this power (0: plain average)",
    )


class RankedRequest(Strict):
    """What every request answered by a ranking takes (a search, a recommendation):
    how many hits, which items, how they are scored, which page, and grouping."""

    k: int = Field(10, ge=1, le=MAX_K, description="number of hits")
    label: Label | None = Field(None, description="only return items with this label")
    filter: Annotated[MetadataFilter | None, JsonText] = None
    rescore: bool = Field(
        True,
        description="an index that scores from compressed codes (PQ, SQ): rank each "
        "segment's `oversample` x k best candidates again by their exact stored vectors "
        "(false: the codes' scores as they are); Flat, IVF-Flat and HNSW-Flat indexes "
        "score exactly and ignore it",
    )
    oversample: int | None = Field(
        None,
        ge=1,
        le=MAX_OVERSAMPLE,
        description="with `rescore`: candidates each compressed segment re-scores, as a "
        "multiple of k (default: the index's setting, from `vitrieval-index configure "
        f"--oversample`, else {DEFAULT_OVERSAMPLE})",
    )
    offset: int = Field(
        0,
        ge=0,
        le=MAX_DEPTH - 1,
        description="skip this many of the best hits: the answer is ranks offset + 1 to "
        f"offset + k (pages of k; k + offset at most {MAX_DEPTH})",
    )
    score_threshold: float | None = Field(
        None,
        allow_inf_nan=False,
        description="leave out hits scoring below it (the answer may hold fewer than k)",
    )

    group_by: str | None = Field(
        None,
        max_length=MAX_FILTER_KEY_LENGTH,
        description='group the hits by this field ("label", or a metadata path as a filter '
        "names it): the answer's `groups` are the k best groups (by their best hit), "
        "each with its `group_size` best hits; `offset` then counts groups",
    )
    group_size: int | None = Field(
        None,
        ge=1,
        le=MAX_GROUP_SIZE,
        description=f"with `group_by`: hits per group (default {DEFAULT_GROUP_SIZE})",
    )

    def shaping(self) -> dict[str, Any]:
        """The request's re-scoring and paging fields, as `Query` takes them."""
        return {name: getattr(self, name) for name in SHAPING}


class SearchRequest(RankedRequest):
    """One query: exactly one of the image or images (multipart `image`, repeated for
    several, or `image_base64` / `images_base64`), an indexed item's `key`, or a raw
    `vector`."""

    image_base64: Annotated[str | None, JsonOnly] = Field(
        None, description="the image, base64 (JSON only)"
    )
    images_base64: Annotated[list[str] | None, JsonOnly] = Field(
        None,
        min_length=1,
        max_length=MAX_QUERY_IMAGES,
        description="several images, base64, searched as one query (see fusion; JSON only)",
    )
    fusion: Fusion = Field(
        DEFAULT_FUSION,
        description="several images as one query: mean (search the mean of their "
        "embeddings) or max (an item scores its best similarity to any of them)",
    )
    rerank: Annotated[Rerank | None, JsonText] = Field(
        None,
        description="re-rank the hits (alpha-QE, or the index's DBA vectors)",
        examples=[Rerank(method="aqe").model_dump()],
    )
    key: LookupKey | None = Field(None, description="query with this indexed item's vector")
    vector: Annotated[list[float] | None, JsonOnly] = Field(
        None, max_length=MAX_VECTOR_LENGTH, description="query with this vector (JSON only)"
    )
    exclude_self: bool = Field(
        True, description="with `key`: leave the query item itself out of the hits"
    )


class Example(Strict):
    """One example of a recommendation: exactly one of an indexed item's `key` (left
    out of the hits), a `vector` or an image (`image_base64`)."""

    key: LookupKey | None = Field(None, description="an indexed item")
    vector: list[float] | None = Field(None, max_length=MAX_VECTOR_LENGTH)
    image_base64: str | None = Field(None, description="an image, base64")

    @model_validator(mode="after")
    def _one_input(self) -> Example:
        if sum(v is not None for v in (self.key, self.vector, self.image_base64)) != 1:
            raise ValueError("give exactly one of key, vector and image_base64")
        return self


class RecommendRequest(RankedRequest):
    """Items like the `positive` examples and unlike the `negative` ones."""

    positive: Annotated[list[Example], JsonText] = Field(
        min_length=1, max_length=MAX_EXAMPLES, description="examples to be near"
    )
    negative: Annotated[list[Example], JsonText] = Field(
        [], max_length=MAX_EXAMPLES, description="examples to be away from"
    )

    @model_validator(mode="after")
    def _few_examples(self) -> RecommendRequest:
        given = len(self.positive) + len(self.negative)
        if given > MAX_EXAMPLES:  # checked before any image is embedded
            raise ValueError(f"at most {MAX_EXAMPLES} examples in all, got {given}")
        return self

    strategy: RecommendStrategy = Field(
        DEFAULT_STRATEGY,
        description="average_vector: search 2 avg(positive) - avg(negative); best_score: "
        "an item scores its best similarity to a positive, or minus the square of its best "
        "to a negative when that is higher",
    )


class EmbedRequest(Strict):
    """The image to embed (multipart `image` or `image_base64`)."""

    image_base64: Annotated[str | None, JsonOnly] = Field(
        None, description="the image, base64 (JSON only)"
    )


class ItemCreate(Strict):
    """An item to add: its key, optional label and metadata, and either the image
    (multipart `image` or `image_base64`) or a `vector`."""

    key: ItemKey
    label: Label | None = None
    metadata: Annotated[dict[str, Any] | None, JsonText] = Field(
        None,
        description=f"a JSON object, at most {MAX_METADATA_BYTES // 1024} KiB as JSON and "
        f"{MAX_METADATA_DEPTH} levels deep",
    )
    image_base64: Annotated[str | None, JsonOnly] = Field(
        None, description="the image, base64 (JSON only)"
    )
    vector: Annotated[list[float] | None, JsonOnly] = Field(
        None,
        max_length=MAX_VECTOR_LENGTH,
        description="add this vector instead of an image (JSON only)",
    )
    replace: bool = Field(False, description="overwrite an item with the same key")
    on_duplicate: Literal["allow", "reject"] = Field(
        "allow",
        description="reject: refuse (409 `duplicate`, naming the nearest item) an item "
        "whose vector scores at least `duplicate_threshold` against one already indexed",
    )
    duplicate_threshold: Score | None = Field(
        None,
        description="with on_duplicate reject: the score (cosine) from which an item is a "
        "duplicate; left out, the index's calibrated threshold (`vitrieval-index "
        "calibrate`; 422 when it has none). docs/duplicates.md",
    )

    @field_validator("metadata")
    @classmethod
    def _storable(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        """Metadata is returned with every hit, so it must serialise back: finite
        numbers, valid Unicode, bounded depth and size."""
        if value is None:
            return None
        if _depth(value) > MAX_METADATA_DEPTH:
            raise ValueError(f"metadata nests deeper than {MAX_METADATA_DEPTH} levels")
        problem = find_unencodable(value, "metadata")
        if problem:
            raise ValueError(problem)
        place = find_outside_int64(value, "metadata")
        if place is not None:  # the store would refuse it too; named here as a 422
            raise ValueError(int64_message(place))
        try:
            encoded = json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")
        except (ValueError, TypeError, UnicodeEncodeError) as exc:
            raise ValueError(f"metadata is not storable as JSON ({exc})") from None
        if len(encoded) > MAX_METADATA_BYTES:
            raise ValueError(f"metadata is larger than {MAX_METADATA_BYTES} bytes as JSON")
        return value


class LabelledQuery(Strict):
    label: Label
    image_base64: str | None = None
    vector: list[float] | None = Field(None, max_length=MAX_VECTOR_LENGTH)

    @model_validator(mode="after")
    def _one_input(self) -> LabelledQuery:
        if (self.image_base64 is None) == (self.vector is None):
            raise ValueError("give exactly one of image_base64 and vector")
        return self


class ScrollRequest(Strict):
    """One page of the items a filter allows, in ascending key order: pass the answer's
    `next` as `after` for the following page."""

    filter: Annotated[MetadataFilter | None, JsonText] = None
    label: Label | None = Field(None, description="only items with this label")
    limit: int = Field(SCROLL_LIMIT, ge=1, le=MAX_SCROLL_LIMIT, description="items on the page")
    after: LookupKey | None = Field(
        None, description="list the keys after this one (the previous page's `next`)"
    )


class DuplicatesRequest(Strict):
    """A job listing every group of near-duplicates among the items a filter allows
    (docs/duplicates.md): pairs scoring at least the threshold, single linkage."""

    threshold: Score | None = Field(
        None,
        description="the score (cosine) from which two items are duplicates; left out, "
        "the index's calibrated threshold (of `precision`)",
    )
    precision: float | None = Field(
        None, gt=0, lt=1, description="the calibrated level whose threshold to use"
    )
    filter: Annotated[MetadataFilter | None, JsonText] = None
    label: Label | None = Field(None, description="only items with this label")
    keep: str = Field(
        DEFAULT_KEEP, description=f"the item each group keeps: {', '.join(KEEP_RULES)}"
    )

    @model_validator(mode="after")
    def _one_threshold(self) -> DuplicatesRequest:
        if self.threshold is not None and self.precision is not None:
            raise ValueError("give threshold or precision, not both")
        return self

    @field_validator("keep")
    @classmethod
    def _rule(cls, value: str) -> str:
        try:
            return check_keep_rule(value)
        except StoreError as exc:  # pydantic reports ValueErrors as 422s
            raise ValueError(str(exc)) from None


class EvaluateRequest(Strict):
    """leave-one-out: every labelled item of the index queries all the others.
    queries: the uploaded labelled queries are ranked against the labelled items."""

    mode: Literal["leave-one-out", "queries"] = "leave-one-out"
    # JSON text in a form, so that a form can ask for mode `queries` too
    ks: Annotated[list[Annotated[int, Field(ge=1, le=MAX_K)]], JsonText] = Field(
        [1, 2, 4, 8],
        min_length=1,
        max_length=MAX_EVALUATE_KS,
        description="the K of Recall@K",
    )
    queries: Annotated[list[LabelledQuery] | None, JsonText] = Field(
        None, max_length=MAX_EVALUATE_QUERIES, description="mode queries: the queries"
    )
    filter: Annotated[MetadataFilter | None, JsonText] = Field(
        None, description="only the labelled items whose metadata satisfy it take part"
    )

    @model_validator(mode="after")
    def _check(self) -> EvaluateRequest:
        if self.mode == "queries" and not self.queries:
            raise ValueError("mode 'queries' needs a non-empty 'queries' list")
        if self.mode == "leave-one-out" and self.queries:
            raise ValueError("'queries' is only for mode 'queries'")
        return self


def _depth(value: Any, level: int = 1) -> int:
    """Nesting depth of a JSON value (iterative bound: stops counting past the limit)."""
    if level > MAX_METADATA_DEPTH:
        return level
    if isinstance(value, dict):
        return max((_depth(v, level + 1) for v in value.values()), default=level)
    if isinstance(value, list):
        return max((_depth(v, level + 1) for v in value), default=level)
    return level - 1


MAX_FILE_NAME = 255
MAX_URL_LENGTH = 2048
SNAPSHOT_SOURCE = rf"^({SNAPSHOT_ID.pattern}|s3://[^\s]+)$"
"""A snapshot id, or an s3:// URL (what the server fetches is object storage only)."""
MAX_FACTORY_LENGTH = 200
MAX_FILTER_FIELDS = 64
MAX_METRIC_NAME = 64
CollectionName = Annotated[str, Field(pattern=NAME_REGEX, description="a collection or alias name")]


class CollectionCreate(Strict):
    """A new collection: empty, embedded by a model file under the data folder's
    models/ (`model`), or holding a snapshot's items (`snapshot`, its id)."""

    model: str | None = Field(
        None, max_length=MAX_FILE_NAME, description="a model file under the data folder's models/"
    )
    snapshot: str | None = Field(
        None,
        pattern=SNAPSHOT_SOURCE,
        max_length=MAX_URL_LENGTH,
        description="a snapshot to restore: its id (POST .../snapshots), or the URL of a "
        "snapshot file in object storage (s3://bucket/key.tar; the server's credentials)",
    )
    factory: str = Field(
        DEFAULT_FACTORY,
        max_length=MAX_FACTORY_LENGTH,
        description="with model: the FAISS index_factory string",
    )
    filter_fields: Annotated[
        list[Annotated[str, Field(max_length=MAX_FILTER_KEY_LENGTH)]] | None, JsonText
    ] = Field(None, max_length=64, description="with model: the metadata fields filters may use")

    @model_validator(mode="after")
    def _one_source(self) -> CollectionCreate:
        if (self.model is None) == (self.snapshot is None):
            raise ValueError("give exactly one of: model, snapshot")
        if self.snapshot is not None and (
            self.factory != DEFAULT_FACTORY or self.filter_fields is not None
        ):
            raise ValueError("factory and filter_fields are the snapshot's own: give them "
                             "with model only")  # fmt: skip
        return self


class AliasSet(Strict):
    """Point an alias at a collection."""

    collection: CollectionName


class PromoteRequest(Strict):
    """Evaluate an alias's collection and a candidate with one evaluation request;
    switch the alias when the candidate's `metric` is at least the current one's plus
    `min_gain`."""

    collection: CollectionName = Field(description="the candidate collection")
    evaluation: Annotated[EvaluateRequest, JsonText] = Field(
        default_factory=EvaluateRequest, description="the same body as POST /v1/evaluate"
    )
    metric: str = Field(
        DEFAULT_METRIC,
        max_length=MAX_METRIC_NAME,
        description="a key of the evaluation: map, recall@1, ...",
    )
    min_gain: float = Field(0.0, allow_inf_nan=False, ge=-1, le=1)

    @model_validator(mode="after")
    def _known_metric(self) -> PromoteRequest:
        # said before the two evaluations run, not after them
        known = metric_names(self.evaluation.ks)
        if self.metric not in known:
            raise ValueError(
                f"no metric {self.metric!r} in the evaluation; one of {', '.join(known)}"
            )
        return self


class ReembedRequest(Strict):
    """Build the new collection `collection` of this collection's items, each embedded
    again from its image by the model file `model` (under the data folder's models/)."""

    model: str = Field(max_length=MAX_FILE_NAME, description="a model file under models/")
    collection: CollectionName = Field(description="the new collection's name")
