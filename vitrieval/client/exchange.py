"""One call's attempts: read each answer into its model or an exception, and decide
whether to try again and after how long (sans I/O: the clients send and sleep).

Only an idempotent call is tried again (every call but an add without
`replace=True`), and only when trying again can help: the connection failed or timed
out, or the server answered one of RETRY_STATUSES. The wait is the server's
Retry-After when it gives one (a longer wait than `max_retry_after_s` is not waited
for: the error is raised at once), else an exponential backoff with jitter.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Generic, TypeVar

import httpx
from pydantic import ValidationError

from .calls import Call
from .errors import APIError, ConnectionFailedError, error_for

T = TypeVar("T")

RETRY_STATUSES = frozenset({429, 502, 503, 504})


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long: `retries` more attempts after the first (0: none),
    waits of `backoff_s` x 2^attempt (at most `max_backoff_s`, jittered down to half
    so that many clients do not come back at once)."""

    retries: int = 2
    backoff_s: float = 0.2
    max_backoff_s: float = 2.0
    max_retry_after_s: float = 10.0

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError(f"retries must be 0 or more, not {self.retries}")

    def backoff(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number `attempt` (0-based)."""
        return min(self.max_backoff_s, self.backoff_s * 2**attempt) * random.uniform(0.5, 1.0)


Step = Call[T] | float
"""What the client does next: send the call, or sleep that many seconds."""


class Exchange(Generic[T]):
    """Iterate to drive one call: for a `Call`, send it and set `outcome` to the
    httpx response or the httpx.RequestError it raised; for a float, sleep that
    long. The iteration ends with `result` set, or raises the call's APIError."""

    def __init__(self, call: Call[T], policy: RetryPolicy) -> None:
        self.call = call
        self.policy = policy
        self.outcome: httpx.Response | httpx.RequestError | None = None
        self.result: T

    def __iter__(self) -> Iterator[Step[T]]:
        attempts = 1 + (self.policy.retries if self.call.idempotent else 0)
        for attempt in range(attempts):
            self.outcome = None
            yield self.call
            if self.outcome is None:
                raise RuntimeError("the client did not set the outcome of the attempt")
            failure = self._read(self.outcome)
            if failure is None:
                return
            if attempt and failure.status == 404 and self.call.done_if_gone is not None:
                # an earlier attempt may have deleted it before its answer was lost
                self.result = self.call.done_if_gone()
                return
            wait = self._wait(failure, attempt)
            if wait is None or attempt == attempts - 1:
                raise failure
            yield wait

    def _read(self, outcome: httpx.Response | httpx.RequestError) -> APIError | None:
        """None when the answer is the result (then set), else the error it is."""
        if isinstance(outcome, httpx.RequestError):
            code = "timeout" if isinstance(outcome, httpx.TimeoutException) else "connection_failed"
            failure = ConnectionFailedError(0, code, f"{type(outcome).__name__}: {outcome}")
            failure.__cause__ = outcome
            return failure
        status = outcome.status_code
        if not (outcome.is_success or status in self.call.answer_statuses):
            retry_after = retry_after_s(outcome.headers.get("retry-after"))
            return error_for(status, outcome.content, retry_after)
        try:
            self.result = self.call.parse(outcome)
        except (ValidationError, ValueError) as exc:
            failure = APIError(status, "invalid_response", f"the answer did not parse: {exc}")
            failure.__cause__ = exc
            return failure
        return None

    def _wait(self, failure: APIError, attempt: int) -> float | None:
        """Seconds to wait before trying again, None when trying again cannot help."""
        if failure.status and failure.status not in RETRY_STATUSES:
            return None
        if failure.code == "invalid_response":
            return None
        if failure.retry_after is None:
            return self.policy.backoff(attempt)
        if failure.retry_after > self.policy.max_retry_after_s:
            return None
        return failure.retry_after


def retry_after_s(value: str | None) -> float | None:
    """A Retry-After header in seconds: delay-seconds or an HTTP date (RFC 9110)."""
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - datetime.now(UTC)).total_seconds())
