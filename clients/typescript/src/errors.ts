/**
 * Typed errors. Every error the client raises is an {@link IdemqError}; an
 * answer of the server that is an RFC 9457 problem document becomes an
 * {@link ApiError} subclass chosen by the problem `type`.
 *
 * No error ever holds a raw idempotency key: the server only sends its
 * preview and digest, and the client also blanks any key of the failed
 * request from every string of the problem before it builds the error.
 */

/** An RFC 9457 problem document as the server sent it (keys blanked). */
export interface Problem {
  type: string;
  title?: string;
  status?: number;
  detail?: string;
  [member: string]: unknown;
}

/** The base of every error raised by this package. */
export class IdemqError extends Error {
  /**
   * Whether the same call, repeated, may succeed: `true` for
   * {@link UnavailableError} (503) and {@link ConnectionError} (timeouts
   * included), `false` for every other error. The client retries only such
   * errors, and only for calls that are safe to repeat.
   */
  readonly retryable: boolean;

  constructor(message: string, options?: { cause?: unknown }) {
    super(message, options);
    Object.defineProperty(this, "name", { value: new.target.name, enumerable: false, configurable: true, writable: true });
    this.retryable = this instanceof UnavailableError || this instanceof ConnectionError;
  }

  /** A JSON form without the stack. */
  toJSON(): Record<string, unknown> {
    const out: Record<string, unknown> = { name: this.name, message: this.message };
    for (const [k, v] of Object.entries(this)) {
      if (k !== "cause") out[k] = v;
    }
    return out;
  }
}

/** The server answered with an error status (a problem document). */
export class ApiError extends IdemqError {
  /** The HTTP status. */
  readonly status: number;
  /** The problem name, e.g. `validation` (the last segment of `type`). */
  readonly problemType: string;
  /** The problem's `title`. */
  readonly title: string | undefined;
  /** The problem's `detail`. */
  readonly detail: string | undefined;
  /** In an atomic batch: the index of the first failing item. */
  readonly index: number | undefined;
  /** The whole problem document. */
  readonly problem: Problem;

  constructor(problem: Problem, status: number) {
    const name = problemName(problem.type) || `http-${status}`;
    const text = problem.detail || problem.title || `HTTP ${status}`;
    super(`${name} (${status}): ${text}`);
    this.status = status;
    this.problemType = name;
    this.title = problem.title;
    this.detail = problem.detail;
    this.index = typeof problem["index"] === "number" ? (problem["index"] as number) : undefined;
    this.problem = problem;
  }
}

/** 400 `bad-request`: the body is not JSON, not an object, or has an unknown member. */
export class BadRequestError extends ApiError {}

/** 422 `validation`: a field breaks a bound; nothing was written. */
export class ValidationError extends ApiError {
  /** The dotted path of the field, e.g. `idempotency.ttl_ms`. */
  readonly field: string | undefined;
  /** The bound that was broken. */
  readonly reason: string | undefined;
  constructor(problem: Problem, status: number) {
    super(problem, status);
    this.field = str(problem["field"]);
    this.reason = str(problem["reason"]);
  }
}

/**
 * 409 `idempotency-conflict`: the key (or the explicit job id) already
 * belongs to a job accepted with a different request. Nothing was written and
 * neither request silently won.
 */
export class EnqueueIdempotencyConflictError extends ApiError {
  /** The existing job that owns the key. */
  readonly jobId: string;
  /** `idempotency_key` or `job_id`. */
  readonly source: "idempotency_key" | "job_id" | string;
  /** The key's scope (`null` when `source` is `job_id`). */
  readonly scope: string | null;
  /** The first characters of the key, then `…` (`null` when `source` is `job_id`). */
  readonly keyPreview: string | null;
  /** 16 hex digits of the key's hash (`null` when `source` is `job_id`). */
  readonly keyDigest: string | null;
  /** The differing fields, sorted dotted paths (e.g. `payload`). */
  readonly fields: string[];
  constructor(problem: Problem, status: number) {
    super(problem, status);
    this.jobId = str(problem["job_id"]) ?? "";
    this.source = str(problem["source"]) ?? "idempotency_key";
    this.scope = str(problem["scope"]) ?? null;
    this.keyPreview = str(problem["key_preview"]) ?? null;
    this.keyDigest = str(problem["key_digest"]) ?? null;
    this.fields = Array.isArray(problem["fields"]) ? (problem["fields"] as unknown[]).map(String) : [];
  }
}

