#!/usr/bin/env python3
"""The simulator's link model against kv_links.sh's measured tails.

    loadtest/scripts/kv_links.sh | python3 loadtest/scripts/kv_links_model.py

For every shaped row of the table on stdin it computes the tail that
`pdserve-loadtest simulate` predicts for the same prompt, measured compute
time and link (`Link::arrival` in loadtest/src/simulate/cluster/mod.rs): the
KV of the last chunk's last layer after compute ends, or the whole transfer
less compute where the link is slower than the prefill, plus the one-way
latency. SmolLM2-135M: 30 layers, 11,520 KV elements per token; the
prefill worker's default chunk of 512 tokens.
"""
import sys

LAYERS, ELEMENTS, CHUNK = 30, 11_520, 512
RATES = {"10g": 10e9, "1g": 1e9, "1g-lossy": 1e9, "100m": 100e6}
ONE_WAY_S = float(sys.argv[1]) / 1e3 if len(sys.argv) > 1 else 0.25e-3

print("| link / wire | prompt | measured tail | model tail | measured / model |")
print("| --- | --- | --- | --- | --- |")
for line in sys.stdin:
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) != 7 or len(cells[0].split()) != 2:
        continue
    link, wire = cells[0].split()
    if link not in RATES or not cells[1].isdigit():
        continue
    n = int(cells[1])
    compute = float(cells[3].split()[0]) / 1e3
    tail = float(cells[5].split()[0]) / 1e3
    per_token = ELEMENTS * (4 if wire == "f32" else 2)
    rate = RATES[link] / 8
    last_chunk = n % CHUNK or min(n, CHUNK)
    model = max(last_chunk * per_token / LAYERS / rate, n * per_token / rate - compute) + ONE_WAY_S
    print(f"| {link} {wire} | {n} | {tail * 1e3:.1f} ms | {model * 1e3:.1f} ms | {tail / model:.2f} |")
