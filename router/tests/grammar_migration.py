"""A constrained stream survives its decode worker's death.

Usage: grammar_migration.py BIN_DIR MODEL ROUTER_PORT DECODE_PORT DECODE_PORT
Run by router/tests/structured.rs on the real model. Two decode workers
behind a router; a streaming JSON-schema request loses its worker (SIGKILL)
after 15 chunks, the router migrates the stream to the other worker, which
rebuilds the grammar state from the tokens already generated: the whole
output must still parse and match the schema.
"""
import json, os, re, signal, subprocess, sys, time, urllib.request
import openai
BIN, MODEL = sys.argv[1], sys.argv[2]
router_port = int(sys.argv[3])
ports = [int(p) for p in sys.argv[4:6]]
procs = []
env = dict(os.environ, PDSERVE_LOG="warn", PDSERVE_INTERNAL_TOKEN="grammar-migration-check")
for p in ports:
    procs.append(subprocess.Popen([f"{BIN}/pdserve-decode", "--model", MODEL, "--port", str(p), "--threads", "1"], env=env))
router = subprocess.Popen([f"{BIN}/pdserve-router", "--model", MODEL, "--port", str(router_port), "--served-model-name", "m",
    "--mode", "aggregated", "--decode-url", ",".join(f"http://127.0.0.1:{p}" for p in ports), "--health-interval-ms", "200"], env=env)
def wait_ready(port):
    for _ in range(240):
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/ready").status == 200: return
        except Exception: pass
        time.sleep(0.5)
    raise SystemExit(f"nothing ready on port {port} after 2 minutes")
try:
    # Both workers, not just the router: the stream must have somewhere to go.
    for p in [router_port] + ports: wait_ready(p)
    # The router's next poll sees the second worker ready.
    time.sleep(1)
    # Exactly six people: an open-ended array lets a sampled answer run past
    # max_tokens before it closes, whatever the migration does.
    SCHEMA = {"type": "object", "properties": {"people": {"type": "array", "minItems": 6, "maxItems": 6, "items": {"type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}}, "required": ["name", "age"],
        "additionalProperties": False}}}, "required": ["people"], "additionalProperties": False}
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{router_port}/v1", api_key="x", max_retries=0)
    stream = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "List six people with their ages as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}, temperature=0.8, seed=11,
        max_tokens=300, stream=True)
    text, killed, chunks = "", None, 0
    for ch in stream:
        for x in ch.choices:
            text += x.delta.content or ""
            chunks += 1
            if chunks == 15 and killed is None:
                for i, p in enumerate(ports):
                    m = urllib.request.urlopen(f"http://127.0.0.1:{p}/metrics").read().decode()
                    active = sum(float(v) for v in re.findall(r'^pdserve_active_sequences\S* (\S+)$', m, re.M))
                    if active >= 1:
                        procs[i].send_signal(signal.SIGKILL); killed = p; print("killed decode worker on", p, "after", chunks, "chunks")
                        break
            if x.finish_reason: print("finish:", x.finish_reason)
    doc = json.loads(text)
    assert len(doc["people"]) == 6 and all(set(p) == {"name", "age"} and isinstance(p["age"], int) for p in doc["people"]), doc
    assert killed is not None, "no worker was killed"
    print("grammar migration passed: the migrated output parses and matches the schema:", text[:120], "...")
finally:
    for p in procs + [router]:
        p.terminate()
