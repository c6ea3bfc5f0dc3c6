# shellcheck shell=bash
# Shared by deploy/docker/e2e.sh and deploy/k8s/e2e.sh (sourced): a private
# dockerd under $D, and the pdserve image built in it on a debootstrap base.
# The caller defines ROOT, BIN, CACHE, D, and log and fail.

# The client of Debian's docker.io, which builds with the daemon's own
# BuildKit; a newer client elsewhere in PATH would want the buildx plugin.
DOCKER="${DOCKER:-/usr/bin/docker}"
DOCKERD_PID=""
dk() { "$DOCKER" -H "unix://$D/docker.sock" "$@"; }

install_docker() {
    if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null || [[ ! -x "$DOCKER" ]]; then
        log "installing docker.io and debootstrap"
        apt-get update -q
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io debootstrap >/dev/null
    fi
}

# dockerd with its data and exec roots under $D, no bridge, no iptables.
start_dockerd() {
    dockerd --data-root "$D/root" --exec-root "$D/exec" -H "unix://$D/docker.sock" \
        --pidfile "$D/dockerd.pid" --bridge=none --iptables=false >"$D/dockerd.log" 2>&1 &
    DOCKERD_PID=$!
    for _ in $(seq 100); do
        dk info >/dev/null 2>&1 && break
        sleep 0.2
    done
    dk info >/dev/null 2>&1 || { tail -20 "$D/dockerd.log" >&2; fail "dockerd did not start"; }
}

# The image pdserve:e2e: the Dockerfile on a Debian base made by debootstrap
# (once, cached in $CACHE), with the binaries of $BIN (BINARIES=prebuilt).
build_image() {
    local mirror started size BASE_TAR
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
}

# Stops the dockerd by PID and unmounts what it left under $D.
stop_dockerd() {
    if [[ -n "$DOCKERD_PID" ]]; then
        kill "$DOCKERD_PID" 2>/dev/null || true
        for _ in $(seq 100); do
            kill -0 "$DOCKERD_PID" 2>/dev/null || break
            sleep 0.1
        done
        kill -9 "$DOCKERD_PID" 2>/dev/null || true
    fi
    grep -o " $D/[^ ]*" /proc/mounts | sort -r | xargs -r -n1 umount -l 2>/dev/null || true
}
