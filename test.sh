#!/usr/bin/env bash
# Quick start, command 2: set everything up (first time only) and run the default test suite.
# Extra arguments go to pytest: `./test.sh tests/engine -x`, `./test.sh -m slow`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
if [ $# -eq 0 ]; then set -- -m "not slow and not gpu and not multinode"; fi
set +e
"$ROOT/.venv/bin/python" -m pytest -q -ra "$@"
rc=$?
set -e
# pytest exits 5 when nothing was collected; that is a failure of the suite, not a pass.
exit $rc
