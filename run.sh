#!/usr/bin/env bash
# Quick start, command 1: set everything up (first time only) and run pdserve.
# With no arguments it starts the OpenAI-compatible server on the embedded model: `./run.sh`.
# Any arguments are passed to the `pdserve` CLI: `./run.sh demo`, `./run.sh serve --decode-workers 2`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bash "$ROOT/scripts/setup.sh"
if [ $# -eq 0 ]; then set -- serve; fi
exec "$ROOT/.venv/bin/pdserve" "$@"
