"""Training losses, one per module, registered by name.

Their options and defaults are declared in training/options.py (LOSSES for the
registered ones); the factories pass options on to the constructors, which take the
defaults from there.
"""

from __future__ import annotations

from typing import Any

from .base import MetricLoss, check_embeddings_and_labels, check_paired_views
from .dense_contrastive import DenseContrastiveLoss
from .info_nce import InfoNCELoss
from .norm_softmax import NormSoftmaxLoss
from .registry import UnknownLossError, create_loss, loss_names, register_loss
from .supcon import SupConLoss, create_supcon
from .triplet import TripletMarginLoss, create_triplet


@register_loss("norm_softmax")
def _norm_softmax(embedding_dim: int, num_classes: int, **options: Any) -> MetricLoss:
    return NormSoftmaxLoss(embedding_dim, num_classes, **options)


register_loss("triplet")(create_triplet)
register_loss("supcon")(create_supcon)

# InfoNCELoss and DenseContrastiveLoss are not registered: the registry's factories make
# `fit --loss` losses of labelled embeddings; these take two views per image (pretrain).
__all__ = [
    "DenseContrastiveLoss",
    "InfoNCELoss",
    "MetricLoss",
    "NormSoftmaxLoss",
    "SupConLoss",
    "TripletMarginLoss",
    "UnknownLossError",
    "check_embeddings_and_labels",
    "check_paired_views",
    "create_loss",
    "loss_names",
    "register_loss",
]
