"""Safe retries: what is retried, what is never retried, and the typed errors
of an unreachable or unavailable server."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Callable, List, Optional

import httpx
import pytest

import idemq
from conftest import Server, free_port

FAST = idemq.Retries(max_retries=3, initial_backoff=0.01, max_backoff=0.02)


class Counting(httpx.BaseTransport):
    """Counts the requests that left the client (to loopback only)."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.sent: List[str] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(f"{request.method} {request.url.path}")
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


def test_keyed_enqueue_is_retried_across_a_server_that_comes_up_late(make_server: Callable[..., Server], uniq: Callable[[str], str]) -> None:
    port = free_port()
    srv = make_server(port=port, start=False)
    starter = threading.Timer(0.8, srv.start)
    starter.start()
    counting = Counting()
    retries = idemq.Retries(max_retries=40, initial_backoff=0.1, max_backoff=0.3)
    try:
        with idemq.Client(srv.url, retries=retries, transport=counting) as c:
            key = uniq("late")
            res = c.enqueue_with_result("late.job", {"n": 1}, idempotency_key=key)
            assert res.outcome == "accepted"
            assert len(counting.sent) > 1  # the first attempts met no server
            assert c.enqueue_with_result("late.job", {"n": 1}, idempotency_key=key).outcome == "replayed"
    finally:
        starter.join()


