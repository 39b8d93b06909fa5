"""Service configuration: one pydantic-settings class, environment prefix `VITRIEVAL_`.

Every field can be set as an environment variable (`VITRIEVAL_API_KEY`,
`VITRIEVAL_MAX_BATCH_SIZE`, ...); `vitrieval-serve` flags override the environment.
The app reads its settings through `get_settings()`, cached, so a process builds them
once.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from vitrieval.index.runtime.images import DEFAULT_MAX_PIXELS

from .schemas import MAX_K

MIN_KEY_LENGTH = 12


def api_key_problem(key: str) -> str | None:
    """Why an API key could never be sent in the X-API-Key header and match (None: it
    can). Clients strip a header value's leading and trailing whitespace (a key read
    from a file keeps its newline) and send ASCII: such a key would start a server on
    which every mutation is a 401. The key itself is never quoted (it is a secret)."""
    if len(key.strip()) < MIN_KEY_LENGTH:
        return f"must be at least {MIN_KEY_LENGTH} characters"
    if key != key.strip():
        return "starts or ends with whitespace (a newline left by reading it from a file?)"
    odd = next((i for i, char in enumerate(key) if not " " <= char <= "~"), None)
    if odd is not None:
        return (
            f"has a character an HTTP header cannot carry (character {odd + 1}, not printable "
            "ASCII); use letters, digits and punctuation"
        )
    return None


class Settings(BaseSettings):
    """What a deployment can tune; defaults suit one CPU host."""

    # An empty variable counts as unset: compose files and manifests template optional
    # settings as `VITRIEVAL_API_KEY=${VITRIEVAL_API_KEY:-}` (docs/deploy.md).
    model_config = SettingsConfigDict(
        env_prefix="VITRIEVAL_", extra="ignore", env_ignore_empty=True
    )

    model: Path | None = Field(None, description="exported model (.onnx)")
    index: Path | None = Field(None, description="index directory built with that model")
    data: Path | None = Field(
        None,
        description="a data folder: serve every collection under it (docs/collections.md) "
        "instead of one --model and --index",
    )
    default_collection: str | None = Field(
        None,
        description="with --data: the collection (or alias) today's /v1/... routes address "
        "(default: the alias 'default')",
    )
    keys_file: Path | None = Field(
        None, description="keys per collection, JSON (docs/collections.md, 'Keys')"
    )
    collection_idle_s: float = Field(
        600.0, gt=0, description="with --data: a collection unused this long is closed"
    )
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    workers: int = Field(1, ge=1, description="server processes (read-only service only)")

    # auth
    api_key: SecretStr | None = Field(
        None, description="key for mutations (POST/DELETE /v1/items), header X-API-Key"
    )
    read_api_key: SecretStr | None = Field(
        None, description="when set, every read route needs this key (or the mutation key)"
    )
    read_only: bool = Field(
        False,
        description="turn the mutation routes off; otherwise they are on and the server "
        "refuses to start without an API key",
    )

    # inference
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N | tensorrt")
    batching: bool | None = Field(
        None,
        description="dynamic batching of concurrent queries (default: on when the model "
        "runs on a GPU, off on CPUs, where one call per core side by side serves more)",
    )
    max_batch_size: int = Field(32, ge=1, le=1024)
    unbatched_concurrency: int | None = Field(
        None,
        ge=1,
        le=64,
        description="with batching off: model calls at once (default: one per core on "
        "CPUs, each on one ONNX Runtime thread; 1 on a GPU)",
    )
    max_batch_wait_ms: float = Field(
        2.0, ge=0, le=1000, description="how long the first query of a batch waits for more"
    )
    intra_op_threads: int | None = Field(None, ge=1, description="ONNX Runtime threads")
    ort_spin_wait: bool = Field(
        False,
        description="let ONNX Runtime's threads busy-wait between calls: a little faster on "
        "a dedicated machine, about a third more CPU per request when cores are shared",
    )
    decode_threads: int = Field(4, ge=1, description="threads decoding uploaded images")

    # limits
    max_body_bytes: int = Field(20 * 2**20, ge=1024, description="larger requests get 413")
    max_pixels: int = Field(
        DEFAULT_MAX_PIXELS, ge=1, description="larger images (width x height) get 413"
    )
    decode_memory_bytes: int = Field(
        512 * 2**20,
        ge=2**20,
        description="memory all image decodes in flight may hold together; an image that "
        "needs more alone gets 413, others wait for their share",
    )
    max_k: int = Field(MAX_K, ge=1, le=MAX_K, description="largest k a search may ask for")
    max_concurrency: int = Field(
        512, ge=1, description="requests in flight; more get 503 at once (probes exempt)"
    )
    upload_slots: int = Field(
        32, ge=1, description="requests whose body is still arriving; more get 503 at once"
    )
    max_body_memory_bytes: int = Field(
        256 * 2**20,
        ge=1024,
        description="request bodies held in memory at once (their Content-Length summed); "
        "a request that would pass it gets 503 at once",
    )
    body_timeout_s: float = Field(
        5.0, gt=0, description="a body that has not fully arrived after this gets 408"
    )
    request_timeout_s: float = Field(30.0, gt=0, description="slower requests get 503")
    max_evaluate_items: int = Field(
        20_000, ge=2, description="largest set /v1/evaluate ranks exactly (O(n^2))"
    )

    # durability
    checkpoint_every: int = Field(
        1000, ge=1, description="journalled mutations that trigger a full index save"
    )
    checkpoint_interval_s: float = Field(
        30.0, gt=0, description="a pending journal is saved at least this often"
    )
    merge_threads: int | None = Field(
        None,
        ge=1,
        description="FAISS threads of a background merge (default: half the cores, at "
        "least 1); merges also run at a lower CPU priority, so searches keep their cores",
    )
    scrub_interval_s: float = Field(
        86_400.0,
        ge=0,
        description="verify every sealed segment's checksums this often (0: never); a "
        "damaged segment is taken out of service and reported by /readyz",
    )
    scrub_delay_s: float = Field(60.0, ge=0, description="first scrub this long after start")
    scrub_bytes_per_s: float = Field(
        64 * 2**20, gt=0, description="how fast the scrub reads (it must not starve searches)"
    )
    store_uploads: bool = Field(
        True, description="keep images added through /v1/items under INDEX/uploads (thumbnails)"
    )

    @field_validator("api_key", "read_api_key")
    @classmethod
    def _usable_key(cls, key: SecretStr | None, info: ValidationInfo) -> SecretStr | None:
        if key is None:
            return None
        problem = api_key_problem(key.get_secret_value())
        if problem:
            raise ValueError(f"VITRIEVAL_{str(info.field_name).upper()} {problem}")
        return key

    @field_validator("model", "index", "data", "keys_file")
    @classmethod
    def _absolute(cls, path: Path | None) -> Path | None:
        # absolute from the start: the messages that name the index's files are then
        # recognisably server paths, which the service keeps out of its answers
        return None if path is None else path.absolute()

    @model_validator(mode="after")
    def _check_limits(self) -> Settings:
        if self.max_body_memory_bytes < self.max_body_bytes:
            raise ValueError(
                "max_body_memory_bytes must be at least max_body_bytes, or no request of "
                "the largest size could ever be accepted"
            )
        return self

    @model_validator(mode="after")
    def _check_sources(self) -> Settings:
        if self.data is not None and (self.model is not None or self.index is not None):
            raise ValueError(
                "serve either a data folder (--data) or one model and index (--model, "
                "--index), not both"
            )
        if self.default_collection is not None and self.data is None:
            raise ValueError("--default names a collection of a data folder: give --data too")
        return self

    @model_validator(mode="after")
    def _check_mutations(self) -> Settings:
        if not self.read_only and self.api_key is None:
            raise ValueError(
                "mutations (POST/DELETE /v1/items) are enabled but no API key is configured: "
                "set VITRIEVAL_API_KEY, or serve read-only with --read-only "
                "(VITRIEVAL_READ_ONLY=1)"
            )
        if not self.read_only and self.workers > 1:
            raise ValueError(
                "mutations need a single worker (one process owns the index): use "
                "--workers 1, or serve read-only with --read-only"
            )
        return self


@lru_cache
def get_settings() -> Settings:
    """The process's settings, from the environment (cached)."""
    return Settings()
