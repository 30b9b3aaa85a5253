from __future__ import annotations

import asyncio
import datetime as dt
import time
from typing import Callable

import httpx
import pytest

import idemq
from conftest import Server


def test_list_with_filters_and_cursor(client: idemq.Client, uniq: Callable[[str], str]) -> None:
    q = uniq("list")
    ids = [client.enqueue("list.job", {"i": i}, queue=q, tags=["even" if i % 2 == 0 else "odd"]) for i in range(5)]
    first = client.list_jobs(queue=q, limit=2)
    assert len(first.jobs) == 2 and first.next_cursor
    second = client.list_jobs(queue=q, limit=2, cursor=first.next_cursor)
    third = client.list_jobs(queue=q, limit=2, cursor=second.next_cursor)
    seen = [j.id for j in first.jobs + second.jobs + third.jobs]
    assert seen == list(reversed(ids))  # newest first
    assert third.next_cursor is None
    assert {j.id for j in client.list_jobs(queue=q, tag="odd").jobs} == {ids[1], ids[3]}
    assert len(client.list_jobs(queue=q, state="ready", type="list.job").jobs) == 5
    assert client.list_jobs(queue=q, state="dead").jobs == []


def test_events_runs_and_wait(client: idemq.Client, uniq: Callable[[str], str]) -> None:
    q = uniq("ev")
    jid = client.enqueue("ev.job", {"a": 1}, queue=q)
    [claimed] = client.claim(queues=[q], worker="py-test", lease_ms=5000)
    assert claimed.id == jid and claimed.attempt == 1 and claimed.payload == {"a": 1}
    hb = client.heartbeat(jid, claimed.lease_token)
    assert hb.cancel_requested is False and hb.lease_expires_at is not None
    assert client.complete(jid, claimed.lease_token, {"r": 2}) == "completed"
    job = client.get_job(jid, wait_ms=2000)
    assert (job.state, job.result) == ("completed", {"r": 2})
    kinds = [e.kind for e in client.events(jid)]
    assert kinds[0] == "accepted" and "completed" in kinds
    [run] = client.runs(jid)
    assert (run.attempt, run.worker, run.outcome) == (1, "py-test", "completed")
    with pytest.raises(idemq.LeaseLostError):
        client.heartbeat(jid, claimed.lease_token)


def test_a_claim_records_the_completions_it_carries(client: idemq.Client, uniq: Callable[[str], str]) -> None:
    q = uniq("carry")
    first = client.enqueue("c.job", 1, queue=q)
    second = client.enqueue("c.job", 2, queue=q)
    plain = client.claim(queues=[q], worker="py-test", lease_ms=5000)
    assert [j.id for j in plain] == [first] and plain.completed is None
    carrying = client.claim(
        queues=[q], worker="py-test", lease_ms=5000,
        complete=[idemq.CompleteItem(first, plain[0].lease_token, {"total": 1})],
    )
    assert isinstance(carrying, idemq.ClaimResult)
    assert carrying.completed == ["completed"]
    assert [j.id for j in carrying] == [second]
    job = client.get_job(first)
    assert (job.state, job.result) == ("completed", {"total": 1})
    [run] = client.runs(first)
    assert (run.attempt, run.worker, run.outcome) == (1, "py-test", "completed")
    # With nothing left to claim the completions are still recorded.
    last = client.claim(queues=[q], worker="py-test", complete=[idemq.CompleteItem(second, carrying[0].lease_token)])
    assert last == [] and last.completed == ["completed"]
    done = client.get_job(second)
    assert (done.state, done.result) == ("completed", None)


def test_a_stale_token_in_complete_fails_only_its_item(client: idemq.Client, uniq: Callable[[str], str]) -> None:
    q = uniq("stale")
    ids = [client.enqueue("s.job", i, queue=q) for i in range(3)]
    held = {j.id: j for j in client.claim(queues=[q], worker="py-test", limit=3, lease_ms=5000)}
    assert sorted(held) == sorted(ids)
    extra = client.enqueue("s.job", 3, queue=q)
    out = client.claim(
        queues=[q],
        worker="py-test",
        lease_ms=5000,
        complete=[
            idemq.CompleteItem(ids[0], held[ids[0]].lease_token, "r0"),
            idemq.CompleteItem(ids[1], "not-the-token", "r1"),
            idemq.CompleteItem(ids[2], held[ids[2]].lease_token),
        ],
    )
    assert [j.id for j in out] == [extra]
    assert out.completed is not None and len(out.completed) == 3
    assert out.completed[0] == "completed" and out.completed[2] == "completed"
    lost = out.completed[1]
    assert isinstance(lost, idemq.LeaseLostError), lost
    assert (lost.status, lost.job_id) == (409, ids[1])
    assert client.get_job(ids[0]).result == "r0"
    assert client.get_job(ids[2]).state == "completed"
    stale = client.get_job(ids[1])
    assert (stale.state, stale.result) == ("active", None)
    assert client.complete(ids[1], held[ids[1]].lease_token, "r1") == "completed"


