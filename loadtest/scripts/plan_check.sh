#!/usr/bin/env bash
# Checks a plan by running it. `pdserve-loadtest plan` picks the cheapest
# pool sizes for a load (fitted from `pdserve-loadtest engine` on one
# thread); the router then starts that cluster for real (its local workers
# on the real model, one thread each, pinned one per core) and
# `pdserve-loadtest run` offers it the same load. Prints planned against
# measured for the plan and for every size in ALSO.
#
#   loadtest/scripts/plan_check.sh [load, SLO and plan flags]
#   ALSO="0+1" loadtest/scripts/plan_check.sh --rate 3 ...   # also 0 prefill + 1 decode
#
# The flags go to both `plan` and `run` except those only `plan` takes
# (listed in PLAN_ONLY below). PDSERVE_MOCK_FIT_FROM skips the engine run.
#
# Every run also measures the live correction factors: the workers' own
# mean prefill and decode-step times over the fitted model's
# (correct_profile.py). CORRECT=1 then plans again with them
# (--prefill-correction, --decode-correction) and runs that plan too.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BIN="${PDSERVE_BIN:-$ROOT/target/release}"
MODEL="${PDSERVE_MODEL:-$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
OUT="${PDSERVE_PLAN_CHECK_OUT:-$(mktemp -d)}"
R=18520
# The router and its local workers share a token this script knows, so it
# can list the workers and read their metrics.
export PDSERVE_INTERNAL_TOKEN="${PDSERVE_INTERNAL_TOKEN:-$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')}"
router_pid=""
cleanup() { [ -z "$router_pid" ] || { kill -TERM "$router_pid" 2>/dev/null; wait "$router_pid" 2>/dev/null; } || true; }
trap cleanup EXIT
# Flags `run` does not take: the search space, its costs and the model.
PLAN_ONLY='^--max-workers$|^--(min|max)-(prefill|decode)-workers$|^--(prefill|decode)-(cost|correction)$|^--search-|^--attainment$|^--threads$'
plan_args=("$@"); run_args=()
while (($#)); do
    if [[ $1 =~ $PLAN_ONLY ]]; then shift 2; continue; fi
    run_args+=("$1"); shift
done
if [ -z "${PDSERVE_MOCK_FIT_FROM:-}" ]; then
    "$BIN/pdserve-loadtest" engine --model "$MODEL" --threads 1 --weights native \
        --decode-batches 1,4,16,32 --json "$OUT/engine.json" >/dev/null
    export PDSERVE_MOCK_FIT_FROM="$OUT/engine.json"
fi
"$BIN/pdserve-loadtest" plan --fit-from "$PDSERVE_MOCK_FIT_FROM" --fit-weights native \
    --no-progress --json "$OUT/plan.json" "${plan_args[@]}" | tee "$OUT/plan.txt" | grep '^plan:'
start=$(grep '^start it:' "$OUT/plan.txt") || { echo "no plan to check" >&2; exit 1; }
# start it: PDSERVE_MAX_BATCH=B PDSERVE_PREFILL_CHUNK_TOKENS=C pdserve-router ... --mode M --local-prefill-max-tokens N
read -r batch chunk mode lpmt < <(sed -E 's/.*MAX_BATCH=([0-9]+) .*CHUNK_TOKENS=([0-9]+) .*--mode ([a-z]+) --local-prefill-max-tokens ([0-9]+).*/\1 \2 \3 \4/' <<<"$start")
planned=$(sed -E 's/.*--local-prefill ([0-9]+) --local-decode ([0-9]+).*/\1+\2/' <<<"$start")

# run_size P+D [TAG]: the cluster of that size under the load; writes
# run-P+D[TAG].json and engine-P+D[TAG].json (its corrections).
run_size() {
    local p=${1%+*} d=${1#*+} m=$mode name=$1${2:-}
    [ "$p" = 0 ] && m=aggregated
    PDSERVE_MAX_BATCH=$batch PDSERVE_PREFILL_CHUNK_TOKENS=$chunk PDSERVE_LOG=warn \
        "$BIN/pdserve-router" --model "$MODEL" --port $R --local-prefill "$p" --local-decode "$d" \
        --mode "$m" --local-prefill-max-tokens "$lpmt" --worker-threads 1 \
        --autoscaler-executor none &
    router_pid=$!
    for _ in $(seq 1 240); do
        page=$(curl -sf "http://127.0.0.1:$R/metrics" || true)
        n=$(awk '/^pdserve_workers[{]/ && /state="ready"/ {s += $2} END {print s + 0}' <<<"$page")
        [ "$n" = $((p + d)) ] && break
        sleep 0.5
    done
    local urls
    urls=$(curl -sf -H "Authorization: Bearer $PDSERVE_INTERNAL_TOKEN" "http://127.0.0.1:$R/v1/internal/workers" |
        python3 -c 'import json, sys; print(" ".join(w["url"] for w in json.load(sys.stdin)["workers"]))')
    scrape() { for u in $urls; do curl -sf "$u/metrics"; done | python3 "$ROOT/loadtest/scripts/correct_profile.py" --sum; }
    for _ in 1 2 3; do # warm up
        curl -sf "http://127.0.0.1:$R/v1/completions" -H 'content-type: application/json' \
            -d '{"model":"'"$(basename "$MODEL" .gguf)"'","prompt":"Hello there, how are you today?","max_tokens":8}' >/dev/null
    done
    scrape >"$OUT/before-$name.json"
    "$BIN/pdserve-loadtest" run --url "http://127.0.0.1:$R" --no-progress \
        --json "$OUT/run-$name.json" "${run_args[@]}" >/dev/null
    scrape >"$OUT/after-$name.json"
    python3 "$ROOT/loadtest/scripts/correct_profile.py" "$PDSERVE_MOCK_FIT_FROM" \
        "$OUT/before-$name.json" "$OUT/after-$name.json" "$OUT/engine-$name.json"
    kill -TERM "$router_pid"; wait "$router_pid" || true; router_pid=""
}
sizes=("$planned")
for s in ${ALSO:-}; do sizes+=("$s"); done
for s in "${sizes[@]}"; do run_size "$s"; done
corrected=""
if [ "${CORRECT:-0}" = 1 ]; then
    read -r cp cd < <(python3 -c 'import json, sys; print(*json.load(open(sys.argv[1]))["correction"])' "$OUT/engine-$planned.json")
    "$BIN/pdserve-loadtest" plan --fit-from "$PDSERVE_MOCK_FIT_FROM" --fit-weights native \
        --no-progress --json "$OUT/plan-corrected.json" "${plan_args[@]}" \
        --prefill-correction "$cp" --decode-correction "$cd" | tee "$OUT/plan-corrected.txt" | grep '^plan:'
    if start=$(grep '^start it:' "$OUT/plan-corrected.txt"); then
        corrected=$(sed -E 's/.*--local-prefill ([0-9]+) --local-decode ([0-9]+).*/\1+\2/' <<<"$start")
        read -r batch chunk mode lpmt < <(sed -E 's/.*MAX_BATCH=([0-9]+) .*CHUNK_TOKENS=([0-9]+) .*--mode ([a-z]+) --local-prefill-max-tokens ([0-9]+).*/\1 \2 \3 \4/' <<<"$start")
        # Run under its own name, even when the first plan had the same size.
        run_size "$corrected" -corrected
    fi
fi

python3 - "$OUT" "$planned" "$corrected" "${sizes[@]}" <<'PY'
import json, os, sys
out, planned, corrected, sizes = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
ms = lambda v: f"{v * 1e3:.0f}"

def candidate(plan, p, d):
    chosen = plan["candidates"][plan["chosen"]]
    knobs = ("chunk_tokens", "max_batch", "local_prefill_max_tokens")
    for c in plan["candidates"]:
        if (c["prefill_workers"], c["decode_workers"]) == (p, d) and all(c[k] == chosen[k] for k in knobs):
            return c

def rows(plan, label, size, name, tag=""):
    p, d = map(int, size.split("+"))
    c = candidate(plan, p, d)
    if c:
        print(f"| {name} | {label} | {'yes' if c['meets'] else 'no'} | {c['slo_attainment']:.3f} | {c['goodput']:.2f} | "
              f"{ms(c['ttft_p50'])} | {ms(c['ttft_p99'])} | {ms(c['tpot_p50'])} | {ms(c['tpot_p99'])} | |")
    m = json.load(open(f"{out}/run-{size}{tag}.json"))["points"][0]["targets"][0]["summary"]
    corr = json.load(open(f"{out}/engine-{size}{tag}.json"))["correction"]
    meets = m["slo_attainment"] >= plan["space"]["attainment"]
    print(f"| {name} | measured | {'yes' if meets else 'no'} | {m['slo_attainment']:.3f} | {m['goodput']:.2f} | "
          f"{ms(m['ttft']['p50'])} | {ms(m['ttft']['p99'])} | {ms(m['tpot']['p50'])} | {ms(m['tpot']['p99'])} | "
          f"{corr[0]:.2f}, {corr[1]:.2f} |")

plan = json.load(open(f"{out}/plan.json"))
print(f"SLOs: TTFT {plan['slo_ttft_ms']} ms, TPOT {plan['slo_tpot_ms']} ms, attainment {plan['space']['attainment']}")
print("| pools | | meets | attainment | goodput req/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | corrections measured (prefill, decode) |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for size in sizes:
    rows(plan, "planned", size, f"{size.replace('+', ' + ')}" + (" (the plan)" if size == planned else ""))
if corrected:
    again = json.load(open(f"{out}/plan-corrected.json"))
    rows(again, "planned, corrected", corrected, f"{corrected.replace('+', ' + ')} (the corrected plan)", "-corrected")
elif os.path.exists(f"{out}/plan-corrected.txt"):
    print("\nThe corrected plan: " + open(f"{out}/plan-corrected.txt").read().strip().splitlines()[-1])
PY
