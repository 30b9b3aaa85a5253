from __future__ import annotations

import asyncio
import datetime as dt
import json
import threading
import time
from typing import Any, Callable, Dict, List, Tuple

import httpx
import pytest

import idemq
from conftest import Server, run_worker, wait_for


def _worker(client: idemq.Client, q: str, handlers: Dict[str, Any], **kw: Any) -> idemq.Worker:
    kw.setdefault("concurrency", 4)
    kw.setdefault("poll_wait_ms", 300)
    kw.setdefault("lease_ms", 3000)
    return idemq.Worker(client, queues=[q], handlers=handlers, **kw)


def _terminal(client: idemq.Client, job_id: str, timeout: float = 20.0) -> idemq.Job:
    deadline = time.monotonic() + timeout
    while True:
        job = client.get_job(job_id, wait_ms=1000)
        if job.terminal or time.monotonic() > deadline:
            return job


def test_worker_drains_jobs_with_results(client: idemq.Client, uniq: Callable[[str], str]) -> None:
    q = uniq("drain")
    seen: List[int] = []
    lock = threading.Lock()

    def add(ctx: idemq.JobContext) -> Dict[str, int]:
        with lock:
            seen.append(ctx.payload["i"])
        return {"sum": ctx.payload["a"] + ctx.payload["b"]}

    ids = [client.enqueue("math.add", {"i": i, "a": i, "b": 1}, queue=q) for i in range(30)]
    w = _worker(client, q, {"math.add": add}, concurrency=5)
    t = run_worker(w)
    try:
        for i, jid in enumerate(ids):
            job = _terminal(client, jid)
            assert job.state == "completed", job
            assert job.result == {"sum": i + 1}
    finally:
        w.stop()
        t.join(20)
    assert not t.is_alive()
    assert sorted(seen) == list(range(30))
    assert w.report.completed == 30
    assert (w.report.failed, w.report.lost) == (0, 0)


def test_worker_retries_a_failing_job_and_failure_kinds(client: idemq.Client, uniq: Callable[[str], str]) -> None:
    q = uniq("retry")
    attempts: Dict[str, List[int]] = {}

    def flaky(ctx: idemq.JobContext) -> str:
        attempts.setdefault(ctx.id, []).append(ctx.attempt)
        if ctx.attempt == 1:
            raise RuntimeError("transient trouble")
        return "ok"

    def permanent(ctx: idemq.JobContext) -> None:
        raise idemq.JobFailure.permanent("bad input")

    def snoozer(ctx: idemq.JobContext) -> str:
        if ctx.attempt == 1:
            raise idemq.JobFailure.snooze(100)
        return "after snooze"

    def later(ctx: idemq.JobContext) -> str:
        if ctx.attempt == 1:
            raise idemq.JobFailure.retry_after("come back", 100)
        return "retried"

    flaky_id = client.enqueue("flaky", None, queue=q, retry=idemq.FixedRetry(delay_ms=100))
    perm_id = client.enqueue("permanent", None, queue=q, max_attempts=5)
    snooze_id = client.enqueue("snoozer", None, queue=q, max_attempts=1)
    later_id = client.enqueue("later", None, queue=q, retry=idemq.FixedRetry(delay_ms=3_600_000))
    w = _worker(client, q, {"flaky": flaky, "permanent": permanent, "snoozer": snoozer, "later": later})
    t = run_worker(w)
    try:
        job = _terminal(client, flaky_id)
        assert (job.state, job.result, job.attempt) == ("completed", "ok", 2)
        assert [r.outcome for r in client.runs(flaky_id)] == ["failed", "completed"]
        assert "transient trouble" in (client.runs(flaky_id)[0].error or "")
        dead = _terminal(client, perm_id)
        assert (dead.state, dead.attempt) == ("dead", 1)
        assert "bad input" in (dead.last_error or "")
        snoozed = _terminal(client, snooze_id)
        assert (snoozed.state, snoozed.result) == ("completed", "after snooze")
        assert [r.outcome for r in client.runs(snooze_id)] == ["snoozed", "completed"]
        retried = _terminal(client, later_id)
        assert (retried.state, retried.result) == ("completed", "retried")
    finally:
        w.stop()
        t.join(20)
    assert attempts[flaky_id] == [1, 2]


def test_worker_stops_a_handler_on_cancel(client: idemq.Client, uniq: Callable[[str], str]) -> None:
    q = uniq("cancel")
    started = threading.Event()
    reasons: List[Any] = []

    def long(ctx: idemq.JobContext) -> str:
        started.set()
        while not ctx.wait_cancelled(0.05):
            pass
        reasons.append(ctx.stop_reason)
        raise RuntimeError("stopped")

    jid = client.enqueue("long", None, queue=q)
    w = _worker(client, q, {"long": long}, lease_ms=900)
    t = run_worker(w)
    try:
        assert started.wait(10)
        assert client.cancel(jid)["cancelled"] is True
        job = _terminal(client, jid)
        assert job.state == "cancelled"
        assert reasons == ["cancelled"]
    finally:
        w.stop()
        t.join(20)
    assert w.report.cancelled == 1


def test_async_handler_is_interrupted_on_cancel(client: idemq.Client, uniq: Callable[[str], str]) -> None:
    q = uniq("async")
    started = threading.Event()
    interrupted = threading.Event()

    async def handler(ctx: idemq.JobContext) -> str:
        if ctx.payload == "quick":
            return "done"
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            interrupted.set()
            raise
        return "never"

    quick = client.enqueue("aio", "quick", queue=q)
    slow = client.enqueue("aio", "slow", queue=q)
    w = _worker(client, q, {"aio": handler}, lease_ms=900, cancel_grace=0.2)
    t = run_worker(w)
    try:
        assert _terminal(client, quick).result == "done"
        assert started.wait(10)
        client.cancel(slow)
        assert _terminal(client, slow).state == "cancelled"
        assert interrupted.wait(5)
    finally:
        w.stop()
        t.join(20)


