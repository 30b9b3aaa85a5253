import assert from "node:assert/strict";
import { after, before, test } from "node:test";
import { Client, JobError, JobInterrupted, LeaseLostError, Worker, type Job, type WorkerOptions } from "idemq";
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

/** A wait that does not keep the process alive once the test is over. */
function idle(ms: number): Promise<void> {
  return new Promise((r) => setTimeout(r, ms).unref());
}

async function waitFor<T>(what: string, fn: () => Promise<T | undefined | false>, timeoutMs = 15_000): Promise<T> {
  const until = Date.now() + timeoutMs;
  for (;;) {
    const v = await fn();
    if (v) return v;
    if (Date.now() > until) throw new Error(`timed out waiting for ${what}`);
    await sleep(50);
  }
}

async function terminal(id: string, timeoutMs = 15_000): Promise<Job> {
  const job = await client.waitForJob(id, { timeoutMs });
  assert.ok(["completed", "dead", "cancelled"].includes(job.state), `job ${id} is still ${job.state}`);
  return job;
}

/** Starts a worker; `stop()` aborts it and returns its report. */
function startWorker(options: WorkerOptions, c: Client = client) {
  const controller = new AbortController();
  const errors: unknown[] = [];
  const worker = new Worker(c, { waitMs: 500, onError: (e) => errors.push(e), ...options });
  const running = worker.run({ signal: controller.signal });
  return {
    worker,
    errors,
    running,
    async stop() {
      controller.abort();
      return running;
    },
  };
}

test("the worker drains N jobs, each completed once with its result", async () => {
  const queue = `drain-${uid()}`;
  const ids: string[] = [];
  for (let i = 0; i < 30; i++) ids.push(await client.enqueue("math.add", { a: i, b: 1 }, { queue }));
  const seen = new Map<string, number>();
  const sent: string[] = [];
  const recording = new Client({
    baseUrl: server.url,
    fetch: (input, init) => {
      const body = String(init?.body ?? "");
      sent.push(`${init?.method} ${new URL(String(input)).pathname} ${body.includes('"complete":[') ? "carrying" : ""}`);
      return fetch(input, init);
    },
  });
  const w = startWorker({
    queues: [queue],
    concurrency: 4,
    handlers: {
      "math.add": (ctx) => {
        seen.set(ctx.id, (seen.get(ctx.id) ?? 0) + 1);
        const p = ctx.payload as { a: number; b: number };
        return { sum: p.a + p.b };
      },
    },
  }, recording);
  const jobs = await Promise.all(ids.map((id) => terminal(id)));
  const report = await w.stop();
  // Completions travel in batches: on claims, or together to POST /v1/jobs/complete.
  const single = sent.filter((s) => /^POST \/v1\/jobs\/[^/]+\/complete /.test(s) && !s.startsWith("POST /v1/jobs/complete "));
  const batched = sent.filter((s) => s.startsWith("POST /v1/jobs/complete ") || s.endsWith("carrying"));
  assert.deepEqual(single, [], "one request per completion");
  assert.ok(batched.length > 0 && batched.length < 30, `${batched.length} completion round trips for 30 jobs`);
  jobs.forEach((job, i) => {
    assert.equal(job.state, "completed");
    assert.deepEqual(job.result, { sum: i + 1 });
    assert.equal(job.attempt, 1);
  });
  assert.equal(report.completed, 30);
  assert.equal(report.failed + report.lost + report.released, 0);
  assert.deepEqual([...seen.values()], Array(30).fill(1));
  const runs = await client.jobRuns(ids[0]!);
  assert.equal(runs.length, 1);
  assert.equal(runs[0]!.outcome, "completed");
  assert.equal(runs[0]!.worker, w.worker.name);
});

test("concurrency bounds the handlers running at once", async () => {
  const queue = `conc-${uid()}`;
  const ids: string[] = [];
  for (let i = 0; i < 7; i++) ids.push(await client.enqueue("slow", i, { queue }));
  let running = 0;
  let peak = 0;
  const w = startWorker({
    queues: [queue],
    concurrency: 3,
    handlers: {
      slow: async () => {
        running++;
        peak = Math.max(peak, running);
        await sleep(250);
        running--;
        return null;
      },
    },
  });
  await Promise.all(ids.map((id) => terminal(id)));
  await w.stop();
  assert.equal(peak, 3);
});

test("a failing job is retried, and its error recorded", async () => {
  const queue = `retry-${uid()}`;
  const id = await client.enqueue("flaky", null, { queue, retry: { kind: "fixed", delayMs: 100 } });
  const w = startWorker({
    queues: [queue],
    handlers: {
      flaky: (ctx) => {
        if (ctx.attempt === 1) throw new Error("upstream said no");
        return { attempt: ctx.attempt };
      },
    },
  });
  const job = await terminal(id);
  const report = await w.stop();
  assert.equal(job.state, "completed");
  assert.deepEqual(job.result, { attempt: 2 });
  assert.equal(job.attempt, 2);
  const runs = await client.jobRuns(id);
  assert.deepEqual(
    runs.map((r) => r.outcome),
    ["failed", "completed"],
  );
  assert.match(runs[0]!.error ?? "", /upstream said no/);
  assert.equal(report.failed, 1);
  assert.equal(report.completed, 1);
});

