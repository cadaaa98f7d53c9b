/* A shm transport's ring ends as an object C owns, with a Python face (``Ends``): the tail it writes,
 * the head it reads, its closed flag and until when its peer shares our core. ``ShmTransport`` keeps
 * its ends in one once its C path is attached (``shm_ring.Ends`` is the Python path's twin); the lone
 * call (shm_lone.c) moves them in C, and ``put`` writes a frame at the tail and moves it in one call.
 * Included by shm_native.c (one extension), after its put's helpers.
 */
#include <structmember.h>

typedef struct {
    PyObject_HEAD
    unsigned long long tail, head;      /* the next record's place out, the next record's place in */
    char closed;
    double shared_until;                /* perf_counter time until which the peer shares our core */
} Ends;

static PyObject *ends_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    unsigned long long tail, head;
    static char *kwlist[] = {"tail", "head", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "KK:Ends", kwlist, &tail, &head))
        return NULL;
    Ends *e = (Ends *)type->tp_alloc(type, 0);
    if (e)
        e->tail = tail, e->head = head, e->closed = 0, e->shared_until = 0.0;
    return (PyObject *)e;
}

/* ends.put(ring, kind, flags, seq, ack, meta, buffers): the frame into the ring at the tail, the tail moved:
 * True; False where the ring declines it (not a frame for the ring alone, no room now, not plain memory:
 * the Python path); None when closed. One call where Python would read and write the tail around put. */
static PyObject *ends_put(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    ARGS(7, "put");
    Ends *e = (Ends *)self;
    if (e->closed)
        Py_RETURN_NONE;
    U64(0, ring); U64(1, kind); U64(2, flags); U64(3, seq); U64(4, ack);
    char *meta; Py_ssize_t meta_len; held_buffers h;
    int held = hold_frame(args[5], args[6], &meta, &meta_len, &h);
    if (held <= 0)
        return held < 0 ? NULL : Py_NewRef(Py_False);
    int64_t t = rgpu_shm_put((const rgpu_ring *)ring, e->tail, (uint32_t)kind, (uint32_t)flags, seq, ack, meta,
                             (uint32_t)meta_len, (uint32_t)h.n, h.ptrs, h.lens);
    release_buffers(&h);
    if (t < 0)
        Py_RETURN_FALSE;
    e->tail = (uint64_t)t;
    Py_RETURN_TRUE;
}

static PyMethodDef ends_methods[] = {
    {"put", (PyCFunction)(void (*)(void))ends_put, METH_FASTCALL,
     "put(ring, kind, flags, seq, ack, meta, buffers) -> True (written), False (declined), None (closed)."},
    {NULL},
};

static PyMemberDef ends_members[] = {
    {"tail", T_ULONGLONG, offsetof(Ends, tail), 0, "where the next record out goes (unpublished until published)"},
    {"head", T_ULONGLONG, offsetof(Ends, head), 0, "where the next record in is read"},
    {"closed", T_BOOL, offsetof(Ends, closed), 0, "the transport was closed"},
    {"shared_until", T_DOUBLE, offsetof(Ends, shared_until), 0, "until when (perf_counter) the peer shares our core"},
    {NULL},
};

static PyTypeObject EndsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_rgpu_shm_native.Ends",
    .tp_basicsize = sizeof(Ends),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Ends(tail, head): a shm transport's ring ends, closed flag and shared-core deadline.",
    .tp_new = ends_new,
    .tp_members = ends_members,
    .tp_methods = ends_methods,
};

