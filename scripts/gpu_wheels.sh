#!/usr/bin/env bash
# Wheels for a GPU machine that has torch, transformers and CuPy but not Ray (the device machines
# here): Ray (its Java jars and dashboard build dropped, to fit a 64 MiB carry) and what it imports
# that such a machine lacks. Written to .whl/ (git ignores *.whl); install there with
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
# then run scripts/gpu_check.sh (its Ray tests run instead of skipping).
#
#   scripts/gpu_wheels.sh [PYTHON_VERSION]      (default 3.12, the GPU machine's)
set -euo pipefail
cd "$(dirname "$0")/.."
PYV="${1:-3.12}"
PY=.venv/bin/python
RAY_VERSION="$("$PY" -c 'import ray; print(ray.__version__)')"
TMP="$(mktemp -d)"
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$TMP" \
    "ray==$RAY_VERSION" jsonschema jsonschema-specifications referencing rpds-py
"$PY" - "$TMP" .whl <<'PY'
import glob, os, shutil, sys, zipfile
src_dir, out = sys.argv[1], sys.argv[2]
drop = lambda n: n.startswith(("ray/jars/", "ray/dashboard/client/build/")) or n.endswith(".js.map")
for path in glob.glob(os.path.join(src_dir, "*.whl")):
    dst = os.path.join(out, os.path.basename(path))
    if not os.path.basename(path).startswith("ray-"):
        shutil.copy(path, dst)
        continue
    with zipfile.ZipFile(path) as zi, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zo:
        for info in zi.infolist():
            if drop(info.filename):
                continue
            data = zi.read(info)
            if info.filename.endswith(".dist-info/RECORD"):  # the dropped files leave the record too
                data = b"".join(l + b"\n" for l in data.splitlines() if not drop(l.split(b",")[0].decode()))
            zo.writestr(info, data)
PY
rm -rf "$TMP"
du -ch .whl/*.whl | tail -1