/** 409 `lease-lost`: the lease token is stale; another attempt owns the job now. */
export class LeaseLostError extends ApiError {
  readonly jobId: string | undefined;
  constructor(problem: Problem, status: number) {
    super(problem, status);
    this.jobId = str(problem["job_id"]);
  }
}

/** 409 `not-dead`: a redrive of a job that is not dead. */
export class NotDeadError extends ApiError {
  readonly jobId: string | undefined;
  readonly state: string | undefined;
  constructor(problem: Problem, status: number) {
    super(problem, status);
    this.jobId = str(problem["job_id"]);
    this.state = str(problem["state"]);
  }
}

/** 404 `not-found`. */
export class NotFoundError extends ApiError {}

/** 401 `unauthorized`: the server has a token and the request did not carry it. */
export class UnauthorizedError extends ApiError {}

/** 403 `forbidden-host`: the `Host` header names neither a loopback address nor an allowed host. */
export class ForbiddenHostError extends ApiError {}

/** 405 `method-not-allowed`. */
export class MethodNotAllowedError extends ApiError {
  /** The methods the path serves, from the `Allow` header. */
  readonly allow: string[];
  constructor(problem: Problem, status: number, allow: string[] = []) {
    super(problem, status);
    this.allow = allow;
  }
}

/** 413 `payload-too-large`: the payload (or the whole body) is over the limit. */
export class PayloadTooLargeError extends ApiError {
  readonly field: string | undefined;
  readonly limit: number | undefined;
  constructor(problem: Problem, status: number) {
    super(problem, status);
    this.field = str(problem["field"]);
    this.limit = typeof problem["limit"] === "number" ? (problem["limit"] as number) : undefined;
  }
}

/** 503 `unavailable`: the backend is down or busy. Safe to retry with a key. */
export class UnavailableError extends ApiError {
  /** The server's `Retry-After`, in milliseconds, when it sent one. */
  readonly retryAfterMs: number | undefined;
  constructor(problem: Problem, status: number, retryAfterMs?: number) {
    super(problem, status);
    this.retryAfterMs = retryAfterMs;
  }
}

/** 500 `internal`. */
export class InternalError extends ApiError {}

/** The server could not be reached, or the connection broke before an answer. */
export class ConnectionError extends IdemqError {
  readonly method: string;
  readonly path: string;
  constructor(message: string, method: string, path: string, options?: { cause?: unknown }) {
    super(message, options);
    this.method = method;
    this.path = path;
  }
}

/** No answer within the client's timeout. */
export class TimeoutError extends ConnectionError {
  readonly timeoutMs: number;
  constructor(method: string, path: string, timeoutMs: number) {
    super(`${method} ${path}: no answer within ${timeoutMs} ms`, method, path);
    this.timeoutMs = timeoutMs;
  }
}

/** Whether `err` is an {@link IdemqError} whose `retryable` is true. */
export function isRetryable(err: unknown): boolean {
  return err instanceof IdemqError && err.retryable;
}

/** The problem types this client maps to their own error class. */
export const PROBLEM_TYPES = {
  "bad-request": BadRequestError,
  validation: ValidationError,
  "idempotency-conflict": EnqueueIdempotencyConflictError,
  "lease-lost": LeaseLostError,
  "not-dead": NotDeadError,
  "not-found": NotFoundError,
  unauthorized: UnauthorizedError,
  "forbidden-host": ForbiddenHostError,
  "method-not-allowed": MethodNotAllowedError,
  "payload-too-large": PayloadTooLargeError,
  unavailable: UnavailableError,
  internal: InternalError,
} as const;

