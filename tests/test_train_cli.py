"""`vitrieval-train fit` and `export` end to end on small data, resume, and user errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from safetensors.torch import load_file

from vitrieval.index.runtime.model_metadata import read_model_metadata
from vitrieval.training.cli import main
from vitrieval.training.config import FitConfig, load_config_file
from vitrieval.training.trainer import fit

FAST = ["--epochs", "2", "--batch-size", "128", "--workers", "0", "--warmup-epochs", "1"]


def test_fit_and_export_digits(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["fit", "--dataset", "digits", "--preset", "tiny", "--out", str(run), *FAST]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["epoch"] for row in rows] == [1, 2]
    for row in rows:
        assert {"epoch", "loss", "recall@1", "map", "map_at_r", "r_precision"} <= set(row)
        assert 0.0 <= row["map"] <= row["recall@1"] <= 1.0
    assert rows[1]["loss"] < rows[0]["loss"]
    assert rows[1]["recall@1"] > 0.3  # far above chance (0.1) after two epochs
    assert rows[0]["n_queries"] == 539  # leave-one-out over the stratified 30% held-out split
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["backbone"] == "tiny" and saved["pool"] == "ggem" and saved["layer_decay"] == 1.0
    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the checkpoint holds the last epoch only, and the run's weights are that file
    kept = sorted(p.name for p in (run / "checkpoint").iterdir())
    assert kept == [
        "loss-2.safetensors",
        "model-2.safetensors",
        "optimizer-2.safetensors",
        "state.json",
    ]
    assert (run / "model.safetensors").samefile(run / "checkpoint" / "model-2.safetensors")
    out = capsys.readouterr().out
    assert "done: 2 epochs" in out

    onnx_path = tmp_path / "model.onnx"
    assert main(["export", "--run", str(run), "--out", str(onnx_path)]) == 0
    meta = read_model_metadata(onnx_path)
    assert meta.embedding_dim == 128 and meta.pooling == "ggem"
    assert "max |diff|" in capsys.readouterr().out


def _final_weights(run):
    return load_file(str(run / "model.safetensors"))


def test_resume_continues_exactly(tmp_path):
    common = dict(dataset="digits", epochs=2, batch_size=256, workers=0, warmup_epochs=1.0, seed=3)
    straight = tmp_path / "straight"
    fit(FitConfig(out=str(straight), **common))
    broken = tmp_path / "broken"
    fit(FitConfig(out=str(broken), **{**common, "epochs": 1}))
    # what a crash after epoch 1 leaves behind, then `fit --resume --epochs 2`
    assert main(["fit", "--out", str(broken), "--resume", "--epochs", "2"]) == 0
    a, b = _final_weights(straight), _final_weights(broken)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=0, rtol=0, msg=key)
    rows = [json.loads(line) for line in (broken / "metrics.jsonl").read_text().splitlines()]
    assert [row["epoch"] for row in rows] == [1, 2]


@pytest.mark.parametrize(
    "argv",
    [
        ["fit", "--out", "r"],
        ["pretrain", "--images", "d", "--out", "r"],
        ["export", "--run", "r", "--out", "m.onnx"],
        ["analyze", "--model", "m.onnx", "--out", "plots"],
    ],
)
def test_global_flags_before_and_after_the_command(argv):
    from vitrieval.training.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(argv).verbose is False
    for flag in ("-v", "--verbose"):
        assert parser.parse_args([flag, *argv]).verbose is True
        assert parser.parse_args([*argv, flag]).verbose is True


def test_existing_run_needs_resume(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoint").mkdir(parents=True)
    (run / "checkpoint" / "state.json").write_text('{"epoch": 1}')
    assert main(["fit", "--out", str(run), *FAST]) == 2
    assert "--resume" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--pool", "gemm"], "valid names: avg, ccbp, cls, gem, ggem, jcf, max"),
        (["--loss", "nope"], "valid names: norm_softmax"),
        (["--preset", "huge"], "unknown backbone 'huge'"),
        (["--dataset", "folder", "--data-root", "/nonexistent/photos"], "/nonexistent/photos"),
        (["--dataset", "imagenet"], "unknown dataset"),
        (["--dataset", "cub"], "root"),
        (["--epochs", "-1"], "--epochs must be >= 0"),
        (["--pool-groups", "3"], "cannot be split into 3 groups"),
        (["--dim", "0"], "--dim must be >= 1"),
        (["--pretrained", "/nonexistent/w.safetensors"], "not found"),
        (["--loss", "triplet", "--mining", "nope"], "--mining must be one of all | batch_hard"),
        (["--loss", "triplet", "--samples-per-class", "1"], "--samples-per-class must be >= 2"),
        (["--loss", "triplet", "--classes-per-batch", "0"], "--classes-per-batch must be >= 1"),
    ],
)
def test_user_errors_are_one_line_without_traceback(tmp_path, capsys, args, needle):
    assert main(["fit", "--out", str(tmp_path / "new" / "r"), *args]) == 2
    err = capsys.readouterr().err
    assert needle in err
    assert "Traceback" not in err
    assert err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []  # no empty run folder (nor its parent) left behind


def test_a_failed_fit_keeps_folders_it_did_not_create_and_files_of_value(tmp_path, capsys):
    missing = ["--dataset", "folder", "--data-root", str(tmp_path / "nope")]
    existing = tmp_path / "existing"
    existing.mkdir()
    assert main(["fit", "--out", str(existing), *missing, *FAST]) == 2
    assert existing.is_dir()
    assert (
        main(["pretrain", "--images", str(tmp_path / "nope"), "--out", str(tmp_path / "pre")]) == 2
    )
    assert not (tmp_path / "pre").exists()
    # no readable image: the run folder stays, with the list that says why
    photos = tmp_path / "photos"
    for label in ("a", "b"):
        (photos / label).mkdir(parents=True)
        for i in range(3):
            (photos / label / f"{i}.png").write_text("not an image")
    run = tmp_path / "run"
    folder = ["--dataset", "folder", "--data-root", str(photos)]
    assert main(["fit", "--out", str(run), *folder, *FAST]) == 2
    assert "no readable training images" in capsys.readouterr().err
    assert sorted(p.name for p in run.iterdir()) == ["skipped.txt"]


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("lr: abc\n", "lr must be a number, got 'abc'"),
        ("epochs: 2.5\n", "epochs must be an integer, got 2.5"),
        ("amp: 3\n", "amp must be true or false, got 3"),
        ("method: [ce]\n", "method must be text"),
        ("seed: null\n", "seed must be an integer, got None"),
    ],
)
@pytest.mark.parametrize("command", ["fit", "pretrain"])
def test_config_file_values_of_the_wrong_type_are_one_line_errors(
    tmp_path, capsys, command, text, needle
):
    config = tmp_path / "c.yaml"
    config.write_text(text)
    argv = [command, "--out", str(tmp_path / "r"), "--config", str(config)]
    assert main([*argv, "--images", str(tmp_path)] if command == "pretrain" else argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and err.count("\n") == 1


def test_config_file_values_take_the_flag_types(tmp_path):
    """YAML reads `1e-4` (no dot) as text and `3.0` as a float: the flags' types win."""
    config = tmp_path / "c.yaml"
    config.write_text("lr: 1e-4\nepochs: 3.0\ndim: null\nout: runs/x\n")
    values = load_config_file(config)
    assert values == {"lr": 1e-4, "epochs": 3, "dim": None, "out": "runs/x"}
    assert isinstance(values["epochs"], int)


