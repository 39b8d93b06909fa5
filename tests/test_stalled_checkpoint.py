"""A checkpoint that cannot take INDEX/.lock (another process holds it): the wait is
bounded, /readyz says "degraded" with a reason code (still 200), /metrics shows the
backlog and the last successful checkpoint, SIGTERM ends the server, and the journal
keeps every acknowledged write."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
from serving import Server

from vitrieval.index.store import IndexStore
from vitrieval.index.store.manifest import LOCK_FILE

KEY = "server-test-key-0123"
AUTH = {"X-API-Key": KEY}
HOLD = (
    "import fcntl, os, sys, time\n"
    "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
    "fcntl.flock(fd, fcntl.LOCK_EX)\n"
    "print('held', flush=True)\n"
    "time.sleep(600)\n"
)


def metric(text: str, name: str) -> float:
    lines = [line for line in text.splitlines() if line.startswith(name + " ")]
    return float(lines[0].split()[-1])


def test_a_stalled_checkpoint_is_visible_and_does_not_block_shutdown(
    digits_gallery, served_index
) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(served_index / LOCK_FILE)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        env = {
            "VITRIEVAL_API_KEY": KEY,
            "VITRIEVAL_CHECKPOINT_EVERY": "5",
            "VITRIEVAL_CHECKPOINT_INTERVAL_S": "0.5",
        }
        server = Server(digits_gallery["model"], served_index, env=env).wait_ready()
        http = httpx.Client(base_url=server.url, timeout=30)
        ready = http.get("/readyz")
        assert ready.json()["status"] == "ready"
        for i in range(10):
            item = {"key": f"s/{i}", "vector": [1.0] + [0.0] * 127}
            assert http.post("/v1/items", json=item, headers=AUTH).status_code == 201
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            ready = http.get("/readyz")
            if ready.json()["status"] != "ready":
                break
            time.sleep(0.3)
        metrics = http.get("/metrics").text
        assert ready.status_code == 200 and ready.json()["status"] == "degraded"
        assert ready.json()["checks"]["reasons"] == ["checkpoint_stalled"]
        assert ready.json()["checks"]["checkpoint"]["reason"] == "writer_lock_held"
        assert metric(metrics, "vitrieval_journal_pending") == 10
        assert metric(metrics, "vitrieval_last_checkpoint_timestamp_seconds") == 0
        assert metric(metrics, "vitrieval_checkpoint_failures_total") >= 1
        # adds go on meanwhile
        item = {"key": "s/late", "vector": [0.0, 1.0] + [0.0] * 126}
        assert http.post("/v1/items", json=item, headers=AUTH).status_code == 201
        server.process.send_signal(signal.SIGTERM)
        try:
            code = server.process.wait(30)  # the final save gives up on the lock
        finally:
            server.stop()
        assert code in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled
    finally:
        holder.kill()
        holder.wait()
    output = server.output()
    assert "checkpoint stalled" in output and "final save gave up" in output
    assert "Traceback" not in output
    with IndexStore.open(served_index) as store:  # the journal replays every write
        assert all(f"s/{i}" in store for i in range(10)) and "s/late" in store
        assert len(store) == 120 + 11
