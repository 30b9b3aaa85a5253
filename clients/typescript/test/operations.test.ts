import assert from "node:assert/strict";
import { request as httpRequest } from "node:http";
import { after, before, test } from "node:test";
import {
  BadRequestError,
  Client,
  ForbiddenHostError,
  MethodNotAllowedError,
  NotDeadError,
  NotFoundError,
  ValidationError,
} from "idemq";
import { type RunningServer, sleep, startServer, uid } from "./server.js";

let server: RunningServer;
let client: Client;

before(async () => {
  server = await startServer();
  client = new Client({ baseUrl: server.url });
});
after(async () => {
  await server?.stop();
});

/** Enqueues a job and drives it to `dead` through the worker protocol. */
async function deadJob(queue: string): Promise<string> {
  const id = await client.enqueue("doomed", { n: 1 }, { queue, maxAttempts: 1 });
  const { jobs } = await client.claim({ queues: [queue], worker: "ops" });
  assert.equal(jobs[0]!.id, id);
  const failed = await client.fail(id, jobs[0]!.leaseToken, { error: "no", retryable: false });
  assert.equal(failed.state, "dead");
  return id;
}

test("health answers ok with the backend and full durability", async () => {
  const h = await client.health();
  assert.equal(h.ok, true);
  assert.equal(h.backend, server.backend);
  assert.equal(h.durability, "full"); // relaxed only on Redis ?durability=relaxed
});

test("health reads durability; a server too old to say leaves it undefined", async () => {
  const bodies: object[] = [
    { ok: true, backend: "redis", durability: "relaxed", newer: 1 },
    { ok: true, backend: "sqlite" },
  ];
  const canned: typeof fetch = async (input, init) => {
    assert.equal(new URL(String(input)).pathname, "/healthz");
    assert.equal(init?.method ?? "GET", "GET");
    return new Response(JSON.stringify(bodies.shift()), { status: 200, headers: { "content-type": "application/json" } });
  };
  const offline = new Client({ baseUrl: "http://127.0.0.1:9", fetch: canned, retry: false });
  assert.deepEqual(await offline.health(), { ok: true, backend: "redis", durability: "relaxed" });
  const older = await offline.health();
  assert.deepEqual(older, { ok: true, backend: "sqlite" });
  assert.equal(older.durability, undefined);
});

test("getJob with waitMs holds until the job is terminal", async () => {
  const queue = `wait-${uid()}`;
  const id = await client.enqueue("w", null, { queue });
  const { jobs } = await client.claim({ queues: [queue], worker: "waiter" });
  const began = Date.now();
  setTimeout(() => void client.complete(id, jobs[0]!.leaseToken, { done: true }), 400);
  const job = await client.getJob(id, { waitMs: 5_000 });
  assert.equal(job.state, "completed");
  assert.deepEqual(job.result, { done: true });
  assert.ok(Date.now() - began >= 300);
  assert.ok(job.finishedAt);
  const now = await client.getJob(id, { waitMs: 0 });
  assert.equal(now.state, "completed");
});

test("listJobs filters by state, queue, type and tag and pages with a cursor", async () => {
  const queue = `list-${uid()}`;
  const ids: string[] = [];
  for (let i = 0; i < 5; i++) ids.push(await client.enqueue("listed", i, { queue, tags: i % 2 ? ["odd"] : ["even"] }));
  await client.enqueue("other", null, { queue });
  const page = await client.listJobs({ queue, type: "listed", limit: 2 });
  assert.equal(page.jobs.length, 2);
  assert.ok(page.nextCursor);
  const all: string[] = [];
  for await (const job of client.iterateJobs({ queue, type: "listed", limit: 2 })) all.push(job.id);
  assert.deepEqual([...all].sort(), [...ids].sort());
  assert.deepEqual(all, [...ids].reverse(), "newest first");
  const odd = await client.listJobs({ queue, tag: "odd" });
  assert.deepEqual(odd.jobs.map((j) => j.payload).sort(), [1, 3]);
  const ready = await client.listJobs({ queue, state: "ready", limit: 100 });
  assert.equal(ready.jobs.length, 6);
  assert.equal(ready.nextCursor, null);
  const none = await client.listJobs({ queue, state: "dead" });
  assert.equal(none.jobs.length, 0);
  const bad = await client.listJobs({ limit: 100_000 }).catch((e: unknown) => e);
  assert.ok(bad instanceof ValidationError, String(bad));
});