test("permanent, retry-after and snooze failures", async () => {
  const queue = `fail-${uid()}`;
  const permanent = await client.enqueue("perm", null, { queue });
  const later = await client.enqueue("later", null, { queue, retry: { kind: "fixed", delayMs: 600_000 } });
  const snoozy = await client.enqueue("snoozy", null, { queue, maxAttempts: 1 });
  const w = startWorker({
    queues: [queue],
    handlers: {
      perm: () => {
        throw JobError.permanent("bad card");
      },
      later: (ctx) => {
        if (ctx.attempt === 1) throw JobError.retryAfter("rate limited", 100);
        return "done";
      },
      snoozy: (ctx) => {
        if (ctx.attempt === 1) throw JobError.snooze(100);
        return "woke";
      },
    },
  });
  const [p, l, s] = await Promise.all([terminal(permanent), terminal(later, 10_000), terminal(snoozy)]);
  await w.stop();
  assert.equal(p.state, "dead");
  assert.equal(p.attemptsUsed, 1);
  assert.match(p.lastError ?? "", /bad card/);
  assert.equal(l.state, "completed");
  assert.equal(l.attempt, 2);
  // A snooze does not consume the attempt: one attempt in the budget was enough.
  assert.equal(s.state, "completed");
  assert.equal(s.result, "woke");
  assert.equal(s.attemptsUsed, 1);
  assert.equal(s.attempt, 2);
});

test("a cancel seen at a heartbeat stops the handler and the job ends cancelled", async () => {
  const queue = `cancel-${uid()}`;
  const id = await client.enqueue("long", null, { queue });
  let started!: () => void;
  const isStarted = new Promise<void>((r) => (started = r));
  let interruptedBy: unknown;
  const w = startWorker({
    queues: [queue],
    leaseMs: 1_500,
    handlers: {
      long: (ctx) =>
        new Promise((_, reject) => {
          started();
          ctx.signal.addEventListener("abort", () => {
            interruptedBy = ctx.signal.reason;
            reject(ctx.signal.reason);
          });
        }),
    },
  });
  await isStarted;
  const answer = await client.cancel(id);
  assert.deepEqual(answer, { cancelled: true, state: "active" });
  const job = await terminal(id, 5_000);
  const report = await w.stop();
  assert.equal(job.state, "cancelled");
  assert.ok(interruptedBy instanceof JobInterrupted);
  assert.equal(interruptedBy.reason, "cancelled");
  assert.equal(report.cancelled, 1);
  assert.equal(report.completed, 0);
});

test("when heartbeats stop the lease is lost and the worker never completes that attempt", async () => {
  const queue = `lease-${uid()}`;
  const id = await client.enqueue("stuck", null, { queue });
  const sent: Array<{ url: string; body: string }> = [];
  const recording = new Client({
    baseUrl: server.url,
    fetch: (input, init) => {
      sent.push({ url: String(input), body: String(init?.body ?? "") });
      return fetch(input, init);
    },
  });
  let firstToken = "";
  let firstReturned!: () => void;
  const firstDone = new Promise<void>((r) => (firstReturned = r));
  let firstSignal: AbortSignal | undefined;
  const w = startWorker(
    {
      queues: [queue],
      concurrency: 1,
      leaseMs: 600,
      heartbeatIntervalMs: 600_000,
      handlers: {
        stuck: async (ctx) => {
          if (ctx.attempt === 1) {
            firstToken = ctx.leaseToken;
            firstSignal = ctx.signal;
            await idle(2_500); // ignores its signal, as a blocked handler would
            firstReturned();
            return "first";
          }
          return "second";
        },
      },
    },
    recording,
  );
  const job = await terminal(id, 15_000);
  await firstDone;
  await sleep(200);
  const report = await w.stop();
  assert.equal(job.state, "completed");
  assert.equal(job.result, "second");
  assert.equal(job.attempt, 2);
  const runs = await client.jobRuns(id);
  assert.equal(runs[0]!.outcome, "lease_expired");
  assert.equal(runs[1]!.outcome, "completed");
  assert.ok(firstSignal?.aborted);
  assert.equal((firstSignal!.reason as JobInterrupted).reason, "lease_lost");
  assert.ok(firstToken.length > 0);
  const completions = sent.filter((s) => /\/complete$|\/v1\/claim$/.test(new URL(s.url).pathname) && s.body.includes(firstToken));
  assert.deepEqual(completions, [], "the attempt whose lease was lost sent a completion");
  assert.equal(report.lost, 1);
  assert.equal(report.completed, 1);
});

test("checkpoints survive a retry: the step runs once, first writer wins", async () => {
  const queue = `ckpt-${uid()}`;
  const id = await client.enqueue("charge", { cents: 500 }, { queue, retry: { kind: "fixed", delayMs: 50 } });
  let stepRuns = 0;
  const w = startWorker({
    queues: [queue],
    handlers: {
      charge: async (ctx) => {
        const charge = await ctx.checkpoint("charge", async () => {
          stepRuns++;
          return { chargeId: `ch_${ctx.id}_${ctx.attempt}` };
        });
        const again = await ctx.checkpoint("charge", () => {
          stepRuns++;
          return { chargeId: "never" };
        });
        assert.deepEqual(again, charge);
        if (ctx.attempt === 1) throw new Error("crashed after the charge");
        return charge;
      },
    },
  });
  const job = await terminal(id);
  await w.stop();
  assert.equal(job.state, "completed");
  assert.equal(job.attempt, 2);
  assert.deepEqual(job.result, { chargeId: `ch_${id}_1` });
  assert.equal(stepRuns, 1);
  assert.deepEqual(await client.jobCheckpoints(id), { charge: { chargeId: `ch_${id}_1` } });

  // The protocol underneath: a second PUT of the same name is refused and the first value kept.
  const other = await client.enqueue("raw.ckpt", null, { queue: `${queue}-raw` });
  const { jobs } = await client.claim({ queues: [`${queue}-raw`], worker: "raw" });
  assert.equal(jobs[0]!.id, other);
  assert.equal(await client.putCheckpoint(other, "step", jobs[0]!.leaseToken, { v: 1 }), true);
  assert.equal(await client.putCheckpoint(other, "step", jobs[0]!.leaseToken, { v: 2 }), false);
  assert.deepEqual(await client.jobCheckpoints(other), { step: { v: 1 } });
  await client.complete(other, jobs[0]!.leaseToken);
});

