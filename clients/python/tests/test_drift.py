"""Drift check: every path and method the client calls, every request member
and query parameter it sends, and every problem type it maps, against the
committed OpenAPI document of the server (read from the repository)."""

from __future__ import annotations

import asyncio
import datetime as dt
import inspect
import json
import re
from typing import Any, Callable, Dict, List, Tuple

import httpx
import pytest

import idemq
from conftest import OPENAPI

SOON = dt.datetime(2030, 1, 1, tzinfo=dt.timezone.utc)

# One call of every public method, with every option it has.
CALLS: Dict[str, Callable[[idemq.Client], Any]] = {
    "enqueue": lambda c: c.enqueue(
        "t",
        {"p": 1},
        queue="q",
        job_id="j",
        priority=1,
        run_at=SOON,
        max_attempts=3,
        retry=idemq.ExponentialRetry(initial_ms=1, factor=2.0, max_ms=9, jitter=True),
        timeout_ms=5,
        deadline=SOON,
        concurrency_key="ck",
        tags=["a"],
        keep_ms=1,
        idempotency_key="k",
        scope="s",
        ttl_ms=1000,
        dedupe=idemq.Dedupe("d", ttl_ms=1, extend=True, replace=False, max_wait_ms=2),
    ),
    "enqueue_with_result": lambda c: c.enqueue_with_result(
        "t", None, delay_ms=5, retry=idemq.FixedRetry(delay_ms=3), dedupe="d", idempotency_key="k",
        scope="s", ttl_ms=1000, key_in_header=True,
    ),
    "enqueue_request": lambda c: c.enqueue_request(idemq.EnqueueRequest("t", retry=idemq.NoRetry())),
    "enqueue_many": lambda c: c.enqueue_many(
        [idemq.EnqueueRequest("t", 1, idempotency_key="k", dedupe={"key": "d", "replace": True})], atomic=True
    ),
    "explain": lambda c: c.explain("t", 1, queue="q", idempotency_key="k"),
    "get_job": lambda c: c.get_job("j", wait_ms=10),
    "list_jobs": lambda c: c.list_jobs(state="ready", queue="q", type="t", tag="g", limit=5, cursor="x"),
    "events": lambda c: c.events("j"),
    "runs": lambda c: c.runs("j"),
    "checkpoints": lambda c: c.checkpoints("j"),
    "cancel": lambda c: c.cancel("j"),
    "cancel_by_key": lambda c: c.cancel_by_key("t", "d"),
    "purge": lambda c: c.purge("j"),
    "promote": lambda c: c.promote("j"),
    "redrive": lambda c: c.redrive("j", idempotency_key="k", max_attempts=2, deadline=SOON, run_at=SOON, reset_checkpoints=True),
    "bulk": lambda c: c.bulk("cancel", filter={"state": "dead", "queue": "q", "type": "t", "tag": "g", "before": SOON}, limit=3),
    "lookup_key": lambda c: c.lookup_key("k", scope="s"),
    "release_key": lambda c: c.release_key("k", scope="s"),
    "lookup_dedupe": lambda c: c.lookup_dedupe("t", "d"),
    "queues": lambda c: c.queues(),
    "pause": lambda c: c.pause("q"),
    "resume": lambda c: c.resume("q"),
    "schedules": lambda c: c.schedules(),
    "put_schedule": lambda c: c.put_schedule("n", idemq.EnqueueRequest("t", queue="q"), cron="0 * * * * *", timezone="UTC", paused=False),
    "delete_schedule": lambda c: c.delete_schedule("n"),
    "health": lambda c: c.health(),
    "claim": lambda c: c.claim(
        queues=["q"], worker="w", limit=2, lease_ms=1000, types=["t"], wait_ms=5,
        complete=[idemq.CompleteItem("j", "tok", {"r": 1}), idemq.CompleteItem("k", "tok")],
    ),
    "heartbeat": lambda c: c.heartbeat("j", "tok"),
    "complete": lambda c: c.complete("j", "tok", {"r": 1}),
    "complete_many": lambda c: c.complete_many([idemq.CompleteItem("j", "tok", 1)]),
    "fail": lambda c: c.fail("j", "tok", "e", retryable=False, retry_after_ms=1, snooze_ms=2),
    "release": lambda c: c.release("j", "tok"),
    "put_checkpoint": lambda c: c.put_checkpoint("j", "n", "tok", {"v": 1}),
}

