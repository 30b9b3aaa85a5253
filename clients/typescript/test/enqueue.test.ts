import assert from "node:assert/strict";
import { after, before, test } from "node:test";
import { inspect } from "node:util";
import {
  ApiError,
  Client,
  EnqueueIdempotencyConflictError,
  IdemqError,
  PayloadTooLargeError,
  ValidationError,
  type EnqueueResult,
} from "idemq";
import { type RunningServer, startServer, uid } from "./server.js";

let server: RunningServer;
let client: Client;

before(async () => {
  server = await startServer();
  client = new Client({ baseUrl: server.url });
});
after(async () => {
  await server?.stop();
});

/** Every way an error can be shown; none may contain `secret`. */
function assertNoSecret(err: unknown, secret: string) {
  const views = [
    String(err),
    (err as Error).message,
    (err as Error).stack ?? "",
    inspect(err, { depth: 20, showHidden: true }),
    JSON.stringify(err),
  ];
  for (const v of views) assert.ok(!v.includes(secret), `the raw key leaked into: ${v}`);
}

test("a repeated idempotent enqueue is replayed with the same id", async () => {
  const key = `capture:${uid()}`;
  const opts = { queue: `billing-${uid()}`, idempotency: { key } };
  const first = await client.enqueueWithResult("invoice.capture", { invoice_id: "inv_42" }, opts);
  const again = await client.enqueueWithResult("invoice.capture", { invoice_id: "inv_42" }, opts);
  assert.equal(first.outcome, "accepted");
  assert.equal(again.outcome, "replayed");
  assert.equal(again.jobId, first.jobId);
  const id = await client.enqueue("invoice.capture", { invoice_id: "inv_42" }, opts);
  assert.equal(id, first.jobId);
});

test("the key sent as the Idempotency-Key header is the same key as in the body", async () => {
  const key = `hdr:"quoted"\\${uid()}`;
  const viaHeader = await client.enqueueWithResult("t.header", { n: 1 }, { idempotency: { key, sendAs: "header" } });
  const viaBody = await client.enqueueWithResult("t.header", { n: 1 }, { idempotency: { key } });
  assert.equal(viaHeader.outcome, "accepted");
  assert.equal(viaBody.outcome, "replayed");
  assert.equal(viaBody.jobId, viaHeader.jobId);
});

test("a conflict raises EnqueueIdempotencyConflictError naming payload and the job, without the raw key", async () => {
  const key = `very-secret-key-${uid()}`;
  const jobId = await client.enqueue("invoice.capture", { invoice_id: "inv_42" }, { idempotency: { key, scope: "capture" } });
  const err = await client
    .enqueue("invoice.capture", { invoice_id: "inv_43" }, { idempotency: { key, scope: "capture" } })
    .then(
      () => assert.fail("a changed request must not be accepted"),
      (e: unknown) => e,
    );
  assert.ok(err instanceof EnqueueIdempotencyConflictError);
  assert.ok(err instanceof ApiError);
  assert.ok(err instanceof IdemqError);
  assert.ok(err instanceof Error);
  assert.equal(err.name, "EnqueueIdempotencyConflictError");
  assert.equal(err.status, 409);
  assert.equal(err.problemType, "idempotency-conflict");
  assert.equal(err.jobId, jobId);
  assert.deepEqual(err.fields, ["payload"]);
  assert.equal(err.source, "idempotency_key");
  assert.equal(err.scope, "capture");
  assert.equal(err.keyPreview, `${key.slice(0, 8)}…`);
  assert.match(err.keyDigest ?? "", /^[0-9a-f]{16}$/);
  assertNoSecret(err, key);
  // Nothing was written: the key still returns the first job.
  const job = await client.getJob(jobId);
  assert.deepEqual(job.payload, { invoice_id: "inv_42" });
  const { jobs } = await client.listJobs({ type: "invoice.capture", limit: 1000 });
  assert.equal(jobs.filter((j) => j.idempotency?.keyDigest === err.keyDigest).length, 1);
});

test("a conflict through the header keeps the key out of the error too", async () => {
  const key = `header-secret-${uid()}`;
  await client.enqueue("t.hconflict", 1, { idempotency: { key, sendAs: "header" } });
  const err = await client.enqueue("t.hconflict", 2, { idempotency: { key, sendAs: "header" } }).catch((e: unknown) => e);
  assert.ok(err instanceof EnqueueIdempotencyConflictError);
  assert.deepEqual(err.fields, ["payload"]);
  assertNoSecret(err, key);
});

test("a header key and a different body key are a validation error that does not show either", async () => {
  const a = `left-key-${uid()}`;
  const b = `right-key-${uid()}`;
  const err = await client
    .request("POST", "/v1/jobs", {
      body: { type: "t.mismatch", idempotency: { key: b } },
      headers: { "idempotency-key": `"${a}"` },
      secrets: [a, b],
    })
    .catch((e: unknown) => e);
  assert.ok(err instanceof ValidationError, String(err));
  assertNoSecret(err, a);
  assertNoSecret(err, b);
});