def test_unkeyed_enqueue_is_not_retried(uniq: Callable[[str], str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    counting = Counting()
    with idemq.Client(url, retries=FAST, transport=counting) as c:
        with pytest.raises(idemq.IdemqConnectionError) as info:
            c.enqueue("x.job", {"n": 1})
        assert isinstance(info.value, idemq.IdemqError) and info.value.retryable
        assert counting.sent == ["POST /v1/jobs"]

        counting.sent.clear()
        with pytest.raises(idemq.IdemqConnectionError):
            c.enqueue("x.job", {"n": 1}, job_id=uniq("explicit"))
        assert len(counting.sent) == FAST.max_retries + 1

        counting.sent.clear()
        with pytest.raises(idemq.IdemqConnectionError):
            c.enqueue_many([idemq.EnqueueRequest("x", idempotency_key="a"), idemq.EnqueueRequest("x")])
        assert len(counting.sent) == 1

        counting.sent.clear()
        with pytest.raises(idemq.IdemqConnectionError):
            c.enqueue_many([idemq.EnqueueRequest("x", idempotency_key="a"), idemq.EnqueueRequest("x", job_id="j")])
        assert len(counting.sent) == FAST.max_retries + 1

        counting.sent.clear()
        with pytest.raises(idemq.IdemqConnectionError):
            c.heartbeat("some-job", "token")
        assert len(counting.sent) == FAST.max_retries + 1


def test_a_silent_server_is_a_typed_timeout() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        url = "http://127.0.0.1:%d" % listener.getsockname()[1]
        with idemq.Client(url, timeout=0.3, retries=0) as c:
            start = time.monotonic()
            with pytest.raises(idemq.IdemqTimeoutError) as info:
                c.get_job("j")
            assert time.monotonic() - start < 3
            assert isinstance(info.value, idemq.IdemqConnectionError)


def _mock(statuses: List[int], *, retry_after: Optional[str] = None, problem: Optional[str] = None):  # type: ignore[no-untyped-def]
    calls: List[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        status = statuses[min(len(calls) - 1, len(statuses) - 1)]
        if status < 400:
            body = {"job_id": "j1", "outcome": "accepted", "lease_expires_at": None, "cancel_requested": False}
            return httpx.Response(status, json=body)
        name = problem or {503: "unavailable", 400: "bad-request", 401: "unauthorized", 403: "forbidden-host",
                           404: "not-found", 409: "idempotency-conflict", 413: "payload-too-large",
                           422: "validation", 500: "internal"}[status]
        headers = {"content-type": "application/problem+json"}
        if retry_after is not None:
            headers["retry-after"] = retry_after
        doc = {"type": f"/problems/{name}", "title": name, "status": status, "detail": "mocked"}
        return httpx.Response(status, headers=headers, content=json.dumps(doc).encode())

    return calls, httpx.MockTransport(handler)


def test_unavailable_is_retried_honouring_retry_after_only_when_safe() -> None:
    calls, transport = _mock([503, 201], retry_after="1")
    with idemq.Client("http://127.0.0.1:9", retries=FAST, transport=transport) as c:
        start = time.monotonic()
        assert c.enqueue("x", 1, idempotency_key="k") == "j1"
        assert time.monotonic() - start >= 0.95
        assert len(calls) == 2
        # The key went in the body, both times.
        assert all(json.loads(r.content)["idempotency"] == {"key": "k"} for r in calls)

    calls, transport = _mock([503, 201], retry_after="1")
    with idemq.Client("http://127.0.0.1:9", retries=FAST, transport=transport) as c:
        with pytest.raises(idemq.UnavailableError) as info:
            c.enqueue("x", 1)
        assert info.value.retry_after == 1.0 and info.value.status == 503
        assert len(calls) == 1

    calls, transport = _mock([503, 503, 200])
    with idemq.Client("http://127.0.0.1:9", retries=FAST, transport=transport) as c:
        assert c.heartbeat("j1", "tok").cancel_requested is False
        assert len(calls) == 3

    calls, transport = _mock([503])
    with idemq.Client("http://127.0.0.1:9", retries=FAST, transport=transport) as c:
        with pytest.raises(idemq.UnavailableError):
            c.enqueue("x", 1, idempotency_key="k")
        assert len(calls) == FAST.max_retries + 1


@pytest.mark.parametrize(
    "status,cls",
    [
        (400, idemq.BadRequestError),
        (401, idemq.UnauthorizedError),
        (403, idemq.ForbiddenHostError),
        (404, idemq.NotFoundError),
        (409, idemq.EnqueueIdempotencyConflictError),
        (413, idemq.PayloadTooLargeError),
        (422, idemq.ValidationError),
        (500, idemq.InternalError),
    ],
)
def test_client_errors_are_never_retried(status: int, cls: type) -> None:
    calls, transport = _mock([status, 201])
    with idemq.Client("http://127.0.0.1:9", retries=FAST, transport=transport) as c:
        with pytest.raises(cls) as info:
            c.enqueue("x", 1, idempotency_key="never-shown-key")
        assert len(calls) == 1
        assert isinstance(info.value, idemq.IdemqError)
        assert "never-shown-key" not in str(info.value) + repr(info.value)


@pytest.mark.parametrize(
    "status,cls",
    [
        (400, idemq.BadRequestError),
        (401, idemq.UnauthorizedError),
        (403, idemq.ForbiddenHostError),
        (404, idemq.NotFoundError),
        (409, idemq.UnexpectedResponseError),  # a 409 is one of three errors: no guess
        (413, idemq.PayloadTooLargeError),
        (422, idemq.ValidationError),
        (500, idemq.InternalError),
        (418, idemq.UnexpectedResponseError),
    ],
)
def test_an_unknown_problem_type_falls_back_on_the_status(status: int, cls: type) -> None:
    calls, transport = _mock([status, 201], problem="overloaded")
    with idemq.Client("http://127.0.0.1:9", retries=FAST, transport=transport) as c:
        with pytest.raises(idemq.ApiError) as info:
            c.enqueue("x", 1, idempotency_key="k")
        assert type(info.value) is cls
        assert (info.value.status, info.value.type, info.value.retryable) == (status, "/problems/overloaded", False)
        assert len(calls) == 1


def test_an_unknown_problem_type_with_503_is_unavailable_and_retried() -> None:
    calls, transport = _mock([503, 201], retry_after="1", problem="overloaded")
    with idemq.Client("http://127.0.0.1:9", retries=FAST, transport=transport) as c:
        start = time.monotonic()
        assert c.enqueue("x", 1, idempotency_key="k") == "j1"
        assert time.monotonic() - start >= 0.95  # Retry-After was honoured
        assert len(calls) == 2

    calls, transport = _mock([503, 201], retry_after="1", problem="overloaded")
    with idemq.Client("http://127.0.0.1:9", retries=FAST, transport=transport) as c:
        with pytest.raises(idemq.UnavailableError) as info:
            c.enqueue("x", 1)  # no key: never retried
        assert info.value.retryable and info.value.retry_after == 1.0
        assert info.value.type == "/problems/overloaded"
        assert len(calls) == 1


def test_lease_calls_are_retried_and_lease_lost_is_not() -> None:
    calls, transport = _mock([409], problem="lease-lost")
    with idemq.Client("http://127.0.0.1:9", retries=FAST, transport=transport) as c:
        with pytest.raises(idemq.LeaseLostError):
            c.complete("j1", "tok")
        assert len(calls) == 1


def test_unreachable_server_is_a_typed_error_from_the_async_client() -> None:
    import asyncio

    async def main() -> None:
        async with idemq.AsyncClient(f"http://127.0.0.1:{free_port()}", retries=FAST) as c:
            with pytest.raises(idemq.IdemqConnectionError):
                await c.health()

    asyncio.run(main())


def test_a_call_bounded_by_until_is_neither_tried_nor_retried_past_it() -> None:
    from idemq import _ops

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        url = "http://127.0.0.1:%d" % listener.getsockname()[1]
        # Each try alone would wait 2 s for the answer, and four retries follow.
        with idemq.Client(url, timeout=2.0) as c:
            start = time.monotonic()
            op = _ops.heartbeat("j", "tok", until=start + 0.5)
            with pytest.raises(idemq.IdemqTimeoutError):
                c.call(op)
            assert time.monotonic() - start < 1.9
            # The server may have had it: a timeout leaves the call uncertain.
            assert op.uncertain
            with pytest.raises(idemq.IdemqTimeoutError):
                c.call(_ops.heartbeat("j", "tok", until=time.monotonic() - 1))


def test_nan_and_infinity_are_refused_before_anything_is_sent() -> None:
    calls, transport = _mock([201])
    with idemq.Client("http://127.0.0.1:9", retries=FAST, transport=transport) as c:
        for value in (float("nan"), float("inf"), {"x": [float("-inf")]}):
            with pytest.raises(ValueError):
                c.enqueue("x", value, idempotency_key="k")
        with pytest.raises(ValueError):
            c.complete("j1", "tok", float("nan"))
    assert calls == []