class DropHeartbeats(httpx.BaseTransport):
    """Loopback traffic as usual, except that every heartbeat is lost on the way."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.dropped = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/heartbeat"):
            self.dropped += 1
            raise httpx.ConnectError("dropped", request=request)
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


def test_a_lost_lease_never_completes(server: Server, client: idemq.Client, uniq: Callable[[str], str]) -> None:
    q = uniq("lease")
    finished = threading.Event()
    reasons: List[Any] = []

    def slow(ctx: idemq.JobContext) -> str:
        time.sleep(2.5)
        reasons.append(ctx.stop_reason)
        finished.set()
        return "too late"

    jid = client.enqueue("slow", None, queue=q, max_attempts=1)
    transport = DropHeartbeats()
    with idemq.Client(server.url, transport=transport, retries=idemq.Retries(max_retries=1, initial_backoff=0.05)) as broken:
        w = _worker(broken, q, {"slow": slow}, lease_ms=1000)
        t = run_worker(w)
        try:
            assert finished.wait(20)
            job = _terminal(client, jid)
            time.sleep(0.5)  # let the worker act on the handler's return
            job = client.get_job(jid)
        finally:
            w.stop()
            t.join(20)
    assert transport.dropped >= 1
    assert reasons == ["lease_lost"]
    assert job.state == "dead"
    assert job.result is None
    assert [r.outcome for r in client.runs(jid)] == ["lease_expired"]
    assert w.report.lost == 1 and w.report.completed == 0


def test_checkpoints_survive_a_retry(client: idemq.Client, uniq: Callable[[str], str]) -> None:
    q = uniq("ckpt")
    calls: List[int] = []
    got: List[Any] = []

    def charge(ctx: idemq.JobContext) -> Any:
        def step() -> Dict[str, Any]:
            calls.append(ctx.attempt)
            return {"charge_id": f"ch_{ctx.id}", "attempt": ctx.attempt}

        value = ctx.checkpoint("charge", step)
        got.append(value)
        if ctx.attempt == 1:
            raise RuntimeError("crash after the charge")
        return value

    jid = client.enqueue("charge", None, queue=q, retry=idemq.FixedRetry(delay_ms=100))
    w = _worker(client, q, {"charge": charge})
    t = run_worker(w)
    try:
        job = _terminal(client, jid)
    finally:
        w.stop()
        t.join(20)
    assert job.state == "completed"
    assert calls == [1]
    expected = {"charge_id": f"ch_{jid}", "attempt": 1}
    assert got == [expected, expected]
    assert job.result == expected
    assert client.checkpoints(jid) == {"charge": expected}


def test_checkpoint_first_writer_wins(client: idemq.Client, uniq: Callable[[str], str]) -> None:
    q = uniq("fww")
    jid = client.enqueue("step", None, queue=q)
    [job] = client.claim(queues=[q], worker="test", lease_ms=5000)
    assert client.put_checkpoint(jid, "s", job.lease_token, {"v": 1}) is True
    assert client.put_checkpoint(jid, "s", job.lease_token, {"v": 2}) is False
    assert client.checkpoints(jid) == {"s": {"v": 1}}
    client.complete(jid, job.lease_token, {"done": True})
    assert client.get_job(jid).result == {"done": True}


def test_graceful_stop_releases_unfinished_leases(client: idemq.Client, uniq: Callable[[str], str]) -> None:
    q = uniq("stop")
    started = threading.Event()
    reasons: List[Any] = []

    def stuck(ctx: idemq.JobContext) -> None:
        started.set()
        ctx.wait_cancelled(30)
        reasons.append(ctx.stop_reason)

    jid = client.enqueue("stuck", None, queue=q)
    w = _worker(client, q, {"stuck": stuck})
    t = run_worker(w)
    assert started.wait(10)
    stopped_at = time.monotonic()
    w.stop(grace=0.3)
    t.join(20)
    assert not t.is_alive()
    assert time.monotonic() - stopped_at < 5
    assert reasons == ["shutdown"]
    job = client.get_job(jid)
    assert job.state == "ready"
    assert job.attempts_used == 0
    assert [r.outcome for r in client.runs(jid)] == ["released"]
    assert w.report.released == 1


def test_timeout_is_enforced_locally(client: idemq.Client, uniq: Callable[[str], str]) -> None:
    q = uniq("timeout")
    reasons: List[Any] = []

    def sleepy(ctx: idemq.JobContext) -> str:
        ctx.wait_cancelled(5)
        reasons.append(ctx.stop_reason)
        return "late"

    jid = client.enqueue("sleepy", None, queue=q, timeout_ms=300, max_attempts=1)
    w = _worker(client, q, {"sleepy": sleepy})
    t = run_worker(w)
    try:
        job = _terminal(client, jid)
    finally:
        w.stop()
        t.join(20)
    assert job.state == "dead"
    assert job.result is None
    assert "timeout" in (job.last_error or "")
    assert reasons == ["timeout"]
    assert w.report.timed_out == 1


class Recording(httpx.BaseTransport):
    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.sent: List[str] = []
        self.bodies: List[Tuple[str, Any]] = []
        self.lock = threading.Lock()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        line = f"{request.method} {request.url.path}"
        content = request.read()
        with self.lock:
            self.sent.append(line)
            self.bodies.append((line, json.loads(content) if content else None))
        return self.inner.handle_request(request)

    def completed_ids(self) -> Tuple[List[str], List[str]]:
        """The job ids sent to be completed: carried on claims, and in batches of their own."""
        carried = [i["id"] for line, b in self.bodies if line == "POST /v1/claim" and b for i in b.get("complete") or []]
        batched = [i["id"] for line, b in self.bodies if line == "POST /v1/jobs/complete" for i in b["jobs"]]
        return carried, batched

    def singles(self) -> List[str]:
        return [s for s in self.sent if s.endswith("/complete") and s != "POST /v1/jobs/complete"]

    def close(self) -> None:
        self.inner.close()


def test_worker_respects_concurrency_and_batches_completions(server: Server, client: idemq.Client, uniq: Callable[[str], str]) -> None:
    q = uniq("batchack")
    running = 0
    peak = 0
    lock = threading.Lock()

    def work(ctx: idemq.JobContext) -> int:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        time.sleep(0.05)
        with lock:
            running -= 1
        return int(ctx.payload)

    ids = [r.job_id for r in client.enqueue_many([idemq.EnqueueRequest("w", i, queue=q) for i in range(40)]) if isinstance(r, idemq.EnqueueResult)]
    assert len(ids) == 40
    rec = Recording()
    with idemq.Client(server.url, transport=rec) as c:
        w = _worker(c, q, {"w": work}, concurrency=3)
        t = run_worker(w)
        try:
            for i, jid in enumerate(ids):
                assert _terminal(client, jid).result == i
        finally:
            w.stop()
            t.join(20)
    assert peak <= 3
    assert w.report.completed == 40
    carrying = [b for line, b in rec.bodies if line == "POST /v1/claim" and b and b.get("complete")]
    acks = [s for s in rec.sent if s == "POST /v1/jobs/complete"]
    assert rec.singles() == [] and 1 <= len(carrying) + len(acks) <= 40


def _in_ms(d: dt.timedelta) -> dt.datetime:
    """An instant ``d`` from now, in whole milliseconds, as the server keeps a deadline."""
    at = dt.datetime.now(dt.timezone.utc) + d
    return at.replace(microsecond=at.microsecond // 1000 * 1000)


def _ended_at_deadline(client: idemq.Client, jid: str) -> None:
    """The server ended the job's one attempt at its deadline: dead with reason
    ``deadline``, the run recorded by the server, and no retry scheduled."""
    events = client.events(jid)
    kinds = [e.kind for e in events]
    assert "retry_scheduled" not in kinds, kinds
    assert [e.data.get("reason") for e in events if e.kind == "dead"] == ["deadline"], events
    job = client.get_job(jid)
    assert (job.state, job.result, job.attempt, job.attempts_used) == ("dead", None, 1, 1), job
    assert job.last_error == "deadline passed", job
    assert [(r.outcome, r.error) for r in client.runs(jid)] == [("failed", "deadline passed")]


def test_deadline_ends_the_job_dead_on_the_server(client: idemq.Client, uniq: Callable[[str], str]) -> None:
    q = uniq("deadline")
    stops: List[Tuple[Any, dt.datetime]] = []

    def slow(ctx: idemq.JobContext) -> str:
        ctx.wait_cancelled(10)
        stops.append((ctx.stop_reason, dt.datetime.now(dt.timezone.utc)))
        return "late"

    deadline = _in_ms(dt.timedelta(seconds=1.5))
    # Budget left and a policy that would retry 1 ms later: a worker that
    # failed the attempt itself would leave a `retry_scheduled`, or a `dead`
    # with another reason (`permanent`).
    jid = client.enqueue("slow", None, queue=q, deadline=deadline, max_attempts=5, retry=idemq.FixedRetry(delay_ms=1))
    w = _worker(client, q, {"slow": slow}, lease_ms=30_000)
    t = run_worker(w)
    try:
        job = _terminal(client, jid)
        wait_for(lambda: len(stops) == 1)
    finally:
        w.stop()
        t.join(20)
    assert job.state == "dead"
    _ended_at_deadline(client, jid)
    # Stopped once the server's clock (this machine's) was past the deadline.
    assert stops[0][0] == "deadline" and stops[0][1] >= deadline, stops
    assert (w.report.failed, w.report.lost, w.report.completed) == (1, 0, 0)


class HeartbeatLog(httpx.BaseTransport):
    """A transport to the real server that records every heartbeat in
    ``beats``: (job id, status, monotonic instant)."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.beats: List[Tuple[str, Any, float]] = []
        self.lock = threading.Lock()

    def of(self, job_id: str) -> List[Tuple[Any, float]]:
        with self.lock:
            return [(status, at) for j, status, at in self.beats if j == job_id]

    def close(self) -> None:
        self.inner.close()


