import { hostname } from "node:os";
import { type Client, RETRYING } from "./client.js";
import {
  ApiError,
  BadRequestError,
  IdemqError,
  LeaseLostError,
  MethodNotAllowedError,
  NotFoundError,
  PayloadTooLargeError,
  ValidationError,
  isRetryable,
} from "./errors.js";
import type { ClaimedJob, Completion, Job, JobRun } from "./types.js";

/**
 * Throw one of these from a handler to say how the attempt failed. Any other
 * thrown value is a retryable failure.
 */
export class JobError extends Error {
  /** `false`: the job goes dead at once. */
  readonly retryable: boolean;
  /** Overrides the backoff for this retry. */
  readonly retryAfterMs: number | undefined;
  /** Run again after this delay without consuming the attempt. */
  readonly snoozeMs: number | undefined;

  constructor(message: string, options: { retryable?: boolean; retryAfterMs?: number; snoozeMs?: number; cause?: unknown } = {}) {
    super(message, { cause: options.cause });
    this.name = "JobError";
    this.retryable = options.retryable ?? true;
    this.retryAfterMs = options.retryAfterMs;
    this.snoozeMs = options.snoozeMs;
  }

  /** A failure the retry policy retries (the default for any error). */
  static retryable(message: string): JobError {
    return new JobError(message);
  }
  /** A failure that makes the job dead at once. */
  static permanent(message: string): JobError {
    return new JobError(message, { retryable: false });
  }
  /** A failure retried after `ms` (unless the job's policy is `none`). */
  static retryAfter(message: string, ms: number): JobError {
    return new JobError(message, { retryAfterMs: ms });
  }
  /** Run again after `ms`; the attempt is not consumed. */
  static snooze(ms: number): JobError {
    return new JobError(`snoozed for ${ms} ms`, { snoozeMs: ms });
  }
}

/** Why a running handler was stopped: `ctx.signal.reason` is a {@link JobInterrupted} with it. */
export type InterruptReason = "cancelled" | "lease_lost" | "timeout" | "deadline" | "shutdown";

/** The reason of an aborted `ctx.signal`. */
export class JobInterrupted extends IdemqError {
  readonly reason: InterruptReason;
  readonly jobId: string;
  constructor(jobId: string, reason: InterruptReason) {
    super(`job ${jobId} interrupted: ${reason.replace("_", " ")}`);
    this.jobId = jobId;
    this.reason = reason;
  }
}

/**
 * A handler: its return value completes the job (and is stored as its
 * result); a throw fails the attempt. `P` types `ctx.payload`.
 */
// eslint-disable-next-line @typescript-eslint/no-explicit-any
export type Handler<P = any> = (ctx: JobContext<P>) => unknown;

export interface WorkerOptions {
  /** Queues to claim from (every queue when omitted). */
  queues?: string[];
  /** Handlers by job type; the worker claims only these types. */
  handlers: Record<string, Handler>;
  /** Jobs run at once (10). */
  concurrency?: number;
  /** The worker's name in the run ledger, 1–128 bytes of UTF-8 (`ts-<host>-<pid>` by default). */
  name?: string;
  /** Lease per claim in ms (30,000). */
  leaseMs?: number;
  /** Heartbeat period in ms (leaseMs / 3). */
  heartbeatIntervalMs?: number;
  /** How long one claim long-polls for work, in ms (5,000; at most 60,000). Shutdown waits for it. */
  waitMs?: number;
  /** On shutdown, how long running handlers may go on before they are stopped and released (30,000). */
  shutdownGraceMs?: number;
  /**
   * After a heartbeat saw a cancel request, how long the handler may go on,
   * in ms (1,000): a result it returns meanwhile completes the job; after
   * that the attempt is failed and the job ends cancelled.
   */
  cancelGraceMs?: number;
  /** How long a finished job waits to be acknowledged together with others, in ms (10). */
  completionDelayMs?: number;
  /** Called with errors the worker recovers from (a failed claim, heartbeat or report). */
  onError?: (error: unknown, job?: ClaimedJob) => void;
}

export interface WorkerReport {
  completed: number;
  failed: number;
  cancelled: number;
  released: number;
  lost: number;
}

/** What a handler sees of the job it runs. */
export class JobContext<P = unknown> {
  readonly id: string;
  readonly type: string;
  readonly queue: string;
  readonly payload: P;
  readonly attempt: number;
  readonly maxAttempts: number;
  readonly deadline: string | null;
  readonly timeoutMs: number;
  readonly tags: string[];
  readonly leaseToken: string;
  /** Aborted when the handler must stop: cancel, lost lease, timeout, deadline, shutdown. */
  readonly signal: AbortSignal;
  readonly #client: Client;
  readonly #beat: () => Promise<void>;
  #checkpoints: Record<string, unknown> | undefined;

