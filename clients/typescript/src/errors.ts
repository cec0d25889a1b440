/**
 * Every error the client throws: one class per case a caller handles differently,
 * chosen from the gRPC status code and, where one code means different things, from
 * the call. The same tree as the Python SDK's `querator.errors`:
 *
 *     QueratorError                 base: .code (Connect's Code), .status (its gRPC name)
 *      ├── InvalidRequest           INVALID_ARGUMENT; .fieldViolations from google.rpc.BadRequest
 *      ├── NotFound                 NOT_FOUND
 *      │    ├── QueueNotFound       no such queue (or it was deleted)
 *      │    └── ItemNotFound   (*)  an id that does not exist (any more)
 *      ├── QueueExists              ALREADY_EXISTS
 *      ├── FailedPrecondition       FAILED_PRECONDITION
 *      │    └── NotLeased      (*)  an id that exists but is not leased, or whose lease ran out
 *      ├── Overloaded               RESOURCE_EXHAUSTED
 *      ├── Unavailable              UNAVAILABLE (safe to retry)
 *      ├── Unauthenticated          UNAUTHENTICATED: no API key, or one the server does not know
 *      ├── PermissionDenied         PERMISSION_DENIED
 *      ├── DeadlineExceeded         DEADLINE_EXCEEDED
 *      ├── Cancelled                CANCELLED (also: the call's AbortSignal fired)
 *      └── ServerError              any other status
 *
 * (*) JavaScript has single inheritance: `LeaseLost` ("this lease is no longer mine",
 * on Complete, Retry and Extend) is not a base class here but `isLeaseLost(error)`,
 * true for ItemNotFound and NotLeased.
 *
 * `DeadLetter` is not a server error: throw it from a Worker handler to send the item
 * to the dead-letter queue instead of retrying it.
 */
import { BinaryReader } from "@bufbuild/protobuf/wire";
import { Code, ConnectError } from "@connectrpc/connect";

import type { ProduceResult, RedriveResult } from "./models.js";

/** One bad field of a request, as the server's google.rpc.BadRequest names it. */
export interface FieldViolation {
  readonly field: string;
  readonly description: string;
}

/** The gRPC status names, by Connect's Code. */
const STATUS_NAMES: Record<number, string> = {
  [Code.Canceled]: "CANCELLED",
  [Code.Unknown]: "UNKNOWN",
  [Code.InvalidArgument]: "INVALID_ARGUMENT",
  [Code.DeadlineExceeded]: "DEADLINE_EXCEEDED",
  [Code.NotFound]: "NOT_FOUND",
  [Code.AlreadyExists]: "ALREADY_EXISTS",
  [Code.PermissionDenied]: "PERMISSION_DENIED",
  [Code.ResourceExhausted]: "RESOURCE_EXHAUSTED",
  [Code.FailedPrecondition]: "FAILED_PRECONDITION",
  [Code.Aborted]: "ABORTED",
  [Code.OutOfRange]: "OUT_OF_RANGE",
  [Code.Unimplemented]: "UNIMPLEMENTED",
  [Code.Internal]: "INTERNAL",
  [Code.Unavailable]: "UNAVAILABLE",
  [Code.DataLoss]: "DATA_LOSS",
  [Code.Unauthenticated]: "UNAUTHENTICATED",
};

/** Base class of every error a Querator call throws. */
export class QueratorError extends Error {
  /** The status code (Connect's `Code`, numerically the gRPC code), or undefined. */
  readonly code: Code | undefined;

  constructor(message: string, code?: Code, options?: { cause?: unknown }) {
    super(code === undefined ? message : `${STATUS_NAMES[code] ?? "UNKNOWN"}: ${message}`, options);
    this.name = new.target.name;
    this.code = code;
    this.rawMessage = message;
  }

  /** The server's message without the status prefix. */
  readonly rawMessage: string;

