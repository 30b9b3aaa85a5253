import { inspect } from "node:util";
import {
  ApiError,
  ConnectionError,
  IdemqError,
  NotFoundError,
  TimeoutError,
  UnavailableError,
  errorFromProblem,
  isRetryable,
  scrub,
} from "./errors.js";
import {
  type BulkFilter,
  type CallOptions,
  type ClaimOptions,
  type ClaimResult,
  type Completion,
  type CompletionResult,
  type DedupeBinding,
  type EnqueueItem,
  type EnqueueOptions,
  type EnqueueResult,
  type Explanation,
  type FailOptions,
  type FailResult,
  type Health,
  type HeartbeatResult,
  type IdempotencyBinding,
  type Job,
  type JobEvent,
  type JobFilter,
  type JobPage,
  type JobRun,
  type ListJobsOptions,
  type QueueInfo,
  type RedriveOptions,
  type Schedule,
  type ScheduleDefinition,
  claimedJobFromWire,
  compact,
  completionToWire,
  enqueueResultFromWire,
  enqueueToWire,
  explainFromWire,
  healthFromWire,
  instant,
  jobFromWire,
  runFromWire,
  scheduleFromWire,
} from "./types.js";

/** When and how often a failed call is tried again. */
export interface RetryOptions {
  /** Tries in all, the first included (4). `1` turns retries off. */
  maxAttempts?: number;
  /** The first backoff ceiling in ms (100); it doubles per retry, with full jitter. */
  initialDelayMs?: number;
  /** The largest backoff ceiling in ms (5,000). */
  maxDelayMs?: number;
  /** A `Retry-After` longer than this (60,000 ms) is not waited for: the error is raised. */
  maxRetryAfterMs?: number;
}

export interface ClientOptions {
  /** The server, e.g. `http://127.0.0.1:8080`. */
  baseUrl: string;
  /** The server's token (`IDEMQ_TOKEN`), sent as `Authorization: Bearer …`. */
  token?: string;
  /** Per-attempt timeout in ms (30,000); a long-poll adds its `waitMs`. */
  timeoutMs?: number;
  /** Retries of safe calls on connection errors and 503 (`false`: never). */
  retry?: RetryOptions | false;
  /** Extra headers sent with every request. */
  headers?: Record<string, string>;
  /** A `fetch` implementation (the global one by default). */
  fetch?: typeof fetch;
}

/** Options of the low-level {@link Client.request}. */
export interface RequestOptions extends CallOptions, Retrying {
  body?: unknown;
  query?: Record<string, string | number | boolean | undefined | null>;
  headers?: Record<string, string>;
  /** The call may be repeated without changing its effect: retry it on connection errors and 503. */
  idempotent?: boolean;
  /** Extra time in ms the server may hold the request (long-polls). */
  waitMs?: number;
  /** Raw keys carried by the request: blanked from any error. */
  secrets?: string[];
}

type Wire = Record<string, unknown>;

/**
 * Internal (not exported by the package): a call's options may carry a
 * function under this key, called with the error of a try before the call is
 * tried again. The worker uses it to know that a completion, failure or
 * release it sent may have been recorded by a try whose answer never came.
 */
export const RETRYING: unique symbol = Symbol("idemq.retrying");
export interface Retrying {
  [RETRYING]?: (error: unknown) => void;
}

const DEFAULT_RETRY: Required<RetryOptions> = {
  maxAttempts: 4,
  initialDelayMs: 100,
  maxDelayMs: 5_000,
  maxRetryAfterMs: 60_000,
};

function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) return reject(signal.reason);
    const t = setTimeout(() => {
      signal?.removeEventListener("abort", onAbort);
      resolve();
    }, ms);
    const onAbort = () => {
      clearTimeout(t);
      reject(signal!.reason);
    };
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}

/** The `Idempotency-Key` header value: a structured-field string. */
export function idempotencyHeader(key: string): string {
  if (!/^[\x20-\x7e]*$/.test(key)) {
    throw new TypeError("an Idempotency-Key header carries printable ASCII only: send this key in the body instead");
  }
  return `"${key.replace(/[\\"]/g, (c) => `\\${c}`)}"`;
}