/**
 * The class of a problem whose type this client does not know (or that has
 * none), by HTTP status. 409 is left out on purpose: it is one of three
 * distinct errors, and a guess would mislead.
 */
const BY_STATUS: Record<number, keyof typeof PROBLEM_TYPES> = {
  400: "bad-request",
  401: "unauthorized",
  403: "forbidden-host",
  404: "not-found",
  405: "method-not-allowed",
  413: "payload-too-large",
  422: "validation",
  500: "internal",
  503: "unavailable",
};

function str(v: unknown): string | undefined {
  return typeof v === "string" ? v : undefined;
}

/** `/problems/validation` (or an absolute URI ending so) → `validation`. */
function problemName(type: unknown): string {
  if (typeof type !== "string" || type === "" || type === "about:blank") return "";
  const cut = type.lastIndexOf("/problems/");
  return cut >= 0 ? type.slice(cut + "/problems/".length) : type;
}

/** Replaces every occurrence of each secret in every string of `value`. */
export function scrub<T>(value: T, secrets: readonly string[]): T {
  const live = secrets.filter((s) => s.length > 0).sort((a, b) => b.length - a.length);
  if (live.length === 0) return value;
  const walk = (v: unknown): unknown => {
    if (typeof v === "string") {
      let s = v;
      for (const secret of live) s = s.split(secret).join("[redacted]");
      return s;
    }
    if (Array.isArray(v)) return v.map(walk);
    if (v && typeof v === "object") {
      const out: Record<string, unknown> = {};
      for (const [k, inner] of Object.entries(v)) out[walk(k) as string] = walk(inner);
      return out;
    }
    return v;
  };
  return walk(value) as T;
}

/** Parses `Retry-After` (delay-seconds or an HTTP date) into milliseconds. */
export function parseRetryAfter(value: string | null | undefined, now = Date.now()): number | undefined {
  if (!value) return undefined;
  const trimmed = value.trim();
  if (/^\d+(\.\d+)?$/.test(trimmed)) return Math.round(Number(trimmed) * 1000);
  const at = Date.parse(trimmed);
  if (Number.isNaN(at)) return undefined;
  return Math.max(0, at - now);
}

/**
 * The typed error of one problem document. `secrets` are the raw keys of the
 * request, blanked from the problem before anything keeps it.
 */
export function errorFromProblem(
  raw: unknown,
  status: number,
  secrets: readonly string[] = [],
  headers?: { get(name: string): string | null },
): ApiError {
  let problem: Problem;
  if (raw && typeof raw === "object" && !Array.isArray(raw)) {
    problem = { ...(raw as Record<string, unknown>) } as Problem;
    if (typeof problem.type !== "string") problem.type = "";
  } else {
    problem = { type: "", detail: typeof raw === "string" && raw.trim() !== "" ? raw.trim().slice(0, 2048) : undefined };
    if (problem.detail === undefined) delete problem.detail;
  }
  problem = scrub(problem, secrets);
  if (typeof problem.status !== "number") problem.status = status;
  // The class: the problem type's, or, for a type this client does not know
  // (or none), the HTTP status's. An unknown type stays on the error
  // (`problemType`, `problem.type`); a missing one is named after the status.
  let kind = problemName(problem.type);
  if (!Object.hasOwn(PROBLEM_TYPES, kind)) {
    const byStatus = Object.hasOwn(BY_STATUS, status) ? BY_STATUS[status] : undefined;
    if (kind === "" && byStatus) problem.type = `/problems/${byStatus}`;
    kind = byStatus ?? "";
  }
  switch (kind) {
    case "method-not-allowed": {
      const allow = (headers?.get("allow") ?? "").split(",").map((m) => m.trim()).filter(Boolean);
      return new MethodNotAllowedError(problem, status, allow);
    }
    case "unavailable":
      return new UnavailableError(problem, status, parseRetryAfter(headers?.get("retry-after")));
    case "":
      return new ApiError(problem, status);
    default:
      return new (PROBLEM_TYPES as Record<string, new (p: Problem, s: number) => ApiError>)[kind]!(problem, status);
  }
}
