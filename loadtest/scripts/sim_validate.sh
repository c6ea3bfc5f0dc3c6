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
#
# CORRECT=1 (with REAL=1) also simulates each rate with the live correction
# factors of that rate's run: the workers' own mean prefill time per prompt
# (`pdserve_prefill_seconds`, `pdserve_prompt_tokens_total`) and mean decode
# step (`pdserve_decode_step_seconds`, `pdserve_decode_batch_size`) over the
# fitted model's, applied to the engine profile (correct_profile.py).
# CORRECT_FROM=DIR (with CORRECT=1) takes each rate's corrected profile from
# an earlier run's output folder (its PDSERVE_VALIDATE_OUT) instead: out of
# sample, e.g. 1 + 1's corrections used for 2 + 2.
#
# SIM_ARGS adds flags to the simulator only, e.g. SIM_ARGS="--cores 2
# --pin-workers" for real workers that share two cores, pinned as this
# script pins them (decode workers first, then prefill, round robin).
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
sim_args=(); [ -n "${SIM_ARGS:-}" ] && read -ra sim_args <<<"$SIM_ARGS"
# A fresh workload seed for each rate (unless one is given): the workers'
# prefix caches still hold the last rate's prompts, the simulator's do not.
seeded=0; for a in "$@"; do [ "$a" = --seed ] && seeded=1; done
# The workers' sums of the series the corrections read, as one JSON line.
scrape() {
    for url in "${prefill[@]}" "${decode[@]}"; do curl -sf "$url/metrics"; done |
        python3 "$ROOT/loadtest/scripts/correct_profile.py" --sum
}
n=0
for rate in "${rates[@]}"; do
    seed=(); n=$((n + 1)); [ "$seeded" = 1 ] || seed=(--seed $((7000 + n)))
    [ "${CORRECT:-0}" = 1 ] && scrape >"$OUT/before-$rate.json"
    "$BIN/pdserve-loadtest" run --url "http://127.0.0.1:$R" --rate "$rate" --no-progress \
        --json "$OUT/run-$rate.json" "${seed[@]}" "$@" >/dev/null
    "$BIN/pdserve-loadtest" simulate --prefill-workers "$P" --decode-workers "$D" \
        --rate "$rate" --no-progress --json "$OUT/sim-$rate.json" "${seed[@]}" "${sim_args[@]}" "$@" >/dev/null
    if [ "${CORRECT:-0}" = 1 ]; then
        scrape >"$OUT/after-$rate.json"
        if [ -n "${CORRECT_FROM:-}" ]; then
            cp "$CORRECT_FROM/engine-$rate.json" "$OUT/engine-$rate.json"
        else
            python3 "$ROOT/loadtest/scripts/correct_profile.py" "$PDSERVE_MOCK_FIT_FROM" \
                "$OUT/before-$rate.json" "$OUT/after-$rate.json" "$OUT/engine-$rate.json"
        fi
        PDSERVE_MOCK_FIT_FROM="$OUT/engine-$rate.json" "$BIN/pdserve-loadtest" simulate \
            --prefill-workers "$P" --decode-workers "$D" --rate "$rate" --no-progress \
            --json "$OUT/corrected-$rate.json" "${seed[@]}" "${sim_args[@]}" "$@" >/dev/null
    fi
done
python3 - "$OUT" "$P" "$D" "${rates[@]}" <<'EOF'
import json, os, sys
out, p, d, rates = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
def summary(kind, rate):
    with open(f"{out}/{kind}-{rate}.json") as f:
        return json.load(f)["points"][0]["targets"][0]["summary"]
kind = "real workers" if os.environ.get("REAL") == "1" else "mocks"
corrected = os.path.exists(f"{out}/corrected-{rates[0]}.json")
extra = " corrected | corrected / measured |" if corrected else ""
print(f"| {p} + {d} {kind}, rate | measure | measured | simulated | sim / measured |{extra}")
print("| --- | --- | --- | --- | --- |" + (" --- | --- |" if corrected else ""))
ratio = lambda v, a: f"{v / a:.2f}" if a else "nan"
for rate in rates:
    m, s = summary("run", rate), summary("sim", rate)
    c = summary("corrected", rate) if corrected else None
    rows = [
        ("TTFT p50 ms", lambda x: x["ttft"]["p50"] * 1e3),
        ("TTFT p99 ms", lambda x: x["ttft"]["p99"] * 1e3),
        ("TPOT p50 ms", lambda x: x["tpot"]["p50"] * 1e3),
        ("goodput req/s", lambda x: x["goodput"]),
    ]
    for name, get in rows:
        a, b = get(m), get(s)
        line = f"| {rate} | {name} | {a:.1f} | {b:.1f} | {ratio(b, a)} |"
        if c:
            line += f" {get(c):.1f} | {ratio(get(c), a)} |"
        print(line)
    tail = f" {c['ok']} / {c['requests']} | |" if c else ""
    print(f"| {rate} | ok / requests | {m['ok']} / {m['requests']} | {s['ok']} / {s['requests']} | |{tail}")
    if c:
        corr = json.load(open(f"{out}/engine-{rate}.json"))["correction"]
        print(f"| {rate} | corrections (prefill, decode) | | | | {corr[0]:.2f}, {corr[1]:.2f} | |")
EOF
