import assert from "node:assert/strict";
import { type IncomingMessage, type ServerResponse, createServer } from "node:http";
import { test } from "node:test";
import { inspect } from "node:util";
import {
  ApiError,
  BadRequestError,
  Client,
  ConnectionError,
  EnqueueIdempotencyConflictError,
  ForbiddenHostError,
  IdemqError,
  InternalError,
  LeaseLostError,
  MethodNotAllowedError,
  NotFoundError,
  PayloadTooLargeError,
  TimeoutError,
  UnauthorizedError,
  UnavailableError,
  ValidationError,
} from "idemq";
import { freePort, sleep, startServer, uid } from "./server.js";

/** A fetch that counts the requests it sends. */
function counting() {
  const calls: string[] = [];
  const f: typeof fetch = (input, init) => {
    calls.push(`${init?.method ?? "GET"} ${new URL(String(input)).pathname}`);
    return fetch(input, init);
  };
  return { calls, fetch: f };
}

/** A local HTTP server whose answers the test scripts. */
async function stub(handler: (req: IncomingMessage, res: ServerResponse, n: number) => void) {
  let n = 0;
  const srv = createServer((req, res) => {
    req.resume();
    req.on("end", () => handler(req, res, ++n));
  });
  await new Promise<void>((r) => srv.listen(0, "127.0.0.1", r));
  const addr = srv.address();
  const port = typeof addr === "object" && addr ? addr.port : 0;
  return {
    url: `http://127.0.0.1:${port}`,
    count: () => n,
    close: () =>
      new Promise<void>((r) => {
        srv.closeAllConnections();
        srv.close(() => r());
      }),
  };
}

function problem(res: ServerResponse, status: number, name: string, extra: Record<string, unknown> = {}, headers = {}) {
  res.writeHead(status, { "content-type": "application/problem+json", ...headers });
  res.end(JSON.stringify({ type: `/problems/${name}`, title: name, status, detail: `${name} happened`, ...extra }));
}

const fastRetry = { maxAttempts: 3, initialDelayMs: 10, maxDelayMs: 20 };

test("an unreachable server is a ConnectionError that holds no key", async () => {
  const port = await freePort();
  const key = `unreachable-secret-${uid()}`;
  const client = new Client({ baseUrl: `http://127.0.0.1:${port}`, retry: false });
  const err = await client.enqueue("t", null, { idempotency: { key } }).catch((e: unknown) => e);
  assert.ok(err instanceof ConnectionError, String(err));
  assert.ok(err instanceof IdemqError);
  assert.equal(err.method, "POST");
  assert.equal(err.path, "/v1/jobs");
  for (const view of [String(err), inspect(err, { depth: 10 }), JSON.stringify(err), err.stack ?? ""]) {
    assert.ok(!view.includes(key));
  }
});

test("no answer within the timeout is a TimeoutError", async () => {
  const silent = await stub(() => {
    /* never answers */
  });
  try {
    const client = new Client({ baseUrl: silent.url, timeoutMs: 200, retry: false });
    const began = Date.now();
    const err = await client.health().catch((e: unknown) => e);
    assert.ok(err instanceof TimeoutError, String(err));
    assert.ok(err instanceof ConnectionError);
    assert.equal(err.timeoutMs, 200);
    assert.ok(Date.now() - began < 2_000);
  } finally {
    await silent.close();
  }
});

test("a keyed enqueue is retried across a server that comes up late", async () => {
  const port = await freePort();
  const { calls, fetch } = counting();
  const client = new Client({
    baseUrl: `http://127.0.0.1:${port}`,
    fetch,
    retry: { maxAttempts: 60, initialDelayMs: 50, maxDelayMs: 300 },
  });
  const key = `late:${uid()}`;
  const pending = client.enqueueWithResult("t.late", { n: 1 }, { idempotency: { key } });
  await sleep(700);
  const server = await startServer({ port });
  try {
    const result = await pending;
    assert.equal(result.outcome, "accepted");
    assert.ok(calls.length > 1, `sent ${calls.length} time(s)`);
    const again = await client.enqueueWithResult("t.late", { n: 1 }, { idempotency: { key } });
    assert.equal(again.outcome, "replayed");
    assert.equal(again.jobId, result.jobId);
  } finally {
    await server.stop();
  }
});

