#!/usr/bin/env bash
# Start pdserve locally: fetch the model if missing, build in release, run.
#
#   PDSERVE_PORT   the router's port (default 8000)
#   extra arguments are passed to the router
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
"$ROOT/deploy/local/fetch-model.sh"
cargo build --release --workspace
if [[ ! -x target/release/pdserve-router ]]; then
    echo "pdserve-router is not part of this build yet: the engine is ready" >&2
    echo "(try: target/release/pdserve-loadtest engine --model models/SmolLM2-135M-Instruct.Q4_1.gguf)" >&2
    exit 1
fi
exec target/release/pdserve-router --port "${PDSERVE_PORT:-8000}" "$@"