class Skewed(HeartbeatLog):
    """Makes a worker's clock disagree with the server's: claim answers say the
    lease expires ``ahead`` seconds later than it does (the server's clock seems
    ahead), and heartbeats fail as unreachable until ``down_until`` (monotonic).
    Records every heartbeat: (job id, status or "down", monotonic instant)."""

    def __init__(self, ahead: float = 0.0, down_until: float = 0.0) -> None:
        super().__init__()
        self.ahead = ahead
        self.down_until = down_until

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        beat = path.endswith("/heartbeat")
        job_id = path.split("/")[-2] if beat else ""
        if beat and time.monotonic() < self.down_until:
            with self.lock:
                self.beats.append((job_id, "down", time.monotonic()))
            raise httpx.ConnectError("the server cannot be reached", request=request)
        resp = self.inner.handle_request(request)
        if beat:
            with self.lock:
                self.beats.append((job_id, resp.status_code, time.monotonic()))
        if path == "/v1/claim" and resp.status_code == 200 and self.ahead:
            body = json.loads(resp.read())
            for j in body["jobs"]:
                at = dt.datetime.fromisoformat(j["lease_expires_at"])
                j["lease_expires_at"] = (at + dt.timedelta(seconds=self.ahead)).isoformat()
            return httpx.Response(200, headers={"content-type": "application/json"}, content=json.dumps(body).encode())
        return resp


def test_deadline_waits_for_the_servers_clock(server: Server, client: idemq.Client, uniq: Callable[[str], str]) -> None:
    q = uniq("skew")
    stops: Dict[str, Tuple[Any, dt.datetime]] = {}

    def hang(ctx: idemq.JobContext) -> str:
        ctx.wait_cancelled(10)
        stops[ctx.id] = (ctx.stop_reason, dt.datetime.now(dt.timezone.utc))
        return "late"

    # The worker believes the server's clock 2 s ahead: it asks about the
    # deadline about 1 s after the claim, 2 s before the server says yes.
    skew = Skewed(ahead=2.0)

    def finish(ctx: idemq.JobContext) -> str:
        # Ends after the worker's timer says "deadline", before the server's clock
        # does: once the early question was answered ("not yet"), however late the
        # claim came, and well before the worker asks again at the deadline. The
        # bound only keeps a broken worker from hanging the test.
        give_up = time.monotonic() + 10.0
        while not skew.of(ctx.id) and time.monotonic() < give_up:
            if ctx.wait_cancelled(0.005):
                stops[ctx.id] = (ctx.stop_reason, dt.datetime.now(dt.timezone.utc))
                break
        return "in time"

    deadline = _in_ms(dt.timedelta(seconds=3))
    retry = idemq.FixedRetry(delay_ms=1)
    hung = client.enqueue("hang", None, queue=q, deadline=deadline, max_attempts=5, retry=retry)
    done = client.enqueue("finish", None, queue=q, deadline=deadline, max_attempts=5, retry=retry)
    with idemq.Client(server.url, transport=skew) as c:
        # A lease of 30 s: no heartbeat but the deadline's comes before it.
        w = _worker(c, q, {"hang": hang, "finish": finish}, lease_ms=30_000)
        t = run_worker(w)
        try:
            completed = _terminal(client, done)
            dead = _terminal(client, hung)
            wait_for(lambda: hung in stops)
        finally:
            w.stop()
            t.join(20)
    assert (completed.state, completed.result) == ("completed", "in time"), completed
    assert done not in stops, stops
    assert [s for s, _ in skew.of(done)] == [200], skew.of(done)
    assert dead.state == "dead"
    _ended_at_deadline(client, hung)
    assert stops[hung][0] == "deadline" and stops[hung][1] >= deadline, stops
    # Asked early ("not yet": the lease renewed), then again at the deadline.
    statuses = [s for s, _ in skew.of(hung)]
    assert statuses[0] == 200 and statuses[-1] == 409, statuses
    assert (w.report.completed, w.report.failed, w.report.lost) == (1, 1, 0)


