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
import random
import statistics
import sys
import time

import kv_job

DECODE, PREFILL, LABEL = sys.argv[1], sys.argv[2], sys.argv[3]
REPEATS = int(sys.argv[4])
LENGTHS = [int(n) for n in sys.argv[5:]]
rng = random.Random(time.time_ns())


def job(n):
    rid = f"links-{n}-{time.time_ns()}"
    prompt = [rng.randrange(100, 40000) for _ in range(n)]
    res, wall = kv_job.run(DECODE, PREFILL, rid, prompt, 2, 120)
    if "compute_seconds" not in res:
        sys.exit(f"{LABEL}: the {n}-token job failed: {res}")
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
