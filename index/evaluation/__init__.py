"""Measuring retrieval: `metrics` (Recall@K, mAP, MAP@R), `benchmark` (the offline
benchmark of `vitrieval-index bench`), `datasets` (labelled image lists and splits),
`copy_detection` (edited near-duplicate queries) and `isotropy` (of an embedding set).
"""
