"""The model runtime: an exported model run on ONNX Runtime, without torch.

`embedder` (images to unit vectors, the `Embedder`), `preprocess` (the model's declared
preprocessing), `images`, `vips_decode` and `image_errors` (safe decoding),
`model_metadata` (what an exported model says about itself), `onnx_files` (writing
model files), `quantize` (INT8) and `optimize` (fused attention).
"""
