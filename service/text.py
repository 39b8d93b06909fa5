"""What text the API accepts: the rules every string from a client passes at the edge.

JSON can carry text that no file or database can hold: a lone UTF-16 surrogate
(`"\\ud800"` decodes to a Python str that cannot be encoded as UTF-8) and NUL. Such a
string reaching SQLite or a JSON response raises deep inside the server; here it is a
422 that names the field instead. Keys and labels are identifiers shown in lists,
logs and URLs, so they also refuse control characters (C0, DEL and C1); free text in
metadata keeps tabs and newlines.

The rules are applied twice, on purpose: `find_unencodable` walks a whole parsed JSON
body (every field, known or not, dict keys included), and the request models'
validators (`vitrieval.service.schemas`) check each field again whatever the body's encoding
was (JSON, multipart, urlencoded, path and query parameters).
"""

from __future__ import annotations

import re
from typing import Any

from vitrieval.index.store.validation import key_problem

MAX_KEY_LENGTH = 512
MAX_LABEL_LENGTH = 512
RESERVED_KEY_SUFFIXES: tuple[str, ...] = ("/thumbnail", "/duplicates")
"""Keys may hold slashes (`GET /v1/items/{key}` takes the rest of the path), so a key
ending in a sub-route's name would be unreachable: such keys are refused."""

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def text_problem(value: str, *, controls: bool = False) -> str | None:
    """Why `value` cannot be stored or echoed (None when it can).

    `controls=True` also refuses control characters (for keys and labels)."""
    surrogate = _SURROGATE.search(value)
    if surrogate:
        return (
            f"contains a lone UTF-16 surrogate (U+{ord(surrogate.group()):04X}) at "
            f"position {surrogate.start()}: not valid Unicode text"
        )
    if "\x00" in value:
        return f"contains a NUL character at position {value.index(chr(0))}"
    if controls:
        control = _CONTROL.search(value)
        if control:
            return (
                f"contains the control character U+{ord(control.group()):04X} at "
                f"position {control.start()}"
            )
    return None


def checked_key(value: str) -> str:
    """An item key as it may be stored (pydantic validator: ValueError says why)."""
    _raise_on(text_problem(value, controls=True))
    if not 1 <= len(value) <= MAX_KEY_LENGTH:
        raise ValueError(f"a key has 1 to {MAX_KEY_LENGTH} characters, not {len(value)}")
    for suffix in RESERVED_KEY_SUFFIXES:
        if value.endswith(suffix):
            raise ValueError(f"a key cannot end in {suffix!r} (that path is a sub-route)")
    _raise_on(key_problem(value))  # the index's rule for new keys (dot or empty segments)
    return value


def checked_lookup_key(value: str) -> str:
    """A key to look up: valid text; unknown keys are a 404, not a 422."""
    _raise_on(text_problem(value, controls=True))
    return value


def checked_label(value: str) -> str:
    _raise_on(text_problem(value, controls=True))
    if len(value) > MAX_LABEL_LENGTH:
        raise ValueError(f"a label has at most {MAX_LABEL_LENGTH} characters")
    return value


def find_unencodable(value: Any, path: str = "body") -> str | None:
    """The first string in a parsed JSON value (dict keys included) that cannot be
    stored, as "<where>: <why>"; None when every string is fine. Iterative, so a
    deeply nested body cannot exhaust the stack here."""
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        node, where = stack.pop()
        if isinstance(node, str):
            problem = text_problem(node)
            if problem:
                return f"{where}: {problem}"
        elif isinstance(node, dict):
            for key, child in node.items():
                problem = text_problem(key)
                if problem:
                    return f"{where}: a field name {problem}"
                stack.append((child, f"{where}.{key}"))
        elif isinstance(node, list):
            stack.extend((child, f"{where}[{i}]") for i, child in enumerate(node))
    return None


def _raise_on(problem: str | None) -> None:
    if problem:
        raise ValueError(problem)
