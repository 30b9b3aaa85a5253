"""The sync :class:`Client` and the async :class:`AsyncClient` of the idemq HTTP API."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Dict, List, Mapping, Optional, Sequence, Type, TypeVar, Union

import httpx

from . import _ops
from ._ops import EnqueueOptions, Op
from .errors import (
    ApiError,
    IdemqConnectionError,
    IdemqError,
    IdemqTimeoutError,
    NotFoundError,
    UnavailableError,
    UnexpectedResponseError,
    error_from_problem,
)
from .models import (
    ClaimResult,
    CompleteItem,
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
    Run,
    Schedule,
)

from typing import Unpack

__all__ = ["Client", "AsyncClient", "Retries"]

T = TypeVar("T")
_VERSION = "0.1.0"


@dataclass(frozen=True)
class Retries:
    """When and how long a client retries a call that is safe to repeat.

    Only connection errors, timeouts and ``503 unavailable`` are retried, and
    only for calls that cannot do the work twice (see the README). The delay
    before retry ``n`` (0-based) is drawn from
    ``[d/2, d]`` with ``d = min(max_backoff, initial_backoff * 2**n)``, and is
    at least the server's ``Retry-After`` (capped at ``max_retry_after``).
    """

    max_retries: int = 4
    initial_backoff: float = 0.1
    max_backoff: float = 5.0
    max_retry_after: float = 30.0

    def delay(self, attempt: int, retry_after: Optional[float]) -> float:
        d = min(self.max_backoff, self.initial_backoff * (2.0**attempt))
        wait = random.uniform(d / 2.0, d)
        if retry_after is not None:
            wait = max(wait, min(retry_after, self.max_retry_after))
        return wait


def _retries(value: Union[Retries, int, None]) -> Retries:
    if value is None:
        return Retries()
    if isinstance(value, Retries):
        return value
    return Retries(max_retries=int(value))


class _Base:
    def __init__(
        self,
        base_url: str,
        token: Optional[str],
        timeout: float,
        retries: Union[Retries, int, None],
        headers: Optional[Mapping[str, str]],
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = float(timeout)
        self.retries = _retries(retries)
        self._headers: Dict[str, str] = {"Accept": "application/json", "User-Agent": f"idemq-python/{_VERSION}"}
        if headers:
            self._headers.update(headers)
        if token:
            self._headers["Authorization"] = f"Bearer {token}"

    def __repr__(self) -> str:
        # Never the token.
        return f"{type(self).__name__}({self.base_url!r})"

    def _timeout(self, op: Op[Any]) -> httpx.Timeout:
        timeout, read = self.timeout, self.timeout + op.extra_timeout
        if op.until is not None:
            left = op.until - time.monotonic()
            if left <= 0:
                raise IdemqTimeoutError(f"{op.method} {op.path}: its time ran out before it could be sent")
            timeout, read = min(timeout, left), min(read, left)
        return httpx.Timeout(timeout, read=read)

    def _content(self, op: Op[Any]) -> Optional[bytes]:
        if not op.has_body:
            return None
        # NaN and the infinities are not JSON: refused here (ValueError), never sent as `NaN`.
        return json.dumps(op.body, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")

    def _headers_for(self, op: Op[Any]) -> Dict[str, str]:
        h = dict(op.headers)
        if op.has_body:
            h["Content-Type"] = "application/json"
        return h

    @staticmethod
    def _transport_error(op: Op[Any], exc: Exception) -> IdemqError:
        what = f"{op.method} {op.path}"
        if isinstance(exc, httpx.TimeoutException):
            return IdemqTimeoutError(f"{what}: timed out ({type(exc).__name__})")
        return IdemqConnectionError(f"{what}: {type(exc).__name__}: {exc}")

    @staticmethod
    def _answer(op: Op[T], resp: httpx.Response) -> Union[T, ApiError]:
        status = resp.status_code
        if status < 400:
            try:
                body = resp.json() if resp.content else None
            except ValueError:
                return UnexpectedResponseError(
                    f"{op.method} {op.path}: an answer that is not JSON ({status})", status=status
                )
            try:
                return op.parse(status, body)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                return UnexpectedResponseError(
                    f"{op.method} {op.path}: an unexpected answer ({status}): {type(exc).__name__}", status=status
                )
        problem: Any = None
        try:
            problem = resp.json()
        except ValueError:
            problem = None
        headers = {k.lower(): v for k, v in resp.headers.items()}
        return error_from_problem(status, problem if isinstance(problem, dict) else None, headers)

    def _retryable(self, op: Op[Any], err: IdemqError) -> bool:
        return op.retry_safe and (isinstance(err, (IdemqConnectionError, UnavailableError)))

    def _retry_delay(self, op: Op[Any], err: IdemqError, attempt: int) -> Optional[float]:
        """The wait before the next try, or ``None`` when the error is final: not
        retryable, out of retries, or a retry that would start past ``op.until``."""
        if attempt >= self.retries.max_retries or not self._retryable(op, err):
            return None
        delay = self.retries.delay(attempt, getattr(err, "retry_after", None))
        if op.until is not None and time.monotonic() + delay >= op.until:
            return None
        return delay


def _result_or_raise(op: Op[T], out: Union[T, ApiError]) -> T:
    if isinstance(out, NotFoundError) and op.none_on_404:
        return None  # type: ignore[return-value]
    if isinstance(out, ApiError):
        raise out
    return out


class Client(_Base):
    """A blocking client of an idemq server.

    >>> client = idemq.Client("http://127.0.0.1:8080", token=None)
    >>> job_id = client.enqueue("invoice.capture", {"invoice_id": "inv_42"}, idempotency_key="capture:inv_42")
    """

    def __init__(
        self,
        base_url: str,
        token: Optional[str] = None,
        *,
        timeout: float = 30.0,
        retries: Union[Retries, int, None] = None,
        headers: Optional[Mapping[str, str]] = None,
        transport: Optional[httpx.BaseTransport] = None,
    ) -> None:
        super().__init__(base_url, token, timeout, retries, headers)
        self._http = httpx.Client(base_url=self.base_url, headers=self._headers, transport=transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(
        self, et: Optional[Type[BaseException]], ev: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        self.close()

    def call(self, op: Op[T]) -> T:
        """Runs one API call with the client's retry rules."""
        attempt = 0
        while True:
            err: IdemqError
            try:
                resp = self._http.request(
                    op.method,
                    op.path,
                    params=op.params or None,
                    content=self._content(op),
                    headers=self._headers_for(op),
                    timeout=self._timeout(op),
                )
            except httpx.TransportError as exc:
                op.uncertain = True
                err = self._transport_error(op, exc)
            else:
                out = self._answer(op, resp)
                if not isinstance(out, ApiError):
                    return out
                err = out
            delay = self._retry_delay(op, err, attempt)
            if delay is None:
                if isinstance(err, ApiError):
                    return _result_or_raise(op, err)
                raise err
            time.sleep(delay)
            attempt += 1

    # ------------------------------------------------------------------ enqueue

    def enqueue(self, type: str, payload: Any = None, *, key_in_header: bool = False, **options: Unpack[EnqueueOptions]) -> str:
        """Enqueues a job and returns its id (the original job's id on a replay)."""
        return self.enqueue_with_result(type, payload, key_in_header=key_in_header, **options).job_id

    def enqueue_with_result(
        self, type: str, payload: Any = None, *, key_in_header: bool = False, **options: Unpack[EnqueueOptions]
    ) -> EnqueueResult:
        """Enqueues a job; returns ``job_id``, ``outcome`` and ``reason``."""
        return self.call(_ops.enqueue(EnqueueRequest(type, payload, **options), key_in_header))

    def enqueue_request(self, request: EnqueueRequest, *, key_in_header: bool = False) -> EnqueueResult:
        """Enqueues a prepared :class:`EnqueueRequest`."""
        return self.call(_ops.enqueue(request, key_in_header))

    def enqueue_many(
        self, requests: Sequence[EnqueueRequest], *, atomic: bool = False
    ) -> List[Union[EnqueueResult, ApiError]]:
        """One round trip for up to 1,000 requests; one result per request, in order.

        A failing item is an :class:`ApiError` in its place (not raised). With
        ``atomic=True`` any failure raises the first item's error (its
        ``index`` set) and nothing is written.
        """
        return self.call(_ops.enqueue_many(requests, atomic))

    def explain(self, type: str, payload: Any = None, *, key_in_header: bool = False, **options: Unpack[EnqueueOptions]) -> Explain:
        """What this enqueue would do now, and why. Writes nothing."""
        return self.call(_ops.explain(EnqueueRequest(type, payload, **options), key_in_header))

    # ------------------------------------------------------------------ jobs

    def get_job(self, job_id: str, *, wait_ms: Optional[int] = None) -> Job:
        """A job; with ``wait_ms`` the server holds the answer until the job is terminal (≤ 60,000)."""
        return self.call(_ops.get_job(job_id, wait_ms))

    def list_jobs(
        self,
        *,
        state: Optional[str] = None,
        queue: Optional[str] = None,
        type: Optional[str] = None,
        tag: Optional[str] = None,
        limit: Optional[int] = None,
        cursor: Optional[str] = None,
    ) -> JobPage:
        """One page of jobs, newest first."""
        return self.call(_ops.list_jobs(state, queue, type, tag, limit, cursor))

    def events(self, job_id: str) -> List[Event]:
        return self.call(_ops.events(job_id))

    def runs(self, job_id: str) -> List[Run]:
        return self.call(_ops.runs(job_id))

    def checkpoints(self, job_id: str) -> Dict[str, Any]:
        return self.call(_ops.checkpoints(job_id))

    def cancel(self, job_id: str) -> Dict[str, Any]:
        """``{"cancelled": bool, "state": str}``."""
        return self.call(_ops.cancel(job_id))

    def cancel_by_key(self, type: str, key: str) -> bool:
        """Cancels every pending job of ``type`` with dedupe key ``key``."""
        return self.call(_ops.cancel_by_key(type, key))

    def purge(self, job_id: str) -> bool:
        return self.call(_ops.purge(job_id))

    def promote(self, job_id: str) -> bool:
        return self.call(_ops.promote(job_id))

    def redrive(
        self,
        job_id: str,
        *,
        idempotency_key: Optional[str] = None,
        max_attempts: Optional[int] = None,
        deadline: Optional[Instant] = None,
        run_at: Optional[Instant] = None,
        reset_checkpoints: Optional[bool] = None,
    ) -> Redriven:
        return self.call(_ops.redrive(job_id, idempotency_key, max_attempts, deadline, run_at, reset_checkpoints))

    def bulk(
        self, action: str, *, filter: Optional[Mapping[str, Any]] = None, limit: Optional[int] = None
    ) -> Dict[str, int]:
        """``action`` is ``cancel``, ``purge`` or ``redrive``; returns ``{"matched", "done"}``."""
        return self.call(_ops.bulk(action, filter, limit))

    # ------------------------------------------------------------------ bindings

    def lookup_key(self, key: str, *, scope: Optional[str] = None) -> Optional[KeyBinding]:
        """The job an idempotency key belongs to, or ``None``. The key travels in the body."""
        return self.call(_ops.idempotency_lookup(key, scope))

    def release_key(self, key: str, *, scope: Optional[str] = None) -> bool:
        return self.call(_ops.idempotency_release(key, scope))

    def lookup_dedupe(self, type: str, key: str) -> Optional[DedupeBinding]:
        return self.call(_ops.dedupe_lookup(type, key))

    # ------------------------------------------------------------------ queues, schedules, health

    def queues(self) -> List[QueueInfo]:
        return self.call(_ops.queues())

    def pause(self, queue: str) -> bool:
        return self.call(_ops.pause(queue))

    def resume(self, queue: str) -> bool:
        return self.call(_ops.resume(queue))

    def schedules(self) -> List[Schedule]:
        return self.call(_ops.schedules())

    def put_schedule(
        self,
        name: str,
        job: Union[EnqueueRequest, Mapping[str, Any]],
        *,
        cron: Optional[str] = None,
        every_ms: Optional[int] = None,
        timezone: Optional[str] = None,
        paused: Optional[bool] = None,
    ) -> Schedule:
        return self.call(_ops.put_schedule(name, job, cron, every_ms, timezone, paused))

    def delete_schedule(self, name: str) -> bool:
        return self.call(_ops.delete_schedule(name))

    def health(self) -> Health:
        return self.call(_ops.health())

    # ------------------------------------------------------------------ worker protocol

    def claim(
        self,
        *,
        queues: Optional[Sequence[str]] = None,
        worker: Optional[str] = None,
        limit: Optional[int] = None,
        lease_ms: Optional[int] = None,
        types: Optional[Sequence[str]] = None,
        wait_ms: Optional[int] = None,
        complete: Optional[Sequence[CompleteItem]] = None,
    ) -> ClaimResult:
        """Claims up to ``limit`` due jobs under a lease; returns them as a list.

        ``complete`` records those completions first, in the same round trip
        and commit; the result's ``completed`` has one answer per item, in
        order (``"completed"`` or the item's :class:`ApiError`, not raised).
        """
        return self.call(_ops.claim(queues, worker, limit, lease_ms, types, wait_ms, complete))

    def heartbeat(self, job_id: str, lease_token: str) -> Heartbeat:
        return self.call(_ops.heartbeat(job_id, lease_token))

    def complete(self, job_id: str, lease_token: str, result: Any = None) -> str:
        return self.call(_ops.complete(job_id, lease_token, result))

    def complete_many(self, items: Sequence[CompleteItem]) -> List[Union[str, ApiError]]:
        """Many completions in one round trip; a stale token fails only its own item."""
        return self.call(_ops.complete_many(items))

    def fail(
        self,
        job_id: str,
        lease_token: str,
        error: str,
        *,
        retryable: bool = True,
        retry_after_ms: Optional[int] = None,
        snooze_ms: Optional[int] = None,
    ) -> FailOutcome:
        return self.call(_ops.fail(job_id, lease_token, error, retryable, retry_after_ms, snooze_ms))

    def release(self, job_id: str, lease_token: str) -> str:
        return self.call(_ops.release(job_id, lease_token))

    def put_checkpoint(self, job_id: str, name: str, lease_token: str, value: Any) -> bool:
        """Stores a checkpoint; ``False`` when one existed (the first value is kept)."""
        return self.call(_ops.put_checkpoint(job_id, name, lease_token, value))


