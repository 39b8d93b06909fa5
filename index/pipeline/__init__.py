"""The folder pipeline: images to an embeddings folder to an index.

`sources` lists the images (a folder or a CSV list); `embed_folder` embeds them into an
embeddings folder, part by part (`vitrieval-index embed`); `embeddings_folder` is that
folder's format (Parquet parts); `build_index` fills an index from images or from an
embeddings folder (`vitrieval-index build`).
"""