/**
 * One path segment, percent-encoded. A segment that is "." or ".." (a valid
 * job id) cannot be sent by `fetch`: its URL parser drops dot segments,
 * encoded (`%2E`) or not, so the request would reach another path. It is
 * refused before anything is sent; such a job is reachable with the Go or
 * Python client, or `curl --path-as-is`.
 */
const seg = (s: string) => {
  if (s === "." || s === "..") {
    throw new TypeError(
      `the path segment "${s}" cannot be sent by fetch (URLs drop dot segments): reach this job with the Go or Python client, or curl --path-as-is`,
    );
  }
  return encodeURIComponent(s);
};

/**
 * The idemq HTTP API v1. Every method returns a promise and raises an
 * {@link IdemqError} subclass on failure.
 */
export class Client {
  readonly baseUrl: string;
  readonly timeoutMs: number;
  readonly #token: string | undefined;
  readonly #retry: Required<RetryOptions>;
  readonly #headers: Record<string, string>;
  readonly #fetch: typeof fetch;

  constructor(options: ClientOptions) {
    if (!options || typeof options.baseUrl !== "string" || options.baseUrl === "") {
      throw new TypeError("new Client({ baseUrl }) needs the server's URL, e.g. http://127.0.0.1:8080");
    }
    this.baseUrl = options.baseUrl.replace(/\/+$/, "");
    this.timeoutMs = options.timeoutMs ?? 30_000;
    this.#token = options.token;
    this.#retry =
      options.retry === false ? { ...DEFAULT_RETRY, maxAttempts: 1 } : { ...DEFAULT_RETRY, ...(options.retry ?? {}) };
    this.#headers = { ...(options.headers ?? {}) };
    this.#fetch = options.fetch ?? globalThis.fetch;
  }

  [inspect.custom](): string {
    return `Client { baseUrl: ${JSON.stringify(this.baseUrl)}, token: ${this.#token ? "[set]" : "none"} }`;
  }

