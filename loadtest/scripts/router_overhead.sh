#!/usr/bin/env bash
# The router's own cost: mock workers that take no compute time, a router in
# front of them, and closed-loop streaming load at a given concurrency.
# Prints the load test's table, the router's CPU seconds, peak RSS and open
# descriptors, the CPU of the load generator and the mocks, and the latency
# the router adds.
#
#   loadtest/scripts/router_overhead.sh 1000 [extra load-test args]
#   RATE=300 loadtest/scripts/router_overhead.sh open [extra load-test args]
#
# With RATE, arrivals are Poisson at that many requests per second (open
# loop) instead of a closed loop of the given number of streams.
#
# PACE_MS=N holds streams open without computing anything: the mock decode
# worker emits one token for its whole batch every N ms (its prefill is
# free). Without it (PACE_MS=0) the mocks answer at once.
# WORKER_PROTOCOL=http1|http2 picks the router's calls to workers.
# DECODE_WORKERS=N starts N decode mocks (default 1): a decode step then hands
# the router a share of the streams' tokens instead of all of them at once.
# PIN=1 gives the router core 0 and everything else (mocks, load
# generator) core 1, as a deployment would give the router its own core.
# LOAD_ON="cmd args" starts the load generator under that command instead
# (e.g. LOAD_ON="taskset -c 0 chrt -i 0": on the router's core, but only
# when the router is idle), to see what sharing a core costs the mocks.
# ROUTER_LOG and MOCK_LOG set the router's and the prefill mock's log
# filters (default warn), e.g. MOCK_LOG=warn,hyper=debug to see why a
# connection closed.
#
# Added latency, per request: the client's end-to-end time minus the decode
# worker's own span of it (from the arrival of the router's generate call to
# the end of its stream, logged by the worker as `generate stream closed`),
# paired by request id. What is left is the router (tokenizing, templating,
# placement, the prefill call, relaying every token as SSE) plus loopback.
# The router's own view of it is printed too: its span of each request (from
# the handler's start to the `[DONE]` chunk handed to the connection, logged
# as `request served`) minus the same decode worker span; this leaves out
# the client's hops and the load generator's own time.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BIN="${PDSERVE_BIN:-$ROOT/target/release}"
MODEL="${PDSERVE_MODEL:-$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
PACE_MS="${PACE_MS:-0}"
C="${1:?concurrency (or any label, with RATE)}"; shift
on_router=(); on_rest=()
if [ "${PIN:-0}" = 1 ]; then on_router=(taskset -c 0); on_rest=(taskset -c 1); fi
on_load=("${on_rest[@]}")
if [ -n "${LOAD_ON:-}" ]; then read -r -a on_load <<<"$LOAD_ON"; fi
if [ -n "${RATE:-}" ]; then load=(--rate "$RATE"); else load=(--concurrency "$C"); fi
P=18401; R=18410; D0=18420; NDEC="${DECODE_WORKERS:-1}"
[[ "$NDEC" =~ ^[1-9][0-9]?$ ]] || { echo "DECODE_WORKERS must be 1-99" >&2; exit 2; }
DECODE_URLS="$(seq -s, -f "http://127.0.0.1:%g" "$D0" $((D0 + NDEC - 1)))"
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"
OUT="$(mktemp -d)"
pids=()
# On failure, what the router logged (its stderr goes to a file) is shown.
cleanup() {
    local status=$?
    kill -TERM "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true
    [ "$status" = 0 ] || grep -v "request served" "$OUT/router.log" >&2 2>/dev/null || true
    rm -rf "$OUT"
}
trap cleanup EXIT
if [ "$PACE_MS" = 0 ]; then
    mock=(--model "$MODEL" --latency-scale 0)
else
    mock=(--model "$MODEL" --prefill-fixed-ms 0 --prefill-ms-per-token 0
          --step-fixed-ms "$PACE_MS" --step-ms-per-seq 0)
fi
"${on_rest[@]}" "$BIN/pdserve-mock-worker" --pool prefill --port $P --max-queue 100000 --log "${MOCK_LOG:-warn}" \
    --decode-url "$DECODE_URLS" "${mock[@]}" & pids+=($!)
