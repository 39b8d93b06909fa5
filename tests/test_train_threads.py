"""`--threads` of `fit` and `pretrain`: parsed and checked, `auto` resolved by its rule,
and the count used recorded in the run's config."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from vitrieval.training.cli import build_parser, main
from vitrieval.training.threads import (
    MAX_AUTO_THREADS,
    ThreadsError,
    auto_threads,
    parse_threads,
    resolve_threads,
)


@pytest.fixture
def torch_threads():
    """A test that runs `fit` sets this process's torch threads: put them back after."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("cores", "workers", "threads"),
    [
        (1, 0, 1),  # never fewer than one
        (2, 0, 1),  # the 2-core host: one for training, one for the rest
        (2, 1, 1),
        (2, 4, 1),  # more workers than cores: still one
        (4, 0, 3),
        (8, 4, 3),
        (16, 4, MAX_AUTO_THREADS),  # capped
    ],
)
def test_auto_leaves_a_core_per_worker_and_one_spare(cores, workers, threads):
    assert auto_threads(cores, workers) == threads
    assert resolve_threads("auto", workers, cores=cores) == threads


def test_a_number_is_taken_as_given():
    assert parse_threads("auto") is None
    assert parse_threads("3") == 3
    assert parse_threads(2) == 2
    assert resolve_threads("5", workers=4, cores=2) == 5


@pytest.mark.parametrize("value", ["0", "-1", "x", "1.5", ""])
def test_parse_refuses_what_is_no_thread_count(value):
    with pytest.raises(ThreadsError, match="--threads must be auto or an integer >= 1"):
        parse_threads(value)


def test_fit_and_pretrain_both_take_the_flag():
    parser = build_parser()
    for command in (["fit"], ["pretrain"]):
        assert parser.parse_args([*command, "--threads", "2"]).threads == "2"
        assert parser.parse_args(command).threads is None  # the config's default applies


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
@pytest.mark.parametrize("command", ["fit", "pretrain"])
def test_bad_values_are_one_line_errors(tmp_path, capsys, command, value):
    run = tmp_path / "run"
    extra = ["--images", str(tmp_path)] if command == "pretrain" else []
    assert main([command, "--out", str(run), *extra, f"--threads={value}"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines() == [
        f"vitrieval-train {command}: error: --threads must be auto or an integer >= 1, "
        f"got {value if value.lstrip('-').isdigit() else repr(value)}"
    ]
    assert not run.exists()


def test_fit_records_the_threads_it_used(tmp_path, capsys, torch_threads):
    rng = np.random.default_rng(0)
    root = tmp_path / "photos"
    for c, colour in enumerate([(220, 30, 30), (30, 220, 30)]):
        folder = root / f"class_{c}"
        folder.mkdir(parents=True)
        for i in range(4):
            pixels = np.clip(rng.normal(colour, 25, (32, 32, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(folder / f"{i}.png")
    run = tmp_path / "run"
    args = ["fit", "--dataset", "folder", "--data-root", str(root), "--out", str(run)]
    args += ["--epochs", "1", "--workers", "0", "--batch-size", "4", "--threads", "1"]
    assert main(args) == 0
    assert yaml.safe_load((run / "config.yaml").read_text())["threads"] == 1
    assert torch.get_num_threads() == 1
    assert "torch threads: 1 (--threads 1, 0 data-loading workers" in capsys.readouterr().out