def test_deadline_is_asked_again_while_the_server_is_unreachable(server: Server, client: idemq.Client, uniq: Callable[[str], str]) -> None:
    q = uniq("unreachable")
    stops: List[Any] = []

    def hang(ctx: idemq.JobContext) -> str:
        ctx.wait_cancelled(10)
        stops.append(ctx.stop_reason)
        return "late"

    deadline = _in_ms(dt.timedelta(seconds=1))
    jid = client.enqueue("hang", None, queue=q, deadline=deadline, max_attempts=5, retry=idemq.FixedRetry(delay_ms=1))
    # Heartbeats fail from the start until 1.2 s after the deadline.
    skew = Skewed(down_until=time.monotonic() + 2.2)
    with idemq.Client(server.url, transport=skew, retries=0) as c:
        w = _worker(c, q, {"hang": hang}, lease_ms=30_000)
        t = run_worker(w)
        try:
            job = _terminal(client, jid)
            wait_for(lambda: len(stops) == 1)
        finally:
            w.stop()
            t.join(20)
    assert job.state == "dead"
    _ended_at_deadline(client, jid)
    # The handler went on while the question could not be answered, asked
    # again with a growing backoff, and stopped once the server ended the attempt.
    assert stops == ["deadline"]
    beats = skew.of(jid)
    down = [at for s, at in beats if s == "down"]
    assert 3 <= len(down) <= 8, beats
    gaps = [b - a for a, b in zip(down, down[1:])]
    assert all(g >= 0.04 for g in gaps) and gaps[-1] > gaps[0], gaps
    assert beats[-1][0] == 409, beats
    assert (w.report.failed, w.report.lost) == (1, 0)


class SlowCompletions(HeartbeatLog):
    """Holds every request carrying a completion (a claim carrying some, a batch,
    a completion of its own) for ``hold`` seconds before it goes to the server, as
    a busy network or a long claim queue would. Records every heartbeat:
    (job id, status, the monotonic instant it was sent)."""

    def __init__(self, hold: float) -> None:
        super().__init__()
        self.hold = hold
        self.held = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        carries = path.endswith("/complete")
        if path == "/v1/claim":
            carries = bool(json.loads(request.read() or b"{}").get("complete"))
        if carries:
            with self.lock:
                self.held += 1
            time.sleep(self.hold)
        sent = time.monotonic()
        resp = self.inner.handle_request(request)
        if path.endswith("/heartbeat"):
            with self.lock:
                self.beats.append((path.split("/")[-2], resp.status_code, sent))
        return resp


def test_no_heartbeat_ends_an_attempt_whose_handler_returned(server: Server, client: idemq.Client, uniq: Callable[[str], str]) -> None:
    q = uniq("late-beat")
    deadline = _in_ms(dt.timedelta(seconds=1.5))
    # The deadline on the monotonic clock the heartbeats are recorded on.
    deadline_at = time.monotonic() + (deadline - dt.datetime.now(dt.timezone.utc)).total_seconds()
    returned: List[float] = []

    def finish(ctx: idemq.JobContext) -> str:
        # Returns 0.6 s before the deadline (at once when the claim came later), so
        # that neither its return nor a heartbeat already under way races the deadline.
        ctx.wait_cancelled(max(0.0, (deadline - dt.datetime.now(dt.timezone.utc)).total_seconds() - 0.6))
        returned.append(time.monotonic())
        return "in time"

    jid = client.enqueue("finish", None, queue=q, deadline=deadline, max_attempts=5, retry=idemq.FixedRetry(delay_ms=1))
    # The completion is held for more than a heartbeat interval (1.2 s with a lease of
    # 3.6 s), and reaches the server about 1 s past the deadline, well within the lease:
    # a heartbeat sent meanwhile (the question about the deadline, due at it, or a
    # regular one) would reach the server past the deadline and end the attempt there
    # (dead, deadline), and the completion would be refused.
    slow = SlowCompletions(hold=1.6)
    with idemq.Client(server.url, transport=slow) as c:
        w = _worker(c, q, {"finish": finish}, lease_ms=3600)
        t = run_worker(w)
        try:
            job = _terminal(client, jid)
        finally:
            w.stop()
            t.join(20)
    assert (job.state, job.result) == ("completed", "in time"), job
    assert slow.held > 0
    # Every heartbeat of the job renewed the lease and was sent before the deadline:
    # none went out while the completion waited past it.
    beats = slow.of(jid)
    assert all(status == 200 and at < deadline_at for status, at in beats), (returned, deadline_at, beats)
    assert (w.report.completed, w.report.lost, w.report.failed) == (1, 0, 0)


def test_a_regular_heartbeat_that_finds_the_deadline_passed_reports_the_deadline(
    server: Server, client: idemq.Client, uniq: Callable[[str], str]
) -> None:
    q = uniq("behind")
    stops: List[Any] = []

    def hang(ctx: idemq.JobContext) -> str:
        ctx.wait_cancelled(10)
        stops.append(ctx.stop_reason)
        return "late"

    deadline = _in_ms(dt.timedelta(seconds=1))
    jid = client.enqueue("hang", None, queue=q, deadline=deadline, max_attempts=5, retry=idemq.FixedRetry(delay_ms=1))
    # The worker believes the server's clock 3 s behind: it would ask about the
    # deadline 3 s after it passed, so a regular heartbeat finds it first.
    skew = Skewed(ahead=-3.0)
    with idemq.Client(server.url, transport=skew) as c:
        w = _worker(c, q, {"hang": hang}, lease_ms=750)
        t = run_worker(w)
        started = time.monotonic()
        try:
            job = _terminal(client, jid)
            wait_for(lambda: len(stops) == 1)
        finally:
            w.stop()
            t.join(20)
    assert job.state == "dead"
    _ended_at_deadline(client, jid)
    assert stops == ["deadline"]
    beats = skew.of(jid)
    assert len(beats) >= 2 and beats[-1][0] == 409 and beats[-1][1] < started + 3.0, beats
    assert (w.report.failed, w.report.lost) == (1, 0)


