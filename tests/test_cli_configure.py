"""`vitrieval-index configure` (and the same options on build): filter fields and DBA."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from index_cli_helpers import run
from store_helpers import unit_vectors

from vitrieval.index.store import IndexStore


def small_index(directory: Path) -> np.ndarray:
    x = unit_vectors(np.random.default_rng(0), 120, 8)
    with IndexStore.create(directory, dim=8) as store:
        for part in (slice(0, 60), slice(60, 120)):
            keys = [str(i) for i in range(120)][part]
            metadata = [{"colour": ("red", "blue")[i % 2], "price": i} for i in range(120)][part]
            store.add(keys, x[part], metadata=metadata)
            store.save()
    return x


def test_configure_sets_fields_and_dba_and_rewrites_the_index(tmp_path: Path, capsys) -> None:
    x = small_index(tmp_path / "idx")
    code, out, err = run(
        capsys, "configure", tmp_path / "idx", "--filter-fields", "colour", "--dba"
    )
    assert code == 0, err
    assert out.strip() == (
        f"{tmp_path / 'idx'}: filter fields colour; DBA 2 neighbours, alpha 3; rewrote 2 segment(s)"
    )
    manifest = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    assert manifest["filter_fields"] == ["colour"]
    dba = manifest["dba"]  # the settings and the derived index, beside the segments
    assert (dba["neighbours"], dba["alpha"], dba["count"]) == (2, 3.0, len(x))
    with IndexStore.open(tmp_path / "idx") as store:
        (segment,) = store._state.sealed
        assert store.info()["dba"]["live_items_with_dba"] == len(x)
        paths = {p for (p,) in segment._db.execute("SELECT DISTINCT path FROM fields")}
        assert paths == {"colour"}
        hits = store.search(
            x[:1], 3, augmented=True, filter={"must": [{"key": "price", "range": {"lt": 10}}]}
        )
        assert [h.key for h in hits[0]][:1] == ["0"]
    code, out, _ = run(capsys, "configure", tmp_path / "idx", "--filter-fields", "all", "--no-dba")
    assert code == 0 and out.strip().endswith("filter fields all; DBA off; rewrote 1 segment(s)")
    assert json.loads((tmp_path / "idx" / "manifest.json").read_text())["dba"] is None


def test_configure_refuses_bad_settings_in_one_line(tmp_path: Path, capsys) -> None:
    small_index(tmp_path / "idx")
    for args, message in [
        ((), "give --filter-fields, --dba N, --no-dba or --oversample N"),
        (("--dba", "0"), "DBA neighbours must be between 1 and 64"),
        (("--filter-fields", "a..b"), "is not a dot path"),
    ]:
        code, _, err = run(capsys, "configure", tmp_path / "idx", *args)
        assert code == 2 and err.count("\n") == 1 and message in err, err
    code, _, err = run(capsys, "configure", tmp_path / "missing", "--dba")
    assert code == 2 and "Traceback" not in err
