#!/usr/bin/env bash
# The simulator against the cluster it models: P prefill and D decode mock
# workers behind a router, loaded by `pdserve-loadtest run` at each rate,
# then `pdserve-loadtest simulate` with the same cluster and the same load.
# Prints TTFT p50/p99, TPOT p50 and goodput of both, and simulated over
# measured.
#
#   loadtest/scripts/sim_validate.sh P D RATE[,RATE...] [extra load flags]
#
# The extra flags go to both `run` and `simulate` (workload, SLOs,
# duration); mock latency flags come from the PDSERVE_MOCK_* variables,
# which both the mocks and the simulator read.
#
# REAL=1 runs the real workers instead (one model thread each, pinned one
# per core as the local supervisor does) and fits the simulator's latency
# model from `pdserve-loadtest engine` on one thread, measured first
# (or from PDSERVE_MOCK_FIT_FROM, if set).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BIN="${PDSERVE_BIN:-$ROOT/target/release}"
MODEL="${PDSERVE_MODEL:-$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
P="${1:?prefill workers}"; D="${2:?decode workers}"; RATES="${3:?rates}"; shift 3
OUT="${PDSERVE_VALIDATE_OUT:-$(mktemp -d)}"
R=18510
ulimit -n 65536 2>/dev/null || true
pids=()
cleanup() { kill -TERM "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT
mock=(--model "$MODEL" --log warn)
prefill=(); decode=()
join() { local IFS=,; echo "$*"; }
cores=$(nproc); slot=0
# worker POOL PORT [flags]: a mock, or with REAL=1 the real binary pinned to a core.
worker() {
    local pool=$1 port=$2; shift 2
    if [ "${REAL:-0}" = 1 ]; then
        taskset -c $((slot % cores)) "$BIN/pdserve-$pool" --port "$port" --threads 1 "${mock[@]}" "$@" &
        slot=$((slot + 1))
    else
        "$BIN/pdserve-mock-worker" --pool "$pool" --port "$port" "${mock[@]}" "$@" &
    fi
    pids+=($!)
}
if [ "${REAL:-0}" = 1 ] && [ -z "${PDSERVE_MOCK_FIT_FROM:-}" ]; then
    "$BIN/pdserve-loadtest" engine --model "$MODEL" --threads 1 --weights native \
        --json "$OUT/engine.json" >/dev/null
    export PDSERVE_MOCK_FIT_FROM="$OUT/engine.json" PDSERVE_MOCK_FIT_WEIGHTS=native
fi
for i in $(seq 1 "$D"); do
    port=$((18600 + i))
    worker decode $port
    decode+=("http://127.0.0.1:$port")
done
for i in $(seq 1 "$P"); do
    port=$((18700 + i))
    worker prefill $port --decode-url "$(join "${decode[@]}")"
    prefill+=("http://127.0.0.1:$port")
done
"$BIN/pdserve-router" --model "$MODEL" --port $R \
    --prefill-url "$(join "${prefill[@]}")" --decode-url "$(join "${decode[@]}")" \
    --log warn & pids+=($!)
for _ in $(seq 1 120); do
    curl -sf "http://127.0.0.1:$R/ready" >/dev/null && break
    sleep 0.25
done
sleep 2 # every worker's first /load poll
if [ "${REAL:-0}" = 1 ]; then # warm the workers up before measuring
    for _ in 1 2 3; do
        curl -sf "http://127.0.0.1:$R/v1/completions" -H 'content-type: application/json' \
            -d '{"model":"'"$(basename "$MODEL" .gguf)"'","prompt":"Hello there, how are you today?","max_tokens":8}' >/dev/null
    done
fi
IFS=, read -ra rates <<<"$RATES"
# A fresh workload seed for each rate (unless one is given): the workers'
# prefix caches still hold the last rate's prompts, the simulator's do not.
seeded=0; for a in "$@"; do [ "$a" = --seed ] && seeded=1; done
n=0
for rate in "${rates[@]}"; do
    seed=(); n=$((n + 1)); [ "$seeded" = 1 ] || seed=(--seed $((7000 + n)))
    "$BIN/pdserve-loadtest" run --url "http://127.0.0.1:$R" --rate "$rate" --no-progress \
        --json "$OUT/run-$rate.json" "${seed[@]}" "$@" >/dev/null
    "$BIN/pdserve-loadtest" simulate --prefill-workers "$P" --decode-workers "$D" \
        --rate "$rate" --no-progress --json "$OUT/sim-$rate.json" "${seed[@]}" "$@" >/dev/null
done
python3 - "$OUT" "$P" "$D" "${rates[@]}" <<'EOF'
import json, sys
out, p, d, rates = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
def summary(kind, rate):
    with open(f"{out}/{kind}-{rate}.json") as f:
        return json.load(f)["points"][0]["targets"][0]["summary"]
kind = "real workers" if __import__("os").environ.get("REAL") == "1" else "mocks"
print(f"| {p} + {d} {kind}, rate | measure | measured | simulated | sim / measured |")
print("| --- | --- | --- | --- | --- |")
for rate in rates:
    m, s = summary("run", rate), summary("sim", rate)
    rows = [
        ("TTFT p50 ms", m["ttft"]["p50"] * 1e3, s["ttft"]["p50"] * 1e3),
        ("TTFT p99 ms", m["ttft"]["p99"] * 1e3, s["ttft"]["p99"] * 1e3),
        ("TPOT p50 ms", m["tpot"]["p50"] * 1e3, s["tpot"]["p50"] * 1e3),
        ("goodput req/s", m["goodput"], s["goodput"]),
    ]
    for name, a, b in rows:
        ratio = b / a if a else float("nan")
        print(f"| {rate} | {name} | {a:.1f} | {b:.1f} | {ratio:.2f} |")
    print(f"| {rate} | ok / requests | {m['ok']} / {m['requests']} | {s['ok']} / {s['requests']} | |")
EOF
