/** One node's connection: its HTTP/2 session, the service clients over it, and the
 * Produce/Lease streams open on it. A Client has one (a single server) or one per
 * cluster member it has sent a call to. */
import { type Client as ConnectClient, type Transport, createClient } from "@connectrpc/connect";
import type { Http2SessionManager } from "@connectrpc/connect-node";

import { Cancelled, type QueratorError } from "./errors.js";
import { ClusterService } from "./gen/querator/v1/cluster_pb.js";
import { KeysService } from "./gen/querator/v1/keys_pb.js";
import { QueueService } from "./gen/querator/v1/queue_pb.js";
import { QueuesService } from "./gen/querator/v1/queues_pb.js";
import { StorageService } from "./gen/querator/v1/storage_pb.js";
import type { RequestStream } from "./streams.js";

export class NodeChannel {
  readonly address: string;
  /** The cluster node id behind `address` ("" for a single server or a bootstrap
   * address not yet matched to a member). */
  node = "";
  readonly queue: ConnectClient<typeof QueueService>;
  readonly queues: ConnectClient<typeof QueuesService>;
  readonly storage: ConnectClient<typeof StorageService>;
  readonly keys: ConnectClient<typeof KeysService>;
  readonly cluster: ConnectClient<typeof ClusterService>;
  /** The open ProduceStream and LeaseStream of each queue (key: kind and queue). */
  readonly streams = new Map<string, RequestStream<unknown, unknown>>();
  readonly #session: Http2SessionManager | undefined;

  constructor(address: string, transport: Transport, session?: Http2SessionManager) {
    this.address = address;
    this.#session = session;
    this.queue = createClient(QueueService, transport);
    this.queues = createClient(QueuesService, transport);
    this.storage = createClient(StorageService, transport);
    this.keys = createClient(KeysService, transport);
    this.cluster = createClient(ClusterService, transport);
  }

  /** Close the streams (their requests in flight fail with `error`) and, when this
   * channel owns its session, the connection. */
  close(error: QueratorError, dropConnection = false): void {
    for (const stream of this.streams.values()) stream.close(error);
    this.streams.clear();
    if (dropConnection) this.#session?.abort(new Cancelled("the node left the cluster"));
  }
}
