#!/usr/bin/env bash
# Disaggregated vs aggregated vs auto on one machine, in one interleaved run.
#
# Starts one prefill and one decode worker (each with the machine's threads:
# they share the cores, as they would on this box) and three routers over
# the same two workers, one per --mode, then loads them side by side with
# `pdserve-loadtest run --compare`. Extra arguments go to the load test.
#
#   loadtest/scripts/compare_modes.sh --rate 2 --duration 30 --json out.json
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BIN="${PDSERVE_BIN:-$ROOT/target/release}"
MODEL="${PDSERVE_MODEL:-$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
THREADS="${PDSERVE_THREADS:-0}"
P=18301; D=18302; R=18310
pids=()
cleanup() { kill -TERM "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT

"$BIN/pdserve-prefill" --model "$MODEL" --port $P --threads "$THREADS" --log warn & pids+=($!)
"$BIN/pdserve-decode" --model "$MODEL" --port $D --threads "$THREADS" --log warn & pids+=($!)
for i in 0 1 2; do
    mode=(disaggregated aggregated auto)
    "$BIN/pdserve-router" --model "$MODEL" --port $((R + i)) --mode "${mode[$i]}" \
        --prefill-url "http://127.0.0.1:$P" --decode-url "http://127.0.0.1:$D" \
        --health-interval-ms 200 --log warn & pids+=($!)
done
for port in $R $((R + 1)) $((R + 2)); do
    for _ in $(seq 1 120); do
        curl -sf "http://127.0.0.1:$port/ready" >/dev/null && break
        sleep 0.5
    done
done
"$BIN/pdserve-loadtest" run \
    --url "http://127.0.0.1:$R" \
    --compare "http://127.0.0.1:$((R + 1)),http://127.0.0.1:$((R + 2))" \
    --label disaggregated,aggregated,auto \
    "$@"