def test_async_claim_carries_completions(server: Server, uniq: Callable[[str], str]) -> None:
    q = uniq("acarry")

    async def main() -> None:
        async with idemq.AsyncClient(server.url) as c:
            jid = await c.enqueue("a.job", 1, queue=q)
            [held] = await c.claim(queues=[q], worker="aio")
            out = await c.claim(queues=[q], worker="aio", complete=[idemq.CompleteItem(jid, held.lease_token, "done")])
            assert out == [] and out.completed == ["completed"]
            assert (await c.get_job(jid)).result == "done"

    asyncio.run(main())


def test_get_with_wait_returns_when_terminal(client: idemq.Client, uniq: Callable[[str], str]) -> None:
    q = uniq("wait")
    jid = client.enqueue("w.job", None, queue=q)
    [c] = client.claim(queues=[q], worker="py-test")

    import threading

    threading.Timer(0.4, lambda: client.complete(jid, c.lease_token, 7)).start()
    start = time.monotonic()
    job = client.get_job(jid, wait_ms=10_000)
    assert job.state == "completed" and job.result == 7
    assert 0.3 < time.monotonic() - start < 8


def test_fail_release_and_redrive(client: idemq.Client, uniq: Callable[[str], str]) -> None:
    q = uniq("dead")
    jid = client.enqueue("d.job", None, queue=q, max_attempts=1)
    [c] = client.claim(queues=[q], worker="py-test")
    assert client.release(jid, c.lease_token) == "ready"
    [c] = client.claim(queues=[q], worker="py-test")
    out = client.fail(jid, c.lease_token, "boom", retryable=False)
    assert out.state == "dead"
    with pytest.raises(idemq.LeaseLostError):
        client.fail(jid, c.lease_token, "again")
    key = uniq("redrive-key")
    red = client.redrive(jid, idempotency_key=key, max_attempts=2)
    assert (red.job_id, red.outcome) == (jid, "accepted")
    assert client.redrive(jid, idempotency_key=key, max_attempts=2).outcome == "replayed"
    with pytest.raises(idemq.NotDeadError) as info:
        client.redrive(jid)
    assert (info.value.status, info.value.state) == (409, "ready")
    other = client.enqueue("d.job", None, queue=q, delay_ms=60_000)
    with pytest.raises(idemq.EnqueueIdempotencyConflictError) as conflict:
        client.redrive(other, idempotency_key=key, max_attempts=2)
    assert conflict.value.fields == ["job_id"]
    assert key not in str(conflict.value)


def test_cancel_purge_promote(client: idemq.Client, uniq: Callable[[str], str]) -> None:
    q = uniq("ops")
    later = client.enqueue("o.job", None, queue=q, delay_ms=3_600_000)
    assert client.get_job(later).state == "scheduled"
    assert client.promote(later) is True
    assert client.get_job(later).state == "ready"
    res = client.cancel(later)
    assert res == {"cancelled": True, "state": "cancelled"} or res["cancelled"] is True
    assert client.cancel(later)["cancelled"] is False
    assert client.purge(later) is True
    with pytest.raises(idemq.NotFoundError):
        client.get_job(later)
    assert client.purge(later) is False


def test_bulk_and_cancel_by_key(client: idemq.Client, uniq: Callable[[str], str]) -> None:
    q = uniq("bulk")
    typ = uniq("debounced")
    for i in range(3):
        client.enqueue("b.job", i, queue=q)
    done = client.bulk("cancel", filter={"queue": q, "state": "ready"})
    assert done == {"matched": 3, "done": 3}
    assert client.bulk("purge", filter={"queue": q, "before": dt.datetime.now(dt.timezone.utc) + dt.timedelta(minutes=1)}, limit=10)["done"] == 3
    keyed = client.enqueue(typ, None, dedupe="acct-9")
    binding = client.lookup_dedupe(typ, "acct-9")
    assert binding is not None and (binding.job_id, binding.mode) == (keyed, "pending")
    assert client.cancel_by_key(typ, "acct-9") is True
    assert client.cancel_by_key(typ, "acct-9") is False
    assert client.lookup_dedupe(typ, "acct-9") is None
    assert client.get_job(keyed).state == "cancelled"


def test_idempotency_lookup_and_release(client: idemq.Client, uniq: Callable[[str], str]) -> None:
    key, scope = uniq("lookup-key"), uniq("sc")
    jid = client.enqueue("l.job", 1, idempotency_key=key, scope=scope)
    found = client.lookup_key(key, scope=scope)
    assert found is not None and found.job_id == jid and len(found.key_digest) == 16
    assert key not in repr(found)
    assert client.lookup_key(key) is None  # another scope
    assert client.release_key(key, scope=scope) is True
    assert client.lookup_key(key, scope=scope) is None
    assert client.enqueue_with_result("l.job", 2, idempotency_key=key, scope=scope).outcome == "accepted"
    assert client.release_key(uniq("unknown")) is False


