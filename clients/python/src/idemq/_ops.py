"""Every call of the HTTP API as a description (method, path, body, retry
safety, how to read the answer), shared by the sync and the async client."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import (
    Any,
    Callable,
    Dict,
    Generic,
    List,
    Mapping,
    Optional,
    Sequence,
    TypedDict,
    TypeVar,
    Union,
)
from urllib.parse import quote

from .errors import ApiError, error_from_problem
from .models import (
    ClaimedJob,
    ClaimResult,
    CompleteItem,
    Dedupe,
    DedupeBinding,
    EnqueueRequest,
    EnqueueResult,
    Event,
    Explain,
    FailOutcome,
    Health,
    Heartbeat,
    Instant,
    Job,
    JobPage,
    KeyBinding,
    QueueInfo,
    Redriven,
    RetryPolicy,
    Run,
    Schedule,
    format_time,
)

T = TypeVar("T")


class EnqueueOptions(TypedDict, total=False):
    """The options of an enqueue, spelled as the wire's snake_case names."""

    queue: Optional[str]
    job_id: Optional[str]
    priority: Optional[int]
    run_at: Optional[Instant]
    delay_ms: Optional[int]
    max_attempts: Optional[int]
    retry: Optional[RetryPolicy]
    timeout_ms: Optional[int]
    deadline: Optional[Instant]
    concurrency_key: Optional[str]
    tags: Optional[List[str]]
    keep_ms: Optional[int]
    idempotency_key: Optional[str]
    scope: Optional[str]
    ttl_ms: Optional[int]
    dedupe: Union[Dedupe, str, Mapping[str, Any], None]


@dataclass
class Op(Generic[T]):
    """One HTTP call."""

    method: str
    path: str
    parse: Callable[[int, Any], T]
    body: Any = None
    has_body: bool = False
    params: Dict[str, Any] = field(default_factory=dict)
    headers: Dict[str, str] = field(default_factory=dict)
    #: Repeating the call cannot do the work twice.
    retry_safe: bool = True
    #: Extra seconds of read timeout (long polls).
    extra_timeout: float = 0.0
    #: Answer ``None`` for a 404 instead of raising NotFoundError.
    none_on_404: bool = False
    #: A ``time.monotonic()`` instant that bounds the call: each try's timeouts
    #: end by it, no retry starts that could not, and past it nothing is sent
    #: (``IdemqTimeoutError``). ``None``: the client's timeout and retries alone.
    until: Optional[float] = None
    #: Set by the client when a try ended in a transport error (a connection
    #: error or a timeout): the server may have done the call though its answer
    #: never arrived, so a retry's answer may describe the state that try left.
    uncertain: bool = False


def seg(value: str) -> str:
    """One path segment, percent-encoded. A segment that is ``.`` or ``..``
    (a valid job id) would be read as a dot segment and dropped from the
    URL, so its dots are sent encoded (``%2E``); the server decodes them."""
    s = quote(str(value), safe="")
    if s in (".", ".."):
        return s.replace(".", "%2E")
    return s


def header_key(key: str) -> str:
    """An idempotency key as a structured-field string for ``Idempotency-Key``."""
    if not key or any(not (0x20 <= ord(c) <= 0x7E) for c in key):
        # Never name the key: it is a secret of the caller's.
        raise ValueError(
            "an idempotency key sent as the Idempotency-Key header must be printable ASCII;"
            " send it in the body instead (the default)"
        )
    return '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _clean(d: Mapping[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def _result(status: int, body: Any) -> EnqueueResult:
    return EnqueueResult.from_wire(body)


def _null(status: int, body: Any) -> None:
    return None


def _enqueue_body(req: EnqueueRequest, key_in_header: bool) -> tuple[Dict[str, Any], Dict[str, str]]:
    headers: Dict[str, str] = {}
    if key_in_header and req.idempotency_key is not None:
        headers["Idempotency-Key"] = header_key(req.idempotency_key)
        # Scope and ttl (if any) stay in the body's `idempotency` object, without the key.
        return req.to_wire(include_key=False), headers
    return req.to_wire(), headers


