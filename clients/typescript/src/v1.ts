/** The generated querator.v1 messages, enums and service descriptors (protoc-gen-es),
 * for callers who build their own Connect clients. */
export * from "./gen/querator/v1/cluster_pb.js";
export * from "./gen/querator/v1/keys_pb.js";
export * from "./gen/querator/v1/queue_pb.js";
export * from "./gen/querator/v1/queues_pb.js";
export * from "./gen/querator/v1/storage_pb.js";
