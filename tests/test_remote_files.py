"""Reading and writing snapshots at URLs (index/remote_files.py), through fsspec's
in-memory filesystem: a failed open, read or upload of the URL is a StoreError, a
failure of the reader's own work is not."""

from __future__ import annotations

import errno

import fsspec  # the s3 extra, which the dev extra installs
import pytest

from vitrieval.index.remote_files import reading, writing
from vitrieval.index.store import StoreError


@pytest.fixture
def url() -> str:
    with fsspec.open("memory://backups/snap.tar", "wb") as fh:
        fh.write(b"x" * 1000)
    return "memory://backups/snap.tar"


def test_a_url_reads_whole(url: str) -> None:
    with reading(url) as fh:
        assert fh.read() == b"x" * 1000


def test_a_read_that_fails_part_way_is_a_store_error(url: str, monkeypatch) -> None:
    from fsspec.implementations.memory import MemoryFile

    def broken(self, size: int = -1) -> bytes:
        raise ConnectionResetError("the connection dropped")

    with reading(url) as fh:
        assert fh.read(10) == b"x" * 10
        monkeypatch.setattr(MemoryFile, "read", broken)
        with pytest.raises(StoreError, match=r"cannot read memory://backups/snap\.tar.*dropped"):
            fh.read(10)


def test_the_readers_own_failure_is_not_blamed_on_the_url(url: str) -> None:
    # restoring onto a full disk: the server answers 503, not "cannot read the URL" (422)
    with pytest.raises(OSError) as raised, reading(url) as fh:
        fh.read(10)
        raise OSError(errno.ENOSPC, "No space left on device")
    assert raised.type is OSError and raised.value.errno == errno.ENOSPC


def test_a_missing_url_is_a_store_error() -> None:
    with (
        pytest.raises(StoreError, match=r"not found: memory://backups/none\.tar"),
        reading("memory://backups/none.tar"),
    ):
        pass


class _ProtocolFailure(Exception):
    """What a protocol's package raises of its own (botocore's NoCredentialsError, ...)."""


@pytest.mark.parametrize(
    ("exc", "said"),
    [
        (_ProtocolFailure("Unable to locate credentials"), "_ProtocolFailure: Unable to locate"),
        (NotImplementedError(), "NotImplementedError"),  # http cannot write
    ],
)
def test_a_url_that_cannot_be_opened_is_a_store_error(monkeypatch, exc, said) -> None:
    from fsspec.implementations.memory import MemoryFileSystem

    def refuse(self, path, mode="rb", **kwargs):
        raise exc

    monkeypatch.setattr(MemoryFileSystem, "_open", refuse)
    for opened in (reading, writing):
        expected = rf"cannot open memory://b/snap\.tar: {said}"
        with pytest.raises(StoreError, match=expected), opened("memory://b/snap.tar"):
            pass


def test_an_upload_that_fails_at_the_end_is_a_store_error(monkeypatch) -> None:
    from fsspec.implementations.memory import MemoryFile

    def refuse(self) -> None:
        raise _ProtocolFailure("the upload was refused")

    monkeypatch.setattr(MemoryFile, "close", refuse)
    expected = r"cannot complete memory://b/up\.tar: .*refused"
    with pytest.raises(StoreError, match=expected), writing("memory://b/up.tar") as fh:
        fh.write(b"x" * 10)