def enqueue(req: EnqueueRequest, key_in_header: bool = False) -> Op[EnqueueResult]:
    body, headers = _enqueue_body(req, key_in_header)
    return Op("POST", "/v1/jobs", _result, body=body, has_body=True, headers=headers, retry_safe=req.retry_safe)


def explain(req: EnqueueRequest, key_in_header: bool = False) -> Op[Explain]:
    body, headers = _enqueue_body(req, key_in_header)
    # Explain writes nothing: always safe to repeat.
    return Op("POST", "/v1/jobs/explain", lambda s, b: Explain.from_wire(b), body=body, has_body=True, headers=headers)


def batch_item(item: Any) -> Union[EnqueueResult, ApiError]:
    if isinstance(item, Mapping) and "error" in item:
        problem = item["error"] if isinstance(item["error"], Mapping) else {}
        status = problem.get("status")
        return error_from_problem(int(status) if isinstance(status, int) else 0, problem)
    return EnqueueResult.from_wire(item)


def enqueue_many(
    reqs: Sequence[EnqueueRequest], atomic: bool = False
) -> Op[List[Union[EnqueueResult, ApiError]]]:
    items = list(reqs)
    body: Dict[str, Any] = {"jobs": [r.to_wire() for r in items]}
    if atomic:
        body["atomic"] = True

    def parse(status: int, b: Any) -> List[Union[EnqueueResult, ApiError]]:
        return [batch_item(i) for i in b.get("results") or []]

    return Op(
        "POST",
        "/v1/jobs/batch",
        parse,
        body=body,
        has_body=True,
        retry_safe=bool(items) and all(r.retry_safe for r in items),
    )


def get_job(job_id: str, wait_ms: Optional[int]) -> Op[Job]:
    params = {"wait_ms": wait_ms} if wait_ms else {}
    return Op(
        "GET",
        f"/v1/jobs/{seg(job_id)}",
        lambda s, b: Job.from_wire(b),
        params=params,
        extra_timeout=(wait_ms or 0) / 1000.0,
    )


def list_jobs(
    state: Optional[str],
    queue: Optional[str],
    type: Optional[str],
    tag: Optional[str],
    limit: Optional[int],
    cursor: Optional[str],
) -> Op[JobPage]:
    params = _clean({"state": state, "queue": queue, "type": type, "tag": tag, "limit": limit, "cursor": cursor})
    return Op("GET", "/v1/jobs", lambda s, b: JobPage.from_wire(b), params=params)


def events(job_id: str) -> Op[List[Event]]:
    return Op(
        "GET", f"/v1/jobs/{seg(job_id)}/events", lambda s, b: [Event.from_wire(e) for e in b.get("events") or []]
    )


def runs(job_id: str) -> Op[List[Run]]:
    return Op("GET", f"/v1/jobs/{seg(job_id)}/runs", lambda s, b: [Run.from_wire(r) for r in b.get("runs") or []])


def checkpoints(job_id: str) -> Op[Dict[str, Any]]:
    return Op("GET", f"/v1/jobs/{seg(job_id)}/checkpoints", lambda s, b: dict(b.get("checkpoints") or {}))


def cancel(job_id: str) -> Op[Dict[str, Any]]:
    return Op("POST", f"/v1/jobs/{seg(job_id)}/cancel", lambda s, b: dict(b))


def purge(job_id: str) -> Op[bool]:
    return Op("POST", f"/v1/jobs/{seg(job_id)}/purge", lambda s, b: bool(b.get("purged")))


def promote(job_id: str) -> Op[bool]:
    return Op("POST", f"/v1/jobs/{seg(job_id)}/promote", lambda s, b: bool(b.get("promoted")))


def redrive(
    job_id: str,
    idempotency_key: Optional[str],
    max_attempts: Optional[int],
    deadline: Optional[Instant],
    run_at: Optional[Instant],
    reset_checkpoints: Optional[bool],
) -> Op[Redriven]:
    body = _clean(
        {
            "max_attempts": max_attempts,
            "deadline": format_time(deadline) if deadline is not None else None,
            "run_at": format_time(run_at) if run_at is not None else None,
            "reset_checkpoints": reset_checkpoints,
        }
    )
    headers = {"Idempotency-Key": header_key(idempotency_key)} if idempotency_key is not None else {}
    return Op(
        "POST",
        f"/v1/jobs/{seg(job_id)}/redrive",
        lambda s, b: Redriven.from_wire(b),
        body=body or None,
        has_body=bool(body),
        headers=headers,
        # A keyed redrive repeated is a replay; an unkeyed one is not retried.
        retry_safe=idempotency_key is not None,
    )


