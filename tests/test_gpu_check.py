"""bench/gpu_check.py, the GPU check: its CPU rehearsal runs the same code at toy sizes,
so the check cannot rot between the rare runs on a GPU host."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


def _check(out: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'bench'}"}
    command = [sys.executable, str(REPO / "bench" / "gpu_check.py"), "--out", str(out), *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def test_rehearsal_runs_the_training_and_search_parts(tmp_path: Path):
    done = _check(tmp_path, "--rehearse", "--parts", "methods,search")
    assert done.returncode == 0, done.stderr
    methods = json.loads((tmp_path / "methods.json").read_text())
    assert "error" not in methods, methods.get("traceback")
    names = [row["method"] for row in methods["rows"]]
    assert names == ["JCF", "LaCViT (SupCon)", "DenseCL++"]
    for row in methods["rows"]:
        assert row["fp32 losses finite"] and row["amp losses finite"]
        moved, total = map(int, row["fp32 tensors moved"].split("/"))
        assert moved == total  # every trainable tensor took a step
    search = json.loads((tmp_path / "search.json").read_text())
    rows = {row["search"]: row for row in search["rows"]}
    # exact top-k in torch finds FAISS Flat's answers (float32; ties aside)
    assert rows["torch cpu exact, float32"]["recall@10"] >= 0.999
    assert 0 < rows["FAISS CPU IVF512,Flat nprobe=16"]["recall@10"] <= 1
    combined = json.loads((tmp_path / "gpu-check.json").read_text())
    assert combined["rehearsal"] is True and set(combined["parts"]) == {"methods", "search"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_without_a_gpu_each_part_is_skipped_with_the_reason(tmp_path: Path):
    done = _check(tmp_path, "--parts", "train,embed")
    assert done.returncode == 0, done.stderr
    for part in ("train", "embed"):
        result = json.loads((tmp_path / f"{part}.json").read_text())
        assert result["skipped"].startswith("no CUDA device: torch ")


def test_an_unknown_part_is_refused(tmp_path: Path):
    done = _check(tmp_path, "--parts", "train,nonsense")
    assert done.returncode == 2 and "unknown part(s) ['nonsense']" in done.stderr
