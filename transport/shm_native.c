/* shm's per-message calls as Python sees them: objects in, objects out.
 *
 * shm_fast.c (through cffi) has the ring's work in C, but each frame still cost both
 * ends a few microseconds of Python around it: cffi takes and gives C values only, so
 * each buffer needed its from_buffer, each frame read its fields unpacked from a
 * struct, its meta sliced out, its buffers copied out, all in Python; and the
 * server's loop around it was Python too. These functions (put, take, the server's
 * frame loop; a connection's lone call, shm_lone.c, included below) do that in C and
 * hand back what Python needs (the GPU host's 64 B round trip over shm was that Python:
 * docs/perf/transport.md). Built and loaded beside the cffi module (shm_fast.py); the
 * ring and frame structs are the cffi module's, passed by address. Whatever they
 * decline (a buffer that is not plain contiguous memory, a record for the Python path)
 * they say so, writing and consuming nothing.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "shm_fast.c"

typedef struct {
    Py_buffer views[FAST_BUFS];
    const char *ptrs[FAST_BUFS];
    uint64_t lens[FAST_BUFS];
    Py_ssize_t n;
} held_buffers;

static void release_buffers(held_buffers *h) {
    for (Py_ssize_t i = 0; i < h->n; i++)
        PyBuffer_Release(&h->views[i]);
    h->n = 0;
}

/* 1: every item of ``seq`` (a list or tuple of at most FAST_BUFS) held as contiguous memory;
 * 0: not so (no Python error left set): the caller's usual path takes them. */
static int hold_buffers(PyObject *seq, held_buffers *h) {
    h->n = 0;
    if (!PyList_Check(seq) && !PyTuple_Check(seq))
        return 0;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > FAST_BUFS)
        return 0;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyObject_GetBuffer(items[i], &h->views[i], PyBUF_C_CONTIGUOUS) < 0) {
            PyErr_Clear();
            release_buffers(h);
            return 0;
        }
        h->n = i + 1;
        h->ptrs[i] = h->views[i].buf;
        h->lens[i] = (uint64_t)h->views[i].len;
    }
    return 1;
}

/* A frame's metadata (bytes) and its buffers held: 1; 0 when a buffer is not plain contiguous memory
 * (nothing held, no Python error); -1 on a Python error (the metadata is not bytes). */
static int hold_frame(PyObject *meta_obj, PyObject *bufs, char **meta, Py_ssize_t *meta_len, held_buffers *h) {
    if (PyBytes_AsStringAndSize(meta_obj, meta, meta_len) < 0)
        return -1;
    return hold_buffers(bufs, h);
}

static int as_u64(PyObject *o, uint64_t *v) {
    *v = PyLong_AsUnsignedLongLong(o);
    return !(*v == (uint64_t)-1 && PyErr_Occurred());
}

static int as_double(PyObject *o, double *v) {
    *v = PyFloat_AsDouble(o);
    return !(*v == -1.0 && PyErr_Occurred());
}

#define U64(i, name) uint64_t name; if (!as_u64(args[i], &name)) return NULL
#define DBL(i, name) double name; if (!as_double(args[i], &name)) return NULL
#define ARGS(count, fn) if (nargs != count) { \
        PyErr_Format(PyExc_TypeError, fn "() takes %d arguments (%zd given)", count, nargs); return NULL; }

/* The buffers of the frame ``f`` describes (taken, wholly in the ring), copied out: a list of
 * memoryviews of fresh bytearrays (the ring's space is the peer's again once consumed). */
static PyObject *copied_buffers(const rgpu_ring *r, const rgpu_frame *f) {
    PyObject *bufs = PyList_New((Py_ssize_t)f->nbufs);
    for (uint64_t i = 0; bufs && i < f->nbufs; i++) {
        PyObject *b = PyByteArray_FromStringAndSize((const char *)r->ring_in + f->buf_off[i], (Py_ssize_t)f->buf_len[i]);
        PyObject *v = b ? PyMemoryView_FromObject(b) : NULL;
        Py_XDECREF(b);
        if (!v)
            Py_CLEAR(bufs);
        else
            PyList_SET_ITEM(bufs, (Py_ssize_t)i, v);
    }
    return bufs;
}

/* The frame ``f`` describes as (kind, seq, ack, meta bytes, [buffers]), its record consumed; NULL
 * (nothing consumed) on a Python error. */
