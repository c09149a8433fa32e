"""Measuring an emulated link: a TCP echo server and a client timing small round trips over one connection.

    python -m corolla.netemu.probe serve PORT            # echoes every byte back; prints "listening" once ready
    python -m corolla.netemu.probe rtt HOST PORT [N]     # prints {"rtt_ms": [...], "median_ms": ...}

The client sends one byte and waits for it N times (TCP_NODELAY on both ends), so each sample is one network
round trip plus a little scheduling noise. Both ends stop on their own: the server after its first client leaves
or `SERVE_TIMEOUT` seconds, the client after N samples or `CLIENT_TIMEOUT` seconds.
"""

from __future__ import annotations

import json
import socket
import statistics
import sys
import time

SERVE_TIMEOUT = 120.0  # seconds the echo server waits for and serves its client
CLIENT_TIMEOUT = 30.0  # seconds the client may take in all


def serve(port: int) -> None:
    with socket.create_server(("0.0.0.0", port)) as listener:
        listener.settimeout(SERVE_TIMEOUT)
        print("listening", flush=True)
        connection, _ = listener.accept()
        with connection:
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connection.settimeout(SERVE_TIMEOUT)
            while data := connection.recv(4096):
                connection.sendall(data)


def measure(host: str, port: int, samples: int) -> dict[str, object]:
    """Round trips of one byte over one TCP connection to `host`:`port`, in milliseconds."""
    deadline = time.monotonic() + CLIENT_TIMEOUT
    with socket.create_connection((host, port), timeout=CLIENT_TIMEOUT) as connection:
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rtts = []
        for _ in range(samples):
            if time.monotonic() > deadline:
                break
            begin = time.perf_counter()
            connection.sendall(b"x")
            if connection.recv(1) != b"x":
                raise ConnectionError("the echo server closed the connection")
            rtts.append((time.perf_counter() - begin) * 1e3)
    return {"rtt_ms": [round(r, 3) for r in rtts], "median_ms": round(statistics.median(rtts), 3)}


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "serve":
        serve(int(argv[1]))
        return 0
    if len(argv) >= 3 and argv[0] == "rtt":
        print(json.dumps(measure(argv[1], int(argv[2]), int(argv[3]) if len(argv) > 3 else 10)), flush=True)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
