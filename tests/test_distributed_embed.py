"""`vitrieval-index embed --ray`: the embeddings folder made by a Ray Data actor pool
equals the single-process embed's, resumes after a kill, and fails in one line without
Ray or with an address that is not one (distributed/, index/pipeline/embed_folder.py)."""

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
from index_cli_helpers import run  # tests/index_cli_helpers.py
from ray_cluster import NO_RAY, ray_missing
from test_embeddings import one_line, read_rows

from vitrieval.distributed.cluster import ClusterError, parse_address, plan_actors
from vitrieval.index.evaluation.datasets import load_dataset

REPO = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-5  # ORT's kernels may differ with the thread count; the math is the same


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """60 digit images in 3 class folders plus 3 unreadable files."""
    root = tmp_path_factory.mktemp("ray_images")
    for item in load_dataset("digits").train[:60]:
        folder = root / f"class_{int(item.label) % 3}"
        folder.mkdir(exist_ok=True)
        item.open().save(folder / f"{item.key.replace('/', '_')}.png")
    (root / "class_0" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    (root / "class_1" / "notes.jpg").write_text("this is not an image")
    (root / "class_2" / "empty.webp").write_bytes(b"")
    return root


def cli(*argv: object) -> list[str]:
    """The command line of `vitrieval-index ARGV` in a new process."""
    return [sys.executable, "-m", "vitrieval.index.cli", *map(str, argv)]


def error_keys(folder: Path) -> list[str]:
    with (folder / "errors.csv").open(newline="") as fh:
        return sorted(row["key"] for row in csv.DictReader(fh))


def assert_same_folder(folder: Path, reference: Path) -> None:
    """Same keys, labels and part files, vectors within TOLERANCE, same unreadable files
    and the same parts recorded."""
    keys, vectors, labels = read_rows(folder)
    keys_, vectors_, labels_ = read_rows(reference)
    assert keys == keys_ and labels == labels_
    assert np.abs(vectors - vectors_).max() <= TOLERANCE
    assert sorted(p.name for p in folder.glob("*.parquet")) == sorted(
        p.name for p in reference.glob("*.parquet")
    )
    assert error_keys(folder) == error_keys(reference)
    meta, meta_ = (json.loads((f / "embeddings.json").read_text()) for f in (folder, reference))
    assert meta["complete"] is True and meta["parts"] == meta_["parts"]
    assert (meta["count"], meta["unreadable"]) == (meta_["count"], meta_["unreadable"])


@pytest.fixture(scope="module")
def single(tmp_path_factory, images, tiny_onnx) -> tuple[Path, list[str]]:
    """The single-process embed of `images` in parts of 8, and its options."""
    options = ["--part-size", "8", "--labels-from-folders", "--device", "cpu"]
    emb = tmp_path_factory.mktemp("single") / "emb"
    done = subprocess.run(
        cli("embed", "--model", tiny_onnx, "--images", images, "--out", emb, *options),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return emb, options


@pytest.mark.ray
@pytest.mark.skipif(ray_missing(), reason=NO_RAY)
def test_embed_on_a_local_cluster_equals_the_single_process_embed(
    tmp_path, images, single, tiny_onnx
):
    reference, options = single
    emb = tmp_path / "emb"
    argv = ["embed", "--model", tiny_onnx, "--images", images, "--out", emb]
    done = subprocess.run(
        cli(*argv, *options, "--ray", "local", "--actors", "2", "--actor-threads", "1"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    assert "Deprecation" not in done.stderr, done.stderr  # vitrieval's Ray calls are current
    assert "embedded 60 of 63 images, 3 unreadable skipped" in done.stdout
    assert f"{emb} holds 60 embeddings in 8 part(s)" in done.stdout
    assert_same_folder(emb, reference)
    assert error_keys(emb) == ["class_0/broken.png", "class_1/notes.jpg", "class_2/empty.webp"]
    # a re-run has nothing left to do
    again = subprocess.run(
        cli(*argv, *options, "--ray", "local"), cwd=REPO, capture_output=True, text=True
    )
    assert again.returncode == 0 and "embedded 0 of 63 images" in again.stdout


@pytest.mark.ray
def test_a_killed_embed_on_ray_resumes(tmp_path, capsys, images, single, tiny_onnx, ray_address):
    _, options = single
    emb = tmp_path / "emb"
    argv = ["embed", "--model", tiny_onnx, "--images", images, "--out", emb, *options]
    # smaller parts, so the kill finds most of them undone
    argv[argv.index("--part-size") + 1] = "2"
    command = cli(*argv, "--batch-size", "1", "--ray", "auto", "--actors", "1")
    env = {**os.environ, "RAY_ADDRESS": ray_address}
    log = tmp_path / "stderr.txt"
    with log.open("w") as stderr:
        process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=stderr
        )

    def parts_recorded() -> int:
        try:
            return len(json.loads((emb / "embeddings.json").read_text())["parts"])
        except (OSError, ValueError, KeyError):
            return 0

    deadline = time.monotonic() + 120
    try:
        while not parts_recorded() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        process.send_signal(signal.SIGKILL)
    finally:
        process.wait()
    assert process.returncode == -signal.SIGKILL, f"not killed, ended: {log.read_text()}"
    meta = json.loads((emb / "embeddings.json").read_text())
    assert meta["complete"] is False and 1 <= len(meta["parts"]) < 32, meta["parts"]
    kept = {name: os.stat(emb / name) for name in (p["file"] for p in meta["parts"])}

    # the re-run, in this process: on the session's cluster, the parts recorded kept
    resumed = [*argv, "--batch-size", "1", "--ray", "auto", "--actors", "2"]
    code, out, err = run(capsys, *resumed, "--actor-threads", "1")
    assert code == 0, err
    assert f"{len(kept)} part(s) already done" in out and "holds 60 embeddings in 32" in out, out
    for name, before in kept.items():
        after = os.stat(emb / name)
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert not list(emb.glob(".*.tmp")), sorted(p.name for p in emb.iterdir())

    unbroken = tmp_path / "unbroken"
    code, _, err = run(capsys, *argv[:6], unbroken, *argv[7:])
    assert code == 0, err
    assert_same_folder(emb, unbroken)
    assert (emb / "errors.csv").read_text() == (unbroken / "errors.csv").read_text()


ACTOR_FAULT = """
import os, sys
from pathlib import Path
import vitrieval.distributed.embed as embed
from vitrieval.index.cli import main

class Faulty(embed.PartEmbedder):  # in __main__: Ray ships the class itself to the workers
    fault = sys.argv[1]  # read here, in the driver; travels with the class

    def __init__(self, **kwargs):
        if self.fault == "init":
            raise embed.EmbeddingsError("the model on this node is another one")
        super().__init__(**kwargs)

    def __call__(self, batch):
        os._exit(3)  # the process dies as a segfault or the OOM killer would end it

embed.PartEmbedder = Faulty
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.ray
@pytest.mark.parametrize("fault", ["call", "init"])
def test_an_actor_that_dies_ends_the_embed_with_one_line(
    tmp_path, images, tiny_onnx, ray_address, fault
):
    # Ray Data restarts a dead actor and retries its part forever by default: a part
    # that kills its actor would hang the command; here it ends after the retries
    emb = tmp_path / "emb"
    argv = ["embed", "--model", tiny_onnx, "--images", images, "--out", emb]
    argv += ["--part-size", "8", "--ray", "auto", "--actors", "1", "--actor-threads", "1"]
    done = subprocess.run(
        [sys.executable, "-c", ACTOR_FAULT, fault, *map(str, argv)],
        cwd=REPO,
        env={**os.environ, "RAY_ADDRESS": ray_address},
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    if fault == "call":
        assert "an embedding actor's process died more than 2 times" in last, last
    else:
        assert "the model on this node is another one" in last, last
    meta = json.loads((emb / "embeddings.json").read_text())
    assert meta["complete"] is False and meta["parts"] == []


WITHOUT_RAY = """
import sys
sys.modules["ray"] = None  # `import ray` raises ImportError, as without the extra
from vitrieval.index.cli import main
sys.exit(main(sys.argv[1:]))
"""


def run_without_ray(*argv: object) -> subprocess.CompletedProcess[str]:
    """`vitrieval-index ARGV` in a child process where `import ray` fails."""
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_RAY, *map(str, argv)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_without_ray_the_option_is_one_line_naming_the_extra(tmp_path, images, tiny_onnx):
    argv = ["embed", "--model", tiny_onnx, "--images", images, "--out", tmp_path / "emb"]
    done = run_without_ray(*argv, "--ray", "local")
    assert done.returncode == 2 and one_line(done.stderr), done.stderr
    assert "pip install -c constraints.txt -e '.[distributed]'" in done.stderr
    assert not (tmp_path / "emb").exists()


@pytest.mark.parametrize("address", ["bogus", "ray://", "ray://host", "ray://host:0", "10.0.0.1"])
def test_a_bad_address_is_one_line(tmp_path, capsys, images, tiny_onnx, address):
    argv = ["embed", "--model", tiny_onnx, "--images", images, "--out", tmp_path / "emb"]
    code, _, err = run(capsys, *argv, "--ray", address)
    assert code == 2 and one_line(err) and "is not a Ray address" in err
    assert not (tmp_path / "emb").exists()


def test_an_actor_decodes_with_the_drivers_decoder_whatever_its_node_says(
    tmp_path, tiny_onnx, monkeypatch
):
    # a node of a remote cluster does not share the driver's environment: the driver's
    # VITRIEVAL_DECODER travels in the actor's constructor arguments
    from vitrieval.distributed.embed import PartEmbedder
    from vitrieval.index.runtime.embedder import Embedder
    from vitrieval.index.runtime.vips_decode import DECODER_ENV, decoder_setting

    monkeypatch.setenv(DECODER_ENV, "vips")  # what the node's environment would say
    fingerprint = Embedder(tiny_onnx, device="cpu").fingerprint
    options = dict(model=str(tiny_onnx), fingerprint=fingerprint, out=str(tmp_path))
    options.update(base=str(tmp_path), device="cpu", batch_size=4, threads=1)
    PartEmbedder(**options, decoder="pillow")
    assert decoder_setting() == "pillow"
    with pytest.raises(ValueError, match="VITRIEVAL_DECODER='bogus'"):
        PartEmbedder(**options, decoder="bogus")


def test_addresses_and_the_actor_rule():
    for address in ("local", "auto", "ray://head:10001", "ray://10.0.0.1:10001"):
        assert parse_address(address) == address
    # CPU: actors x threads never exceeds the CPUs; no actor wider than a node
    assert plan_actors(16, 0, 16) == plan_actors(16, 0, 16, actors=4)
    assert (plan_actors(16, 0, 16).actors, plan_actors(16, 0, 16).threads) == (4, 4)
    assert (plan_actors(2, 0, 2).actors, plan_actors(2, 0, 2).threads) == (1, 2)
    assert plan_actors(2, 0, 2, actors=2).threads == 1
    assert plan_actors(64, 0, 8, actors=2).threads == 8
    assert plan_actors(8, 0, 8, threads=3).actors == 2
    # GPUs: one actor per GPU, unless --device cpu
    plan = plan_actors(32, 4, 8)
    assert (plan.actors, plan.threads, plan.gpu) == (4, 4, True)
    assert plan_actors(32, 4, 8, device="cpu").gpu is False
    with pytest.raises(ClusterError, match="no GPU"):
        plan_actors(8, 0, 8, device="cuda")
    with pytest.raises(ClusterError, match="--actors must be at least 1"):
        plan_actors(8, 0, 8, actors=0)
