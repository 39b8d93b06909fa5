"""docs/python.md's examples, run as written: every ```python block of a section in one
namespace, in order, in a folder holding `model.onnx` (an exported model) and `images/`
(digit PNGs, a folder per label). The client's section runs against a real server on
loopback whose write key is the page's `my-secret-write-key`; its address replaces the page's
`http://localhost:8000`."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from serving import Server

DOCS = Path(__file__).resolve().parents[1] / "docs" / "python.md"
PAGE_URL = "http://localhost:8000"
PAGE_KEY = "my-secret-write-key"


def sections(text: str) -> dict[str, list[str]]:
    """ "## heading" -> the ```python blocks under it (its ### subsections included)."""
    found: dict[str, list[str]] = {}
    for part in re.split(r"^## ", text, flags=re.M)[1:]:
        heading, _, body = part.partition("\n")
        found[heading.strip()] = re.findall(r"^```python\n(.*?)^```", body, re.S | re.M)
    return found


def test_the_block_reader_finds_each_sections_blocks():
    text = "# t\n## A\n```python\nx = 1\n```\n### A.1\n```python\ny = 2\n```\n## B\n```\nz\n```\n"
    assert sections(text) == {"A": ["x = 1\n", "y = 2\n"], "B": []}


@pytest.fixture
def folder(digits_gallery: dict[str, Path], tmp_path: Path, monkeypatch) -> Path:
    shutil.copy(digits_gallery["model"], tmp_path / "model.onnx")
    shutil.copytree(digits_gallery["images"], tmp_path / "images")
    (tmp_path / "images" / "list.csv").unlink()  # the page walks the image files only
    monkeypatch.chdir(tmp_path)
    return tmp_path


def run_blocks(blocks: list[str], name: str) -> dict:
    assert blocks, f"docs/python.md: no python example under {name!r}"
    namespace: dict = {"__name__": "docs_python"}
    for number, block in enumerate(blocks, 1):
        exec(compile(block, f"docs/python.md [{name} #{number}]", "exec"), namespace)
    return namespace


def test_the_python_api_examples_run(folder):
    namespace = run_blocks(sections(DOCS.read_text())["The Python API"], "The Python API")
    assert (folder / "my-index" / "manifest.json").is_file()
    assert (folder / "my-run" / "model.onnx").is_file()
    assert namespace["metrics"]["n_queries"] > 0


def test_the_client_examples_run(folder, served_index, digits_gallery):
    server = Server(
        digits_gallery["model"], served_index, env={"VITRIEVAL_API_KEY": PAGE_KEY}
    ).wait_ready()
    try:
        blocks = [
            block.replace(PAGE_URL, server.url)
            for block in sections(DOCS.read_text())["The HTTP client"]
        ]
        run_blocks(blocks, "The HTTP client")
    finally:
        server.stop()