test("an enqueue without a key or job id is never retried; with a job id it is", async () => {
  const port = await freePort();
  const unkeyed = counting();
  const client = new Client({ baseUrl: `http://127.0.0.1:${port}`, fetch: unkeyed.fetch, retry: fastRetry });
  const err = await client.enqueue("t.unkeyed", { n: 1 }).catch((e: unknown) => e);
  assert.ok(err instanceof ConnectionError);
  assert.equal(unkeyed.calls.length, 1);

  const withId = counting();
  const c2 = new Client({ baseUrl: `http://127.0.0.1:${port}`, fetch: withId.fetch, retry: fastRetry });
  assert.ok((await c2.enqueue("t.id", null, { jobId: `job-${uid()}` }).catch((e: unknown) => e)) instanceof ConnectionError);
  assert.equal(withId.calls.length, 3);
});

test("a batch is retried only when every item carries a key or a job id", async () => {
  const port = await freePort();
  const keyed = counting();
  const c1 = new Client({ baseUrl: `http://127.0.0.1:${port}`, fetch: keyed.fetch, retry: fastRetry });
  await c1
    .enqueueMany([
      { type: "a", idempotency: { key: `k1-${uid()}` } },
      { type: "b", jobId: `j-${uid()}` },
    ])
    .catch(() => {});
  assert.equal(keyed.calls.length, 3);
  const mixed = counting();
  const c2 = new Client({ baseUrl: `http://127.0.0.1:${port}`, fetch: mixed.fetch, retry: fastRetry });
  await c2.enqueueMany([{ type: "a", idempotency: { key: `k2-${uid()}` } }, { type: "b" }]).catch(() => {});
  assert.equal(mixed.calls.length, 1);
});

test("a null jobId or idempotency counts as absent: such an enqueue is never retried", async () => {
  const port = await freePort();
  const base = `http://127.0.0.1:${port}`;
  const cases: Array<[string, (c: Client) => Promise<unknown>]> = [
    ["jobId: null", (c) => c.enqueue("t", { n: 1 }, { jobId: null } as any)],
    ["idempotency: null", (c) => c.enqueue("t", { n: 1 }, { idempotency: null } as any)],
    ["both null", (c) => c.enqueueWithResult("t", { n: 1 }, { jobId: null, idempotency: null } as any)],
    ["a batch item with jobId: null", (c) => c.enqueueMany([{ type: "a", jobId: null } as any])],
    [
      "a batch whose second item has jobId: null",
      (c) => c.enqueueMany([{ type: "a", idempotency: { key: `k-${uid()}` } }, { type: "b", jobId: null, idempotency: null } as any]),
    ],
    ["a redrive with idempotencyKey: null", (c) => c.redrive("j", { idempotencyKey: null } as any)],
  ];
  for (const [what, call] of cases) {
    const { calls, fetch } = counting();
    const client = new Client({ baseUrl: base, fetch, retry: fastRetry });
    const err = await call(client).catch((e: unknown) => e);
    assert.ok(err instanceof ConnectionError, `${what}: ${String(err)}`);
    assert.equal(calls.length, 1, `${what} was sent ${calls.length} times`);
  }
});

test("a null option is sent as no option: no Idempotency-Key header, no dedupe", async () => {
  const seen: Array<{ headers: Record<string, string>; body: Record<string, unknown> }> = [];
  const f: typeof fetch = async (_input, init) => {
    seen.push({ headers: (init?.headers ?? {}) as Record<string, string>, body: JSON.parse(String(init?.body ?? "{}")) });
    return new Response(JSON.stringify({ job_id: "j-1", outcome: "accepted" }), {
      status: 201,
      headers: { "content-type": "application/json" },
    });
  };
  const client = new Client({ baseUrl: "http://127.0.0.1:1", fetch: f });
  assert.equal(await client.enqueue("t", null, { idempotency: null, dedupe: null } as any), "j-1");
  await client.redrive("j", { idempotencyKey: null } as any);
  for (const { headers, body } of seen) {
    assert.ok(!Object.keys(headers).some((h) => h.toLowerCase() === "idempotency-key"), JSON.stringify(headers));
    assert.ok(body["idempotency"] == null && body["dedupe"] == null, JSON.stringify(body));
  }
});

