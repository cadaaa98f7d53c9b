"""TLS's big reads in C: a whole buffer read through the socket's OpenSSL object without the GIL.

Python's ``SSLSocket.recv_into`` returns one TLS record (16 KiB at most) a call and takes the GIL again
for each: a GiB is 65,536 calls, and the four streams of a striped frame (``tcp_streams.py``) queued on
the GIL between records (on the H200 host TLS on 4 streams moved 1.5-1.7 GB/s, a fifth of plain tcp's).
``exact_reader(sock)`` returns a function that fills a whole view record after record in one C call
(``rgpu_tls_read`` in ``shm_fast.c``), for reads whose length is known: a frame's buffers, a stripe.
The staging reads of small frames stay with ``recv_into`` (they must return what has come).

The ``SSL *`` is read from CPython's ``_ssl._SSLSocket`` (its layout: the object's head, the socket's
weakref, then the pointer), and trusted only when OpenSSL says it is the socket's (``SSL_get_fd``) and
the context's (``SSL_get_SSL_CTX``); anything else, no C module, or ``RGPU_NATIVE=off``: None, and the
caller reads as Python's ssl does. Errors are never the C call's: when ``SSL_read_ex`` would block or
fails, the rest goes to ``recv_into``, which waits for the socket's timeout or raises what Python raises.
"""
from __future__ import annotations

import ctypes
import ssl
import sys
from collections.abc import Callable

from . import shm_fast

_WORD = ctypes.sizeof(ctypes.c_void_p)
_HEAD = object.__basicsize__          # PyObject_HEAD: what comes before a C object's own fields
_libssl = None                        # the libssl _ssl is linked with, through ctypes (False: not found)


def _openssl():
    global _libssl
    if _libssl is None:
        try:
            import _ssl
            lib = ctypes.CDLL(getattr(_ssl, "__file__", None))   # the same handle: its libssl's symbols
            for name, res, args in (("SSL_get_fd", ctypes.c_int, [ctypes.c_void_p]),
                                    ("SSL_get_SSL_CTX", ctypes.c_void_p, [ctypes.c_void_p])):
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = res, args
            lib.read_ex = ctypes.cast(lib.SSL_read_ex, ctypes.c_void_p).value
            _libssl = lib
        except (ImportError, OSError, AttributeError):
            _libssl = False
    return _libssl or None


def _field(obj, index: int) -> int:
    """The ``index``-th pointer-sized field after ``obj``'s head (CPython's object layout)."""
    return ctypes.c_void_p.from_address(id(obj) + _HEAD + index * _WORD).value or 0


def exact_reader(sock: ssl.SSLSocket, use_c: bool = True) -> Callable[[memoryview], int] | None:
    """A function filling all of a byte view from ``sock`` (returning the bytes read: fewer only at the
    end of the stream), or None where the C read cannot be used on this socket."""
    sslobj = getattr(sock, "_sslobj", None)
    if (not use_c or sys.implementation.name != "cpython" or not (3, 8) <= sys.version_info[:2] <= (3, 14)
            or type(sslobj).__name__ != "_SSLSocket" or not isinstance(sock.context, ssl.SSLContext)):
        return None
    lib, module = _openssl(), shm_fast.load(use_c)
    if lib is None or module is None:
        return None
    pointer = _field(sslobj, 1)       # PySSLSocket: the socket's weakref (0), SSL *ssl (1)
    if (not pointer or lib.SSL_get_SSL_CTX(pointer) != _field(sock.context, 0)   # PySSLContext: SSL_CTX *ctx
            or lib.SSL_get_fd(pointer) != sock.fileno()):
        return None
    read, ffi, recv_into = module.lib.rgpu_tls_read, module.ffi, sock.recv_into
    read_ex = lib.read_ex

    def read_exactly(view: memoryview, _keep=sslobj) -> int:   # _keep: the SSL object lives while this does
        n = view.nbytes
        buf = ffi.from_buffer("char[]", view, require_writable=True)
        pos = 0
        while pos < n:
            pos += read(read_ex, pointer, buf + pos, n - pos)
            if pos < n:                   # would block, a record of another type, or an error: Python's way
                got = recv_into(view[pos:])
                if not got:
                    break
                pos += got
        return pos

    return read_exactly
