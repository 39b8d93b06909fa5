"""vitrieval on a Ray cluster (`pip install -c constraints.txt -e '.[distributed]'`).

Every Ray import of the project lives in this package, and inside functions only:
importing a module of it costs nothing without Ray, and a `--ray` option given without
Ray installed ends in one line naming the extra (`vitrieval.distributed.cluster`).

- `vitrieval.distributed.cluster`: the `--ray ADDRESS` values and the cluster's start and stop.
- `vitrieval.distributed.embed`: `vitrieval-index embed --ray`, the parts embedded by a Ray Data
  actor pool into the same embeddings folder `vitrieval.index.pipeline.embed_folder` writes.
- `vitrieval.distributed.build`: `vitrieval-index build --shards N --ray`, each shard's build a
  Ray task.
- `vitrieval.distributed.serve`: `vitrieval-serve --ray`, the HTTP service as a Ray Serve
  application; its deployment modules import Ray at module level (Serve's decorators
  need it when the classes are defined) and are imported only once Ray is found.
"""
