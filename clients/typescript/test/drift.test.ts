// The client against the committed OpenAPI document: every path and method it
// calls, every query parameter, header and body member it sends, and every
// problem type it maps must be in the document; every operation of the
// document must be reachable through the client.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { test } from "node:test";
import { Client, PROBLEM_TYPES, Worker } from "idemq";
import { repoRoot } from "./server.js";

type Schema = Record<string, unknown>;
const doc = JSON.parse(readFileSync(join(repoRoot, "crates/idemq-server/tests/snapshots/openapi.json"), "utf8")) as {
  paths: Record<string, Record<string, { parameters?: Array<{ in: string; name: string }>; requestBody?: { content?: Record<string, { schema?: Schema }> } }>>;
  components: { schemas: Record<string, Schema> };
};

interface Sent {
  method: string;
  path: string;
  query: string[];
  headers: string[];
  body: unknown;
}

/** A fetch that records each request and answers with a body every method can read. */
function recorder() {
  const sent: Sent[] = [];
  const universal = {
    job_id: "j-1",
    outcome: "accepted",
    id: "j-1",
    type: "t",
    queue: "q",
    state: "completed",
    jobs: [],
    results: [],
    events: [],
    runs: [],
    checkpoints: {},
    queues: [],
    schedules: [],
    completed: [],
    cancelled: true,
    purged: true,
    promoted: true,
    paused: false,
    released: true,
    deleted: true,
    stored: true,
    matched: 0,
    done: 0,
    ok: true,
    backend: "sqlite",
    name: "s",
    timezone: "UTC",
    job: { type: "t" },
    mode: "pending",
    key_preview: "k…",
    key_digest: "0000000000000000",
    expires_at: "2030-01-01T00:00:00Z",
    lease_expires_at: "2030-01-01T00:00:00Z",
    cancel_requested: false,
  };
  const f: typeof fetch = async (input, init) => {
    const url = new URL(String(input));
    const headers = Object.keys((init?.headers as Record<string, string>) ?? {}).map((h) => h.toLowerCase());
    sent.push({
      method: init?.method ?? "GET",
      path: url.pathname,
      query: [...url.searchParams.keys()],
      headers,
      body: init?.body === undefined ? undefined : JSON.parse(String(init.body)),
    });
    return new Response(JSON.stringify(universal), { status: 200, headers: { "content-type": "application/json" } });
  };
  return { sent, fetch: f };
}

/** Calls every method of the client with every option it has. */
async function exerciseEverything(client: Client) {
  const all = {
    queue: "q",
    jobId: "job-1",
    priority: 1,
    runAt: new Date(),
    delayMs: 1,
    maxAttempts: 2,
    retry: { kind: "exponential" as const, initialMs: 1, factor: 2, maxMs: 3, jitter: true },
    timeoutMs: 1000,
    deadline: new Date(),
    concurrencyKey: "c",
    tags: ["t"],
    keepMs: 1,
    idempotency: { key: "k", scope: "s", ttlMs: 1000 },
    dedupe: { key: "d", ttlMs: 1, extend: true, replace: false, maxWaitMs: 2 },
  };
  await client.enqueue("t", { any: { thing: 1 } }, all);
  await client.enqueueWithResult("t", null, { ...all, retry: { kind: "fixed", delayMs: 5 }, dedupe: "bare" });
  await client.enqueueWithResult("t", null, { retry: { kind: "none" }, idempotency: { key: "k", scope: "s", ttlMs: 1, sendAs: "header" } });
  await client.enqueueMany([{ type: "t", payload: 1, ...all }], { atomic: true });
  await client.explain("t", 1, all);
  await client.explain("t", 1, { idempotency: { key: "k", sendAs: "header" } });
  await client.getJob("j", { waitMs: 10 });
  await client.listJobs({ state: "ready", queue: "q", type: "t", tag: "x", limit: 5, cursor: "c" });
  await client.jobEvents("j");
  await client.jobRuns("j");
  await client.jobCheckpoints("j");
  await client.cancel("j");
  await client.cancelByKey("t", "k");
  await client.purge("j");
  await client.promote("j");
  await client.redrive("j", { idempotencyKey: "k", maxAttempts: 1, deadline: new Date(), runAt: new Date(), resetCheckpoints: true });
  await client.bulk("cancel", { state: "ready", queue: "q", type: "t", tag: "x", before: new Date() }, { limit: 10 });
  await client.queues();
  await client.pauseQueue("q");
  await client.resumeQueue("q");
  await client.dedupeLookup("t", "k");
  await client.idempotencyLookup("k", { scope: "s" });
  await client.idempotencyRelease("k", { scope: "s" });
  await client.schedules();
  await client.putSchedule("s", { cron: "0 * * * * *", timezone: "UTC", paused: false, job: { type: "t", payload: 1, queue: "q", tags: ["a"] } });
  await client.putSchedule("s", { everyMs: 1000, job: { type: "t" } });
  await client.deleteSchedule("s");
  await client.health();
  await client.claim({
    queues: ["q"],
    worker: "w",
    limit: 1,
    leaseMs: 1000,
    types: ["t"],
    waitMs: 0,
    complete: [{ id: "j", leaseToken: "l", result: 1 }],
  });
  await client.heartbeat("j", "l");
  await client.complete("j", "l", { r: 1 });
  await client.completeMany([{ id: "j", leaseToken: "l", result: 1 }]);
  await client.fail("j", "l", { error: "e", retryable: false, retryAfterMs: 1, snoozeMs: 1 });
  await client.release("j", "l");
  await client.putCheckpoint("j", "n", "l", { v: 1 });
}

