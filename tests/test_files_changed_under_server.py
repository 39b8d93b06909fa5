"""Segment files truncated, deleted or replaced under a running server: the process
stays up (a truncated memory-mapped FAISS file would kill it with SIGBUS at the next
search), the changed segments are taken out of service at the next search (a stat of
each file first), the others answer as before, /readyz is 503 and `verify` exits 2."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import httpx
import numpy as np
from serving import REPO, Server

from vitrieval.index.store import IndexStore

KINDS = ("faiss", "vectors.npy", "items.sqlite", "del")
ACTIONS = ("truncate", "delete", "replace")
ROWS = 10


def segment_file(index, number: int, kind: str):
    if kind == "del":
        return next(index.glob(f"seg.{number}.del.*.npy"))
    return index / f"seg.{number}.{kind}"


def test_segment_files_changed_under_a_running_server(digits_gallery, tmp_path) -> None:
    index = tmp_path / "index"
    rng = np.random.default_rng(4)
    x = rng.normal(size=(len(KINDS) * len(ACTIONS) * ROWS, 128)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    store = IndexStore.create(index, dim=128, factory="HNSW16", model_path=digits_gallery["model"])
    store.save()
    store.close()
    # journalled: its saves do not merge, so every batch stays a segment of its own
    store = IndexStore.open(index, journal=True)
    for start in range(0, len(x), ROWS):
        store.add([str(i) for i in range(start, start + ROWS)], x[start : start + ROWS])
        store.save()
    store.remove([str(start + ROWS - 1) for start in range(0, len(x), ROWS)])
    store.save()  # every segment has a tombstone file now
    numbers = [s["number"] for s in store.info()["segments"]]
    store.close()
    assert len(numbers) == len(KINDS) * len(ACTIONS)
    plan = [(kind, action) for kind in KINDS for action in ACTIONS]
    spare = tmp_path / "spare"
    spare.mkdir()
    with Server(digits_gallery["model"], index, "--read-only") as server:
        http = httpx.Client(base_url=server.url, timeout=30)

        def top(i: int) -> str | None:
            found = http.post("/v1/search", json={"vector": x[i].tolist(), "k": 1})
            assert found.status_code == 200, found.text
            hits = found.json()["hits"]
            return hits[0]["key"] if hits else None

        assert all(top(start) == str(start) for start in range(0, len(x), ROWS))
        for j, (number, (kind, action)) in enumerate(zip(numbers, plan, strict=True)):
            path = segment_file(index, number, kind)
            if action == "truncate":
                os.truncate(path, path.stat().st_size // 3)
            elif action == "delete":
                path.unlink()
            else:  # the same name, another file: a copy of another segment's
                other = segment_file(index, numbers[-1 if j == 0 else 0], kind)
                shutil.copyfile(other, spare / path.name)
                os.replace(spare / path.name, path)
            # the next search takes the changed segment out; the process stays up and
            # the segments still in service answer as before
            assert top(j * ROWS) != str(j * ROWS), (kind, action)
            assert server.process.poll() is None
            if j + 1 < len(numbers):
                assert top((j + 1) * ROWS) == str((j + 1) * ROWS)
        # every segment was changed: none of their items is served any more
        assert all(top(start) is None for start in range(0, len(x), ROWS))
        ready = http.get("/readyz")
        info = http.get("/v1/info")
        assert http.get("/healthz").status_code == 200
    assert ready.status_code == 503
    damaged = ready.json()["checks"]["damaged_segments"]
    assert sorted(d["segment"] for d in damaged) == sorted(numbers)
    codes = {d["reason"] for d in damaged}
    assert codes <= {"deleted", "changed_on_disk"} and "deleted" in codes
    assert str(tmp_path) not in ready.text  # codes only: the paths go to the log
    shown = {s["number"]: s.get("damaged") for s in info.json()["index"]["segments"]}
    assert {shown[n] for n in numbers} == codes and str(tmp_path) not in info.text
    verify = subprocess.run(
        [sys.executable, "-m", "vitrieval.index.cli", "verify", str(index)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert verify.returncode == 2 and len(verify.stderr.strip().splitlines()) == 1
    assert "out of service" in server.output() and "Traceback" not in server.output()
