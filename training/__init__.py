"""vitrieval training: ViT backbones, pooling heads, losses, the fit loop and ONNX export."""
