from __future__ import annotations

import asyncio
import datetime as dt
import logging
from typing import Callable

import pytest

import idemq
from conftest import Server

SECRET_KEY = "capture:inv_42-secret-part-0123456789"


def test_enqueue_returns_id_and_replay_returns_the_same(client: idemq.Client, uniq: Callable[[str], str]) -> None:
    key, q = uniq("k"), uniq("q")
    first = client.enqueue_with_result("invoice.capture", {"invoice_id": "inv_42"}, idempotency_key=key, queue=q)
    assert first.outcome == "accepted"
    assert first.reason is None
    again = client.enqueue_with_result("invoice.capture", {"invoice_id": "inv_42"}, idempotency_key=key, queue=q)
    assert again.outcome == "replayed"
    assert again.job_id == first.job_id
    assert client.enqueue("invoice.capture", {"invoice_id": "inv_42"}, idempotency_key=key, queue=q) == first.job_id
    # Nothing more was written: one job in the queue.
    page = client.list_jobs(queue=q)
    assert [j.id for j in page.jobs] == [first.job_id]


def test_conflict_is_typed_and_never_shows_the_key(
    client: idemq.Client, uniq: Callable[[str], str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    key = SECRET_KEY + uniq("x")
    scope = uniq("scope")
    job_id = client.enqueue("invoice.capture", {"invoice_id": "inv_42"}, idempotency_key=key, scope=scope)
    with pytest.raises(idemq.EnqueueIdempotencyConflictError) as info:
        client.enqueue("invoice.capture", {"invoice_id": "inv_43"}, idempotency_key=key, scope=scope)
    err = info.value
    assert isinstance(err, idemq.IdemqError)
    assert err.job_id == job_id
    assert err.source == "idempotency_key"
    assert err.scope == scope
    assert err.fields == ["payload"]
    assert err.status == 409
    assert err.key_preview is not None and err.key_preview.endswith("…")
    assert err.key_preview[:-1] == key[: len(err.key_preview) - 1]
    assert err.key_digest is not None and len(err.key_digest) == 16
    for text in (str(err), repr(err), repr(err.problem), str(err.args), caplog.text):
        assert key not in text
        assert SECRET_KEY not in text
    # Nothing was written by the refused request.
    assert client.get_job(job_id).payload == {"invoice_id": "inv_42"}


def test_conflict_through_the_header_and_scope_in_body(
    client: idemq.Client, uniq: Callable[[str], str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    key = uniq("hdr-key")
    scope = uniq("s")
    first = client.enqueue_with_result("email.send", {"to": "a"}, idempotency_key=key, scope=scope, key_in_header=True)
    assert first.outcome == "accepted"
    # The header and the body are the same key.
    again = client.enqueue_with_result("email.send", {"to": "a"}, idempotency_key=key, scope=scope)
    assert (again.outcome, again.job_id) == ("replayed", first.job_id)
    with pytest.raises(idemq.EnqueueIdempotencyConflictError) as info:
        client.enqueue("email.send", {"to": "b"}, idempotency_key=key, scope=scope, key_in_header=True)
    assert info.value.job_id == first.job_id
    assert info.value.scope == scope
    assert key not in str(info.value) and key not in repr(info.value)
    assert caplog.records and key not in caplog.text


def test_conflict_on_an_explicit_job_id(client: idemq.Client, uniq: Callable[[str], str]) -> None:
    jid = uniq("job")
    assert client.enqueue("t.one", 1, job_id=jid) == jid
    assert client.enqueue_with_result("t.one", 1, job_id=jid).outcome == "replayed"
    with pytest.raises(idemq.EnqueueIdempotencyConflictError) as info:
        client.enqueue("t.one", 2, job_id=jid)
    err = info.value
    assert (err.job_id, err.source, err.scope, err.key_preview, err.key_digest) == (jid, "job_id", None, None, None)
    assert "payload" in err.fields


def test_twenty_concurrent_identical_enqueues(server: Server, uniq: Callable[[str], str]) -> None:
    key = uniq("burst")

    async def main() -> list[idemq.EnqueueResult]:
        async with idemq.AsyncClient(server.url) as c:
            return list(
                await asyncio.gather(
                    *[c.enqueue_with_result("order.place", {"order": 7}, idempotency_key=key) for _ in range(20)]
                )
            )

    results = asyncio.run(main())
    outcomes = sorted(r.outcome for r in results)
    assert outcomes == ["accepted"] + ["replayed"] * 19
    assert len({r.job_id for r in results}) == 1


def test_non_replaceable_carries_its_reason(client: idemq.Client, uniq: Callable[[str], str]) -> None:
    typ = uniq("sync")
    first = client.enqueue_with_result(typ, {"n": 1}, dedupe=idemq.Dedupe("acct-1"))
    assert first.outcome == "accepted"
    other = client.enqueue_with_result(typ, {"n": 2}, dedupe=idemq.Dedupe("acct-1", replace=True))
    assert (other.outcome, other.reason, other.job_id) == ("non_replaceable", "incompatible_mode", first.job_id)

    typ2 = uniq("remind")
    due = client.enqueue_with_result(typ2, {"n": 1}, dedupe=idemq.Dedupe("acct-1", replace=True))
    late = client.enqueue_with_result(typ2, {"n": 2}, dedupe=idemq.Dedupe("acct-1", replace=True))
    assert (late.outcome, late.reason, late.job_id) == ("non_replaceable", "window_elapsed", due.job_id)

    typ3 = uniq("later")
    waiting = client.enqueue_with_result(typ3, {"n": 1}, delay_ms=60_000, dedupe={"key": "k", "replace": True})
    replaced = client.enqueue_with_result(typ3, {"n": 2}, delay_ms=60_000, dedupe={"key": "k", "replace": True})
    assert (replaced.outcome, replaced.reason, replaced.job_id) == ("replaced", None, waiting.job_id)
    assert client.get_job(waiting.job_id).payload == {"n": 2}
    coalesced = client.enqueue_with_result(typ, {"n": 3}, dedupe="acct-1")
    assert (coalesced.outcome, coalesced.job_id) == ("coalesced", first.job_id)


def test_batch_with_a_bad_item_returns_per_item_results(client: idemq.Client, uniq: Callable[[str], str]) -> None:
    q = uniq("batch")
    key = uniq("k")
    results = client.enqueue_many(
        [
            idemq.EnqueueRequest("a.job", {"i": 0}, queue=q, idempotency_key=key),
            idemq.EnqueueRequest("not a valid type!", {"i": 1}, queue=q),
            idemq.EnqueueRequest("a.job", {"i": 0}, queue=q, idempotency_key=key),
            idemq.EnqueueRequest("a.job", {"i": 9}, queue=q, idempotency_key=key),
        ]
    )
    assert len(results) == 4
    ok, bad, replay, conflict = results
    assert isinstance(ok, idemq.EnqueueResult) and ok.outcome == "accepted"
    assert isinstance(bad, idemq.ValidationError) and bad.field == "type" and bad.status == 422
    assert isinstance(replay, idemq.EnqueueResult) and (replay.outcome, replay.job_id) == ("replayed", ok.job_id)
    assert isinstance(conflict, idemq.EnqueueIdempotencyConflictError) and conflict.job_id == ok.job_id
    assert conflict.fields == ["payload"]
    assert key not in repr(results)
    assert [j.id for j in client.list_jobs(queue=q).jobs] == [ok.job_id]


def test_atomic_batch_failure_writes_nothing(client: idemq.Client, uniq: Callable[[str], str]) -> None:
    q = uniq("atomic")
    with pytest.raises(idemq.ValidationError) as info:
        client.enqueue_many(
            [idemq.EnqueueRequest("a.job", 1, queue=q), idemq.EnqueueRequest("a.job", 2, queue=q, max_attempts=0)],
            atomic=True,
        )
    assert info.value.index == 1
    assert info.value.field == "max_attempts"
    assert client.list_jobs(queue=q).jobs == []
    results = client.enqueue_many([idemq.EnqueueRequest("a.job", i, queue=q) for i in range(3)], atomic=True)
    assert [r.outcome for r in results if isinstance(r, idemq.EnqueueResult)] == ["accepted"] * 3


def test_explain_writes_nothing(client: idemq.Client, uniq: Callable[[str], str]) -> None:
    q = uniq("explain")
    key = uniq("k")
    ex = client.explain("report.build", {"r": 1}, queue=q, idempotency_key=key)
    assert ex.outcome == "accepted"
    assert client.list_jobs(queue=q).jobs == []
    job_id = client.enqueue("report.build", {"r": 1}, queue=q, idempotency_key=key)
    again = client.explain("report.build", {"r": 1}, queue=q, idempotency_key=key)
    assert (again.outcome, again.job_id) == ("replayed", job_id)
    conflict = client.explain("report.build", {"r": 2}, queue=q, idempotency_key=key)
    assert conflict.outcome == "conflict"
    assert conflict.conflict_fields == ["payload"]
    assert conflict.idempotency is not None and conflict.idempotency["job_id"] == job_id
    assert [j.id for j in client.list_jobs(queue=q).jobs] == [job_id]
    with pytest.raises(idemq.ValidationError):
        client.explain("report.build", None, queue=q, max_attempts=5000)


def test_every_option_reaches_the_job(client: idemq.Client, uniq: Callable[[str], str]) -> None:
    q = uniq("opts")
    deadline = dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=2)
    run_at = dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1)
    jid = client.enqueue(
        "opt.job",
        {"x": [1, 2]},
        queue=q,
        priority=5,
        run_at=run_at,
        max_attempts=3,
        retry=idemq.FixedRetry(delay_ms=500),
        timeout_ms=60_000,
        deadline=deadline,
        concurrency_key=uniq("ck"),
        tags=["b", "a", "a"],
        keep_ms=1000,
        idempotency_key=uniq("k"),
        scope=uniq("sc"),
        ttl_ms=3_600_000,
        dedupe=idemq.Dedupe(uniq("d"), ttl_ms=60_000),
    )
    job = client.get_job(jid)
    assert (job.queue, job.priority, job.max_attempts, job.timeout_ms) == (q, 5, 3, 60_000)
    assert job.state == "scheduled"
    assert job.tags == ["a", "b"]
    assert job.raw["retry"] == {"kind": "fixed", "delay_ms": 500}
    assert job.deadline is not None and abs((job.deadline - deadline).total_seconds()) < 0.001
    assert job.run_at is not None and abs((job.run_at - run_at).total_seconds()) < 0.001
    assert job.idempotency is not None and job.idempotency.key_digest
    assert job.dedupe is not None and job.dedupe.mode == "throttle"
    exp = client.enqueue("opt.job", None, queue=q, retry=idemq.ExponentialRetry(initial_ms=100, factor=3.0, max_ms=900, jitter=False), delay_ms=50_000)
    assert client.get_job(exp).raw["retry"]["factor"] == 3.0
    none = client.enqueue("opt.job", None, queue=q, retry=idemq.NoRetry(), delay_ms=50_000)
    assert client.get_job(none).raw["retry"] == {"kind": "none"}


def test_validation_and_payload_errors_are_typed(client: idemq.Client) -> None:
    with pytest.raises(idemq.ValidationError) as info:
        client.enqueue("ok.type", None, max_attempts=0)
    assert info.value.field == "max_attempts" and info.value.reason
    with pytest.raises(idemq.PayloadTooLargeError) as big:
        client.enqueue("ok.type", "x" * (1024 * 1024 + 10))
    assert big.value.status == 413
    with pytest.raises(idemq.NotFoundError):
        client.get_job("no-such-job")
    with pytest.raises(ValueError):
        client.enqueue("ok.type", None, idempotency_key="kéy", key_in_header=True)
