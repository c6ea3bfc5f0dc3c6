#!/usr/bin/env bash
# KV transfer over shaped links: a prefill worker and a decode worker in two
# network namespaces, the link between them shaped in both directions; for
# each link, wire type and prompt length, the transfer time left after the
# prefill's compute (its tail) against the job's wall time. Needs root
# (ip netns, tc, TUN devices). Creates everything it uses and removes it on
# exit.
#
#   sudo loadtest/scripts/kv_links.sh            # the whole table
#   sudo LINKS="10g 1g" DTYPES=f16 LENGTHS="512" REPEATS=3 loadtest/scripts/kv_links.sh
#
# Links: 10g and 1g (rate, RTT_MS round trip, 0.5 ms by default), 1g-lossy
# (also 1% of packets dropped each way), 100m (where a CPU prefill outruns
# the link), loopback (the veth, unshaped). Shaped links use netem on the
# veth where the kernel has it. Without netem the two workers' addresses move
# to a pair of TUN devices joined by `pdserve-loadtest link`, which adds the
# same rate, delay and loss in user space; the script says which it used.
# After each link it prints (on stderr) the KV connection's smoothed RTT as
# the kernel measured it, and the emulator's own lateness.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BIN="${PDSERVE_BIN:-$ROOT/target/release}"
MODEL="${PDSERVE_MODEL:-$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
LINKS="${LINKS:-loopback 10g 1g 1g-lossy}"
DTYPES="${DTYPES:-f32 f16}"
LENGTHS="${LENGTHS:-128 256 512 1024 2048}"
REPEATS="${REPEATS:-3}"
THREADS="${THREADS:-1}"
RTT_MS="${RTT_MS:-0.5}"
HALF_RTT_MS="$(awk -v r="$RTT_MS" 'BEGIN { print r / 2 }')"
P=pdkv-prefill; D=pdkv-decode; PA=10.77.0.1; DA=10.77.0.2
export PDSERVE_INTERNAL_TOKEN="${PDSERVE_INTERNAL_TOKEN:-kv-links-$RANDOM$RANDOM}"
pids=()
link_pid=""
LINK_LOG=""
cleanup() {
    stop_link
    kill -TERM "${pids[@]}" 2>/dev/null || true
    wait 2>/dev/null || true
    ip netns del "$P" 2>/dev/null || true
    ip netns del "$D" 2>/dev/null || true
    [ -z "$LINK_LOG" ] || rm -f "$LINK_LOG"
}
# stop_link: the user-space link, if one runs; its report goes to stderr.
stop_link() {
    [ -n "$link_pid" ] || return 0
    kill -TERM "$link_pid" 2>/dev/null || true
    wait "$link_pid" 2>/dev/null || true
    link_pid=""
    grep '^link ' "$LINK_LOG" | grep -v 'link ready' >&2 || true
}
trap cleanup EXIT
cleanup
LINK_LOG="$(mktemp)"
ip netns add "$P"; ip netns add "$D"
ip link add pdkv-p netns "$P" type veth peer name pdkv-d netns "$D"
ip -n "$P" addr add "$PA/24" dev pdkv-p; ip -n "$D" addr add "$DA/24" dev pdkv-d
for ns in "$P" "$D"; do ip -n "$ns" link set lo up; done
ip -n "$P" link set pdkv-p up; ip -n "$D" link set pdkv-d up

has_netem=1
ip netns exec "$P" tc qdisc add dev pdkv-p root netem delay 0ms 2>/dev/null || has_netem=0
ip netns exec "$P" tc qdisc del dev pdkv-p root 2>/dev/null || true
if [ "$has_netem" = 0 ]; then
    echo "note: no netem in this kernel: shaped links run through pdserve-loadtest link (TUN devices, user space)" >&2
    ip netns exec "$P" ip tuntap add dev pdkv-tp mode tun vnet_hdr
    ip netns exec "$D" ip tuntap add dev pdkv-td mode tun vnet_hdr
    ip -n "$P" link set pdkv-tp up; ip -n "$D" link set pdkv-td up
fi