test("the timeout is enforced by the worker itself", async () => {
  const queue = `timeout-${uid()}`;
  const slow = await client.enqueue("hang", null, { queue, timeoutMs: 300, maxAttempts: 1 });
  const reasons = new Map<string, unknown>();
  const began = Date.now();
  const w = startWorker({
    queues: [queue],
    handlers: {
      hang: async (ctx) => {
        ctx.signal.addEventListener("abort", () => reasons.set(ctx.id, (ctx.signal.reason as JobInterrupted).reason));
        await idle(6_000); // ignores its signal
        return "too late";
      },
    },
  });
  const a = await terminal(slow, 10_000);
  const elapsed = Date.now() - began;
  await w.stop();
  assert.ok(elapsed < 5_000, `took ${elapsed} ms`);
  assert.equal(a.state, "dead");
  assert.match(a.lastError ?? "", /timeout/);
  assert.equal(reasons.get(slow), "timeout");
});

/** Budget left and a policy that would retry 1 ms later: a worker that failed the attempt itself would leave a retry, or a death of its own. */
const wouldRetry = { maxAttempts: 5, retry: { kind: "fixed" as const, delayMs: 1 } };

/** The server ended the job's one attempt at its deadline: dead (`deadline`), recorded by the server, no retry. */
async function endedAtDeadline(id: string): Promise<void> {
  const events = await client.jobEvents(id);
  const kinds = events.map((e) => e.kind);
  assert.ok(!kinds.includes("retry_scheduled"), `a retry: ${kinds.join(", ")}`);
  assert.deepEqual(
    events.filter((e) => e.kind === "dead").map((e) => (e.data as { reason?: string }).reason),
    ["deadline"],
  );
  const job = await client.getJob(id);
  assert.deepEqual([job.state, job.result, job.attempt, job.attemptsUsed], ["dead", null, 1, 1]);
  assert.equal(job.lastError, "deadline passed");
  assert.deepEqual(
    (await client.jobRuns(id)).map((r) => [r.outcome, r.error]),
    [["failed", "deadline passed"]],
  );
}

/**
 * A fetch that makes the worker's clock disagree with the server's: claim
 * answers say the lease expires `aheadMs` later than it does (the server's
 * clock seems ahead), and heartbeats cannot reach the server until
 * `downUntil` (a Date.now() instant). Records every heartbeat's answer.
 */
function skewed(o: { aheadMs?: number; downUntil?: number } = {}) {
  const beats: { id: string; status: number | "down"; at: number }[] = [];
  const f: typeof fetch = async (input, init) => {
    const path = new URL(input instanceof Request ? input.url : String(input)).pathname;
    const heartbeat = path.endsWith("/heartbeat");
    const id = heartbeat ? decodeURIComponent(path.split("/").at(-2)!) : "";
    if (heartbeat && Date.now() < (o.downUntil ?? 0)) {
      beats.push({ id, status: "down", at: Date.now() });
      throw new TypeError("fetch failed", { cause: { code: "ECONNREFUSED" } });
    }
    const res = await fetch(input, init);
    if (heartbeat) beats.push({ id, status: res.status, at: Date.now() });
    if (path === "/v1/claim" && res.ok && o.aheadMs) {
      const body = (await res.json()) as { jobs: { lease_expires_at: string }[] };
      for (const j of body.jobs) j.lease_expires_at = new Date(Date.parse(j.lease_expires_at) + o.aheadMs).toISOString();
      return new Response(JSON.stringify(body), { status: res.status, headers: { "content-type": "application/json" } });
    }
    return res;
  };
  return { fetch: f, of: (id: string) => beats.filter((b) => b.id === id) };
}

test("a deadline ends the job dead (deadline) on the server, never a retry", async () => {
  const queue = `deadline-${uid()}`;
  const deadline = new Date(Date.now() + 1_500);
  const late = await client.enqueue("hang", null, { queue, deadline, ...wouldRetry });
  const stops = new Map<string, { reason: unknown; at: number }>();
  const w = startWorker({
    queues: [queue],
    handlers: {
      hang: async (ctx) => {
        ctx.signal.addEventListener("abort", () =>
          stops.set(ctx.id, { reason: (ctx.signal.reason as JobInterrupted).reason, at: Date.now() }),
        );
        await idle(6_000); // ignores its signal
        return "too late";
      },
    },
  });
  const job = await terminal(late, 10_000);
  const report = await w.stop();
  assert.equal(job.state, "dead");
  await endedAtDeadline(late);
  // Stopped once the server's clock (this machine's) was past the deadline.
  assert.equal(stops.get(late)?.reason, "deadline");
  assert.ok(stops.get(late)!.at >= deadline.getTime(), `stopped ${deadline.getTime() - stops.get(late)!.at} ms early`);
  assert.deepEqual([report.failed, report.lost, report.completed], [1, 0, 0]);
});

test("at the deadline the worker waits for the server's clock", async () => {
  const queue = `skew-${uid()}`;
  const deadline = new Date(Date.now() + 3_000);
  const hung = await client.enqueue("hang", null, { queue, deadline, ...wouldRetry });
  const done = await client.enqueue("finish", null, { queue, deadline, ...wouldRetry });
  const stops = new Map<string, { reason: unknown; at: number }>();
  const watch = (ctx: { id: string; signal: AbortSignal }) =>
    ctx.signal.addEventListener("abort", () =>
      stops.set(ctx.id, { reason: (ctx.signal.reason as JobInterrupted).reason, at: Date.now() }),
    );
  // The worker believes the server's clock 2 s ahead: it asks about the
  // deadline about 1 s after the claim, 2 s before the server says yes.
  const skew = skewed({ aheadMs: 2_000 });
  const w = startWorker(
    {
      queues: [queue],
      leaseMs: 30_000, // no heartbeat but the deadline's comes before it
      handlers: {
        hang: async (ctx) => {
          watch(ctx);
          await idle(8_000);
          return "too late";
        },
        // Ends after the worker's timer says "deadline", before the server's
        // clock does: once the early question was answered ("not yet"),
        // however late the claim came, and well before the worker asks again
        // at the deadline. The bound only keeps a broken worker from hanging the test.
        finish: async (ctx) => {
          watch(ctx);
          const giveUp = Date.now() + 10_000;
          while (skew.of(ctx.id).length === 0 && !ctx.signal.aborted && Date.now() < giveUp) await idle(5);
          return "in time";
        },
      },
    },
    new Client({ baseUrl: server.url, fetch: skew.fetch }),
  );
  const completed = await terminal(done, 10_000);
  const dead = await terminal(hung, 10_000);
  const report = await w.stop();
  assert.deepEqual([completed.state, completed.result], ["completed", "in time"]);
  assert.equal(stops.get(done), undefined);
  assert.deepEqual(skew.of(done).map((b) => b.status), [200]);
  assert.equal(dead.state, "dead");
  await endedAtDeadline(hung);
  assert.equal(stops.get(hung)?.reason, "deadline");
  assert.ok(stops.get(hung)!.at >= deadline.getTime(), `stopped ${deadline.getTime() - stops.get(hung)!.at} ms early`);
  // Asked early ("not yet": the lease renewed), then again at the deadline.
  const statuses = skew.of(hung).map((b) => b.status);
  assert.equal(statuses[0], 200, statuses.join());
  assert.equal(statuses.at(-1), 409, statuses.join());
  assert.deepEqual([report.completed, report.failed, report.lost], [1, 1, 0]);
});

