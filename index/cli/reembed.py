"""`vitrieval-index reembed SRC --model NEW.onnx --out DST`: a new index of SRC's items
embedded by another model (index/reembed.py); resumable."""

from __future__ import annotations

import argparse
from pathlib import Path

from .arguments import Subcommands
from .common import add_runtime_options, checked_save_every, embedder_from_args


def add_reembed_command(sub: Subcommands) -> None:
    cmd = sub.add_parser("reembed", help="build a new index of an index's items with another model")
    cmd.add_argument("src", help="the index whose items to embed again")
    cmd.add_argument("--model", required=True, help="the new model (.onnx)")
    cmd.add_argument("--out", required=True, help="the new index folder (a re-run resumes it)")
    cmd.add_argument("--save-every", type=int, metavar="N", help="images per commit (default 2048)")
    add_runtime_options(cmd)
    cmd.set_defaults(handler=_reembed)


def _reembed(args: argparse.Namespace) -> int:
    from ..reembed import REPORT_FILE, reembed

    save_every = checked_save_every(args.save_every, 2048)
    out = Path(args.out)
    report = reembed(
        Path(args.src), out, embedder_from_args(Path(args.model), args), save_every=save_every
    )
    assert report.build is not None
    left = len(report.no_image) + len(report.image_gone)
    note = f"; {left} without an image left out (see {out / REPORT_FILE})" if left else ""
    print(report.build.summary(out) + note)
    return 0
