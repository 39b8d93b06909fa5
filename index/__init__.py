"""vitrieval retrieval library: embedder, index store, metrics, dataset readers, benchmark."""
