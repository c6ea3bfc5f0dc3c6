#!/usr/bin/env bash
# Builds the fuzz targets and runs each for a while on a copy of the
# committed seed corpus; exits non-zero if any target crashed.
#
#   ./fuzz/run.sh [SECONDS]           # default 60 seconds per target
#
# Environment:
#   FUZZ_SECONDS     seconds per target when no argument is given (60)
#   FUZZ_TARGETS     targets to run, space-separated (all of fuzz/fuzz_targets/)
#   FUZZ_SANITIZER   cargo fuzz's --sanitizer (none; `address` builds slower)
#   FUZZ_WORKDIR     keep each target's grown corpus, log and crashes here
#                    (a temporary directory, removed at exit, by default)
#
# cargo fuzz needs nightly features: the stable toolchain runs it with
# RUSTC_BOOTSTRAP=1. cargo-fuzz is installed with `cargo install` when it
# is missing, and a C++ compiler (for libFuzzer itself) with apt-get.
# A crash's input is copied to fuzz/artifacts/<target>/; docs/fuzzing.md
# tells how to reproduce it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

SECONDS_PER_TARGET="${1:-${FUZZ_SECONDS:-60}}"
if ! [[ "$SECONDS_PER_TARGET" =~ ^[1-9][0-9]*$ ]]; then
    echo "usage: $0 [SECONDS]" >&2
    exit 2
fi
SANITIZER="${FUZZ_SANITIZER:-none}"
TARGETS="${FUZZ_TARGETS:-$(cd fuzz/fuzz_targets && ls ./*.rs | sed 's|^\./||; s|\.rs$||' | tr '\n' ' ')}"
export RUSTC_BOOTSTRAP=1
start=$(date +%s)

# A C++ compiler for libfuzzer-sys's build script (CI runs as root on Debian).
if ! command -v c++ >/dev/null 2>&1 && ! command -v g++ >/dev/null 2>&1 \
    && ! command -v clang++ >/dev/null 2>&1; then
    if [[ $(id -u) -ne 0 ]]; then
        echo "error: a C++ compiler is needed (apt-get install g++)" >&2
        exit 1
    fi
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends g++
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
    cargo install cargo-fuzz --locked
fi

# All targets in one cargo invocation: release, debug assertions and
# overflow checks on, coverage instrumentation, no sanitizer by default.
echo "fuzz: building every target (sanitizer: $SANITIZER)"
cargo fuzz build --fuzz-dir fuzz --release --debug-assertions --sanitizer "$SANITIZER"
built=$(date +%s)
host=$(rustc -vV | sed -n 's/^host: //p')
bin_dir="fuzz/target/$host/release"

if [[ -n "${FUZZ_WORKDIR:-}" ]]; then
    work="$FUZZ_WORKDIR"
    mkdir -p "$work"
else
    work=$(mktemp -d "${TMPDIR:-/tmp}/pdserve-fuzz.XXXXXX")
    trap 'rm -rf "$work"' EXIT
fi

failed=0
summary=()
for target in $TARGETS; do
    dir="$work/$target"
    rm -rf "$dir"
    mkdir -p "$dir/corpus" "$dir/crashes"
    # The fuzzer writes new inputs into the copy, never into fuzz/corpus/.
    if [[ -d "fuzz/corpus/$target" ]]; then
        cp fuzz/corpus/"$target"/* "$dir/corpus/" 2>/dev/null || true
    fi
    seeds=$(find "$dir/corpus" -type f | wc -l)
    echo "fuzz: $target for ${SECONDS_PER_TARGET}s ($seeds seeds)"
    rc=0
    "$bin_dir/$target" "$dir/corpus" \
        -max_total_time="$SECONDS_PER_TARGET" -max_len=4096 -timeout=10 \
        -rss_limit_mb=2048 -print_final_stats=1 \
        -artifact_prefix="$dir/crashes/" >"$dir/log" 2>&1 || rc=$?
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$dir/log" | tail -1)
    rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$dir/log" | tail -1)
    # libFuzzer's final corpus: inputs/size (the directory also keeps
    # inputs that later ones replaced).
    corpus=$(sed -n 's/.*DONE .* corp: \([0-9]*\/[0-9]*[a-zA-Z]*\).*/\1/p' "$dir/log" | tail -1)
    crashes=$(find "$dir/crashes" -type f \( -name 'crash-*' -o -name 'oom-*' \
        -o -name 'timeout-*' -o -name 'leak-*' \) | wc -l)
    if [[ $rc -ne 0 || $crashes -ne 0 ]]; then
        failed=1
        ((crashes == 0)) && crashes="? (exit $rc)"
        echo "fuzz: $target FAILED:" >&2
        grep -m 5 -E 'panicked at|memory allocation of .* failed|ERROR: libFuzzer' \
            "$dir/log" >&2 || true
        echo "fuzz: the end of its log:" >&2
        tail -n 40 "$dir/log" >&2
        mkdir -p "fuzz/artifacts/$target"
        for f in "$dir"/crashes/*; do
            [[ -f "$f" ]] || continue
            cp "$f" "fuzz/artifacts/$target/"
            echo "fuzz: reproduce with: $bin_dir/$target fuzz/artifacts/$target/$(basename "$f")" >&2
        done
    fi
    line=$(printf '%-16s %12s %8s %12s %s' "$target" "${execs:-0}" "${rate:-0}" "${corpus:-?}" "$crashes")
    summary+=("$line")
    echo "fuzz: $line"
done

end=$(date +%s)
echo
printf '%-16s %12s %8s %12s %s\n' target executions exec/s corpus crashes
printf '%s\n' "${summary[@]}"
echo "fuzz: build $((built - start)) s, total $((end - start)) s"
if ((failed)); then
    echo "fuzz: a target crashed (inputs under fuzz/artifacts/)" >&2
    exit 1
fi
