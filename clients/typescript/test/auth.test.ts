import assert from "node:assert/strict";
import { after, before, test } from "node:test";
import { Client, UnauthorizedError, Worker } from "idemq";
import { type RunningServer, startServer, uid } from "./server.js";

let server: RunningServer;
const token = `token-${uid()}`;

before(async () => {
  server = await startServer({ token });
});
after(async () => {
  await server?.stop();
});

test("without the token every API call is UnauthorizedError; healthz stays open", async () => {
  const anonymous = new Client({ baseUrl: server.url });
  const err = await anonymous.enqueue("t.auth", null, { idempotency: { key: `k-${uid()}` } }).catch((e: unknown) => e);
  assert.ok(err instanceof UnauthorizedError, String(err));
  assert.equal(err.status, 401);
  assert.equal(err.problemType, "unauthorized");
  const wrong = new Client({ baseUrl: server.url, token: "not-it" });
  assert.ok((await wrong.listJobs().catch((e: unknown) => e)) instanceof UnauthorizedError);
  assert.equal((await anonymous.health()).ok, true);
});

test("with the token the calls go through", async () => {
  const client = new Client({ baseUrl: server.url, token });
  const key = `auth:${uid()}`;
  const first = await client.enqueueWithResult("t.auth", { a: 1 }, { idempotency: { key } });
  const again = await client.enqueueWithResult("t.auth", { a: 1 }, { idempotency: { key } });
  assert.equal(first.outcome, "accepted");
  assert.equal(again.outcome, "replayed");
  assert.equal((await client.getJob(first.jobId)).state, "ready");
});

test("a worker without the token stops with UnauthorizedError", async () => {
  const worker = new Worker(new Client({ baseUrl: server.url }), { handlers: { x: () => null }, waitMs: 100 });
  const err = await worker.run().catch((e: unknown) => e);
  assert.ok(err instanceof UnauthorizedError, String(err));
});
