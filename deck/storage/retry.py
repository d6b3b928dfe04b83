"""Retrying transient storage failures with exponential backoff and jitter: deck's one retry
mechanism (:class:`RetryPolicy` + :func:`call_with_retry`), also used by the stager's patient
upload retries (a deadline instead of a number of attempts, any storage error retried).

Only failures that can go away by themselves are retried (connection refused/reset, timeouts,
HTTP 5xx / 429, throttling). A missing object, a permission error or a bad argument fails at once:
retrying those only delays the error the user has to act on.
"""

from __future__ import annotations

import errno
import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

from pydantic import Field, model_validator

from deck.config import Settings
from deck.errors import DeckError

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Never transient, whatever else the exception also is (s3fs maps 403 -> PermissionError, 404 ->
# FileNotFoundError; deck's own errors are already final).
_PERMANENT_TYPES: tuple[type[BaseException], ...] = (
    FileNotFoundError,
    PermissionError,
    FileExistsError,
    IsADirectoryError,
    NotADirectoryError,
    DeckError,
    ValueError,
    TypeError,
)

# Matched by class name anywhere in the MRO so that deck does not have to import botocore, aiohttp,
# requests or urllib3 (all optional) to recognise their network errors.
_TRANSIENT_CLASS_NAMES = frozenset(
    {
        "ConnectionError",
        "EndpointConnectionError",
        "ConnectionClosedError",
        "HTTPClientError",
        "ReadTimeoutError",
        "ConnectTimeoutError",
        "ClientConnectionError",
        "ClientOSError",
        "ServerDisconnectedError",
        "ClientPayloadError",
        "IncompleteRead",
        "ResponseParserError",
        "ProtocolError",
        "ChunkedEncodingError",
        "Timeout",
        "ReadTimeout",
        "ConnectTimeout",
    }
)

_TRANSIENT_ERRNOS = frozenset(
    {
        errno.EIO,  # s3fs maps unrecognised server errors to EIO
        errno.EREMOTEIO,  # s3fs: InternalError / HTTP 500
        errno.EBUSY,  # s3fs: ServiceUnavailable / SlowDown / HTTP 503
        errno.EAGAIN,
        errno.ECONNRESET,
        errno.ECONNREFUSED,
        errno.ECONNABORTED,
        errno.ETIMEDOUT,
        errno.EPIPE,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.ENETDOWN,
    }
)


def _http_status(exc: BaseException) -> int | None:
    """HTTP status carried by a botocore / aiohttp / requests exception, if any."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):  # botocore ClientError
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return status if isinstance(status, int) else None
    for obj in (exc, response):
        for attr in ("status", "status_code"):
            status = getattr(obj, attr, None)
            if isinstance(status, int):
                return status
    return None


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and the chain of exceptions it was raised from (wrappers hide the real cause)."""
    chain: list[BaseException] = []
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen and len(chain) < 16:
        seen.add(id(cur))
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    return chain


def status_of(exc: BaseException) -> int | None:
    """The first HTTP status found along ``exc``'s cause chain (fsspec backends re-raise a
    botocore error as an ``OSError``), or None."""
    for e in _causes(exc):
        status = _http_status(e)
        if status is not None:
            return status
    return None


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` looks like a failure that retrying the same call may get past.

    The outermost exception decides first: a permanent type (missing object, permission, bad
    argument) is never retried even if it was raised from a network error. Then the whole cause
    chain is searched for an HTTP status (5xx / 429 transient, other 4xx permanent), a network or
    timeout exception, or a transient ``errno``.
    """
    if isinstance(exc, _PERMANENT_TYPES):
        return False
    chain = _causes(exc)
    for e in chain:
        status = _http_status(e)
        if status is not None and status >= 400:
            return status >= 500 or status == 429
    for e in chain:
        if isinstance(e, (ConnectionError, TimeoutError)):
            return True
        if any(cls.__name__ in _TRANSIENT_CLASS_NAMES for cls in type(e).__mro__):
            return True
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
            return True
    return False


_OUT_OF_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def is_out_of_space(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from) is a full disk or an exhausted quota: a
    failure that waiting does not fix while the writer keeps writing to the same disk."""
    return any(isinstance(e, OSError) and e.errno in _OUT_OF_SPACE_ERRNOS for e in _causes(exc))


class RetryPolicy(Settings):
    """How often and how patiently to retry a failed call (by default: a transient storage
    failure, see :func:`is_transient`).

    Attempt ``i`` (0-based) that fails with an error ``retry_on`` accepts is followed by a sleep of
    ``min(max_delay, initial_delay * multiplier**i)`` scaled by a random factor in
    ``[1 - jitter, 1]`` (jitter spreads out many ranks retrying against the same store). The call
    is given up (its last error re-raised) after ``attempts`` calls, or once the next sleep would
    end past ``deadline_s`` after the first call, whichever comes first. Invalid values raise
    :class:`deck.errors.ConfigError` naming the field.
    """

    attempts: int | None = Field(
        default=5,
        ge=1,
        description="Calls in all, the first included; None: no limit (deadline_s then bounds "
        "the retries).",
    )
    initial_delay: float = Field(
        default=0.2, ge=0, description="Seconds to wait after the first failure."
    )
    max_delay: float = Field(
        default=5.0, ge=0, description="Longest wait between two calls, at least initial_delay."
    )
    multiplier: float = Field(
        default=2.0, ge=1, description="Growth of the wait from one failure to the next."
    )
    jitter: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="Each wait is scaled by a random factor in [1 - jitter, 1]; 0: no jitter.",
    )
    deadline_s: float | None = Field(
        default=None,
        gt=0,
        description="Give up once the next wait would end more than this many seconds after the "
        "first call; None: no time limit (attempts bounds the retries).",
    )
    retry_on: Callable[[BaseException], bool] = Field(
        default=is_transient,
        exclude=True,
        description="Which errors are retried (default: transient storage failures); any other "
        "error is re-raised at once.",
    )

    @model_validator(mode="after")
    def _bounded(self) -> RetryPolicy:
        if self.max_delay < self.initial_delay:
            raise ValueError(
                "needs 0 <= initial_delay <= max_delay, got "
                f"initial_delay={self.initial_delay}, max_delay={self.max_delay}"
            )
        if self.attempts is None and self.deadline_s is None:
            raise ValueError("needs attempts or deadline_s: without either it retries forever")
        return self

    def delay(self, attempt: int) -> float:
        """Seconds to sleep after failed attempt number ``attempt`` (0-based)."""
        base = min(self.max_delay, self.initial_delay * self.multiplier**attempt)
        return base * (1.0 - self.jitter * random.random())


def call_with_retry(fn: Callable[[], T], policy: RetryPolicy, what: str) -> T:
    """Return ``fn()``, retrying it per ``policy`` while it fails with errors ``policy.retry_on``
    accepts.

    Any other failure, or the last retried one, is re-raised unchanged (the caller maps it to a
    typed error). Each retry is logged at WARNING naming the operation ``what`` (e.g. "put
    s3://b/k").
    """
    attempt = 0
    started = time.monotonic()
    while True:
        try:
            return fn()
        except Exception as exc:
            last = policy.attempts is not None and attempt + 1 >= policy.attempts
            if last or not policy.retry_on(exc):
                raise
            delay = policy.delay(attempt)
            deadline = policy.deadline_s
            if deadline is not None and time.monotonic() - started + delay > deadline:
                raise
            attempt += 1
            logger.warning(
                "%s failed (%s: %s); retry %d%s in %.2fs",
                what,
                type(exc).__name__,
                exc,
                attempt,
                "" if policy.attempts is None else f"/{policy.attempts - 1}",
                delay,
            )
            time.sleep(delay)
