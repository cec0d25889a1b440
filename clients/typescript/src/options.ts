/** What a Client is built with, and what every call takes. */
import type { Transport } from "@connectrpc/connect";

import type { RetryPolicy } from "./retry.js";
import type { Logger } from "./routing.js";

export const DEFAULT_ADDRESS = "127.0.0.1:2319";

/** Options every call takes: a deadline through an AbortSignal, and/or a timeout. */
export interface CallOptions {
  /** Abort the call (it then fails with Cancelled). `AbortSignal.timeout(ms)` is a deadline. */
  signal?: AbortSignal;
  /** The call's gRPC deadline in milliseconds (default: the client's timeoutMs). */
  timeoutMs?: number;
}

/** TLS settings: PEM strings or buffers. */
export interface TlsOptions {
  /** Root certificates to trust (default: Node's bundled roots). */
  ca?: string | Buffer;
  /** Client certificate chain and key, for mutual TLS. */
  cert?: string | Buffer;
  key?: string | Buffer;
  /** The name to check the server's certificate against (default: the host). */
  serverName?: string;
}

export interface ClientOptions {
  /** host:port of the server; default: $QUERATOR_ADDRESS, else 127.0.0.1:2319. */
  address?: string;
  /** A cluster's bootstrap addresses (host:port of some of its nodes; the first that
   * answers tells the client the rest). Instead of `address`. */
  addresses?: readonly string[];
  /** In a cluster: how often the client reads the cluster's map again. Default 30 s. */
  clusterRefreshMs?: number;
  /** Where the client logs (nodes going down and coming back): `console` fits.
   * Default: nothing is logged. */
  logger?: Logger;
  /** Retry a Produce after UNAVAILABLE even when it may have been stored (a reply lost
   * with its node): never loses an item, may store a batch twice. Default false: only a
   * Produce that never reached a server, or whose items all carry idempotency keys, is
   * retried. */
  retryProduce?: boolean;
  /** Retry Complete, Retry and a Lease with `complete` after UNAVAILABLE. Default true:
   * the server answers ids a first send already settled as done
   * (`CompleteResponse.alreadyCompleted`); set false against older servers, which
   * answer such a repeat NOT_FOUND. */
  retryComplete?: boolean;
  /** Deadline of each call in milliseconds (Lease: its wait plus leaseMarginMs). Default 30 s. */
  timeoutMs?: number;
  /** Extra time a Lease call gets over its wait before the client gives up. Default 5 s. */
  leaseMarginMs?: number;
  /** Use TLS: `true` for Node's default roots, or the certificates to use. */
  tls?: boolean | TlsOptions;
  /** Sent as `authorization: Bearer <token>` on every call. */
  bearerToken?: string;
  /** Metadata (headers) sent on every call. */
  metadata?: Record<string, string>;
  /** How many times a call that is safe to repeat is retried after UNAVAILABLE. Default 3. */
  retries?: number;
  /** The whole retry rule (tries, backoff, which errors) instead of `retries`; the
   * client's Worker backs off by it too. Default: `new RetryPolicy({ retries })`. */
  retryPolicy?: RetryPolicy;
  /** Produce requests one produce() keeps in flight. Default 4. */
  maxInFlight?: number;
  /** Send Produce and Lease requests over a ProduceStream / LeaseStream per queue
   * (default true), as the Python SDK does; unary calls with servers that lack them. */
  streams?: boolean;
  /** Full control: a Connect transport built by the caller (address and tls then unused;
   * no cluster routing: every call goes through it). */
  transport?: Transport;
}