def bulk(action: str, filter: Optional[Mapping[str, Any]], limit: Optional[int]) -> Op[Dict[str, int]]:
    body: Dict[str, Any] = {"action": action}
    if filter:
        f = _clean(filter)
        if "before" in f:
            f["before"] = format_time(f["before"])
        body["filter"] = f
    if limit is not None:
        body["limit"] = limit
    return Op(
        "POST",
        "/v1/jobs/bulk",
        lambda s, b: {"matched": int(b.get("matched") or 0), "done": int(b.get("done") or 0)},
        body=body,
        has_body=True,
        # cancel and purge are idempotent by nature; a repeated redrive could redrive jobs that died again.
        retry_safe=action != "redrive",
    )


def cancel_by_key(type: str, key: str) -> Op[bool]:
    return Op(
        "POST", "/v1/dedupe/cancel", lambda s, b: bool(b.get("cancelled")), body={"type": type, "key": key}, has_body=True
    )


def dedupe_lookup(type: str, key: str) -> Op[Optional[DedupeBinding]]:
    return Op(
        "GET",
        f"/v1/dedupe/{seg(type)}/{seg(key)}",
        lambda s, b: DedupeBinding.from_wire(b),
        none_on_404=True,
    )


def idempotency_lookup(key: str, scope: Optional[str]) -> Op[Optional[KeyBinding]]:
    return Op(
        "POST",
        "/v1/idempotency/lookup",
        lambda s, b: KeyBinding.from_wire(b),
        body=_clean({"scope": scope, "key": key}),
        has_body=True,
        none_on_404=True,
    )


def idempotency_release(key: str, scope: Optional[str]) -> Op[bool]:
    return Op(
        "POST",
        "/v1/idempotency/release",
        lambda s, b: bool(b.get("released")),
        body=_clean({"scope": scope, "key": key}),
        has_body=True,
    )


def queues() -> Op[List[QueueInfo]]:
    return Op("GET", "/v1/queues", lambda s, b: [QueueInfo.from_wire(q) for q in b.get("queues") or []])


def pause(name: str) -> Op[bool]:
    return Op("POST", f"/v1/queues/{seg(name)}/pause", lambda s, b: bool(b.get("paused")))


def resume(name: str) -> Op[bool]:
    return Op("POST", f"/v1/queues/{seg(name)}/resume", lambda s, b: bool(b.get("paused")))


def schedules() -> Op[List[Schedule]]:
    return Op("GET", "/v1/schedules", lambda s, b: [Schedule.from_wire(x) for x in b.get("schedules") or []])


def put_schedule(
    name: str,
    job: Union[EnqueueRequest, Mapping[str, Any]],
    cron: Optional[str],
    every_ms: Optional[int],
    timezone: Optional[str],
    paused: Optional[bool],
) -> Op[Schedule]:
    if (cron is None) == (every_ms is None):
        raise ValueError("a schedule needs exactly one of cron and every_ms")
    template = job.to_wire() if isinstance(job, EnqueueRequest) else dict(job)
    body = _clean({"cron": cron, "every_ms": every_ms, "timezone": timezone, "paused": paused})
    body["job"] = template
    return Op("PUT", f"/v1/schedules/{seg(name)}", lambda s, b: Schedule.from_wire(b), body=body, has_body=True)


def delete_schedule(name: str) -> Op[bool]:
    return Op("DELETE", f"/v1/schedules/{seg(name)}", lambda s, b: bool(b.get("deleted")))


def health() -> Op[Health]:
    return Op("GET", "/healthz", lambda s, b: Health.from_wire(b))


# ---------------------------------------------------------------- worker protocol
# Every call below is fenced by the lease token: repeating it never does the work
# twice. A repeat of a call whose first try the server recorded (its answer lost)
# finds the token spent: a complete, fail or release is then answered
# ``lease-lost``, which the worker checks for each of them (see ``Op.uncertain``).