  constructor(client: Client, job: ClaimedJob, signal: AbortSignal, beat: () => Promise<void>) {
    this.id = job.id;
    this.type = job.type;
    this.queue = job.queue;
    this.payload = job.payload as P;
    this.attempt = job.attempt;
    this.maxAttempts = job.maxAttempts;
    this.deadline = job.deadline;
    this.timeoutMs = job.timeoutMs;
    this.tags = job.tags;
    this.leaseToken = job.leaseToken;
    this.signal = signal;
    this.#client = client;
    this.#beat = beat;
  }

  /** True once a cancel was seen at a heartbeat. */
  get cancelled(): boolean {
    return this.signal.aborted && (this.signal.reason as JobInterrupted)?.reason === "cancelled";
  }

  /** Renews the lease now (heartbeats also run on their own every lease/3). */
  heartbeat(): Promise<void> {
    return this.#beat();
  }

  /**
   * A durable step: the first attempt that reaches it runs `fn` and stores its
   * JSON result under the job; every later attempt gets the stored value
   * without running `fn`. The first stored value wins.
   */
  async checkpoint<T>(name: string, fn: () => T | Promise<T>): Promise<T> {
    this.signal.throwIfAborted();
    if (this.#checkpoints === undefined) this.#checkpoints = await this.#client.jobCheckpoints(this.id);
    if (Object.prototype.hasOwnProperty.call(this.#checkpoints, name)) return this.#checkpoints[name] as T;
    const value = await fn();
    this.signal.throwIfAborted();
    const json = value === undefined ? null : JSON.parse(JSON.stringify(value));
    const stored = await this.#client.putCheckpoint(this.id, name, this.leaseToken, json);
    if (!stored) {
      this.#checkpoints = await this.#client.jobCheckpoints(this.id);
      return this.#checkpoints[name] as T;
    }
    this.#checkpoints[name] = json;
    return json as T;
  }
}

type Settled = { kind: "ok"; value: unknown } | { kind: "error"; error: unknown } | { kind: "stop"; reason: InterruptReason };

/** A completion's answer; `error` may also be one raised here (it was never sent). */
type Ack = { ok: true; state: string } | { ok: false; error: unknown };

interface PendingCompletion {
  completion: Completion;
  job: ClaimedJob;
  resolve: (r: Ack) => void;
  done: Promise<Ack>;
  settled: boolean;
  abandoned: boolean;
  /** Set once a claim carrying it was refused: it then goes in a call of its own. */
  apart: boolean;
  /**
   * Set once a call carrying it failed in transit (a connection error or a
   * 503) and was tried again: that call may have recorded it.
   */
  retried: boolean;
}

const MAX_TIMER = 2_147_483_647;
/** The most jobs one claim may ask for (API: `limit` ≤ 1,000). */
const MAX_CLAIM_LIMIT = 1_000;
/** The longest worker name the API takes, in bytes of UTF-8. */
const MAX_NAME_BYTES = 128;
const EMPTY_CLAIM_PAUSE_MS = 100;
/** The shortest wait before the server is asked about a deadline again, when it said "not yet". */
const DEADLINE_RECHECK_MS = 10;
/** The first and the longest wait before a deadline question the server did not answer is asked again. */
const DEADLINE_BACKOFF_MS = [50, 2_000] as const;

function wait(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve) => {
    if (signal?.aborted) return resolve();
    const t = setTimeout(done, ms);
    function done() {
      clearTimeout(t);
      signal?.removeEventListener("abort", done);
      resolve();
    }
    signal?.addEventListener("abort", done, { once: true });
  });
}

/** `s` cut to at most `max` bytes of UTF-8, on a character boundary. */
function truncateUtf8(s: string, max: number): string {
  if (Buffer.byteLength(s, "utf8") <= max) return s;
  let out = "";
  let bytes = 0;
  for (const ch of s) {
    const n = Buffer.byteLength(ch, "utf8");
    if (bytes + n > max) break;
    out += ch;
    bytes += n;
  }
  return out;
}

/** The most bytes of a failure's error text the server keeps. */
const MAX_ERROR_BYTES = 8192;

/**
 * A failure's error text as the server keeps it in the attempt's run:
 * U+0000 written as U+FFFD, cut to 8 KiB of UTF-8 on a character boundary.
 */
function keptError(error: string): string {
  return truncateUtf8(error.replaceAll("\0", "\ufffd"), MAX_ERROR_BYTES);
}

function describe(err: unknown): string {
  const text = err instanceof Error ? `${err.name === "Error" ? "" : `${err.name}: `}${err.message}` : String(err);
  return text.length > 8192 ? text.slice(0, 8192) : text;
}

/**
 * The server's refusal of a completion for what it holds (over the payload
 * limit, or not a value it stores): the same handler would produce the same
 * result again, so the attempt fails for good.
 */
const refusedResult = (err: unknown) =>
  err instanceof PayloadTooLargeError || err instanceof ValidationError || err instanceof BadRequestError;

/**
 * Runs handlers for claimed jobs: long-polls for as many jobs as it has free
 * slots, heartbeats each every lease/3, enforces the timeout locally, asks
 * the server at a job's deadline (the server ends the attempt there, on its
 * clock), acknowledges completions in batches (that of a job with a
 * deadline at once: it gets no heartbeat after its handler returned) and,
 * on shutdown, releases the leases it cannot finish.
 */
export class Worker {
  readonly client: Client;
  readonly name: string;
  readonly #o: Required<Omit<WorkerOptions, "queues" | "name" | "onError">> & { queues: string[] | undefined };
  readonly #onError: (error: unknown, job?: ClaimedJob) => void;
  #running = false;
  #stopping = false;
  #stopSignal = new AbortController();
  #slotFreed: (() => void) | undefined;
  #active = new Map<string, { stop: (r: InterruptReason) => void }>();
  #tasks = new Set<Promise<void>>();
  #pending: PendingCompletion[] = [];
  #flushTimer: NodeJS.Timeout | undefined;
  #flushing: Promise<void> = Promise.resolve();
  #piggyback = true;
  #batchEndpoint = true;
  #report: WorkerReport = { completed: 0, failed: 0, cancelled: 0, released: 0, lost: 0 };

