#!/usr/bin/env bash
# End-to-end test of deploy/slurm/pdserve.sbatch on a real Slurm: a
# three-node cluster emulated on this machine (one slurmd per node, all on
# 127.0.0.1), the job submitted as a user would, chat requests through its
# router, then `scancel` while requests are in flight. Passes when every
# request finished, both workers drained and exited holding no KV.
#
#   deploy/slurm/e2e.sh        # after `cargo build --release` (PDSERVE_BIN_DIR to override)
#
# Needs root (munge and the Slurm daemons). Installs Debian's slurmctld,
# slurmd, slurm-client and munge when they are missing. Every daemon it
# starts gets its own state under a temporary folder and is stopped by PID
# at the end; a munged already running is used and left alone.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BIN="${PDSERVE_BIN_DIR:-$ROOT/target/release}"
REQUESTS="${REQUESTS:-6}"
D="$(mktemp -d "${TMPDIR:-/tmp}/pdserve-slurm.XXXXXX")"
export SLURM_CONF="$D/slurm.conf"
JOB=""
MUNGED_PID=""

log() { echo "slurm-e2e: $*" >&2; }
fail() {
    log "FAILED: $*"
    for f in "$D"/job-*.out "$D"/slurmctld.log; do
        [[ -f "$f" ]] && { echo "--- $f" >&2; tail -n 60 "$f" >&2; }
    done
    exit 1
}