  /** For a produce() that stored some batches before failing: what was stored (ids ""
   * for the items that were not). */
  produced: ProduceResult | undefined;

  /** For a redriveItems() that moved items before a call failed: what those calls moved. */
  redriven: RedriveResult | undefined;

  /** The status code's gRPC name, e.g. "NOT_FOUND" ("UNKNOWN" when there is none). */
  get status(): string {
    return this.code === undefined ? "UNKNOWN" : (STATUS_NAMES[this.code] ?? "UNKNOWN");
  }
}

/** The request is malformed (INVALID_ARGUMENT); `fieldViolations` names each bad field. */
export class InvalidRequest extends QueratorError {
  readonly fieldViolations: readonly FieldViolation[];

  constructor(message: string, code?: Code, fieldViolations: FieldViolation[] = [], options?: { cause?: unknown }) {
    super(message, code ?? Code.InvalidArgument, options);
    this.fieldViolations = fieldViolations;
  }
}

/** NOT_FOUND: the queue or the item does not exist. */
export class NotFound extends QueratorError {}
/** The queue does not exist (or was deleted). */
export class QueueNotFound extends NotFound {}
/** An id passed to Complete, Retry or Extend does not exist (any more). A lease lost. */
export class ItemNotFound extends NotFound {}
/** ALREADY_EXISTS: a queue of that name exists. */
export class QueueExists extends QueratorError {}
/** FAILED_PRECONDITION: the current state forbids the operation. */
export class FailedPrecondition extends QueratorError {}
/** An id passed to Complete, Retry or Extend is not leased, or its lease ran out. A lease lost. */
export class NotLeased extends FailedPrecondition {}
/** RESOURCE_EXHAUSTED: the queue is overloaded or the request is too big. */
export class Overloaded extends QueratorError {}
/** UNAVAILABLE: the server is shutting down, its storage is failing or it cannot be reached. */
export class Unavailable extends QueratorError {}
/** UNAUTHENTICATED: the server requires an API key and the call had none it accepts. */
export class Unauthenticated extends QueratorError {}
/** PERMISSION_DENIED: the key may not make this call on this queue. */
export class PermissionDenied extends QueratorError {}
/** DEADLINE_EXCEEDED: the call's deadline passed before the server answered. */
export class DeadlineExceeded extends QueratorError {}
/** CANCELLED: the call was cancelled (its AbortSignal fired, or the client was closed). */
export class Cancelled extends QueratorError {}
/** Any other status (UNKNOWN, INTERNAL, UNIMPLEMENTED, ...): a bug or a mismatched server. */
export class ServerError extends QueratorError {}

/** The lease named by an id is no longer the caller's: ItemNotFound or NotLeased. */
export function isLeaseLost(error: unknown): error is ItemNotFound | NotLeased {
  return error instanceof ItemNotFound || error instanceof NotLeased;
}

/** Throw from a Worker handler to send the item to the dead-letter queue, without retrying it. */
export class DeadLetter extends Error {
  constructor(message = "sent to the dead-letter queue by the handler", options?: { cause?: unknown }) {
    super(message, options);
    this.name = "DeadLetter";
  }
}

/** A Worker's handler ran past its `handlerTimeoutMs`: the worker aborted its signal,
 * stopped waiting for it and retries the item (or dead-letters it by the rules, or on
 * its last attempt). JavaScript cannot stop a running promise: a handler that ignores
 * its signal runs on to its end (the limit is soft, as the Python worker's thread mode). */
export class HandlerTimeout extends Error {
  constructor(message: string, options?: { cause?: unknown }) {
    super(message, options);
    this.name = "HandlerTimeout";
  }
}

type ErrorClass = new (message: string, code?: Code, options?: { cause?: unknown }) => QueratorError;

