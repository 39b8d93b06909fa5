"""`vitrieval.index.factory`: the choice of `--factory auto` and its memory estimates."""

from __future__ import annotations

import numpy as np
import pytest

from vitrieval.index.factory import (
    FactoryError,
    choose_factory,
    estimate_bytes,
    format_bytes,
    ivf_lists,
    parse_bytes,
)

GIB = 1 << 30
MIB = 1 << 20


@pytest.mark.parametrize(
    ("n", "dim", "budget", "factory"),
    [
        (0, 128, None, "Flat"),
        (539, 128, None, "Flat"),
        (99_999, 512, None, "Flat"),
        (99_999, 512, GIB, "Flat"),
        # 4 sqrt(1e5) = 1265 -> 1024 lists
        (100_000, 512, None, "IVF1024,Flat"),
        (400_000, 384, None, "IVF2048,Flat"),  # 2530 -> 2048
        # 4000 -> 4096 lists, from which the quantizer is an HNSW graph
        (1_000_000, 384, None, "IVF4096_HNSW32,Flat"),
        # 4 sqrt(1e7) = 12649, capped by the 200k training sample: 200000 / 39 -> 4096
        (10_000_000, 384, None, "IVF4096_HNSW32,Flat"),
        # full vectors (1.9 GiB) exceed the budget: the largest PQ that fits
        (1_000_000, 512, GIB, "IVF4096_HNSW32,PQ256"),
        (1_000_000, 512, 256 * MIB, "IVF4096_HNSW32,PQ128"),
        (1_000_000, 512, 64 * MIB, "IVF4096_HNSW32,PQ32"),
        (1_000_000, 384, 64 * MIB, "IVF4096_HNSW32,PQ48"),  # m divides the dimension
        # a small catalogue whose Flat index is over the budget
        (50_000, 512, 50 * MIB, "IVF1024,PQ256"),
    ],
)
def test_choices(n, dim, budget, factory):
    choice = choose_factory(n, dim, budget)
    assert choice.factory == factory
    assert choice.memory_bytes <= (budget or float("inf"))
    assert (choice.file_bytes, choice.memory_bytes) == estimate_bytes(factory, n, dim)


@pytest.mark.parametrize(
    ("n", "dim", "budget", "factory"),
    [
        (1_000_000, 384, GIB, "IVF4096_HNSW32,SQ8"),  # one byte a dimension fits
        (10_000_000, 384, GIB, "IVF4096_HNSW32,PQ96"),  # SQ8 (3.6 GiB) does not
        (1_000_000, 384, None, "IVF4096_HNSW32,Flat"),  # no budget: full vectors
        (50_000, 128, None, "Flat"),
    ],
)
def test_a_target_recall_tries_scalar_codes_before_pq(n, dim, budget, factory):
    choice = choose_factory(n, dim, budget, target_recall=0.95)
    assert choice.factory == factory
    assert choice.memory_bytes <= (budget or float("inf"))
    if "SQ8" in factory or "PQ" in factory:
        assert choice.summary().endswith(
            "re-scored by the exact vectors and tuned to recall@10 0.95)"
        )


def test_the_summary_is_one_line_with_the_choice_and_its_memory():
    line = choose_factory(1_000_000, 512, GIB).summary()
    assert line == (
        "factory auto: IVF4096_HNSW32,PQ256 for 1,000,000 vectors of dimension 512, a FAISS "
        "index of about 261 MiB in memory (full vectors (1.92 GiB) exceed the 1 GiB budget; "
        "256 bytes per vector)"
    )
    assert choose_factory(539, 128).summary() == (
        "factory auto: Flat for 539 vectors of dimension 128, a FAISS index of about "
        "301 KiB in memory (exact search below 100,000 vectors, no budget)"
    )


def test_no_fitting_factory_is_an_error_that_names_the_smallest():
    with pytest.raises(FactoryError, match=r"smallest, IVF4096_HNSW32,PQ1, needs about"):
        choose_factory(10_000_000, 128, 10 * MIB)
    with pytest.raises(FactoryError, match=r"too few to train PQ codes \(9,984 needed\)"):
        choose_factory(5_000, 512, 5 * MIB)
    with pytest.raises(FactoryError, match="n >= 0 and dim >= 1"):
        choose_factory(10, 0)


def test_ivf_lists():
    assert ivf_lists(0) == ivf_lists(1) == 1
    assert ivf_lists(40) == 1  # 40 // 39 training points per list
    assert ivf_lists(100_000) == 1024
    assert ivf_lists(50_000) == 1024  # 894 -> 1024, within 50000 / 39 = 1282
    assert ivf_lists(10**9) == 4096


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("4G", 4 * GIB),
        ("4g", 4 * GIB),
        ("4GiB", 4 * GIB),
        ("4 GB", 4 * GIB),
        ("512M", 512 * MIB),
        ("1.5G", 3 * GIB // 2),
        ("800K", 800 * 1024),
        ("1000000", 1_000_000),
        ("100B", 100),
    ],
)
def test_parse_bytes(text, size):
    assert parse_bytes(text) == size


@pytest.mark.parametrize("text", ["", "G", "abc", "-1G", "4X", "0", "1.5.2G"])
def test_parse_bytes_refuses(text):
    with pytest.raises(FactoryError):
        parse_bytes(text)


def test_format_bytes():
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(261 * MIB) == "261 MiB"
    assert format_bytes(1000 * MIB) == "1000 MiB"
    assert format_bytes(3 * 1024 * GIB) == "3 TiB"


@pytest.mark.parametrize(
    ("factory", "n", "dim"),
    [
        ("Flat", 3000, 64),
        ("IVF32,Flat", 3000, 64),
        ("IVF32_HNSW32,Flat", 3000, 64),
        ("IVF16,PQ8", 3000, 64),
        ("IVF16,PQ16", 3000, 32),
        ("IVF16,SQ8", 3000, 64),
    ],
)
def test_estimate_matches_the_saved_index(tmp_path, factory, n, dim):
    """The estimate is the size of the FAISS file the store writes, within 1%."""
    from vitrieval.index.store import IndexStore

    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((n, dim)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    store = IndexStore.create(tmp_path / "index", dim=dim, factory=factory)
    if store.needs_training():
        store.train(vectors)
    store.add([str(i) for i in range(n)], vectors)
    store.save()
    written = next((tmp_path / "index").glob("seg.*.faiss")).stat().st_size
    file_bytes, memory_bytes = estimate_bytes(factory, n, dim)
    assert file_bytes == pytest.approx(written, rel=0.01)
    assert memory_bytes >= file_bytes
    with pytest.raises(FactoryError, match="no size estimate"):
        estimate_bytes("HNSW32", n, dim)
