"""The index's upkeep in a running service: checkpoints seal segments, merges fold
them in the background while adds and searches go on, and the scrub takes a damaged
segment out of service and reports it."""

from __future__ import annotations

import time

import httpx
from serving import Server

from vitrieval.index.store._merge_policy import MERGE_FACTOR

KEY = "server-test-key-0123"
AUTH = {"X-API-Key": KEY}


def vector(i: int) -> list[float]:
    v = [0.0] * 128
    v[i % 128] = 1.0
    v[(i * 7 + 3) % 128] += 0.5
    return v


def test_checkpoints_and_background_merges_keep_segments_bounded(
    digits_gallery, served_index
) -> None:
    env = {
        "VITRIEVAL_API_KEY": KEY,
        "VITRIEVAL_CHECKPOINT_EVERY": "10",
        "VITRIEVAL_CHECKPOINT_INTERVAL_S": "0.2",
    }
    with Server(digits_gallery["model"], served_index, env=env) as server:
        http = httpx.Client(base_url=server.url, timeout=30)
        for i in range(150):
            item = {"key": f"m/{i}", "vector": vector(i), "label": "m"}
            assert http.post("/v1/items", json=item, headers=AUTH).status_code == 201
            if i % 10 == 9:
                time.sleep(0.7)  # let a checkpoint (and perhaps a merge) run
                query = {"key": f"m/{i}", "k": 1, "exclude_self": False}
                hits = http.post("/v1/search", json=query).json()["hits"]
                assert hits and hits[0]["score"] > 0.99
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            info = http.get("/v1/info").json()["index"]
            if not info["journal_pending"] and len(info["segments"]) <= MERGE_FACTOR:
                break
            time.sleep(0.2)
        metrics = http.get("/metrics").text
    print(f"segments {[s['live'] for s in info['segments']]}")
    assert info["count"] == 120 + 150 and info["journal_pending"] == 0
    assert len(info["segments"]) <= MERGE_FACTOR
    merges = [
        line for line in metrics.splitlines() if line.startswith("vitrieval_index_merges_total")
    ]
    assert merges and float(merges[0].split()[-1]) >= 1
    assert "Traceback" not in server.output()


def test_the_scrub_takes_a_damaged_segment_out_of_service(digits_gallery, served_index) -> None:
    segment = served_index / "seg.1.items.sqlite"
    data = bytearray(segment.read_bytes())
    data[len(data) // 2] ^= 0xFF  # passes the cheap checks at open; fails its checksum
    segment.write_bytes(bytes(data))
    env = {
        "VITRIEVAL_API_KEY": KEY,
        "VITRIEVAL_SCRUB_DELAY_S": "0.5",
        "VITRIEVAL_SCRUB_BYTES_PER_S": str(100 * 2**20),
    }
    with Server(digits_gallery["model"], served_index, env=env).wait_ready() as server:
        http = httpx.Client(base_url=server.url, timeout=30)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and http.get("/readyz").status_code == 200:
            time.sleep(0.2)
        ready = http.get("/readyz")
        assert ready.status_code == 503
        damaged = ready.json()["checks"]["damaged_segments"]
        assert [d["segment"] for d in damaged] == [1] and "checksum" in damaged[0]["reason"]
        assert "vitrieval_index_damaged_segments 1.0" in http.get("/metrics").text
        assert http.get("/healthz").status_code == 200  # alive, not ready
        # the damaged segment is not served: its items are gone from search results
        found = http.post("/v1/search", json={"vector": vector(1), "k": 5})
        assert found.status_code == 200 and found.json()["hits"] == []
        # the damaged segment's keys cannot be looked up: changes wait for the restore
        added = http.post("/v1/items", json={"key": "after", "vector": vector(1)}, headers=AUTH)
        assert added.status_code == 503 and added.json()["code"] == "storage_unavailable"
        assert "restored from a backup" in added.json()["detail"]
    assert "out of service" in server.output()
