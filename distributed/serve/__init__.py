"""`vitrieval-serve --ray ADDRESS`: the HTTP search service as a Ray Serve application.

The same HTTP API as the single-process server (service/), in three kinds of
deployments (docs/scale.md, "Serving with Ray Serve"):

- `embedder`: the model, `--embed-replicas` replicas (one GPU each on a cluster with
  GPUs), decoding uploads and embedding them in batches (`@serve.batch`);
- `shard-NNN`: one deployment per shard of the index (a single store is one shard):
  with `--read-only`, `--shard-replicas` replicas each, the shard opened read-only and
  reopened when a new commit appears; with mutations on, one replica, the shard's
  writer (its journal, checkpoints, merges and scrub);
- `ingress`: the service's FastAPI app (`vitrieval.service.app.build_app`: the same routes,
  middleware and JSON errors) whose index and model calls go to the deployments above;
  a search asks every shard for its top k and merges them with
  `vitrieval.index.shards.merge_ranked`, as `ShardedStore` does in one process. With
  `--read-only`, `--ingress-replicas` replicas; with mutations on, one (it numbers
  new items across the shards).

`options` holds the defaults and needs no Ray; `replicas`, `ingress` and `run` import
Ray at module level (their classes are Serve deployments) and are imported only once
`vitrieval.distributed.cluster.import_ray` has found it.
"""