test("events, runs and checkpoints of a job", async () => {
  const queue = `hist-${uid()}`;
  const id = await client.enqueue("hist", null, { queue });
  const { jobs } = await client.claim({ queues: [queue], worker: "historian" });
  await client.putCheckpoint(id, "step one", jobs[0]!.leaseToken, [1, 2]);
  await client.complete(id, jobs[0]!.leaseToken, "ok");
  const events = await client.jobEvents(id);
  const kinds = events.map((e) => e.kind);
  assert.ok(kinds.includes("accepted"), kinds.join());
  assert.ok(kinds.includes("completed"), kinds.join());
  assert.ok(events.every((e) => typeof e.seq === "number" && typeof e.at === "string"));
  const runs = await client.jobRuns(id);
  assert.equal(runs.length, 1);
  assert.equal(runs[0]!.worker, "historian");
  assert.equal(runs[0]!.outcome, "completed");
  assert.ok(runs[0]!.startedAt && runs[0]!.finishedAt);
  assert.deepEqual(await client.jobCheckpoints(id), { "step one": [1, 2] });
  const missing = await client.jobEvents(`nope-${uid()}`).catch((e: unknown) => e);
  assert.ok(missing instanceof NotFoundError);
});

test("an unknown job is NotFoundError", async () => {
  const err = await client.getJob(`missing-${uid()}`).catch((e: unknown) => e);
  assert.ok(err instanceof NotFoundError);
  assert.equal(err.status, 404);
  assert.equal(err.problemType, "not-found");
});

test("a job id of dots is refused before any request: fetch cannot send it", async () => {
  for (const id of [".", ".."]) {
    assert.equal(await client.enqueue("dots", 1, { jobId: id }), id);
    for (const call of [() => client.getJob(id), () => client.cancel(id), () => client.jobEvents(id)]) {
      const err = await call().catch((e: unknown) => e);
      assert.ok(err instanceof TypeError, String(err));
      assert.match(err.message, /dot segments/);
    }
  }
});

test("cancel, purge and promote", async () => {
  const queue = `ops-${uid()}`;
  const waiting = await client.enqueue("op", null, { queue });
  assert.deepEqual(await client.cancel(waiting), { cancelled: true, state: "cancelled" });
  assert.deepEqual(await client.cancel(waiting), { cancelled: false, state: "cancelled" });
  assert.equal(await client.purge(waiting), true);
  assert.equal(await client.purge(waiting), false);
  assert.ok((await client.getJob(waiting).catch((e: unknown) => e)) instanceof NotFoundError);

  const later = await client.enqueue("op", null, { queue, delayMs: 3_600_000 });
  assert.equal((await client.getJob(later)).state, "scheduled");
  assert.equal(await client.promote(later), true);
  assert.equal((await client.getJob(later)).state, "ready");
});

test("cancelByKey cancels the pending jobs of a dedupe key", async () => {
  const type = `keyed.${uid()}`;
  const id = await client.enqueue(type, null, { dedupe: "acct-9" });
  assert.deepEqual(await client.dedupeLookup(type, "acct-9"), { jobId: id, mode: "pending", windowUntil: null });
  assert.equal(await client.cancelByKey(type, "acct-9"), true);
  assert.equal((await client.getJob(id)).state, "cancelled");
  assert.equal(await client.cancelByKey(type, "acct-9"), false);
  assert.equal(await client.dedupeLookup(type, "acct-9"), null);
});

test("redrive a dead job, idempotently with a key; not-dead is typed", async () => {
  const queue = `redrive-${uid()}`;
  const id = await deadJob(queue);
  const key = `redrive:${uid()}`;
  const first = await client.redrive(id, { idempotencyKey: key, maxAttempts: 2 });
  assert.deepEqual(first, { jobId: id, outcome: "accepted" });
  const again = await client.redrive(id, { idempotencyKey: key, maxAttempts: 2 });
  assert.deepEqual(again, { jobId: id, outcome: "replayed" });
  const job = await client.getJob(id);
  assert.equal(job.state, "ready");
  assert.equal(job.maxAttempts, 2);
  const err = await client.redrive(id).catch((e: unknown) => e);
  assert.ok(err instanceof NotDeadError, String(err));
  assert.equal(err.status, 409);
  assert.equal(err.jobId, id);
});

test("bulk actions over a filter", async () => {
  const queue = `bulk-${uid()}`;
  for (let i = 0; i < 3; i++) await client.enqueue("bulk", i, { queue, tags: ["sweep"] });
  await client.enqueue("bulk", "kept", { queue });
  const cancelled = await client.bulk("cancel", { queue, tag: "sweep", state: "ready" });
  assert.deepEqual(cancelled, { matched: 3, done: 3 });
  const purged = await client.bulk("purge", { queue, state: "cancelled", before: new Date(Date.now() + 60_000) }, { limit: 2 });
  assert.deepEqual(purged, { matched: 2, done: 2 });
  const left = await client.listJobs({ queue });
  assert.equal(left.jobs.length, 2);
  const dead = await deadJob(`${queue}-dead`);
  const redriven = await client.bulk("redrive", { queue: `${queue}-dead`, state: "dead" });
  assert.deepEqual(redriven, { matched: 1, done: 1 });
  assert.equal((await client.getJob(dead)).state, "ready");
});

