"""Files named by a local path or a URL (`s3://bucket/key`, any fsspec protocol): where
snapshots are written and read from (`vitrieval-index snapshot --out`, `restore`).

A local file is written under a temporary name and renamed when complete (atomic.py);
an object-store URL through fsspec, whose S3 upload becomes visible only once it is
complete. Either way a write killed part way leaves the whole file or none. URLs need
fsspec and the protocol's package: S3 is the `s3` extra (`pip install 'vitrieval[s3]'`:
s3fs, which reads the usual AWS settings: AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, ...).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, cast

from .atomic import atomic_path
from .store import StoreError

_URL = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://")


def is_url(name: str) -> bool:
    """Whether `name` is a URL (`scheme://...`) rather than a local path."""
    return bool(_URL.match(name))


@contextlib.contextmanager
def writing(target: str) -> Iterator[IO[bytes]]:
    """A binary file to write `target` (a path or a URL) through; complete on success,
    absent after a failure."""
    if not is_url(target):
        with atomic_path(Path(target)) as temporary, temporary.open("wb") as fh:
            yield fh
        return
    with _url(target, "wb") as fh:
        yield fh


@contextlib.contextmanager
def reading(source: str) -> Iterator[IO[bytes]]:
    """A binary file to read `source` (a path or a URL) from; StoreError when there is
    none."""
    if not is_url(source):
        path = Path(source)
        if not path.is_file():
            raise StoreError(f"file not found: {source}")
        with path.open("rb") as fh:
            yield fh
        return
    with _url(source, "rb") as fh:
        yield fh


@contextlib.contextmanager
def _url(url: str, mode: str) -> Iterator[IO[bytes]]:
    if "::" in url:  # fsspec's chained URLs: one location, one protocol
        raise StoreError(f"{url}: a chained URL ('::') is not a snapshot location")
    try:
        import fsspec
    except ImportError:
        raise StoreError(
            f"{url}: URLs need fsspec and the protocol's package (for S3: pip install "
            "'vitrieval[s3]')"
        ) from None
    try:
        opened = fsspec.open(url, mode)
        fh = opened.open()
    except ImportError as exc:  # the protocol's package is missing
        raise StoreError(f"{url}: {exc} (for S3: pip install 'vitrieval[s3]')") from None
    except FileNotFoundError:
        raise StoreError(f"not found: {url}") from None
    except (OSError, ValueError) as exc:
        raise StoreError(f"cannot open {url}: {exc}") from None
    except Exception as exc:
        # the protocol's own: botocore's NoCredentialsError or EndpointConnectionError,
        # NotImplementedError for one that cannot write (http); nothing of ours runs here
        raise StoreError(f"cannot open {url}: {_reason(exc)}") from None
    try:
        yield cast(IO[bytes], _Reads(fh, url)) if mode == "rb" else fh
        try:
            fh.close()  # a write's upload completes here
        except Exception as exc:
            raise StoreError(f"cannot complete {url}: {_reason(exc)}") from None
    except BaseException:
        # an S3 upload not completed stays invisible: discard it rather than finish it
        with contextlib.suppress(Exception):
            if hasattr(fh, "discard"):
                fh.discard()
                fh.closed = True  # discarded: closing must not upload what is left
        raise


def _reason(exc: Exception) -> str:
    """An exception of the URL's protocol as one phrase: its type, and its text if any."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class _Reads:
    """A URL's stream whose failed reads are StoreError ("cannot read URL": the network
    or the object store failing part way, as botocore's errors or OSError). What the
    caller's own work raises between reads stays what it is: a local disk filling up
    while a snapshot is restored is no fault of the URL."""

    def __init__(self, stream: IO[bytes], url: str) -> None:
        self._stream = stream
        self._url = url

    def read(self, size: int = -1) -> bytes:
        try:
            return self._stream.read(size)
        except Exception as exc:
            raise StoreError(f"cannot read {self._url}: {_reason(exc)}") from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)
