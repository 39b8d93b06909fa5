"""Several processes on one index folder: a writer (a server with mutations on,
checkpointing and merging every few adds) beside a `--read-only` server and a CLI
search loop. Readers keep answering from the generation they opened (their reader
leases keep its files) and the read-only server follows the writer's commits;
`vitrieval-index merge` beside the writer refuses in one line."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx
from serving import REPO, Server

KEY = "server-test-key-0123"
AUTH = {"X-API-Key": KEY}
RUN_S = 12.0  # long enough for several merges and CLI searches; --many-processes-s N


def vector(i: int) -> list[float]:
    v = [0.0] * 128
    v[i % 128] = 1.0
    v[(i * 7 + 3) % 128] += 0.5
    return v


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vitrieval.index.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def metric(text: str, name: str) -> float:
    lines = [line for line in text.splitlines() if line.startswith(name + " ")]
    return float(lines[0].split()[-1]) if lines else 0.0


def test_a_writer_beside_a_read_only_server_and_cli_searches(
    digits_gallery, served_index, pytestconfig
) -> None:
    run_s = pytestconfig.getoption("--many-processes-s") or RUN_S
    writer_env = {
        "VITRIEVAL_API_KEY": KEY,
        "VITRIEVAL_CHECKPOINT_EVERY": "3",  # a segment every 3 adds, a merge every 12
        "VITRIEVAL_CHECKPOINT_INTERVAL_S": "0.2",
    }
    reader_env = {"VITRIEVAL_SCRUB_DELAY_S": "1", "VITRIEVAL_SCRUB_INTERVAL_S": "1"}
    query = str(next(digits_gallery["images"].rglob("*.png")))
    with (
        Server(digits_gallery["model"], served_index, env=writer_env) as writer,
        Server(digits_gallery["model"], served_index, "--read-only", env=reader_env) as reader,
    ):
        w = httpx.Client(base_url=writer.url, timeout=30)
        r = httpx.Client(base_url=reader.url, timeout=30)
        cli_runs: list[subprocess.CompletedProcess] = []
        stop = threading.Event()

        def cli_searches() -> None:
            while not stop.is_set():
                cli_runs.append(cli("search", str(served_index), query, "-k", "3", "--json"))

        searcher = threading.Thread(target=cli_searches)
        searcher.start()
        answers, statuses, generations, not_ready = [], [], set(), 0
        added = 0
        merge_refusal = None
        started = time.monotonic()
        try:
            while time.monotonic() - started < run_s:
                item = {"key": f"w/{added}", "vector": vector(added), "label": "w"}
                assert w.post("/v1/items", json=item, headers=AUTH).status_code == 201
                added += 1
                found = r.post("/v1/search", json={"vector": vector(added), "k": 5})
                statuses.append(found.status_code)
                answers.append(found.json().get("hits"))
                generations.add(r.get("/v1/info").json()["index"]["generation"])
                not_ready += r.get("/readyz").status_code != 200
                if added == 30:
                    merge_refusal = cli("merge", str(served_index), "--all")
        finally:
            stop.set()
            searcher.join(180)
        # the writer saves what its journal holds; the reader follows within its poll
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            saved = w.get("/v1/info").json()["index"]["journal_pending"] == 0
            if saved and r.get("/v1/info").json()["index"]["count"] == 120 + added:
                break
            time.sleep(0.3)
        reader_info = r.get("/v1/info").json()["index"]
        writer_metrics = w.get("/metrics").text
        reader_metrics = r.get("/metrics").text
        followed = r.get(f"/v1/items/w/{added - 1}")
    print(
        f"{added} adds, {len(statuses)} reader searches, {len(cli_runs)} CLI searches, "
        f"reader generations {sorted(generations)}, "
        f"merges {metric(writer_metrics, 'vitrieval_index_merges_total')}"
    )
    assert metric(writer_metrics, "vitrieval_index_merges_total") >= 2  # files were deleted
    # merge beside the writer: refused in one line, exit 2
    assert merge_refusal is not None and merge_refusal.returncode == 2
    assert "already open for writing" in merge_refusal.stderr
    assert len(merge_refusal.stderr.strip().splitlines()) == 1
    # the read-only server: every search answered, none empty, never unready
    assert set(statuses) == {200} and all(answers)
    assert not_ready == 0 and metric(reader_metrics, "vitrieval_index_damaged_segments") == 0
    # ... and it followed the writer's commits, to the last
    assert len(generations) >= 3
    assert reader_info["count"] == 120 + added
    assert followed.status_code == 200 and followed.json()["label"] == "w"
    # every CLI search answered from a committed generation
    assert cli_runs and all(run.returncode == 0 for run in cli_runs), [
        run.stderr for run in cli_runs if run.returncode
    ]
    assert all(json.loads(run.stdout)[0]["hits"] for run in cli_runs)
    assert "Traceback" not in writer.output() + reader.output()