cleanup() {
    local rc=$?
    if [[ -n "$JOB" ]]; then scancel "$JOB" 2>/dev/null || true; fi
    local pids=() p fd
    for f in "$D"/slurmd-*.pid "$D"/slurmctld.pid; do
        [[ -f "$f" ]] && pids+=("$(cat "$f")")
    done
    # Step daemons of this cluster's jobs (they write to its slurmd logs).
    for p in $(pgrep -x slurmstepd || true); do
        for fd in "/proc/$p/fd"/*; do
            if [[ "$(readlink "$fd" 2>/dev/null)" == "$D/"* ]]; then pids+=("$p"); break; fi
        done
    done
    [[ -n "$MUNGED_PID" ]] && pids+=("$MUNGED_PID")
    if ((${#pids[@]})); then
        kill "${pids[@]}" 2>/dev/null || true
        for _ in $(seq 50); do
            kill -0 "${pids[@]}" 2>/dev/null || break
            sleep 0.1
        done
        kill -9 "${pids[@]}" 2>/dev/null || true
    fi
    rm -rf "$D"
    exit "$rc"
}
trap cleanup EXIT

[[ "$(id -u)" == 0 ]] || { log "needs root (munge and the Slurm daemons)"; exit 1; }
for b in pdserve-router pdserve-prefill pdserve-decode; do
    [[ -x "$BIN/$b" ]] || { log "no $BIN/$b: run cargo build --release first"; exit 1; }
done
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null ||
    ! command -v sbatch >/dev/null || ! command -v munged >/dev/null; then
    log "installing slurmctld, slurmd, slurm-client and munge"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        slurmctld slurmd slurm-client munge >/dev/null
fi

# munge authenticates every Slurm message: start it unless one answers.
if ! munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
    mkdir -p /run/munge && chown munge:munge /run/munge
    # munged runs as munge, which may write in /run/munge only.
    pidfile="/run/munge/pdserve-e2e-$$.pid"
    runuser -u munge -- /usr/sbin/munged --pid-file="$pidfile" || fail "munged did not start"
    MUNGED_PID="$(cat "$pidfile")"
    rm -f "$pidfile"
fi

# Free ports for slurmctld, the three slurmds and the router.
read -r P_CTLD P_N1 P_N2 P_N3 P_ROUTER < <(python3 - <<'PY'
import socket
socks = [socket.socket() for _ in range(5)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
PY
)
H="$(hostname -s)"
mkdir -p "$D/state" "$D/spool"
cat >"$SLURM_CONF" <<EOF
ClusterName=pde2e
SlurmctldHost=$H(127.0.0.1)
SlurmctldPort=$P_CTLD
AuthType=auth/munge
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool/%n
SlurmctldPidFile=$D/slurmctld.pid
SlurmdPidFile=$D/slurmd-%n.pid
SlurmctldLogFile=$D/slurmctld.log
SlurmdLogFile=$D/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MailProg=/bin/true
KillWait=60
NodeName=n1 NodeHostname=$H NodeAddr=127.0.0.1 Port=$P_N1 CPUs=2 RealMemory=4000 State=UNKNOWN
NodeName=n2 NodeHostname=$H NodeAddr=127.0.0.1 Port=$P_N2 CPUs=2 RealMemory=4000 State=UNKNOWN
NodeName=n3 NodeHostname=$H NodeAddr=127.0.0.1 Port=$P_N3 CPUs=2 RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
slurmctld -f "$SLURM_CONF" || fail "slurmctld did not start"
for n in n1 n2 n3; do slurmd -f "$SLURM_CONF" -N "$n" || fail "slurmd $n did not start"; done
for _ in $(seq 100); do
    [[ "$(sinfo -h -o '%T %D' 2>/dev/null)" == "idle 3" ]] && break
    sleep 0.3
done
[[ "$(sinfo -h -o '%T %D')" == "idle 3" ]] || fail "the nodes are not idle: $(sinfo -h 2>&1)"
log "Slurm up: $(sinfo -h -o '%D nodes %T %N')"

# The job, as a user submits it (from the repository root).
JOB="$(cd "$ROOT" && PDSERVE_PORT="$P_ROUTER" PDSERVE_BIN_DIR="$BIN" PDSERVE_DRAIN_SECONDS=30 \
    sbatch --parsable --nodes=3 --output="$D/job-%j.out" deploy/slurm/pdserve.sbatch)"
OUT="$D/job-$JOB.out"
URL="http://127.0.0.1:$P_ROUTER"
log "job $JOB submitted; router at $URL"

MODEL_ID=""
chat() {
    [[ -n "$MODEL_ID" ]] || MODEL_ID="$(curl -sS --max-time 5 "$URL/v1/models" |
        python3 -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')" || return 1
    curl -sS --max-time 120 "$URL/v1/chat/completions" -H 'content-type: application/json' \
        -d "{\"model\":\"$MODEL_ID\",\"messages\":[{\"role\":\"user\",\"content\":\"$1\"}],\"max_tokens\":$2,\"ignore_eos\":true}"
}
# Ready: the router answers and a request goes through both workers.
started=$SECONDS
until chat "Say hi." 4 >"$D/first.json" 2>&1 && grep -q '"finish_reason"' "$D/first.json"; do
    ((SECONDS - started < 180)) || fail "no answer through the router after 180 s: $(cat "$D/first.json")"
    squeue -h -j "$JOB" | grep -q . || fail "the job ended early"
    sleep 1
done
log "serving after $((SECONDS - started)) s"
chat "What is the capital of France?" 16 | grep -q '"finish_reason":"length"' ||
    fail "a chat request did not complete"

# Requests in flight, then scancel: every step gets SIGTERM and drains, and
# no request may be lost.
mkdir -p "$D/req"
clients=()
for i in $(seq "$REQUESTS"); do
    chat "Tell me a long story about the number $i." 96 >"$D/req/$i.json" 2>"$D/req/$i.err" &
    clients+=($!)
done
sleep 2
scancel --signal=TERM "$JOB"
log "scancel --signal=TERM with $REQUESTS requests in flight"
wait "${clients[@]}" || true
lost=0
for i in $(seq "$REQUESTS"); do
    python3 - "$D/req/$i.json" <<'PY' || lost=1
import json, sys
body = json.load(open(sys.argv[1]))
choice = body["choices"][0]
assert choice["finish_reason"] == "length", body
assert body["usage"]["completion_tokens"] == 96, body
PY
done
((lost == 0)) || fail "a request in flight at scancel was lost: $(cat "$D"/req/*.err "$D"/req/*.json | head -c 2000)"
log "all $REQUESTS requests in flight at scancel finished (96 tokens each)"

for _ in $(seq 120); do
    squeue -h -j "$JOB" 2>/dev/null | grep -q . || break
    sleep 0.5
done
squeue -h -j "$JOB" 2>/dev/null | grep -q . && fail "the job did not end within 60 s of scancel"
JOB=""
# The nodes idle again once their step daemons have finished the job.
for _ in $(seq 100); do
    [[ "$(sinfo -h -o '%T %D' 2>/dev/null)" == "idle 3" ]] && break
    sleep 0.3
done
# Each worker drained and exited holding nothing.
grep -q "drain deadline passed" "$OUT" && fail "a process hit its drain deadline"
stopped="$(grep -c 'stopped.*active_sequences=0 queued_requests=0 kv_used_tokens=0' "$OUT" || true)"
((stopped == 2)) || fail "expected 2 workers stopped with no KV held, found $stopped"
log "both workers drained and stopped holding no KV; passed"