  toJSON(): Record<string, unknown> {
    return { baseUrl: this.baseUrl, token: this.#token ? "[set]" : null };
  }

  // ------------------------------------------------------------ transport

  /**
   * One API call. Answers with the decoded JSON body (or `null` for an empty
   * one); raises the typed error of a problem answer.
   */
  async request<T = unknown>(method: string, path: string, options: RequestOptions = {}): Promise<T> {
    const { idempotent = false, signal } = options;
    const max = idempotent ? Math.max(1, this.#retry.maxAttempts) : 1;
    for (let attempt = 1; ; attempt++) {
      try {
        return (await this.#once(method, path, options)) as T;
      } catch (err) {
        if (!isRetryable(err) || attempt >= max || signal?.aborted) throw err;
        const retryAfter = err instanceof UnavailableError ? err.retryAfterMs : undefined;
        if (retryAfter !== undefined && retryAfter > this.#retry.maxRetryAfterMs) throw err;
        options[RETRYING]?.(err);
        const ceiling = Math.min(this.#retry.maxDelayMs, this.#retry.initialDelayMs * 2 ** (attempt - 1));
        const jittered = Math.random() * ceiling;
        await sleep(retryAfter !== undefined ? retryAfter + jittered / 10 : jittered, signal);
      }
    }
  }

  async #once(method: string, path: string, options: RequestOptions): Promise<unknown> {
    const url = new URL(this.baseUrl + path);
    for (const [k, v] of Object.entries(options.query ?? {})) {
      if (v !== undefined && v !== null) url.searchParams.set(k, String(v));
    }
    const headers: Record<string, string> = { accept: "application/json, application/problem+json", ...this.#headers };
    if (this.#token) headers["authorization"] = `Bearer ${this.#token}`;
    let body: string | undefined;
    if (options.body !== undefined) {
      headers["content-type"] = "application/json";
      body = JSON.stringify(options.body);
    }
    Object.assign(headers, options.headers ?? {});
    const timeoutMs = (options.requestTimeoutMs ?? this.timeoutMs) + (options.waitMs ?? 0);
    const controller = new AbortController();
    let timedOut = false;
    const timer = setTimeout(() => {
      timedOut = true;
      controller.abort();
    }, timeoutMs);
    const outer = options.signal;
    const onAbort = () => controller.abort(outer!.reason);
    if (outer) {
      if (outer.aborted) {
        clearTimeout(timer);
        throw outer.reason;
      }
      outer.addEventListener("abort", onAbort, { once: true });
    }
    const secrets = options.secrets ?? [];
    try {
      let res: Response;
      let text: string;
      try {
        res = await this.#fetch(url, { method, headers, body, signal: controller.signal });
        text = await res.text();
      } catch (err) {
        if (outer?.aborted) throw outer.reason;
        if (timedOut) throw new TimeoutError(method, path, timeoutMs);
        const cause = err as { cause?: { code?: string; message?: string }; message?: string };
        const why = cause?.cause?.code ?? cause?.cause?.message ?? cause?.message ?? String(err);
        throw new ConnectionError(`${method} ${path}: cannot reach ${this.baseUrl} (${scrub(String(why), secrets)})`, method, path, {
          cause: scrub(String(why), secrets),
        });
      }
      let parsed: unknown = null;
      if (text.length > 0) {
        try {
          parsed = JSON.parse(text);
        } catch {
          parsed = res.ok ? undefined : text;
        }
      }
      if (!res.ok) throw errorFromProblem(parsed, res.status, secrets, res.headers);
      if (parsed === undefined) {
        throw new IdemqError(`${method} ${path}: the server answered ${res.status} with a body that is not JSON`);
      }
      return parsed;
    } finally {
      clearTimeout(timer);
      outer?.removeEventListener("abort", onAbort);
    }
  }

  // ------------------------------------------------------------ enqueue

  /** Enqueues a job and returns its id (the original job's id for a replay). */
  async enqueue(type: string, payload?: unknown, options?: EnqueueOptions & CallOptions): Promise<string> {
    return (await this.enqueueWithResult(type, payload, options)).jobId;
  }

  /** Enqueues a job and says what happened: `accepted`, `replayed`, `coalesced`, `replaced` or `non_replaceable`. */
  async enqueueWithResult(
    type: string,
    payload?: unknown,
    options: EnqueueOptions & CallOptions = {},
  ): Promise<EnqueueResult> {
    const { body, headerKey } = enqueueToWire(type, payload, options);
    const w = await this.request<Wire>("POST", "/v1/jobs", {
      body,
      headers: headerKey !== undefined ? { "idempotency-key": idempotencyHeader(headerKey) } : undefined,
      // A null option is the same as an absent one (the API reads null so).
      idempotent: options.idempotency != null || options.jobId != null,
      secrets: options.idempotency ? [options.idempotency.key] : [],
      signal: options.signal,
      requestTimeoutMs: options.requestTimeoutMs,
    });
    return enqueueResultFromWire(w);
  }

  /**
   * Enqueues many jobs in one round trip (at most 1,000). Each item gets its
   * own result, in request order; with `atomic: true` any failing item fails
   * the whole batch (the error's `index` names it) and nothing is written.
   */
  async enqueueMany(
    items: EnqueueItem[],
    options: { atomic?: boolean } & CallOptions = {},
  ): Promise<Array<{ ok: true; result: EnqueueResult } | { ok: false; error: ApiError }>> {
    const secrets: string[] = [];
    let keyed = items.length > 0;
    const jobs = items.map((item) => {
      const { type, payload, ...opts } = item;
      if (opts.idempotency?.sendAs === "header") {
        throw new TypeError("a batch item carries its idempotency key in the body: drop sendAs: \"header\"");
      }
      if (opts.idempotency) secrets.push(opts.idempotency.key);
      if (opts.idempotency == null && opts.jobId == null) keyed = false;
      return enqueueToWire(type, payload, opts).body;
    });
    const w = await this.request<{ results: Wire[] }>("POST", "/v1/jobs/batch", {
      body: compact({ jobs, atomic: options.atomic }),
      idempotent: keyed,
      secrets,
      signal: options.signal,
      requestTimeoutMs: options.requestTimeoutMs,
    });
    return w.results.map((r) =>
      r["error"] !== undefined
        ? { ok: false as const, error: errorFromProblem(r["error"], statusOf(r["error"]), secrets) }
        : { ok: true as const, result: enqueueResultFromWire(r) },
    );
  }

  /** What an enqueue would do now, and why. Writes nothing. */
  async explain(type: string, payload?: unknown, options: EnqueueOptions & CallOptions = {}): Promise<Explanation> {
    const { body, headerKey } = enqueueToWire(type, payload, options);
    const w = await this.request<Wire>("POST", "/v1/jobs/explain", {
      body,
      headers: headerKey !== undefined ? { "idempotency-key": idempotencyHeader(headerKey) } : undefined,
      idempotent: true,
      secrets: options.idempotency ? [options.idempotency.key] : [],
      signal: options.signal,
      requestTimeoutMs: options.requestTimeoutMs,
    });
    return explainFromWire(w);
  }

  // ------------------------------------------------------------ jobs

  /** A job. With `waitMs` (≤ 60,000) the server holds the call until the job is terminal. */
  async getJob(id: string, options: { waitMs?: number } & CallOptions = {}): Promise<Job> {
    const w = await this.request<Wire>("GET", `/v1/jobs/${seg(id)}`, {
      query: { wait_ms: options.waitMs },
      waitMs: options.waitMs,
      idempotent: true,
      signal: options.signal,
      requestTimeoutMs: options.requestTimeoutMs,
    });
    return jobFromWire(w);
  }

  /** Waits (in long-polls of at most 60 s) until the job is terminal, or `timeoutMs` passed; returns it. */
  async waitForJob(id: string, options: { timeoutMs?: number; signal?: AbortSignal } = {}): Promise<Job> {
    const until = Date.now() + (options.timeoutMs ?? 60_000);
    for (;;) {
      const left = Math.max(0, until - Date.now());
      const job = await this.getJob(id, { waitMs: Math.min(60_000, left), signal: options.signal });
      if (["completed", "dead", "cancelled"].includes(job.state) || left === 0) return job;
    }
  }

  /** One page of jobs, newest first. */
  async listJobs(options: ListJobsOptions = {}): Promise<JobPage> {
    const w = await this.request<{ jobs: Wire[]; next_cursor?: string | null }>("GET", "/v1/jobs", {
      query: {
        state: options.state,
        queue: options.queue,
        type: options.type,
        tag: options.tag,
        limit: options.limit,
        cursor: options.cursor,
      },
      idempotent: true,
      signal: options.signal,
      requestTimeoutMs: options.requestTimeoutMs,
    });
    return { jobs: w.jobs.map(jobFromWire), nextCursor: w.next_cursor ?? null };
  }

  /** Every matching job, page after page. */
  async *iterateJobs(options: Omit<ListJobsOptions, "cursor"> = {}): AsyncGenerator<Job> {
    let cursor: string | undefined;
    do {
      const page = await this.listJobs({ ...options, cursor });
      yield* page.jobs;
      cursor = page.nextCursor ?? undefined;
    } while (cursor);
  }

  /** A job's events, oldest first. */
  async jobEvents(id: string, options: CallOptions = {}): Promise<JobEvent[]> {
    const w = await this.request<{ events: JobEvent[] }>("GET", `/v1/jobs/${seg(id)}/events`, {
      idempotent: true,
      ...options,
    });
    return w.events;
  }

  /** A job's run ledger: one entry per attempt. */
  async jobRuns(id: string, options: CallOptions = {}): Promise<JobRun[]> {
    const w = await this.request<{ runs: Wire[] }>("GET", `/v1/jobs/${seg(id)}/runs`, { idempotent: true, ...options });
    return w.runs.map(runFromWire);
  }

  /** A job's stored checkpoints by step name. */
  async jobCheckpoints(id: string, options: CallOptions = {}): Promise<Record<string, unknown>> {
    const w = await this.request<{ checkpoints: Record<string, unknown> }>("GET", `/v1/jobs/${seg(id)}/checkpoints`, {
      idempotent: true,
      ...options,
    });
    return w.checkpoints ?? {};
  }

  // ------------------------------------------------------------ operator actions

  /** Cancels a job: at once when waiting, at its next heartbeat when active. */
  async cancel(id: string, options: CallOptions = {}): Promise<{ cancelled: boolean; state: string }> {
    return this.request("POST", `/v1/jobs/${seg(id)}/cancel`, { idempotent: true, ...options });
  }

  /** Cancels every pending job of `type` whose dedupe key is `key`, and releases the binding. */
  async cancelByKey(type: string, key: string, options: CallOptions = {}): Promise<boolean> {
    const w = await this.request<{ cancelled: boolean }>("POST", "/v1/dedupe/cancel", {
      body: { type, key },
      idempotent: true,
      ...options,
    });
    return w.cancelled;
  }

  /** Deletes a job that is not active; `false` for an unknown or active job. */
  async purge(id: string, options: CallOptions = {}): Promise<boolean> {
    return (await this.request<{ purged: boolean }>("POST", `/v1/jobs/${seg(id)}/purge`, { idempotent: true, ...options }))
      .purged;
  }

  /** Makes a scheduled job due now. */
  async promote(id: string, options: CallOptions = {}): Promise<boolean> {
    return (
      await this.request<{ promoted: boolean }>("POST", `/v1/jobs/${seg(id)}/promote`, { idempotent: true, ...options })
    ).promoted;
  }

  /**
   * Puts a dead job back to `ready` (same id). With `idempotencyKey` a repeat
   * is a replay that does not redrive again (and the call is retried safely).
   */
  async redrive(id: string, options: RedriveOptions = {}): Promise<{ jobId: string; outcome: "accepted" | "replayed" }> {
    const body = compact({
      max_attempts: options.maxAttempts,
      deadline: instant(options.deadline),
      run_at: instant(options.runAt),
      reset_checkpoints: options.resetCheckpoints,
    });
    const key = options.idempotencyKey ?? undefined;
    const w = await this.request<Wire>("POST", `/v1/jobs/${seg(id)}/redrive`, {
      body,
      headers: key !== undefined ? { "idempotency-key": idempotencyHeader(key) } : undefined,
      idempotent: key !== undefined,
      secrets: key !== undefined ? [key] : [],
      signal: options.signal,
      requestTimeoutMs: options.requestTimeoutMs,
    });
    return { jobId: w["job_id"] as string, outcome: w["outcome"] as "accepted" | "replayed" };
  }

  /** Applies `cancel`, `purge` or `redrive` to every job matching `filter` (at most `limit`). */
  async bulk(
    action: "cancel" | "purge" | "redrive",
    filter: BulkFilter = {},
    options: { limit?: number } & CallOptions = {},
  ): Promise<{ matched: number; done: number }> {
    const f = compact({
      state: filter.state,
      queue: filter.queue,
      type: filter.type,
      tag: filter.tag,
      before: instant(filter.before),
    });
    return this.request("POST", "/v1/jobs/bulk", {
      body: compact({ action, filter: Object.keys(f).length > 0 ? f : undefined, limit: options.limit }),
      idempotent: action !== "redrive",
      signal: options.signal,
      requestTimeoutMs: options.requestTimeoutMs,
    });
  }

  // ------------------------------------------------------------ queues

  /** Every queue with its counts by state. */
  async queues(options: CallOptions = {}): Promise<QueueInfo[]> {
    return (await this.request<{ queues: QueueInfo[] }>("GET", "/v1/queues", { idempotent: true, ...options })).queues;
  }

  /** Pauses a queue: enqueue still accepts, claims skip it. */
  async pauseQueue(name: string, options: CallOptions = {}): Promise<boolean> {
    return (await this.request<{ paused: boolean }>("POST", `/v1/queues/${seg(name)}/pause`, { idempotent: true, ...options }))
      .paused;
  }

  /** Resumes a paused queue. Answers `paused` (false). */
  async resumeQueue(name: string, options: CallOptions = {}): Promise<boolean> {
    return (
      await this.request<{ paused: boolean }>("POST", `/v1/queues/${seg(name)}/resume`, { idempotent: true, ...options })
    ).paused;
  }

  // ------------------------------------------------------------ bindings

  /** The live dedupe binding of `key` for job `type`, or `null`. */
  async dedupeLookup(type: string, key: string, options: CallOptions = {}): Promise<DedupeBinding | null> {
    try {
      const w = await this.request<Wire>("GET", `/v1/dedupe/${seg(type)}/${seg(key)}`, { idempotent: true, ...options });
      return { jobId: w["job_id"] as string, mode: w["mode"] as string, windowUntil: (w["window_until"] as string) ?? null };
    } catch (err) {
      if (err instanceof NotFoundError) return null;
      throw err;
    }
  }

  /** The job a live idempotency key belongs to, or `null`. The key travels in the body. */
  async idempotencyLookup(key: string, options: { scope?: string } & CallOptions = {}): Promise<IdempotencyBinding | null> {
    try {
      const w = await this.request<Wire>("POST", "/v1/idempotency/lookup", {
        body: compact({ scope: options.scope, key }),
        idempotent: true,
        secrets: [key],
        signal: options.signal,
        requestTimeoutMs: options.requestTimeoutMs,
      });
      return {
        jobId: w["job_id"] as string,
        keyPreview: w["key_preview"] as string,
        keyDigest: w["key_digest"] as string,
        expiresAt: w["expires_at"] as string,
      };
    } catch (err) {
      if (err instanceof NotFoundError) return null;
      throw err;
    }
  }

  /** Releases an idempotency binding (an operator action): the key may own a new job. */
  async idempotencyRelease(key: string, options: { scope?: string } & CallOptions = {}): Promise<boolean> {
    const w = await this.request<{ released: boolean }>("POST", "/v1/idempotency/release", {
      body: compact({ scope: options.scope, key }),
      idempotent: true,
      secrets: [key],
      signal: options.signal,
      requestTimeoutMs: options.requestTimeoutMs,
    });
    return w.released;
  }

  // ------------------------------------------------------------ schedules

  async schedules(options: CallOptions = {}): Promise<Schedule[]> {
    const w = await this.request<{ schedules: Wire[] }>("GET", "/v1/schedules", { idempotent: true, ...options });
    return w.schedules.map(scheduleFromWire);
  }

  /** Creates or replaces a schedule: a cron expression (with seconds) or an interval, and a job template. */
  async putSchedule(name: string, definition: ScheduleDefinition, options: CallOptions = {}): Promise<Schedule> {
    const { type, payload, ...jobOptions } = definition.job;
    const body = compact({
      cron: definition.cron,
      timezone: definition.timezone,
      every_ms: definition.everyMs,
      paused: definition.paused,
      job: enqueueToWire(type, payload, jobOptions).body,
    });
    const w = await this.request<Wire>("PUT", `/v1/schedules/${seg(name)}`, { body, idempotent: true, ...options });
    return scheduleFromWire(w);
  }

  async deleteSchedule(name: string, options: CallOptions = {}): Promise<boolean> {
    return (await this.request<{ deleted: boolean }>("DELETE", `/v1/schedules/${seg(name)}`, { idempotent: true, ...options }))
      .deleted;
  }

  // ------------------------------------------------------------ health

  /** `GET /healthz`: raises {@link UnavailableError} when the backend is unreachable. */
  async health(options: CallOptions = {}): Promise<Health> {
    return healthFromWire(await this.request<Wire>("GET", "/healthz", { idempotent: true, ...options }));
  }

  // ------------------------------------------------------------ worker protocol

  /**
   * Claims up to `limit` due jobs. Every worker call is fenced by its lease
   * token, so it is always retried on connection errors and 503.
   */
  async claim(options: ClaimOptions & Retrying = {}): Promise<ClaimResult> {
    const body = compact({
      queues: options.queues,
      worker: options.worker,
      limit: options.limit,
      lease_ms: options.leaseMs,
      types: options.types,
      wait_ms: options.waitMs,
      complete: options.complete && options.complete.length > 0 ? options.complete.map(completionToWire) : undefined,
    });
    const w = await this.request<{ jobs: Wire[]; completed?: Wire[] }>("POST", "/v1/claim", {
      body,
      idempotent: true,
      waitMs: options.waitMs,
      signal: options.signal,
      requestTimeoutMs: options.requestTimeoutMs,
      [RETRYING]: options[RETRYING],
    });
    const out: ClaimResult = { jobs: (w.jobs ?? []).map(claimedJobFromWire) };
    if (Array.isArray(w.completed)) out.completed = w.completed.map(completionResultFromWire);
    return out;
  }

  async heartbeat(id: string, leaseToken: string, options: CallOptions = {}): Promise<HeartbeatResult> {
    const w = await this.request<Wire>("POST", `/v1/jobs/${seg(id)}/heartbeat`, {
      body: { lease_token: leaseToken },
      idempotent: true,
      ...options,
    });
    return { leaseExpiresAt: w["lease_expires_at"] as string, cancelRequested: Boolean(w["cancel_requested"]) };
  }

  async complete(id: string, leaseToken: string, result?: unknown, options: CallOptions & Retrying = {}): Promise<{ state: string }> {
    return this.request("POST", `/v1/jobs/${seg(id)}/complete`, {
      body: compact({ lease_token: leaseToken, result }),
      idempotent: true,
      ...options,
    });
  }

  /** Many completions in one round trip and one commit; a stale token fails only its own item. */
  async completeMany(completions: Completion[], options: CallOptions & Retrying = {}): Promise<CompletionResult[]> {
    const w = await this.request<{ results: Wire[] }>("POST", "/v1/jobs/complete", {
      body: { jobs: completions.map(completionToWire) },
      idempotent: true,
      ...options,
    });
    return w.results.map(completionResultFromWire);
  }

  async fail(id: string, leaseToken: string, options: FailOptions & Retrying = {}): Promise<FailResult> {
    const w = await this.request<Wire>("POST", `/v1/jobs/${seg(id)}/fail`, {
      body: compact({
        lease_token: leaseToken,
        error: options.error,
        retryable: options.retryable,
        retry_after_ms: options.retryAfterMs,
        snooze_ms: options.snoozeMs,
      }),
      idempotent: true,
      signal: options.signal,
      requestTimeoutMs: options.requestTimeoutMs,
      [RETRYING]: options[RETRYING],
    });
    return { state: w["state"] as string, nextRunAt: (w["next_run_at"] as string | null) ?? null };
  }

  /** Gives a lease back: the job is `ready` at once and the attempt is not counted. */
  async release(id: string, leaseToken: string, options: CallOptions & Retrying = {}): Promise<{ state: string }> {
    return this.request("POST", `/v1/jobs/${seg(id)}/release`, {
      body: { lease_token: leaseToken },
      idempotent: true,
      ...options,
    });
  }

  /** Stores a checkpoint; `false` when one already existed (it is kept). */
  async putCheckpoint(id: string, name: string, leaseToken: string, value: unknown, options: CallOptions = {}): Promise<boolean> {
    const w = await this.request<{ stored: boolean }>("PUT", `/v1/jobs/${seg(id)}/checkpoints/${seg(name)}`, {
      body: { lease_token: leaseToken, value: value === undefined ? null : value },
      idempotent: true,
      ...options,
    });
    return w.stored;
  }
}

function statusOf(problem: unknown): number {
  const s = (problem as { status?: unknown } | null)?.status;
  return typeof s === "number" ? s : 0;
}

function completionResultFromWire(r: Wire): CompletionResult {
  if (r["error"] !== undefined) return { ok: false, error: errorFromProblem(r["error"], statusOf(r["error"])) };
  return { ok: true, state: r["state"] as string };
}

export type { JobFilter };
