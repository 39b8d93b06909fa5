"""`vitrieval-serve --ray ADDRESS`: the Ray Serve application answers as the
single-process server does (distributed/serve), and recovers from a dead replica.

Serve takes 10-15 s to start on 2 cores, so each index is served once per module: a
single store read-only by the command exactly as documented (`--ray local`: its own
cluster), a 3-shard index with mutations on by the same command joining the session's
cluster (`--ray auto`), where the test can find a replica's actor and kill it.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from ray_cluster import NO_RAY, ray_missing
from serving import REPO, free_port

from vitrieval.index.evaluation.datasets import csv_list
from vitrieval.index.pipeline.embeddings_folder import write_part
from vitrieval.index.shards import shard_of
from vitrieval.index.shards.build import build_shard, build_sharded
from vitrieval.index.store import IndexStore
from vitrieval.service.app import create_app
from vitrieval.service.settings import Settings

K = 6
KEY = "ray-serve-test-key-0123"
AUTH = {"X-API-Key": KEY}
START_TIMEOUT_S = 150
RECOVERY_BOUND_S = 60


class RayServe:
    """`vitrieval-serve --ray ADDRESS --model M --index DIR --host 127.0.0.1 --port P
    [OPTIONS]` in its own process group (what Ray starts for it ends with it)."""

    def __init__(
        self, model: Path, index: Path, address: str, *options: str, env: dict | None = None
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            sys.executable, "-m", "vitrieval.service.cli", "--ray", address,
            "--model", str(model), "--index", str(index),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--log-level", "warning", *options,
        ]  # fmt: skip
        self.log = index.parent / f"ray-serve-{self.port}.log"
        with self.log.open("w") as out:
            self.process = subprocess.Popen(
                command,
                cwd=REPO,
                env={**os.environ, **(env or {})},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.started = time.monotonic()

    def wait_ready(self) -> float:
        """Seconds from the command's start to /readyz 200."""
        while time.monotonic() - self.started < START_TIMEOUT_S:
            if self.process.poll() is not None:
                raise RuntimeError(f"exited with {self.process.returncode}: {self.output()}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return time.monotonic() - self.started
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"not ready after {START_TIMEOUT_S} s: {self.output()}")

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self) -> int | None:
        """SIGTERM (the command shuts Serve down, and a local cluster), then whatever
        of its process group is left (Ray's agents outlive their raylet a while)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        if self.process.poll() is None:
            self.process.wait(10)
        return self.process.returncode


@pytest.fixture(scope="module")
def indexes(tmp_path_factory, digits_gallery) -> dict[str, Path]:
    """The digits gallery as one store (a copy) and as 3 shards of the same items."""
    root = tmp_path_factory.mktemp("ray_serve")
    one = Path(shutil.copytree(digits_gallery["index"], root / "one"))
    source = IndexStore.open(one)
    keys = source.keys()
    records = [source.get(key) for key in keys]
    emb = root / "emb"
    write_part(
        emb / "part-00000.parquet",
        keys,
        np.stack([r.vector for r in records]),
        labels=[r.label for r in records],
        paths=[r.path for r in records],
    )
    (emb / "embeddings.json").write_text(
        json.dumps({"dim": source.dim, "model_fingerprint": source.fingerprint})
    )
    source.close()
    sharded = root / "sharded"
    build_sharded(
        emb,
        sharded,
        str(digits_gallery["model"]),
        "Flat",
        3,
        50,
        lambda jobs: [build_shard(**job) for job in jobs],
    )
    return {"one": one, "sharded": sharded}


@pytest.fixture(scope="module")
def query(digits_gallery) -> bytes:
    return Path(csv_list(digits_gallery["list"])[7].path).read_bytes()


def search(client: httpx.Client | TestClient, url: str, image: bytes) -> httpx.Response:
    return client.post(
        f"{url}/v1/search", files={"image": ("q.png", image, "image/png")}, data={"k": str(K)}
    )


def single_process_answers(model: Path, index: Path, image: bytes) -> dict:
    """What the single-process server answers: the hits and a bad upload's error."""
    settings = Settings(model=model, index=index, api_key=KEY)
    with TestClient(create_app(settings)) as client:
        hits = search(client, "", image).json()["hits"]
        bad = search(client, "", b"not an image at all")
    return {"hits": hits, "bad": (bad.status_code, bad.json())}


