"""The release number: pyproject.toml reads it from here, the server reports it at
`/v1/info` and the client compares the two."""

__version__ = "0.2.0"
