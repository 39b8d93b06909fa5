"""`vitrieval-index verify | upgrade | merge | info` on segmented indexes; format 1
refused, then upgraded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from index_cli_helpers import run  # tests/index_cli_helpers.py
from store_helpers import exact_vectors
from test_segments import saved_in_parts, write_format_1

from vitrieval.index.store import IndexStore


def test_verify_passes_then_names_a_damaged_file(tmp_path: Path, capsys) -> None:
    x = exact_vectors(np.random.default_rng(0), 300)
    saved_in_parts(tmp_path / "idx", x, 2).close()
    code, out, err = run(capsys, "verify", tmp_path / "idx")
    assert code == 0 and err == ""
    assert out.strip() == (
        f"{tmp_path / 'idx'}: 6 files verified "
        f"({sum(p.stat().st_size for p in (tmp_path / 'idx').glob('seg.*')):,} bytes, "
        "2 segments, 300 items): every checksum holds"
    )
    segment = tmp_path / "idx" / "seg.2.items.sqlite"
    data = bytearray(segment.read_bytes())
    data[-20] ^= 0x01
    segment.write_bytes(bytes(data))
    code, out, err = run(capsys, "info", tmp_path / "idx")  # cheap checks: opens
    assert code == 0
    code, out, err = run(capsys, "verify", tmp_path / "idx")
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "checksum mismatch" in lines[0] and "seg.2.items.sqlite" in lines[0]


def test_verify_names_a_file_changed_after_its_checksum_was_read(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    # the file changes between the checksums and the scan for legacy items, which takes
    # its segment out of service: verify says so, not "every checksum holds"
    saved_in_parts(tmp_path / "idx", exact_vectors(np.random.default_rng(2), 300), 2).close()
    scan = IndexStore.legacy_items

    def truncated_meanwhile(store: IndexStore) -> list[tuple[str, str]]:
        with (tmp_path / "idx" / "seg.1.items.sqlite").open("r+b") as fh:
            fh.truncate(4096)
        return scan(store)

    monkeypatch.setattr(IndexStore, "legacy_items", truncated_meanwhile)
    code, out, err = run(capsys, "verify", tmp_path / "idx")
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "segment 1 changed during the check" in lines[0]
    assert "seg.1.items.sqlite changed on disk while in service" in lines[0]


def test_info_lists_the_segments_on_one_line(tmp_path: Path, capsys) -> None:
    x = exact_vectors(np.random.default_rng(1), 200)
    store = saved_in_parts(tmp_path / "idx", x, 2)
    store.remove(["0", "1"])
    store.save()
    store.close()
    _, out, _ = run(capsys, "info", tmp_path / "idx")
    segments = next(line for line in out.splitlines() if line.startswith("segments"))
    assert segments.split(None, 1)[1] == (
        "number=1, rows=100, live=98, deleted=2; number=2, rows=100, live=100, deleted=0"
    )
    assert "{" not in out


def test_upgrade_and_merge_commands(tmp_path: Path, capsys) -> None:
    x = exact_vectors(np.random.default_rng(2), 120)
    write_format_1(tmp_path / "old", x)
    for command in (["remove", tmp_path / "old", "3"], ["info", tmp_path / "old"]):
        code, out, err = run(capsys, *command)
        assert code == 2 and err.strip().splitlines() == [
            f"vitrieval-index {command[0]}: error: {tmp_path / 'old'} is an index of "
            "format 1, which this vitrieval does not open: convert it with "
            f"`vitrieval-index upgrade {tmp_path / 'old'}`"
        ]
    code, out, _ = run(capsys, "upgrade", tmp_path / "old")
    assert code == 0 and out.strip().endswith("converted from format 1 to format 4 (120 items)")
    code, out, _ = run(capsys, "upgrade", tmp_path / "old")
    assert code == 0 and "already in format 4" in out
    code, out, err = run(capsys, "remove", tmp_path / "old", "3")
    assert code == 0
    many = saved_in_parts(tmp_path / "many", x, 3)
    many.close()
    code, out, _ = run(capsys, "merge", tmp_path / "many", "--all")
    assert code == 0 and out.strip().endswith("merged 3 of 3 segments; 1 now")
    assert len(IndexStore.open(tmp_path / "many")) == 120
