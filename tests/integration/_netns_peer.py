"""Small programs that tests run inside a ``NetnsCluster`` host; each prints one JSON line.

python _netns_peer.py serve HOST READY_FILE   # accepts one connection, counts the bytes until EOF
python _netns_peer.py send HOST:PORT NBYTES   # sends NBYTES, then waits for the server's close
python _netns_peer.py connect HOST:PORT SECONDS  # tries one TCP connect, bounded
python _netns_peer.py pushpull HOST:PORT      # psclient: create, push, pull one variable
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def serve(host: str, ready_file: str) -> dict[str, object]:
    with socket.create_server((host, 0)) as srv:
        srv.settimeout(30)
        tmp = ready_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(f"{host}:{srv.getsockname()[1]}")
        os.replace(tmp, ready_file)
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(30)
            total, t0 = 0, 0.0
            while data := conn.recv(1 << 20):
                t0 = t0 or time.perf_counter()
                total += len(data)
            return {"bytes": total, "seconds": time.perf_counter() - t0}


def send(addr: str, nbytes: int) -> dict[str, object]:
    with socket.create_connection(_addr(addr), timeout=30) as conn:
        chunk = b"x" * (1 << 20)
        left = nbytes
        while left > 0:
            conn.sendall(chunk[:left])
            left -= len(chunk)
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)
    return {"sent": nbytes}


def connect(addr: str, seconds: float) -> dict[str, object]:
    try:
        with socket.create_connection(_addr(addr), timeout=seconds):
            return {"connected": True}
    except OSError as e:
        return {"connected": False, "error": type(e).__name__}


def pushpull(addr: str) -> dict[str, object]:
    import numpy as np

    import psclient

    with psclient.PSClient([addr], worker_id="w0", timeout=20.0) as c:
        c.create("v", np.zeros(4, np.float32), optimizer=psclient.SGD(learning_rate=1.0))
        c.push({"v": np.ones(4, np.float32)})
        return {"v": c.pull()["v"].tolist()}


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    if cmd == "serve":
        out = serve(args[0], args[1])
    elif cmd == "send":
        out = send(args[0], int(args[1]))
    elif cmd == "connect":
        out = connect(args[0], float(args[1]))
    else:
        out = pushpull(args[0])
    print(json.dumps(out), flush=True)
