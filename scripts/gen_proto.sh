#!/usr/bin/env bash
# Regenerate deployments/frontend/grpc/pdserve_pb2.py and pdserve_pb2_grpc.py from proto/pdserve.proto.
# The generated files are committed; run this after editing the .proto and commit the result.
#
# protoc names imports after the .proto's path under its include root, so the file is mapped to
# the virtual path deployments/frontend/grpc/pdserve.proto: the _grpc stub then imports
# `from deployments.frontend.grpc import pdserve_pb2`, which works from any working directory.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
cd "$ROOT"
"$PY" -m grpc_tools.protoc \
  -Ideployments/frontend/grpc=proto \
  --python_out=. --pyi_out=. --grpc_python_out=. \
  deployments/frontend/grpc/pdserve.proto
echo "generated: $(ls deployments/frontend/grpc/pdserve_pb2*.py* | tr '\n' ' ')"
