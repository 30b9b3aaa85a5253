/**
 * Public types, in camelCase, and their conversion to and from the wire's
 * snake_case names (docs/http-api.md). Only the names listed here are ever
 * sent; a payload, a result or a checkpoint value is passed through as is.
 */

/** Any JSON value. */
export type Json = null | boolean | number | string | Json[] | { [key: string]: Json };

/** An instant: a `Date` or an RFC 3339 string. */
export type Instant = Date | string;

/** The backoff between failed attempts. */
export type RetryPolicy =
  | { kind: "exponential"; initialMs?: number; factor?: number; maxMs?: number; jitter?: boolean }
  | { kind: "fixed"; delayMs: number }
  | { kind: "none" };

/** Idempotent acceptance: `(scope, key)` is bound to the job it returned for `ttlMs`. */
export interface IdempotencyOptions {
  /** The caller's stable id of the operation (1–255 bytes). Never logged, never in an error. */
  key: string;
  /** Namespace of keys (`default`). */
  scope?: string;
  /** Retention window in ms, 1 s – 30 d (24 h). */
  ttlMs?: number;
  /** Send the key as the `Idempotency-Key` header instead of in the body (`"body"`). */
  sendAs?: "body" | "header";
}

/** A dedupe (rate policy) key and its mode. A bare string is pending mode. */
export type DedupeOptions =
  | string
  | { key: string; ttlMs?: number; extend?: boolean; replace?: boolean; maxWaitMs?: number };

/** Every option of an enqueue besides `type` and `payload`. */
export interface EnqueueOptions {
  queue?: string;
  jobId?: string;
  priority?: number;
  runAt?: Instant;
  delayMs?: number;
  maxAttempts?: number;
  retry?: RetryPolicy;
  timeoutMs?: number;
  deadline?: Instant;
  concurrencyKey?: string;
  tags?: string[];
  keepMs?: number;
  idempotency?: IdempotencyOptions;
  dedupe?: DedupeOptions;
}

/** Per-call options of every client method. */
export interface CallOptions {
  /** Aborts the call (and its retries). */
  signal?: AbortSignal;
  /** Overrides the client's per-attempt HTTP timeout, in ms. */
  requestTimeoutMs?: number;
}

/** One item of a batch enqueue. */
export interface EnqueueItem extends EnqueueOptions {
  type: string;
  payload?: unknown;
}

export type Outcome = "accepted" | "replayed" | "coalesced" | "replaced" | "non_replaceable";
export type NonReplaceableReason = "incompatible_mode" | "not_pending" | "window_elapsed";

/** What an enqueue did. `reason` exists exactly when `outcome` is `non_replaceable`. */
export type EnqueueResult =
  | { jobId: string; outcome: "accepted" | "replayed" | "coalesced" | "replaced" }
  | { jobId: string; outcome: "non_replaceable"; reason: NonReplaceableReason };

export type JobState = "scheduled" | "ready" | "active" | "completed" | "dead" | "cancelled";

export interface JobIdempotency {
  scope: string;
  keyPreview: string;
  keyDigest: string;
  expiresAt: string | null;
}

export interface JobDedupe {
  key: string;
  mode: string;
  windowUntil: string | null;
  holdsBinding: boolean;
}

/** A job record. Instants are RFC 3339 strings in UTC. */
export interface Job {
  id: string;
  type: string;
  queue: string;
  state: JobState;
  payload: unknown;
  result: unknown;
  priority: number;
  attempt: number;
  attemptsUsed: number;
  maxAttempts: number;
  runAt: string;
  createdAt: string;
  updatedAt: string;
  finishedAt: string | null;
  timeoutMs: number;
  deadline: string | null;
  concurrencyKey: string | null;
  tags: string[];
  lastError: string | null;
  cancelRequested: boolean;
  keepMs: number | null;
  leaseExpiresAt: string | null;
  retry: RetryPolicy | null;
  idempotency: JobIdempotency | null;
  dedupe: JobDedupe | null;
}

export interface JobPage {
  jobs: Job[];
  nextCursor: string | null;
}