def test_checkpoint_keeps_the_first_stored_value(client: idemq.Client, uniq: Callable[[str], str]) -> None:
    q = uniq("race")
    got: List[Any] = []

    def handler(ctx: idemq.JobContext) -> Any:
        def step() -> str:
            # Another writer stores the checkpoint while this step runs.
            assert client.put_checkpoint(ctx.id, "s", ctx.lease_token, "first") is True
            return "second"

        got.append(ctx.checkpoint("s", step))
        return got[-1]

    jid = client.enqueue("race", None, queue=q)
    w = _worker(client, q, {"race": handler})
    t = run_worker(w)
    try:
        job = _terminal(client, jid)
    finally:
        w.stop()
        t.join(20)
    assert got == ["first"]
    assert job.result == "first"
    assert client.checkpoints(jid) == {"s": "first"}


def test_worker_drains_n_jobs_each_completed_once(server: Server, client: idemq.Client, uniq: Callable[[str], str]) -> None:
    q = uniq("carry")
    n = 40
    calls: Dict[str, int] = {}
    lock = threading.Lock()

    def work(ctx: idemq.JobContext) -> Dict[str, int]:
        with lock:
            calls[ctx.id] = calls.get(ctx.id, 0) + 1
        time.sleep(0.01)
        return {"twice": 2 * int(ctx.payload)}

    ids = [r.job_id for r in client.enqueue_many([idemq.EnqueueRequest("w", i, queue=q) for i in range(n)]) if isinstance(r, idemq.EnqueueResult)]
    assert len(ids) == n
    rec = Recording()
    with idemq.Client(server.url, transport=rec) as c:
        w = _worker(c, q, {"w": work}, concurrency=2)
        t = run_worker(w)
        try:
            jobs = [_terminal(client, jid) for jid in ids]
        finally:
            w.stop()
            t.join(20)
    assert not t.is_alive()
    for i, job in enumerate(jobs):
        assert (job.state, job.result, job.attempt) == ("completed", {"twice": 2 * i}, 1), job
    assert calls == {jid: 1 for jid in ids}
    assert (w.report.completed, w.report.failed, w.report.lost, w.report.released) == (n, 0, 0, 0)
    carried, batched = rec.completed_ids()
    # Slots freed one at a time start claims that take what just finished.
    assert carried, "no claim carried a completion"
    assert rec.singles() == []
    assert sorted(carried + batched) == sorted(ids), "a completion sent twice, or never"
    for jid in ids[:5]:
        assert [(r.attempt, r.outcome) for r in client.runs(jid)] == [(1, "completed")]


class RefuseCompletionsOnClaims(Recording):
    """A server from before claims took ``complete``: like any unknown member, a 400."""

    def __init__(self) -> None:
        super().__init__()
        self.refused = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/claim" and b'"complete"' in request.read():
            with self.lock:
                self.refused += 1
            problem = {
                "type": "/problems/bad-request",
                "title": "Bad request",
                "status": 400,
                "detail": "unknown field `complete`",
                "field": "complete",
            }
            return httpx.Response(400, json=problem, headers={"Content-Type": "application/problem+json"})
        return super().handle_request(request)


def test_worker_sends_completions_apart_when_claims_refuse_them(server: Server, client: idemq.Client, uniq: Callable[[str], str]) -> None:
    q = uniq("nocarry")
    n = 30

    def work(ctx: idemq.JobContext) -> int:
        time.sleep(0.01)
        return int(ctx.payload)

    ids = [r.job_id for r in client.enqueue_many([idemq.EnqueueRequest("w", i, queue=q) for i in range(n)]) if isinstance(r, idemq.EnqueueResult)]
    rec = RefuseCompletionsOnClaims()
    with idemq.Client(server.url, transport=rec) as c:
        w = _worker(c, q, {"w": work}, concurrency=2)
        t = run_worker(w)
        try:
            jobs = [_terminal(client, jid) for jid in ids]
        finally:
            w.stop()
            t.join(20)
    assert [(j.state, j.result) for j in jobs] == [("completed", i) for i in range(n)]
    # Refused once, then never carried again.
    assert rec.refused == 1
    carried, batched = rec.completed_ids()
    assert carried == [] and sorted(batched) == sorted(ids)
    assert (w.report.completed, w.report.failed, w.report.lost) == (n, 0, 0)


def test_a_result_over_the_payload_limit_fails_only_its_own_job(server: Server, client: idemq.Client, uniq: Callable[[str], str]) -> None:
    q = uniq("oversize")
    n = 6
    ids = [r.job_id for r in client.enqueue_many([idemq.EnqueueRequest("w", i, queue=q) for i in range(n)]) if isinstance(r, idemq.EnqueueResult)]
    big = ids[2]
    # Every handler returns once all have started, so the completions travel together.
    together = threading.Barrier(n)
    raised: List[BaseException] = []

    def work(ctx: idemq.JobContext) -> Any:
        together.wait(10)
        return "x" * (1024 * 1024 + 1024) if ctx.id == big else {"i": ctx.payload}

    rec = Recording()
    with idemq.Client(server.url, transport=rec) as c:
        w = _worker(c, q, {"w": work}, concurrency=n)

        def run() -> None:
            try:
                w.run()
            except BaseException as exc:  # noqa: B902 - the test reports it
                raised.append(exc)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        try:
            jobs = [_terminal(client, jid) for jid in ids]
        finally:
            w.stop()
            t.join(20)
    assert not t.is_alive() and raised == []
    for i, job in enumerate(jobs):
        if job.id == big:
            assert (job.state, job.attempt, job.result) == ("dead", 1, None), job
            assert "the handler's result was refused" in (job.last_error or ""), job.last_error
        else:
            assert (job.state, job.result, job.attempt) == ("completed", {"i": i}, 1), job
    assert (w.report.completed, w.report.failed, w.report.lost) == (n - 1, 1, 0)
    carried, batched = rec.completed_ids()
    assert big in carried + batched


def _run_catching(w: idemq.Worker) -> Tuple[threading.Thread, List[BaseException]]:
    """Runs the worker in a thread; what ``run()`` raised goes in the list."""
    raised: List[BaseException] = []

    def run() -> None:
        try:
            w.run()
        except BaseException as exc:  # noqa: B902 - the test reports it
            raised.append(exc)

    t = threading.Thread(target=run, name="test-worker", daemon=True)
    t.start()
    return t, raised


def test_run_ends_with_a_claim_refused_for_good(make_server: Callable[..., Server], server: Server, uniq: Callable[[str], str]) -> None:
    q = uniq("refused")
    srv = make_server(token="tok-" + uniq("secret"))
    cases: List[Tuple[idemq.Client, type]] = [
        (idemq.Client(srv.url), idemq.UnauthorizedError),  # no token
        (idemq.Client(srv.url, token="wrong"), idemq.UnauthorizedError),
        (idemq.Client(server.url, headers={"Host": "rebound.example"}), idemq.ForbiddenHostError),
    ]
    for c, expected in cases:
        with c:
            w = _worker(c, q, {"x": lambda ctx: None})
            started = time.monotonic()
            t, raised = _run_catching(w)
            t.join(10)
            assert not t.is_alive(), f"run() went on after {expected.__name__}"
            assert time.monotonic() - started < 5
            assert len(raised) == 1 and isinstance(raised[0], expected), raised
            assert w.stopping and w.report == idemq.WorkerReport()


