"""ClassBalancedBatchSampler: P x K structure, determinism, small classes, errors."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from vitrieval.training.samplers import ClassBalancedBatchSampler

# 6 classes (labels not contiguous) with 10, 8, 6, 5, 3 and 1 items, interleaved.
SIZES = {0: 10, 3: 8, 4: 6, 7: 5, 9: 3, 12: 1}
LABELS = [c for i in range(max(SIZES.values())) for c, n in SIZES.items() if i < n]


def batches(sampler: ClassBalancedBatchSampler) -> list[list[int]]:
    return [list(b) for b in sampler]


def test_every_batch_is_p_classes_by_k_items():
    sampler = ClassBalancedBatchSampler(LABELS, 3, 2, seed=1, epoch_size=50)
    seen_classes = set()
    for batch in batches(sampler):
        assert len(batch) == 6
        counts = Counter(LABELS[i] for i in batch)
        assert len(counts) == 3 and set(counts.values()) == {2}
        # Grouped class after class.
        assert [LABELS[i] for i in batch[::2]] == [LABELS[i] for i in batch[1::2]]
        seen_classes |= set(counts)
    assert seen_classes == set(SIZES)


def test_without_replacement_for_large_classes_with_for_small():
    sampler = ClassBalancedBatchSampler(LABELS, 6, 4, seed=0, epoch_size=40)
    small_repeats = 0
    for batch in batches(sampler):
        for c, n in SIZES.items():
            items = [i for i in batch if LABELS[i] == c]
            assert len(items) == 4
            if n >= 4:
                assert len(set(items)) == 4  # drawn without replacement
            else:
                assert len(set(items)) <= n  # only n distinct items exist
                small_repeats += len(set(items)) < 4
        # The single-item class repeats its only index K times.
        assert [i for i in batch if LABELS[i] == 12] == [LABELS.index(12)] * 4
    assert small_repeats == 2 * 40


def test_large_class_items_vary_between_batches():
    sampler = ClassBalancedBatchSampler(LABELS, 6, 2, seed=0, epoch_size=30)
    drawn = {i for batch in batches(sampler) for i in batch if LABELS[i] == 0}
    assert len(drawn) == SIZES[0]


def test_deterministic_for_seed_and_epoch():
    a = ClassBalancedBatchSampler(LABELS, 3, 2, seed=5)
    b = ClassBalancedBatchSampler(LABELS, 3, 2, seed=5)
    a.set_epoch(2)
    b.set_epoch(2)
    assert batches(a) == batches(b)
    assert batches(a) == batches(a)  # iterating again in the same epoch repeats
    b.set_epoch(3)
    assert batches(a) != batches(b)
    c = ClassBalancedBatchSampler(LABELS, 3, 2, seed=6)
    c.set_epoch(2)
    assert batches(a) != batches(c)


def test_len():
    # 33 items, P * K = 6 -> 5 batches; epoch_size overrides; never 0.
    assert len(LABELS) == 33
    assert len(ClassBalancedBatchSampler(LABELS, 3, 2)) == 5
    assert len(batches(ClassBalancedBatchSampler(LABELS, 3, 2))) == 5
    assert len(ClassBalancedBatchSampler(LABELS, 3, 2, epoch_size=17)) == 17
    assert len(batches(ClassBalancedBatchSampler(LABELS, 3, 2, epoch_size=17))) == 17
    assert len(ClassBalancedBatchSampler(LABELS, 6, 10)) == 1
    assert ClassBalancedBatchSampler(LABELS, 6, 10).batch_size == 60


def test_accepts_tensor_and_array_labels():
    ref = batches(ClassBalancedBatchSampler(LABELS, 2, 3, seed=3))
    assert batches(ClassBalancedBatchSampler(torch.tensor(LABELS), 2, 3, seed=3)) == ref
    assert batches(ClassBalancedBatchSampler(np.array(LABELS), 2, 3, seed=3)) == ref


@pytest.mark.parametrize(
    ("labels", "p", "k", "kwargs", "message"),
    [
        ([], 2, 2, {}, "empty"),
        (LABELS, 7, 2, {}, r"classes_per_batch \(P\) = 7 is larger than the number of classes"),
        (LABELS, 2, 1, {}, r"samples_per_class \(K\) must be >= 2"),
        (LABELS, 0, 2, {}, r"classes_per_batch \(P\) must be >= 1"),
        (LABELS, 2, 2, {"epoch_size": 0}, "epoch_size"),
        ([0.0, 1.0], 2, 2, {}, "integers"),
    ],
)
def test_errors(labels, p, k, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ClassBalancedBatchSampler(labels, p, k, **kwargs)


def test_works_as_dataloader_batch_sampler():
    labels = torch.tensor(LABELS)
    features = torch.arange(len(LABELS), dtype=torch.float32)[:, None]
    dataset = TensorDataset(features, labels)
    sampler = ClassBalancedBatchSampler(LABELS, 3, 4, seed=0)
    sampler.set_epoch(1)
    loader = DataLoader(dataset, batch_sampler=sampler)
    assert len(loader) == len(sampler) == 2
    got = list(loader)
    assert len(got) == 2
    for (x, y), indices in zip(got, batches(sampler), strict=True):
        assert x.shape == (12, 1) and y.shape == (12,)
        assert x[:, 0].long().tolist() == indices
        assert y.tolist() == [LABELS[i] for i in indices]
        assert sorted(Counter(y.tolist()).values()) == [4, 4, 4]