export interface JobFilter {
  state?: JobState;
  queue?: string;
  type?: string;
  tag?: string;
}

export interface ListJobsOptions extends JobFilter, CallOptions {
  limit?: number;
  cursor?: string;
}

export interface JobEvent {
  seq: number;
  kind: string;
  at: string;
  data: unknown;
}

export interface JobRun {
  attempt: number;
  worker: string;
  startedAt: string;
  finishedAt: string | null;
  outcome: string | null;
  error: string | null;
}

export interface Explanation {
  /** As enqueue's outcome, or `conflict`. */
  outcome: Outcome | "conflict";
  reason?: NonReplaceableReason;
  jobId: string | null;
  conflict: { jobId: string; fields: string[] } | null;
  idempotency: { jobId: string; expiresAt: string } | null;
  dedupe: { jobId: string; mode: string; windowUntil: string | null } | null;
}

export interface RedriveOptions extends CallOptions {
  /** Makes the redrive idempotent (scope `idemq.redrive`, 24 h); sent as the `Idempotency-Key` header. */
  idempotencyKey?: string;
  maxAttempts?: number;
  deadline?: Instant;
  runAt?: Instant;
  resetCheckpoints?: boolean;
}

export interface BulkFilter extends JobFilter {
  /** Only jobs created strictly before this instant. */
  before?: Instant;
}

export interface QueueInfo {
  name: string;
  paused: boolean;
  counts: Record<JobState, number>;
}

export interface DedupeBinding {
  jobId: string;
  mode: string;
  windowUntil: string | null;
}

export interface IdempotencyBinding {
  jobId: string;
  keyPreview: string;
  keyDigest: string;
  expiresAt: string;
}

export interface ScheduleDefinition {
  /** Six fields, seconds first, e.g. `0 0 3 * * *` (03:00 every day). */
  cron?: string;
  /** IANA zone of the cron expression (`UTC`). */
  timezone?: string;
  /** An interval ≥ 1000 ms. */
  everyMs?: number;
  paused?: boolean;
  /** The job template (no idempotency key, job id, run_at or deadline). */
  job: EnqueueItem;
}

export interface Schedule {
  name: string;
  cron: string | null;
  everyMs: number | null;
  timezone: string;
  job: Record<string, unknown>;
  nextFireAt: string | null;
  lastFiredAt: string | null;
  paused: boolean;
  createdAt: string;
  updatedAt: string;
}

/** `relaxed`: the store runs without its durability settings checked; acknowledged jobs may be lost. */
export type Durability = "full" | "relaxed";

export interface Health {
  ok: boolean;
  backend: string;
  /**
   * `full`, or `relaxed` on a Redis store opened with `?durability=relaxed`.
   * Absent (`undefined`) when the server is too old to say.
   */
  durability?: Durability;
}

/** A job handed to a worker by a claim. */
export interface ClaimedJob {
  id: string;
  type: string;
  queue: string;
  payload: unknown;
  attempt: number;
  maxAttempts: number;
  leaseToken: string;
  leaseExpiresAt: string;
  timeoutMs: number;
  deadline: string | null;
  tags: string[];
}

/** One completion of a batch. */
export interface Completion {
  id: string;
  leaseToken: string;
  result?: unknown;
}

/** The per-item answer of a batch completion. */
export type CompletionResult = { ok: true; state: string } | { ok: false; error: import("./errors.js").ApiError };

export interface ClaimOptions extends CallOptions {
  queues?: string[];
  worker?: string;
  limit?: number;
  leaseMs?: number;
  types?: string[];
  waitMs?: number;
  /** Completions recorded first, in the same round trip. */
  complete?: Completion[];
}

export interface ClaimResult {
  jobs: ClaimedJob[];
  /** The per-item results of `complete`, in its order (absent when none were sent). */
  completed?: CompletionResult[];
}

export interface FailOptions extends CallOptions {
  error?: string;
  /** `false`: a permanent failure, the job goes dead at once (`true`). */
  retryable?: boolean;
  retryAfterMs?: number;
  snoozeMs?: number;
}

export interface FailResult {
  state: string;
  nextRunAt: string | null;
}

