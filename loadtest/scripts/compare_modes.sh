#!/usr/bin/env bash
# Disaggregated vs aggregated vs auto on one machine, in one interleaved run.
#
# As deploy/local/up.sh runs them, one prefill and one decode worker get one
# core each (pinned, one thread each), and three routers, one per --mode,
# share those two workers. A fourth target is the aggregated baseline at its
# best on this machine: a second decode worker alone with every core. Then
# `pdserve-loadtest run --compare` loads the four side by side, in turns.
# Extra arguments go to the load test:
#
#   loadtest/scripts/compare_modes.sh --rate 1 --duration 30 --json out.json
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BIN="${PDSERVE_BIN:-$ROOT/target/release}"
MODEL="${PDSERVE_MODEL:-$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
CORES="$(nproc)"
P=18301; D=18302; D2=18303; R=18310
pids=()
cleanup() { kill -TERM "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT

taskset -c 0 "$BIN/pdserve-prefill" --model "$MODEL" --port $P --threads 1 --log warn & pids+=($!)
taskset -c $((1 % CORES)) "$BIN/pdserve-decode" --model "$MODEL" --port $D --threads 1 --log warn & pids+=($!)
"$BIN/pdserve-decode" --model "$MODEL" --port $D2 --threads "$CORES" --log warn & pids+=($!)
modes=(disaggregated aggregated auto)
for i in 0 1 2; do
    "$BIN/pdserve-router" --model "$MODEL" --port $((R + i)) --mode "${modes[$i]}" \
        --prefill-url "http://127.0.0.1:$P" --decode-url "http://127.0.0.1:$D" \
        --health-interval-ms 200 --log warn & pids+=($!)
done
"$BIN/pdserve-router" --model "$MODEL" --port $((R + 3)) --mode aggregated \
    --decode-url "http://127.0.0.1:$D2" --health-interval-ms 200 --log warn & pids+=($!)
for port in $R $((R + 1)) $((R + 2)) $((R + 3)); do
    for _ in $(seq 1 120); do
        curl -sf "http://127.0.0.1:$port/ready" >/dev/null && break
        sleep 0.5
    done
done
"$BIN/pdserve-loadtest" run \
    --url "http://127.0.0.1:$R" \
    --compare "http://127.0.0.1:$((R + 1)),http://127.0.0.1:$((R + 2)),http://127.0.0.1:$((R + 3))" \
    --label "disaggregated,aggregated,auto,aggregated-${CORES}-threads" \
    "$@"
