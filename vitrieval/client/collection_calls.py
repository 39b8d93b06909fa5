"""The calls of a data folder server (`vitrieval-serve --data DIR`; docs/collections.md):
its collections, aliases, model switches and snapshots, as `Call`s
(vitrieval.client.calls says how a call becomes a method of both clients).

The item, search and evaluate calls address one collection through the client's
`collection` (`Client(..., collection="shop")`, or `client.in_collection("shop")`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

from vitrieval.service import answers

from .calls import Call, Filter, LabelledQuery, M, _given, _model
from .calls import evaluate as evaluation_call

COLLECTIONS = "/v1/collections"
ALIASES = "/v1/aliases"


def api_path(*parts: str) -> str:
    """A path of the API from its parts, names and ids quoted whole (a '/' or '..' in
    one stays part of it, as the server then refuses it)."""
    return "/".join(quote(part, safe="") if i else part for i, part in enumerate(parts))


def collections() -> Call[answers.CollectionList]:
    """The collections the key may read: name, status, count, dim, model, aliases."""
    return Call("GET", COLLECTIONS, _model(answers.CollectionList))


def get_collection(name: str) -> Call[answers.CollectionOut]:
    """One collection (or the one the alias `name` names)."""
    return Call("GET", api_path(COLLECTIONS, name), _model(answers.CollectionOut))


def create_collection(
    name: str,
    *,
    model: str | None = None,
    snapshot: str | None = None,
    factory: str | None = None,
    filter_fields: Sequence[str] | None = None,
) -> Call[answers.CollectionOut]:
    """Create collection `name`: empty, embedded by `model` (a file under the data
    folder's models/; `factory` and `filter_fields` as for an index), or holding the
    items of `snapshot` (an id `create_snapshot` answered). Needs the admin key."""
    fields = None if filter_fields is None else list(filter_fields)
    body = _given(model=model, snapshot=snapshot, factory=factory, filter_fields=fields)
    return Call(
        "PUT", api_path(COLLECTIONS, name), _model(answers.CollectionOut), json=body, write=True,
        idempotent=False,
    )  # fmt: skip


def delete_collection(name: str) -> Call[answers.CollectionDeleted]:
    """Delete collection `name` (not while an alias names it); its snapshots are moved
    aside, out of reach of a later collection of that name. Needs the admin key."""
    gone = answers.CollectionDeleted(collection=name, deleted=True)
    return _deletion(api_path(COLLECTIONS, name), gone)


def aliases() -> Call[answers.AliasList]:
    """The aliases the key may read, and the collection each names."""
    return Call("GET", ALIASES, _model(answers.AliasList))


def set_alias(alias: str, collection: str) -> Call[answers.AliasOut]:
    """Point `alias` at `collection`, atomically. Needs the admin key."""
    return Call(
        "PUT", api_path(ALIASES, alias), _model(answers.AliasOut), json={"collection": collection},
        write=True,
    )  # fmt: skip


def delete_alias(alias: str) -> Call[answers.AliasOut]:
    """Delete `alias`. Needs the admin key."""
    return Call("DELETE", api_path(ALIASES, alias), _model(answers.AliasOut), write=True)


def promote(
    alias: str,
    collection: str,
    *,
    metric: str | None = None,
    min_gain: float | None = None,
    queries: Sequence[LabelledQuery] | None = None,
    ks: Sequence[int] | None = None,
    filter: Filter | None = None,
) -> Call[answers.PromoteResponse]:
    """Evaluate the collection `alias` names and the candidate `collection` alike
    (leave-one-out, or the labelled `queries`: as `evaluate`) and point the alias at
    the candidate only if its `metric` (default "map") is at least the current one's
    plus `min_gain` (default 0). The answer holds both evaluations and `switched`.
    Needs the admin key."""
    evaluation = evaluation_call(queries=queries, ks=ks, filter=filter).json
    body: dict[str, Any] = {"collection": collection, "evaluation": evaluation}
    body |= _given(metric=metric, min_gain=min_gain)
    return Call(
        "POST", api_path(ALIASES, alias, "promote"), _model(answers.PromoteResponse), json=body,
        write=True, idempotent=False,
    )  # fmt: skip


def start_reembed(collection: str, model: str, into: str) -> Call[answers.ReembedJobOut]:
    """Start building the new collection `into` of `collection`'s items, each embedded
    again from its image by `model` (a file under the data folder's models/): a job,
    answered at once; `reembed_job` reads its progress. Needs the admin key."""
    body = {"model": model, "collection": into}
    path = api_path(COLLECTIONS, collection, "reembed")
    return Call(
        "POST", path, _model(answers.ReembedJobOut), json=body, write=True, idempotent=False
    )


def reembed_job(collection: str, job: str) -> Call[answers.ReembedJobOut]:
    """A re-embedding job: `status` (running, done, failed, cancelled) and `embedded`
    (images read so far). Needs the admin key."""
    path = api_path(COLLECTIONS, collection, "reembed", job)
    return Call("GET", path, _model(answers.ReembedJobOut), write=True)


def cancel_reembed(collection: str, job: str) -> Call[answers.ReembedJobOut]:
    """Cancel a re-embedding job; what it embedded is kept, and starting the same one
    again goes on from there. Needs the admin key."""
    path = api_path(COLLECTIONS, collection, "reembed", job)
    return Call("DELETE", path, _model(answers.ReembedJobOut), write=True)


def create_snapshot(collection: str) -> Call[answers.SnapshotOut]:
    """Take a snapshot of `collection` while writes go on: exactly the items
    acknowledged before it. Needs a key that may write the collection."""
    path = api_path(COLLECTIONS, collection, "snapshots")
    return Call("POST", path, _model(answers.SnapshotOut), write=True, idempotent=False)


def snapshots(collection: str) -> Call[answers.SnapshotList]:
    """The snapshots kept of `collection`, oldest first."""
    return Call("GET", api_path(COLLECTIONS, collection, "snapshots"), _model(answers.SnapshotList))


def download_snapshot(collection: str, snapshot: str) -> Call[bytes]:
    """A snapshot as the bytes of its tar file (`vitrieval-index restore FILE --out
    DIR` makes an index folder of it)."""
    path = api_path(COLLECTIONS, collection, "snapshots", snapshot)
    return Call("GET", path, lambda response: response.content)


def delete_snapshot(collection: str, snapshot: str) -> Call[answers.SnapshotDeleted]:
    """Delete a kept snapshot. Needs a key that may write the collection."""
    path = api_path(COLLECTIONS, collection, "snapshots", snapshot)
    return _deletion(path, answers.SnapshotDeleted(snapshot=snapshot, deleted=True))


def _deletion(path: str, gone: M) -> Call[M]:
    """A DELETE of `path` answering `gone`, also when a repeat finds it gone already
    (the first attempt's answer lost)."""
    return Call("DELETE", path, _model(type(gone)), write=True, done_if_gone=lambda: gone)