export interface HeartbeatResult {
  leaseExpiresAt: string;
  cancelRequested: boolean;
}

// ---------------------------------------------------------------- wire forms

type Wire = Record<string, unknown>;

function instant(v: Instant | undefined): string | undefined {
  if (v === undefined || v === null) return undefined;
  return v instanceof Date ? v.toISOString() : String(v);
}

/** Drops members whose value is `undefined`. */
function compact(o: Wire): Wire {
  const out: Wire = {};
  for (const [k, v] of Object.entries(o)) if (v !== undefined) out[k] = v;
  return out;
}

export function retryToWire(r: RetryPolicy | undefined): Wire | undefined {
  if (!r) return undefined;
  switch (r.kind) {
    case "exponential":
      return compact({ kind: "exponential", initial_ms: r.initialMs, factor: r.factor, max_ms: r.maxMs, jitter: r.jitter });
    case "fixed":
      return { kind: "fixed", delay_ms: r.delayMs };
    case "none":
      return { kind: "none" };
    default:
      throw new TypeError(`unknown retry kind ${(r as { kind: unknown }).kind}`);
  }
}

function retryFromWire(w: unknown): RetryPolicy | null {
  if (!w || typeof w !== "object") return null;
  const r = w as Wire;
  switch (r["kind"]) {
    case "fixed":
      return { kind: "fixed", delayMs: r["delay_ms"] as number };
    case "none":
      return { kind: "none" };
    case "exponential":
      return compact({
        kind: "exponential",
        initialMs: r["initial_ms"],
        factor: r["factor"],
        maxMs: r["max_ms"],
        jitter: r["jitter"],
      }) as RetryPolicy;
    default:
      return null;
  }
}

function dedupeToWire(d: DedupeOptions | undefined): unknown {
  if (d === undefined || d === null) return undefined;
  if (typeof d === "string") return d;
  return compact({ key: d.key, ttl_ms: d.ttlMs, extend: d.extend, replace: d.replace, max_wait_ms: d.maxWaitMs });
}

/**
 * The wire body of one enqueue request, and the idempotency key when it goes
 * in the `Idempotency-Key` header instead.
 */
export function enqueueToWire(
  type: string,
  payload: unknown,
  o: EnqueueOptions = {},
): { body: Wire; headerKey: string | undefined } {
  let idempotency: Wire | undefined;
  let headerKey: string | undefined;
  if (o.idempotency) {
    const { key, scope, ttlMs, sendAs } = o.idempotency;
    if (sendAs === "header") {
      headerKey = key;
      if (scope != null || ttlMs != null) idempotency = compact({ scope, ttl_ms: ttlMs });
    } else {
      idempotency = compact({ key, scope, ttl_ms: ttlMs });
    }
  }
  const body = compact({
    type,
    payload,
    queue: o.queue,
    job_id: o.jobId,
    priority: o.priority,
    run_at: instant(o.runAt),
    delay_ms: o.delayMs,
    max_attempts: o.maxAttempts,
    retry: retryToWire(o.retry),
    timeout_ms: o.timeoutMs,
    deadline: instant(o.deadline),
    concurrency_key: o.concurrencyKey,
    tags: o.tags,
    keep_ms: o.keepMs,
    idempotency,
    dedupe: dedupeToWire(o.dedupe),
  });
  return { body, headerKey };
}

export function enqueueResultFromWire(w: Wire): EnqueueResult {
  const jobId = String(w["job_id"]);
  const outcome = w["outcome"] as Outcome;
  if (outcome === "non_replaceable") {
    return { jobId, outcome, reason: w["reason"] as NonReplaceableReason };
  }
  return { jobId, outcome };
}

const nul = <T>(v: unknown): T | null => (v === undefined ? null : (v as T | null));