  constructor(client: Client, options: WorkerOptions) {
    if (!options || !options.handlers || Object.keys(options.handlers).length === 0) {
      throw new TypeError("new Worker(client, { handlers }) needs at least one handler");
    }
    this.client = client;
    const leaseMs = options.leaseMs ?? 30_000;
    const cancelGraceMs = options.cancelGraceMs ?? 1_000;
    if (typeof cancelGraceMs !== "number" || !Number.isFinite(cancelGraceMs) || cancelGraceMs < 0) {
      throw new RangeError(`cancelGraceMs must be a finite number of ms, 0 or more (got ${String(options.cancelGraceMs)})`);
    }
    this.#o = {
      queues: options.queues,
      handlers: { ...options.handlers },
      concurrency: Math.max(1, Math.floor(options.concurrency ?? 10)),
      leaseMs,
      heartbeatIntervalMs: options.heartbeatIntervalMs ?? Math.max(1, Math.floor(leaseMs / 3)),
      waitMs: Math.min(60_000, Math.max(0, options.waitMs ?? 5_000)),
      shutdownGraceMs: options.shutdownGraceMs ?? 30_000,
      completionDelayMs: options.completionDelayMs ?? 10,
      cancelGraceMs,
    };
    // A name given is sent as it is, or refused here (as the server would
    // refuse it at the first claim); the default one is cut to fit.
    const given = options.name;
    if (given === undefined || given === null || given === "") {
      this.name = truncateUtf8(`ts-${hostname()}-${process.pid}`, MAX_NAME_BYTES);
    } else if (typeof given !== "string") {
      throw new TypeError("the worker's name must be a string");
    } else if (Buffer.byteLength(given, "utf8") > MAX_NAME_BYTES) {
      throw new RangeError(
        `the worker's name is ${Buffer.byteLength(given, "utf8")} bytes of UTF-8: the API takes at most ${MAX_NAME_BYTES}`,
      );
    } else {
      this.name = given;
    }
    this.#onError =
      options.onError ??
      ((error, job) => {
        console.error(`idemq worker ${this.name}${job ? ` (job ${job.id})` : ""}: ${describe(error)}`);
      });
  }