test("worker calls are always retried on connection errors", async () => {
  const port = await freePort();
  const { calls, fetch } = counting();
  const client = new Client({ baseUrl: `http://127.0.0.1:${port}`, fetch, retry: fastRetry });
  await client.heartbeat("j", "t").catch(() => {});
  await client.complete("j", "t").catch(() => {});
  await client.claim({ worker: "w" }).catch(() => {});
  assert.equal(calls.length, 9);
});

test("a 503 is retried after its Retry-After for a keyed enqueue, and raised for an unkeyed one", async () => {
  const s = await stub((_req, res, n) => {
    if (n % 2 === 1) return problem(res, 503, "unavailable", {}, { "retry-after": "1" });
    res.writeHead(201, { "content-type": "application/json" });
    res.end(JSON.stringify({ job_id: "j-1", outcome: "accepted" }));
  });
  try {
    const client = new Client({ baseUrl: s.url, retry: fastRetry });
    const began = Date.now();
    const id = await client.enqueue("t", null, { idempotency: { key: "k" } });
    assert.equal(id, "j-1");
    assert.ok(Date.now() - began >= 1_000, "Retry-After was not honoured");
    assert.equal(s.count(), 2);
    const err = await client.enqueue("t", null).catch((e: unknown) => e);
    assert.ok(err instanceof UnavailableError, String(err));
    assert.equal(err.retryAfterMs, 1_000);
    assert.equal(s.count(), 3);
  } finally {
    await s.close();
  }
});

test("400, 401, 403, 404, 409, 413 and 422 are never retried", async () => {
  for (const [status, name] of [
    [400, "bad-request"],
    [401, "unauthorized"],
    [403, "forbidden-host"],
    [404, "not-found"],
    [409, "lease-lost"],
    [413, "payload-too-large"],
    [422, "validation"],
  ] as const) {
    const s = await stub((_req, res) => problem(res, status, name));
    try {
      const client = new Client({ baseUrl: s.url, retry: fastRetry });
      const err1 = await client.enqueue("t", null, { idempotency: { key: "k" } }).catch((e: unknown) => e);
      const err2 = await client.heartbeat("j", "tok").catch((e: unknown) => e);
      assert.ok(err1 instanceof IdemqError && err2 instanceof IdemqError);
      assert.equal(s.count(), 2, `${status} was retried`);
    } finally {
      await s.close();
    }
  }
});

test("errors say whether the same call may succeed when repeated", async () => {
  const port = await freePort();
  const refused = await new Client({ baseUrl: `http://127.0.0.1:${port}`, retry: false }).health().catch((e: unknown) => e);
  assert.ok(refused instanceof ConnectionError, String(refused));
  assert.equal(refused.retryable, true);

  const silent = await stub(() => {
    /* never answers */
  });
  try {
    const err = await new Client({ baseUrl: silent.url, timeoutMs: 100, retry: false }).health().catch((e: unknown) => e);
    assert.ok(err instanceof TimeoutError, String(err));
    assert.equal(err.retryable, true);
  } finally {
    await silent.close();
  }

  for (const [status, name, cls, retryable] of [
    [503, "unavailable", UnavailableError, true],
    [400, "bad-request", BadRequestError, false],
    [404, "not-found", NotFoundError, false],
    [409, "lease-lost", LeaseLostError, false],
    [409, "idempotency-conflict", EnqueueIdempotencyConflictError, false],
    [422, "validation", ValidationError, false],
    [500, "internal", InternalError, false],
  ] as const) {
    const s = await stub((_req, res) => problem(res, status, name));
    try {
      const err = await new Client({ baseUrl: s.url, retry: false }).getJob("j").catch((e: unknown) => e);
      assert.ok(err instanceof cls, `${status} ${name}: ${String(err)}`);
      assert.equal((err as IdemqError).retryable, retryable, `${status} ${name}`);
      assert.equal(JSON.parse(JSON.stringify(err)).retryable, retryable, `${status} ${name} in JSON`);
    } finally {
      await s.close();
    }
  }
  assert.equal(new IdemqError("plain").retryable, false);
});

