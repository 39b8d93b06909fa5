"""The standing hostile-input test: 2,000 generated requests (tests/hostile_inputs.py)
against a real `vitrieval-serve` from 8 concurrent clients. Every answer is a JSON
body with a status below 500 (the status a request must get where it has one: a 422
for a key clients would rewrite, a 200 or 201 for a vector of extreme scale), names no
server path, and scores hits within [-1, 1]; the server is alive at the end, its peak
memory stayed within the documented budget and its memory came back to the baseline.
A full disk is not among the inputs (it would fail every write of the run; the
in-process tests/test_service_error_bodies.py simulates it)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import httpx
from hostile_inputs import HostileRequest, hostile_requests
from serving import Server
from test_service_limits import rss_kib

KEY = "server-test-key-0123"
N_REQUESTS = 2000
CLIENTS = 8
MIB = 2**20
DECODE_BUDGET = 256 * MIB
SLACK = 64 * MIB  # allocator and interpreter noise around the budget


async def send(http: httpx.AsyncClient, request: HostileRequest) -> httpx.Response:
    headers = {"X-API-Key": KEY} if request.auth else {}
    if request.json_text is not None:
        headers["content-type"] = "application/json"
        return await http.request(
            request.method,
            request.path,
            content=request.json_text.encode("utf-8", "surrogatepass"),
            headers=headers,
        )
    if request.content is not None:
        headers["content-type"] = request.content_type or "application/octet-stream"
        return await http.request(
            request.method, request.path, content=request.content, headers=headers
        )
    if request.files is not None or request.data is not None:
        return await http.request(
            request.method, request.path, files=request.files, data=request.data, headers=headers
        )
    return await http.request(request.method, request.path, headers=headers)


def test_2000_hostile_requests_get_json_4xx_or_2xx_in_bounded_memory(
    digits_gallery, served_index
) -> None:
    requests = list(hostile_requests(N_REQUESTS, seed=13))
    env = {"VITRIEVAL_API_KEY": KEY, "VITRIEVAL_DECODE_MEMORY_BYTES": str(DECODE_BUDGET)}
    with Server(digits_gallery["model"], served_index, env=env) as server:
        pid = server.process.pid
        warm = httpx.post(f"{server.url}/v1/search", json={"key": "1/digits_00001.png", "k": 1})
        assert warm.status_code == 200
        baseline = rss_kib(pid)
        Path_clear = f"/proc/{pid}/clear_refs"
        with open(Path_clear, "w") as refs:  # start a new high-water mark
            refs.write("5")
        failures: list[str] = []
        # no answer names where the index lives (its files, the journal)
        server_paths = {str(served_index), str(served_index.resolve())}
        statuses: Counter[int] = Counter()
        queue: asyncio.Queue[HostileRequest] = asyncio.Queue()
        for request in requests:
            queue.put_nowait(request)

        async def client() -> None:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                while not queue.empty():
                    request = queue.get_nowait()
                    response = await send(http, request)
                    statuses[response.status_code] += 1
                    content_type = response.headers.get("content-type", "")
                    is_thumbnail = response.status_code == 200 and request.path.endswith(
                        "thumbnail"
                    )
                    if response.status_code >= 500:
                        failures.append(f"{request.name}: {response.status_code} {response.text}")
                    elif not is_thumbnail and not content_type.startswith("application/json"):
                        failures.append(f"{request.name}: {content_type} {response.text[:100]}")
                    elif response.status_code >= 400 and "code" not in response.json():
                        failures.append(f"{request.name}: no error code {response.text[:100]}")
                    elif request.expect and response.status_code not in request.expect:
                        failures.append(
                            f"{request.name}: {response.status_code}, not {request.expect}"
                        )
                    elif any(path in response.text for path in server_paths):
                        failures.append(f"{request.name}: a server path in {response.text[:200]}")
                    elif not is_thumbnail and not all(
                        -1.0 - 1e-5 <= hit["score"] <= 1.0 + 1e-5
                        for hit in response.json().get("hits", [])
                        if isinstance(hit, dict)
                    ):
                        failures.append(f"{request.name}: a score beyond [-1, 1] {response.text}")

        started = time.perf_counter()

        async def run() -> None:
            await asyncio.gather(*(client() for _ in range(CLIENTS)))

        asyncio.run(run())
        seconds = time.perf_counter() - started
        peak_growth = (rss_kib(pid, "VmHWM") - baseline) * 1024
        time.sleep(0.5)
        after = rss_kib(pid)
        print(
            f"{N_REQUESTS} requests in {seconds:.1f} s: {dict(sorted(statuses.items()))}; "
            f"RSS baseline {baseline / 1024:.0f} MiB, peak +{peak_growth / MIB:.0f} MiB, "
            f"after +{(after - baseline) / 1024:.1f} MiB"
        )
        assert not failures, failures[:10]
        assert sum(statuses.values()) == N_REQUESTS
        assert statuses[200] + statuses[201] > 100  # the valid ones were served
        assert server.process.poll() is None
        assert httpx.get(f"{server.url}/readyz").status_code == 200
        assert peak_growth < DECODE_BUDGET + SLACK
        assert (after - baseline) / 1024 < 48
    assert "Traceback" not in server.output(), server.output()[-3000:]
