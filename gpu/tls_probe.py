"""Where TLS's time goes on this host: N TLS socket pairs in one process (as a striped frame's streams),
each moving SIZE bytes one way at once, read three ways: Python's recv_into (a record a call), rgpu's C read
(tls_fast.py), and the C read with OpenSSL's read-ahead (a buffer of READ_AHEAD bytes a read() instead of a
record's header and its body). Beside them: one core's AES-GCM (`openssl speed`). Prints one JSON line.

    python3 gpu/tls_probe.py [--streams 1,4,5] [--size 256M] [--repeats 3]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import socket
import ssl
import statistics
import subprocess
import tempfile
import threading
import time

from rgpu.config import _size
from rgpu.transport import tls_fast


def contexts(folder):
    cert, key = os.path.join(folder, "c.pem"), os.path.join(folder, "k.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", key, "-out", cert, "-days", "1", "-subj", "/CN=probe"], check=True, capture_output=True)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname, client.verify_mode = False, ssl.CERT_NONE
    return server, client


def pair(server, client):
    listener = socket.create_server(("127.0.0.1", 0))
    plain = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    listener.close()
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("s", server.wrap_socket(accepted, server_side=True)))
    t.start()
    c = client.wrap_socket(plain)
    t.join()
    return c, got["s"]


def once(ctxs, n: int, size: int, mode: str, ahead: int) -> float:
    pairs = [pair(*ctxs) for _ in range(n)]
    src = memoryview(bytearray(size))
    dsts = [memoryview(bytearray(size)) for _ in range(n)]
    lib = tls_fast._openssl()
    readers = []
    for _, s in pairs:
        if mode == "c+ahead":
            p = tls_fast._field(s._sslobj, 1)
            lib.SSL_set_read_ahead(ctypes.c_void_p(p), 1)
            lib.SSL_set_default_read_buffer_len(ctypes.c_void_p(p), ctypes.c_size_t(ahead))
        readers.append(tls_fast.exact_reader(s) if mode != "python" else None)

    def read(i):
        pos, view, s = 0, dsts[i], pairs[i][1]
        if readers[i] is not None:
            pos = readers[i](view)
        while pos < size:
            pos += s.recv_into(view[pos:])

    threads = [threading.Thread(target=read, args=(i,)) for i in range(n)]
    threads += [threading.Thread(target=pairs[i][0].sendall, args=(src,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    for c, s in pairs:
        c.close()
        s.close()
    return n * size / dt / 1e9


def openssl_speed(cipher: str) -> float | None:
    done = subprocess.run(["openssl", "speed", "-evp", cipher, "-seconds", "1", "-bytes", "16384"],
                          capture_output=True, text=True)
    try:
        return float(done.stdout.strip().splitlines()[-1].split()[-1].rstrip("k")) * 1e3 / 1e9
    except (IndexError, ValueError):
        return None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--streams", default="1,4,5")
    p.add_argument("--size", default="256M")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--read-ahead", default="256K")
    a = p.parse_args()
    size, ahead = _size(a.size), _size(a.read_ahead)
    lib = tls_fast._openssl()
    lib.SSL_set_read_ahead.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.SSL_set_default_read_buffer_len.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    out = {"cores": len(os.sched_getaffinity(0)), "openssl": ssl.OPENSSL_VERSION,
           "aes_256_gcm_GBps_one_core": openssl_speed("aes-256-gcm"),
           "aes_128_gcm_GBps_one_core": openssl_speed("aes-128-gcm"),
           "ktls_option": hasattr(ssl, "OP_ENABLE_KTLS"), "kernel_tls_module": os.path.isdir("/sys/module/tls"),
           "rows": []}
    with tempfile.TemporaryDirectory() as folder:
        ctxs = contexts(folder)
        for n in (int(x) for x in a.streams.split(",")):
            got = {m: [] for m in ("python", "c", "c+ahead")}
            for _ in range(a.repeats):            # interleaved
                for m in got:
                    got[m].append(once(ctxs, n, size, m, ahead))
            out["rows"].append({"streams": n, **{m: {"median_GBps": statistics.median(v), "runs": v}
                                                 for m, v in got.items()}})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