def test_run_ends_with_a_lease_the_server_refuses(client: idemq.Client, uniq: Callable[[str], str]) -> None:
    q = uniq("badlease")
    jid = client.enqueue("x", None, queue=q)
    for lease_ms in (50, 3_600_001):
        w = _worker(client, q, {"x": lambda ctx: "ran"}, lease_ms=lease_ms)
        t, raised = _run_catching(w)
        t.join(10)
        assert not t.is_alive(), f"run() went on with lease_ms={lease_ms}"
        assert len(raised) == 1 and isinstance(raised[0], idemq.ValidationError), raised
        assert raised[0].field == "lease_ms"
    assert client.get_job(jid).state == "ready"  # nothing was claimed


def test_poll_wait_is_kept_within_the_api_bound(client: idemq.Client) -> None:
    waits: List[Any] = []
    holder: List[idemq.Worker] = []

    def handler(request: httpx.Request) -> httpx.Response:
        # As the server does: a wait past 60 s is refused.
        wait = json.loads(request.read()).get("wait_ms")
        waits.append(wait)
        if wait is not None and wait > 60_000:
            problem = {"type": "/problems/validation", "title": "Validation failed", "status": 422, "field": "wait_ms"}
            return httpx.Response(422, json=problem, headers={"Content-Type": "application/problem+json"})
        holder[0].stop()
        return httpx.Response(200, json={"jobs": []})

    with idemq.Client("http://127.0.0.1:9", transport=httpx.MockTransport(handler)) as c:
        w = _worker(c, "q", {"x": lambda ctx: None}, poll_wait_ms=120_000)
        holder.append(w)
        assert w.poll_wait_ms == 60_000
        t, raised = _run_catching(w)
        t.join(10)
        if t.is_alive():
            w.stop()
    assert not t.is_alive() and raised == [] and waits == [60_000], (raised, waits)
    assert _worker(client, "q", {"x": lambda ctx: None}, poll_wait_ms=-1).poll_wait_ms == 0


@pytest.mark.parametrize(
    "error",
    [idemq.UnauthorizedError("refused (401)", status=401, problem={}), RuntimeError("boom"), KeyboardInterrupt()],
    ids=["claim-refused", "exception", "keyboard-interrupt"],
)
def test_every_end_of_run_shuts_down_with_grace_and_releases(
    server: Server, client: idemq.Client, uniq: Callable[[str], str], error: BaseException
) -> None:
    q = uniq("fatal")
    started = threading.Event()
    reasons: List[Any] = []

    def stuck(ctx: idemq.JobContext) -> None:
        started.set()
        ctx.wait_cancelled(60)
        reasons.append(ctx.stop_reason)

    jid = client.enqueue("stuck", None, queue=q)
    calls: List[int] = []
    with idemq.Client(server.url) as c:
        call = c.call

        def failing_claim(op: Any) -> Any:
            # The first claim gets the job; the second, with a slot still free, fails.
            if op.path != "/v1/claim":
                return call(op)
            calls.append(1)
            if len(calls) == 1:
                return call(op)
            assert started.wait(10)
            raise error

        c.call = failing_claim  # type: ignore[method-assign]
        w = _worker(c, q, {"stuck": stuck}, concurrency=2, shutdown_grace=0.5)
        t, raised = _run_catching(w)
        assert started.wait(10)
        began = time.monotonic()
        t.join(10)
    assert not t.is_alive(), f"run() did not end after {error!r}"
    assert time.monotonic() - began < 3
    assert raised == [error]
    assert reasons == ["shutdown"]
    job = client.get_job(jid)
    assert (job.state, job.attempts_used) == ("ready", 0)
    assert [r.outcome for r in client.runs(jid)] == ["released"]
    assert w.report.released == 1
    client.cancel(jid)


