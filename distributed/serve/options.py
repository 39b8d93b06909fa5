"""The Ray Serve application's names, defaults and limits, defined once (no Ray import:
the CLI reads them for its help text)."""

from __future__ import annotations

APP_NAME = "vitrieval"
INGRESS = "ingress"
EMBEDDER = "embedder"

DEFAULT_EMBED_REPLICAS = 1
DEFAULT_SHARD_REPLICAS = 1
DEFAULT_INGRESS_REPLICAS = 1
"""Replicas of the HTTP ingress. Above 1 only read-only: with mutations on, the one
ingress numbers new items across the shards."""

STATS_POLL_S = 5.0
"""How often the ingress refreshes the index gauges of /metrics (items, damaged
segments) from the shards."""

REMOTE_TIMEOUT_S = 30.0
"""The longest the ingress waits for one call to a deployment (a replica that died
mid-call is noticed at once; one that hangs, after this): then a 503."""

PROXY_TIMEOUT_MARGIN_S = 5.0
"""Ray Serve's proxy gives up on a request `request_timeout_s` + this after it arrived,
so the service's own timeout answer (a JSON 503 from the ingress) comes first."""

SHARD_MAX_ONGOING = 64
"""Requests one shard replica runs at once (searches run in its worker threads)."""

EMBED_QUEUE_FACTOR = 4
"""A replica's queue beyond its running requests, in model batches: more waiting
requests are refused (a JSON 503 from the ingress) rather than queued without bound."""

INGRESS_HEADROOM = 2
"""An ingress replica takes up to this many times `max_concurrency` requests from
Serve's proxy, so the app's own edge (service.middleware) refuses the excess with its
JSON 503 and probes still get in; Serve's plain-text 503 comes only past that and
`max_concurrency` more waiting in Serve's queue."""