  /**
   * Claims and runs jobs until `signal` aborts, then stops claiming, lets
   * running handlers finish for up to `shutdownGraceMs`, stops the rest and
   * releases their leases. Resolves with what it did; rejects when a claim
   * fails for good (e.g. unauthorized).
   */
  async run(options: { signal?: AbortSignal } = {}): Promise<WorkerReport> {
    if (this.#running) throw new Error("this worker is already running");
    this.#running = true;
    this.#stopping = false;
    this.#stopSignal = new AbortController();
    this.#report = { completed: 0, failed: 0, cancelled: 0, released: 0, lost: 0 };
    const { signal } = options;
    let graceTimer: NodeJS.Timeout | undefined;
    const stop = () => {
      if (this.#stopping) return;
      this.#stopping = true;
      this.#stopSignal.abort();
      this.#slotFreed?.();
      graceTimer = setTimeout(() => {
        for (const a of this.#active.values()) a.stop("shutdown");
      }, this.#o.shutdownGraceMs);
    };
    if (signal?.aborted) stop();
    signal?.addEventListener("abort", stop, { once: true });
    let fatal: unknown;
    try {
      fatal = await this.#claimLoop();
      if (fatal !== undefined) stop();
      while (this.#tasks.size > 0) await Promise.all([...this.#tasks]);
      await this.#flushAll();
    } finally {
      clearTimeout(graceTimer);
      signal?.removeEventListener("abort", stop);
      this.#running = false;
    }
    if (fatal !== undefined) throw fatal;
    return { ...this.#report };
  }

  async #claimLoop(): Promise<unknown> {
    let failures = 0;
    while (!this.#stopping) {
      const free = this.#o.concurrency - this.#active.size;
      if (free <= 0) {
        await new Promise<void>((resolve) => (this.#slotFreed = resolve));
        this.#slotFreed = undefined;
        continue;
      }
      const carried = this.#piggyback ? this.#takeCarried(1000) : [];
      let answer;
      const claimedAt = Date.now();
      try {
        answer = await this.client.claim({
          queues: this.#o.queues,
          worker: this.name,
          limit: Math.min(free, MAX_CLAIM_LIMIT),
          leaseMs: this.#o.leaseMs,
          types: Object.keys(this.#o.handlers),
          waitMs: this.#o.waitMs,
          complete: carried.map((p) => p.completion),
          [RETRYING]: () => carried.forEach((p) => (p.retried = true)),
        });
        failures = 0;
      } catch (err) {
        if (carried.length > 0 && !isRetryable(err)) {
          // What was refused may be one of the completions (a result over
          // the size limit refuses the whole call): their own calls answer
          // each, and the claim is tried again without them.
          for (const p of carried) p.apart = true;
          this.#putBack(carried);
          // A server from before claims took completions refuses the member
          // like any unknown one.
          if (err instanceof BadRequestError) this.#piggyback = false;
          this.#onError(err);
          continue;
        }
        if (isRetryable(err)) for (const p of carried) p.retried = true;
        this.#putBack(carried);
        if (isRetryable(err)) {
          this.#onError(err);
          failures++;
          await wait(Math.min(5_000, 250 * 2 ** Math.min(failures, 5)) * (0.5 + Math.random() / 2), this.#stopSignal.signal);
          continue;
        }
        return err;
      }
      if (carried.length > 0) {
        if (answer.completed && answer.completed.length === carried.length) {
          carried.forEach((p, i) => this.#settle(p, answer.completed![i]!));
        } else {
          this.#piggyback = false;
          this.#putBack(carried);
        }
      }
      if (answer.jobs.length === 0 && carried.length === 0) {
        // An empty answer that came back at once (no long-poll): do not spin.
        const quick = EMPTY_CLAIM_PAUSE_MS - (Date.now() - claimedAt);
        if (quick > 0) await wait(quick, this.#stopSignal.signal);
      }
      for (const job of answer.jobs) {
        if (this.#stopping) {
          await this.#releaseUnstarted(job);
        } else {
          this.#start(job);
        }
      }
    }
    return undefined;
  }

  async #releaseUnstarted(job: ClaimedJob): Promise<void> {
    let retried = false;
    try {
      await this.client.release(job.id, job.leaseToken, { [RETRYING]: () => (retried = true) });
      this.#report.released++;
    } catch (err) {
      if (!(err instanceof LeaseLostError)) this.#onError(err, job);
      else if (retried && (await this.#endedByOwnCall(job, "released", null))) this.#report.released++;
      else this.#report.lost++;
    }
  }

  #start(job: ClaimedJob): void {
    let stop: (r: InterruptReason) => void = () => {};
    let handlerDone: () => void = () => {};
    const running = new Promise<void>((resolve) => (handlerDone = resolve));
    const slot = { stop: (r: InterruptReason) => stop(r) };
    this.#active.set(job.id, slot);
    void running.then(() => {
      this.#active.delete(job.id);
      this.#slotFreed?.();
    });
    const task = this.#execute(job, (fn) => (stop = fn), handlerDone)
      .catch((err) => this.#onError(err, job))
      .finally(() => {
        handlerDone();
        this.#tasks.delete(task);
      });
    this.#tasks.add(task);
  }

  async #execute(job: ClaimedJob, expose: (stop: (r: InterruptReason) => void) => void, handlerDone: () => void): Promise<void> {
    const claimedAt = Date.now();
    const controller = new AbortController();
    let reason: InterruptReason | undefined;
    let onStop: (r: InterruptReason) => void = () => {};
    const stopped = new Promise<InterruptReason>((resolve) => (onStop = resolve));
    const stop = (r: InterruptReason) => {
      if (reason !== undefined) return;
      reason = r;
      controller.abort(new JobInterrupted(job.id, r));
      onStop(r);
    };
    expose(stop);
    // Lease loss is tracked on its own: it matters after the handler too,
    // while the completion waits for its acknowledgement.
    let leaseLost = false;
    let onLost: () => void = () => {};
    const lost = new Promise<void>((resolve) => (onLost = resolve));
    const loseLease = () => {
      leaseLost = true;
      onLost();
      stop("lease_lost");
    };

    // The lease as this worker knows it: renewed by each heartbeat that
    // succeeds, counted from the moment that heartbeat was sent.
    let watchdog: NodeJS.Timeout | undefined;
    const armWatchdog = (from: number) => {
      clearTimeout(watchdog);
      watchdog = setTimeout(loseLease, Math.max(0, from + this.#o.leaseMs - Date.now()));
    };
    armWatchdog(Date.now());
    // A heartbeat answered lease-lost. For a job with a deadline the server
    // may have ended the attempt there (its clock may be past the deadline
    // before this worker's estimate says so): it is asked which.
    const leaseGone = async () => {
      if (job.deadline !== null && (await this.#endedByServer(job))) stop("deadline");
      else loseLease();
    };
    let beating = true;
    const beat = async () => {
      if (!beating) return;
      const sent = Date.now();
      try {
        const hb = await this.client.heartbeat(job.id, job.leaseToken);
        if (!beating) return;
        armWatchdog(sent);
        if (hb.cancelRequested) stop("cancelled");
      } catch (err) {
        if (err instanceof LeaseLostError) await leaseGone();
        else this.#onError(err, job);
      }
    };
    const heartbeats = setInterval(() => void beat(), this.#o.heartbeatIntervalMs);
    const timers: NodeJS.Timeout[] = [];
    if (job.timeoutMs > 0 && job.timeoutMs <= MAX_TIMER) timers.push(setTimeout(() => stop("timeout"), job.timeoutMs));

    // The deadline is the server's to enforce, on its clock: this worker's
    // timer only says when to ask, by the attempt's heartbeat. Past the
    // deadline the server ends the attempt (dead, reason deadline) and
    // answers lease-lost; before it, the lease is renewed, and the answer
    // says when the server's clock will be there.
    let asking = job.deadline !== null;
    let askTimer: NodeJS.Timeout | undefined;
    let backoff: number = DEADLINE_BACKOFF_MS[0];
    const askIn = (ms: number) => {
      clearTimeout(askTimer);
      if (asking) askTimer = setTimeout(() => void ask(), Math.min(MAX_TIMER, Math.max(0, ms)));
    };
    /** How long until the server's clock reads the deadline, given its lease expiry as of now. */
    const untilDeadline = (leaseExpiresAt: string | null | undefined, now: number) => {
      const expires = leaseExpiresAt ? Date.parse(leaseExpiresAt) : NaN;
      const serverNow = Number.isFinite(expires) ? expires - this.#o.leaseMs : now;
      return Date.parse(job.deadline!) - serverNow;
    };
    const ask = async () => {
      if (!asking) return;
      const sent = Date.now();
      try {
        const hb = await this.client.heartbeat(job.id, job.leaseToken);
        if (!asking) return;
        armWatchdog(sent);
        backoff = DEADLINE_BACKOFF_MS[0];
        if (hb.cancelRequested) stop("cancelled");
        // Not yet on the server's clock: ask again when it will be.
        askIn(Math.max(DEADLINE_RECHECK_MS, untilDeadline(hb.leaseExpiresAt, Date.now())));
      } catch (err) {
        if (!asking) return;
        if (err instanceof LeaseLostError) {
          await leaseGone();
        } else {
          // The server cannot be asked: the handler goes on, and the question is asked again.
          this.#onError(err, job);
          askIn(backoff);
          backoff = Math.min(backoff * 2, DEADLINE_BACKOFF_MS[1]);
        }
      }
    };
    if (asking) askIn(untilDeadline(job.leaseExpiresAt, claimedAt) - (Date.now() - claimedAt));

    const ctx = new JobContext(this.client, job, controller.signal, beat);
    try {
      let outcome: Settled;
      if (reason !== undefined) {
        outcome = { kind: "stop", reason };
      } else {
        const handler = this.#o.handlers[job.type];
        const running = handler
          ? Promise.resolve().then(() => handler(ctx))
          : Promise.reject(JobError.permanent(`no handler for job type ${job.type}`));
        running.catch(() => {});
        const returned = running.then(
          (value): Settled => ({ kind: "ok", value }),
          (error): Settled => ({ kind: "error", error }),
        );
        outcome = await Promise.race([returned, stopped.then((r): Settled => ({ kind: "stop", reason: r }))]);
        if (outcome.kind === "stop" && outcome.reason === "cancelled") {
          // Whatever ends the attempt decides: the handler, told by its
          // signal, may still return within the grace, and a completion then
          // records the effect. Past it, the attempt is failed (cancelled).
          const cancelled = outcome;
          let graceTimer: NodeJS.Timeout | undefined;
          const graceOver = new Promise<Settled>(
            (resolve) => (graceTimer = setTimeout(() => resolve(cancelled), Math.min(MAX_TIMER, this.#o.cancelGraceMs))),
          );
          outcome = await Promise.race([returned, graceOver, lost.then((): Settled => ({ kind: "stop", reason: "lease_lost" }))]);
          clearTimeout(graceTimer);
        }
      }
      for (const t of timers) clearTimeout(t);
      asking = false;
      clearTimeout(askTimer);
      if (job.deadline !== null) {
        // No heartbeat once the handler returned: past the deadline on the
        // server's clock, one would end the attempt there, and the
        // completion would be refused. The completion goes at once instead,
        // within the lease left from the last renewal.
        beating = false;
        clearInterval(heartbeats);
      }
      handlerDone();
      if (leaseLost) {
        this.#report.lost++;
        return;
      }
      if (outcome.kind === "ok") {
        // The result as JSON now: one JSON cannot carry (a BigInt, a cycle)
        // would fail every call that carries it, so the attempt fails for
        // good instead (the same handler would return it again).
        let result: unknown;
        try {
          const text = JSON.stringify(outcome.value);
          result = text === undefined ? undefined : JSON.parse(text);
        } catch (err) {
          await this.#sendFail(job, { error: describe(`the handler's result is not JSON: ${describe(err)}`), retryable: false });
          return;
        }
        let ack: Ack;
        let retried: () => boolean;
        if (job.deadline !== null) {
          const sent = await this.#completeNow(job, result, lost, () => leaseLost);
          ack = sent.ack;
          retried = () => sent.retried;
        } else {
          // The heartbeat goes on while the completion waits for a claim or
          // a batch to carry it.
          const record = this.#enqueueCompletion(job, result);
          const first = await Promise.race([record.done, lost.then(() => undefined)]);
          if (first === undefined) this.#abandon(record);
          ack = await record.done;
          retried = () => record.retried;
        }
        if (!ack.ok && ack.error instanceof LeaseLostError && retried()) {
          // A call that carried it failed in transit and was tried again:
          // the try whose answer never came may have recorded it, and the
          // next one then finds the lease gone. The job says which.
          ack = await this.#recordedBefore(job, ack);
        }
        if (!ack.ok && refusedResult(ack.error)) {
          await this.#sendFail(job, {
            error: describe(`the handler's result was refused: ${(ack.error as Error).message}`),
            retryable: false,
          });
          return;
        }
        this.#count(ack, job);
        return;
      }
      if (outcome.kind === "stop") {
        switch (outcome.reason) {
          case "shutdown":
            await this.#releaseStarted(job);
            return;
          case "cancelled":
            await this.#sendFail(job, { error: "cancelled while running", retryable: true });
            return;
          case "timeout":
            await this.#sendFail(job, { error: `timeout: the attempt ran past ${job.timeoutMs} ms`, retryable: true });
            return;
          case "deadline":
            // The server recorded the attempt's end: nothing more to record.
            this.#report.failed++;
            return;
          case "lease_lost":
            this.#report.lost++;
            return;
        }
      }
      const error = (outcome as { error: unknown }).error;
      if (error instanceof JobInterrupted && error.jobId === job.id && error.reason === "cancelled") {
        // The handler threw its signal's reason: the cancel ended it.
        await this.#sendFail(job, { error: "cancelled while running", retryable: true });
      } else if (error instanceof JobError) {
        await this.#sendFail(job, {
          error: describe(error.message),
          retryable: error.retryable,
          retryAfterMs: error.retryAfterMs,
          snoozeMs: error.snoozeMs,
        });
      } else if (error instanceof LeaseLostError) {
        this.#report.lost++;
      } else {
        await this.#sendFail(job, { error: describe(error), retryable: true });
      }
    } finally {
      beating = false;
      asking = false;
      clearInterval(heartbeats);
      clearTimeout(watchdog);
      clearTimeout(askTimer);
      for (const t of timers) clearTimeout(t);
    }
  }

  /**
   * Whether the server ended this attempt when a heartbeat of a job with a
   * deadline found the lease gone (at the deadline, or at its timeout, as a
   * heartbeat then records it), rather than the attempt being another's
   * already.
   */
  async #endedByServer(job: ClaimedJob): Promise<boolean> {
    try {
      const now = await this.client.getJob(job.id);
      return now.attempt === job.attempt && now.state !== "active" && now.state !== "completed";
    } catch {
      return false;
    }
  }

  /**
   * Records a completion in a call of its own, at once; a transient failure
   * is tried again while the lease may still be this worker's.
   */
  async #completeNow(
    job: ClaimedJob,
    result: unknown,
    lost: Promise<void>,
    isLost: () => boolean,
  ): Promise<{ ack: Ack; retried: boolean }> {
    let retried = false;
    const retrying = () => (retried = true);
    for (;;) {
      try {
        const r = await this.client.complete(job.id, job.leaseToken, result, { [RETRYING]: retrying });
        return { ack: { ok: true, state: r.state }, retried };
      } catch (err) {
        if (!isRetryable(err)) return { ack: { ok: false, error: err }, retried };
        retried = true;
        this.#onError(err, job);
        await Promise.race([wait(500), lost]);
        if (isLost()) return { ack: { ok: false, error: leaseLost(job.id) }, retried };
      }
    }
  }

  /**
   * A completion answered lease-lost after a call carrying it was tried
   * again: completed when the job is `completed` at the attempt this worker
   * held (only that attempt's lease could complete it), else the lease-lost
   * answer stands.
   */
  async #recordedBefore(job: ClaimedJob, ack: Ack): Promise<Ack> {
    let now: Job;
    try {
      now = await this.client.getJob(job.id);
    } catch (err) {
      this.#onError(err, job);
      return ack;
    }
    return now.state === "completed" && now.attempt === job.attempt ? { ok: true, state: "completed" } : ack;
  }

  #count(ack: Ack, job?: ClaimedJob): void {
    if (ack.ok) this.#report.completed++;
    else if (ack.error instanceof LeaseLostError) this.#report.lost++;
    else this.#onError(ack.error, job);
  }

  async #sendFail(
    job: ClaimedJob,
    o: { error: string; retryable: boolean; retryAfterMs?: number; snoozeMs?: number },
  ): Promise<void> {
    let retried = false;
    try {
      const r = await this.client.fail(job.id, job.leaseToken, { ...o, [RETRYING]: () => (retried = true) });
      if (r.state === "cancelled") this.#report.cancelled++;
      else this.#report.failed++;
    } catch (err) {
      if (!(err instanceof LeaseLostError)) {
        this.#onError(err, job);
        return;
      }
      // A snooze keeps no error text; a failure keeps the text sent.
      const snoozed = o.snoozeMs !== undefined && o.snoozeMs !== null;
      const ended = retried
        ? await this.#endedByOwnCall(job, snoozed ? "snoozed" : "failed", snoozed ? null : keptError(o.error))
        : undefined;
      if (ended === undefined) this.#report.lost++;
      else if (ended === "cancelled") this.#report.cancelled++;
      else this.#report.failed++;
    }
  }

  async #releaseStarted(job: ClaimedJob): Promise<void> {
    let retried = false;
    try {
      const r = await this.client.release(job.id, job.leaseToken, { [RETRYING]: () => (retried = true) });
      if (r.state === "cancelled") this.#report.cancelled++;
      else this.#report.released++;
    } catch (err) {
      if (!(err instanceof LeaseLostError)) {
        this.#onError(err, job);
        return;
      }
      const ended = retried ? await this.#endedByOwnCall(job, "released", null) : undefined;
      if (ended === undefined) this.#report.lost++;
      else if (ended === "cancelled") this.#report.cancelled++;
      else this.#report.released++;
    }
  }

  /**
   * A `fail` or `release` answered lease-lost after a call of it failed in
   * transit and was tried again: the try whose answer never came may have
   * recorded it. It did when the run of the attempt this worker held ended
   * as the call ends one: `outcome` (`failed`, `snoozed` or `released`), or
   * `cancelled` when a cancel was requested, with the error text sent as
   * the server keeps it (`error`; none for a snooze or a release). Answers
   * that run's outcome, or `undefined` when the attempt is lost: the server
   * ended it otherwise (its lease expired, a heartbeat recorded its timeout
   * or deadline, each with an outcome or text of its own), it has not ended,
   * or the runs cannot be read.
   */
  async #endedByOwnCall(
    job: ClaimedJob,
    outcome: "failed" | "snoozed" | "released",
    error: string | null,
  ): Promise<string | undefined> {
    let runs: JobRun[];
    try {
      runs = await this.client.jobRuns(job.id);
    } catch (err) {
      this.#onError(err, job);
      return undefined;
    }
    const run = runs.find(
      (r) =>
        r.attempt === job.attempt &&
        (r.outcome === outcome || r.outcome === "cancelled") &&
        (r.error ?? "") === (error ?? ""),
    );
    return run?.outcome ?? undefined;
  }

  // ------------------------------------------------------------ completions

  #enqueueCompletion(job: ClaimedJob, result: unknown): PendingCompletion {
    let resolve: (r: Ack) => void = () => {};
    const done = new Promise<Ack>((r) => (resolve = r));
    const completion: Completion = { id: job.id, leaseToken: job.leaseToken };
    if (result !== undefined) completion.result = result;
    const record: PendingCompletion = {
      completion,
      job,
      resolve,
      done,
      settled: false,
      abandoned: false,
      apart: false,
      retried: false,
    };
    this.#pending.push(record);
    this.#scheduleFlush();
    return record;
  }

  /**
   * The lease was lost before the completion was acknowledged: an unsent
   * completion is dropped (a lost lease never completes); one in flight gets
   * the server's answer, but is not sent again.
   */
  #abandon(record: PendingCompletion): void {
    record.abandoned = true;
    const i = this.#pending.indexOf(record);
    if (i >= 0) {
      this.#pending.splice(i, 1);
      this.#settle(record, { ok: false, error: leaseLost(record.job.id) });
    }
  }

  #take(max: number): PendingCompletion[] {
    return this.#pending.splice(0, max);
  }

  /** The completions the next claim carries: none that a claim was refused with. */
  #takeCarried(max: number): PendingCompletion[] {
    const taken: PendingCompletion[] = [];
    const kept: PendingCompletion[] = [];
    for (const p of this.#pending) {
      if (!p.apart && taken.length < max) taken.push(p);
      else kept.push(p);
    }
    this.#pending = kept;
    return taken;
  }

  #putBack(items: PendingCompletion[]): void {
    const live: PendingCompletion[] = [];
    for (const p of items) {
      if (p.settled) continue;
      if (p.abandoned) this.#settle(p, { ok: false, error: leaseLost(p.job.id) });
      else live.push(p);
    }
    if (live.length === 0) return;
    this.#pending.unshift(...live);
    this.#scheduleFlush();
  }

  #settle(p: PendingCompletion, r: Ack): void {
    if (p.settled) return;
    p.settled = true;
    p.resolve(r);
  }

  #scheduleFlush(): void {
    if (this.#flushTimer || this.#pending.length === 0) return;
    this.#flushTimer = setTimeout(() => {
      this.#flushTimer = undefined;
      this.#flushing = this.#flushing.then(() => this.#flush());
    }, this.#o.completionDelayMs);
  }

  async #flushAll(): Promise<void> {
    clearTimeout(this.#flushTimer);
    this.#flushTimer = undefined;
    await this.#flushing;
    while (this.#pending.length > 0) await this.#flush();
  }

  async #flush(): Promise<void> {
    const batch = this.#take(1000);
    if (batch.length === 0) return;
    if (this.#batchEndpoint) {
      try {
        const results = await this.client.completeMany(
          batch.map((p) => p.completion),
          { [RETRYING]: () => batch.forEach((p) => (p.retried = true)) },
        );
        batch.forEach((p, i) => this.#settle(p, results[i] ?? { ok: false, error: missing() }));
        return;
      } catch (err) {
        if (isRetryable(err)) {
          for (const p of batch) p.retried = true;
          this.#onError(err);
          await wait(500);
          this.#putBack(batch);
          return;
        }
        if (err instanceof NotFoundError || err instanceof MethodNotAllowedError) {
          this.#batchEndpoint = false;
        }
        // Refused as a whole (say one result over the size limit): one
        // completion at a time gives each its own answer, so the others
        // still complete.
      }
    }
    await Promise.all(
      batch.map(async (p) => {
        try {
          const r = await this.client.complete(p.completion.id, p.completion.leaseToken, p.completion.result, {
            [RETRYING]: () => (p.retried = true),
          });
          this.#settle(p, { ok: true, state: r.state });
        } catch (err) {
          // Only a failure in transit is tried again: any other error (an
          // answer of the server, or one raised here before anything was
          // sent) is the completion's answer.
          if (!isRetryable(err)) this.#settle(p, { ok: false, error: err });
          else {
            p.retried = true;
            this.#onError(err, p.job);
            await wait(500);
            this.#putBack([p]);
          }
        }
      }),
    );
  }
}

function leaseLost(jobId: string): LeaseLostError {
  return new LeaseLostError(
    { type: "/problems/lease-lost", title: "Lease lost", detail: "the lease expired before the completion was acknowledged", job_id: jobId },
    409,
  );
}

function missing(): ApiError {
  return new ApiError({ type: "/problems/internal", detail: "the server sent fewer results than completions" }, 500);
}
