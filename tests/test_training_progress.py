"""What `vitrieval-train` tells a user while it works: a first line before the slow
imports, elapsed and remaining time per epoch, "already finished" on a resume with
nothing left, the presets in `--list-backbones`, and a fast, clear failure of
`--pretrained timm` without a network (training/progress.py, training/backbones.py)."""

from __future__ import annotations

import json
import logging
import socket
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vitrieval.training import progress
from vitrieval.training.backbones import PRESETS, BackboneError, create_backbone
from vitrieval.training.cli import main
from vitrieval.training.progress import EpochClock, clock

FAST = ["--epochs", "2", "--batch-size", "128", "--workers", "0", "--warmup-epochs", "1"]


def test_clock_and_the_estimate_of_the_time_left(monkeypatch):
    assert [clock(s) for s in (0, 59.4, 61, 3599, 3600, 7325)] == [
        "0:00",
        "0:59",
        "1:01",
        "59:59",
        "1:00:00",
        "2:02:05",
    ]
    now = [100.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now[0])
    resumed = EpochClock(done=10, epochs=80)  # a run resumed after epoch 10
    now[0] += 60  # two epochs of 30 s
    assert resumed.text(12) == "elapsed 1:00, about 34:00 left"  # 68 epochs x 30 s
    now[0] += 30
    assert resumed.text(80) == "elapsed 1:30"


def _small_folder(root: Path) -> Path:
    """40 small images of 4 classes (a colour each, with noise): a fit of seconds."""
    rng = np.random.default_rng(0)
    for c in range(4):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(10):
            pixels = rng.integers(0, 96, (32, 32, 3)) + np.eye(3, dtype=int)[c % 3] * 150
            Image.fromarray(pixels.astype(np.uint8)).save(root / f"c{c}" / f"{i}.png")
    return root


def test_fit_says_what_it_prepares_times_its_epochs_and_knows_when_it_is_done(tmp_path, capsys):
    run = tmp_path / "run"
    data = ["--dataset", "folder", "--data-root", str(_small_folder(tmp_path / "images"))]
    args = ["fit", *data, "--preset", "tiny", "--out", str(run), *FAST, "--batch-size", "8"]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    # before torch is imported, the first line says what is coming
    assert lines[0].startswith(f"fit: preparing {run}: loading torch, the folder images"), lines
    epochs = [line for line in lines if line.startswith("epoch ")]
    assert len(epochs) == 2, lines
    assert epochs[0].startswith("epoch 1/2") and "elapsed " in epochs[0]
    assert epochs[0].endswith(" left") and ", about " in epochs[0]
    assert "elapsed " in epochs[1] and not epochs[1].endswith(" left")

    files = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert main(["fit", "--out", str(run), "--resume"]) == 0
    out = capsys.readouterr().out
    assert "training " not in out, out
    assert out.startswith(f"{run}: already finished, 2 of 2 epochs, held-out R@1 "), out
    assert f"R@1 {last['recall@1']:.4f} mAP {last['map']:.4f}" in out
    assert out.count("\n") == 1, out  # one line, nothing prepared or loaded
    # nothing rewritten: `make demo` redoes nothing made from the run
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()} == files


def test_a_recipe_says_what_it_prepares_before_the_trainer_loads(tmp_path, capsys, monkeypatch):
    import sys
    import types

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("stages:\n  - {name: head}\n  - {name: full}\n")
    seen_when_loaded: list[str] = []

    def fit(cfg):  # what the trainer module is asked for, once it is imported
        seen_when_loaded.append(capsys.readouterr().out)
        raise SystemExit(0)

    monkeypatch.setitem(sys.modules, "vitrieval.training.trainer", types.SimpleNamespace(fit=fit))
    with pytest.raises(SystemExit):
        main(["fit", "--recipe", str(recipe), "--out", str(tmp_path / "run")])
    first = seen_when_loaded[0].splitlines()[0]
    assert (
        first
        == f"fit: recipe {recipe}, stages head, full into {tmp_path / 'run'}: loading torch ..."
    )


def test_list_backbones_starts_with_the_presets(capsys):
    assert main(["fit", "--list-backbones"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("presets")
    for i, name in enumerate(PRESETS, start=1):
        assert lines[i].split()[0] == name
        assert PRESETS[name].description in lines[i]
    assert lines[len(PRESETS) + 1].startswith("timm ViTs (")
    assert "  vit_small_patch16_224" in lines


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_pretrained_timm_without_a_network_fails_at_once(tmp_path, monkeypatch, caplog):
    """Unreachable (here: a proxy that refuses), timm's hub client would retry each
    file for about a minute; the hub is probed once and the local cache alone is tried."""
    import huggingface_hub.constants as hub_constants

    monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    caplog.set_level(logging.WARNING)
    started = time.monotonic()
    with pytest.raises(BackboneError) as info:
        create_backbone("vit_tiny_patch16_224", "timm")
    message = str(info.value)
    assert "no network" in message and "not in the local cache" in message, message
    assert message.endswith("pass --pretrained PATH with a local weights file instead")
    assert "\n" not in message
    assert not [r for r in caplog.records if "Retrying" in r.getMessage()]
    assert time.monotonic() - started < 30  # generous: the retries took over a minute
    assert hub_constants.HF_HUB_OFFLINE is False  # offline only for that one call
