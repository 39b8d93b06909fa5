"""Shared by the in-process service tests: the write key, and the app over an index."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from vitrieval.service.app import create_app
from vitrieval.service.settings import Settings

KEY = "test-write-key"
AUTH = {"X-API-Key": KEY}


def make_client(model: Path, index: Path, **settings) -> TestClient:
    """The real app (its lifespan runs when the client is entered), writes under KEY."""
    settings.setdefault("api_key", KEY)
    return TestClient(create_app(Settings(model=model, index=index, **settings)))


ODD = {"must": [{"key": "label", "match": {"any": ["1", "3", "5", "7", "9"]}}]}
"""A filter allowing the odd digits of the gallery."""
