"""Class-balanced P x K batches: what triplet (and any pair-based) loss needs.

Each batch holds P = `classes_per_batch` distinct classes and K = `samples_per_class`
dataset indices of each, so every item has K - 1 positives and (P - 1) K negatives.

    sampler = ClassBalancedBatchSampler(labels, classes_per_batch=8, samples_per_class=4)
    loader = DataLoader(dataset, batch_sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for images, labels in loader: ...
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import Sampler


class ClassBalancedBatchSampler(Sampler[list[int]]):
    """Yields batches (lists of P * K dataset indices, grouped by class, class after class).

    - Classes: each batch draws P classes uniformly without replacement from all classes,
      independently of the other batches.
    - Items: a class with >= K items gives K distinct items (without replacement); a class
      with fewer than K items gives K items drawn *with* replacement, so the batch still has
      exactly K entries per class (some indices repeated; a repeated index is a positive at
      distance 0 for a triplet loss, which is harmless).
    - Length: `epoch_size` batches per epoch if given, else max(1, len(labels) // (P * K)),
      i.e. about one pass over the data.
    - Determinism: the batches are a function of (seed, epoch) only; `set_epoch(epoch)`
      reseeds like `DistributedSampler`, and iterating twice in one epoch repeats the batches.

    Labels are any integers (a sequence, tensor or array); they need not be contiguous.
    """

    def __init__(
        self,
        labels: Sequence[int],
        classes_per_batch: int,
        samples_per_class: int,
        *,
        seed: int = 0,
        epoch_size: int | None = None,
    ):
        label_tensor = torch.as_tensor(labels).reshape(-1)
        if label_tensor.numel() == 0:
            raise ValueError("labels is empty: a class-balanced sampler needs labelled items")
        if label_tensor.is_floating_point() or label_tensor.is_complex():
            raise ValueError(f"labels must be integers, got {label_tensor.dtype}")
        if samples_per_class < 2:
            raise ValueError(
                f"samples_per_class (K) must be >= 2 so that every item has a positive, "
                f"got {samples_per_class}"
            )
        if classes_per_batch < 1:
            raise ValueError(f"classes_per_batch (P) must be >= 1, got {classes_per_batch}")
        if epoch_size is not None and epoch_size < 1:
            raise ValueError(f"epoch_size must be >= 1 batch, got {epoch_size}")

        # Group indices by class with one sort (no loop over the labels).
        label_tensor = label_tensor.long()
        order = torch.argsort(label_tensor, stable=True)
        classes, counts = torch.unique_consecutive(label_tensor[order], return_counts=True)
        if classes_per_batch > len(classes):
            raise ValueError(
                f"classes_per_batch (P) = {classes_per_batch} is larger than the number of "
                f"classes in labels ({len(classes)})"
            )
        self.classes: list[int] = classes.tolist()
        self.class_indices: list[torch.Tensor] = list(torch.split(order, counts.tolist()))
        self.num_items = label_tensor.numel()
        self.classes_per_batch = classes_per_batch
        self.samples_per_class = samples_per_class
        self.seed = seed
        self.epoch = 0
        self.epoch_size = epoch_size

    @property
    def batch_size(self) -> int:
        return self.classes_per_batch * self.samples_per_class

    def set_epoch(self, epoch: int) -> None:
        """Select the batches of `epoch` (call before iterating, once per epoch)."""
        self.epoch = epoch

    def __len__(self) -> int:
        if self.epoch_size is not None:
            return self.epoch_size
        return max(1, self.num_items // self.batch_size)

    def _sample_class(self, members: torch.Tensor, generator: torch.Generator) -> list[int]:
        k = self.samples_per_class
        if len(members) >= k:
            picks = torch.randperm(len(members), generator=generator)[:k]
        else:
            picks = torch.randint(len(members), (k,), generator=generator)
        return members[picks].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        for _ in range(len(self)):
            chosen = torch.randperm(len(self.classes), generator=generator)
            batch: list[int] = []
            for c in chosen[: self.classes_per_batch].tolist():
                batch.extend(self._sample_class(self.class_indices[c], generator))
            yield batch