test("pause and resume a queue; queues lists counts", async () => {
  const queue = `paused-${uid()}`;
  await client.enqueue("p", null, { queue });
  assert.equal(await client.pauseQueue(queue), true);
  const listed = (await client.queues()).find((q) => q.name === queue);
  assert.ok(listed);
  assert.equal(listed.paused, true);
  assert.equal(listed.counts.ready, 1);
  assert.deepEqual(Object.keys(listed.counts).sort(), ["active", "cancelled", "completed", "dead", "ready", "scheduled"]);
  const { jobs } = await client.claim({ queues: [queue], worker: "nobody" });
  assert.equal(jobs.length, 0);
  assert.equal(await client.resumeQueue(queue), false);
  const after = await client.claim({ queues: [queue], worker: "somebody" });
  assert.equal(after.jobs.length, 1);
  await client.complete(after.jobs[0]!.id, after.jobs[0]!.leaseToken);
});

test("idempotency lookup and release; the key travels in the body only", async () => {
  const key = `lookup-secret-${uid()}`;
  const id = await client.enqueue("looked.up", null, { idempotency: { key, scope: "lookups" } });
  const binding = await client.idempotencyLookup(key, { scope: "lookups" });
  assert.ok(binding);
  assert.equal(binding.jobId, id);
  assert.equal(binding.keyPreview, `${key.slice(0, 8)}…`);
  assert.match(binding.keyDigest, /^[0-9a-f]{16}$/);
  assert.ok(binding.expiresAt);
  assert.equal(await client.idempotencyLookup(key), null, "another scope");
  assert.equal(await client.idempotencyRelease(key, { scope: "lookups" }), true);
  assert.equal(await client.idempotencyRelease(key, { scope: "lookups" }), false);
  const fresh = await client.enqueueWithResult("looked.up", "changed", { idempotency: { key, scope: "lookups" } });
  assert.equal(fresh.outcome, "accepted");
  assert.notEqual(fresh.jobId, id);
});

test("schedules: put, list, delete", async () => {
  const name = `nightly-${uid()}`;
  const created = await client.putSchedule(name, {
    cron: "0 0 3 * * *",
    timezone: "Europe/Paris",
    job: { type: "report.build", payload: { kind: "daily" }, queue: "reports", tags: ["cron"] },
  });
  assert.equal(created.name, name);
  assert.equal(created.cron, "0 0 3 * * *");
  assert.equal(created.timezone, "Europe/Paris");
  assert.ok(created.nextFireAt);
  const every = await client.putSchedule(`${name}-every`, { everyMs: 60_000, paused: true, job: { type: "tick" } });
  assert.equal(every.everyMs, 60_000);
  assert.equal(every.paused, true);
  const listed = await client.schedules();
  const mine = listed.find((s) => s.name === name);
  assert.ok(mine);
  assert.equal(mine.job["type"], "report.build");
  assert.equal(mine.job["queue"], "reports");
  assert.equal(await client.deleteSchedule(name), true);
  assert.equal(await client.deleteSchedule(name), false);
  assert.equal(await client.deleteSchedule(`${name}-every`), true);
  const bad = await client.putSchedule(`${name}-bad`, { cron: "not cron", job: { type: "x" } }).catch((e: unknown) => e);
  assert.ok(bad instanceof ValidationError, String(bad));
});

test("a known path with another method is MethodNotAllowedError with Allow", async () => {
  const err = await client.request("DELETE", "/v1/jobs").catch((e: unknown) => e);
  assert.ok(err instanceof MethodNotAllowedError, String(err));
  assert.equal(err.status, 405);
  assert.ok(err.allow.includes("GET") && err.allow.includes("POST"), err.allow.join());
  assert.equal(err.problem.type, "/problems/method-not-allowed");
});

test("a malformed body is BadRequestError", async () => {
  const err = await client.request("POST", "/v1/jobs", { body: { type: "x", no_such_member: 1 } }).catch((e: unknown) => e);
  assert.ok(err instanceof BadRequestError, String(err));
  assert.match(err.detail ?? "", /no_such_member/);
});

test("a Host the server does not know is ForbiddenHostError", async () => {
  // fetch always sends the URL's host, so this client goes through node:http with another Host header.
  const foreign = new Client({
    baseUrl: server.url,
    fetch: (input, init) =>
      new Promise((resolve, reject) => {
        const url = new URL(String(input));
        const req = httpRequest(
          {
            host: "127.0.0.1",
            port: url.port,
            path: url.pathname + url.search,
            method: init?.method ?? "GET",
            headers: { ...(init?.headers as Record<string, string>), host: "idemq.example.com" },
          },
          (res) => {
            const chunks: Buffer[] = [];
            res.on("data", (c: Buffer) => chunks.push(c));
            res.on("end", () => {
              const headers = new Headers();
              for (const [k, v] of Object.entries(res.headers)) if (typeof v === "string") headers.set(k, v);
              resolve(new Response(Buffer.concat(chunks), { status: res.statusCode ?? 500, headers }));
            });
          },
        );
        req.on("error", reject);
        if (init?.body) req.write(init.body as string);
        req.end();
      }),
  });
  const err = await foreign.enqueue("t.host", null).catch((e: unknown) => e);
  assert.ok(err instanceof ForbiddenHostError, String(err));
  assert.equal(err.status, 403);
  await sleep(0);
});
