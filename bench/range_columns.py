"""A sealed segment's numeric column against its field index, for ranges that vary.

An index of N items (default 200,000; 8-d Flat vectors, as only the metadata is
measured) with the metadata {"price": a float in [0, 1000)} is built once in a
temporary folder and saved as one sealed segment, whose columns file the save writes
(index/store/_columns.py). Then, side by side:

- the columns file's write (`columns.write_columns`: the path's rows read from the
  field index into id and value arrays, written to a file), what the save spent on
  it, and the peak of the memory it allocates (tracemalloc, which sees numpy's
  buffers; SQLite's page cache aside);
- a range at each of 1%, 10%, 50% and 100% of the items answered from the column
  (`NumberColumn.ids_in`, memory-mapped) and from the field index
  (`fields.index_ids`, an index range scan), the median of `--repeats` runs each, and
  their ratio; both answers are checked equal.

Run:  PYTHONPATH=. .venv/bin/python bench/range_columns.py [--n 200000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

from bench.machine import cpu_model, git, load_average
from vitrieval.index.store import IndexStore
from vitrieval.index.store import _field_index as fx
from vitrieval.index.store._columns import write_columns
from vitrieval.index.store.filters import parse_filter

SHARES = (0.01, 0.1, 0.5, 1.0)


def timed_read(read) -> tuple[float, float]:
    """(ms, peak MB allocated) of one call: timed untraced, then traced."""
    t0 = time.perf_counter()
    read()
    ms = 1e3 * (time.perf_counter() - t0)
    tracemalloc.start()
    read()
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    return ms, peak


def median_ms(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    if args.n < 1 or args.repeats < 1:
        ap.error("--n and --repeats must be at least 1")
    print(f"{cpu_model()}, {os.cpu_count()} cores; commit {git('rev-parse', '--short', 'HEAD')}; "
          f"load before {load_average()}", flush=True)  # fmt: skip
    rng = np.random.default_rng(0)
    prices = rng.uniform(0, 1000, size=args.n)
    vectors = rng.standard_normal((args.n, 8)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    with tempfile.TemporaryDirectory() as tmp:
        store = IndexStore.create(Path(tmp) / "idx", dim=8, factory="Flat", filter_fields=["price"])
        for start in range(0, args.n, 50_000):
            end = min(start + 50_000, args.n)
            store.add(
                [f"k{i}" for i in range(start, end)],
                vectors[start:end],
                metadata=[{"price": float(p)} for p in prices[start:end]],
            )
        store.save()
        store.close()
        store = IndexStore.open(Path(tmp) / "idx")
        segment = store._state.sealed[0]
        column = segment.columns.numbers["price"]
        assert column.ids.size == args.n
        written = Path(tmp) / "columns.again"
        write_ms, write_mb = timed_read(lambda: write_columns(segment._db, written))
        column_mb = written.stat().st_size / 2**20
        print(f"\nN = {args.n:,}; the columns file holds {column_mb:.1f} MB\n")
        print("| the columns file's write | ms | µs an item | peak MB allocated |")
        print("|---|---:|---:|---:|")
        print(f"| write_columns | {write_ms:.0f} | {1e3 * write_ms / args.n:.2f} "
              f"| {write_mb:.1f} |\n")  # fmt: skip
        print("| range | items | column ms | field index ms | index / column |")
        print("|---|---:|---:|---:|---:|")
        for share in SHARES:
            raw = {"must": [{"key": "price", "range": {"lt": 1000 * share}}]}
            leaf = parse_filter(raw).must[0]
            found = column.ids_in(leaf)
            assert np.array_equal(found, fx.index_ids(segment._db, leaf))
            col_ms = median_ms(lambda leaf=leaf: column.ids_in(leaf), args.repeats)
            idx_ms = median_ms(lambda leaf=leaf: fx.index_ids(segment._db, leaf), args.repeats)
            print(f"| price < {1000 * share:g} ({share:.0%}) | {found.size:,} | {col_ms:.2f} | "
                  f"{idx_ms:.2f} | {idx_ms / col_ms:.0f}x |")  # fmt: skip
        store.close()
    print(f"\nload after {load_average()}")


if __name__ == "__main__":
    main()
