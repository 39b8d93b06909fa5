"""Near-duplicate groups (index/duplicates.py): on a catalogue with planted groups of
near copies (and a chain only single linkage joins), the groups equal the connected
components of the brute-force pairs at the threshold, with a filter too and on a
sharded index; the keep rules; `vitrieval-index duplicates` writes JSON and CSV, and a
run killed with SIGKILL resumes to the same groups."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from index_cli_helpers import run
from PIL import Image

from vitrieval.index.duplicates import find_duplicates
from vitrieval.index.shards import open_index
from vitrieval.index.shards.build import build_sharded
from vitrieval.index.store import IndexStore, StoreError

REPO = Path(__file__).resolve().parents[1]
DIM = 64
THRESHOLD = 0.9


def unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


@pytest.fixture(scope="module")
def catalogue() -> dict:
    """1,000 random items, 30 planted groups of 2 to 5 near copies, and a chain a - b - c
    whose ends are not duplicates of each other (24 degrees apart in turn: cos 0.914
    for a - b and b - c, 0.669 for a - c)."""
    rng = np.random.default_rng(70)
    x = [unit(rng.standard_normal((1000, DIM)))]
    for size in rng.integers(2, 6, 30):
        base = rng.standard_normal(DIM)
        x.append(unit(base + 0.12 * rng.standard_normal((size, DIM))))
    e0, e1 = np.eye(DIM)[:2]
    x.append(unit(np.stack([np.cos(a) * e0 + np.sin(a) * e1 for a in np.radians([0, 24, 48])])))
    x = np.concatenate(x)
    order = rng.permutation(len(x))  # keys not in planting order
    keys = [f"item/{i:05d}" for i in order]
    return {"x": x, "keys": keys, "shop": [f"s{i % 2}" for i in range(len(x))]}


def brute_force_groups(x, keys, threshold, allowed=None) -> list[list[str]]:
    """Connected components of the pairs scoring >= threshold (float64)."""
    rows = np.arange(len(x)) if allowed is None else np.flatnonzero(allowed)
    scores = x[rows].astype(np.float64) @ x[rows].astype(np.float64).T
    parent = list(range(len(rows)))

    def root(i):
        while parent[i] != i:
            i = parent[i]
        return i

    for i, j in zip(*np.nonzero(np.triu(scores >= threshold, 1)), strict=True):
        parent[max(root(i), root(j))] = min(root(i), root(j))
    groups: dict[int, list[str]] = {}
    for i in range(len(rows)):
        groups.setdefault(root(i), []).append(keys[rows[i]])
    return sorted(sorted(g) for g in groups.values() if len(g) > 1)


@pytest.fixture(scope="module")
def store(catalogue, tmp_path_factory):
    path = tmp_path_factory.mktemp("dups") / "index"
    s = IndexStore.create(path, dim=DIM, factory="Flat")
    s.add(catalogue["keys"], catalogue["x"], metadata=[{"shop": v} for v in catalogue["shop"]])
    s.save()
    yield s
    s.close()


def test_the_groups_are_the_brute_force_components(store, catalogue) -> None:
    groups = find_duplicates(store, THRESHOLD, batch=97)
    want = brute_force_groups(catalogue["x"], catalogue["keys"], THRESHOLD)
    assert sorted(g.keys for g in groups) == want
    assert len(want) == 31  # the 30 planted groups and the chain, nothing random
    chain = [g for g in groups if len(g.keys) == 3 and len(g.pairs) == 2]
    assert any(max(s for *_, s in g.pairs) < 0.92 for g in chain)  # joined by single linkage
    for group in groups:
        assert all(score >= THRESHOLD for *_, score in group.pairs)
        assert group.keep in group.keys
    # largest groups first
    assert [len(g.keys) for g in groups] == sorted((len(g.keys) for g in groups), reverse=True)


def test_a_filter_narrows_the_items_grouped(store, catalogue) -> None:
    odd = {"must": [{"key": "shop", "match": "s1"}]}
    groups = find_duplicates(store, THRESHOLD, filter=odd)
    allowed = np.asarray(catalogue["shop"]) == "s1"
    want = brute_force_groups(catalogue["x"], catalogue["keys"], THRESHOLD, allowed)
    assert sorted(g.keys for g in groups) == want


def test_a_sharded_index_groups_as_one_store(store, catalogue, tmp_path) -> None:
    from test_shards import in_process, write_folder

    emb = write_folder(tmp_path / "emb", catalogue["x"], catalogue["keys"])
    build_sharded(emb, tmp_path / "sharded", "", "Flat", 3, 500, in_process)
    sharded = open_index(tmp_path / "sharded")
    got = find_duplicates(sharded, THRESHOLD)
    assert [(g.keys, g.pairs) for g in got] == [
        (g.keys, g.pairs) for g in find_duplicates(store, THRESHOLD)
    ]


def test_the_keep_rules(tmp_path) -> None:
    x = unit(np.ones((3, DIM)) + 0.01 * np.random.default_rng(1).standard_normal((3, DIM)))
    paths = []
    for i, side in enumerate((40, 80, 60)):
        path = tmp_path / f"{i}.png"
        Image.new("RGB", (side, side), (i * 50, 0, 0)).save(path)
        os.utime(path, ns=(10**18 + i, 10**18 + (3 - i) * 10**9))  # the last is the oldest
        paths.append(str(path))
    s = IndexStore.create(tmp_path / "index", dim=DIM, factory="Flat")
    s.add(["a", "b", "c"], x, paths=paths, metadata=[{"q": {"n": 1}}, {"q": {"n": 5}}, {}])
    (group,) = find_duplicates(s, 0.99, keep="largest")
    assert group.keys == ["a", "b", "c"] and group.keep == "b"  # 80 x 80
    assert find_duplicates(s, 0.99, keep="oldest")[0].keep == "c"
    assert find_duplicates(s, 0.99, keep="metadata:q.n")[0].keep == "b"
    assert find_duplicates(s, 0.99, keep="metadata:none")[0].keep == "a"  # none has it: key
    with pytest.raises(StoreError, match="keep must be one of"):
        find_duplicates(s, 0.99, keep="newest")


def test_the_command_writes_json_and_csv(store, catalogue, capsys, tmp_path) -> None:
    index = Path(store.directory)
    code, out, _ = run(capsys, "duplicates", index, "--threshold", THRESHOLD, "--out",
                       tmp_path / "groups.json")  # fmt: skip
    assert code == 0 and "31 groups" in out
    groups = json.loads((tmp_path / "groups.json").read_text())
    want = brute_force_groups(catalogue["x"], catalogue["keys"], THRESHOLD)
    assert sorted(g["keys"] for g in groups) == want
    assert not (tmp_path / "groups.json.partial").exists()
    code, _, _ = run(capsys, "duplicates", index, "--threshold", THRESHOLD, "--out",
                     tmp_path / "groups.csv", "--keep", "metadata:shop")  # fmt: skip
    rows = list(csv.DictReader((tmp_path / "groups.csv").open()))
    assert code == 0 and len(rows) == sum(len(g) for g in want)
    assert sum(row["keep"] == "True" for row in rows) == len(want)
    for argv, message in (
        (["--out", tmp_path / "g.txt"], "--out must end in .json or .csv"),
        (["--out", tmp_path / "g.json", "--keep", "best"], "keep must be one of"),
        (["--out", tmp_path / "g.json", "--threshold", "nan"], "score_threshold must be"),
        (["--out", tmp_path / "g.json", "--threshold", "1.5"], "must be a cosine, from -1 to 1"),
    ):
        code, _, err = run(capsys, "duplicates", index, "--threshold", THRESHOLD, *argv)
        assert code == 2 and err.count("\n") == 1 and message in err, err
    for precision in ("1.5", "0"):
        code, _, err = run(capsys, "duplicates", index, "--precision", precision, "--out",
                           tmp_path / "g.json")  # fmt: skip
        assert code == 2 and "precision must be a number between 0 and 1" in err, err


def test_a_killed_run_resumes_to_the_same_groups(store, catalogue, tmp_path) -> None:
    index = Path(store.directory)
    out = tmp_path / "groups.json"
    state = tmp_path / "groups.json.partial"
    argv = [sys.executable, "-m", "vitrieval.index.cli", "duplicates", str(index),
            "--threshold", str(THRESHOLD), "--out", str(out), "--batch", "5"]  # fmt: skip
    process = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # killed once a few batches are recorded
        if state.exists() and state.read_text().count("\n") >= 6:
            break
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not out.exists() and state.exists()
    recorded = state.read_text().count("\n") - 1
    with state.open("a") as fh:
        fh.write('{"after": "item/9')  # a torn line, as a kill during a write leaves
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    resumed = json.loads(out.read_text())
    assert 0 < recorded < len(catalogue["keys"]) / 5
    want = [g.as_json() for g in find_duplicates(store, THRESHOLD)]
    assert resumed == want and not state.exists()


def test_a_resumed_run_drops_items_removed_meanwhile(catalogue, tmp_path) -> None:
    s = IndexStore.create(tmp_path / "index", dim=DIM, factory="Flat")
    s.add(catalogue["keys"], catalogue["x"])
    s.save()
    state = tmp_path / "state.partial"
    first = find_duplicates(s, THRESHOLD, state=state, batch=50)
    lines = state.read_text().splitlines()
    state.write_text("\n".join(lines[:4]) + "\n")  # as if it stopped after 3 batches
    gone = first[0].keys[0]
    s.remove([gone])
    resumed = find_duplicates(s, THRESHOLD, state=state, batch=50)
    assert resumed == find_duplicates(s, THRESHOLD, batch=50)
    assert all(gone not in g.keys for g in resumed)
    # another index (made again in the same folder) does not take the old pairs
    s.close()
    other = IndexStore.create(tmp_path / "other", dim=DIM, factory="Flat")
    other.add(catalogue["keys"][:500], catalogue["x"][:500])
    assert find_duplicates(other, THRESHOLD, state=state) == find_duplicates(other, THRESHOLD)


class DeletingBeside:
    """A store that another client empties as the run goes: after each page is
    listed, the page's first three items are removed (a server deleting beside a job)."""

    def __init__(self, store: IndexStore) -> None:
        self.store = store
        self.removed: list[str] = []

    def __getattr__(self, name: str):
        return getattr(self.store, name)

    def __contains__(self, key: str) -> bool:
        return key in self.store

    def scroll(self, *args, **kwargs):
        page = self.store.scroll(*args, **kwargs)
        gone = [item.key for item in page.items[:3]]
        self.store.remove(gone)
        self.removed += gone
        return page


def test_items_removed_while_a_run_reads_them_are_skipped(catalogue, tmp_path) -> None:
    store = IndexStore.create(tmp_path / "index", dim=DIM, factory="Flat")
    store.add(catalogue["keys"], catalogue["x"])
    beside = DeletingBeside(store)
    groups = find_duplicates(beside, THRESHOLD, batch=100)
    assert len(beside.removed) == 3 * 11  # 1,000 + 98 items: 11 pages
    left = np.array([key not in beside.removed for key in catalogue["keys"]])
    assert sorted(g.keys for g in groups) == brute_force_groups(
        catalogue["x"], catalogue["keys"], THRESHOLD, left
    )
    store.close()
