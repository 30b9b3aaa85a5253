"""A worker for the idemq worker protocol: claim, heartbeat, complete or fail.

``Worker(client, queues=[...], handlers={"type": fn}, concurrency=N).run()``
blocks until :meth:`Worker.stop` is called (from another thread, or a signal
handler), or until a claim is refused for good (the error is raised after
the same shutdown). Each handler gets a :class:`JobContext` and returns the job's result
(any JSON value) or raises: a plain exception is a retryable failure,
:class:`JobFailure` says how to fail (permanent, retry after, snooze).
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import inspect
import json
import logging
import os
import socket
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from . import _ops
from .client import Client
from .errors import (
    ApiError,
    BadRequestError,
    IdemqError,
    LeaseLostError,
    MethodNotAllowedError,
    NotFoundError,
    PayloadTooLargeError,
    ValidationError,
)
from .models import ClaimedJob, CompleteItem, Heartbeat

__all__ = ["Worker", "WorkerReport", "JobContext", "JobFailure", "Handler"]

log = logging.getLogger("idemq.worker")

#: How long a finished job's completion waits before it is sent on its own:
#: the slot it frees usually starts a claim within this time, which carries it.
_COMPLETION_DELAY = 0.01
#: The most completions one call carries (the server's batch bound).
_MAX_COMPLETIONS = 1000
#: The most jobs one claim asks for (the API's bound on ``limit``).
_MAX_CLAIM = 1000
#: The shortest wait before the server is asked about a deadline again, when it
#: said "not yet" but its clock should be there already.
_DEADLINE_RECHECK = 0.01
#: The first and the longest wait before a deadline question the server did not
#: answer (it could not be reached) is asked again.
_DEADLINE_BACKOFF = (0.05, 2.0)
#: The longest long-poll of one claim (the API's bound on ``wait_ms``).
_MAX_POLL_WAIT_MS = 60_000
#: The most bytes of a failure's error text the server keeps.
_MAX_ERROR_BYTES = 8192
#: The call that ends an attempt with each run outcome, for the log.
_CALL_OF = {"failed": "failure", "snoozed": "snooze", "released": "release"}

Handler = Callable[["JobContext"], Any]


class JobFailure(Exception):
    """Raised by a handler to fail the attempt in a chosen way.

    ``JobFailure("msg")`` is retryable (the job's retry policy decides when);
    ``JobFailure.permanent(msg)`` sends the job to ``dead`` at once;
    ``JobFailure.retry_after(msg, ms)`` retries after ``ms``;
    ``JobFailure.snooze(ms)`` runs the job again after ``ms`` without consuming the attempt.
    """

    def __init__(
        self,
        message: str,
        *,
        retryable: bool = True,
        retry_after_ms: Optional[int] = None,
        snooze_ms: Optional[int] = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.retryable = retryable
        self.retry_after_ms = retry_after_ms
        self.snooze_ms = snooze_ms

    @classmethod
    def permanent(cls, message: str) -> "JobFailure":
        return cls(message, retryable=False)

    @classmethod
    def retry_after(cls, message: str, ms: int) -> "JobFailure":
        return cls(message, retry_after_ms=ms)

    @classmethod
    def snooze(cls, ms: int, message: str = "snoozed") -> "JobFailure":
        return cls(message, snooze_ms=ms)


@dataclass
class WorkerReport:
    """What a worker did between ``run()`` and its return."""

    completed: int = 0
    failed: int = 0
    released: int = 0
    lost: int = 0
    cancelled: int = 0
    timed_out: int = 0


class JobContext:
    """A claimed job, as a handler sees it."""

    def __init__(self, worker: "Worker", job: ClaimedJob) -> None:
        self._worker = worker
        self._client = worker.client
        self.job = job
        self.id = job.id
        self.type = job.type
        self.queue = job.queue
        self.payload: Any = job.payload
        self.attempt = job.attempt
        self.max_attempts = job.max_attempts
        self.deadline: Optional[_dt.datetime] = job.deadline
        self.timeout_ms: Optional[int] = job.timeout_ms
        self.tags: List[str] = list(job.tags)
        self._stopped = threading.Event()
        self._stop_reason: Optional[str] = None
        self._on_stop: List[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._checkpoints: Optional[Dict[str, Any]] = None

    def __repr__(self) -> str:
        return f"JobContext(id={self.id!r}, type={self.type!r}, attempt={self.attempt})"

    @property
    def lease_token(self) -> str:
        return self.job.lease_token

    @property
    def cancelled(self) -> bool:
        """True once the handler should stop: cancel requested, lease lost, timeout,
        deadline or the worker's shutdown grace over (``stop_reason`` says which)."""
        return self._stopped.is_set()

    @property
    def stop_reason(self) -> Optional[str]:
        return self._stop_reason

    def wait_cancelled(self, timeout: Optional[float] = None) -> bool:
        """Sleeps up to ``timeout`` seconds, waking early when the handler should stop."""
        return self._stopped.wait(timeout)

    def _stop(self, reason: str) -> None:
        with self._lock:
            if self._stopped.is_set():
                return
            self._stop_reason = reason
            self._stopped.set()
            hooks = list(self._on_stop)
        for hook in hooks:
            try:
                hook()
            except Exception:  # pragma: no cover - a hook never stops the worker
                log.exception("stop hook failed")

    def _stored(self, name: str) -> tuple[bool, Any]:
        if self._checkpoints is None:
            self._checkpoints = self._client.checkpoints(self.id)
        if name in self._checkpoints:
            return True, self._checkpoints[name]
        return False, None

    def _store(self, name: str, value: Any) -> Any:
        if self.cancelled and self._stop_reason == "lease_lost":
            raise LeaseLostError(f"job {self.id}: the lease was lost", status=409, problem={"job_id": self.id})
        stored = self._client.put_checkpoint(self.id, name, self.lease_token, value)
        if stored:
            assert self._checkpoints is not None
            self._checkpoints[name] = value
            return value
        # Another attempt stored one first: the first value wins.
        self._checkpoints = self._client.checkpoints(self.id)
        return self._checkpoints.get(name, value)

    def checkpoint(self, name: str, fn: Callable[[], Any]) -> Any:
        """A durable step: the first attempt that reaches it runs ``fn`` and stores its
        JSON result; later attempts of the job get the stored value without running ``fn``."""
        found, value = self._stored(name)
        if found:
            return value
        return self._store(name, fn())

    async def acheckpoint(self, name: str, fn: Callable[[], Awaitable[Any]]) -> Any:
        """:meth:`checkpoint` for an async step (in an ``async def`` handler)."""
        found, value = self._stored(name)
        if found:
            return value
        return self._store(name, await fn())


@dataclass
class _Outcome:
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: Optional[BaseException] = None


@dataclass
class _Beat:
    """One heartbeat under way, on a thread of its own, so that the job's
    timers (lease, timeout, shutdown) are checked while it waits for its answer."""

    sent_at: float
    #: The question about the job's deadline.
    asking: bool
    #: A regular heartbeat was due when it went.
    due: bool
    done: threading.Event = field(default_factory=threading.Event)
    answered_at: float = 0.0
    #: The renewal, when the server answered one.
    beat: Optional[Heartbeat] = None
    #: Why the lease is gone (``lease_lost`` or ``deadline``), when the server said so.
    gone: Optional[str] = None
    error: Optional[BaseException] = None


@dataclass
class _Ack:
    job: ClaimedJob
    result: Any
    lease_until: float
    #: False once a claim carrying it failed: it then goes in a call of its own.
    carry: bool = True
    #: A call carrying it may have been recorded though its answer was lost (a
    #: connection error or timeout): a ``lease-lost`` answer is then checked.
    unsure: bool = False

    def item(self) -> CompleteItem:
        return CompleteItem(self.job.id, self.job.lease_token, self.result)


class Worker:
    """Runs handlers for claimed jobs, ``concurrency`` at a time.

    :param client: a sync :class:`Client`.
    :param queues: the queues to claim from (``None``: every queue).
    :param handlers: job type -> handler; only these types are claimed.
    :param concurrency: jobs run at once.
    :param lease_ms: the lease of each claim; heartbeats every ``lease_ms / 3``.
        The server checks it (100 to 3,600,000): a value it refuses ends
        :meth:`run` with a :class:`ValidationError`.
    :param poll_wait_ms: how long one claim long-polls for work, kept within
        0 to 60,000 (the API's bound).
    :param shutdown_grace: seconds running handlers get to finish when the
        worker shuts down (:meth:`stop`, or :meth:`run` ending on an error)
        before they are told to stop and their leases are released.
    :param cancel_grace: seconds a handler gets to return after a cancel was requested.
    """

    def __init__(
        self,
        client: Client,
        queues: Optional[Sequence[str]] = None,
        handlers: Optional[Mapping[str, Handler]] = None,
        concurrency: int = 4,
        *,
        lease_ms: int = 30_000,
        poll_wait_ms: int = 2_000,
        shutdown_grace: float = 30.0,
        cancel_grace: float = 1.0,
        name: Optional[str] = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if not handlers:
            raise ValueError("a worker needs at least one handler")
        self.client = client
        self.queues = list(queues) if queues is not None else None
        self.handlers: Dict[str, Handler] = dict(handlers)
        self.concurrency = concurrency
        self.lease_ms = lease_ms
        self.poll_wait_ms = min(_MAX_POLL_WAIT_MS, max(0, poll_wait_ms))
        self.shutdown_grace = shutdown_grace
        self.cancel_grace = cancel_grace
        self.name = name or f"python-{socket.gethostname()}-{os.getpid()}"
        self.report = WorkerReport()
        self._stopping = threading.Event()
        self._grace_until: Optional[float] = None
        self._slots = threading.Condition()
        self._active = 0
        self._pending: List[_Ack] = []
        self._pending_cv = threading.Condition()
        self._closing = False
        self._carry = True
        self._batch_complete = True
        self._report_lock = threading.Lock()
        self._running = False
        #: Jobs a claim returned that were neither started nor released yet.
        self._unstarted: List[ClaimedJob] = []

    # ------------------------------------------------------------------ control

    def stop(self, grace: Optional[float] = None) -> None:
        """Stops claiming; running handlers get ``grace`` seconds (default
        ``shutdown_grace``) to finish, then their leases are released. Safe to call
        from any thread or a signal handler; ``run()`` returns when all is done."""
        g = self.shutdown_grace if grace is None else grace
        until = time.monotonic() + g
        if self._grace_until is None or until < self._grace_until:
            self._grace_until = until
        self._stopping.set()
        with self._slots:
            self._slots.notify_all()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def run(self) -> WorkerReport:
        """Claims and runs jobs until :meth:`stop`; returns what it did.

        A claim refused for good (any error but a retryable one, such as
        :class:`UnauthorizedError`, :class:`ForbiddenHostError` or a
        :class:`ValidationError` of ``lease_ms``) ends it: the worker shuts down
        as :meth:`stop` does, then the error is raised. So does any other
        exception, ``KeyboardInterrupt`` included."""
        if self._running:
            raise RuntimeError("this worker is already running")
        self._running = True
        acker = threading.Thread(target=self._ack_loop, name="idemq-completer", daemon=True)
        acker.start()
        pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="idemq-job")
        try:
            self._claim_loop(pool)
        finally:
            self._shut_down(pool, acker)
        return self.report

    def _claim_loop(self, pool: ThreadPoolExecutor) -> None:
        types = sorted(self.handlers)
        failures = 0
        while not self._stopping.is_set():
            with self._slots:
                while self._active >= self.concurrency and not self._stopping.is_set():
                    self._slots.wait(0.5)
                free = self.concurrency - self._active
            if self._stopping.is_set():
                break
            carried = self._take_carried()
            op = _ops.claim(
                self.queues,
                self.name,
                min(free, _MAX_CLAIM),
                self.lease_ms,
                types,
                self.poll_wait_ms,
                [a.item() for a in carried] or None,
            )
            try:
                jobs = self.client.call(op)
                failures = 0
            except IdemqError as exc:
                self._put_back(carried, unsure=op.uncertain)
                if carried and isinstance(exc, BadRequestError) and _unknown_complete(exc):
                    # A server that does not take completions on a claim: send them apart from now on.
                    log.info("the server refused completions on a claim (%s); sending them apart", exc)
                    self._carry = False
                    continue
                if carried and not exc.retryable:
                    # What was refused may be one of them (a result over the size
                    # limit refuses the whole call): their own calls answer each,
                    # and the claim goes again without them, at once.
                    log.info("a claim carrying completions was refused (%s); sending them apart", exc)
                    continue
                if not exc.retryable:
                    # Refused for good (a wrong token, a forbidden host, a lease the
                    # server does not take): asking again cannot help.
                    log.error("claim refused: %s; the worker shuts down", exc)
                    raise
                failures += 1
                log.warning("claim failed: %s", exc)
                self._stopping.wait(min(5.0, 0.2 * (2 ** min(failures, 5))))
                continue
            except BaseException:
                # Whether the claim recorded them is unknown: a call of their own answers each.
                self._put_back(carried, unsure=True)
                raise
            if carried:
                if op.uncertain:
                    for a in carried:
                        a.unsure = True
                if jobs.completed is not None and len(jobs.completed) == len(carried):
                    self._settle(carried, jobs.completed)
                else:
                    # Answers that do not match cannot be trusted; their own call gives each one.
                    self._carry = False
                    self._put_back(carried, unsure=True)
            self._unstarted = list(jobs)
            while self._unstarted:
                job = self._unstarted[0]
                if self._stopping.is_set():
                    self._release(job)
                else:
                    with self._slots:
                        self._active += 1
                    try:
                        pool.submit(self._slot, job, time.monotonic())
                    except BaseException:
                        with self._slots:
                            self._active -= 1
                        raise
                del self._unstarted[0]

    def _shut_down(self, pool: ThreadPoolExecutor, acker: threading.Thread) -> None:
        """Every end of :meth:`run`: no more claims; running handlers get the grace
        period, then are told to stop and their leases are released; the
        completions still waiting are sent. An interrupt meanwhile (a second
        Ctrl-C) ends the grace period at once."""
        self.stop()
        try:
            while True:
                try:
                    # Claimed, not started: released at once, not held through the grace period.
                    while self._unstarted:
                        self._release(self._unstarted[0])
                        del self._unstarted[0]
                    with self._slots:
                        while self._active > 0:
                            self._slots.wait(0.2)
                    pool.shutdown(wait=True)
                    with self._pending_cv:
                        self._closing = True
                        self._pending_cv.notify_all()
                    acker.join()
                    return
                except KeyboardInterrupt:
                    log.warning("interrupted during shutdown; releasing the running jobs now")
                    self.stop(grace=0)
        finally:
            self._running = False

    # ------------------------------------------------------------------ one job

    def _count(self, what: str) -> None:
        with self._report_lock:
            setattr(self.report, what, getattr(self.report, what) + 1)

    def _slot(self, job: ClaimedJob, claimed_at: float) -> None:
        try:
            self._execute(job, claimed_at)
        except Exception:  # pragma: no cover - a bug here must not kill the worker
            log.exception("job %s: the worker failed around its handler", job.id)
        finally:
            with self._slots:
                self._active -= 1
                self._slots.notify_all()

    def _invoke(self, handler: Handler, ctx: JobContext, out: _Outcome) -> None:
        try:
            if inspect.iscoroutinefunction(handler):
                loop = asyncio.new_event_loop()
                try:
                    task = loop.create_task(handler(ctx))

                    def interrupt() -> None:
                        loop.call_soon_threadsafe(task.cancel)

                    ctx._on_stop.append(interrupt)
                    if ctx.cancelled:
                        task.cancel()
                    out.result = loop.run_until_complete(task)
                finally:
                    loop.close()
            else:
                out.result = handler(ctx)
        except BaseException as exc:  # noqa: B902 - every outcome is reported
            out.error = exc
        finally:
            out.done.set()

    def _execute(self, job: ClaimedJob, claimed_at: float) -> None:
        handler = self.handlers.get(job.type)
        if handler is None:
            self._fail(job, f"no handler for job type {job.type!r}", retryable=False)
            return
        ctx = JobContext(self, job)
        out = _Outcome()
        thread = threading.Thread(target=self._invoke, args=(handler, ctx, out), daemon=True, name=f"idemq-{job.id}")
        thread.start()

        lease_s = self.lease_ms / 1000.0
        every = lease_s / 3.0
        start = time.monotonic()
        lease_until = claimed_at + lease_s
        next_beat = start + every
        timeout_at = start + job.timeout_ms / 1000.0 if job.timeout_ms else None
        # The deadline is the server's to enforce, on its clock: this timer only
        # says when to ask it (by a heartbeat, which past the deadline ends the attempt).
        ask_at = self._deadline_at(job, claimed_at, job.lease_expires_at)
        ask_backoff = _DEADLINE_BACKOFF[0]
        reason: Optional[str] = None
        # The heartbeat under way: it runs on a thread of its own, bounded by the
        # lease it would renew, while this loop goes on checking the lease, the
        # timeout and the shutdown. A heartbeat that hangs cannot keep a handler
        # running past its lease unaware.
        beat: Optional[_Beat] = None

        while True:
            # Heartbeats end with the handler: after it, one that reached the
            # server past the job's deadline would end the attempt there and
            # the completion would be refused. The completion goes within the
            # lease left from the last renewal.
            finished = out.done.wait(0.05)
            if beat is not None and finished:
                # The one under way may find the lease gone: its answer decides,
                # within the lease.
                beat.done.wait(max(0.0, lease_until - time.monotonic()))
            if beat is not None and beat.done.is_set():
                b, beat = beat, None
                if b.gone is not None:
                    # Another attempt owns it, it was purged, or (for a job with
                    # a deadline) the server ended this attempt there: its clock
                    # may be past the deadline before this worker's estimate is,
                    # so any heartbeat of such a job may be the one to find it.
                    reason = b.gone
                elif b.beat is not None:
                    lease_until = b.sent_at + lease_s
                    next_beat = b.sent_at + every
                    if b.asking:
                        # Not yet on the server's clock: ask again when it says it will be.
                        ask_backoff = _DEADLINE_BACKOFF[0]
                        ask_at = self._deadline_at(job, b.answered_at, b.beat.lease_expires_at)
                        if ask_at is not None:
                            ask_at = max(ask_at, time.monotonic() + _DEADLINE_RECHECK)
                    if b.beat.cancel_requested:
                        reason = "cancelled"
                else:
                    now = time.monotonic()
                    if b.asking:
                        # The server decides, and cannot be asked: the handler
                        # goes on, and the question is asked again.
                        log.debug("job %s: the deadline check failed (%s); asking again", job.id, b.error)
                        ask_at = now + ask_backoff
                        ask_backoff = min(ask_backoff * 2, _DEADLINE_BACKOFF[1])
                    if b.due:
                        log.warning("job %s: heartbeat failed: %s", job.id, b.error)
                        next_beat = now + min(1.0, every)
                if reason is not None:
                    break
            if finished:
                # A heartbeat still under way past the lease is left to end on
                # its own: the completion goes, and the server's answer decides.
                break
            now = time.monotonic()
            if self._grace_until is not None and now >= self._grace_until:
                reason = "shutdown"
            elif timeout_at is not None and now >= timeout_at:
                reason = "timeout"
            elif now >= lease_until:
                reason = "lease_lost"  # no heartbeat got through in time
            elif beat is None and (now >= next_beat or (ask_at is not None and now >= ask_at)):
                beat = _Beat(sent_at=now, asking=ask_at is not None and now >= ask_at, due=now >= next_beat)
                threading.Thread(
                    target=self._heartbeat, args=(job, beat, lease_until), daemon=True, name=f"idemq-beat-{job.id}"
                ).start()
            if reason is not None:
                break

        if reason is None:
            self._finish(job, ctx, out, lease_until)
            return
        ctx._stop(reason)
        if reason == "cancelled":
            # The handler may clean up and return: a completion then records the effect.
            if out.done.wait(self.cancel_grace):
                self._finish(job, ctx, out, lease_until)
            else:
                self._fail(job, "cancelled while running", retryable=True)
            self._count("cancelled")
        elif reason == "lease_lost":
            log.warning("job %s: lease lost; the attempt's result is dropped", job.id)
            self._count("lost")
        elif reason == "timeout":
            self._fail(job, f"timeout: the attempt ran past {job.timeout_ms} ms", retryable=True)
            self._count("timed_out")
        elif reason == "deadline":
            # The server recorded the attempt's end (dead, reason deadline): nothing more to record.
            log.info("job %s: its deadline passed; the server ended the attempt", job.id)
            self._count("failed")
        else:
            self._release(job)

    def _heartbeat(self, job: ClaimedJob, b: _Beat, until: float) -> None:
        """Sends one heartbeat (on a thread of its own), bounded by the lease it
        would renew: no try, and no retry, past ``until``."""
        try:
            b.beat = self.client.call(_ops.heartbeat(job.id, job.lease_token, until=until))
            b.answered_at = time.monotonic()
        except (LeaseLostError, NotFoundError):
            b.gone = self._lease_gone_reason(job, until) if job.deadline is not None else "lease_lost"
        except Exception as exc:  # noqa: B902 - any failure is a heartbeat that did not get through
            b.error = exc
        finally:
            b.done.set()

    def _deadline_at(
        self, job: ClaimedJob, local_now: float, lease_expires_at: Optional[_dt.datetime]
    ) -> Optional[float]:
        """The instant on this worker's monotonic clock when the server's clock should
        read the job's deadline (``None``: no deadline). The server's clock read
        ``lease_expires_at - lease`` (of the claim, or of a heartbeat's answer) at
        ``local_now``; without one, this machine's wall clock stands in for it."""
        if job.deadline is None:
            return None
        if lease_expires_at is not None:
            server_now = lease_expires_at - _dt.timedelta(milliseconds=self.lease_ms)
        else:
            server_now = _dt.datetime.now(_dt.timezone.utc)
        return local_now + max(0.0, (job.deadline - server_now).total_seconds())

    def _lease_gone_reason(self, job: ClaimedJob, until: Optional[float] = None) -> str:
        """Why a heartbeat of a job with a deadline found the lease gone:
        ``deadline`` when the server ended this attempt there (or at its timeout,
        as a heartbeat then records it), ``lease_lost`` when the attempt was no
        longer this worker's (or the question got no answer by ``until``)."""
        op = _ops.get_job(job.id, None)
        op.until = until
        try:
            now = self.client.call(op)
        except IdemqError:
            return "lease_lost"
        if now.attempt == job.attempt and now.state not in ("active", "completed"):
            return "deadline"
        return "lease_lost"

    def _finish(self, job: ClaimedJob, ctx: JobContext, out: _Outcome, lease_until: float) -> None:
        err = out.error
        if err is None:
            try:
                # As the client sends it: NaN and the infinities are not JSON.
                json.dumps(out.result, allow_nan=False)
            except (TypeError, ValueError) as exc:
                self._fail(job, f"the handler's result is not JSON: {exc}", retryable=False)
                return
            self._hand_over(_Ack(job=job, result=out.result, lease_until=lease_until))
        elif isinstance(err, LeaseLostError):
            log.warning("job %s: lease lost; the attempt's result is dropped", job.id)
            self._count("lost")
        elif isinstance(err, JobFailure):
            self._fail(
                job, err.message, retryable=err.retryable, retry_after_ms=err.retry_after_ms, snooze_ms=err.snooze_ms
            )
        elif isinstance(err, asyncio.CancelledError):
            self._fail(job, f"interrupted ({ctx.stop_reason or 'cancelled'})", retryable=True)
        else:
            text = "".join(traceback.format_exception_only(type(err), err)).strip()
            self._fail(job, text, retryable=True)

    def _fail(
        self,
        job: ClaimedJob,
        error: str,
        *,
        retryable: bool,
        retry_after_ms: Optional[int] = None,
        snooze_ms: Optional[int] = None,
    ) -> None:
        text = error[-8192:]
        op = _ops.fail(job.id, job.lease_token, text, retryable, retry_after_ms, snooze_ms)
        try:
            self.client.call(op)
        except LeaseLostError:
            # A snooze keeps no error text; a failure keeps the text sent.
            if snooze_ms is not None:
                ended = op.uncertain and self._ended_by_own_call(job, "snoozed", None)
            else:
                ended = op.uncertain and self._ended_by_own_call(job, "failed", _kept_error(text))
            self._count("failed" if ended else "lost")
        except IdemqError as exc:
            log.warning("job %s: fail could not be recorded: %s", job.id, exc)
        else:
            self._count("failed")

    def _release(self, job: ClaimedJob) -> None:
        op = _ops.release(job.id, job.lease_token)
        try:
            self.client.call(op)
        except LeaseLostError:
            ended = op.uncertain and self._ended_by_own_call(job, "released", None)
            self._count("released" if ended else "lost")
        except IdemqError as exc:
            log.warning("job %s: release failed: %s", job.id, exc)
        else:
            self._count("released")

    def _ended_by_own_call(self, job: ClaimedJob, outcome: str, error: Optional[str]) -> bool:
        """Whether a ``fail`` or ``release`` answered ``lease-lost`` after a try of
        it went unanswered (a connection error or a timeout) was recorded by that
        try. The run of the attempt this worker held then ended as the call ends
        one: ``outcome`` (``failed``, ``snoozed`` or ``released``), or
        ``cancelled`` when a cancel was requested, with the error text sent as the
        server keeps it (``error``; none for a snooze or a release). An attempt
        the server ended otherwise (its lease expired, a heartbeat recorded its
        timeout or deadline) keeps its own outcome or text, and one still running
        has no end: those are lost, and so is every attempt when the runs cannot
        be read."""
        try:
            runs = self.client.runs(job.id)
        except IdemqError as exc:
            log.warning("job %s: whether its %s was recorded is unknown: %s", job.id, _CALL_OF[outcome], exc)
            return False
        for run in runs:
            if (
                run.attempt == job.attempt
                and run.outcome in (outcome, "cancelled")
                and (run.error or "") == (error or "")
            ):
                log.info("job %s: an earlier try of its %s was recorded", job.id, _CALL_OF[outcome])
                return True
        return False

    # ------------------------------------------------------------------ completions
    # A completion goes on the next claim when one starts soon (one round trip
    # for both), else in a batch of its own (``POST /v1/jobs/complete``).

    def _hand_over(self, ack: _Ack) -> None:
        with self._pending_cv:
            self._pending.append(ack)
            self._pending_cv.notify_all()

    def _take_carried(self) -> List[_Ack]:
        with self._pending_cv:
            if not self._carry:
                return []
            taken = [a for a in self._pending if a.carry][:_MAX_COMPLETIONS]
            if taken:
                chosen = set(map(id, taken))
                self._pending = [a for a in self._pending if id(a) not in chosen]
            return taken

    def _put_back(self, acks: List[_Ack], unsure: bool = False) -> None:
        if not acks:
            return
        for a in acks:
            a.carry = False
            a.unsure = a.unsure or unsure
        with self._pending_cv:
            self._pending[:0] = acks
            self._pending_cv.notify_all()

    def _ack_loop(self) -> None:
        """Sends the completions no claim took, many per round trip."""
        while True:
            with self._pending_cv:
                while not self._pending and not self._closing:
                    self._pending_cv.wait()
                if not self._pending:
                    return
                closing = self._closing
            if not closing:
                time.sleep(_COMPLETION_DELAY)
            with self._pending_cv:
                batch = self._pending[:_MAX_COMPLETIONS]
                del self._pending[:_MAX_COMPLETIONS]
            if batch:
                self._ack(batch)

    def _ack(self, batch: List[_Ack]) -> None:
        while batch:
            if not self._batch_complete:
                batch, error = self._one_by_one(batch)
            else:
                op = _ops.complete_many([a.item() for a in batch])
                try:
                    answers: List[Union[str, ApiError]] = self.client.call(op)
                except (NotFoundError, MethodNotAllowedError):
                    # A server without batch completion: one call per job.
                    self._batch_complete = False
                    continue
                except IdemqError as exc:
                    self._mark_unsure(batch, op)
                    if exc.retryable:
                        batch = self._unexpired(batch, exc)
                        time.sleep(0.2)
                        continue
                    # Refused as a whole, as one result over the size limit does: one
                    # call per job gives each its own answer, so the others still complete.
                    log.info("a completion batch was refused (%s); sending them one by one", exc)
                    batch, error = self._one_by_one(batch)
                else:
                    self._mark_unsure(batch, op)
                    self._settle(batch, answers)
                    return
            if batch:
                batch = self._unexpired(batch, error)
                time.sleep(0.2)

    def _one_by_one(self, batch: List[_Ack]) -> Tuple[List[_Ack], Optional[IdemqError]]:
        """Records each completion on its own; returns those to try again, with the
        transient error that stopped the last of them."""
        again: List[_Ack] = []
        error: Optional[IdemqError] = None
        for a in batch:
            op = _ops.complete(a.job.id, a.job.lease_token, a.result)
            try:
                self.client.call(op)
            except (PayloadTooLargeError, ValidationError, BadRequestError) as exc:
                self._mark_unsure([a], op)
                # The same handler would return the same result: retrying the attempt cannot help.
                self._fail(a.job, f"the handler's result was refused: {exc}", retryable=False)
            except ApiError as exc:
                self._mark_unsure([a], op)
                if exc.retryable:
                    again.append(a)
                    error = exc
                else:
                    self._settle([a], [exc])
            except IdemqError as exc:
                self._mark_unsure([a], op)
                again.append(a)
                error = exc
            else:
                self._count("completed")
        return again, error

    @staticmethod
    def _mark_unsure(acks: List[_Ack], op: _ops.Op[Any]) -> None:
        if op.uncertain:
            for a in acks:
                a.unsure = True

    def _unexpired(self, batch: List[_Ack], exc: Optional[IdemqError]) -> List[_Ack]:
        now = time.monotonic()
        for a in batch:
            if a.lease_until <= now:
                log.warning("job %s: completion not recorded before the lease ran out: %s", a.job.id, exc)
                self._count("lost")
        return [a for a in batch if a.lease_until > now]

    def _settle(self, batch: List[_Ack], answers: Sequence[Union[str, ApiError]]) -> None:
        for a, ans in zip(batch, answers):
            if isinstance(ans, LeaseLostError):
                self._count("completed" if a.unsure and self._recorded(a) else "lost")
            elif isinstance(ans, ApiError):
                log.warning("job %s: completion refused: %s", a.job.id, ans)
                self._count("failed")
            else:
                self._count("completed")

    def _recorded(self, a: _Ack) -> bool:
        """Whether an earlier try of this completion, whose answer was lost, was
        recorded: the job is ``completed`` at the attempt this worker held (only
        its lease token could complete that attempt)."""
        try:
            job = self.client.get_job(a.job.id)
        except IdemqError as exc:
            log.warning("job %s: whether its completion was recorded is unknown: %s", a.job.id, exc)
            return False
        if job.state == "completed" and job.attempt == a.job.attempt:
            log.info("job %s: an earlier try of its completion was recorded", a.job.id)
            return True
        return False


def _kept_error(error: str) -> str:
    """A failure's error text as the server keeps it in the attempt's run:
    U+0000 written as U+FFFD, cut to 8 KiB of UTF-8 on a character boundary."""
    raw = error.replace("\0", "\ufffd").encode("utf-8", "surrogatepass")
    return raw[:_MAX_ERROR_BYTES].decode("utf-8", "ignore")


def _unknown_complete(exc: BadRequestError) -> bool:
    """Whether a claim's ``400`` says the server does not know its ``complete``
    member (a server from before claims carried completions), not that
    something in it was malformed."""
    member = exc.problem.get("field")
    if member is not None:
        return str(member) == "complete"
    detail = exc.detail or ""
    return "unknown" in detail and "`complete`" in detail
