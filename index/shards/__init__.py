"""Sharded indexes: N index stores behind one index folder (layout.py for the format).

`open_index` opens any index folder, sharded or not; `build.py` builds a sharded index
from an embeddings folder, one process (or remote task) per shard.
"""

from .layout import SHARDS_FILE, is_sharded, shard_name, shard_of
from .routing import merge_ranked
from .store import ShardedStore, is_index, open_index

__all__ = [
    "SHARDS_FILE",
    "ShardedStore",
    "is_index",
    "is_sharded",
    "merge_ranked",
    "open_index",
    "shard_name",
    "shard_of",
]
