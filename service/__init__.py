"""vitrieval's HTTP search service: `create_app()` and the `vitrieval-serve` CLI."""

from vitrieval._version import __version__

__all__ = ["__version__"]
