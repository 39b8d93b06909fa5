"""Dense contrastive loss: DenseCL's (eq. 1 of the DenseCL++ paper, docs/papers.md) and
DenseCL++'s (eq. 2, 3).

Inputs are two views per image, views i and i + B of image i, and p(a) = (a + B) mod 2B
is the other view of anchor view a's image:

- z (2B, T, c): the dense projections of the T patch tokens, L2-normalised;
- f (2B, T, C): the backbone's patch tokens, used only to find correspondences.

Positive (sec. 3.1): token k of view a is matched to the token of the other view
whose backbone feature is most similar, k+ = argmax_l cos(f_{a,k}, f_{p(a),l}) (the
paper's "pair feature: backbone"; an argmax, so no gradient flows through the
matching), and its positive is that token's projection z_{p(a),k+}.

Negatives, by `negatives`:

- "densecl" (DenseCL, eq. 1): the global vectors v_j of the views j of OTHER images,
  v_j = the token average of z_j, L2-normalised: 2(B - 1) negatives per anchor view,
  the same for all its tokens.
- "random" (DenseCL++, eq. 2, Fig. 2a): one token drawn uniformly from every view of
  another image; the anchor view's tokens share that set of 2(B - 1) dense negatives.
  Each anchor view draws its own set.
- "guided" (DenseCL++*, sec. 3.2 and appendix C.1): M (`candidates`) such random sets
  are drawn per anchor view; for each, the cosine similarity q of every negative in it
  to every one of the anchor view's dense projections is thresholded (eq. 3: q <= beta
  becomes -1) and averaged over the T x 2(B - 1) pairs; the set with the highest mean
  (the hardest) is kept. The choice is discrete and made without gradient.

Cross-view negatives (sec. 3.2, appendix C.1): with N = `cross_view_negatives` > 0,
each anchor token also gets the N tokens of the positive view p(a) least similar to
it on the dense projections (its matched token k+ excluded: it is the positive), a
set per token. N defaults to GUIDED_CROSS_VIEW_NEGATIVES (training/options.py, the
paper's DenseCL++* of Table 2) for "guided" and 0 otherwise; it can be combined with
any negatives. N is clipped to T - 1 and M to the number of distinct sets, T^(2(B-1)).

The loss of token k of anchor view a, with s = the cosines above and tau the
temperature (every exponent divided by tau: docs/papers.md, reading 4), is

    l_{a,k} = -log( exp(s_pos / tau) / (exp(s_pos / tau) + sum_neg exp(s_neg / tau)) )

and the loss is the MEAN over the T tokens and the 2B anchor views,
L_d = 1/(2B T) sum_a sum_k l_{a,k} (eq. 2 sums over k; the mean keeps the scale
independent of the grid size, comparable with the global InfoNCE it is mixed with).
Negatives carry gradient (in-batch, as in SimCLR; DenseCL's queue had none).

Randomness comes from the `generator` passed to `forward` (or torch's global RNG
on z's device), so a seeded run draws the same negatives. Everything is batched; the
only Python loop is over chunks of anchor views when scoring guided candidates, to
bound memory (T x 2B x T similarities per anchor view).

Not registered as a `fit --loss`: it takes views and backbone features, not the
(embeddings, labels) of the registry's contract (`vitrieval-train pretrain` uses it).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..options import NEGATIVES, DenseContrastiveOptions, default_cross_view_negatives
from .base import check_paired_views, check_temperature

__all__ = ["NEGATIVES", "DenseContrastiveLoss"]
GUIDED_CHUNK_ELEMENTS = 1 << 24
"""Similarities computed at once while scoring guided candidates (64 MiB of fp32)."""


class DenseContrastiveLoss(nn.Module):
    """Args: negatives (one of NEGATIVES), temperature tau (> 0), candidates M (guided),
    beta (guided threshold of eq. 3), and cross_view_negatives N (None: the default of
    `negatives`); the defaults are DenseContrastiveOptions (training/options.py). Has no
    parameters.

    forward(z (2B, T, c), features (2B, T, C), generator=None) -> scalar. B >= 2.
    Computed in fp32 whatever the input dtype; z is L2-normalised here too.
    """

    def __init__(
        self,
        negatives: str = DenseContrastiveOptions.negatives,
        temperature: float = DenseContrastiveOptions.temperature,
        candidates: int = DenseContrastiveOptions.candidates,
        beta: float = DenseContrastiveOptions.beta,
        cross_view_negatives: int | None = DenseContrastiveOptions.cross_view_negatives,
    ):
        super().__init__()
        if negatives not in NEGATIVES:
            raise ValueError(f"unknown negatives {negatives!r}; valid: {', '.join(NEGATIVES)}")
        if candidates < 1:
            raise ValueError(f"candidates must be >= 1, got {candidates}")
        if not -1.0 <= beta <= 1.0:
            raise ValueError(f"beta must lie in [-1, 1], got {beta}")
        if cross_view_negatives is None:
            cross_view_negatives = default_cross_view_negatives(negatives)
        if cross_view_negatives < 0:
            raise ValueError(f"cross_view_negatives must be >= 0, got {cross_view_negatives}")
        self.negatives = negatives
        self.temperature = check_temperature(temperature)
        self.candidates = int(candidates)
        self.beta = float(beta)
        self.cross_view_negatives = int(cross_view_negatives)

    def extra_repr(self) -> str:
        return (
            f"negatives={self.negatives!r}, temperature={self.temperature}, "
            f"candidates={self.candidates}, beta={self.beta}, "
            f"cross_view_negatives={self.cross_view_negatives}"
        )

    # -- the pieces, public so that tests can check each rule ------------------------

    @staticmethod
    def partner(num_views: int, device: torch.device | None = None) -> torch.Tensor:
        """(2B,) p(a) = (a + B) mod 2B, the other view of view a's image."""
        return torch.arange(num_views, device=device).roll(num_views // 2)

    @staticmethod
    def other_views(num_views: int, device: torch.device | None = None) -> torch.Tensor:
        """(2B, 2B - 2): for anchor view a, the views of the other images, ascending."""
        b = num_views // 2
        image = torch.arange(num_views, device=device) % b
        other = image[:, None] != image[None, :]
        views = torch.arange(num_views, device=device).expand(num_views, num_views)
        return views[other].view(num_views, num_views - 2)

    @torch.no_grad()
    def correspondence(self, features: torch.Tensor) -> torch.Tensor:
        """features (2B, T, C) -> (2B, T) long: k+ of every token, an index into the
        tokens of the partner view: argmax_l cos(f_{a,k}, f_{p(a),l})."""
        f = F.normalize(features.float(), dim=-1)
        partner = self.partner(f.shape[0], f.device)
        return torch.bmm(f, f[partner].transpose(1, 2)).argmax(dim=-1)

    def candidate_sets(
        self,
        num_views: int,
        tokens: int,
        count: int,
        generator: torch.Generator | None = None,
        device: torch.device | None = None,
    ) -> torch.Tensor:
        """(2B, count, 2B - 2) long: `count` random sets per anchor view; entry
        [a, s, j] is the token drawn from view `other_views(2B)[a, j]`."""
        rng_device = generator.device if generator is not None else device
        shape = (num_views, count, num_views - 2)
        drawn = torch.randint(0, tokens, shape, generator=generator, device=rng_device)
        return drawn.to(device)

    def num_candidates(self, num_views: int, tokens: int) -> int:
        """M clipped to the number of distinct sets, T^(2(B-1))."""
        others = num_views - 2
        if others * math.log(tokens) >= math.log(self.candidates):
            return self.candidates
        return int(tokens**others)

    @torch.no_grad()
    def guided_scores(self, z: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """z (2B, T, c) unit rows, candidates (2B, M, 2B - 2) -> (2B, M): per anchor view
        and set, the mean over its tokens k and the set's negatives n of the thresholded
        cosine q(k, n) (eq. 3: -1 where q <= beta)."""
        num_views, tokens, _ = z.shape
        flat = z.reshape(num_views * tokens, -1)
        # summed[a, j, m] = sum_k qbar(z_{a,k} . z_{j,m}), in chunks of anchor views
        per_view = tokens * num_views * tokens
        chunk = max(1, GUIDED_CHUNK_ELEMENTS // per_view)
        parts = []
        for start in range(0, num_views, chunk):
            anchors = z[start : start + chunk]
            q = torch.einsum("atc,nc->atn", anchors, flat).view(
                anchors.shape[0], tokens, num_views, tokens
            )
            q = torch.where(q <= self.beta, torch.full_like(q, -1.0), q)
            parts.append(q.sum(dim=1))
        summed = torch.cat(parts)  # (2B, 2B, T)
        views = self.other_views(num_views, z.device)
        summed = summed.gather(1, views[:, :, None].expand(-1, -1, tokens))  # (2B, 2B-2, T)
        m = candidates.shape[1]
        picked = summed[:, None].expand(-1, m, -1, -1).gather(3, candidates[..., None])
        return picked.squeeze(3).sum(dim=2) / (tokens * (num_views - 2))

    def negative_tokens(
        self, z: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """(2B, 2B - 2) long: the token taken from each other-image view (the columns of
        `other_views`) for every anchor view; "random" or "guided" only."""
        num_views, tokens, _ = z.shape
        if self.negatives == "random":
            return self.candidate_sets(num_views, tokens, 1, generator, z.device)[:, 0]
        if self.negatives != "guided":
            raise ValueError(f"negatives {self.negatives!r} draws no dense negatives")
        m = self.num_candidates(num_views, tokens)
        sets = self.candidate_sets(num_views, tokens, m, generator, z.device)
        best = self.guided_scores(F.normalize(z.detach().float(), dim=-1), sets).argmax(dim=1)
        return sets[torch.arange(num_views, device=z.device), best]

    @torch.no_grad()
    def cross_view_tokens(self, z: torch.Tensor, match: torch.Tensor) -> torch.Tensor:
        """(2B, T, N) long: for each anchor token, the N tokens of the partner view least
        similar to it on z, its positive k+ (`match`, (2B, T)) excluded. N <= T - 1."""
        num_views, tokens, _ = z.shape
        n = min(self.cross_view_negatives, tokens - 1)
        z = F.normalize(z.float(), dim=-1)
        sim = torch.bmm(z, z[self.partner(num_views, z.device)].transpose(1, 2))
        sim = sim.scatter(2, match[..., None], float("inf"))
        return sim.topk(n, dim=2, largest=False).indices

    # -- the loss ---------------------------------------------------------------------

    def forward(
        self,
        z: torch.Tensor,
        features: torch.Tensor,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        b = check_paired_views(z, 3)
        check_paired_views(features, 3, "features")
        if features.shape[:2] != z.shape[:2]:
            raise ValueError(
                f"features {tuple(features.shape)} and z {tuple(z.shape)} must share (2B, T)"
            )
        if b < 2:
            raise ValueError("the dense loss needs at least 2 images (4 views) per batch")
        z = F.normalize(z.float(), dim=-1)
        num_views, _, dim = z.shape
        partner_z = z[self.partner(num_views, z.device)]  # (2B, T, c)
        match = self.correspondence(features)  # (2B, T)
        positive = partner_z.gather(1, match[..., None].expand(-1, -1, dim))
        logits = [(z * positive).sum(dim=-1, keepdim=True)]  # (2B, T, 1)

        views = self.other_views(num_views, z.device)  # (2B, 2B - 2)
        if self.negatives == "densecl":
            globals_ = F.normalize(z.mean(dim=1), dim=-1)  # (2B, c): v_j
            negatives = globals_[views]  # (2B, 2B - 2, c)
        else:
            negatives = z[views, self.negative_tokens(z, generator)]  # (2B, 2B - 2, c)
        logits.append(torch.einsum("atc,ajc->atj", z, negatives))  # (2B, T, 2B - 2)

        if self.cross_view_negatives > 0:
            far = self.cross_view_tokens(z.detach(), match)  # (2B, T, N)
            sim = torch.bmm(z, partner_z.transpose(1, 2))  # (2B, T, T)
            logits.append(sim.gather(2, far))  # (2B, T, N)

        logits = torch.cat(logits, dim=-1) / self.temperature
        return -F.log_softmax(logits, dim=-1)[..., 0].mean()
