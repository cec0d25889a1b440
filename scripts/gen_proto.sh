#!/usr/bin/env bash
# Regenerates the Python code for proto/querator/v1 into the querator-proto package,
# plus querator_v1.binpb: a FileDescriptorSet of our files WITH source info
# (the proto comments), which the server's reflection service hands out so
# grpcurl describe shows the API reference. Imports (well-known types) are
# left out: the runtime descriptor pool already has them.
# The output is committed; CI runs this and fails when it differs.
set -euo pipefail
export LC_ALL=C
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
py="${PYTHON:-$root/.venv/bin/python}"
bindir="$(dirname "$py")"
out=clients/proto/src
rm -f "$out"/querator/v1/*_pb2*.py "$out"/querator/v1/*_pb2*.pyi "$out"/querator/v1/*.binpb
PATH="$bindir:$PATH" "$py" -m grpc_tools.protoc -Iproto \
  --python_out="$out" --mypy_out=quiet:"$out" \
  --grpc_python_out="$out" --mypy_grpc_out=quiet:"$out" \
  --descriptor_set_out="$out"/querator/v1/querator_v1.binpb --include_source_info \
  proto/querator/v1/*.proto
