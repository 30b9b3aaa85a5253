export { Client, idempotencyHeader } from "./client.js";
export type { ClientOptions, RetryOptions, RequestOptions } from "./client.js";
export * from "./errors.js";
export type * from "./types.js";
export { Worker, JobContext, JobError, JobInterrupted } from "./worker.js";
export type { Handler, WorkerOptions, WorkerReport, InterruptReason } from "./worker.js";
