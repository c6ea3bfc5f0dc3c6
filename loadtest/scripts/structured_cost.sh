#!/usr/bin/env bash
# What constrained decoding costs: decode throughput at 16 streams with a
# JSON schema against the same load unconstrained, in alternating rounds
# (A, B, A, B) on one cluster, so machine noise hits both alike.
#
# One router with one local decode worker (aggregated: every token of the
# output, the first included, is sampled under the grammar on the decode
# worker) is loaded by `pdserve-loadtest run` with and without
# `--extra-body '{"response_format": ...}'`. It prints TPOT p50 and output
# tokens/s per round and the constrained/unconstrained ratios.
#
#   ROUNDS=2 SECONDS_PER_RUN=30 loadtest/scripts/structured_cost.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BIN="${PDSERVE_BIN:-$ROOT/target/release}"
MODEL="${PDSERVE_MODEL:-$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
ROUNDS="${ROUNDS:-2}"
SECONDS_PER_RUN="${SECONDS_PER_RUN:-30}"
STREAMS="${STREAMS:-16}"
PORT="${PORT:-18410}"
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
# People as an open-ended array of objects: the output stays inside the
# grammar (strings, numbers, enums, separators) for the whole run.
SCHEMA='{"type": "object", "properties": {"people": {"type": "array", "items": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}, "mood": {"type": "string", "enum": ["happy", "sad", "calm"]}}, "required": ["name", "age", "mood"], "additionalProperties": false}}}, "required": ["people"], "additionalProperties": false}'
CONSTRAINED="{\"response_format\": {\"type\": \"json_schema\", \"json_schema\": {\"name\": \"people\", \"schema\": $SCHEMA}}}"

pid=""
cleanup() { [ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null; wait 2>/dev/null || true; }
trap cleanup EXIT

PDSERVE_LOG=warn "$BIN/pdserve-router" --model "$MODEL" --port "$PORT" --mode aggregated \
    --local-prefill 0 --local-decode 1 --prefill-min-replicas 0 --prefill-max-replicas 0 &
pid=$!
for _ in $(seq 1 240); do
    curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null && break
    sleep 0.5
done
curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null || { echo "the router never got ready" >&2; exit 1; }

run() { # name, extra body
    "$BIN/pdserve-loadtest" run --url "http://127.0.0.1:$PORT" \
        --concurrency "$STREAMS" --duration "$SECONDS_PER_RUN" --warmup 3 \
        --input-len 128 --output-len 64 --extra-body "$2" --no-progress \
        --json "$OUT/$1.json" >/dev/null
    jq -r --arg n "$1" '.points[0].targets[0].summary
        | "\($n)\t\(.tpot.p50 * 1000 | floor) ms\t\(.output_tokens_per_second | floor) tok/s\t\(.ok)/\(.requests) ok"' \
        "$OUT/$1.json"
}

run warm-up '{}' >/dev/null # first requests, caches, the batch filling up
printf 'run\tTPOT p50\toutput\trequests\n'
for r in $(seq 1 "$ROUNDS"); do
    run "plain-$r" '{}'
    run "schema-$r" "$CONSTRAINED"
done
jq -rs '
    def mean(f): (map(f) | add / length);
    (map(select(.args.extra_body | length == 0)) | map(.points[0].targets[0].summary)) as $a
    | (map(select(.args.extra_body | length > 0)) | map(.points[0].targets[0].summary)) as $b
    | "schema / plain: TPOT p50 \(($b | mean(.tpot.p50)) / ($a | mean(.tpot.p50)) * 100 | round / 100)x, output tok/s \(($b | mean(.output_tokens_per_second)) / ($a | mean(.output_tokens_per_second)) * 100 | round / 100)x"
' "$OUT"/plain-[0-9]*.json "$OUT"/schema-[0-9]*.json
echo "JSON reports in $OUT"
