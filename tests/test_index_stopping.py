"""Stopping `vitrieval-index build/embed/add`: Ctrl-C says at once that it stops, exits
within seconds keeping what was done, and names the command to go on with; a command
that needs the writer lock checks it before embedding anything."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from index_cli_helpers import run  # tests/index_cli_helpers.py
from PIL import Image

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def many_small(tmp_path_factory) -> Path:
    """2048 small noise images: with --batch-size 128, several seconds of embedding on
    an idle 2-core machine (512 took under 2 s: the command ended before its Ctrl-C)."""
    root = tmp_path_factory.mktemp("many")
    rng = np.random.default_rng(0)
    for i in range(2048):
        pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / f"{i:04d}.png", compress_level=0)
    return root


@pytest.mark.parametrize("command", ["build", "embed"])
def test_ctrl_c_stops_at_once_and_says_how_to_go_on(tmp_path, many_small, tiny_onnx, command):
    out = tmp_path / "out"
    argv = [command, "--model", str(tiny_onnx), "--images", str(many_small), "--out", str(out)]
    argv += ["--batch-size", "128", "--device", "cpu"]
    if command == "embed":
        argv += ["--part-size", "512"]
    process = subprocess.Popen(
        [sys.executable, "-m", "vitrieval.index.cli", *argv],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    chunks: list[str] = []
    reader = threading.Thread(
        target=lambda: chunks.extend(iter(lambda: process.stderr.read(1), ""))
    )
    reader.start()
    try:
        deadline = time.monotonic() + 60
        # the first progress line (a redrawn bar's "img/s" where there is no such line)
        while not re.search("embedding: |img/s", "".join(chunks)):
            assert time.monotonic() < deadline and process.poll() is None, "".join(chunks)
            time.sleep(0.05)
        time.sleep(0.3)  # into the first model calls, far from the end
        sent = time.monotonic()
        process.send_signal(signal.SIGINT)
        while "stopping" not in "".join(chunks) and process.poll() is None:
            time.sleep(0.01)
        said = time.monotonic() - sent
        process.wait(timeout=30)
        took = time.monotonic() - sent
    finally:
        process.kill()
        reader.join()
    err = "".join(chunks)
    assert process.returncode == 130, err
    lines = err.strip().splitlines()
    assert f"vitrieval-index {command}: stopping, keeping what is done" in err
    assert said < 1.0, f"{said:.1f}s from Ctrl-C to the first word"
    assert f"to go on, run the same command again: vitrieval-index {command} --model" in lines[-1]
    assert took < 3.0, f"{took:.1f}s from Ctrl-C to exit"
    if command == "build":  # what the line says was kept is in the index
        kept = int(re.search(r"holds (\d+) items", lines[-1]).group(1))
        assert kept % 128 == 0 and json.loads((out / "manifest.json").read_text())
        code, info, _ = _run_cli(["info", str(out), "--json"])
        assert code == 0 and json.loads(info)["count"] == kept
    else:
        done = int(re.search(r"(\d+) of 4 part\(s\) done", lines[-1]).group(1))
        parts = json.loads((out / "embeddings.json").read_text())["parts"]
        assert len(parts) == done and sorted(out.glob("part-*.parquet")) == [
            out / part["file"] for part in parts
        ]


def _run_cli(argv: list[str]) -> tuple[int, str, str]:
    done = subprocess.run(
        [sys.executable, "-m", "vitrieval.index.cli", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        timeout=120,
    )
    return done.returncode, done.stdout, done.stderr


def test_add_to_a_served_index_is_refused_before_embedding(
    tmp_path, capsys, monkeypatch, many_small, tiny_onnx
):
    from vitrieval.index.runtime.embedder import Embedder
    from vitrieval.index.store._journal import JournalOwner

    index = tmp_path / "index"
    first = tmp_path / "first"
    first.mkdir()
    (first / "a.png").write_bytes((many_small / "0000.png").read_bytes())
    assert run(capsys, "build", "--model", tiny_onnx, "--images", first, "--out", index)[0] == 0

    def no_embedding(*args, **kwargs):
        raise AssertionError("embedded before checking the writer lock")

    monkeypatch.setattr(Embedder, "iter_items", no_embedding)
    monkeypatch.setattr(Embedder, "embed_items", no_embedding)
    server = JournalOwner(index)  # what a running vitrieval-serve holds
    try:
        code, _, err = run(capsys, "add", index, "--images", many_small)
    finally:
        server.release()
    assert code == 2 and "already open for writing by another process" in err