const BY_CODE: Partial<Record<Code, ErrorClass>> = {
  [Code.NotFound]: NotFound,
  [Code.AlreadyExists]: QueueExists,
  [Code.FailedPrecondition]: FailedPrecondition,
  [Code.ResourceExhausted]: Overloaded,
  [Code.Unavailable]: Unavailable,
  [Code.Unauthenticated]: Unauthenticated,
  [Code.PermissionDenied]: PermissionDenied,
  [Code.DeadlineExceeded]: DeadlineExceeded,
  [Code.Canceled]: Cancelled,
};

const BAD_REQUEST = "google.rpc.BadRequest";

/** What kind of call failed: the same status means different things to them. */
export interface CallKind {
  /** The call names leased ids (Complete, Retry, Extend, a Lease that completes). */
  itemCall?: boolean;
  /** A KeysService call: NOT_FOUND is then a missing key. */
  keyCall?: boolean;
}

function isQueueMessage(message: string): boolean {
  return message.startsWith("queue ") && (message.includes("does not exist") || message.includes("was deleted"));
}

/** The error for a status `code` and its message. */
export function fromStatus(
  code: Code,
  message: string,
  fieldViolations: FieldViolation[] = [],
  kind: CallKind = {},
  cause?: unknown,
): QueratorError {
  const options = cause === undefined ? undefined : { cause };
  if (code === Code.InvalidArgument) return new InvalidRequest(message, code, fieldViolations, options);
  let cls: ErrorClass = BY_CODE[code] ?? ServerError;
  if (cls === NotFound && !kind.keyCall) {
    cls = kind.itemCall && !isQueueMessage(message) ? ItemNotFound : QueueNotFound;
  } else if (cls === FailedPrecondition && kind.itemCall && !message.includes("client_id")) {
    cls = NotLeased;
  }
  return new cls(message, code, options);
}

/** Map anything a Connect call threw to a QueratorError (an AbortError becomes Cancelled). */
export function fromConnectError(error: unknown, kind: CallKind = {}): QueratorError {
  if (error instanceof QueratorError) return error;
  const connect = ConnectError.from(error);
  const violations: FieldViolation[] = [];
  for (const detail of connect.details) {
    if ("type" in detail && detail.type === BAD_REQUEST) {
      violations.push(...decodeBadRequest(detail.value));
    }
  }
  // A failure of the connection itself (a TLS handshake the client refused, say, or a
  // connection reset by a server that died) is reported by Connect as INTERNAL, UNKNOWN
  // or ABORTED with the socket's error as its cause: no server answered, so it is
  // Unavailable, as gRPC's own clients report it.
  const cause: unknown = connect.cause;
  if ((connect.code === Code.Internal || connect.code === Code.Unknown || connect.code === Code.Aborted) && cause instanceof Error && typeof (cause as NodeJS.ErrnoException).code === "string") {
    return fromStatus(Code.Unavailable, `connection failed: ${connect.rawMessage}`, [], kind, error);
  }
  return fromStatus(connect.code, connect.rawMessage, violations, kind, error);
}

/**
 * google.rpc.BadRequest's field violations, read off the wire: `repeated FieldViolation
 * field_violations = 1` of `{string field = 1; string description = 2}`. Two fields
 * do not justify bundling the googleapis protos; a garbled detail must not hide the
 * real error, so it yields what it could read.
 */
function decodeBadRequest(bytes: Uint8Array): FieldViolation[] {
  const out: FieldViolation[] = [];
  try {
    const reader = new BinaryReader(bytes);
    while (reader.pos < reader.len) {
      const [field, wireType] = reader.tag();
      if (field !== 1) {
        reader.skip(wireType);
        continue;
      }
      const inner = new BinaryReader(reader.bytes());
      let name = "";
      let description = "";
      while (inner.pos < inner.len) {
        const [f, w] = inner.tag();
        if (f === 1) name = inner.string();
        else if (f === 2) description = inner.string();
        else inner.skip(w);
      }
      out.push({ field: name, description });
    }
  } catch {
    // keep what was read
  }
  return out;
}