def claim(
    queues: Optional[Sequence[str]],
    worker: Optional[str],
    limit: Optional[int],
    lease_ms: Optional[int],
    types: Optional[Sequence[str]],
    wait_ms: Optional[int],
    complete: Optional[Sequence[CompleteItem]] = None,
) -> Op[ClaimResult]:
    items = list(complete) if complete is not None else None
    body = _clean(
        {
            "queues": list(queues) if queues is not None else None,
            "worker": worker,
            "limit": limit,
            "lease_ms": lease_ms,
            "types": list(types) if types is not None else None,
            "wait_ms": wait_ms,
        }
    )
    if items:
        body["complete"] = [i.to_wire() for i in items]

    def parse(status: int, b: Any) -> ClaimResult:
        jobs = [ClaimedJob.from_wire(j) for j in b.get("jobs") or []]
        answers = b.get("completed")
        completed: Optional[List[Union[str, ApiError]]] = None
        if isinstance(answers, list):
            completed = [completion_result(r) for r in answers]
        elif items is not None and not items:
            # Nothing to carry is sent as no `complete` at all, which a server of any age takes.
            completed = []
        return ClaimResult(jobs, completed)

    return Op(
        "POST",
        "/v1/claim",
        parse,
        body=body,
        has_body=True,
        extra_timeout=(wait_ms or 0) / 1000.0,
        # A claim whose answer is lost leaves leases that expire and count an attempt,
        # never a job run twice at once; retried like every worker call. The
        # completions it carries are fenced by their own lease tokens.
        retry_safe=True,
    )


def heartbeat(job_id: str, lease_token: str, until: Optional[float] = None) -> Op[Heartbeat]:
    return Op(
        "POST",
        f"/v1/jobs/{seg(job_id)}/heartbeat",
        lambda s, b: Heartbeat.from_wire(b),
        body={"lease_token": lease_token},
        has_body=True,
        until=until,
    )


def complete(job_id: str, lease_token: str, result: Any) -> Op[str]:
    body: Dict[str, Any] = {"lease_token": lease_token}
    if result is not None:
        body["result"] = result
    return Op("POST", f"/v1/jobs/{seg(job_id)}/complete", lambda s, b: str(b.get("state")), body=body, has_body=True)


def completion_result(item: Any) -> Union[str, ApiError]:
    """One answer of a batch completion: the job's state, or the item's own error."""
    if isinstance(item, Mapping) and "error" in item:
        p = item["error"] if isinstance(item["error"], Mapping) else {}
        st = p.get("status")
        return error_from_problem(int(st) if isinstance(st, int) else 0, p)
    return str(item.get("state"))


def complete_many(items: Sequence[CompleteItem]) -> Op[List[Union[str, ApiError]]]:
    def parse(status: int, b: Any) -> List[Union[str, ApiError]]:
        return [completion_result(r) for r in b.get("results") or []]

    return Op("POST", "/v1/jobs/complete", parse, body={"jobs": [i.to_wire() for i in items]}, has_body=True)


def fail(
    job_id: str,
    lease_token: str,
    error: str,
    retryable: bool,
    retry_after_ms: Optional[int],
    snooze_ms: Optional[int],
) -> Op[FailOutcome]:
    body = _clean(
        {
            "lease_token": lease_token,
            "error": error,
            "retryable": retryable,
            "retry_after_ms": retry_after_ms,
            "snooze_ms": snooze_ms,
        }
    )
    return Op("POST", f"/v1/jobs/{seg(job_id)}/fail", lambda s, b: FailOutcome.from_wire(b), body=body, has_body=True)


def release(job_id: str, lease_token: str) -> Op[str]:
    return Op(
        "POST",
        f"/v1/jobs/{seg(job_id)}/release",
        lambda s, b: str(b.get("state")),
        body={"lease_token": lease_token},
        has_body=True,
    )


def put_checkpoint(job_id: str, name: str, lease_token: str, value: Any) -> Op[bool]:
    return Op(
        "PUT",
        f"/v1/jobs/{seg(job_id)}/checkpoints/{seg(name)}",
        lambda s, b: bool(b.get("stored")),
        body={"lease_token": lease_token, "value": value},
        has_body=True,
    )


__all__ = ["Op", "EnqueueOptions"]