test("an explicit job id repeated with other fields conflicts with source job_id", async () => {
  const jobId = `order-${uid()}`;
  assert.equal((await client.enqueueWithResult("t.explicit", { a: 1 }, { jobId })).outcome, "accepted");
  assert.equal((await client.enqueueWithResult("t.explicit", { a: 1 }, { jobId })).outcome, "replayed");
  const err = await client.enqueue("t.explicit", { a: 2 }, { jobId }).catch((e: unknown) => e);
  assert.ok(err instanceof EnqueueIdempotencyConflictError);
  assert.equal(err.source, "job_id");
  assert.equal(err.jobId, jobId);
  assert.equal(err.scope, null);
  assert.equal(err.keyPreview, null);
  assert.equal(err.keyDigest, null);
  assert.deepEqual(err.fields, ["payload"]);
});

test("20 concurrent identical enqueues: one accepted, 19 replayed, one id", async () => {
  const key = `burst:${uid()}`;
  const results = await Promise.all(
    Array.from({ length: 20 }, () => client.enqueueWithResult("t.burst", { order: 7 }, { idempotency: { key } })),
  );
  const outcomes = results.map((r) => r.outcome).sort();
  assert.equal(outcomes.filter((o) => o === "accepted").length, 1);
  assert.equal(outcomes.filter((o) => o === "replayed").length, 19);
  assert.equal(new Set(results.map((r) => r.jobId)).size, 1);
  const { jobs } = await client.listJobs({ type: "t.burst", limit: 100 });
  assert.equal(jobs.filter((j) => j.id === results[0]!.jobId).length, 1);
});

test("dedupe outcomes: coalesced, replaced, and non_replaceable with its reason", async () => {
  const type = `t.dedupe.${uid()}`;
  const first = await client.enqueueWithResult(type, 1, { dedupe: "acct-1" });
  const second = await client.enqueueWithResult(type, 2, { dedupe: "acct-1" });
  assert.equal(first.outcome, "accepted");
  assert.equal(second.outcome, "coalesced");
  assert.equal(second.jobId, first.jobId);

  const incompatible = await client.enqueueWithResult(type, 3, { dedupe: { key: "acct-1", replace: true } });
  assert.equal(incompatible.outcome, "non_replaceable");
  if (incompatible.outcome === "non_replaceable") {
    assert.equal(incompatible.reason, "incompatible_mode");
  }
  assert.equal(incompatible.jobId, first.jobId);

  const waiting = await client.enqueueWithResult(type, "a", { dedupe: { key: "later", replace: true }, delayMs: 60_000 });
  const replaced = await client.enqueueWithResult(type, "b", { dedupe: { key: "later", replace: true }, delayMs: 60_000 });
  assert.equal(replaced.outcome, "replaced");
  assert.equal(replaced.jobId, waiting.jobId);
  assert.equal((await client.getJob(waiting.jobId)).payload, "b");

  await client.enqueue(type, "x", { dedupe: { key: "due", replace: true } });
  const elapsed: EnqueueResult = await client.enqueueWithResult(type, "y", { dedupe: { key: "due", replace: true } });
  assert.ok(elapsed.outcome === "non_replaceable" && elapsed.reason === "window_elapsed", JSON.stringify(elapsed));
  // The union narrows: `reason` exists only on non_replaceable.
  const describe = (r: EnqueueResult) => (r.outcome === "non_replaceable" ? `${r.outcome}/${r.reason}` : r.outcome);
  assert.equal(describe(elapsed), "non_replaceable/window_elapsed");
  assert.equal(describe(first), "accepted");
  assert.ok(!("reason" in first));
  if (first.outcome === "accepted") {
    // @ts-expect-error -- the build fails if `reason` existed on any outcome but non_replaceable
    assert.equal(first.reason, undefined);
  }
});