def assert_same_answers(url: str, expected: dict, image: bytes) -> None:
    with httpx.Client(timeout=30) as client:
        answer = search(client, url, image)
        assert answer.status_code == 200, answer.text
        hits = answer.json()["hits"]
        assert [h["key"] for h in hits] == [h["key"] for h in expected["hits"]]
        np.testing.assert_allclose(
            [h["score"] for h in hits], [h["score"] for h in expected["hits"]], atol=1e-5
        )
        bad = search(client, url, b"not an image at all")
        assert (bad.status_code, bad.json()) == expected["bad"]


@pytest.mark.ray
@pytest.mark.skipif(ray_missing(), reason=NO_RAY)
def test_ray_local_serves_a_store_as_the_single_process_server(indexes, query, digits_gallery):
    model = digits_gallery["model"]
    expected = single_process_answers(model, indexes["one"], query)
    server = RayServe(model, indexes["one"], "local", "--read-only", "--ingress-replicas", "2")
    try:
        print(f"--ray local: ready {server.wait_ready():.1f} s after the command started")
        assert_same_answers(server.url, expected, query)
        refused = httpx.post(f"{server.url}/v1/items", json={"key": "x"}, timeout=30)
        assert refused.status_code == 403 and refused.json()["code"] == "read_only"
        info = httpx.get(f"{server.url}/v1/info", timeout=30)
        assert info.status_code == 200, info.text
        assert info.json()["service"]["batching"] is True
    finally:
        code = server.stop()
    assert code == 0, server.output()


@pytest.mark.skipif(ray_missing(), reason=NO_RAY)
@pytest.mark.parametrize(
    ("read_only", "ingresses", "shard_replicas"), [(True, 3, 2), (False, 1, 1)]
)
def test_ingress_replicas_are_asked_for_only_read_only(
    indexes, digits_gallery, read_only, ingresses, shard_replicas
):
    """--ingress-replicas and --shard-replicas become the deployments' replica counts
    read-only; with mutations on, the ingress and each shard have one replica."""
    from vitrieval.distributed.serve.run import build_application, check_inputs

    settings = Settings(
        model=digits_gallery["model"],
        index=indexes["sharded"],
        read_only=read_only,
        api_key=None if read_only else KEY,
    )
    app = build_application(
        settings,
        check_inputs(settings),
        embed_replicas=1,
        shard_replicas=2,
        ingress_replicas=3,
        cluster={"CPU": 2.0},
        node_cpus=2,
    )
    # Serve's Application exposes its deployment (and its arguments) only privately
    ingress = app._bound_deployment
    assert ingress.name == "ingress" and ingress.num_replicas == ingresses
    shards = [a._bound_deployment for a in ingress.init_args[2]]
    assert [d.num_replicas for d in shards] == [shard_replicas] * 3


def _kill_one_replica(deployment: str) -> str:
    """ray.kill on a replica of `deployment`'s actor, found by its name (Serve names
    them SERVE_REPLICA::APP#DEPLOYMENT#ID); Serve's controller replaces it."""
    import ray

    prefix = f"SERVE_REPLICA::vitrieval#{deployment}#"
    names = [
        actor["name"]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["namespace"] == "serve" and actor["name"].startswith(prefix)
    ]
    assert names, f"no replica of {deployment}"
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=False)
    return names[0]


@pytest.fixture(scope="module")
def sharded_on_session_cluster(indexes, digits_gallery, ray_address) -> Iterator[RayServe]:
    from ray import serve

    served = Path(shutil.copytree(indexes["sharded"], indexes["sharded"].parent / "served"))
    env = {"RAY_ADDRESS": ray_address, "VITRIEVAL_API_KEY": KEY}
    server = RayServe(digits_gallery["model"], served, "auto", env=env)
    try:
        print(f"--ray auto, 3 shards: ready {server.wait_ready():.1f} s after the start")
        yield server
    finally:
        code = server.stop()
        serve.shutdown()  # whatever the command left on the session's cluster
    assert code == 0, server.output()


