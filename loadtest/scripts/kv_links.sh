#!/usr/bin/env bash
# KV transfer over shaped links: a prefill worker and a decode worker in two
# network namespaces joined by a veth pair, shaped with tc; for each link,
# wire type and prompt length, the transfer time left after the prefill's
# compute (its tail) against the job's wall time. Needs root (ip netns, tc).
# Creates everything it uses and removes it on exit.
#
#   sudo loadtest/scripts/kv_links.sh            # the whole table
#   LINKS="10g 1g" DTYPES=f16 LENGTHS="512" REPEATS=3 loadtest/scripts/kv_links.sh
#
# Links: 10g and 1g (rate, 0.5 ms RTT), 1g-lossy (also 1% of packets to the
# decode worker dropped), 100m (where a CPU prefill outruns the link),
# loopback (no shaping). The RTT and the loss use
# netem where the kernel has it; without netem the rate is shaped with tbf,
# the loss with an iptables `statistic` rule, and the RTT is left out (the
# script says so).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BIN="${PDSERVE_BIN:-$ROOT/target/release}"
MODEL="${PDSERVE_MODEL:-$ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
LINKS="${LINKS:-loopback 10g 1g 1g-lossy}"
DTYPES="${DTYPES:-f32 f16}"
LENGTHS="${LENGTHS:-128 256 512 1024 2048}"
REPEATS="${REPEATS:-3}"
THREADS="${THREADS:-1}"
P=pdkv-prefill; D=pdkv-decode; PA=10.77.0.1; DA=10.77.0.2
export PDSERVE_INTERNAL_TOKEN="${PDSERVE_INTERNAL_TOKEN:-kv-links-$RANDOM$RANDOM}"
pids=()
cleanup() {
    kill -TERM "${pids[@]}" 2>/dev/null || true
    wait 2>/dev/null || true
    ip netns del "$P" 2>/dev/null || true
    ip netns del "$D" 2>/dev/null || true
}
trap cleanup EXIT
cleanup
ip netns add "$P"; ip netns add "$D"
ip link add pdkv-p netns "$P" type veth peer name pdkv-d netns "$D"
ip -n "$P" addr add "$PA/24" dev pdkv-p; ip -n "$D" addr add "$DA/24" dev pdkv-d
for ns in "$P" "$D"; do ip -n "$ns" link set lo up; done
ip -n "$P" link set pdkv-p up; ip -n "$D" link set pdkv-d up

has_netem=1
ip netns exec "$P" tc qdisc add dev pdkv-p root netem delay 0ms 2>/dev/null || has_netem=0
ip netns exec "$P" tc qdisc del dev pdkv-p root 2>/dev/null || true
[ "$has_netem" = 1 ] || echo "note: no netem in this kernel: rates shaped with tbf, loss by iptables, no added RTT" >&2

# shape LINK: both directions of the veth.
shape() {
    local rate="" loss=""
    case "$1" in
        loopback) ;;
        10g) rate=10gbit ;;
        1g) rate=1gbit ;;
        1g-lossy) rate=1gbit; loss=1 ;;
        100m) rate=100mbit ;;
        *) echo "unknown link $1" >&2; exit 2 ;;
    esac
    for side in "$P pdkv-p" "$D pdkv-d"; do
        set -- $side
        ip netns exec "$1" tc qdisc del dev "$2" root 2>/dev/null || true
        [ -z "$rate" ] && continue
        if [ "$has_netem" = 1 ]; then
            # 0.25 ms each way: 0.5 ms RTT.
            ip netns exec "$1" tc qdisc add dev "$2" root netem delay 0.25ms rate "$rate" \
                ${loss:+loss ${loss}%}
        else
            local burst=256kb; [ "$rate" = 10gbit ] && burst=4mb; [ "$rate" = 100mbit ] && burst=64kb
            ip netns exec "$1" tc qdisc add dev "$2" root tbf rate "$rate" burst "$burst" latency 20ms
        fi
    done
    ip netns exec "$D" iptables -F INPUT 2>/dev/null || true
    if [ -n "$loss" ] && [ "$has_netem" = 0 ]; then
        ip netns exec "$D" iptables -A INPUT -i pdkv-d -m statistic --mode random \
            --probability "0.0$loss" -j DROP
    fi
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
for dtype in $DTYPES; do
    start_workers "$dtype"
    for link in $LINKS; do
        shape "$link"
        ip netns exec "$P" python3 "$ROOT/loadtest/scripts/kv_links.py" \
            "http://$DA:8211" "http://$PA:8111" "$link $dtype" "$REPEATS" $LENGTHS
    done
    kill -TERM "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; pids=()
done