# route_via veth|tun: the two workers' addresses on that pair of devices.
# Connections survive the move: their addresses do not change.
route_via() {
    local on_p=pdkv-p on_d=pdkv-d off_p=pdkv-tp off_d=pdkv-td
    if [ "$1" = tun ]; then on_p=pdkv-tp; on_d=pdkv-td; off_p=pdkv-p; off_d=pdkv-d; fi
    ip -n "$P" addr flush dev "$off_p"; ip -n "$D" addr flush dev "$off_d"
    ip -n "$P" addr replace "$PA/24" dev "$on_p"; ip -n "$D" addr replace "$DA/24" dev "$on_d"
}

# shape LINK: both directions.
shape() {
    local mbit="" loss=0
    case "$1" in
        loopback) ;;
        10g) mbit=10000 ;;
        1g) mbit=1000 ;;
        1g-lossy) mbit=1000; loss=1 ;;
        100m) mbit=100 ;;
        *) echo "unknown link $1" >&2; exit 2 ;;
    esac
    stop_link
    local ns dev
    for side in "$P pdkv-p" "$D pdkv-d"; do
        read -r ns dev <<< "$side"
        ip netns exec "$ns" tc qdisc del dev "$dev" root 2>/dev/null || true
        if [ -n "$mbit" ] && [ "$has_netem" = 1 ]; then
            ip netns exec "$ns" tc qdisc add dev "$dev" root netem delay "${HALF_RTT_MS}ms" \
                rate "${mbit}mbit" loss "${loss}%"
        fi
    done
    [ "$has_netem" = 1 ] && return
    if [ -z "$mbit" ]; then route_via veth; return; fi
    route_via tun
    "$BIN/pdserve-loadtest" link --ns-a "$P" --dev-a pdkv-tp --ns-b "$D" --dev-b pdkv-td \
        --delay-ms "$HALF_RTT_MS" --rate-mbit "$mbit" --loss "$loss" 2> "$LINK_LOG" &
    link_pid=$!
    for _ in $(seq 1 100); do
        grep -q 'link ready' "$LINK_LOG" && return
        kill -0 "$link_pid" 2>/dev/null || break
        sleep 0.05
    done
    cat "$LINK_LOG" >&2; echo "the user-space link did not start" >&2; exit 1
}

# report_rtt LABEL: the kernel's smoothed RTT with its mean deviation, and its
# minimum RTT (ms), of the prefill worker's connections to the decode worker.
report_rtt() {
    local rtts
    rtts="$(ip netns exec "$P" ss -tinpH state established dst "$DA" | awk '
        /pdserve-prefill/ { mine = 1; next }
        mine { for (i = 1; i <= NF; i++) if ($i ~ /^(rtt|minrtt):/) printf "%s ", $i; mine = 0 }' || true)"
    echo "$1: the KV connection's ${rtts:-rtt: none open}" >&2
}

start_workers() {
    ip netns exec "$D" "$BIN/pdserve-decode" --model "$MODEL" --host "$DA" --port 8211 \
        --threads 1 --log warn & pids+=($!)
    ip netns exec "$P" "$BIN/pdserve-prefill" --model "$MODEL" --host "$PA" --port 8111 \
        --threads "$THREADS" --kv-dtype "$1" --decode-url "http://$DA:8211" --log warn & pids+=($!)
    for _ in $(seq 1 240); do
        ip netns exec "$P" curl -sf "http://$PA:8111/ready" >/dev/null 2>&1 &&
            ip netns exec "$P" curl -sf "http://$DA:8211/ready" >/dev/null 2>&1 && return
        sleep 0.25
    done
    echo "the workers did not come up" >&2; exit 1
}

echo "| link / wire | prompt | KV sent | compute | wall | tail | tail / wall |"
echo "| --- | --- | --- | --- | --- | --- | --- |"
# Fresh workers for every link, so that each link's TCP connections (their
# congestion state and minimum RTT) start on it.
for dtype in $DTYPES; do
    for link in $LINKS; do
        shape "$link"
        start_workers "$dtype"
        ip netns exec "$P" python3 "$ROOT/loadtest/scripts/kv_links.py" \
            "http://$DA:8211" "http://$PA:8111" "$link $dtype" "$REPEATS" $LENGTHS
        report_rtt "$link $dtype"
        kill -TERM "${pids[@]}" 2>/dev/null || true; wait "${pids[@]}" 2>/dev/null || true; pids=()
    done
    stop_link
done
