"""Typed errors of the idemq client.

Every error raised by this package derives from :class:`IdemqError`. Errors
answered by the server are mapped from the problem document's ``type``
(``/problems/<name>``). No error ever carries a raw idempotency key: the
server only answers with ``key_preview`` and ``key_digest``, and the client
never puts a key into a message.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple, Type

__all__ = [
    "IdemqError",
    "ApiError",
    "BadRequestError",
    "ValidationError",
    "EnqueueIdempotencyConflictError",
    "LeaseLostError",
    "NotDeadError",
    "NotFoundError",
    "UnauthorizedError",
    "ForbiddenHostError",
    "MethodNotAllowedError",
    "PayloadTooLargeError",
    "UnavailableError",
    "InternalError",
    "UnexpectedResponseError",
    "IdemqConnectionError",
    "IdemqTimeoutError",
    "PROBLEM_TYPES",
]


class IdemqError(Exception):
    """The base of every error this package raises."""

    #: Whether repeating the same call may succeed (connection errors, 503).
    retryable: bool = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r})"


class ApiError(IdemqError):
    """An error answered by the server as an RFC 9457 problem document."""

    #: The problem name this class maps (``/problems/<name>``).
    problem_name: str = ""

    def __init__(
        self,
        message: str,
        *,
        status: int,
        problem: Optional[Mapping[str, Any]] = None,
        headers: Optional[Mapping[str, str]] = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.problem: Dict[str, Any] = dict(problem or {})
        self.type: str = str(self.problem.get("type") or "")
        self.title: Optional[str] = _opt_str(self.problem.get("title"))
        self.detail: Optional[str] = _opt_str(self.problem.get("detail"))
        #: For atomic batches: the index of the first failing item.
        self.index: Optional[int] = _opt_int(self.problem.get("index"))
        self.headers: Dict[str, str] = dict(headers or {})


class BadRequestError(ApiError):
    """400 ``bad-request``: malformed JSON, a body that is not an object, an unknown member."""

    problem_name = "bad-request"


class ValidationError(ApiError):
    """422 ``validation``: a field broke a bound; nothing was written."""

    problem_name = "validation"

    def __init__(self, message: str, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.field: Optional[str] = _opt_str(self.problem.get("field"))
        self.reason: Optional[str] = _opt_str(self.problem.get("reason"))


class EnqueueIdempotencyConflictError(ApiError):
    """409 ``idempotency-conflict``: the key (or explicit job id) already owns a job
    whose request differs. Nothing was written and neither request won."""

    problem_name = "idempotency-conflict"

    def __init__(self, message: str, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.job_id: Optional[str] = _opt_str(self.problem.get("job_id"))
        self.source: Optional[str] = _opt_str(self.problem.get("source"))
        self.scope: Optional[str] = _opt_str(self.problem.get("scope"))
        self.key_preview: Optional[str] = _opt_str(self.problem.get("key_preview"))
        self.key_digest: Optional[str] = _opt_str(self.problem.get("key_digest"))
        fields = self.problem.get("fields")
        self.fields: List[str] = [str(f) for f in fields] if isinstance(fields, list) else []


class LeaseLostError(ApiError):
    """409 ``lease-lost``: the lease token is stale; another attempt owns the job."""

    problem_name = "lease-lost"

    def __init__(self, message: str, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.job_id: Optional[str] = _opt_str(self.problem.get("job_id"))


class NotDeadError(ApiError):
    """409 ``not-dead``: redrive of a job that is not dead."""

    problem_name = "not-dead"

    def __init__(self, message: str, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.job_id: Optional[str] = _opt_str(self.problem.get("job_id"))
        self.state: Optional[str] = _opt_str(self.problem.get("state"))


class NotFoundError(ApiError):
    """404 ``not-found``."""

    problem_name = "not-found"


class UnauthorizedError(ApiError):
    """401 ``unauthorized``: the server needs a token (``Client(token=...)``)."""

    problem_name = "unauthorized"


class ForbiddenHostError(ApiError):
    """403 ``forbidden-host``: a server without a token refuses a non-loopback ``Host``."""

    problem_name = "forbidden-host"


class MethodNotAllowedError(ApiError):
    """405 ``method-not-allowed``."""

    problem_name = "method-not-allowed"

    def __init__(self, message: str, **kw: Any) -> None:
        super().__init__(message, **kw)
        allow = self.headers.get("allow", "")
        self.allow: List[str] = [m.strip() for m in allow.split(",") if m.strip()]


class PayloadTooLargeError(ApiError):
    """413 ``payload-too-large``: the payload or the body is over the server's limit."""

    problem_name = "payload-too-large"

    def __init__(self, message: str, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.field: Optional[str] = _opt_str(self.problem.get("field"))
        self.limit: Optional[int] = _opt_int(self.problem.get("limit"))


class UnavailableError(ApiError):
    """503 ``unavailable``: the backend is down or busy; retryable."""

    problem_name = "unavailable"
    retryable = True

    def __init__(self, message: str, **kw: Any) -> None:
        super().__init__(message, **kw)
        #: Seconds the server asked to wait (``Retry-After``), if it said.
        self.retry_after: Optional[float] = parse_retry_after(self.headers.get("retry-after"))


class InternalError(ApiError):
    """500 ``internal``."""

    problem_name = "internal"


class UnexpectedResponseError(ApiError):
    """An answer that is not a known problem document or not the JSON expected."""


class IdemqConnectionError(IdemqError):
    """The server could not be reached, or the connection broke mid-request."""

    retryable = True


class IdemqTimeoutError(IdemqConnectionError):
    """The request timed out (connecting, sending or waiting for the answer)."""


_BY_NAME: Dict[str, Type[ApiError]] = {
    cls.problem_name: cls
    for cls in (
        BadRequestError,
        ValidationError,
        EnqueueIdempotencyConflictError,
        LeaseLostError,
        NotDeadError,
        NotFoundError,
        UnauthorizedError,
        ForbiddenHostError,
        MethodNotAllowedError,
        PayloadTooLargeError,
        UnavailableError,
        InternalError,
    )
}

#: The problem names this client maps to a class of its own.
PROBLEM_TYPES: Tuple[str, ...] = tuple(sorted(_BY_NAME))

_BY_STATUS: Dict[int, Type[ApiError]] = {
    400: BadRequestError,
    401: UnauthorizedError,
    403: ForbiddenHostError,
    404: NotFoundError,
    405: MethodNotAllowedError,
    413: PayloadTooLargeError,
    422: ValidationError,
    500: InternalError,
    503: UnavailableError,
}


def problem_name(type_uri: str) -> str:
    """``/problems/validation`` (or an absolute URI ending so) -> ``validation``."""
    return type_uri.rstrip("/").rsplit("/", 1)[-1] if type_uri else ""


def error_from_problem(
    status: int,
    problem: Optional[Mapping[str, Any]],
    headers: Optional[Mapping[str, str]] = None,
) -> ApiError:
    """Builds the typed error for a problem document (or a bare status)."""
    doc: Dict[str, Any] = dict(problem) if isinstance(problem, Mapping) else {}
    name = problem_name(str(doc.get("type") or ""))
    cls = _BY_NAME.get(name)
    if cls is None:
        # An unknown problem type: fall back on the status, never on 409
        # (a 409 is one of three distinct errors and guessing would mislead).
        cls = _BY_STATUS.get(status, UnexpectedResponseError)
    title = _opt_str(doc.get("title")) or name
    detail = _opt_str(doc.get("detail"))
    message = (f"{title} ({status})" if title else f"HTTP {status}") + (f": {detail}" if detail else "")
    return cls(message, status=status, problem=doc, headers=headers)


def parse_retry_after(value: Optional[str]) -> Optional[float]:
    """``Retry-After`` in seconds (delta-seconds or an HTTP date), or ``None``."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    from email.utils import parsedate_to_datetime
    import datetime as _dt

    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=_dt.timezone.utc)
    return max(0.0, (when - _dt.datetime.now(_dt.timezone.utc)).total_seconds())


def _opt_str(v: Any) -> Optional[str]:
    return None if v is None else str(v)


def _opt_int(v: Any) -> Optional[int]:
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, int):
        return v
    return None
