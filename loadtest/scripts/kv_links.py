#!/usr/bin/env python3
"""One prefill worker's KV transfer over a link, against its prefill time.

Usage: kv_links.py DECODE_URL PREFILL_URL LABEL REPEATS LENGTH...
Run by kv_links.sh inside the prefill worker's network namespace. For each
prompt length (unique random tokens every job, so no prefix cache on either
side shortens the transfer) it reserves KV on the decode worker, sends the
prefill job and reads the job's own report: compute time, wall time and
bytes sent. The tail is what the transfer added after compute ended (wall
minus compute). Prints one Markdown row per length: medians over REPEATS.
"""
import json
import os
import random
import statistics
import sys
import time
import urllib.request

DECODE, PREFILL, LABEL = sys.argv[1], sys.argv[2], sys.argv[3]
REPEATS = int(sys.argv[4])
LENGTHS = [int(n) for n in sys.argv[5:]]
rng = random.Random(int(time.time()))


def last_line(resp):
    """The prefill job's answer: NDJSON (a `queued` line, then the result)."""
    lines = [json.loads(l) for l in resp.read().decode().splitlines() if l.strip()]
    return lines[-1]


def post(url, body):
    headers = {"content-type": "application/json"}
    token = os.environ.get("PDSERVE_INTERNAL_TOKEN")
    if token:
        headers["authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    return urllib.request.urlopen(req, timeout=120)


def job(n):
    rid = f"links-{n}-{time.time_ns()}"
    prompt = [rng.randrange(100, 40000) for _ in range(n)]
    sampling = {"temperature": 0, "max_tokens": 2}
    stream = post(f"{DECODE}/v1/internal/generate", {
        "request_id": rid, "prompt_tokens": prompt, "sampling": sampling,
        "kv_source": {"kind": "remote", "lease_ms": 120000}})
    kv_url = json.loads(stream.readline())["kv_url"]
    start = time.time()
    res = last_line(post(f"{PREFILL}/v1/internal/prefill", {
        "request_id": rid, "prompt_tokens": prompt, "sampling": sampling,
        "kv_destination": kv_url, "deadline_ms": 120000}))
    wall = time.time() - start
    stream.read()
    return res["compute_seconds"], wall, res["transfer_bytes"]


job(64)  # warm-up: connections, first allocations
for n in LENGTHS:
    runs = [job(n) for _ in range(REPEATS)]
    compute = statistics.median(r[0] for r in runs)
    wall = statistics.median(r[1] for r in runs)
    tail = statistics.median(max(0.0, r[1] - r[0]) for r in runs)
    mb = runs[0][2] / 1e6
    print(f"| {LABEL} | {n} | {mb:.1f} MB | {compute * 1e3:.0f} ms | {wall * 1e3:.0f} ms | "
          f"{tail * 1e3:.1f} ms | {100 * tail / wall:.1f}% |", flush=True)
