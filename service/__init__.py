"""vitrieval search service (HTTP API over an index and an exported model)."""