class AsyncClient(_Base):
    """The asyncio twin of :class:`Client`: the same methods, awaited."""

    def __init__(
        self,
        base_url: str,
        token: Optional[str] = None,
        *,
        timeout: float = 30.0,
        retries: Union[Retries, int, None] = None,
        headers: Optional[Mapping[str, str]] = None,
        transport: Optional[httpx.AsyncBaseTransport] = None,
    ) -> None:
        super().__init__(base_url, token, timeout, retries, headers)
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=self._headers, transport=transport)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(
        self, et: Optional[Type[BaseException]], ev: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        await self.aclose()

    async def call(self, op: Op[T]) -> T:
        """Runs one API call with the client's retry rules."""
        attempt = 0
        while True:
            err: IdemqError
            try:
                resp = await self._http.request(
                    op.method,
                    op.path,
                    params=op.params or None,
                    content=self._content(op),
                    headers=self._headers_for(op),
                    timeout=self._timeout(op),
                )
            except httpx.TransportError as exc:
                op.uncertain = True
                err = self._transport_error(op, exc)
            else:
                out = self._answer(op, resp)
                if not isinstance(out, ApiError):
                    return out
                err = out
            delay = self._retry_delay(op, err, attempt)
            if delay is None:
                if isinstance(err, ApiError):
                    return _result_or_raise(op, err)
                raise err
            await asyncio.sleep(delay)
            attempt += 1

    async def enqueue(self, type: str, payload: Any = None, *, key_in_header: bool = False, **options: Unpack[EnqueueOptions]) -> str:
        return (await self.enqueue_with_result(type, payload, key_in_header=key_in_header, **options)).job_id

    async def enqueue_with_result(
        self, type: str, payload: Any = None, *, key_in_header: bool = False, **options: Unpack[EnqueueOptions]
    ) -> EnqueueResult:
        return await self.call(_ops.enqueue(EnqueueRequest(type, payload, **options), key_in_header))

    async def enqueue_request(self, request: EnqueueRequest, *, key_in_header: bool = False) -> EnqueueResult:
        return await self.call(_ops.enqueue(request, key_in_header))

    async def enqueue_many(
        self, requests: Sequence[EnqueueRequest], *, atomic: bool = False
    ) -> List[Union[EnqueueResult, ApiError]]:
        return await self.call(_ops.enqueue_many(requests, atomic))

    async def explain(self, type: str, payload: Any = None, *, key_in_header: bool = False, **options: Unpack[EnqueueOptions]) -> Explain:
        return await self.call(_ops.explain(EnqueueRequest(type, payload, **options), key_in_header))

    async def get_job(self, job_id: str, *, wait_ms: Optional[int] = None) -> Job:
        return await self.call(_ops.get_job(job_id, wait_ms))

    async def list_jobs(
        self,
        *,
        state: Optional[str] = None,
        queue: Optional[str] = None,
        type: Optional[str] = None,
        tag: Optional[str] = None,
        limit: Optional[int] = None,
        cursor: Optional[str] = None,
    ) -> JobPage:
        return await self.call(_ops.list_jobs(state, queue, type, tag, limit, cursor))

    async def events(self, job_id: str) -> List[Event]:
        return await self.call(_ops.events(job_id))

    async def runs(self, job_id: str) -> List[Run]:
        return await self.call(_ops.runs(job_id))

    async def checkpoints(self, job_id: str) -> Dict[str, Any]:
        return await self.call(_ops.checkpoints(job_id))

    async def cancel(self, job_id: str) -> Dict[str, Any]:
        return await self.call(_ops.cancel(job_id))

    async def cancel_by_key(self, type: str, key: str) -> bool:
        return await self.call(_ops.cancel_by_key(type, key))

    async def purge(self, job_id: str) -> bool:
        return await self.call(_ops.purge(job_id))

    async def promote(self, job_id: str) -> bool:
        return await self.call(_ops.promote(job_id))

    async def redrive(
        self,
        job_id: str,
        *,
        idempotency_key: Optional[str] = None,
        max_attempts: Optional[int] = None,
        deadline: Optional[Instant] = None,
        run_at: Optional[Instant] = None,
        reset_checkpoints: Optional[bool] = None,
    ) -> Redriven:
        return await self.call(_ops.redrive(job_id, idempotency_key, max_attempts, deadline, run_at, reset_checkpoints))

    async def bulk(
        self, action: str, *, filter: Optional[Mapping[str, Any]] = None, limit: Optional[int] = None
    ) -> Dict[str, int]:
        return await self.call(_ops.bulk(action, filter, limit))

    async def lookup_key(self, key: str, *, scope: Optional[str] = None) -> Optional[KeyBinding]:
        return await self.call(_ops.idempotency_lookup(key, scope))

    async def release_key(self, key: str, *, scope: Optional[str] = None) -> bool:
        return await self.call(_ops.idempotency_release(key, scope))

    async def lookup_dedupe(self, type: str, key: str) -> Optional[DedupeBinding]:
        return await self.call(_ops.dedupe_lookup(type, key))

    async def queues(self) -> List[QueueInfo]:
        return await self.call(_ops.queues())

    async def pause(self, queue: str) -> bool:
        return await self.call(_ops.pause(queue))

    async def resume(self, queue: str) -> bool:
        return await self.call(_ops.resume(queue))

    async def schedules(self) -> List[Schedule]:
        return await self.call(_ops.schedules())

    async def put_schedule(
        self,
        name: str,
        job: Union[EnqueueRequest, Mapping[str, Any]],
        *,
        cron: Optional[str] = None,
        every_ms: Optional[int] = None,
        timezone: Optional[str] = None,
        paused: Optional[bool] = None,
    ) -> Schedule:
        return await self.call(_ops.put_schedule(name, job, cron, every_ms, timezone, paused))

    async def delete_schedule(self, name: str) -> bool:
        return await self.call(_ops.delete_schedule(name))

    async def health(self) -> Health:
        return await self.call(_ops.health())

    async def claim(
        self,
        *,
        queues: Optional[Sequence[str]] = None,
        worker: Optional[str] = None,
        limit: Optional[int] = None,
        lease_ms: Optional[int] = None,
        types: Optional[Sequence[str]] = None,
        wait_ms: Optional[int] = None,
        complete: Optional[Sequence[CompleteItem]] = None,
    ) -> ClaimResult:
        return await self.call(_ops.claim(queues, worker, limit, lease_ms, types, wait_ms, complete))

    async def heartbeat(self, job_id: str, lease_token: str) -> Heartbeat:
        return await self.call(_ops.heartbeat(job_id, lease_token))

    async def complete(self, job_id: str, lease_token: str, result: Any = None) -> str:
        return await self.call(_ops.complete(job_id, lease_token, result))

    async def complete_many(self, items: Sequence[CompleteItem]) -> List[Union[str, ApiError]]:
        return await self.call(_ops.complete_many(items))

    async def fail(
        self,
        job_id: str,
        lease_token: str,
        error: str,
        *,
        retryable: bool = True,
        retry_after_ms: Optional[int] = None,
        snooze_ms: Optional[int] = None,
    ) -> FailOutcome:
        return await self.call(_ops.fail(job_id, lease_token, error, retryable, retry_after_ms, snooze_ms))

    async def release(self, job_id: str, lease_token: str) -> str:
        return await self.call(_ops.release(job_id, lease_token))

    async def put_checkpoint(self, job_id: str, name: str, lease_token: str, value: Any) -> bool:
        return await self.call(_ops.put_checkpoint(job_id, name, lease_token, value))
