#!/usr/bin/env bash
# The router's own cost: mock workers that take no time (--latency-scale 0),
# a router in front of them, and closed-loop load at a given concurrency.
# Prints the load test's table, then the router's CPU seconds and peak RSS.
#
#   loadtest/scripts/router_overhead.sh 1000 [extra load-test args]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BIN="${PDSERVE_BIN:-$ROOT/target/release}"
MODEL="${PDSERVE_MODEL:-$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
C="${1:?concurrency}"; shift
P=18401; D=18402; R=18410
ulimit -n 65536 2>/dev/null || true
pids=()
cleanup() { kill -TERM "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT
mock=(--model "$MODEL" --latency-scale 0 --log warn)
"$BIN/pdserve-mock-worker" --pool prefill --port $P --max-queue 100000 "${mock[@]}" & pids+=($!)
"$BIN/pdserve-mock-worker" --pool decode --port $D --max-batch 100000 --max-queue 100000 \
    --kv-cache-tokens 100000000 "${mock[@]}" & pids+=($!)
"$BIN/pdserve-router" --model "$MODEL" --port $R --mode disaggregated \
    --prefill-url "http://127.0.0.1:$P" --decode-url "http://127.0.0.1:$D" \
    --max-concurrent-requests 100000 --log warn & ROUTER=$!; pids+=($ROUTER)
for _ in $(seq 1 120); do
    curl -sf "http://127.0.0.1:$R/ready" >/dev/null && break
    sleep 0.25
done
cpu() { awk '{print $14 + $15}' "/proc/$ROUTER/stat"; }
before=$(cpu)
start=$(date +%s.%N)
"$BIN/pdserve-loadtest" run --url "http://127.0.0.1:$R" --concurrency "$C" --no-progress "$@"
end=$(date +%s.%N)
after=$(cpu)
ticks=$(getconf CLK_TCK)
awk -v b="$before" -v a="$after" -v t="$ticks" -v s="$start" -v e="$end" \
    'BEGIN { printf "router CPU: %.1f s over %.1f s of load (%.0f%% of one core)\n", (a-b)/t, e-s, 100*(a-b)/t/(e-s) }'
grep -E "VmHWM|VmRSS" "/proc/$ROUTER/status"