test("while the server cannot be reached the deadline is asked again with backoff", async () => {
  const queue = `unreachable-${uid()}`;
  const deadline = new Date(Date.now() + 1_000);
  const id = await client.enqueue("hang", null, { queue, deadline, ...wouldRetry });
  const reasons: unknown[] = [];
  // Heartbeats fail from the start until 1.2 s after the deadline.
  const skew = skewed({ downUntil: deadline.getTime() + 1_200 });
  const w = startWorker(
    {
      queues: [queue],
      leaseMs: 30_000,
      handlers: {
        hang: async (ctx) => {
          ctx.signal.addEventListener("abort", () => reasons.push((ctx.signal.reason as JobInterrupted).reason));
          await idle(8_000);
          return "too late";
        },
      },
    },
    new Client({ baseUrl: server.url, fetch: skew.fetch, retry: false }),
  );
  const job = await terminal(id, 10_000);
  const report = await w.stop();
  assert.equal(job.state, "dead");
  await endedAtDeadline(id);
  // The handler went on while the question could not be answered, asked
  // again with a growing backoff, and stopped once the server ended the attempt.
  assert.deepEqual(reasons, ["deadline"]);
  const beats = skew.of(id);
  const down = beats.filter((b) => b.status === "down").map((b) => b.at);
  assert.ok(down.length >= 3 && down.length <= 8, JSON.stringify(beats));
  const gaps = down.slice(1).map((at, i) => at - down[i]!);
  assert.ok(gaps.every((g) => g >= 40) && gaps.at(-1)! > gaps[0]!, gaps.join());
  assert.equal(beats.at(-1)!.status, 409);
  assert.deepEqual([report.failed, report.lost], [1, 0]);
  assert.ok(w.errors.length >= down.length, "each failed question is reported to onError");
});

/**
 * A fetch that holds every request carrying a completion (a claim carrying
 * some, a batch, a completion of its own) for `holdMs` before it goes to the
 * server, as a busy network or a long claim queue would. Records every
 * heartbeat with the instant it was sent and its answer.
 */
function slowCompletions(holdMs: number) {
  const beats: { id: string; status: number; at: number }[] = [];
  let held = 0;
  const f: typeof fetch = async (input, init) => {
    const path = new URL(input instanceof Request ? input.url : String(input)).pathname;
    const body = String(init?.body ?? "");
    if (path.endsWith("/complete") || (path === "/v1/claim" && body.includes('"complete":['))) {
      held++;
      await sleep(holdMs);
    }
    const sent = Date.now();
    const res = await fetch(input, init);
    if (path.endsWith("/heartbeat")) beats.push({ id: decodeURIComponent(path.split("/").at(-2)!), status: res.status, at: sent });
    return res;
  };
  return { fetch: f, held: () => held, of: (id: string) => beats.filter((b) => b.id === id) };
}

test("no heartbeat ends an attempt whose handler returned before the deadline", async () => {
  const queue = `late-beat-${uid()}`;
  const deadline = new Date(Date.now() + 1_500);
  const id = await client.enqueue("finish", null, { queue, deadline, ...wouldRetry });
  // The handler returns 600 ms before the deadline (at once when the claim
  // came later), so that neither its return nor a heartbeat already under
  // way races the deadline. The completion is held 1.2 s: it reaches the
  // server past the deadline, well within the lease, and while it waits at
  // least two heartbeat intervals pass after the deadline. Without care, a
  // heartbeat goes out then, past the deadline, and ends the attempt on the
  // server (dead, deadline); the completion is then refused.
  const slow = slowCompletions(1_200);
  let returned = 0;
  const w = startWorker(
    {
      queues: [queue],
      leaseMs: 4_000,
      heartbeatIntervalMs: 300,
      handlers: {
        finish: async () => {
          await idle(deadline.getTime() - 600 - Date.now());
          returned = Date.now();
          return "in time";
        },
      },
    },
    new Client({ baseUrl: server.url, fetch: slow.fetch }),
  );
  const job = await terminal(id, 10_000);
  const report = await w.stop();
  assert.deepEqual([job.state, job.result], ["completed", "in time"], `last error ${job.lastError}`);
  assert.ok(slow.held() > 0, "no completion was held");
  // Every heartbeat of the job renewed the lease and was sent before the
  // deadline: none went out while the completion waited past it.
  const beats = slow.of(id);
  assert.ok(
    beats.every((b) => b.status === 200 && b.at < deadline.getTime()),
    `returned at ${returned}, deadline ${deadline.getTime()}: ${JSON.stringify(beats)}`,
  );
  assert.deepEqual([report.completed, report.lost, report.failed], [1, 0, 0]);
});

