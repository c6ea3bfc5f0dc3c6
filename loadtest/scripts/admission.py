#!/usr/bin/env python3
"""How many sequences a decode worker admits at once.

Opens up to N generate streams on one decode worker, each a prompt of
--prompt-tokens token ids with --max-tokens, waiting for KV from a prefill
worker that never comes (kv_source remote, a long lease), so every admitted
sequence keeps its reservation. Counts the `reserved` answers until the
worker refuses (kv_exhausted), then closes every stream (the worker frees
the KV). Loopback only; bounded by N and by --timeout.

    loadtest/scripts/admission.py http://127.0.0.1:PORT --streams 700

The worker is the one from `pdserve-decode --port PORT ...`, or a local
worker of `up.sh` (its URL is in the router's log and on /metrics).
"""

import argparse
import http.client
import json
import sys
import time
import urllib.parse


def open_stream(host, port, i, args):
    body = json.dumps({
        "request_id": f"admission-{i}",
        "prompt_tokens": [100 + (i * 7 + k) % 5000 for k in range(args.prompt_tokens)],
        "sampling": {"temperature": 0, "max_tokens": args.max_tokens},
        "kv_source": {"kind": "remote", "lease_ms": int(args.timeout * 1000)},
    })
    conn = http.client.HTTPConnection(host, port, timeout=args.timeout)
    conn.request("POST", "/v1/internal/generate", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        kind = json.loads(resp.read() or b"{}").get("kind", f"http_{resp.status}")
        conn.close()
        return None, kind
    line = json.loads(resp.readline())
    if line.get("event") != "reserved":
        conn.close()
        return None, line.get("kind", line.get("event"))
    return conn, "reserved"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("url", help="the decode worker's base URL (loopback)")
    ap.add_argument("--streams", type=int, default=700, help="streams to try at most")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds, whole run and each lease")
    args = ap.parse_args()
    u = urllib.parse.urlparse(args.url)
    if u.hostname not in ("127.0.0.1", "localhost"):
        sys.exit("loopback only")
    held, refused, started = [], {}, time.time()
    for i in range(args.streams):
        if time.time() - started > args.timeout:
            break
        conn, outcome = open_stream(u.hostname, u.port, i, args)
        if conn is None:
            refused[outcome] = refused.get(outcome, 0) + 1
            break
        held.append(conn)
    print(json.dumps({
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "admitted": len(held),
        "first_refusal": refused,
    }))
    for c in held:
        c.close()


if __name__ == "__main__":
    main()
