"""Request options and answers of the idemq HTTP API, as Python types.

Answers keep the whole decoded JSON object in ``raw`` so members added by a
newer server stay reachable.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Literal, Mapping, Optional, Union, cast

from .errors import ApiError

__all__ = [
    "Outcome",
    "NonReplaceableReason",
    "JobState",
    "Durability",
    "ExponentialRetry",
    "FixedRetry",
    "NoRetry",
    "RetryPolicy",
    "Dedupe",
    "EnqueueRequest",
    "EnqueueResult",
    "Explain",
    "JobIdempotency",
    "JobDedupe",
    "Job",
    "JobPage",
    "Event",
    "Run",
    "QueueInfo",
    "Schedule",
    "Health",
    "KeyBinding",
    "DedupeBinding",
    "Redriven",
    "ClaimedJob",
    "ClaimResult",
    "Heartbeat",
    "FailOutcome",
    "CompleteItem",
    "parse_time",
    "format_time",
]

Outcome = Literal["accepted", "replayed", "coalesced", "replaced", "non_replaceable"]
NonReplaceableReason = Literal["incompatible_mode", "not_pending", "window_elapsed"]
JobState = Literal["scheduled", "ready", "active", "completed", "dead", "cancelled"]
Durability = Literal["full", "relaxed"]
Instant = Union[_dt.datetime, str]


def parse_time(value: Any) -> Optional[_dt.datetime]:
    """An RFC 3339 string from the server -> an aware UTC ``datetime`` (``None`` stays)."""
    if value is None:
        return None
    text = str(value).strip()
    if text.endswith(("Z", "z")):
        text = text[:-1] + "+00:00"
    # Python < 3.11 takes at most 6 fractional digits.
    if "." in text:
        head, rest = text.split(".", 1)
        digits = ""
        while rest and rest[0].isdigit():
            digits, rest = digits + rest[0], rest[1:]
        text = head + ("." + digits[:6].ljust(6, "0") if digits else "") + rest
    when = _dt.datetime.fromisoformat(text)
    if when.tzinfo is None:
        when = when.replace(tzinfo=_dt.timezone.utc)
    return when.astimezone(_dt.timezone.utc)


def format_time(value: Instant) -> str:
    """A ``datetime`` (aware; naive means UTC) or an RFC 3339 string -> the wire form."""
    if isinstance(value, str):
        return value
    if not isinstance(value, _dt.datetime):
        raise TypeError("an instant must be a datetime or an RFC 3339 string")
    if value.tzinfo is None:
        value = value.replace(tzinfo=_dt.timezone.utc)
    value = value.astimezone(_dt.timezone.utc)
    return value.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _opt_time(v: Any) -> Optional[_dt.datetime]:
    return parse_time(v) if v is not None else None


def _time(v: Any) -> _dt.datetime:
    t = parse_time(v)
    if t is None:
        raise ValueError("missing instant")
    return t


def _opt_int(v: Any) -> Optional[int]:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _opt_str(v: Any) -> Optional[str]:
    return None if v is None else str(v)


# --------------------------------------------------------------------------
# Request options


@dataclass(frozen=True)
class ExponentialRetry:
    """``initial_ms × factor^(n-1)``, capped at ``max_ms``, with optional full jitter."""

    initial_ms: Optional[int] = None
    factor: Optional[float] = None
    max_ms: Optional[int] = None
    jitter: Optional[bool] = None

    def to_wire(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"kind": "exponential"}
        for name in ("initial_ms", "factor", "max_ms", "jitter"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out


@dataclass(frozen=True)
class FixedRetry:
    """The same delay after every failure."""

    delay_ms: int

    def to_wire(self) -> Dict[str, Any]:
        return {"kind": "fixed", "delay_ms": self.delay_ms}


@dataclass(frozen=True)
class NoRetry:
    """No retries: the first failure is final."""

    def to_wire(self) -> Dict[str, Any]:
        return {"kind": "none"}


RetryPolicy = Union[ExponentialRetry, FixedRetry, NoRetry, Mapping[str, Any]]


@dataclass(frozen=True)
class Dedupe:
    """A dedupe key (scoped per job type) and its mode.

    ``Dedupe(key)`` pending, ``Dedupe(key, ttl_ms=...)`` throttle,
    ``Dedupe(key, ttl_ms=..., extend=True)`` debounce,
    ``Dedupe(key, replace=True)`` replace (latest wins while waiting).
    """

    key: str
    ttl_ms: Optional[int] = None
    extend: Optional[bool] = None
    replace: Optional[bool] = None
    max_wait_ms: Optional[int] = None

    def to_wire(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"key": self.key}
        for name in ("ttl_ms", "extend", "replace", "max_wait_ms"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out

    def __repr__(self) -> str:
        return f"Dedupe(key={self.key!r}, ttl_ms={self.ttl_ms!r}, replace={self.replace!r})"


@dataclass(frozen=True)
class EnqueueRequest:
    """One enqueue request, for :meth:`Client.enqueue_many` (and usable anywhere).

    The idempotency key is kept out of ``repr``.
    """

    type: str
    payload: Any = None
    queue: Optional[str] = None
    job_id: Optional[str] = None
    priority: Optional[int] = None
    run_at: Optional[Instant] = None
    delay_ms: Optional[int] = None
    max_attempts: Optional[int] = None
    retry: Optional[RetryPolicy] = None
    timeout_ms: Optional[int] = None
    deadline: Optional[Instant] = None
    concurrency_key: Optional[str] = None
    tags: Optional[List[str]] = None
    keep_ms: Optional[int] = None
    idempotency_key: Optional[str] = field(default=None, repr=False)
    scope: Optional[str] = None
    ttl_ms: Optional[int] = None
    dedupe: Union[Dedupe, str, Mapping[str, Any], None] = None

    @property
    def retry_safe(self) -> bool:
        """A repeat of this request cannot create a second job."""
        return bool(self.idempotency_key) or bool(self.job_id)

    def to_wire(self, *, include_key: bool = True) -> Dict[str, Any]:
        """The JSON body (``include_key=False`` leaves ``idempotency.key`` out)."""
        body: Dict[str, Any] = {"type": self.type}
        if self.payload is not None:
            body["payload"] = self.payload
        for name in (
            "queue",
            "job_id",
            "priority",
            "delay_ms",
            "max_attempts",
            "timeout_ms",
            "concurrency_key",
            "keep_ms",
        ):
            value = getattr(self, name)
            if value is not None:
                body[name] = value
        if self.tags is not None:
            body["tags"] = list(self.tags)
        if self.run_at is not None:
            body["run_at"] = format_time(self.run_at)
        if self.deadline is not None:
            body["deadline"] = format_time(self.deadline)
        if self.retry is not None:
            body["retry"] = (
                dict(self.retry) if isinstance(self.retry, Mapping) else self.retry.to_wire()
            )
        if self.dedupe is not None:
            if isinstance(self.dedupe, str):
                body["dedupe"] = self.dedupe
            elif isinstance(self.dedupe, Dedupe):
                body["dedupe"] = self.dedupe.to_wire()
            else:
                body["dedupe"] = dict(self.dedupe)
        idem: Dict[str, Any] = {}
        if self.idempotency_key is not None and include_key:
            idem["key"] = self.idempotency_key
        if self.scope is not None:
            idem["scope"] = self.scope
        if self.ttl_ms is not None:
            idem["ttl_ms"] = self.ttl_ms
        if idem:
            if self.idempotency_key is None:
                raise ValueError("scope and ttl_ms need an idempotency_key")
            body["idempotency"] = idem
        return body


# --------------------------------------------------------------------------
# Answers


@dataclass(frozen=True)
class EnqueueResult:
    """What an enqueue did. ``reason`` is set exactly when ``outcome`` is ``non_replaceable``."""

    job_id: str
    outcome: str
    reason: Optional[str] = None

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> "EnqueueResult":
        return cls(job_id=str(d["job_id"]), outcome=str(d["outcome"]), reason=_opt_str(d.get("reason")))


@dataclass(frozen=True)
class Explain:
    """What an enqueue would do now, and why (nothing is written)."""

    outcome: str
    reason: Optional[str]
    job_id: Optional[str]
    conflict: Optional[Dict[str, Any]]
    idempotency: Optional[Dict[str, Any]]
    dedupe: Optional[Dict[str, Any]]
    raw: Dict[str, Any] = field(repr=False, compare=False)

    @property
    def conflict_fields(self) -> List[str]:
        return list((self.conflict or {}).get("fields") or [])

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> "Explain":
        return cls(
            outcome=str(d["outcome"]),
            reason=_opt_str(d.get("reason")),
            job_id=_opt_str(d.get("job_id")),
            conflict=d.get("conflict"),
            idempotency=d.get("idempotency"),
            dedupe=d.get("dedupe"),
            raw=dict(d),
        )


@dataclass(frozen=True)
class JobIdempotency:
    scope: str
    key_preview: str
    key_digest: str
    expires_at: Optional[_dt.datetime]

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> "JobIdempotency":
        return cls(
            scope=str(d.get("scope")),
            key_preview=str(d.get("key_preview")),
            key_digest=str(d.get("key_digest")),
            expires_at=_opt_time(d.get("expires_at")),
        )


@dataclass(frozen=True)
class JobDedupe:
    key: str
    mode: str
    window_until: Optional[_dt.datetime]
    holds_binding: bool

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> "JobDedupe":
        return cls(
            key=str(d.get("key")),
            mode=str(d.get("mode")),
            window_until=_opt_time(d.get("window_until")),
            holds_binding=bool(d.get("holds_binding")),
        )


@dataclass(frozen=True)
class Job:
    """A job record (``GET /v1/jobs/{id}``)."""

    id: str
    type: str
    queue: str
    state: str
    payload: Any
    result: Any
    priority: int
    attempt: int
    attempts_used: int
    max_attempts: int
    run_at: Optional[_dt.datetime]
    created_at: Optional[_dt.datetime]
    updated_at: Optional[_dt.datetime]
    finished_at: Optional[_dt.datetime]
    timeout_ms: Optional[int]
    deadline: Optional[_dt.datetime]
    concurrency_key: Optional[str]
    tags: List[str]
    last_error: Optional[str]
    cancel_requested: bool
    idempotency: Optional[JobIdempotency]
    dedupe: Optional[JobDedupe]
    raw: Dict[str, Any] = field(repr=False, compare=False)

    @property
    def terminal(self) -> bool:
        return self.state in ("completed", "dead", "cancelled")

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> "Job":
        idem = d.get("idempotency")
        ded = d.get("dedupe")
        return cls(
            id=str(d["id"]),
            type=str(d["type"]),
            queue=str(d["queue"]),
            state=str(d["state"]),
            payload=d.get("payload"),
            result=d.get("result"),
            priority=int(d.get("priority") or 0),
            attempt=int(d.get("attempt") or 0),
            attempts_used=int(d.get("attempts_used") or 0),
            max_attempts=int(d.get("max_attempts") or 0),
            run_at=_opt_time(d.get("run_at")),
            created_at=_opt_time(d.get("created_at")),
            updated_at=_opt_time(d.get("updated_at")),
            finished_at=_opt_time(d.get("finished_at")),
            timeout_ms=_opt_int(d.get("timeout_ms")),
            deadline=_opt_time(d.get("deadline")),
            concurrency_key=_opt_str(d.get("concurrency_key")),
            tags=[str(t) for t in (d.get("tags") or [])],
            last_error=_opt_str(d.get("last_error")),
            cancel_requested=bool(d.get("cancel_requested")),
            idempotency=JobIdempotency.from_wire(idem) if isinstance(idem, Mapping) else None,
            dedupe=JobDedupe.from_wire(ded) if isinstance(ded, Mapping) else None,
            raw=dict(d),
        )


@dataclass(frozen=True)
class JobPage:
    """One page of ``GET /v1/jobs``; pass ``next_cursor`` as ``cursor`` for the next."""

    jobs: List[Job]
    next_cursor: Optional[str]

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> "JobPage":
        return cls(
            jobs=[Job.from_wire(j) for j in d.get("jobs") or []],
            next_cursor=_opt_str(d.get("next_cursor")),
        )


@dataclass(frozen=True)
class Event:
    seq: int
    kind: str
    at: Optional[_dt.datetime]
    data: Any

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> "Event":
        return cls(seq=int(d.get("seq") or 0), kind=str(d.get("kind")), at=_opt_time(d.get("at")), data=d.get("data"))


@dataclass(frozen=True)
class Run:
    attempt: int
    worker: Optional[str]
    started_at: Optional[_dt.datetime]
    finished_at: Optional[_dt.datetime]
    outcome: Optional[str]
    error: Optional[str]

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> "Run":
        return cls(
            attempt=int(d.get("attempt") or 0),
            worker=_opt_str(d.get("worker")),
            started_at=_opt_time(d.get("started_at")),
            finished_at=_opt_time(d.get("finished_at")),
            outcome=_opt_str(d.get("outcome")),
            error=_opt_str(d.get("error")),
        )


@dataclass(frozen=True)
class QueueInfo:
    name: str
    paused: bool
    counts: Dict[str, int]

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> "QueueInfo":
        counts = {str(k): int(v) for k, v in (d.get("counts") or {}).items()}
        return cls(name=str(d["name"]), paused=bool(d.get("paused")), counts=counts)


@dataclass(frozen=True)
class Schedule:
    name: str
    cron: Optional[str]
    every_ms: Optional[int]
    timezone: Optional[str]
    job: Dict[str, Any]
    next_fire_at: Optional[_dt.datetime]
    paused: bool
    raw: Dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> "Schedule":
        return cls(
            name=str(d["name"]),
            cron=_opt_str(d.get("cron")),
            every_ms=_opt_int(d.get("every_ms")),
            timezone=_opt_str(d.get("timezone")),
            job=dict(d.get("job") or {}),
            next_fire_at=_opt_time(d.get("next_fire_at")),
            paused=bool(d.get("paused")),
            raw=dict(d),
        )


@dataclass(frozen=True)
class Health:
    """The answer of ``GET /healthz``.

    ``durability`` is ``"full"``, or ``"relaxed"`` when the store runs without
    its durability settings checked (Redis ``?durability=relaxed``:
    acknowledged jobs may be lost). ``None``: the server is too old to say.
    """

    ok: bool
    backend: Optional[str]
    durability: Optional[Durability] = None

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> "Health":
        durability = d.get("durability")
        return cls(
            ok=bool(d.get("ok")),
            backend=_opt_str(d.get("backend")),
            durability=None if durability is None else cast(Durability, str(durability)),
        )


@dataclass(frozen=True)
class KeyBinding:
    """The job an idempotency key belongs to (``POST /v1/idempotency/lookup``)."""

    job_id: str
    key_preview: str
    key_digest: str
    expires_at: Optional[_dt.datetime]

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> "KeyBinding":
        return cls(
            job_id=str(d["job_id"]),
            key_preview=str(d.get("key_preview")),
            key_digest=str(d.get("key_digest")),
            expires_at=_opt_time(d.get("expires_at")),
        )


@dataclass(frozen=True)
class DedupeBinding:
    """The job a dedupe key belongs to (``GET /v1/dedupe/{type}/{key}``)."""

    job_id: str
    mode: str
    window_until: Optional[_dt.datetime]

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> "DedupeBinding":
        return cls(job_id=str(d["job_id"]), mode=str(d.get("mode")), window_until=_opt_time(d.get("window_until")))


@dataclass(frozen=True)
class Redriven:
    job_id: str
    outcome: str

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> "Redriven":
        return cls(job_id=str(d["job_id"]), outcome=str(d["outcome"]))


@dataclass(frozen=True)
class ClaimedJob:
    """A job claimed under a lease (``POST /v1/claim``)."""

    id: str
    type: str
    queue: str
    payload: Any
    attempt: int
    max_attempts: int
    lease_token: str = field(repr=False)
    lease_expires_at: Optional[_dt.datetime]
    timeout_ms: Optional[int]
    deadline: Optional[_dt.datetime]
    tags: List[str]
    raw: Dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> "ClaimedJob":
        return cls(
            id=str(d["id"]),
            type=str(d["type"]),
            queue=str(d.get("queue")),
            payload=d.get("payload"),
            attempt=int(d.get("attempt") or 0),
            max_attempts=int(d.get("max_attempts") or 0),
            lease_token=str(d["lease_token"]),
            lease_expires_at=_opt_time(d.get("lease_expires_at")),
            timeout_ms=_opt_int(d.get("timeout_ms")),
            deadline=_opt_time(d.get("deadline")),
            tags=[str(t) for t in (d.get("tags") or [])],
            raw=dict(d),
        )


class ClaimResult(List[ClaimedJob]):
    """The answer of a claim: the claimed jobs, as a list.

    ``completed`` has one answer per completion the claim carried
    (``complete=``), in order: ``"completed"``, or that item's
    :class:`ApiError` (:class:`LeaseLostError` for a stale token), the same
    answers as :meth:`Client.complete_many`. It is ``None`` when no
    ``complete`` was given.
    """

    completed: Optional[List[Union[str, ApiError]]]

    def __init__(
        self, jobs: Iterable[ClaimedJob] = (), completed: Optional[List[Union[str, ApiError]]] = None
    ) -> None:
        super().__init__(jobs)
        self.completed = completed

    def __repr__(self) -> str:
        return f"ClaimResult({list(self)!r}, completed={self.completed!r})"


@dataclass(frozen=True)
class Heartbeat:
    lease_expires_at: Optional[_dt.datetime]
    cancel_requested: bool

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> "Heartbeat":
        return cls(lease_expires_at=_opt_time(d.get("lease_expires_at")), cancel_requested=bool(d.get("cancel_requested")))


@dataclass(frozen=True)
class FailOutcome:
    state: str
    next_run_at: Optional[_dt.datetime]

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> "FailOutcome":
        return cls(state=str(d["state"]), next_run_at=_opt_time(d.get("next_run_at")))


@dataclass(frozen=True)
class CompleteItem:
    """One completion, for :meth:`Client.complete_many` or a claim's ``complete``."""

    id: str
    lease_token: str = field(repr=False)
    result: Any = None

    def to_wire(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"id": self.id, "lease_token": self.lease_token}
        if self.result is not None:
            out["result"] = self.result
        return out