test("a regular heartbeat that finds the deadline passed reports the deadline, not a lost lease", async () => {
  const queue = `behind-${uid()}`;
  const deadline = new Date(Date.now() + 1_000);
  const id = await client.enqueue("hang", null, { queue, deadline, ...wouldRetry });
  const reasons: unknown[] = [];
  // The worker believes the server's clock 3 s behind: it would ask about
  // the deadline 3 s after it passed, so a regular heartbeat finds it first.
  const skew = skewed({ aheadMs: -3_000 });
  const w = startWorker(
    {
      queues: [queue],
      leaseMs: 3_000,
      heartbeatIntervalMs: 250,
      handlers: {
        hang: async (ctx) => {
          ctx.signal.addEventListener("abort", () => reasons.push((ctx.signal.reason as JobInterrupted).reason));
          await idle(8_000);
          return "too late";
        },
      },
    },
    new Client({ baseUrl: server.url, fetch: skew.fetch }),
  );
  const job = await terminal(id, 10_000);
  await waitFor("the handler's stop", async () => reasons.length > 0);
  const report = await w.stop();
  assert.equal(job.state, "dead");
  await endedAtDeadline(id);
  assert.deepEqual(reasons, ["deadline"]);
  const beats = skew.of(id);
  assert.ok(beats.length >= 2 && beats.at(-1)!.status === 409 && beats.at(-1)!.at < deadline.getTime() + 2_000, JSON.stringify(beats));
  assert.deepEqual([report.failed, report.lost], [1, 0]);
});

test("graceful shutdown lets short handlers finish and releases the rest", async () => {
  const queue = `shutdown-${uid()}`;
  const quick = await client.enqueue("quick", null, { queue });
  const stuck = await client.enqueue("stuck", null, { queue });
  let started = 0;
  const w = startWorker({
    queues: [queue],
    concurrency: 2,
    shutdownGraceMs: 700,
    handlers: {
      quick: async () => {
        started++;
        await sleep(300);
        return "finished in the grace period";
      },
      stuck: async () => {
        started++;
        await idle(60_000);
      },
    },
  });
  await waitFor("both handlers to start", async () => started === 2);
  const report = await w.stop();
  assert.equal(report.completed, 1);
  assert.equal(report.released, 1);
  const q = await client.getJob(quick);
  assert.equal(q.state, "completed");
  assert.equal(q.result, "finished in the grace period");
  const s = await client.getJob(stuck);
  assert.equal(s.state, "ready");
  assert.equal(s.attemptsUsed, 0);
  assert.deepEqual(
    (await client.jobRuns(stuck)).map((r) => r.outcome),
    ["released"],
  );
});

test("completions acknowledged in one batch: a stale token fails only its own item", async () => {
  const queue = `batchack-${uid()}`;
  for (let i = 0; i < 3; i++) await client.enqueue("ack", i, { queue });
  const { jobs } = await client.claim({ queues: [queue], worker: "batcher", limit: 3 });
  assert.equal(jobs.length, 3);
  const results = await client.completeMany([
    { id: jobs[0]!.id, leaseToken: jobs[0]!.leaseToken, result: "r0" },
    { id: jobs[1]!.id, leaseToken: "not-the-token" },
    { id: jobs[2]!.id, leaseToken: jobs[2]!.leaseToken },
  ]);
  assert.equal(results.length, 3);
  assert.deepEqual(results[0], { ok: true, state: "completed" });
  assert.ok(!results[1]!.ok && results[1]!.error instanceof LeaseLostError);
  assert.deepEqual(results[2], { ok: true, state: "completed" });
  assert.equal((await client.getJob(jobs[0]!.id)).result, "r0");
  assert.equal((await client.getJob(jobs[1]!.id)).state, "active");
});

test("a claim carries the completions of what the worker finished", async () => {
  const queue = `carry-${uid()}`;
  const first = await client.enqueue("carry", 1, { queue });
  const second = await client.enqueue("carry", 2, { queue });
  const one = await client.claim({ queues: [queue], worker: "carrier" });
  assert.equal(one.jobs[0]!.id, first);
  const two = await client.claim({
    queues: [queue],
    worker: "carrier",
    complete: [{ id: first, leaseToken: one.jobs[0]!.leaseToken, result: { ok: 1 } }],
  });
  assert.deepEqual(two.completed, [{ ok: true, state: "completed" }]);
  assert.equal(two.jobs[0]!.id, second);
  assert.deepEqual((await client.getJob(first)).result, { ok: 1 });
  await client.complete(second, two.jobs[0]!.leaseToken);
});

