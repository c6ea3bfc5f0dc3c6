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
for i in $(seq 1 "$D"); do
    port=$((18600 + i))
    "$BIN/pdserve-mock-worker" --pool decode --port $port "${mock[@]}" & pids+=($!)
    decode+=("http://127.0.0.1:$port")
done
for i in $(seq 1 "$P"); do
    port=$((18700 + i))
    "$BIN/pdserve-mock-worker" --pool prefill --port $port --decode-url "$(join "${decode[@]}")" \
        "${mock[@]}" & pids+=($!)
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
IFS=, read -ra rates <<<"$RATES"
for rate in "${rates[@]}"; do
    "$BIN/pdserve-loadtest" run --url "http://127.0.0.1:$R" --rate "$rate" --no-progress \
        --json "$OUT/run-$rate.json" "$@" >/dev/null
    "$BIN/pdserve-loadtest" simulate --prefill-workers "$P" --decode-workers "$D" \
        --rate "$rate" --no-progress --json "$OUT/sim-$rate.json" "$@" >/dev/null
done
python3 - "$OUT" "$P" "$D" "${rates[@]}" <<'EOF'
import json, sys
out, p, d, rates = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
def summary(kind, rate):
    with open(f"{out}/{kind}-{rate}.json") as f:
        return json.load(f)["points"][0]["targets"][0]["summary"]
print(f"| {p} + {d} mocks, rate | measure | measured | simulated | sim / measured |")
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