for i in $(seq 0 $((NDEC - 1))); do
    "${on_rest[@]}" "$BIN/pdserve-mock-worker" --pool decode --port $((D0 + i)) --max-batch 100000 \
        --max-queue 100000 --kv-cache-tokens 100000000 --log "warn,pdserve_worker::decode::generate=debug" \
        "${mock[@]}" 2>"$OUT/decode-$i.log" & pids+=($!)
done
"${on_router[@]}" "$BIN/pdserve-router" --model "$MODEL" --port $R --mode disaggregated \
    --prefill-url "http://127.0.0.1:$P" --decode-url "$DECODE_URLS" \
    --worker-protocol "${WORKER_PROTOCOL:-http2}" \
    --max-concurrent-requests 100000 --log "${ROUTER_LOG:-warn},pdserve_router::request=debug" \
    2>"$OUT/router.log" & ROUTER=$!; pids+=($ROUTER)
up=0
for _ in $(seq 1 120); do
    curl -sf "http://127.0.0.1:$R/ready" >/dev/null && { up=1; break; }
    sleep 0.25
done
[ "$up" = 1 ] || { echo "the router did not become ready in 30 s" >&2; exit 1; }
cpu() { awk '{print $14 + $15}' "/proc/${1:-$ROUTER}/stat"; }
PREFILL=${pids[0]}; DECODES=("${pids[@]:1:NDEC}")
dcpu() { local t=0; for p in "${DECODES[@]}"; do t=$((t + $(cpu "$p"))); done; echo "$t"; }
# Every decode mock in placement before the load starts.
ready_decode() {
    curl -sf "http://127.0.0.1:$R/metrics" |
        awk '/^pdserve_workers\{pool="decode",state="ready"\}/ {print $2}' || true
}
up=0
for _ in $(seq 1 120); do
    [ "$(ready_decode)" = "$NDEC" ] && { up=1; break; }
    sleep 0.25
done
[ "$up" = 1 ] || { echo "only $(ready_decode) of $NDEC decode mocks ready after 30 s" >&2; exit 1; }
fds=0
watch_fds() {
    while kill -0 "$ROUTER" 2>/dev/null; do
        n=$(ls "/proc/$ROUTER/fd" 2>/dev/null | wc -l); [ "$n" -gt "$fds" ] && fds=$n
        echo "$fds" >"$OUT/fds"; sleep 0.5
    done
}
watch_fds & pids+=($!)
before=$(cpu); d_before=$(dcpu); p_before=$(cpu "$PREFILL")
start=$(date +%s.%N)
"${on_load[@]}" "$BIN/pdserve-loadtest" run --url "http://127.0.0.1:$R" --no-progress "${load[@]}" \
    --json "$OUT/run.json" "$@" & LOAD=$!
load_cpu=0
while kill -0 "$LOAD" 2>/dev/null; do load_cpu=$(cpu "$LOAD" 2>/dev/null || echo "$load_cpu"); sleep 0.2; done
wait "$LOAD"
end=$(date +%s.%N)
after=$(cpu); d_after=$(dcpu); p_after=$(cpu "$PREFILL")
ticks=$(getconf CLK_TCK)
awk -v b="$before" -v a="$after" -v t="$ticks" -v s="$start" -v e="$end" \
    'BEGIN { printf "router CPU: %.1f s over %.1f s of load (%.0f%% of one core)\n", (a-b)/t, e-s, 100*(a-b)/t/(e-s) }'
awk -v l="$load_cpu" -v d="$((d_after - d_before))" -v p="$((p_after - p_before))" -v t="$ticks" -v s="$start" -v e="$end" \
    'BEGIN { printf "others: load generator %.0f%%, decode mocks %.0f%%, prefill mock %.0f%% of one core\n", 100*l/t/(e-s), 100*d/t/(e-s), 100*p/t/(e-s) }'
grep -E "VmHWM|VmRSS" "/proc/$ROUTER/status"
echo "router open descriptors, peak: $(cat "$OUT/fds" 2>/dev/null || echo ?)"
grep -v "request served" "$OUT/router.log" >&2 || true
cat "$OUT"/decode-*.log > "$OUT/decode.log"
python3 "$ROOT/loadtest/scripts/added_latency.py" "$OUT/run.json" "$OUT/decode.log" "$OUT/router.log"
