"""vitrieval's HTTP search service: `create_app()` and the `vitrieval-serve` CLI."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("vitrieval")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