test("every option is sent under its wire name and comes back on the job", async () => {
  const key = `opts:${uid()}`;
  const runAt = new Date(Date.now() + 3_600_000);
  const deadline = new Date(Date.now() + 7_200_000);
  const id = await client.enqueue("t.options", { deep: { camelCase: 1 } }, {
    queue: "opts-q",
    priority: 5,
    runAt,
    maxAttempts: 3,
    retry: { kind: "fixed", delayMs: 250 },
    timeoutMs: 5_000,
    deadline,
    concurrencyKey: "ck-1",
    tags: ["b", "a", "a"],
    keepMs: 60_000,
    idempotency: { key, scope: "opts-scope", ttlMs: 3_600_000 },
  });
  const job = await client.getJob(id);
  assert.equal(job.queue, "opts-q");
  assert.equal(job.type, "t.options");
  assert.equal(job.priority, 5);
  assert.equal(job.state, "scheduled");
  assert.equal(job.maxAttempts, 3);
  assert.deepEqual(job.retry, { kind: "fixed", delayMs: 250 });
  assert.equal(job.timeoutMs, 5_000);
  assert.equal(Date.parse(job.deadline!), deadline.getTime());
  assert.equal(Date.parse(job.runAt), runAt.getTime());
  assert.equal(job.concurrencyKey, "ck-1");
  assert.deepEqual(job.tags, ["a", "b"]);
  assert.equal(job.keepMs, 60_000);
  assert.deepEqual(job.payload, { deep: { camelCase: 1 } });
  assert.equal(job.idempotency?.scope, "opts-scope");
  assert.equal(job.idempotency?.keyPreview, `${key.slice(0, 8)}…`);
  assert.ok(!JSON.stringify(job).includes(key));

  const delayed = await client.getJob(
    await client.enqueue("t.options", null, { delayMs: 60_000, retry: { kind: "exponential", initialMs: 10, factor: 3, maxMs: 99, jitter: false } }),
  );
  assert.equal(delayed.state, "scheduled");
  // A job's timeoutMs is the job's; the HTTP timeout of the call is requestTimeoutMs.
  const short = await client.getJob(await client.enqueue("t.options", null, { timeoutMs: 1, requestTimeoutMs: 10_000 }));
  assert.equal(short.timeoutMs, 1);
  assert.deepEqual(delayed.retry, { kind: "exponential", initialMs: 10, factor: 3, maxMs: 99, jitter: false });
});

test("a batch with a bad item answers per item, in order", async () => {
  const key = `batch:${uid()}`;
  const results = await client.enqueueMany([
    { type: "t.batch", payload: 1, idempotency: { key } },
    { type: "not a valid type!", payload: 2 },
    { type: "t.batch", payload: 1, idempotency: { key } },
    { type: "t.batch", payload: 3, idempotency: { key } },
  ]);
  assert.equal(results.length, 4);
  const [a, b, c, d] = results;
  assert.ok(a!.ok && a.result.outcome === "accepted");
  assert.ok(!b!.ok);
  assert.ok(b.error instanceof ValidationError, String(b.error));
  assert.equal(b.error.field, "type");
  assert.ok(c!.ok && c.result.outcome === "replayed" && c.result.jobId === a.result.jobId);
  assert.ok(!d!.ok && d.error instanceof EnqueueIdempotencyConflictError);
  assert.equal(d.error.jobId, a.result.jobId);
  assertNoSecret(d.error, key);
});

test("an atomic batch with a bad item fails whole, names the item, and writes nothing", async () => {
  const key = `atomic:${uid()}`;
  const type = `t.atomic.${uid()}`;
  const err = await client
    .enqueueMany(
      [
        { type, payload: 1, idempotency: { key } },
        { type, payload: 2, maxAttempts: 0 },
      ],
      { atomic: true },
    )
    .catch((e: unknown) => e);
  assert.ok(err instanceof ValidationError, String(err));
  assert.equal(err.index, 1);
  assert.equal(err.field, "max_attempts");
  assert.equal((await client.listJobs({ type })).jobs.length, 0);
  assert.equal(await client.idempotencyLookup(key), null);
  assertNoSecret(err, key);
});

test("explain says what would happen and writes nothing", async () => {
  const key = `explain:${uid()}`;
  const type = `t.explain.${uid()}`;
  const dry = await client.explain(type, { a: 1 }, { idempotency: { key } });
  assert.equal(dry.outcome, "accepted");
  assert.equal(dry.jobId, null);
  assert.equal((await client.listJobs({ type })).jobs.length, 0);
  assert.equal(await client.idempotencyLookup(key), null);

  const id = await client.enqueue(type, { a: 1 }, { idempotency: { key } });
  const replay = await client.explain(type, { a: 1 }, { idempotency: { key } });
  assert.equal(replay.outcome, "replayed");
  assert.equal(replay.jobId, id);
  assert.equal(replay.idempotency?.jobId, id);
  const conflict = await client.explain(type, { a: 2 }, { idempotency: { key } });
  assert.equal(conflict.outcome, "conflict");
  assert.deepEqual(conflict.conflict, { jobId: id, fields: ["payload"] });
  assert.equal((await client.listJobs({ type })).jobs.length, 1);
});

test("validation and payload-too-large are typed", async () => {
  const v = await client.enqueue("t.valid", null, { maxAttempts: 0 }).catch((e: unknown) => e);
  assert.ok(v instanceof ValidationError);
  assert.equal(v.status, 422);
  assert.equal(v.field, "max_attempts");
  assert.ok(typeof v.reason === "string" && v.reason.length > 0);

  const big = await client.enqueue("t.big", "x".repeat(1_100_000)).catch((e: unknown) => e);
  assert.ok(big instanceof PayloadTooLargeError, String(big));
  assert.equal(big.status, 413);
});
