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
DOCKERD_PID=""

log() { echo "docker-e2e: $*" >&2; }
# The client of Debian's docker.io, which builds with the daemon's own
# BuildKit; a newer client elsewhere in PATH would want the buildx plugin.
DOCKER="${DOCKER:-/usr/bin/docker}"
dk() { "$DOCKER" -H "unix://$D/docker.sock" "$@"; }
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
        kill "$DOCKERD_PID" 2>/dev/null || true
        for _ in $(seq 100); do
            kill -0 "$DOCKERD_PID" 2>/dev/null || break
            sleep 0.1
        done
        kill -9 "$DOCKERD_PID" 2>/dev/null || true
    fi
    # Whatever dockerd left mounted under its roots.
    grep -o " $D/[^ ]*" /proc/mounts | sort -r | xargs -r -n1 umount -l 2>/dev/null || true
    rm -rf "$D" 2>/dev/null || true
    exit "$rc"
}
trap cleanup EXIT

[[ "$(id -u)" == 0 ]] || { log "needs root (dockerd)"; exit 1; }
for b in pdserve-router pdserve-prefill pdserve-decode; do
    [[ -x "$BIN/$b" ]] || { log "no $BIN/$b: run cargo build --release first"; exit 1; }
done
[[ -f "$MODEL_DIR/$MODEL_FILE" ]] || "$ROOT/deploy/local/fetch-model.sh"
if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
    log "installing docker.io and debootstrap"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io debootstrap >/dev/null
fi

dockerd --data-root "$D/root" --exec-root "$D/exec" -H "unix://$D/docker.sock" \
    --pidfile "$D/dockerd.pid" --bridge=none --iptables=false >"$D/dockerd.log" 2>&1 &
DOCKERD_PID=$!
for _ in $(seq 100); do
    dk info >/dev/null 2>&1 && break
    sleep 0.2
done
dk info >/dev/null 2>&1 || { tail -20 "$D/dockerd.log" >&2; fail "dockerd did not start"; }

# The base: Debian's minimal bootstrap, made once and cached.
BASE_TAR="$CACHE/debian-bookworm-minbase.tar"
if [[ ! -s "$BASE_TAR" ]]; then
    log "debootstrap --variant=minbase bookworm (once; about a minute)"
    mkdir -p "$CACHE"
    mirror="$(sed -n 's/^URIs: *\([^ ]*debian\)$/\1/p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)"
    debootstrap --variant=minbase bookworm "$D/rootfs" "${mirror:-http://deb.debian.org/debian}" >"$D/debootstrap.log" 2>&1 ||
        { tail -20 "$D/debootstrap.log" >&2; fail "debootstrap failed"; }
    tar -C "$D/rootfs" -cf "$BASE_TAR.part" . && mv "$BASE_TAR.part" "$BASE_TAR"
    rm -rf "$D/rootfs"
fi
dk import "$BASE_TAR" local/debian:bookworm >/dev/null

# The build context: the fetch script and the binaries (BINARIES=prebuilt).
mkdir -p "$D/ctx/prebuilt" "$D/ctx/deploy/local"
cp "$ROOT/deploy/local/fetch-model.sh" "$D/ctx/deploy/local/"
cp "$BIN"/pdserve-router "$BIN"/pdserve-prefill "$BIN"/pdserve-decode "$D/ctx/prebuilt/"
# The release profile keeps debug info for profiling; the image needs none.
if command -v strip >/dev/null; then strip --strip-debug "$D"/ctx/prebuilt/*; fi
started=$SECONDS
DOCKER_BUILDKIT=1 dk build --network host -f "$ROOT/deploy/docker/Dockerfile" \
    --build-arg BASE_IMAGE=local/debian:bookworm --build-arg BINARIES=prebuilt \
    -t pdserve:e2e "$D/ctx" >"$D/build.log" 2>&1 || { tail -30 "$D/build.log" >&2; fail "docker build failed"; }
size="$(dk image inspect pdserve:e2e --format '{{.Size}}')"
log "image pdserve:e2e built in $((SECONDS - started)) s: $((size / 1000000)) MB"

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
