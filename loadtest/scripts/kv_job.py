"""One disaggregated job against a decode and a prefill worker's internal API,
shared by kv_overlap.py and kv_links.py: reserve KV on the decode worker,
send the prefill job that streams the KV there, read the job's own report.
Requests carry PDSERVE_INTERNAL_TOKEN when it is set.
"""
import json
import os
import time
import urllib.request


def post(url, body, timeout):
    headers = {"content-type": "application/json"}
    token = os.environ.get("PDSERVE_INTERNAL_TOKEN")
    if token:
        headers["authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    return urllib.request.urlopen(req, timeout=timeout)


def run(decode, prefill, rid, prompt, max_tokens, timeout):
    """Returns the prefill job's result (its last NDJSON line, after a
    `queued` line) and the job's wall time in seconds."""
    sampling = {"temperature": 0, "max_tokens": max_tokens}
    stream = post(f"{decode}/v1/internal/generate", {
        "request_id": rid, "prompt_tokens": prompt, "sampling": sampling,
        "kv_source": {"kind": "remote", "lease_ms": timeout * 1000}}, timeout)
    reserved = json.loads(stream.readline())
    start = time.time()
    # As the router does: the KV stream starts after what the decode worker
    # already holds in its prefix cache.
    answer = post(f"{prefill}/v1/internal/prefill", {
        "request_id": rid, "prompt_tokens": prompt, "sampling": sampling,
        "kv_destination": reserved["kv_url"], "deadline_ms": timeout * 1000,
        "cached_tokens": reserved.get("cached_tokens", 0)}, timeout)
    lines = [json.loads(l) for l in answer.read().decode().splitlines() if l.strip()]
    wall = time.time() - start
    stream.read()
    return lines[-1], wall
