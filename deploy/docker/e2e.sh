#!/usr/bin/env bash
# End-to-end test of the container image: builds deploy/docker/Dockerfile on
# a Debian base made here by debootstrap (no registry needed), runs the
# router, a prefill and a decode worker as three containers on the host
# network with an internal token, serves a chat request with the official
# `openai` SDK, then stops the containers (`docker stop`: SIGTERM, a drain)
# with requests in flight. Passes when every request finished and both
# workers exited 0 holding no KV. Prints the image size.
#
#   deploy/docker/e2e.sh      # after `cargo build --release` (PDSERVE_BIN_DIR to override)
#
# Needs root. Installs Debian's docker.io and debootstrap when missing. Its
# own dockerd (data and exec roots under a temporary folder, no bridge, no
# iptables) is stopped by PID at the end. The debootstrap base is cached as
# a tarball in $PDSERVE_DOCKER_CACHE (default ~/.cache/pdserve/docker).
# The image gets the binaries of $PDSERVE_BIN_DIR (BINARIES=prebuilt):
# compiling inside the build would need a Rust image from a registry.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BIN="${PDSERVE_BIN_DIR:-$ROOT/target/release}"
MODEL_DIR="${PDSERVE_MODEL_DIR:-$ROOT/models}"
MODEL_FILE="SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE="${PDSERVE_DOCKER_CACHE:-$HOME/.cache/pdserve/docker}"
REQUESTS="${REQUESTS:-4}"
D="$(mktemp -d "${TMPDIR:-/tmp}/pdserve-docker.XXXXXX")"
# shellcheck source=deploy/docker/lib.sh
source "$ROOT/deploy/docker/lib.sh"

log() { echo "docker-e2e: $*" >&2; }
fail() {
    log "FAILED: $*"
    for c in router prefill decode; do
        echo "--- $c" >&2
        dk logs "pd-$c" 2>&1 | tail -n 30 >&2 || true
    done
    exit 1
}

cleanup() {
    local rc=$?
    if [[ -n "$DOCKERD_PID" ]]; then
        dk rm -f pd-router pd-prefill pd-decode >/dev/null 2>&1 || true
    fi
    stop_dockerd
    rm -rf "$D" 2>/dev/null || true
    exit "$rc"
}
trap cleanup EXIT

[[ "$(id -u)" == 0 ]] || { log "needs root (dockerd)"; exit 1; }
for b in pdserve-router pdserve-prefill pdserve-decode; do
    [[ -x "$BIN/$b" ]] || { log "no $BIN/$b: run cargo build --release first"; exit 1; }
done
[[ -f "$MODEL_DIR/$MODEL_FILE" ]] || "$ROOT/deploy/local/fetch-model.sh"
install_docker

start_dockerd
build_image
# The internal token, readable by the image's user (uid 10001) only.
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$D/token"
chown 10001 "$D/token" && chmod 400 "$D/token"
read -r PORT < <(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
URL="http://127.0.0.1:$PORT"
run() {
    local name="$1"
    shift
    dk run -d --name "pd-$name" --network host \
        -v "$MODEL_DIR:/models:ro" -v "$D/token:/run/secrets/pdserve-token:ro" \
        -e PDSERVE_INTERNAL_TOKEN_FILE=/run/secrets/pdserve-token -e PDSERVE_HOST=127.0.0.1 \
        -e PDSERVE_DRAIN_SECONDS=30 pdserve:e2e "$@" >/dev/null
}
run router pdserve-router --port "$PORT"
run prefill pdserve-prefill --port 0 --router-url "$URL" --threads 1
run decode pdserve-decode --port 0 --router-url "$URL" --threads 1

# The official SDK, beside the checkout unless it is importable already.
if ! python3 -c "import openai" 2>/dev/null; then
    python3 -m pip install -q --disable-pip-version-check --target "$D/py" openai >"$D/pip.log" 2>&1 ||
        { tail -20 "$D/pip.log" >&2; fail "cannot install the openai SDK"; }
    export PYTHONPATH="$D/py${PYTHONPATH:+:$PYTHONPATH}"
fi
started=$SECONDS
until curl -sf "$URL/ready" >/dev/null && curl -sf "$URL/v1/models" | grep -q '"id"'; do
    ((SECONDS - started < 120)) || fail "the router was not ready after 120 s"
    sleep 1
done
python3 - "$URL" <<'PY' || fail "the SDK request failed"
import sys
from openai import OpenAI
client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused")
model = client.models.list().data[0].id
r = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
    max_tokens=24)
assert r.choices[0].message.content, r
stream = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Count to five."}],
    max_tokens=16, stream=True)
text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
assert text, "empty stream"
print(f"docker-e2e: the openai SDK got {r.usage.completion_tokens} tokens, then a stream: {text!r}",
      file=sys.stderr)
PY

# Requests in flight, then `docker stop` (SIGTERM): each container drains.
MODEL_ID="$(curl -sS "$URL/v1/models" | python3 -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')"
clients=()
for i in $(seq "$REQUESTS"); do
    curl -sS --max-time 120 "$URL/v1/chat/completions" -H 'content-type: application/json' \
        -d "{\"model\":\"$MODEL_ID\",\"messages\":[{\"role\":\"user\",\"content\":\"Tell me a story about $i.\"}],\"max_tokens\":64,\"ignore_eos\":true}" \
        >"$D/req-$i.json" 2>&1 &
    clients+=($!)
done
sleep 2
dk stop -t 60 pd-router pd-prefill pd-decode >/dev/null &
stopper=$!
log "docker stop with $REQUESTS requests in flight"
wait "${clients[@]}" || true
wait "$stopper" || fail "docker stop failed"
for i in $(seq "$REQUESTS"); do
    python3 -c 'import json, sys; b = json.load(open(sys.argv[1])); assert b["usage"]["completion_tokens"] == 64, b' \
        "$D/req-$i.json" 2>/dev/null || fail "a request in flight at docker stop was lost: $(cat "$D/req-$i.json")"
done
log "all $REQUESTS requests in flight at docker stop finished (64 tokens each)"
for c in router prefill decode; do
    code="$(dk inspect -f '{{.State.ExitCode}}' "pd-$c")"
    [[ "$code" == 0 ]] || fail "pd-$c exited with $code"
done
for c in prefill decode; do
    dk logs "pd-$c" 2>&1 | grep -q 'stopped.*active_sequences=0 queued_requests=0 kv_used_tokens=0' ||
        fail "pd-$c did not stop clean"
done
log "all three exited 0, both workers drained holding no KV; passed"
