from __future__ import annotations

from typing import Callable

import pytest

import idemq
from conftest import Server


def test_token_is_required_and_typed(make_server: Callable[..., Server], uniq: Callable[[str], str]) -> None:
    token = "tok-" + uniq("secret")
    srv = make_server(token=token)
    with idemq.Client(srv.url) as anon:
        assert anon.health().ok  # /healthz needs no token
        with pytest.raises(idemq.UnauthorizedError) as info:
            anon.enqueue("a.job", 1)
        assert info.value.status == 401
        assert info.value.type == "/problems/unauthorized"
    with idemq.Client(srv.url, token="wrong") as wrong:
        with pytest.raises(idemq.UnauthorizedError):
            wrong.queues()
    with idemq.Client(srv.url, token=token) as c:
        assert token not in repr(c)
        jid = c.enqueue("a.job", 1, idempotency_key=uniq("k"))
        assert c.get_job(jid).state == "ready"


def test_foreign_host_header_is_forbidden(server: Server) -> None:
    # Still sent to 127.0.0.1: only the Host header names another site.
    with idemq.Client(server.url, headers={"Host": "rebound.example"}) as c:
        with pytest.raises(idemq.ForbiddenHostError) as info:
            c.queues()
        assert info.value.status == 403
        assert info.value.type == "/problems/forbidden-host"


def test_unserved_method_is_a_typed_problem(client: idemq.Client) -> None:
    op: idemq.Op[object] = idemq.Op("DELETE", "/v1/jobs", lambda s, b: b)
    with pytest.raises(idemq.MethodNotAllowedError) as info:
        client.call(op)
    assert info.value.status == 405
    assert "POST" in info.value.allow
    assert info.value.type == "/problems/method-not-allowed"


def test_batch_completion_endpoint(client: idemq.Client, uniq: Callable[[str], str]) -> None:
    q = uniq("many")
    ids = [client.enqueue("m.job", i, queue=q) for i in range(3)]
    claimed = client.claim(queues=[q], worker="py-test", limit=3)
    assert sorted(c.id for c in claimed) == sorted(ids)
    items = [idemq.CompleteItem(c.id, c.lease_token, {"r": c.payload}) for c in claimed]
    items.append(idemq.CompleteItem(claimed[0].id, "stale-token"))
    answers = client.complete_many(items)
    assert answers[:3] == ["completed"] * 3
    assert isinstance(answers[3], idemq.LeaseLostError)
    for c in claimed:
        assert client.get_job(c.id).result == {"r": c.payload}
