/**
 * Querator for TypeScript: a client for the Querator lease-based FIFO work-queue service.
 *
 *     import { Client, Worker } from "@querator/client";
 *
 *     const client = new Client({ address: "127.0.0.1:2319" });
 *     await client.createQueue("emails");
 *     await client.produce("emails", ["hello", "world"]);
 *     const worker = new Worker(client, "emails", async (item) => console.log(item.text));
 *     await worker.run();   // until worker.stop() or SIGTERM
 *
 * The generated messages and service descriptors are in "@querator/client/v1", not
 * here. Three of the client's plain-object types share a name with a generated message:
 * `ApiKey`, `QueueInfo` and `PartitionStats` here are what the client's methods take and
 * return (milliseconds, Dates, no protobuf); the messages of the same names are in
 * "@querator/client/v1" (import them under another name when both are needed:
 * `import { QueueInfo as QueueInfoMessage } from "@querator/client/v1"`). The Python SDK
 * names them the same way (`querator.QueueInfo` beside `querator.v1.queues_pb2.QueueInfo`).
 *
 * Every name exported is listed below; the modules behind them are private.
 */
export { Client, DEFAULT_ADDRESS, MAX_BATCH, type CallOptions, type ClientOptions, type TlsOptions } from "./client.js";
export {
  Cancelled,
  DeadLetter,
  DeadlineExceeded,
  FailedPrecondition,
  HandlerTimeout,
  InvalidRequest,
  ItemNotFound,
  NotFound,
  NotLeased,
  Overloaded,
  PermissionDenied,
  QueratorError,
  QueueExists,
  QueueNotFound,
  ServerError,
  Unauthenticated,
  Unavailable,
  isLeaseLost,
  type FieldViolation,
} from "./errors.js";
export { MAX_ERROR_BYTES, failureText } from "./failure.js";
export { LeasedItem, type LeaseState, type RetryOptions } from "./items.js";
export type {
  ApiKey,
  ClusterMember,
  ClusterView,
  CompleteResult,
  CreatedKey,
  DeadReason,
  ExtendResult,
  Item,
  ItemHistory,
  ItemRef,
  Page,
  PartitionStats,
  Payload,
  ProduceInput,
  ProduceResult,
  PromotedCopy,
  QueueInfo,
  QueueSettings,
  QueueStats,
  RedriveResult,
  ReplicaSet,
  RetiredNode,
  RetryResult,
  Role,
  StoredItem,
} from "./models.js";
export type { RedriveOptions } from "./operations.js";
export { Pager } from "./paging.js";
export type { Logger } from "./routing.js";
export { RetryPolicy, backoff, type ErrorClass } from "./retry.js";
export {
  Worker,
  defaultWorkerHooks,
  type Handler,
  type KindHandler,
  type KindOptions,
  type RunOptions,
  type WorkerHooks,
  type WorkerOptions,
  type WorkerStats,
} from "./worker.js";
export { FailureLog, RetryRule, type DeadOn, type ErrorType, type RetryOn } from "./failures.js";
export type { MetricsRegistry } from "./metrics.js";
