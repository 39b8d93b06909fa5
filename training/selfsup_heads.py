"""The heads of self-supervised pretraining (`vitrieval-train pretrain`, DenseCL++).

The encoder is the project's EmbeddingModel (backbone + `avg` or `cls` pooling, no
`--dim` layer): exactly what `model.safetensors` holds and `export` writes. The
pretraining heads sit on top of it and are discarded afterwards:

- global head: pooled vector h (N, C) -> 3-layer MLP -> (N, 128), L2-normalised
  (the DenseCL++ paper, sec. 4: "a 3 layer MLP ... output dimension of 128");
- dense head: the same MLP applied to every patch token (N, T, C) -> (N, T, 128),
  L2-normalised; its BatchNorm pools statistics over all N x T tokens, which is
  DenseCL's 1x1-convolution head written on token sequences;
- reconstruction decoder (optional, appendix B.2): dense projections on the patch
  grid -> (N, 3, H, W), for the auxiliary L1 loss of eq. 4.

The MLP is SimCLR v2's (Chen et al. 2020b): Linear-BN-ReLU, Linear-BN-ReLU, Linear.
The paper's hidden width is 4096 for ViT-S (384 channels); the default here is four
times the backbone width (512 for the tiny preset), which keeps the heads in
proportion with the small CPU backbones; `--head-hidden-dim 4096` gives the paper's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

DECODER_CHANNELS = 16  # appendix C.3's best convolutional decoder: 16 channels per layer
DECODER_UPSAMPLING = 4  # and 4x bicubic upsampling after each convolution


class ProjectionMLP(nn.Module):
    """(..., in_dim) -> (..., out_dim), L2-normalised: Linear-BN-ReLU x 2, Linear.

    Leading axes are flattened for the BatchNorm, so a (N, T, C) input normalises over
    all N x T tokens. Computed in the input's dtype (autocast applies); output fp32.
    """

    def __init__(self, in_dim: int, hidden_dim: int, out_dim: int = 128):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(in_dim, hidden_dim),
            nn.BatchNorm1d(hidden_dim),
            nn.ReLU(inplace=True),
            nn.Linear(hidden_dim, hidden_dim),
            nn.BatchNorm1d(hidden_dim),
            nn.ReLU(inplace=True),
            nn.Linear(hidden_dim, out_dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        out = self.net(x.reshape(-1, x.shape[-1]))
        return F.normalize(out.float(), dim=-1).reshape(*lead, -1)


class ReconstructionDecoder(nn.Module):
    """Dense projections (N, T, L) on a (gh, gw) patch grid -> image (N, 3, H, W).

    Appendix B.2's convolutional decoder with its best settings (C.3): 3x3 convolutions
    of 16 channels, each followed by ReLU and a 4x bicubic upsampling (the last one
    to exactly (H, W)), until the input size is reached; a final 3x3 convolution
    gives the 3 channels. Tiny preset (8 x 8 grid, 32 px): one stage.
    """

    def __init__(self, in_dim: int, grid: tuple[int, int], image_size: tuple[int, int]):
        super().__init__()
        self.grid = (int(grid[0]), int(grid[1]))
        self.sizes: list[tuple[int, int]] = []
        h, w = self.grid
        while (h, w) != tuple(image_size):
            h = min(h * DECODER_UPSAMPLING, image_size[0])
            w = min(w * DECODER_UPSAMPLING, image_size[1])
            self.sizes.append((h, w))
        channels = [in_dim] + [DECODER_CHANNELS] * max(1, len(self.sizes))
        self.convs = nn.ModuleList(
            nn.Conv2d(channels[i], channels[i + 1], 3, padding=1) for i in range(len(channels) - 1)
        )
        self.out = nn.Conv2d(DECODER_CHANNELS, 3, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        n, t, c = z.shape
        if t != self.grid[0] * self.grid[1]:
            raise ValueError(f"expected {self.grid[0]}x{self.grid[1]} tokens, got {t}")
        x = z.transpose(1, 2).reshape(n, c, *self.grid)
        for i, conv in enumerate(self.convs):
            x = F.relu(conv(x))
            if i < len(self.sizes):
                x = F.interpolate(x, size=self.sizes[i], mode="bicubic", align_corners=False)
        return self.out(x)


@dataclass
class PretrainOutputs:
    """One forward pass over 2B views.

    global_z (2B, 128) and dense_z (2B, T, 128): unit rows; features (2B, T, C): the
    backbone's patch tokens; recon (2B, 3, H, W) or None.
    """

    global_z: torch.Tensor
    dense_z: torch.Tensor | None
    features: torch.Tensor
    recon: torch.Tensor | None


class PretrainHeads(nn.Module):
    """The global head, and the dense head and decoder where the method uses them.

    Saved as the checkpoint's `loss` part (like LaCViT's projection head), so
    `model.safetensors` stays the embedding model alone.
    """

    def __init__(
        self,
        width: int,
        hidden_dim: int,
        out_dim: int,
        dense: bool,
        decoder_grid: tuple[int, int] | None = None,
        image_size: tuple[int, int] | None = None,
    ):
        super().__init__()
        self.global_head = ProjectionMLP(width, hidden_dim, out_dim)
        self.dense_head = ProjectionMLP(width, hidden_dim, out_dim) if dense else None
        self.decoder = None
        if decoder_grid is not None:
            if not dense or image_size is None:
                raise ValueError("the reconstruction decoder needs the dense head and image size")
            self.decoder = ReconstructionDecoder(out_dim, decoder_grid, image_size)

    def forward(self, encoder: nn.Module, images: torch.Tensor) -> PretrainOutputs:
        """encoder: an EmbeddingModel; images (2B, 3, H, W), normalised."""
        tokens = encoder.backbone.forward_features(images)  # (2B, P + T, C)
        prefix = encoder.num_prefix_tokens
        features = tokens[:, prefix:]
        global_z = self.global_head(encoder.pool(tokens, prefix))
        dense_z = self.dense_head(features) if self.dense_head is not None else None
        recon = self.decoder(dense_z) if self.decoder is not None else None
        return PretrainOutputs(global_z, dense_z, features, recon)