test("a result over the payload limit fails its own job for good; the rest complete and the worker runs on", async () => {
  const queue = `oversize-${uid()}`;
  const n = 6;
  const ids: string[] = [];
  for (let i = 0; i < n; i++) ids.push(await client.enqueue("sized", i, { queue }));
  const big = ids[2]!;
  const carried413: string[] = [];
  const recording = new Client({
    baseUrl: server.url,
    fetch: async (input, init) => {
      const answer = await fetch(input, init);
      const path = new URL(String(input)).pathname;
      if (path === "/v1/claim" && String(init?.body ?? "").includes('"complete":[') && answer.status === 413) carried413.push(path);
      return answer;
    },
  });
  // Every handler returns at once when all have started, so the completions
  // travel together; the flush waits long enough for a claim to carry them.
  let release!: () => void;
  const gate = new Promise<void>((r) => (release = r));
  let started = 0;
  const w = startWorker(
    {
      queues: [queue],
      concurrency: n,
      waitMs: 200,
      completionDelayMs: 1_500,
      handlers: {
        sized: async (ctx) => {
          if (++started === n) release();
          await gate;
          return ctx.id === big ? "x".repeat(1024 * 1024 + 1024) : { i: ctx.payload as number };
        },
      },
    },
    recording,
  );
  const jobs = await Promise.all(ids.map((id) => terminal(id)));
  const report = await w.stop();
  jobs.forEach((job, i) => {
    if (job.id === big) {
      assert.equal(job.state, "dead");
      assert.equal(job.attemptsUsed, 1);
      assert.equal(job.result, null);
      assert.match(job.lastError ?? "", /the handler's result was refused/);
    } else {
      assert.equal(job.state, "completed");
      assert.deepEqual(job.result, { i });
      assert.equal(job.attempt, 1);
    }
  });
  assert.ok(carried413.length >= 1, "no claim carried the oversized result");
  assert.deepEqual(
    { completed: report.completed, failed: report.failed, lost: report.lost },
    { completed: n - 1, failed: 1, lost: 0 },
  );
});

test("worker calls with a stale lease token raise LeaseLostError", async () => {
  const queue = `stale-${uid()}`;
  const id = await client.enqueue("stale", null, { queue });
  await client.claim({ queues: [queue], worker: "w" });
  for (const call of [
    () => client.heartbeat(id, "stale-token"),
    () => client.complete(id, "stale-token", 1),
    () => client.fail(id, "stale-token", { error: "x" }),
    () => client.release(id, "stale-token"),
    () => client.putCheckpoint(id, "n", "stale-token", 1),
  ]) {
    const err = await call().catch((e: unknown) => e);
    assert.ok(err instanceof LeaseLostError, String(err));
    assert.equal(err.status, 409);
  }
});

test("a result JSON cannot carry fails its job for good; the others complete and run() ends", async () => {
  const queue = `notjson-${uid()}`;
  const big = await client.enqueue("odd", "bigint", { queue });
  const loop = await client.enqueue("odd", "cycle", { queue });
  const fine = await client.enqueue("odd", "fine", { queue });
  const w = startWorker({
    queues: [queue],
    concurrency: 3,
    handlers: {
      odd: (ctx) => {
        if (ctx.payload === "bigint") return { cents: 10n };
        if (ctx.payload === "cycle") {
          const o: Record<string, unknown> = { at: new Date(0) };
          o["self"] = o;
          return o;
        }
        return { at: new Date(0), gone: undefined };
      },
    },
  });
  const [b, l, f] = await Promise.all([terminal(big, 10_000), terminal(loop, 10_000), terminal(fine, 10_000)]);
  const report = await w.stop();
  for (const job of [b, l]) {
    assert.equal(job.state, "dead", `job ${job.id} is ${job.state}`);
    assert.equal(job.attemptsUsed, 1);
    assert.equal(job.result, null);
    assert.match(job.lastError ?? "", /the handler's result is not JSON: TypeError/);
  }
  assert.equal(f.state, "completed");
  assert.deepEqual(f.result, { at: "1970-01-01T00:00:00.000Z" });
  assert.deepEqual([report.completed, report.failed, report.lost], [1, 2, 0]);
});

test("a completion that cannot be sent for a local reason is answered, not tried for ever", async () => {
  const queue = `localfail-${uid()}`;
  const id = await client.enqueue("local", null, { queue });
  const refuse = () => Promise.reject(new TypeError("this completion cannot be sent"));
  // Every way a completion travels fails here, before anything is sent.
  class Unsendable extends Client {
    override claim(options: Parameters<Client["claim"]>[0] = {}) {
      return options.complete && options.complete.length > 0 ? refuse() : super.claim(options);
    }
    override completeMany() {
      return refuse();
    }
    override complete() {
      return refuse();
    }
  }
  let handled!: () => void;
  const ran = new Promise<void>((r) => (handled = r));
  const w = startWorker(
    {
      queues: [queue],
      handlers: {
        local: () => {
          handled();
          return "done";
        },
      },
    },
    new Unsendable({ baseUrl: server.url }),
  );
  await ran;
  // The completion's answer is the local error: it goes to onError once
  // (each way it travelled may report it), and run() ends.
  await waitFor("the completion's answer", async () =>
    w.errors.some((e) => e instanceof TypeError && /cannot be sent/.test(e.message)) ? true : undefined,
  );
  const stopped = await Promise.race([w.stop(), idle(10_000).then(() => "still running" as const)]);
  assert.notEqual(stopped, "still running", "run() did not end: the completion is tried for ever");
  if (stopped !== "still running") assert.deepEqual([stopped.completed, stopped.lost], [0, 0]);
  assert.equal((await client.getJob(id)).state, "active");
});

test("a claim asks for at most 1,000 jobs, whatever the concurrency", async () => {
  const queue = `wide-${uid()}`;
  const ids = [await client.enqueue("wide", 1, { queue }), await client.enqueue("wide", 2, { queue })];
  const limits: number[] = [];
  const recording = new Client({
    baseUrl: server.url,
    fetch: (input, init) => {
      if (new URL(String(input)).pathname === "/v1/claim") limits.push((JSON.parse(String(init?.body)) as { limit: number }).limit);
      return fetch(input, init);
    },
  });
  const w = startWorker({ queues: [queue], concurrency: 1_500, handlers: { wide: (ctx) => ctx.payload } }, recording);
  // run() rejecting (a claim refused with 422) fails the test at once.
  const jobs = await Promise.race([Promise.all(ids.map((id) => terminal(id))), w.running.then(() => [])]);
  const report = await w.stop();
  assert.deepEqual(
    jobs.map((j) => [j.state, j.result]),
    [
      ["completed", 1],
      ["completed", 2],
    ],
  );
  assert.equal(report.completed, 2);
  assert.ok(limits.length > 0 && limits.every((l) => l >= 1 && l <= 1_000), limits.join());
  assert.equal(limits[0], 1_000);
});

test("the worker's name is at most 128 bytes of UTF-8: a longer one is refused up front", async () => {
  const handlers = { named: () => "ok" };
  // 65 characters, 130 bytes: within 128 UTF-16 code units, over the API's 128 bytes.
  assert.throws(() => new Worker(client, { handlers, name: "é".repeat(65) }), (e: unknown) => {
    assert.ok(e instanceof RangeError, String(e));
    assert.match(e.message, /130 bytes of UTF-8: the API takes at most 128/);
    return true;
  });
  assert.throws(() => new Worker(client, { handlers, name: "x".repeat(129) }), RangeError);
  assert.ok(Buffer.byteLength(new Worker(client, { handlers }).name) <= 128);
  assert.match(new Worker(client, { handlers, name: "" }).name, /^ts-/);
  // Exactly 128 bytes is taken, and recorded as given.
  const name = "é".repeat(64);
  const queue = `named-${uid()}`;
  const id = await client.enqueue("named", null, { queue });
  const w = startWorker({ queues: [queue], name, handlers });
  assert.equal(w.worker.name, name);
  const job = await Promise.race([terminal(id), w.running.then(() => undefined)]);
  await w.stop();
  assert.equal(job?.state, "completed");
  assert.equal((await client.jobRuns(id))[0]!.worker, name);
});

/**
 * A fetch under which the first request carrying the completion of each of
 * `ids` (on a claim, in a batch or on its own) reaches the server and is
 * recorded there, but its answer is lost: the connection breaks.
 */
function lostAnswers(ids: string[]) {
  const dropped = new Set<string>();
  const f: typeof fetch = async (input, init) => {
    const path = new URL(String(input)).pathname;
    const body = String(init?.body ?? "");
    const carrying = path.endsWith("/complete") || (path === "/v1/claim" && body.includes('"complete":['));
    const hit = carrying
      ? ids.filter((id) => !dropped.has(id) && (path.includes(`/${encodeURIComponent(id)}/`) || body.includes(`"id":${JSON.stringify(id)}`)))
      : [];
    const res = await fetch(input, init);
    if (hit.length === 0) return res;
    await res.text();
    for (const id of hit) dropped.add(id);
    throw new TypeError("fetch failed", { cause: { code: "ECONNRESET" } });
  };
  return { fetch: f, dropped };
}

test("a completion recorded by a try whose answer was lost counts as completed, not lost", async () => {
  // The client's own retry (the default), and none (the worker tries again).
  for (const retry of [undefined, false as const]) {
    const queue = `lostanswer-${uid()}`;
    const plain = await client.enqueue("answer", "plain", { queue });
    // A job with a deadline sends its completion at once, on its own.
    const timed = await client.enqueue("answer", "timed", { queue, deadline: new Date(Date.now() + 120_000) });
    const lossy = lostAnswers([plain, timed]);
    const w = startWorker(
      { queues: [queue], concurrency: 2, handlers: { answer: (ctx) => ({ done: ctx.payload }) } },
      new Client({ baseUrl: server.url, fetch: lossy.fetch, retry }),
    );
    const jobs = await Promise.all([terminal(plain), terminal(timed)]);
    const report = await w.stop();
    assert.deepEqual(
      jobs.map((j) => [j.state, j.result, j.attempt]),
      [
        ["completed", { done: "plain" }, 1],
        ["completed", { done: "timed" }, 1],
      ],
    );
    assert.deepEqual([...lossy.dropped].sort(), [plain, timed].sort(), "an answer was not lost");
    assert.deepEqual([report.completed, report.lost, report.failed], [2, 0, 0], `retry ${String(retry)}`);
  }
});

/**
 * A fetch under which the first `POST /v1/jobs/{id}/<call>` reaches the
 * server and is recorded there, but its answer is lost: the connection
 * breaks. Records the status of every later answer to that call.
 */
function loseOneAnswer(id: string, call: "fail" | "release") {
  const path = `/v1/jobs/${encodeURIComponent(id)}/${call}`;
  const lost: string[] = [];
  const answers: number[] = [];
  const f: typeof fetch = async (input, init) => {
    const res = await fetch(input, init);
    if (new URL(String(input)).pathname !== path) return res;
    if (lost.length === 0) {
      await res.text();
      lost.push(path);
      throw new TypeError("fetch failed", { cause: { code: "ECONNRESET" } });
    }
    answers.push(res.status);
    return res;
  };
  return { fetch: f, path, lost, answers };
}

const lostAnswerCases: {
  name: string;
  state: string;
  run: [string, string | null];
  counted: "failed" | "released" | "cancelled";
}[] = [
  { name: "retry-after", state: "scheduled", run: ["failed", "later"], counted: "failed" },
  { name: "permanent", state: "dead", run: ["failed", "bad input"], counted: "failed" },
  // 10,000 bytes of UTF-8: the server keeps the first 8 KiB.
  { name: "long-error", state: "dead", run: ["failed", "\u00e9".repeat(4096)], counted: "failed" },
  { name: "snooze", state: "scheduled", run: ["snoozed", null], counted: "failed" },
  { name: "cancelled", state: "cancelled", run: ["cancelled", "cancelled while running"], counted: "cancelled" },
  { name: "release", state: "ready", run: ["released", null], counted: "released" },
];

for (const c of lostAnswerCases) {
  test(`a fail or release recorded by a try whose answer was lost counts as done, not lost (${c.name})`, async () => {
    const queue = `lostfail-${uid()}`;
    const id = await client.enqueue("w", c.name, { queue, maxAttempts: 3 });
    const lossy = loseOneAnswer(id, c.name === "release" ? "release" : "fail");
    let started!: () => void;
    const running = new Promise<void>((r) => (started = r));
    const w = startWorker(
      {
        queues: [queue],
        concurrency: 1,
        leaseMs: 3_000,
        shutdownGraceMs: 0,
        handlers: {
          w: (ctx) => {
            started();
            switch (c.name) {
              case "retry-after":
                throw JobError.retryAfter("later", 60_000);
              case "permanent":
                throw JobError.permanent("bad input");
              case "long-error":
                throw JobError.permanent("\u00e9".repeat(5000));
              case "snooze":
                throw JobError.snooze(60_000);
            }
            // Held until the shutdown releases it, or until a cancel ends it
            // (the handler throws its signal's reason: a failure).
            if (c.name === "release") return new Promise(() => {});
            return new Promise((_, reject) => ctx.signal.addEventListener("abort", () => reject(ctx.signal.reason)));
          },
        },
      },
      new Client({ baseUrl: server.url, fetch: lossy.fetch }),
    );
    await running;
    if (c.name === "cancelled") await client.cancel(id);
    if (c.name !== "release") {
      await waitFor("the repeated call's answer", async () => lossy.answers.length > 0);
    }
    const report = await w.stop();
    // The first try was recorded and its answer lost; the repeat found the lease spent.
    assert.deepEqual(lossy.lost, [lossy.path], c.name);
    assert.deepEqual(lossy.answers, [409], c.name);
    assert.equal((await client.getJob(id)).state, c.state, c.name);
    const runs = await client.jobRuns(id);
    assert.deepEqual(
      runs.map((r) => [r.attempt, r.outcome, r.error]),
      [[1, ...c.run]],
      c.name,
    );
    const expected = { completed: 0, failed: 0, cancelled: 0, released: 0, lost: 0 };
    expected[c.counted] = 1;
    assert.deepEqual(report, expected, c.name);
  });
}

test("a fail answered lease-lost after its lease expired is still counted lost", async () => {
  // The try went unanswered, but the server never saw it: the lease expired
  // meanwhile, and the repeat's lease-lost answer is a lost lease indeed.
  const queue = `expiredfail-${uid()}`;
  const id = await client.enqueue("w", null, { queue, maxAttempts: 3 });
  const failPath = `/v1/jobs/${encodeURIComponent(id)}/fail`;
  let holding = false;
  const answers: number[] = [];
  const expired = async () => {
    const job = await client.getJob(id);
    return job.attempt > 1 || job.state !== "active";
  };
  const held: typeof fetch = async (input, init) => {
    const path = new URL(String(input)).pathname;
    if (path === failPath && !holding) {
      holding = true;
      await waitFor("the lease's expiry", expired);
      throw new TypeError("fetch failed", { cause: { code: "ECONNRESET" } });
    }
    if (holding && path === `/v1/jobs/${encodeURIComponent(id)}/heartbeat`) {
      // The connection is down for this attempt's heartbeats too.
      throw new TypeError("fetch failed", { cause: { code: "ECONNREFUSED" } });
    }
    const res = await fetch(input, init);
    if (path === failPath) answers.push(res.status);
    return res;
  };
  const w = startWorker(
    {
      queues: [queue],
      concurrency: 2,
      leaseMs: 600,
      handlers: {
        w: (ctx) => {
          if (ctx.attempt === 1) throw JobError.permanent("bad input");
          return "second";
        },
      },
    },
    new Client({ baseUrl: server.url, fetch: held }),
  );
  const job = await terminal(id);
  await waitFor("the first attempt's count", async () => answers.length > 0);
  const report = await w.stop();
  assert.deepEqual([job.state, job.result], ["completed", "second"]);
  assert.deepEqual(answers, [409]);
  const runs = await client.jobRuns(id);
  assert.deepEqual(
    runs.map((r) => [r.attempt, r.outcome]),
    [
      [1, "lease_expired"],
      [2, "completed"],
    ],
  );
  assert.deepEqual([report.completed, report.lost, report.failed], [1, 1, 0]);
});

test("after a cancel the handler gets cancelGraceMs to return: a result completes the job", async () => {
  assert.throws(() => new Worker(client, { handlers: { x: () => 1 }, cancelGraceMs: -1 }), RangeError);
  assert.throws(() => new Worker(client, { handlers: { x: () => 1 }, cancelGraceMs: Number.NaN }), RangeError);
  const queue = `grace-${uid()}`;
  const tidy = await client.enqueue("tidy", null, { queue });
  const stubborn = await client.enqueue("stubborn", null, { queue });
  const aborted = new Map<string, number>();
  const fails = new Map<string, number>();
  const recording = new Client({
    baseUrl: server.url,
    fetch: (input, init) => {
      const path = new URL(String(input)).pathname;
      if (path.endsWith("/fail")) fails.set(decodeURIComponent(path.split("/").at(-2)!), Date.now());
      return fetch(input, init);
    },
  });
  let started = 0;
  let bothStarted!: () => void;
  const ready = new Promise<void>((r) => (bothStarted = r));
  const grace = 400;
  const w = startWorker(
    {
      queues: [queue],
      concurrency: 2,
      leaseMs: 1_500,
      cancelGraceMs: grace,
      handlers: {
        // Cleans up on the cancel (a round trip to the server), then returns.
        tidy: (ctx) =>
          new Promise((resolve, reject) => {
            if (++started === 2) bothStarted();
            ctx.signal.addEventListener("abort", () => {
              aborted.set(ctx.id, Date.now());
              client.getJob(ctx.id).then(() => resolve("cleaned up"), reject);
            });
          }),
        // Ignores its signal.
        stubborn: async (ctx) => {
          if (++started === 2) bothStarted();
          ctx.signal.addEventListener("abort", () => aborted.set(ctx.id, Date.now()));
          await idle(30_000);
          return "too late";
        },
      },
    },
    recording,
  );
  await ready;
  assert.deepEqual(await client.cancel(tidy), { cancelled: true, state: "active" });
  assert.deepEqual(await client.cancel(stubborn), { cancelled: true, state: "active" });
  const [t, s] = await Promise.all([terminal(tidy, 10_000), terminal(stubborn, 10_000)]);
  const report = await w.stop();
  assert.deepEqual([t.state, t.result], ["completed", "cleaned up"]);
  assert.equal(s.state, "cancelled");
  assert.ok(aborted.has(tidy) && aborted.has(stubborn));
  assert.ok(!fails.has(tidy), "the job whose handler returned was failed");
  const waited = fails.get(stubborn)! - aborted.get(stubborn)!;
  assert.ok(waited >= grace - 5, `failed ${waited} ms after the cancel, within the grace`);
  assert.deepEqual([report.completed, report.cancelled, report.failed, report.lost], [1, 1, 0, 0]);
});
