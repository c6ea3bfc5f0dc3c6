#!/usr/bin/env python3
"""Measure how much of the KV transfer the prefill worker hides behind compute.

Start a decode worker and a prefill worker first, e.g.
  target/release/pdserve-decode  --model MODEL --port 8211 --threads 1 &
  target/release/pdserve-prefill --model MODEL --port 8111 --threads 1 --decode-url http://127.0.0.1:8211 &
then run this script (with PDSERVE_INTERNAL_TOKEN set to the workers' token,
if they have one). For each prompt length it reserves KV on the decode
worker, sends the prefill job, and prints compute time, wall time and bytes;
at the end it prints the prefill worker's transfer-tail histogram (transfer
time left after compute ended) and the MFU/MBU gauges.
"""
import sys
import time
import urllib.request

import kv_job

DECODE = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8211"
PREFILL = sys.argv[2] if len(sys.argv) > 2 else "http://127.0.0.1:8111"
PROMPT = [100 + (i * 7919) % 40000 for i in range(512)]


def one(n):
    rid = f"overlap-{n}-{time.time_ns()}"
    res, wall = kv_job.run(DECODE, PREFILL, rid, PROMPT[:n], 4, 60)
    print(f"{n:4d} tokens: compute {res['compute_seconds']:.3f} s, wall {wall:.3f} s, KV {res['transfer_bytes']} bytes")


def metrics(url, prefixes):
    text = urllib.request.urlopen(f"{url}/metrics").read().decode()
    return [line for line in text.splitlines() if line.startswith(prefixes)]


for n in (128, 512, 512, 128):
    one(n)
for line in metrics(PREFILL, ("pdserve_kv_transfer_tail_seconds_sum", "pdserve_kv_transfer_tail_seconds_count",
                              "pdserve_model_flops_utilization_ratio")):
    print(line)
for line in metrics(DECODE, ("pdserve_model_bandwidth_utilization_ratio",)):
    print(line)
