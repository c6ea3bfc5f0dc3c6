#!/usr/bin/env python3
"""The floor under any added-latency figure on this machine: the round trip
of one byte between two processes over loopback TCP (TCP_NODELAY), after
the two have been idle for a while, as a request's hops are between tokens.

    python3 loadtest/scripts/loopback_rtt.py            # client and server on cores 0 and 1
    python3 loadtest/scripts/loopback_rtt.py --same-core

Prints the median and p90 round trip for idle gaps of 0, 1, 10 and 100 ms.
"""
import os
import socket
import statistics
import sys
import time

ROUNDS = 30
GAPS_MS = [0, 1, 10, 100]


def serve(listener):
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while data := conn.recv(64):
        conn.sendall(data)


def main():
    same = "--same-core" in sys.argv
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    pid = os.fork()
    if pid == 0:
        os.sched_setaffinity(0, {1 % os.cpu_count()} if not same else {0})
        serve(listener)
        os._exit(0)
    os.sched_setaffinity(0, {0})
    conn = socket.create_connection(("127.0.0.1", port))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    print(f"loopback round trip, {'one core' if same else 'two cores'}, {ROUNDS} rounds per gap")
    for gap in GAPS_MS:
        rtts = []
        for _ in range(ROUNDS):
            time.sleep(gap / 1000)
            start = time.perf_counter_ns()
            conn.sendall(b"x")
            conn.recv(64)
            rtts.append((time.perf_counter_ns() - start) / 1000)
        rtts.sort()
        p90 = rtts[int(0.9 * len(rtts))]
        print(f"idle {gap:4d} ms before each: median {statistics.median(rtts):6.0f} us, p90 {p90:6.0f} us")
    conn.close()
    os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
