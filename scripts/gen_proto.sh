#!/usr/bin/env bash
# Regenerates the Python code for proto/querator/v1 into the client package.
# The output is committed; CI runs this and fails when it differs.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
py="${PYTHON:-$root/.venv/bin/python}"
bindir="$(dirname "$py")"
out=clients/python/src
rm -f "$out"/querator/v1/*_pb2*.py "$out"/querator/v1/*_pb2*.pyi
PATH="$bindir:$PATH" "$py" -m grpc_tools.protoc -Iproto \
  --python_out="$out" --mypy_out="$out" \
  --grpc_python_out="$out" --mypy_grpc_out="$out" \
  proto/querator/v1/*.proto
