#!/usr/bin/env bash
# Start pdserve on this machine: fetch the model if missing, build in release,
# then run the router with one prefill and one decode worker in the
# foreground. Ctrl-C stops everything (the workers drain first).
#
#   PDSERVE_PORT   the router's port (default 8000)
#   PDSERVE_INTERNAL_TOKEN, PDSERVE_INTERNAL_TOKEN_FILE
#                  the internal plane's shared secret (default: a random one
#                  per run, never printed; docs/deploy.md)
#   extra arguments are passed to the router (see: pdserve-router --help)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
MODEL="${PDSERVE_MODEL:-$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
PORT="${PDSERVE_PORT:-8000}"

"$ROOT/deploy/local/fetch-model.sh"
cargo build --release --workspace

# Every internal call (router <-> workers) carries this bearer token. Exported,
# so the router and the workers it spawns share it.
if [[ -z "${PDSERVE_INTERNAL_TOKEN:-}" && -z "${PDSERVE_INTERNAL_TOKEN_FILE:-}" ]]; then
    PDSERVE_INTERNAL_TOKEN="$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')"
    export PDSERVE_INTERNAL_TOKEN
fi

target/release/pdserve-router \
    --port "$PORT" \
    --model "$MODEL" \
    --local-prefill "${PDSERVE_LOCAL_PREFILL:-1}" \
    --local-decode "${PDSERVE_LOCAL_DECODE:-1}" \
    "$@" &
ROUTER=$!
trap 'kill -TERM "$ROUTER" 2>/dev/null || true; wait "$ROUTER"' INT TERM

# GET /ready without needing curl on the machine.
ready() {
    exec 3<>"/dev/tcp/127.0.0.1/$PORT" || return 1
    printf 'GET /ready HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' >&3
    local status
    read -r _ status _ <&3 || true
    exec 3<&-
    [[ "$status" == 200 ]]
}

for _ in $(seq 1 240); do
    if ready 2>/dev/null; then
        NAME="$(basename "$MODEL" .gguf)"
        cat <<MSG

pdserve is ready at http://127.0.0.1:$PORT/v1  (model: $NAME)

  curl http://127.0.0.1:$PORT/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"model": "$NAME", "messages": [{"role": "user", "content": "What is the capital of France?"}]}'

Ctrl-C stops the router and its workers.
MSG
        break
    fi
    kill -0 "$ROUTER" 2>/dev/null || break
    sleep 0.5
done
wait "$ROUTER"