ANSWER = {
    "job_id": "j", "outcome": "accepted", "id": "j", "type": "t", "queue": "q", "state": "ready",
    "name": "n", "job": {"type": "t"}, "ok": True, "jobs": [], "results": [], "events": [], "runs": [],
    "checkpoints": {}, "queues": [], "schedules": [], "mode": "pending", "key_preview": "k…",
    "key_digest": "0" * 16, "cancel_requested": False, "lease_expires_at": None,
}


def _recorded() -> List[httpx.Request]:
    seen: List[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=ANSWER)

    with idemq.Client("http://127.0.0.1:9", transport=httpx.MockTransport(handler), retries=0) as c:
        for call in CALLS.values():
            call(c)
    return seen


def _public(cls: type) -> set[str]:
    return {n for n, v in vars(cls).items() if callable(v) and not n.startswith("_")} - {"close", "aclose", "call"}


@pytest.fixture(scope="module")
def doc() -> Dict[str, Any]:
    return json.loads(OPENAPI.read_text())


def _ref(doc: Dict[str, Any], schema: Dict[str, Any]) -> Dict[str, Any]:
    while "$ref" in schema:
        node: Any = doc
        for part in schema["$ref"].lstrip("#/").split("/"):
            node = node[part]
        schema = node
    return schema


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


def _unknown(doc: Dict[str, Any], value: Any, schema: Dict[str, Any], where: str) -> List[str]:
    """Members of `value` the schema does not declare (dotted paths); [] when it fits."""
    schema = _ref(doc, schema)
    for key in ("oneOf", "anyOf"):
        if key in schema:
            tries = [_unknown(doc, value, s, where) for s in schema[key]]
            if any(not t for t in tries):
                return []
            # Report against the branch of the value's own JSON type, if there is one.
            typed = [t for t in tries if not any(" (a " in p for p in t)]
            return min(typed or tries, key=len)
    declared = schema.get("type")
    if declared is not None:
        allowed = declared if isinstance(declared, list) else [declared]
        t = _json_type(value)
        if t not in allowed and not (t == "integer" and "number" in allowed):
            return [f"{where} (a {t}, not {allowed})"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"{where} (= {value!r})"]
    out: List[str] = []
    if isinstance(value, dict) and "properties" in schema:
        props = schema["properties"]
        for k, v in value.items():
            if k not in props:
                out.append(f"{where}.{k}")
            else:
                out += _unknown(doc, v, props[k], f"{where}.{k}")
    if isinstance(value, list) and "items" in schema:
        for i, v in enumerate(value):
            out += _unknown(doc, v, schema["items"], f"{where}[{i}]")
    return out


def _operation(doc: Dict[str, Any], method: str, path: str) -> Tuple[str, Dict[str, Any]]:
    for template, ops in doc["paths"].items():
        pattern = "^" + re.sub(r"\{[^}]+\}", "[^/]+", template) + "$"
        if re.match(pattern, path) and method.lower() in ops:
            # A literal path wins over a template (`/v1/jobs/batch` over `/v1/jobs/{id}`).
            literal = [t for t in doc["paths"] if t == path and method.lower() in doc["paths"][t]]
            if literal:
                return literal[0], doc["paths"][literal[0]][method.lower()]
            return template, ops[method.lower()]
    raise KeyError(f"{method} {path}")


def test_every_public_method_is_covered() -> None:
    assert _public(idemq.Client) == set(CALLS)
    # The async client has the same methods, all coroutines.
    assert _public(idemq.AsyncClient) == set(CALLS)
    for name in CALLS:
        assert inspect.iscoroutinefunction(getattr(idemq.AsyncClient, name)), name


