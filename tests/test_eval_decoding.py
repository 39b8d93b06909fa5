"""`fit` evaluates its held-out image files decoded as the exported model's Embedder
decodes them (training/data.py's `decoded_as_exported`), so the run's figures and
`vitrieval-index bench` on the exported model agree: same model input, bit for bit
up to float rounding, whatever the decode cache keeps for training."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from vitrieval.index.runtime.embedder import Embedder
from vitrieval.training.config import FitConfig
from vitrieval.training.data import build_transforms
from vitrieval.training.trainer import prepare_run


@pytest.mark.parametrize("mode", ["memory", "off"])
def test_held_out_inputs_are_the_embedders(tmp_path, tiny_onnx, mode):
    root = tmp_path / "photos"
    rng = np.random.default_rng(0)
    for c in range(2):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(5):
            # smooth photos, large enough that the JPEG draft and the cache both reduce
            small = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
            large = Image.fromarray(small).resize((640, 480), Image.Resampling.BICUBIC)
            large.save(root / f"c{c}" / f"{i}.jpg", quality=90)
    cfg = FitConfig(
        out=str(tmp_path / "run"),
        dataset="folder",
        data_root=str(root),
        decode_cache=mode,
        workers=0,
    ).resolved()
    _, _, model, _, train_items, test_items = prepare_run(cfg, resume=False)
    assert len(test_items) >= 2 and len(train_items) >= 2
    _, eval_tf = build_transforms(model.data_config(), cfg.crop_scale, cfg.hflip)
    embedder = Embedder(tiny_onnx, device="cpu")
    for item in test_items:
        fit_input = eval_tf(item.open()).numpy()
        np.testing.assert_allclose(fit_input, embedder.prepare(item.path), atol=1e-5)
