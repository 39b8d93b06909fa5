"""Journal rows that cannot be applied, and setting them aside.

A journalled mutation was checked before it was written, so every row replays; but
a row written by an older version may hold what this version refuses (metadata with
an integer outside int64, which the field index cannot store). Such a row stops the
open with one line naming it (`unappliable_row`), never a traceback, and
`vitrieval-index verify --repair INDEX` moves it out of the journal into
`REJECTED_FILE` beside it (one JSON object a line: the row as written and the
reason), keeping every other row; what was set aside can be re-added by hand.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

from ._journal import Journal, JournalEntry, JournalOwner
from .errors import StoreError
from .validation import checked_items

REJECTED_FILE = "journal.rejected.jsonl"
REPAIR_COMMAND = "vitrieval-index verify --repair"


class UnappliableRowError(StoreError):
    """A journal row this version refuses to apply (see the module docstring)."""


def row_problem(entry: JournalEntry, dim: int) -> str | None:
    """Why `entry` cannot be applied (the add's own checks), or None."""
    if entry.op != "add":
        return None
    try:
        checked_items(
            [entry.key], entry.vector[None, :], dim, [entry.label], [entry.path], [entry.metadata]
        )
    except StoreError as exc:
        return str(exc)
    return None


def unappliable_row(directory: Path, entry: JournalEntry, problem: str) -> UnappliableRowError:
    """The one-line refusal of an open that met `entry`."""
    return UnappliableRowError(
        f"{directory}: journal row {entry.seq} ({entry.op} of key {entry.key!r}) cannot be "
        f"applied: {problem}; nothing was opened. `{REPAIR_COMMAND} {directory}` sets such "
        f"rows aside in {REJECTED_FILE} and keeps every other row"
    )


def repair_journal(directory: Path, dim: int) -> int:
    """Move the rows of `directory`'s journal that cannot be applied to REJECTED_FILE
    (appended and fsynced before they leave the journal); returns how many. Takes the
    folder's writer lock, so it refuses while a server owns the index."""
    owner = JournalOwner(directory)
    try:
        journal = Journal.open_existing(directory, dim)
        if journal is None:
            return 0
        try:
            rejected = [
                (entry, problem)
                for entry in journal.entries()
                if (problem := row_problem(entry, dim)) is not None
            ]
            if rejected:
                _append_rejected(directory / REJECTED_FILE, rejected)
                journal.delete([entry.seq for entry, _ in rejected])
            return len(rejected)
        finally:
            journal.close()
    finally:
        owner.release()


def _append_rejected(path: Path, rejected: list[tuple[JournalEntry, str]]) -> None:
    lines = [
        json.dumps(
            {
                "seq": entry.seq,
                "op": entry.op,
                "key": entry.key,
                "label": entry.label,
                "path": entry.path,
                "metadata": entry.metadata,
                "vector_f32le_base64": (
                    None
                    if entry.vector is None
                    else base64.b64encode(entry.vector.astype("<f4").tobytes()).decode()
                ),
                "reason": problem,
            }
        )
        for entry, problem in rejected
    ]
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