test("a 503 with a problem type the client does not know is an UnavailableError, and retried", async () => {
  const s = await stub((_req, res, n) => {
    if (n % 2 === 1) return problem(res, 503, "overloaded", {}, { "retry-after": "1" });
    res.writeHead(201, { "content-type": "application/json" });
    res.end(JSON.stringify({ job_id: "j-1", outcome: "accepted" }));
  });
  try {
    const client = new Client({ baseUrl: s.url, retry: fastRetry });
    const began = Date.now();
    assert.equal(await client.enqueue("t", null, { idempotency: { key: "k" } }), "j-1");
    assert.ok(Date.now() - began >= 1_000, "Retry-After was not honoured");
    assert.equal(s.count(), 2);
    const err = await client.enqueue("t", null).catch((e: unknown) => e);
    assert.ok(err instanceof UnavailableError, String(err));
    assert.equal(err.retryable, true);
    assert.equal(err.retryAfterMs, 1_000);
    assert.equal(err.status, 503);
    assert.equal(err.problemType, "overloaded");
    assert.equal(err.problem.type, "/problems/overloaded");
    assert.equal(s.count(), 3);
  } finally {
    await s.close();
  }
});

test("a problem type the client does not know falls back on the HTTP status, and keeps its type", async () => {
  for (const [status, cls] of [
    [400, BadRequestError],
    [401, UnauthorizedError],
    [403, ForbiddenHostError],
    [404, NotFoundError],
    [405, MethodNotAllowedError],
    [413, PayloadTooLargeError],
    [422, ValidationError],
    [500, InternalError],
    [503, UnavailableError],
    [409, ApiError],
    [418, ApiError],
  ] as const) {
    const s = await stub((_req, res) => problem(res, status, "novel", { field: "payload", reason: "too novel" }));
    try {
      const err = await new Client({ baseUrl: s.url, retry: false }).getJob("j").catch((e: unknown) => e);
      assert.ok(err instanceof cls, `${status}: ${String(err)}`);
      if (cls === ApiError) {
        // 409 is one of three distinct errors: no guess. Nor is any other status mapped.
        assert.equal(Object.getPrototypeOf(err), ApiError.prototype, `${status}: ${(err as Error).name}`);
      }
      assert.equal(err.status, status);
      assert.equal(err.problemType, "novel");
      assert.equal(err.problem.type, "/problems/novel");
      assert.equal(err.retryable, status === 503);
      if (err instanceof ValidationError) {
        assert.equal(err.field, "payload");
        assert.equal(err.reason, "too novel");
      }
    } finally {
      await s.close();
    }
  }
});

test("a key echoed by a server is blanked from the error", async () => {
  const key = `echoed-secret-${uid()}`;
  const s = await stub((_req, res, n) =>
    n === 1
      ? problem(res, 422, "validation", { field: "idempotency.key", reason: `bad key ${key}`, detail: `key ${key} refused` })
      : problem(res, 409, "idempotency-conflict", { job_id: "j", fields: ["payload"], key_preview: key, source: "idempotency_key" }),
  );
  try {
    const client = new Client({ baseUrl: s.url });
    const v = await client.enqueue("t", null, { idempotency: { key } }).catch((e: unknown) => e);
    assert.ok(v instanceof ValidationError);
    const c = await client.enqueue("t", null, { idempotency: { key, sendAs: "header" } }).catch((e: unknown) => e);
    assert.ok(c instanceof EnqueueIdempotencyConflictError);
    for (const err of [v, c]) {
      for (const view of [String(err), inspect(err, { depth: 10, showHidden: true }), JSON.stringify(err), (err as Error).stack ?? ""]) {
        assert.ok(!view.includes(key), view);
      }
    }
  } finally {
    await s.close();
  }
});

test("the client does not show its token", () => {
  const client = new Client({ baseUrl: "http://127.0.0.1:1", token: "tok-very-secret" });
  assert.ok(!inspect(client, { depth: 10, showHidden: true }).includes("tok-very-secret"));
  assert.ok(!JSON.stringify(client).includes("tok-very-secret"));
});

test("an aborted call rejects with the signal's reason and is not retried", async () => {
  const s = await stub(() => {
    /* never answers */
  });
  try {
    const client = new Client({ baseUrl: s.url, retry: fastRetry });
    const controller = new AbortController();
    setTimeout(() => controller.abort(new Error("caller gave up")), 100);
    const err = await client.getJob("j", { signal: controller.signal }).catch((e: unknown) => e);
    assert.equal((err as Error).message, "caller gave up");
    assert.equal(s.count(), 1);
  } finally {
    await s.close();
  }
});