export function jobFromWire(w: Wire): Job {
  const idem = w["idempotency"] as Wire | null | undefined;
  const dd = w["dedupe"] as Wire | null | undefined;
  return {
    id: w["id"] as string,
    type: w["type"] as string,
    queue: w["queue"] as string,
    state: w["state"] as JobState,
    payload: w["payload"] ?? null,
    result: w["result"] ?? null,
    priority: (w["priority"] as number) ?? 0,
    attempt: w["attempt"] as number,
    attemptsUsed: w["attempts_used"] as number,
    maxAttempts: w["max_attempts"] as number,
    runAt: w["run_at"] as string,
    createdAt: w["created_at"] as string,
    updatedAt: w["updated_at"] as string,
    finishedAt: nul(w["finished_at"]),
    timeoutMs: w["timeout_ms"] as number,
    deadline: nul(w["deadline"]),
    concurrencyKey: nul(w["concurrency_key"]),
    tags: (w["tags"] as string[]) ?? [],
    lastError: nul(w["last_error"]),
    cancelRequested: Boolean(w["cancel_requested"]),
    keepMs: nul(w["keep_ms"]),
    leaseExpiresAt: nul(w["lease_expires_at"]),
    retry: retryFromWire(w["retry"]),
    idempotency: idem
      ? {
          scope: idem["scope"] as string,
          keyPreview: idem["key_preview"] as string,
          keyDigest: idem["key_digest"] as string,
          expiresAt: nul(idem["expires_at"]),
        }
      : null,
    dedupe: dd
      ? {
          key: dd["key"] as string,
          mode: dd["mode"] as string,
          windowUntil: nul(dd["window_until"]),
          holdsBinding: Boolean(dd["holds_binding"]),
        }
      : null,
  };
}

export function runFromWire(w: Wire): JobRun {
  return {
    attempt: w["attempt"] as number,
    worker: w["worker"] as string,
    startedAt: w["started_at"] as string,
    finishedAt: nul(w["finished_at"]),
    outcome: nul(w["outcome"]),
    error: nul(w["error"]),
  };
}

export function explainFromWire(w: Wire): Explanation {
  const c = w["conflict"] as Wire | null | undefined;
  const i = w["idempotency"] as Wire | null | undefined;
  const d = w["dedupe"] as Wire | null | undefined;
  const out: Explanation = {
    outcome: w["outcome"] as Explanation["outcome"],
    jobId: nul(w["job_id"]),
    conflict: c ? { jobId: c["job_id"] as string, fields: (c["fields"] as string[]) ?? [] } : null,
    idempotency: i ? { jobId: i["job_id"] as string, expiresAt: i["expires_at"] as string } : null,
    dedupe: d ? { jobId: d["job_id"] as string, mode: d["mode"] as string, windowUntil: nul(d["window_until"]) } : null,
  };
  if (typeof w["reason"] === "string") out.reason = w["reason"] as NonReplaceableReason;
  return out;
}

export function scheduleFromWire(w: Wire): Schedule {
  return {
    name: w["name"] as string,
    cron: nul(w["cron"]),
    everyMs: nul(w["every_ms"]),
    timezone: w["timezone"] as string,
    job: (w["job"] as Record<string, unknown>) ?? {},
    nextFireAt: nul(w["next_fire_at"]),
    lastFiredAt: nul(w["last_fired_at"]),
    paused: Boolean(w["paused"]),
    createdAt: w["created_at"] as string,
    updatedAt: w["updated_at"] as string,
  };
}

export function healthFromWire(w: Wire): Health {
  const h: Health = { ok: Boolean(w["ok"]), backend: w["backend"] as string };
  if (typeof w["durability"] === "string") h.durability = w["durability"] as Durability;
  return h;
}

export function claimedJobFromWire(w: Wire): ClaimedJob {
  return {
    id: w["id"] as string,
    type: w["type"] as string,
    queue: w["queue"] as string,
    payload: w["payload"] ?? null,
    attempt: w["attempt"] as number,
    maxAttempts: w["max_attempts"] as number,
    leaseToken: w["lease_token"] as string,
    leaseExpiresAt: w["lease_expires_at"] as string,
    timeoutMs: w["timeout_ms"] as number,
    deadline: nul(w["deadline"]),
    tags: (w["tags"] as string[]) ?? [],
  };
}

export function completionToWire(c: Completion): Wire {
  return compact({ id: c.id, lease_token: c.leaseToken, result: c.result });
}

export { compact, instant };