class HangingHeartbeats(httpx.BaseTransport):
    """Loopback traffic as usual, except that no heartbeat is ever answered: each
    waits out the read timeout it was sent with, as a request the server never
    answers does, then times out. Records those timeouts."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.release = threading.Event()
        self.timeouts: List[Any] = []
        self.lock = threading.Lock()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/heartbeat"):
            read = request.extensions.get("timeout", {}).get("read")
            with self.lock:
                self.timeouts.append(read)
            self.release.wait(read)
            raise httpx.ReadTimeout("no answer", request=request)
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


def test_a_hanging_heartbeat_cannot_outlast_the_lease(server: Server, client: idemq.Client, uniq: Callable[[str], str]) -> None:
    q = uniq("hungbeat")
    stops: List[Any] = []
    stopped = threading.Event()

    def wait(ctx: idemq.JobContext) -> str:
        ctx.wait_cancelled(60)
        stops.append(ctx.stop_reason)
        stopped.set()
        return "too late"

    jid = client.enqueue("wait", None, queue=q, max_attempts=1)
    hang = HangingHeartbeats()
    # The client's defaults: a 30 s timeout and 4 retries. A heartbeat that took
    # them all would keep the handler running, unaware, long past its 1 s lease.
    with idemq.Client(server.url, transport=hang) as c:
        w = _worker(c, q, {"wait": wait}, lease_ms=1000)
        t = run_worker(w)
        try:
            assert stopped.wait(15), "the handler was never told its lease was gone"
            job = _terminal(client, jid)
            wait_for(lambda: w.report.lost == 1)
        finally:
            hang.release.set()
            w.stop()
            t.join(20)
    assert stops == ["lease_lost"]
    # Each try of a heartbeat was bounded by the lease it would have renewed.
    assert hang.timeouts and all(0 < x <= 1.0 for x in hang.timeouts), hang.timeouts
    assert (job.state, job.result) == ("dead", None), job
    assert [r.outcome for r in client.runs(jid)] == ["lease_expired"]
    assert (w.report.lost, w.report.completed, w.report.failed) == (1, 0, 0)


def test_a_claim_asks_for_at_most_the_apis_bound() -> None:
    limits: List[Any] = []
    holder: List[idemq.Worker] = []

    def handler(request: httpx.Request) -> httpx.Response:
        # As the server does: a limit outside 1 to 1,000 is refused.
        limit = json.loads(request.read()).get("limit")
        limits.append(limit)
        if not isinstance(limit, int) or not 1 <= limit <= 1000:
            problem = {"type": "/problems/validation", "title": "Validation failed", "status": 422, "field": "limit"}
            return httpx.Response(422, json=problem, headers={"Content-Type": "application/problem+json"})
        holder[0].stop()
        return httpx.Response(200, json={"jobs": []})

    with idemq.Client("http://127.0.0.1:9", transport=httpx.MockTransport(handler)) as c:
        w = idemq.Worker(c, queues=["q"], handlers={"x": lambda ctx: None}, concurrency=1500, poll_wait_ms=0)
        holder.append(w)
        t, raised = _run_catching(w)
        t.join(10)
        if t.is_alive():
            w.stop()
    assert not t.is_alive() and raised == [] and limits == [1000], (raised, limits)


def _carries(request: httpx.Request) -> bool:
    """Whether a request carries a completion: a claim carrying some, a batch, one on its own."""
    path = request.url.path
    if path == "/v1/claim":
        return bool(json.loads(request.read() or b"{}").get("complete"))
    return path.endswith("/complete")


def _problem(status: int, name: str, **extra: Any) -> httpx.Response:
    problem = {"type": f"/problems/{name}", "title": name, "status": status, **extra}
    return httpx.Response(status, json=problem, headers={"Content-Type": "application/problem+json"})


class LoseCompletionAnswers(Recording):
    """Sends the first ``lose`` requests carrying a completion to the server, then
    loses their answers, as a connection that breaks after the commit does.
    ``old_server`` answers as a server from before claims carried completions
    (a 400 naming ``complete``); ``no_batches`` also as one without batch
    completion (404)."""

    def __init__(self, lose: int = 1, old_server: bool = False, no_batches: bool = False) -> None:
        super().__init__()
        self.lose = lose
        self.old_server = old_server
        self.no_batches = no_batches
        self.lost: List[str] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        carries = _carries(request)
        if carries and path == "/v1/claim" and self.old_server:
            return _problem(400, "bad-request", detail="unknown member `complete`", field="complete")
        if path == "/v1/jobs/complete" and self.no_batches:
            return _problem(404, "not-found")
        resp = super().handle_request(request)
        with self.lock:
            lose = carries and len(self.lost) < self.lose
            if lose:
                self.lost.append(path)
        if lose:
            resp.read()
            resp.close()
            raise httpx.ReadError("the connection broke before the answer", request=request)
        return resp


@pytest.mark.parametrize(
    "path,retries",
    [("claim", None), ("claim", 0), ("batch", None), ("batch", 0), ("single", None)],
    ids=["claim", "claim-no-retries", "batch", "batch-no-retries", "single"],
)
def test_a_completion_recorded_before_its_answer_was_lost_counts_completed(
    server: Server,
    client: idemq.Client,
    uniq: Callable[[str], str],
    monkeypatch: pytest.MonkeyPatch,
    path: str,
    retries: Any,
) -> None:
    # A completion waits a second for a claim to carry it: with one slot, the
    # claim its slot starts always does (unless claims refuse completions).
    monkeypatch.setattr(idemq.worker, "_COMPLETION_DELAY", 1.0)
    q = uniq("lostanswer")
    jid = client.enqueue("w", 7, queue=q)
    lossy = LoseCompletionAnswers(old_server=path != "claim", no_batches=path == "single")
    with idemq.Client(server.url, transport=lossy, retries=retries) as c:
        w = _worker(c, q, {"w": lambda ctx: ctx.payload * 6}, concurrency=1)
        t = run_worker(w)
        try:
            job = _terminal(client, jid)
            wait_for(lambda: w.report.completed + w.report.lost + w.report.failed >= 1)
        finally:
            w.stop()
            t.join(20)
    expected = {"claim": "/v1/claim", "batch": "/v1/jobs/complete", "single": f"/v1/jobs/{jid}/complete"}[path]
    assert lossy.lost == [expected], lossy.sent
    assert (job.state, job.result) == ("completed", 42), job
    assert [(r.attempt, r.outcome) for r in client.runs(jid)] == [(1, "completed")]
    # The repeat was answered lease-lost; the job says the first try was recorded.
    assert (w.report.completed, w.report.lost, w.report.failed) == (1, 0, 0), w.report


class LoseAnAnswer(Recording):
    """Sends the first request whose path ends with ``suffix`` to the server, then
    loses its answer, as a connection that breaks after the commit does. Records
    the status of every answer that came back to the worker."""

    def __init__(self, suffix: str) -> None:
        super().__init__()
        self.suffix = suffix
        self.lost: List[str] = []
        self.answers: List[Tuple[str, int]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        resp = super().handle_request(request)
        path = request.url.path
        with self.lock:
            lose = path.endswith(self.suffix) and not self.lost
            if lose:
                self.lost.append(path)
            else:
                self.answers.append((path, resp.status_code))
        if lose:
            resp.read()
            resp.close()
            raise httpx.ReadError("the connection broke before the answer", request=request)
        return resp


_LONG = "\u00e9" * 5000  # 10,000 bytes of UTF-8: the server keeps the first 8 KiB


@pytest.mark.parametrize(
    "case,state,run,counted",
    [
        ("retry-after", "scheduled", ("failed", "later"), "failed"),
        ("permanent", "dead", ("failed", "bad input"), "failed"),
        ("long-error", "dead", ("failed", "\u00e9" * 4096), "failed"),
        ("snooze", "scheduled", ("snoozed", None), "failed"),
        ("cancelled", "cancelled", ("cancelled", "RuntimeError: stopped on cancel"), "failed"),
        ("release", "ready", ("released", None), "released"),
    ],
    ids=["retry-after", "permanent", "long-error", "snooze", "cancelled", "release"],
)
def test_a_fail_or_release_recorded_before_its_answer_was_lost_is_not_counted_lost(
    server: Server,
    client: idemq.Client,
    uniq: Callable[[str], str],
    case: str,
    state: str,
    run: Tuple[str, Any],
    counted: str,
) -> None:
    q = uniq("lostfail")
    jid = client.enqueue("w", case, queue=q, max_attempts=3)
    started = threading.Event()

    def handler(ctx: idemq.JobContext) -> Any:
        started.set()
        if case == "retry-after":
            raise idemq.JobFailure.retry_after("later", 60_000)
        if case == "permanent":
            raise idemq.JobFailure.permanent("bad input")
        if case == "long-error":
            raise idemq.JobFailure.permanent(_LONG)
        if case == "snooze":
            raise idemq.JobFailure.snooze(60_000)
        # Held until a cancel (a failure) or the shutdown (a release) stops it.
        ctx.wait_cancelled(20)
        if case == "cancelled":
            raise RuntimeError("stopped on cancel")
        return "too late"

    lossy = LoseAnAnswer("/release" if case == "release" else "/fail")
    with idemq.Client(server.url, transport=lossy) as c:
        w = _worker(c, q, {"w": handler}, concurrency=1, cancel_grace=5.0)
        t = run_worker(w)
        try:
            assert started.wait(20)
            if case == "cancelled":
                client.cancel(jid)
            elif case == "release":
                w.stop(grace=0)
            wait_for(lambda: w.report.failed + w.report.released + w.report.lost >= 1)
        finally:
            w.stop()
            t.join(20)
    assert not t.is_alive()
    path = f"/v1/jobs/{jid}/{'release' if case == 'release' else 'fail'}"
    # The first try was recorded and its answer lost; the repeat found the lease spent.
    assert lossy.lost == [path], lossy.sent
    assert [a for a in lossy.answers if a[0] == path] == [(path, 409)], lossy.answers
    assert client.get_job(jid).state == state
    assert [(r.attempt, r.outcome, r.error) for r in client.runs(jid)] == [(1, *run)]
    report = w.report
    expected = {"failed": 0, "released": 0, "lost": 0, "completed": 0}
    expected[counted] = 1
    assert {k: getattr(report, k) for k in expected} == expected, report
    assert report.cancelled == (1 if case == "cancelled" else 0), report


class LoseAFailBeforeTheServer(Recording):
    """Holds the first ``/fail`` of ``job_id`` until ``ready()`` says the attempt
    has ended otherwise, then ends it with a connection error, never sent."""

    def __init__(self, job_id: str, ready: Callable[[], bool]) -> None:
        super().__init__()
        self.job_id = job_id
        self.ready = ready
        self.held = 0
        self.answers: List[Tuple[str, int]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == f"/v1/jobs/{self.job_id}/fail":
            with self.lock:
                hold = self.held == 0
                self.held += 1
            if hold:
                wait_for(self.ready)
                raise httpx.ConnectError("the connection broke", request=request)
        resp = super().handle_request(request)
        with self.lock:
            self.answers.append((path, resp.status_code))
        return resp


def test_a_fail_answered_lease_lost_after_its_lease_expired_is_still_lost(
    server: Server, client: idemq.Client, uniq: Callable[[str], str]
) -> None:
    # The try went unanswered, but the server never saw it: the lease expired
    # meanwhile, and the repeat's lease-lost answer is a lost lease indeed.
    q = uniq("expiredfail")
    jid = client.enqueue("w", None, queue=q, max_attempts=3)

    def handler(ctx: idemq.JobContext) -> str:
        if ctx.attempt == 1:
            raise idemq.JobFailure.permanent("bad input")
        return "second"

    def expired() -> bool:
        job = client.get_job(jid)
        return job.attempt > 1 or job.state != "active"

    held = LoseAFailBeforeTheServer(jid, expired)
    with idemq.Client(server.url, transport=held) as c:
        w = _worker(c, q, {"w": handler}, concurrency=2, lease_ms=500)
        t = run_worker(w)
        try:
            job = _terminal(client, jid)
            wait_for(lambda: w.report.completed + w.report.lost >= 2)
        finally:
            w.stop()
            t.join(20)
    path = f"/v1/jobs/{jid}/fail"
    assert held.held == 2 and [a for a in held.answers if a[0] == path] == [(path, 409)], held.answers
    assert (job.state, job.result) == ("completed", "second"), job
    assert [(r.attempt, r.outcome) for r in client.runs(jid)] == [(1, "lease_expired"), (2, "completed")]
    assert (w.report.completed, w.report.lost, w.report.failed) == (1, 1, 0), w.report


def test_a_result_that_is_not_json_fails_its_own_job_and_claims_still_carry(
    server: Server, client: idemq.Client, uniq: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(idemq.worker, "_COMPLETION_DELAY", 1.0)
    q = uniq("nan")
    rec = Recording()
    with idemq.Client(server.url, transport=rec) as c:
        w = _worker(c, q, {"w": lambda ctx: float(ctx.payload)}, concurrency=1)
        t = run_worker(w)
        try:
            bad = client.enqueue("w", "nan", queue=q)
            dead = _terminal(client, bad)
            good = client.enqueue("w", "1.5", queue=q)
            done = _terminal(client, good)
            wait_for(lambda: w.report.completed == 1)
        finally:
            w.stop()
            t.join(20)
    assert (dead.state, dead.attempt, dead.result) == ("dead", 1, None), dead
    assert "the handler's result is not JSON" in (dead.last_error or ""), dead.last_error
    assert (done.state, done.result) == ("completed", 1.5), done
    # NaN never went to the server, and claims still carry completions.
    carried, batched = rec.completed_ids()
    assert carried == [good] and batched == [], (carried, batched)
    assert (w.report.completed, w.report.failed, w.report.lost) == (1, 1, 0)


class RefuseOneCarryingClaim(Recording):
    """Answers the first claim carrying completions with a 400 about one of its
    items (as a malformed result is answered), not about the ``complete`` member."""

    def __init__(self) -> None:
        super().__init__()
        self.refused = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/claim" and _carries(request):
            with self.lock:
                refuse = self.refused == 0
                self.refused += 1 if refuse else 0
            if refuse:
                return _problem(
                    400, "bad-request", detail="invalid member `complete.0.result`", field="complete.0.result"
                )
        return super().handle_request(request)


def test_one_refused_carrying_claim_does_not_stop_carrying(
    server: Server, client: idemq.Client, uniq: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(idemq.worker, "_COMPLETION_DELAY", 1.0)
    q = uniq("carryon")
    rec = RefuseOneCarryingClaim()
    with idemq.Client(server.url, transport=rec) as c:
        w = _worker(c, q, {"w": lambda ctx: ctx.payload}, concurrency=1)
        t = run_worker(w)
        try:
            first = client.enqueue("w", 1, queue=q)
            one = _terminal(client, first)
            second = client.enqueue("w", 2, queue=q)
            two = _terminal(client, second)
            wait_for(lambda: w.report.completed == 2)
        finally:
            w.stop()
            t.join(20)
    assert (one.state, one.result, two.state, two.result) == ("completed", 1, "completed", 2)
    assert rec.refused == 1
    # The refused one went in a call of its own; the next was carried again.
    carried, batched = rec.completed_ids()
    assert batched == [first] and carried == [second], (carried, batched)
    assert (w.report.completed, w.report.failed, w.report.lost) == (2, 0, 0)
