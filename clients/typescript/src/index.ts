export { Client, idempotencyHeader } from "./client.js";
export type { ClientOptions, RetryOptions, RequestOptions } from "./client.js";
export {
  IdemqError,
  ApiError,
  BadRequestError,
  ValidationError,
  EnqueueIdempotencyConflictError,
  LeaseLostError,
  NotDeadError,
  NotFoundError,
  UnauthorizedError,
  ForbiddenHostError,
  MethodNotAllowedError,
  PayloadTooLargeError,
  UnavailableError,
  InternalError,
  ConnectionError,
  TimeoutError,
  PROBLEM_TYPES,
} from "./errors.js";
export type { Problem } from "./errors.js";
export type * from "./types.js";
export { Worker, JobContext, JobError, JobInterrupted } from "./worker.js";
export type { Handler, WorkerOptions, WorkerReport, InterruptReason } from "./worker.js";
