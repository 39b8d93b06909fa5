"""Shared by the `vitrieval-index` CLI tests: run the CLI in-process, capture its output."""

from __future__ import annotations

import pytest

from vitrieval.index.cli import main


def run(capsys: pytest.CaptureFixture, *argv: object) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `vitrieval-index ARGV`."""
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err
