"""Generated protobuf and gRPC modules for the querator.v1 API."""
