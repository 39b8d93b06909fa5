"""How a route is declared: `operation()`, which documents an operation from the route's
own function (its name the operationId, its docstring the summary), so that the two are
written once. Request bodies are declared through it too (`inputs.RequestBody.post`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import APIRouter

F = TypeVar("F", bound=Callable[..., Any])


def operation(
    router: APIRouter,
    method: str,
    path: str,
    errors: dict[int | str, dict[str, Any]],
    status_code: int = 200,
    **options: Any,
) -> Callable[[F], F]:
    """`router.api_route(path, methods=[method])` documented from the route itself: its
    function's name is the operation id, its docstring's first line the summary;
    `errors` the documented answers besides the 200 (`errors.error_responses(...)`);
    `options` more of `api_route`'s (`dependencies`, `response_class`, ...)."""

    def declare(route: F) -> F:
        summary = (route.__doc__ or "").strip().splitlines()[0].rstrip(".")
        return router.api_route(
            path,
            methods=[method],
            operation_id=route.__name__,
            summary=summary,
            status_code=status_code,
            responses=errors,
            **options,
        )(route)

    return declare
