"""JSON text read from files and options: `parse_json`, json.loads whose every failure
is a ValueError.

json.loads raises RecursionError, not ValueError, on input nested past about 1,000
levels; each reader of JSON (manifests, metadata, configs, state files) catches
ValueError for malformed input and names the file, so this makes the one case
json leaves out one of them.
"""

from __future__ import annotations

import json
from typing import Any


def parse_json(text: str | bytes) -> Any:
    """`json.loads(text)`; ValueError for any malformed input, nesting too deep included."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