@pytest.mark.ray
def test_a_sharded_index_on_ray_serve_answers_as_the_single_process_server(
    sharded_on_session_cluster, indexes, query, digits_gallery
):
    expected = single_process_answers(digits_gallery["model"], indexes["sharded"], query)
    # the one store and the 3 shards hold the same items: the same hits
    one = single_process_answers(digits_gallery["model"], indexes["one"], query)
    assert [h["key"] for h in one["hits"]] == [h["key"] for h in expected["hits"]]
    assert_same_answers(sharded_on_session_cluster.url, expected, query)
    # each image embedded is in exactly one model call's batch size: the calls' sizes
    # add up to the images the embed stage timed
    metrics = httpx.get(f"{sharded_on_session_cluster.url}/metrics", timeout=30).text
    embedded = _sample(metrics, 'vitrieval_stage_duration_seconds_count{stage="embed"}')
    assert embedded >= 1
    assert _sample(metrics, "vitrieval_embed_batch_size_sum") == embedded
    assert 1 <= _sample(metrics, "vitrieval_embed_batch_size_count") <= embedded


def _sample(metrics: str, name: str) -> float:
    """The value of the Prometheus sample `name` (with its labels) in `metrics`."""
    lines = metrics.splitlines()
    values = [line.rsplit(" ", 1)[1] for line in lines if line.startswith(name + " ")]
    assert len(values) == 1, (name, values)
    return float(values[0])


def mutations(client: httpx.Client | TestClient, url: str) -> list[tuple[int, dict]]:
    """Add, add again, find, read, delete and read again an item: every answer."""
    vector = [0.0] * 128
    vector[5] = 1.0
    item = {"key": "api/1", "vector": vector, "label": "x", "metadata": {"n": 1}}
    answers = [
        client.post(f"{url}/v1/items", json=item, headers=AUTH),
        client.post(f"{url}/v1/items", json=item, headers=AUTH),
        client.post(f"{url}/v1/items", json=item),
        client.post(f"{url}/v1/search", json={"vector": vector, "k": 3}),
        client.get(f"{url}/v1/items/api/1"),
        client.delete(f"{url}/v1/items/api/1", headers=AUTH),
        client.get(f"{url}/v1/items/api/1"),
    ]
    out = []
    for answer in answers:
        body = answer.json()
        body.pop("timings_ms", None)
        out.append((answer.status_code, body))
    return out


@pytest.mark.ray
def test_mutations_on_ray_serve_answer_as_the_single_process_server(
    sharded_on_session_cluster, indexes, digits_gallery, tmp_path
):
    copy = Path(shutil.copytree(indexes["sharded"], tmp_path / "sharded"))
    settings = Settings(model=digits_gallery["model"], index=copy, api_key=KEY)
    with TestClient(create_app(settings)) as client:
        expected = mutations(client, "")
    with httpx.Client(timeout=30) as client:
        got = mutations(client, sharded_on_session_cluster.url)
    assert [status for status, _ in got] == [201, 409, 401, 200, 200, 200, 404]
    assert got[3][1]["hits"][0]["key"] == "api/1"
    for (status, body), (want_status, want) in zip(got, expected, strict=True):
        assert status == want_status
        if "hits" in body:
            assert [h["key"] for h in body["hits"]] == [h["key"] for h in want["hits"]]
            np.testing.assert_allclose(
                [h["score"] for h in body["hits"]], [h["score"] for h in want["hits"]], atol=1e-5
            )
        else:
            assert body == want


def _replicas(deployment: str) -> set[str]:
    import ray

    prefix = f"SERVE_REPLICA::vitrieval#{deployment}#"
    return {
        actor["name"]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["namespace"] == "serve" and actor["name"].startswith(prefix)
    }


def _healthy(deployment: str) -> bool:
    from ray import serve

    app = serve.status().applications.get("vitrieval")
    return app is not None and app.deployments[deployment].status == "HEALTHY"