function deref(s: Schema | undefined): Schema {
  let cur = s ?? {};
  while (typeof cur["$ref"] === "string") {
    const name = (cur["$ref"] as string).split("/").pop()!;
    cur = doc.components.schemas[name] ?? {};
  }
  return cur;
}

/** The members of `value` that `schema` does not describe, as dotted paths. */
function unknownMembers(value: unknown, schema: Schema | undefined, at: string): string[] {
  const s = deref(schema);
  const alternatives = (s["oneOf"] ?? s["anyOf"]) as Schema[] | undefined;
  if (alternatives) {
    let best: string[] | undefined;
    for (const alt of alternatives) {
      const d = deref(alt);
      const types = ([] as unknown[]).concat(d["type"] ?? []);
      if (value === null && types.includes("null")) return [];
      if (value !== null && types.length === 1 && types[0] === "null") continue;
      const found = unknownMembers(value, alt, at);
      if (found.length === 0) return [];
      if (!best || found.length < best.length) best = found;
    }
    return best ?? [`${at} (no alternative)`];
  }
  if (Array.isArray(value)) {
    return s["items"] ? value.flatMap((v, i) => unknownMembers(v, s["items"] as Schema, `${at}[${i}]`)) : [];
  }
  if (value && typeof value === "object") {
    const props = s["properties"] as Record<string, Schema> | undefined;
    if (!props) return [];
    const out: string[] = [];
    for (const [k, v] of Object.entries(value)) {
      const path = at ? `${at}.${k}` : k;
      if (!(k in props)) out.push(path);
      else out.push(...unknownMembers(v, props[k], path));
    }
    return out;
  }
  return [];
}

function templateOf(path: string): string | undefined {
  for (const template of Object.keys(doc.paths)) {
    const re = new RegExp(`^${template.replace(/\{[^}]+\}/g, "[^/]+")}$`);
    if (re.test(path)) return template;
  }
  return undefined;
}

