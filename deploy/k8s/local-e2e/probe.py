"""Exec probe for a pod on the host network whose worker took a free port:
finds the port the container's main process (PID 1) listens on and GETs
http://127.0.0.1:<port><path> (argv[1], /ready or /health). With the host
network two workers on one node cannot share a fixed port, and an httpGet
probe needs one."""
import os
import sys
import urllib.request

path = sys.argv[1] if len(sys.argv) > 1 else "/ready"
inodes = set()
for fd in os.listdir("/proc/1/fd"):
    try:
        target = os.readlink(f"/proc/1/fd/{fd}")
    except OSError:
        continue
    if target.startswith("socket:["):
        inodes.add(target[len("socket:["):-1])
ports = []
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    try:
        lines = open(table).read().splitlines()[1:]
    except OSError:
        continue
    for line in lines:
        f = line.split()
        if f[3] == "0A" and f[9] in inodes:  # LISTEN, and ours
            ports.append(int(f[1].rsplit(":", 1)[1], 16))
if not ports:
    sys.exit("not listening yet")
urllib.request.urlopen(f"http://127.0.0.1:{ports[0]}{path}", timeout=2)