@pytest.mark.ray
def test_searches_recover_when_a_shard_writer_dies(sharded_on_session_cluster, query):
    url = sharded_on_session_cluster.url
    # (sent, seconds taken, status, body) of every search, times from the kill
    answers: list[tuple[float, float, int, str]] = []
    stop = threading.Event()
    killed_at: list[float] = []

    def client() -> None:
        with httpx.Client(timeout=RECOVERY_BOUND_S) as http:
            while not stop.is_set():
                sent = time.monotonic()
                try:
                    response = search(http, url, query)
                    status, body = response.status_code, response.text[:200]
                except httpx.HTTPError as exc:
                    status, body = 0, type(exc).__name__
                if killed_at:
                    took = time.monotonic() - sent
                    answers.append((sent - killed_at[0], took, status, body))

    # an item the victim's journal holds (no checkpoint yet) must survive the kill
    key = next(f"kept/{i}" for i in range(100) if shard_of(f"kept/{i}", 3) == 1)
    vector = [0.0] * 128
    vector[7] = 1.0
    added = httpx.post(f"{url}/v1/items", json={"key": key, "vector": vector}, headers=AUTH)
    assert added.status_code == 201, added.text
    clients = [threading.Thread(target=client) for _ in range(4)]
    for thread in clients:
        thread.start()
    try:
        time.sleep(1.0)
        before = _replicas("shard-001")
        killed_at.append(time.monotonic())
        victim = _kill_one_replica("shard-001")
        replaced = None
        while time.monotonic() - killed_at[0] < RECOVERY_BOUND_S:
            if _replicas("shard-001") - before and _healthy("shard-001"):
                replaced = time.monotonic() - killed_at[0]
                break
            time.sleep(0.5)
        time.sleep(2.0)  # searches sent after the replacement
    finally:
        stop.set()
        for thread in clients:
            thread.join(RECOVERY_BOUND_S)
    counts = collections.Counter(status for _, _, status, _ in answers)
    errors = [(round(t, 2), status, body) for t, _, status, body in answers if status != 200]
    slowest = max(answers, key=lambda answer: answer[1])
    print(
        f"killed {victim}; replaced and healthy after {replaced} s; answers after the kill "
        f"by status {dict(counts)}, errors {errors[:5]}; the slowest search, sent "
        f"{slowest[0]:.2f} s after the kill, took {slowest[1]:.2f} s"
    )
    assert replaced is not None, f"no new replica within {RECOVERY_BOUND_S} s: {dict(counts)}"
    # what fails is the service's own JSON 503 (a call in flight to the dead replica)
    for _, status, body in errors:
        assert status == 503 and json.loads(body)["code"] == "unavailable", body
    after = [status for t, _, status, _ in answers if t > replaced]
    assert after and set(after) == {200}, after
    with httpx.Client(timeout=30) as http:
        assert http.get(f"{url}/readyz").status_code == 200
        assert http.get(f"{url}/v1/items/{key}").status_code == 200


WITHOUT_RAY = """
import sys
sys.modules["ray"] = None  # `import ray` raises ImportError, as without the extra
from vitrieval.service.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize(
    ("options", "env", "says"),
    [
        (
            ["--ray", "local", "--read-only"],
            {},
            "pip install -c constraints.txt -e '.[distributed]'",
        ),
        (
            ["--ray", "auto", "--shard-replicas", "2"],
            {"VITRIEVAL_API_KEY": KEY},
            "each shard has one replica, its writer",
        ),
        (
            ["--ray", "auto", "--ingress-replicas", "2"],
            {"VITRIEVAL_API_KEY": KEY},
            "one ingress numbers the new items",
        ),
    ],
)
def test_ray_serve_refusals_are_one_line(digits_gallery, options, env, says):
    """Without Ray, --ray names the extra; with mutations on, a shard has one replica."""
    model, index = digits_gallery["model"], digits_gallery["index"]
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_RAY, "--model", str(model), "--index", str(index), *options],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert says in done.stderr