def test_paths_and_methods_exist(doc: Dict[str, Any]) -> None:
    missing = []
    for r in _recorded():
        try:
            _operation(doc, r.method, r.url.path)
        except KeyError:
            missing.append(f"{r.method} {r.url.path}")
    assert missing == [], f"calls the OpenAPI document does not have: {missing}"


def test_request_members_query_and_headers_are_documented(doc: Dict[str, Any]) -> None:
    problems: List[str] = []
    for r in _recorded():
        try:
            template, op = _operation(doc, r.method, r.url.path)
        except KeyError:
            continue  # reported by test_paths_and_methods_exist
        label = f"{r.method} {template}"
        params = op.get("parameters") or []
        query = {p["name"] for p in params if p.get("in") == "query"}
        header = {p["name"].lower() for p in params if p.get("in") == "header"}
        for name in r.url.params:
            if name not in query:
                problems.append(f"{label}: query {name}")
        if "idempotency-key" in r.headers and "idempotency-key" not in header:
            problems.append(f"{label}: header Idempotency-Key")
        if r.content:
            body = json.loads(r.content)
            schema = (((op.get("requestBody") or {}).get("content") or {}).get("application/json") or {}).get("schema")
            if schema is None:
                problems.append(f"{label}: a body the document does not take")
                continue
            problems += [f"{label}: {p}" for p in _unknown(doc, body, schema, "body")]
    assert problems == [], problems


def _documented_problem_types(doc: Dict[str, Any]) -> set[str]:
    problem = doc["components"]["schemas"]["Problem"]
    type_schema = problem["properties"]["type"]
    names: set[str] = set()
    for value in type_schema.get("enum") or []:
        names.add(str(value).rsplit("/", 1)[-1])
    description = type_schema.get("description", "")
    if ":" in description:
        listed = description.split(":", 1)[1]
        names |= {n.strip(" .\n`") for n in listed.split(",") if n.strip(" .\n`")}
    names |= set(re.findall(r"/problems/([a-z]+(?:-[a-z]+)*)", json.dumps(doc)))
    return names


def test_problem_types_match(doc: Dict[str, Any]) -> None:
    documented = _documented_problem_types(doc)
    assert documented, "no problem types found in the document"
    mapped = set(idemq.PROBLEM_TYPES)
    assert sorted(documented - mapped) == [], "documented problem types the client does not map"
    assert sorted(mapped - documented) == [], "problem types the client maps that the document does not list"


def test_async_client_sends_the_same_requests() -> None:
    sync = [(r.method, r.url.path, r.url.query, r.content) for r in _recorded()]
    seen: List[httpx.Request] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        await request.aread()
        seen.append(request)
        return httpx.Response(200, json=ANSWER)

    async def main() -> None:
        async with idemq.AsyncClient("http://127.0.0.1:9", transport=httpx.MockTransport(handler), retries=0) as c:
            for call in CALLS.values():
                await call(c)  # type: ignore[arg-type]

    asyncio.run(main())
    assert [(r.method, r.url.path, r.url.query, r.content) for r in seen] == sync


def test_the_check_sees_unknown_members(doc: Dict[str, Any]) -> None:
    _, op = _operation(doc, "POST", "/v1/jobs")
    schema = op["requestBody"]["content"]["application/json"]["schema"]
    body = {"type": "t", "dedupe": {"key": "k", "mode": "x"}, "retry": {"kind": "fixed", "delay_ms": 1, "jitter": True}}
    assert _unknown(doc, body, schema, "body") != []
    assert _unknown(doc, {"type": "t", "dedupe": {"key": "k"}}, schema, "body") == []
    assert sorted(_unknown(doc, {"type": "t", "dedupe": {"key": "k", "mode": "x"}}, schema, "body")) == ["body.dedupe.mode"]