static PyObject *frame_tuple(const rgpu_ring *r, rgpu_frame *f) {
    PyObject *meta = PyBytes_FromStringAndSize((const char *)r->ring_in + f->meta_off, (Py_ssize_t)f->meta_len);
    PyObject *bufs = meta ? copied_buffers(r, f) : NULL;
    if (!bufs) {
        Py_XDECREF(meta);
        return NULL;
    }
    rgpu_shm_consume(r, f->next);
    return Py_BuildValue("(KKKNN)", (unsigned long long)f->kind, (unsigned long long)f->seq,
                         (unsigned long long)f->ack, meta, bufs);
}

/* put(ring, tail, kind, flags, seq, ack, meta, buffers) -> the new tail; -1 (not a frame for the
 * ring alone), -2 (no room now); None when a buffer is not plain contiguous memory. */
static PyObject *py_put(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    ARGS(8, "put");
    U64(0, ring); U64(1, tail); U64(2, kind); U64(3, flags); U64(4, seq); U64(5, ack);
    char *meta; Py_ssize_t meta_len; held_buffers h;
    int held = hold_frame(args[6], args[7], &meta, &meta_len, &h);
    if (held <= 0)
        return held < 0 ? NULL : Py_NewRef(Py_None);
    int64_t t = rgpu_shm_put((const rgpu_ring *)ring, tail, (uint32_t)kind, (uint32_t)flags, seq, ack, meta,
                             (uint32_t)meta_len, (uint32_t)h.n, h.ptrs, h.lens);
    release_buffers(&h);
    return PyLong_FromLongLong(t);
}

/* rgpu_shm_take, and a frame of a kind outside ``kinds`` (a bit per kind) left for the Python path
 * (which names it): 0, 1 or 2 as rgpu_shm_take says. */
static int take_known(const rgpu_ring *r, uint64_t head, uint64_t max_meta, uint64_t max_bufs, uint64_t max_frame,
                      uint64_t kinds, rgpu_frame *f) {
    int got = rgpu_shm_take(r, head, (uint32_t)max_meta, (uint32_t)max_bufs, max_frame, f);
    return got == 1 && (f->kind >= 64 || !((kinds >> f->kind) & 1)) ? 2 : got;
}

/* take(ring, frame, head, max_meta, max_bufs, max_frame, kinds) -> (kind, seq, ack, meta, [buffers])
 * with the record consumed and its buffers copied out (the frame's ``next`` is the new head); else
 * the int take_known gave: 0, nothing there; 2, a record for the Python path at the frame's ``head``. */
static PyObject *py_take(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    ARGS(7, "take");
    U64(0, ring); U64(1, frame); U64(2, head); U64(3, max_meta); U64(4, max_bufs); U64(5, max_frame); U64(6, kinds);
    const rgpu_ring *r = (const rgpu_ring *)ring;
    rgpu_frame *f = (rgpu_frame *)frame;
    int got = take_known(r, head, max_meta, max_bufs, max_frame, kinds, f);
    if (got != 1)
        return PyLong_FromLong(got);
    return frame_tuple(r, f);
}

/* Until the peer's tail passes ``head`` (rgpu_shm_wait's answer): the first busy_s with the GIL held,
 * the rest of spin_s without it. An answer within busy_s (a round trip's, a streamed op's next) then
 * costs no hand-off of the GIL and back, which on the GPU host was a tenth of a 64 B round trip. */
static int wait_for_peer(const rgpu_ring *r, uint64_t head, double busy_s, double spin_s, int yield_core) {
    int got = rgpu_shm_wait(r, head, busy_s, busy_s, 0);
    if (!got && spin_s > busy_s) {
        Py_BEGIN_ALLOW_THREADS
        got = rgpu_shm_wait(r, head, 0, spin_s - busy_s, yield_core);
        Py_END_ALLOW_THREADS
    }
    return got;
}

/* ``n`` bytes of metadata at ``p`` decoded by ``spec``, (function, option names, option values) as
 * wire.unpack_spec gives it: function(bytes, **options) by vectorcall. NULL with a Python error. */