def test_recipe_values_are_checked_like_config_files(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("stages:\n  - name: one\n    lr: fast\n")
    assert main(["fit", "--out", str(tmp_path / "run"), "--recipe", str(recipe)]) == 2
    assert "stage one: lr must be a number, got 'fast'" in capsys.readouterr().err
    recipe.write_text("stages:\n  - just a string\n")
    assert main(["fit", "--out", str(tmp_path / "run"), "--recipe", str(recipe)]) == 2
    assert "each a mapping with a `name`" in capsys.readouterr().err


def test_out_that_is_a_file_is_refused(tmp_path, capsys):
    out = tmp_path / "file"
    out.write_text("x")
    assert main(["fit", "--out", str(out)]) == 2
    assert main(["pretrain", "--out", str(out), "--images", str(tmp_path)]) == 2
    assert capsys.readouterr().err.count("is a file; a run needs a folder") == 2


def test_corrupt_images_are_skipped_and_counted(tmp_path, capsys):
    rng = np.random.default_rng(0)
    root = tmp_path / "photos"
    for c, colour in enumerate([(220, 30, 30), (30, 220, 30), (30, 30, 220)]):
        folder = root / f"class_{c}"
        folder.mkdir(parents=True)
        for i in range(6):
            pixels = np.clip(rng.normal(colour, 25, (40, 40, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(folder / f"{i}.png")
    (root / "class_1" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 truncated")
    run = tmp_path / "run"
    code = main(
        [
            "fit",
            "--dataset",
            "folder",
            "--data-root",
            str(root),
            "--out",
            str(run),
            "--epochs",
            "1",
            "--workers",
            "0",
            "--batch-size",
            "8",
        ]
    )
    assert code == 0
    assert "skipped 1 unreadable images" in capsys.readouterr().out
    skipped = (run / "skipped.txt").read_text()
    assert "broken.jpg" in skipped and skipped.count("\n") == 1


def test_console_script_is_installed():
    exe = shutil.which("vitrieval-train") or str(
        __import__("pathlib").Path(sys.executable).parent / "vitrieval-train"
    )
    result = subprocess.run([exe, "fit", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0
    assert "--preset" in result.stdout and "--pool" in result.stdout


# `python -c` with torch and timm unimportable (a None entry in sys.modules makes
# `import torch` raise ImportError), then `vitrieval-train ARGV`.
WITHOUT_TORCH = """
import sys
for name in ("torch", "timm", "torchvision"):
    sys.modules[name] = None
from vitrieval.training.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["fit", "--help"], ["pretrain", "--help"], ["export", "--help"], ["-v", "--help"]],
)
def test_help_imports_neither_torch_nor_timm(argv):
    """Parsing and --help are instant: torch and timm are imported by the commands only."""
    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, "-c", WITHOUT_TORCH, *argv]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=root)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: vitrieval-train")


def test_without_torch_a_command_that_needs_it_fails():
    """The check above means something: the same blocking stops `fit --list-backbones`."""
    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, "-c", WITHOUT_TORCH, "fit", "--list-backbones"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=root)
    # the blocked import reaches the command: one line naming the install it needs
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "is not installed; training needs pip install" in lines[0]


def test_triplet_loss_trains_with_class_balanced_batches(tmp_path, capsys):
    run = tmp_path / "run"
    args = ["fit", "--dataset", "digits", "--pool", "avg", "--loss", "triplet", "--out", str(run)]
    assert main([*args, "--epochs", "1", "--samples-per-class", "4", "--workers", "0"]) == 0
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["sampler"] == "pk" and saved["mining"] == "batch_hard"
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert row["loss"] > 0 and row["recall@1"] > 0.2


def test_more_classes_per_batch_than_classes_is_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    args = ["fit", "--dataset", "digits", "--pool", "avg", "--loss", "triplet", "--out", str(run)]
    assert main([*args, "--classes-per-batch", "11", *FAST]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "--classes-per-batch 11 is larger than the 10 classes" in err.strip().splitlines()[-1]


def test_recipe_runs_stages_in_order(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "common: {pool: avg, epochs: 1, workers: 0, batch_size: 256}\n"
        "stages:\n"
        "  - {name: head, freeze_backbone: true}\n"
        "  - {name: full, lr: 1.0e-4}\n"
    )
    run = tmp_path / "run"
    assert main(["fit", "--recipe", str(recipe), "--out", str(run)]) == 0
    head = yaml.safe_load((run / "head" / "config.yaml").read_text())
    full = yaml.safe_load((run / "full" / "config.yaml").read_text())
    assert head["freeze_backbone"] is True and head["init"] is None
    assert full["init"] == str(run / "head") and full["lr"] == 1e-4
    # the frozen stage changed the head only: backbone weights equal a fresh seed-0 model
    from vitrieval.training.run_folder import model_from_config

    torch.manual_seed(0)
    fresh = model_from_config(FitConfig(out="x", pool="avg"))
    trained = load_file(str(run / "head" / "model.safetensors"))
    key = "backbone.blocks.0.attn.qkv.weight"
    torch.testing.assert_close(trained[key], fresh.state_dict()[key])
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages: [{name: a, colour: red}]\n")
    assert main(["fit", "--recipe", str(bad), "--out", str(run)]) == 2
    assert "unknown options colour" in capsys.readouterr().err


def test_grad_scaler_state_survives_a_checkpoint(tmp_path):
    """The fp16 loss scale goes into state.json and comes back on resume (off: nothing)."""
    from vitrieval.training.checkpoint import restore_scaler, scaler_state

    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    grad = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([grad], lr=0.1)
    for _ in range(4):  # one growth step (x2 after 3 finite steps), counter at 1
        scaler.scale(grad.sum()).backward()
        scaler.step(optimizer)
        scaler.update()
    saved = json.loads(json.dumps({"grad_scaler": scaler_state(scaler)}))
    fresh = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    restore_scaler(fresh, saved)
    assert fresh.get_scale() == scaler.get_scale() == 2048.0
    assert fresh.state_dict() == scaler.state_dict()
    off = torch.amp.GradScaler("cpu", enabled=False)
    assert scaler_state(off) == {}
    restore_scaler(off, saved)  # a disabled scaler ignores a saved scale
    assert not off.is_enabled()
    restore_scaler(fresh, None)  # a checkpoint from before this record
    assert fresh.get_scale() == 2048.0


def test_claim_run_folder(tmp_path):
    """A run folder holding a run needs --resume; a resumed checkpoint must be its kind."""
    from vitrieval.training.run_folder import TrainingError, claim_run_folder

    claim_run_folder(tmp_path / "new", resume=False)  # nothing there: fine
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "state.json").write_text(json.dumps({"stage": "pretrain"}))
    with pytest.raises(TrainingError, match="already holds a run; pass --resume"):
        claim_run_folder(tmp_path, resume=False)
    claim_run_folder(tmp_path, resume=True)  # fit (no stage) resumes whatever is there
    claim_run_folder(tmp_path, resume=True, stage="pretrain", kind="pretrain")
    with pytest.raises(TrainingError, match="is not a lacvit run; cannot resume it"):
        claim_run_folder(tmp_path, resume=True, stage="contrastive", kind="lacvit")


def test_mixed_precision_on_cpu_is_a_plain_clipped_step():
    """Off the GPU, MixedPrecision is float32: no autocast, no scaling; its step equals
    zero_grad + backward + clip_grad_norm_ + step done by hand."""
    from vitrieval.training.amp import MixedPrecision

    amp = MixedPrecision(True, torch.device("cpu"))
    assert not amp.on and amp.active_dtype is None and not amp.scaler.is_enabled()
    assert amp.state() == {}
    weights = []
    for by_hand in (False, True):
        torch.manual_seed(0)
        layer = torch.nn.Linear(4, 3)
        optimizer = torch.optim.SGD(layer.parameters(), lr=0.5)
        for _ in range(3):
            with amp.autocast():
                loss = (layer(torch.ones(2, 4)) ** 2).sum() * 10  # large: clipping bites
            assert loss.dtype == torch.float32
            if by_hand:
                optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(layer.parameters(), 0.1)
                optimizer.step()
            else:
                amp.optimizer_step(loss, optimizer, layer.parameters(), 0.1)
        weights.append(layer.weight.detach().clone())
    torch.testing.assert_close(weights[0], weights[1], rtol=0, atol=0)