test("every request the client sends is in the committed OpenAPI document", async () => {
  const { sent, fetch } = recorder();
  await exerciseEverything(new Client({ baseUrl: "http://127.0.0.1:9", fetch, retry: false }));
  const problems: string[] = [];
  const covered = new Set<string>();
  const transport = new Set(["accept", "content-type", "authorization"]);
  for (const r of sent) {
    // Paths with literal segments win over templates: try the literal first.
    const template = doc.paths[r.path] ? r.path : templateOf(r.path);
    const op = template ? doc.paths[template]?.[r.method.toLowerCase()] : undefined;
    if (!template || !op) {
      problems.push(`${r.method} ${r.path}: no such operation`);
      continue;
    }
    covered.add(`${r.method} ${template}`);
    const params = op.parameters ?? [];
    for (const q of r.query) {
      if (!params.some((p) => p.in === "query" && p.name === q)) problems.push(`${r.method} ${template}: query ?${q}`);
    }
    for (const h of r.headers) {
      if (transport.has(h)) continue;
      if (!params.some((p) => p.in === "header" && p.name.toLowerCase() === h)) problems.push(`${r.method} ${template}: header ${h}`);
    }
    if (r.body !== undefined) {
      const schema = op.requestBody?.content?.["application/json"]?.schema;
      if (!schema) problems.push(`${r.method} ${template}: a body is sent, the document takes none`);
      else for (const m of unknownMembers(r.body, schema, "")) problems.push(`${r.method} ${template}: body member ${m}`);
    }
  }
  assert.deepEqual(problems, [], `drift from the OpenAPI document:\n${problems.join("\n")}`);

  const skip = new Set(["GET /metrics", "GET /openapi.json", "GET /problems/{name}", "GET /"]);
  const missing: string[] = [];
  for (const [path, ops] of Object.entries(doc.paths)) {
    for (const [method, op] of Object.entries(ops)) {
      const key = `${method.toUpperCase()} ${path}`;
      // The GET of a fixed path (`/v1/jobs/batch`, …) is GET /v1/jobs/{id}
      // for a job whose id is that name, which the client sends as such.
      const alias = String((op as { operationId?: string }).operationId ?? "").startsWith("get_job_named_");
      if (!skip.has(key) && !alias && !covered.has(key)) missing.push(key);
    }
  }
  assert.deepEqual(missing, [], `operations the client does not call:\n${missing.join("\n")}`);
});

test("the worker's own requests are in the document too", async () => {
  const { sent, fetch } = recorder();
  const client = new Client({ baseUrl: "http://127.0.0.1:9", fetch, retry: false });
  const controller = new AbortController();
  const worker = new Worker(client, { queues: ["q"], handlers: { t: () => 1 }, waitMs: 0, onError: () => {} });
  const run = worker.run({ signal: controller.signal });
  await new Promise((r) => setTimeout(r, 50));
  controller.abort();
  await run;
  assert.ok(sent.length > 0);
  for (const r of sent) {
    const template = doc.paths[r.path] ? r.path : templateOf(r.path);
    const op = template ? doc.paths[template]?.[r.method.toLowerCase()] : undefined;
    assert.ok(op, `${r.method} ${r.path}`);
    const schema = op.requestBody?.content?.["application/json"]?.schema;
    if (r.body !== undefined) assert.deepEqual(unknownMembers(r.body, schema, ""), [], `${r.method} ${template}`);
  }
});

test("the problem types the client maps are the document's", () => {
  const problem = deref(doc.components.schemas["Problem"]);
  const typeSchema = deref((problem["properties"] as Record<string, Schema>)["type"]);
  const listed = new Set<string>();
  for (const e of (typeSchema["enum"] as string[] | undefined) ?? []) listed.add(e.replace(/^.*\/problems\//, ""));
  // The description reads "`/problems/<name>`: bad-request, validation, …".
  const text = String(typeSchema["description"] ?? "");
  const declared = text.includes(":") ? text.slice(text.indexOf(":") + 1) : "";
  for (const m of declared.matchAll(/[a-z]+(?:-[a-z]+)*/g)) listed.add(m[0]);
  for (const m of JSON.stringify(doc).matchAll(/\/problems\/([a-z]+(?:-[a-z]+)*)/g)) listed.add(m[1]!);
  assert.ok(listed.size > 0, "the document lists no problem type");
  const mapped = Object.keys(PROBLEM_TYPES);
  const unknown = mapped.filter((name) => !listed.has(name));
  assert.deepEqual(unknown, [], `problem types the document does not list: ${unknown.join(", ")}`);
  const unmapped = [...listed].filter((name) => !mapped.includes(name));
  assert.deepEqual(unmapped, [], `problem types the client does not map: ${unmapped.join(", ")}`);
});