static PyObject *decode_meta(PyObject *spec, const char *p, Py_ssize_t n) {
    if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) != 3 || !PyTuple_Check(PyTuple_GET_ITEM(spec, 1))
        || !PyTuple_Check(PyTuple_GET_ITEM(spec, 2)) || PyTuple_GET_SIZE(PyTuple_GET_ITEM(spec, 2)) > 8
        || PyTuple_GET_SIZE(PyTuple_GET_ITEM(spec, 1)) != PyTuple_GET_SIZE(PyTuple_GET_ITEM(spec, 2))) {
        PyErr_SetString(PyExc_TypeError, "unpack: (function, option names, option values) expected");
        return NULL;
    }
    PyObject *raw = PyBytes_FromStringAndSize(p, n);
    if (!raw)
        return NULL;
    PyObject *values = PyTuple_GET_ITEM(spec, 2), *argv[9] = {raw};
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(values); i++)
        argv[1 + i] = PyTuple_GET_ITEM(values, i);
    PyObject *meta = PyObject_Vectorcall(PyTuple_GET_ITEM(spec, 0), argv, 1, PyTuple_GET_ITEM(spec, 1));
    Py_DECREF(raw);
    return meta;
}

/* A byte pair msgpack decodes as a timestamp (extension -1) itself, without the ext_hook that
 * refuses every other extension: such metadata goes to the Python path, which decides. */
static int has_timestamp_mark(const uint8_t *p, uint64_t n) {
    for (const uint8_t *q = memchr(p, 0xff, n); q; q = memchr(q + 1, 0xff, n - (uint64_t)(q + 1 - p))) {
        uint64_t i = (uint64_t)(q - p);
        if ((i >= 1 && (p[i - 1] == 0xd6 || p[i - 1] == 0xd7)) || (i >= 2 && p[i - 2] == 0xc7 && p[i - 1] == 0x0c))
            return 1;
    }
    return 0;
}

/* A reply of ``result`` (None or (meta, buffers)) put in the ring: 1, or 0 with nothing written and
 * no Python error set (metadata ``pack`` refused, buffers that are not plain memory, too big for the
 * ring alone, no room): the Python path sends it, naming what is wrong. */
static int put_reply(const rgpu_ring *r, uint64_t *tail, uint64_t kind, uint64_t seq, uint64_t ack,
                     PyObject *result, PyObject *pack) {
    PyObject *meta = Py_None, *bufs = NULL;
    if (result != Py_None) {
        if (!PyTuple_Check(result) || PyTuple_GET_SIZE(result) != 2)
            return 0;
        meta = PyTuple_GET_ITEM(result, 0);
        bufs = PyTuple_GET_ITEM(result, 1);
    }
    PyObject *packed = meta == Py_None ? PyBytes_FromStringAndSize(NULL, 0) : PyObject_CallOneArg(pack, meta);
    if (!packed || !PyBytes_Check(packed)) {
        PyErr_Clear();
        Py_XDECREF(packed);
        return 0;
    }
    held_buffers h = {.n = 0};
    PyObject *empty = NULL;
    if (!bufs)
        bufs = empty = PyList_New(0);
    int ok = bufs && hold_buffers(bufs, &h);
    if (ok) {
        int64_t t = rgpu_shm_put(r, *tail, (uint32_t)kind, 0, seq, ack, PyBytes_AS_STRING(packed),
                                 (uint32_t)PyBytes_GET_SIZE(packed), (uint32_t)h.n, h.ptrs, h.lens);
        release_buffers(&h);
        ok = t >= 0;
        if (ok)
            *tail = (uint64_t)t;
    }
    PyErr_Clear();
    Py_XDECREF(empty);
    Py_DECREF(packed);
    return ok;
}

static PyObject *raised(void) {
#if PY_VERSION_HEX >= 0x030C0000
    return PyErr_GetRaisedException();
#else
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb)
        PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
#endif
}

enum { SERVE_IDLE, SERVE_PYTHON, SERVE_RAISED, SERVE_REPLY };

/* serve(ring, frame, tail, head, handle, unpack, pack, max_meta, max_bufs, max_frame, post, request,
 * reply, busy_s, spin_s, yield_core, applied) -> (why, applied, detail): a server's frame loop for
 * frames wholly in the ring, waiting as wait_for_peer does. Each POST or REQUEST goes through
 * ``handle(meta, buffers, wants_reply)`` (meta by ``unpack``, buffers copied out, the record consumed
 * first) and a request's answer back into the ring (meta by ``pack``, ack = ``applied``). It returns
 * when Python is needed: why 0, nothing came within spin_s; 1, the next record is for the Python
 * path (another kind, heap buffers, anything malformed or undecodable), not consumed; 2, ``handle``
 * raised: detail (seq, the exception); 3, the answer could not be put here: detail (seq, result).
 * The frame's ``tail`` and ``head`` always say where the ends are, even when it raises itself. */
