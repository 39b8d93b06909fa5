"""`make demo` as a user meets it: a busy port named with the variable that changes it,
and a Ctrl-C during the training that keeps the run's files, names `make demo` as the
way on, and resumes to the figures of an unbroken run (the Makefile, with a short
training through DEMO_FIT_ARGS and a run folder of the test's own through DEMO_RUN)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_interrupt import _left, _stop_after_first_checkpoint

from vitrieval.training.cli import main

REPO = Path(__file__).resolve().parents[1]
VENV = Path(sys.executable).parent.parent  # the virtualenv running the tests
SHORT = ["--epochs", "2", "--batch-size", "128", "--workers", "0", "--warmup-epochs", "1"]


def _make(*args: str) -> list[str]:
    # -o: never (re)install the virtualenv from a test, whatever the stamp's age
    return ["make", "-o", str(VENV / ".installed"), f"VENV={VENV}", *args]


def test_a_busy_demo_port_is_named_with_demo_port_before_any_training(tmp_path):
    run = tmp_path / "run"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        process = subprocess.Popen(
            _make("demo", f"DEMO_PORT={port}", f"DEMO_RUN={run}"),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            _out, err = process.communicate(timeout=60)
        finally:
            if process.poll() is None:  # training: the port was not checked first
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    assert process.returncode != 0
    assert f"port {port} on 127.0.0.1 is in use" in err, err
    assert f"make demo DEMO_PORT={port + 1}" in err, err
    assert not run.exists()  # nothing trained, nothing written


@pytest.mark.slow(reason="three short digits trainings through make: minutes on 2 cores")
def test_ctrl_c_in_make_demo_keeps_the_run_and_make_demo_finishes_it(tmp_path):
    run = tmp_path / "demo"
    target = str(run / "model.safetensors")
    command = _make(f"DEMO_RUN={run}", f"DEMO_FIT_ARGS={' '.join(SHORT)}", target)
    result, seen, _ = _stop_after_first_checkpoint(command, run, signal.SIGINT, True)
    assert result.returncode != 0
    assert _left(seen) == [], "the training outlived make"
    # precious: make leaves the run's weights (and everything else) where they are
    assert "Deleting file" not in result.stderr, result.stderr
    assert (run / "model.safetensors").is_file()
    epoch = json.loads((run / "checkpoint" / "state.json").read_text())["epoch"]
    assert epoch == 1
    hint = f"holds the checkpoint of epoch 1: `make demo DEMO_RUN={run}` continues it"
    assert hint in result.stderr, result.stderr

    again = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    assert f"resuming {run} after epoch 1" in again.stdout
    finished = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert finished.returncode == 0, finished.stderr
    assert f"{run}: already finished, 2 of 2 epochs" in finished.stdout
    assert "training " not in finished.stdout

    straight = tmp_path / "straight"
    fit = ["fit", "--dataset", "digits", "--preset", "tiny", "--out", str(straight), *SHORT]
    assert main(fit) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    unbroken = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert [row["epoch"] for row in rows] == [1, 2]
    for key in ("loss", "recall@1", "map", "map_at_r"):
        assert rows[-1][key] == unbroken[-1][key], key
    a, b = load_file(str(run / "model.safetensors")), load_file(str(straight / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=0, rtol=0, msg=key)
