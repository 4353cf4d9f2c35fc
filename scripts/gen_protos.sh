#!/usr/bin/env bash
# Regenerates the Python modules of tokenserve's own protos (committed to the repo).
# Needs grpcio-tools (not a runtime dependency): pass a Python that has it, e.g.
#   python -m venv /tmp/gt && /tmp/gt/bin/pip install grpcio-tools==1.85.1
#   PYTHON=/tmp/gt/bin/python bash scripts/gen_protos.sh
# The generated code must not need a newer protobuf than the runtime pin in pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-/tmp/gt/bin/python}"
# Protos live under src/ so the generated imports are package paths
# (tokenserve.server.proto.tokenserve.generation_pb2), not a top-level `tokenserve` module.
"$PYTHON" -m grpc_tools.protoc -I src \
  --python_out=src --pyi_out=src --grpc_python_out=src \
  src/tokenserve/server/proto/tokenserve/generation.proto
echo "generated: $(ls src/tokenserve/server/proto/tokenserve/*_pb2*.py*)"