def test_queues_pause_resume(client: idemq.Client, uniq: Callable[[str], str]) -> None:
    q = uniq("pq")
    jid = client.enqueue("p.job", None, queue=q)
    assert client.pause(q) is True
    assert client.claim(queues=[q], worker="py-test") == []
    info = {x.name: x for x in client.queues()}[q]
    assert info.paused is True and info.counts["ready"] == 1
    assert client.resume(q) is False
    [c] = client.claim(queues=[q], worker="py-test")
    assert c.id == jid


def test_schedules(client: idemq.Client, uniq: Callable[[str], str]) -> None:
    name = uniq("nightly")
    s = client.put_schedule(name, idemq.EnqueueRequest("report.build", {"r": 1}, queue=uniq("sq")), cron="0 0 3 * * *", timezone="Europe/Paris")
    assert (s.name, s.cron, s.timezone) == (name, "0 0 3 * * *", "Europe/Paris")
    assert s.next_fire_at is not None
    every = client.put_schedule(uniq("every"), {"type": "tick"}, every_ms=3_600_000, paused=True)
    assert every.every_ms == 3_600_000 and every.paused is True
    names = {x.name for x in client.schedules()}
    assert {name, every.name} <= names
    assert client.delete_schedule(name) is True
    assert client.delete_schedule(name) is False
    with pytest.raises(idemq.ValidationError):
        client.put_schedule(uniq("bad"), {"type": "x"}, cron="not a cron")
    with pytest.raises(ValueError):
        client.put_schedule(uniq("both"), {"type": "x"}, cron="0 * * * * *", every_ms=1000)


def test_health(client: idemq.Client) -> None:
    h = client.health()
    assert h.ok is True and h.backend in ("sqlite", "postgres")
    assert h.durability == "full"  # relaxed only on Redis ?durability=relaxed


def test_health_reads_durability_and_an_older_server_says_none() -> None:
    bodies = [
        {"ok": True, "backend": "redis", "durability": "relaxed", "newer": 1},
        {"ok": True, "backend": "sqlite"},
    ]

    def handler(request: httpx.Request) -> httpx.Response:
        assert (request.method, request.url.path) == ("GET", "/healthz")
        return httpx.Response(200, json=bodies.pop(0))

    with idemq.Client("http://127.0.0.1:9", transport=httpx.MockTransport(handler), retries=0) as c:
        relaxed = c.health()
        assert (relaxed.ok, relaxed.backend, relaxed.durability) == (True, "redis", "relaxed")
        older = c.health()  # a server from before `durability`: too old to say, not "full"
        assert (older.ok, older.backend, older.durability) == (True, "sqlite", None)
    assert idemq.Health.from_wire({"ok": True, "backend": "postgres", "durability": "full"}).durability == "full"


def test_async_client_covers_the_same_calls(server: Server, uniq: Callable[[str], str]) -> None:
    q = uniq("aq")
    key = uniq("k")

    async def main() -> None:
        async with idemq.AsyncClient(server.url) as c:
            assert (await c.health()).ok
            jid = await c.enqueue("a.job", {"n": 1}, queue=q, idempotency_key=key)
            with pytest.raises(idemq.EnqueueIdempotencyConflictError) as info:
                await c.enqueue("a.job", {"n": 2}, queue=q, idempotency_key=key)
            assert info.value.job_id == jid
            results = await c.enqueue_many([idemq.EnqueueRequest("a.job", 3, queue=q), idemq.EnqueueRequest("", queue=q)])
            assert isinstance(results[0], idemq.EnqueueResult) and isinstance(results[1], idemq.ValidationError)
            assert (await c.explain("a.job", {"n": 1}, queue=q, idempotency_key=key)).outcome == "replayed"
            [claimed] = await c.claim(queues=[q], worker="aio", limit=1)
            assert await c.put_checkpoint(claimed.id, "s", claimed.lease_token, 1) is True
            assert await c.checkpoints(claimed.id) == {"s": 1}
            assert await c.complete(claimed.id, claimed.lease_token, "r") == "completed"
            assert (await c.get_job(claimed.id)).result == "r"
            assert len((await c.list_jobs(queue=q)).jobs) == 2
            assert (await c.lookup_key(key)) is not None
            assert await c.pause(q) is True and await c.resume(q) is False

    asyncio.run(main())


def test_job_ids_of_dots_are_reachable(client: idemq.Client, uniq: Callable[[str], str]) -> None:
    # "." and ".." are valid job ids; a URL would drop them as dot segments.
    q = uniq("dots")
    for jid in (".", ".."):
        assert client.enqueue("dots.job", {"id": jid}, queue=q, job_id=jid) == jid
        job = client.get_job(jid)
        assert (job.id, job.queue) == (jid, q)
        assert [e.kind for e in client.events(jid)][0] == "accepted"
        assert client.cancel(jid)["state"] == "cancelled"