static PyObject *py_serve(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    ARGS(17, "serve");
    U64(0, ring); U64(1, frame); U64(2, tail); U64(3, head);
    PyObject *handle = args[4], *unpack = args[5], *pack = args[6];
    U64(7, max_meta); U64(8, max_bufs); U64(9, max_frame); U64(10, post); U64(11, request); U64(12, reply);
    DBL(13, busy_s); DBL(14, spin_s); U64(15, yield_core); U64(16, applied);
    const rgpu_ring *r = (const rgpu_ring *)ring;
    rgpu_frame *f = (rgpu_frame *)frame;
    int why = SERVE_IDLE;
    PyObject *detail = NULL;
    for (;;) {
        f->tail = tail;
        f->head = head;
        int waited = wait_for_peer(r, head, busy_s, spin_s, (int)yield_core);
        if (PyErr_CheckSignals() < 0)
            return NULL;
        int got = waited ? take_known(r, head, max_meta, max_bufs, max_frame, (1ull << post) | (1ull << request), f)
                         : 0;
        if (got != 1) {
            if (got)
                head = f->head;            /* past any wrap marker */
            why = got ? SERVE_PYTHON : SERVE_IDLE;
            break;
        }
        head = f->head;
        const char *meta_p = (const char *)r->ring_in + f->meta_off;
        if (has_timestamp_mark((const uint8_t *)meta_p, f->meta_len)) {
            why = SERVE_PYTHON;
            break;
        }
        PyObject *meta = f->meta_len ? decode_meta(unpack, meta_p, (Py_ssize_t)f->meta_len) : Py_NewRef(Py_None);
        if (!meta) {
            PyErr_Clear();                 /* the Python path names what is wrong */
            why = SERVE_PYTHON;
            break;
        }
        PyObject *bufs = copied_buffers(r, f);
        if (!bufs) {
            Py_DECREF(meta);
            return NULL;
        }
        uint64_t seq = f->seq, kind = f->kind;
        rgpu_shm_consume(r, f->next);
        head = f->head = f->next;
        PyObject *argv[3] = {meta, bufs, kind == request ? Py_True : Py_False};
        PyObject *result = PyObject_Vectorcall(handle, argv, 3, NULL);
        Py_DECREF(meta);
        Py_DECREF(bufs);
        if (!result) {
            why = SERVE_RAISED;
            detail = Py_BuildValue("(KN)", (unsigned long long)seq, raised());
            break;
        }
        applied = seq;
        if (kind == request && !put_reply(r, &tail, reply, seq, applied, result, pack)) {
            why = SERVE_REPLY;
            detail = Py_BuildValue("(KN)", (unsigned long long)seq, result);
            break;
        }
        Py_DECREF(result);
    }
    f->tail = tail;
    f->head = head;
    if (why >= SERVE_RAISED && !detail)
        return NULL;
    return Py_BuildValue("(iKN)", why, (unsigned long long)applied, detail ? detail : Py_NewRef(Py_None));
}

#include "shm_ends.c"
#include "shm_lone.c"

static PyMethodDef methods[] = {
    {"put", (PyCFunction)(void (*)(void))py_put, METH_FASTCALL, "A frame into the ring."},
    {"take", (PyCFunction)(void (*)(void))py_take, METH_FASTCALL, "A frame out of the ring."},
    {"lone_call", (PyCFunction)(void (*)(void))new_lone_call, METH_FASTCALL, "A connection's exchange state and lone call over shm."},
    {"serve", (PyCFunction)(void (*)(void))py_serve, METH_FASTCALL, "A server's frame loop, in the ring."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "_rgpu_shm_native", .m_size = -1,
                                     .m_methods = methods};

PyMODINIT_FUNC PyInit__rgpu_shm_native(void) {
    if (PyType_Ready(&EndsType) < 0 || PyType_Ready(&LoneCallType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddObjectRef(m, "Ends", (PyObject *)&EndsType) < 0)
        Py_CLEAR(m);
    return m;
}
