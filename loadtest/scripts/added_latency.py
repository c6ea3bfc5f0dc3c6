"""The latency the router adds, per request, from a load test's JSON and the
decode worker's and router's logs (router_overhead.sh runs it).

    python3 added_latency.py RUN_JSON DECODE_LOG ROUTER_LOG

Each request's client end-to-end time minus the decode worker's span of it
(`generate stream closed ... elapsed_us`, its request id with `-0`), and
the router's own span (`request served ... elapsed_us`) minus the same,
split at the decode span's end into before and after; p50 / p90 / p99.
"""
import datetime, json, re, sys

if len(sys.argv) != 4:
    sys.exit(__doc__)
run = json.load(open(sys.argv[1]))


def spans(path):
    """request id -> (end as Unix seconds, span in ms), from log lines that
    start with an RFC 3339 timestamp."""
    out = {}
    for line in open(path, errors="replace"):
        m = re.search(r'^(\S+?)Z?\s.*request_id=(\S+) elapsed_us=(\d+)', line)
        if m:
            end = datetime.datetime.fromisoformat(m.group(1)).timestamp()
            out[m.group(2)] = (end, int(m.group(3)) / 1e3)
    return out


decode, router = spans(sys.argv[2]), spans(sys.argv[3])
client_added, router_added, before, after = [], [], [], []
for point in run.get("points", [run]):
    for t in point.get("targets", []):
        for r in t.get("records", []):
            if r.get("error") or r.get("warmup") or not r.get("id"):
                continue
            if r["id"] + "-0" not in decode:
                continue
            d_end, span = decode[r["id"] + "-0"]
            client_added.append(r["e2e"] * 1e3 - span)
            if r["id"] in router:
                r_end, r_span = router[r["id"]]
                router_added.append(r_span - span)
                after.append((r_end - d_end) * 1e3)
                before.append(router_added[-1] - after[-1])
if not client_added:
    sys.exit("no request paired with the decode worker's log")


def show(label, added):
    added.sort()
    pct = lambda q: added[min(len(added) - 1, int(q * len(added)))]
    print(f"added latency ({label}), {len(added)} requests: p50 {pct(0.5):.2f} ms, "
          f"p90 {pct(0.9):.2f} ms, p99 {pct(0.99):.2f} ms, max {added[-1]:.2f} ms")


show("client E2E - decode worker span", client_added)
if router_added:
    show("the router's own span - decode worker span", router_added)
    show("of which before the decode worker's span", before)
    show("of which after it", after)
