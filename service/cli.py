"""`vitrieval-serve`: the HTTP search service for one model and one index.

Loads the model and the index before binding the port, so a wrong path or a
mismatched index ends with one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pydantic import ValidationError

if TYPE_CHECKING:
    from .settings import Settings

# flags named after Settings fields; each field also reads VITRIEVAL_<FIELD>
_SETTINGS_FLAGS = (
    "model",
    "index",
    "data",
    "default_collection",
    "keys_file",
    "collection_idle_s",
    "host",
    "port",
    "workers",
    "device",
    "read_only",
    "batching",
    "max_batch_size",
    "max_batch_wait_ms",
    "max_body_bytes",
    "request_timeout_s",
)


_DATA_OPTIONS = (
    (
        "--data",
        "data",
        "DIR",
        "instead of --model and --index: serve every collection of this data folder "
        "(DIR/models, DIR/collections, DIR/aliases.json; docs/collections.md)",
    ),
    (
        "--default",
        "default_collection",
        "NAME",
        "with --data: the collection or alias the /v1/... routes address (default: the "
        "alias 'default')",
    ),
    ("--keys", "keys_file", "FILE", "keys per collection (a JSON file)"),
    (
        "--collection-idle-s",
        "collection_idle_s",
        "S",
        "with --data: close a collection unused this long (default 600 s)",
    ),
)
"""(flag, Settings field, metavar, help) of the data folder server's options."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vitrieval-serve",
        description="Serve similar-image search over HTTP (docs: /docs; web page: /). "
        "Every option can also be set as an environment variable VITRIEVAL_<NAME>.",
    )
    parser.add_argument("--model", help="exported model (.onnx)")
    parser.add_argument("--index", help="index directory built with that model")
    for flag, dest, metavar, text in _DATA_OPTIONS:
        kind = float if metavar == "S" else str  # seconds are a number
        parser.add_argument(flag, dest=dest, metavar=metavar, type=kind, help=text)
    parser.add_argument("--host", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (default 8000)")
    parser.add_argument("--workers", type=int, help="server processes (read-only only)")
    parser.add_argument("--device", help="auto | cpu | cuda | cuda:N | tensorrt")
    parser.add_argument(
        "--read-only",
        action="store_true",
        default=None,
        help="turn the mutation routes off (no API key needed)",
    )
    batching = parser.add_mutually_exclusive_group()
    batching.add_argument(
        "--batching",
        dest="batching",
        action="store_true",
        default=None,
        help="dynamic batching of concurrent queries (default on a GPU)",
    )
    batching.add_argument(
        "--no-batching",
        dest="batching",
        action="store_false",
        help="one model call per query, one per core at once on CPUs (default on CPUs)",
    )
    parser.add_argument("--max-batch-size", type=int, help="largest model batch (default 32)")
    parser.add_argument(
        "--max-batch-wait-ms", type=float, help="longest wait for a batch to fill (default 2)"
    )
    parser.add_argument("--max-body-bytes", type=int, help="request size limit (default 20 MiB)")
    parser.add_argument("--request-timeout-s", type=float, help="request time limit (default 30)")
    parser.add_argument(
        "--log-level", default="info", choices=("critical", "error", "warning", "info", "debug")
    )
    _add_ray_options(parser)
    return parser


def _add_ray_options(parser: argparse.ArgumentParser) -> None:
    """--ray ADDRESS and the replica counts of the Ray Serve application (docs/scale.md,
    distributed/serve); the names and defaults live there, imported here only."""
    from vitrieval.distributed.cluster import ADDRESS_HELP
    from vitrieval.distributed.serve.options import (
        DEFAULT_EMBED_REPLICAS,
        DEFAULT_INGRESS_REPLICAS,
        DEFAULT_SHARD_REPLICAS,
    )

    parser.add_argument(
        "--ray",
        metavar="ADDRESS",
        help=f"serve as a Ray Serve application: {ADDRESS_HELP}",
    )
    parser.add_argument(
        "--embed-replicas",
        type=int,
        default=DEFAULT_EMBED_REPLICAS,
        metavar="N",
        help=f"with --ray: replicas of the model (default {DEFAULT_EMBED_REPLICAS})",
    )
    parser.add_argument(
        "--shard-replicas",
        type=int,
        default=DEFAULT_SHARD_REPLICAS,
        metavar="N",
        help=f"with --ray: replicas of each index shard (default {DEFAULT_SHARD_REPLICAS})",
    )
    parser.add_argument(
        "--ingress-replicas",
        type=int,
        default=DEFAULT_INGRESS_REPLICAS,
        metavar="N",
        help="with --ray and --read-only: replicas of the HTTP front (request checks, "
        f"merging the shards' hits; default {DEFAULT_INGRESS_REPLICAS})",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the service until it is stopped; the exit status (2: bad input)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        # Ctrl-C: uvicorn shuts down cleanly, then re-raises the SIGINT it caught so the
        # exit status says "interrupted"; 130 says the same without a traceback (also
        # for a Ctrl-C while the model and index are still loading).
        return 130


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # which of its builds FAISS loaded is not news (it logs every attempt at INFO)
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)
    # nor is libvips's thread pool finishing ("VIPS: threadpool completed with 1 workers")
    logging.getLogger("pyvips").setLevel(logging.WARNING)
    from .settings import Settings
    from .state import ServiceState, StartupError

    overrides = {name: getattr(args, name) for name in _SETTINGS_FLAGS}
    overrides = {name: value for name, value in overrides.items() if value is not None}
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:
        message = "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
        print(f"vitrieval-serve: {message}", file=sys.stderr)
        return 2
    if args.ray is not None:
        if settings.data is not None:
            print("vitrieval-serve: --data is not served on Ray: serve a data folder "
                  "without --ray, or one --model and --index with it", file=sys.stderr)  # fmt: skip
            return 2
        return _serve_on_ray(args, settings)
    problem = _keys_problem(settings)
    if problem:
        print(f"vitrieval-serve: {problem}", file=sys.stderr)
        return 2
    if settings.data is not None:
        return _serve_data(args, settings)
    try:
        listener = _listen(settings.host, settings.port)
    except OSError as exc:
        print(
            f"vitrieval-serve: cannot listen on {settings.host}:{settings.port}: "
            f"{exc.strerror or exc}",
            file=sys.stderr,
        )
        return 2
    try:
        state = ServiceState.load(settings)
    except StartupError as exc:
        listener.close()
        print(f"vitrieval-serve: {exc}", file=sys.stderr)
        return 2

    import uvicorn

    print(
        f"vitrieval-serve: {len(state.store)} items; web page http://{_url_host(settings.host)}:"
        f"{settings.port}/ , API docs /docs",
        file=sys.stderr,
        flush=True,
    )
    # no limit_concurrency: uvicorn's own overload answer is a plain-text 503 that also
    # hits the probes; the app's edge (service.middleware) bounds requests instead
    if settings.workers > 1:
        # each worker process loads its own copy and binds the port itself; the
        # settings travel in the environment
        listener.close()
        state.close()
        for field, value in overrides.items():
            os.environ[f"VITRIEVAL_{field.upper()}"] = str(value)
        uvicorn.run(
            "vitrieval.service.app:create_app",
            factory=True,
            host=settings.host,
            port=settings.port,
            workers=settings.workers,
            log_level=args.log_level,
        )
        return 0
    from .app import create_app

    config = uvicorn.Config(
        create_app(settings, state), log_level=args.log_level, timeout_graceful_shutdown=10
    )
    uvicorn.Server(config).run(sockets=[listener])
    return 0


def _keys_problem(settings: Settings) -> str | None:
    """Why the keys file cannot be used (None: it can, or there is none)."""
    from .keys import KeyRing, KeysFileError

    if settings.keys_file is None:
        return None
    try:
        KeyRing.read(settings.keys_file)
    except KeysFileError as exc:
        return str(exc)
    return None


def _serve_data(args: argparse.Namespace, settings: Settings) -> int:
    """`--data DIR`: every collection of a data folder (service/catalogue.py)."""
    from .app import create_data_app
    from .catalogue import Catalogue, data_folder
    from .metrics import ServiceMetrics
    from .state import StartupError

    assert settings.data is not None
    try:
        folder = data_folder(settings.data)
        listener = _listen(settings.host, settings.port)
    except (StartupError, OSError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        print(f"vitrieval-serve: {reason}", file=sys.stderr)
        return 2
    if settings.workers > 1:
        listener.close()
        print("vitrieval-serve: --data serves with one worker (--workers 1)", file=sys.stderr)
        return 2
    import uvicorn

    catalogue = Catalogue(settings, ServiceMetrics(), folder)
    print(
        f"vitrieval-serve: {len(folder.names())} collections in {settings.data}; web page "
        f"http://{_url_host(settings.host)}:{settings.port}/ , API docs /docs",
        file=sys.stderr,
        flush=True,
    )
    config = uvicorn.Config(
        create_data_app(settings, catalogue),
        log_level=args.log_level,
        timeout_graceful_shutdown=10,
    )
    uvicorn.Server(config).run(sockets=[listener])
    return 0


def _serve_on_ray(args: argparse.Namespace, settings: Settings) -> int:
    """`--ray ADDRESS`: the same API as a Ray Serve application (distributed.serve)."""
    from vitrieval.distributed.cluster import ClusterError, import_ray, parse_address

    problem = _ray_problem(args, settings)
    if problem:
        print(f"vitrieval-serve: {problem}", file=sys.stderr)
        return 2
    try:
        parse_address(args.ray)
        import_ray()
    except ClusterError as exc:
        print(f"vitrieval-serve: {exc}", file=sys.stderr)
        return 2
    from vitrieval.distributed.serve.run import serve_on_ray

    return serve_on_ray(
        settings,
        args.ray,
        embed_replicas=args.embed_replicas,
        shard_replicas=args.shard_replicas,
        ingress_replicas=args.ingress_replicas,
    )


def _ray_problem(args: argparse.Namespace, settings: Settings) -> str | None:
    """What is wrong with the --ray command's options (None: nothing), before Ray."""
    for flag, value in (
        ("--embed-replicas", args.embed_replicas),
        ("--shard-replicas", args.shard_replicas),
        ("--ingress-replicas", args.ingress_replicas),
    ):
        if value < 1:
            return f"{flag} must be at least 1, got {value}"
    if args.shard_replicas > 1 and not settings.read_only:
        return (
            "with mutations on, each shard has one replica, its writer: --shard-replicas 1, "
            "or --read-only"
        )
    if args.ingress_replicas > 1 and not settings.read_only:
        return (
            "with mutations on, one ingress numbers the new items: --ingress-replicas 1, "
            "or --read-only"
        )
    if settings.workers > 1:
        return (
            "--ray sets its processes with --embed-replicas, --shard-replicas and "
            "--ingress-replicas, not --workers"
        )
    try:  # the port is Ray Serve's proxy's to bind: say now if it is taken
        _listen(settings.host, settings.port).close()
    except OSError as exc:
        return f"cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}"
    return None


def _listen(host: str, port: int) -> socket.socket:
    """A bound, listening socket for host:port (OSError when the port is taken), so a
    port in use is one line and exit 2 before anything is loaded."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(2048)
    except OSError:
        listener.close()
        raise
    return listener


def _url_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else host


if __name__ == "__main__":
    sys.exit(main())
