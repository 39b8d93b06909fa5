"""Name -> factory registries: the values of `--pool` and `--loss` come from these."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


class UnknownNameError(ValueError):
    """A name that is not registered; the message lists the valid ones."""


class Registry(Generic[F]):
    """Factories registered by name with a decorator, looked up with a helpful error."""

    def __init__(self, kind: str, error: type[UnknownNameError] = UnknownNameError):
        self.kind = kind
        self.error = error
        self._factories: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def wrap(factory: F) -> F:
            if name in self._factories:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            self._factories[name] = factory
            return factory

        return wrap

    def names(self) -> list[str]:
        return sorted(self._factories)

    def get(self, name: str) -> F:
        try:
            return self._factories[name]
        except KeyError:
            raise self.error(
                f"unknown {self.kind} {name!r}; valid names: {', '.join(self.names())}"
            ) from None
