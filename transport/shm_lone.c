/* A connection's lone call over shm, whole in C: Connection._call_alone (connection_lone.py, the
 * reference and the path of every other transport) and shm's round trip in one call from Python.
 *
 * On the GPU host a 64 B round trip over shm was mostly the client's Python around its C call:
 * the connection's checks and locks, its frame and reply objects (docs/perf/transport.md). This
 * takes the same steps in the same order on the same objects (the connection's locks, queue,
 * pending requests, sequence, stats and flags; the transport's locks and ends), with the GIL held
 * except while it waits. What is not the common case goes to the connection's own Python: a frame
 * the ring does not take (``_exchange_alone``: the usual write and read), a reply not here within
 * the spin or not a plain one (``_read_alone``), a transport that failed (``_lost``).
 * Included by shm_native.c (one extension); ``new_lone_call`` names the objects it uses. The Reply it
 * returns is made through the tuple's constructor (Reply is a tuple), never by its layout.
 */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *conn, *transport, *cdict, *tdict;                  /* and their instance dicts */
    PyObject *pending, *queue, *seq, *stats, *limits;            /* the connection's, fixed for its life */
    PyObject *rcv_acquire, *rcv_release, *notify_all, *cv_acquire, *cv_release, *send_acquire, *send_release;
    PyObject *t_send_acquire, *t_send_release, *t_recv_acquire, *t_recv_release;   /* the transport's */
    PyObject *unpack, *pack, *pack_meta, *reply_type, *frame_type, *kinds, *as_bytes_view, *rgpu_error;
    const rgpu_ring *ring;
    rgpu_frame *frame;
    uint64_t max_meta, max_bufs, max_frame, known_kinds, request, reply;
    double busy_s;                      /* the transport's, and its spin_yield: class settings, read once */
    int spin_yield;
} LoneCall;

#define LONE_OBJECTS(X) X(conn) X(transport) X(cdict) X(tdict) X(pending) X(queue) X(seq) X(stats) X(limits) \
    X(rcv_acquire) X(rcv_release) X(notify_all) X(cv_acquire) X(cv_release) X(send_acquire) X(send_release) \
    X(t_send_acquire) X(t_send_release) X(t_recv_acquire) X(t_recv_release) X(unpack) X(pack) X(pack_meta) \
    X(reply_type) X(frame_type) X(kinds) X(as_bytes_view) X(rgpu_error)

static PyObject *s_reading, *s_dead, *s_async_error, *s_waiters, *s_sending_seq, *s_closed, *s_tail, *s_head,
    *s_shared_until, *s_busy_s, *s_spin_s, *s_spin_yield, *s_exchange_alone, *s_read_alone, *s_lost, *s_recv_c,
    *s_messages, *s_round_trips, *s_bytes_out, *s_bytes_in;

static int intern_names(void) {
    struct { PyObject **name; const char *text; } names[] = {
        {&s_reading, "_reading"}, {&s_dead, "_dead"}, {&s_async_error, "_async_error"}, {&s_waiters, "_waiters"},
        {&s_sending_seq, "_sending_seq"}, {&s_closed, "_closed"}, {&s_tail, "_tail"}, {&s_head, "_head"},
        {&s_shared_until, "_shared_until"}, {&s_busy_s, "busy_s"}, {&s_spin_s, "spin_s"},
        {&s_spin_yield, "spin_yield"}, {&s_exchange_alone, "_exchange_alone"}, {&s_read_alone, "_read_alone"},
        {&s_lost, "_lost"}, {&s_recv_c, "_recv_c"}, {&s_messages, "messages"}, {&s_round_trips, "round_trips"},
        {&s_bytes_out, "bytes_out"}, {&s_bytes_in, "bytes_in"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!(*names[i].name = PyUnicode_InternFromString(names[i].text)))
            return -1;
    return 0;
}

/* ---- small steps on Python objects: each -1 (or NULL) with a Python error set ---------------- */

static PyObject *fetch_error(void) { return PyErr_Occurred() ? raised() : NULL; }

static void restore_error(PyObject *exc) {    /* the error fetch_error took, raised again (none: nothing) */
    if (!exc)
        return;
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(exc);
#else
    PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(exc)), exc, PyException_GetTraceback(exc));
#endif
}

static int call0(PyObject *fn) {              /* a lock's acquire, a condition's notify_all */
    PyObject *r = PyObject_CallNoArgs(fn);
    Py_XDECREF(r);
    return r ? 0 : -1;
}

/* A held lock let go; an error already set stays (a release that fails is reported as unraisable). */
static void release(PyObject *fn) {
    PyObject *exc = fetch_error(), *r = PyObject_CallNoArgs(fn);
    if (!r)
        PyErr_WriteUnraisable(fn);
    Py_XDECREF(r);
    restore_error(exc);
}

/* The connection's and the transport's per-call state is read and written in their instance dicts
 * (none of it is a descriptor): PyObject_GetAttr looks through their classes first, and these were
 * a seventh of the call. */
static PyObject *field(PyObject *dict, PyObject *name) {   /* borrowed */
    PyObject *v = PyDict_GetItemWithError(dict, name);
    if (!v && !PyErr_Occurred())
        PyErr_SetObject(PyExc_AttributeError, name);
    return v;
}

/* ``name`` in ``dict``: 1 if set (truthy; or not None where ``none_is_unset``), 0 if not */
static int flag(PyObject *dict, PyObject *name, int none_is_unset) {
    PyObject *v = field(dict, name);
    return !v ? -1 : none_is_unset ? v != Py_None : PyObject_IsTrue(v);
}

static int field_u64(PyObject *dict, PyObject *name, uint64_t *out) {
    PyObject *v = field(dict, name);
    return v && as_u64(v, out) ? 0 : -1;
}

static int field_double(PyObject *dict, PyObject *name, double *out) {
    PyObject *v = field(dict, name);
    return v && as_double(v, out) ? 0 : -1;
}

static int set_u64(PyObject *dict, PyObject *name, uint64_t value) {
    PyObject *v = PyLong_FromUnsignedLongLong(value);
    int r = v ? PyDict_SetItem(dict, name, v) : -1;
    Py_XDECREF(v);
    return r;
}

static int add_count(PyObject *stats, PyObject *key, uint64_t n) {    /* stats[key] += n */
    PyObject *was = PyDict_GetItemWithError(stats, key), *add = PyLong_FromUnsignedLongLong(n);
    PyObject *now = add && was ? PyNumber_Add(was, add) : NULL;
    int r = now ? PyDict_SetItem(stats, key, now) : -1;
    if (!was && !PyErr_Occurred())
        PyErr_SetObject(PyExc_KeyError, key);
    Py_XDECREF(add);
    Py_XDECREF(now);
    return r;
}

/* ---- the connection's side: Connection._call_alone's steps ------------------------------------ */

/* 1 when something is in flight (a request pending, frames queued) or the connection failed (and,
 * with ``async_too``, a post's error is kept): a lone call is not for now. */
static int in_flight(LoneCall *L, int async_too) {
    if (PyDict_GET_SIZE(L->pending))
        return 1;
    Py_ssize_t queued = PyObject_Size(L->queue);
    if (queued)
        return queued < 0 ? -1 : 1;
    int dead = flag(L->cdict, s_dead, 1);
    return dead || !async_too ? dead : flag(L->cdict, s_async_error, 1);
}

/* ``_reading`` taken for this thread: 1; 0 when another thread reads. */
static int begin_read(LoneCall *L) {
    if (call0(L->rcv_acquire) < 0)
        return -1;
    int reading = flag(L->cdict, s_reading, 0);
    if (!reading && PyDict_SetItem(L->cdict, s_reading, Py_True) < 0)
        reading = -1;
    release(L->rcv_release);
    return reading < 0 ? -1 : !reading;
}

/* ``_end_read()``: ``_reading`` cleared, waiting threads woken. An error already set is kept. */
static void end_read(LoneCall *L) {
    PyObject *exc = fetch_error();
    if (call0(L->rcv_acquire) == 0) {
        if (PyDict_SetItem(L->cdict, s_reading, Py_False) == 0 && flag(L->cdict, s_waiters, 0) > 0)
            call0(L->notify_all);
        release(L->rcv_release);
    }
    if (exc) {
        PyErr_Clear();                        /* the call's own error is the one to raise */
        restore_error(exc);
    }
}

/* Under the connection's condition lock: nothing queued or pending, not failed, the send lock
 * taken without waiting and the next sequence number drawn: 1 (the send lock held); 0: not now. */
static int claim_send(LoneCall *L, uint64_t *seq) {
    if (call0(L->cv_acquire) < 0)
        return -1;
    int busy = in_flight(L, 0);
    if (!busy) {
        PyObject *got = PyObject_CallOneArg(L->send_acquire, Py_False);
        busy = got ? !PyObject_IsTrue(got) : -1;
        Py_XDECREF(got);
    }
    PyObject *n = busy ? NULL : PyIter_Next(L->seq);
    if (!busy && !(n && as_u64(n, seq))) {
        busy = -1;
        release(L->send_release);
    }
    Py_XDECREF(n);
    release(L->cv_release);
    return busy < 0 ? -1 : !busy;
}

/* ---- the transport's side: the round trip in the ring -------------------------------------------- */

typedef struct {
    uint64_t sent, kind, seq, ack;
    int copied;
    PyObject *meta;             /* the reply's, decoded here (its record consumed), or NULL */
    PyObject *frame;            /* else the Frame the transport's _recv_c read, or NULL */
} round_trip;

/* Under the transport's locks: the request put in the ring, the answer waited for and taken, its
 * metadata decoded, its one buffer copied into ``into``; the transport's ends moved. 1: sent;
 * 0: nothing written (closed, not plain memory, too big for the ring alone, no room now). */
static int ring_round_trip(LoneCall *L, uint64_t seq, PyObject *packed, PyObject *buffers, PyObject *into,
                           round_trip *rt) {
    uint64_t tail, head;
    double spin_s, shared_until;
    int closed = flag(L->tdict, s_closed, 0);
    if (closed)
        return closed < 0 ? -1 : 0;           /* the usual way names it */
    if (field_u64(L->tdict, s_tail, &tail) < 0 || field_u64(L->tdict, s_head, &head) < 0
        || field_double(L->tdict, s_spin_s, &spin_s) < 0 || field_double(L->tdict, s_shared_until, &shared_until) < 0)
        return -1;
    /* the peer shares our core: yield it from the start (shm_recv.py's _busy_s; perf_counter is CLOCK_MONOTONIC) */
    double busy_s = now_s() < shared_until ? 0.0 : L->busy_s;
    char *meta;
    Py_ssize_t meta_len;
    held_buffers h;
    int held = hold_frame(packed, buffers, &meta, &meta_len, &h);
    if (held <= 0)
        return held;
    Py_buffer target = {0};
    if (into && PyObject_GetBuffer(into, &target, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyErr_Clear();
        release_buffers(&h);
        return 0;
    }
    int64_t t = rgpu_shm_put(L->ring, tail, (uint32_t)L->request, 0, seq, 0, meta, (uint32_t)meta_len,
                             (uint32_t)h.n, h.ptrs, h.lens);
    for (Py_ssize_t i = 0; i < h.n; i++)
        rt->sent += h.lens[i];
    release_buffers(&h);
    if (t < 0 || set_u64(L->tdict, s_tail, (uint64_t)t) < 0) {
        if (into)
            PyBuffer_Release(&target);
        return t < 0 ? 0 : -1;
    }
    rgpu_frame *f = L->frame;
    int copied = 0;
    int got = wait_for_peer(L->ring, head, busy_s, spin_s, L->spin_yield)
        ? take_known(L->ring, head, L->max_meta, L->max_bufs, L->max_frame, L->known_kinds, f) : 0;
    if (got == 1 && into && f->nbufs == 1 && f->buf_len[0] == (uint64_t)target.len) {
        memcpy(target.buf, L->ring->ring_in + f->buf_off[0], (size_t)target.len);
        copied = 1;
    }
    if (into)
        PyBuffer_Release(&target);
    if (got)
        head = f->head;                       /* past any wrap marker */
    const char *meta_p = (const char *)L->ring->ring_in + f->meta_off;
    if (got == 1 && (f->nbufs == 0 || copied) && !has_timestamp_mark((const uint8_t *)meta_p, f->meta_len)) {
        rt->meta = f->meta_len ? decode_meta(L->unpack, meta_p, (Py_ssize_t)f->meta_len) : Py_NewRef(Py_None);
        if (rt->meta) {
            rgpu_shm_consume(L->ring, f->next);
            head = f->next;
            rt->kind = f->kind, rt->seq = f->seq, rt->ack = f->ack, rt->copied = copied;
        } else {
            PyErr_Clear();                    /* the Python path names what is wrong */
        }
    }
    if (set_u64(L->tdict, s_head, head) < 0)
        return -1;
    if (got == 1 && !rt->meta)                /* read by the transport's Python, from the frame's words */
        return (rt->frame = PyObject_CallMethodObjArgs(L->transport, s_recv_c, L->limits, Py_None, NULL)) ? 1 : -1;
    return 1;
}

/* ring_round_trip with the transport's send and receive locks held (close() waits on them). */
static int locked_round_trip(LoneCall *L, uint64_t seq, PyObject *packed, PyObject *buffers, PyObject *into,
                             round_trip *rt) {
    if (call0(L->t_send_acquire) < 0)
        return -1;
    if (call0(L->t_recv_acquire) < 0) {
        release(L->t_send_release);
        return -1;
    }
    int r = ring_round_trip(L, seq, packed, buffers, into, rt);
    release(L->t_recv_release);
    release(L->t_send_release);
    return r;
}

/* Reply(meta, bufs, None), made by the tuple's constructor (Reply is a tuple of the three): Reply's own
 * __new__ is a Python call, a tenth of the lone call, and this needs nothing of its layout. */
static PyObject *new_reply(LoneCall *L, PyObject *meta, PyObject *bufs) {
    PyObject *items = PyTuple_Pack(3, meta, bufs, Py_None), *args = items ? PyTuple_Pack(1, items) : NULL;
    PyObject *reply = args ? PyTuple_Type.tp_new((PyTypeObject *)L->reply_type, args, NULL) : NULL;  /* tuple(items) */
    Py_XDECREF(args);
    Py_XDECREF(items);
    return reply;
}

/* The reply as Python's path gives it: a Reply when it is this request's plain answer, else what
 * the connection's ``_read_alone`` makes of it (an error, a failed post's error first, more frames). */
static PyObject *answer(LoneCall *L, uint64_t seq, PyObject *reply_into, PyObject *into, round_trip *rt) {
    if (!rt->meta) {
        PyObject *n = PyLong_FromUnsignedLongLong(seq);
        PyObject *got = n ? PyObject_CallMethodObjArgs(L->conn, s_read_alone, n, reply_into,
                                                       rt->frame ? rt->frame : Py_None, NULL) : NULL;
        Py_XDECREF(n);
        return got;
    }
    PyObject *view = NULL, *bufs;
    if (rt->copied) {
        Py_buffer *b = PyMemoryView_Check(into) ? PyMemoryView_GET_BUFFER(into) : NULL;
        int plain = b && b->ndim == 1 && (!b->format || !strcmp(b->format, "B")) && PyBuffer_IsContiguous(b, 'C');
        view = plain ? Py_NewRef(into) : PyObject_CallOneArg(L->as_bytes_view, into);
        if (!view)
            return NULL;
        bufs = PyList_New(1);
        if (bufs)
            PyList_SET_ITEM(bufs, 0, Py_NewRef(view));
    } else {
        bufs = PyList_New(0);
    }
    int async_error = bufs ? flag(L->cdict, s_async_error, 1) : -1;
    PyObject *result = NULL;
    if (async_error == 0 && rt->kind == L->reply && rt->seq == seq) {
        if (!view || add_count(L->stats, s_bytes_in, (uint64_t)PyMemoryView_GET_BUFFER(view)->len) == 0) {
            result = new_reply(L, rt->meta, bufs);
        }
    } else if (async_error >= 0) {            /* an ERROR, another request's reply, a post's error kept */
        PyObject *number = PyLong_FromUnsignedLongLong(rt->kind);
        PyObject *kind = number ? PyObject_GetItem(L->kinds, number) : NULL;
        Py_XDECREF(number);
        PyObject *frame = kind ? PyObject_CallFunction(L->frame_type, "OKKOO", kind, (unsigned long long)rt->seq,
                                                       (unsigned long long)rt->ack, rt->meta, bufs) : NULL;
        PyObject *n = frame ? PyLong_FromUnsignedLongLong(seq) : NULL;
        result = n ? PyObject_CallMethodObjArgs(L->conn, s_read_alone, n, reply_into, frame, NULL) : NULL;
        Py_XDECREF(kind);
        Py_XDECREF(frame);
        Py_XDECREF(n);
    }
    Py_XDECREF(view);
    Py_XDECREF(bufs);
    return result;
}

/* The claimed call (the send lock held; released here): written and read through the ring, or the
 * usual way where the ring declines it. */
static PyObject *exchange(LoneCall *L, uint64_t seq, PyObject *packed, PyObject *buffers,
                          PyObject *reply_into, PyObject *into) {
    round_trip rt = {0};
    int r = add_count(L->stats, s_messages, 1) < 0 || add_count(L->stats, s_round_trips, 1) < 0
        || set_u64(L->cdict, s_sending_seq, seq) < 0 ? -1 : locked_round_trip(L, seq, packed, buffers, into, &rt);
    PyObject *n = r ? NULL : PyLong_FromUnsignedLongLong(seq);
    if (!r)                                   /* nothing written: the usual way, which releases the send lock */
        return n ? PyObject_CallMethodObjArgs(L->conn, s_exchange_alone, n, packed, buffers, reply_into, NULL) : NULL;
    release(L->send_release);
    PyObject *result = NULL;
    if (r > 0 && add_count(L->stats, s_bytes_out, rt.sent) == 0)
        result = answer(L, seq, reply_into, into, &rt);
    else if (PyErr_ExceptionMatches(L->rgpu_error)) {   /* the transport failed: the connection is lost */
        PyObject *exc = raised();
        PyObject *why = PyObject_CallMethodOneArg(L->conn, s_lost, exc);
        Py_DECREF(exc);
        if (why)
            PyErr_SetObject((PyObject *)Py_TYPE(why), why);
        Py_XDECREF(why);
    }
    Py_XDECREF(rt.meta);
    Py_XDECREF(rt.frame);
    return result;
}

/* ``meta`` packed by this call's own Packer: the reader's (``_reading``), so no other thread's at once.
 * What it refuses goes through wire's pack_meta, which names the fault (or encodes it). */
static PyObject *encode(LoneCall *L, PyObject *meta) {
    if (meta == Py_None)
        return PyBytes_FromStringAndSize(NULL, 0);   /* no metadata block: decodes back to None */
    PyObject *packed = PyObject_CallOneArg(L->pack, meta);
    if (!packed) {
        PyErr_Clear();
        packed = PyObject_CallOneArg(L->pack_meta, meta);
    }
    return packed;
}

/* lone(meta, buffers, reply_into) -> Reply, or None when the call is not for now (another thread
 * reads or writes, a request is pending, frames are queued, the connection failed, ``reply_into`` is
 * not one target): nothing sent, request() does it. Connection.call()'s lone call, as _call_alone. */
static PyObject *lone_call(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    LoneCall *L = (LoneCall *)self;
    if (PyVectorcall_NARGS(nargsf) != 3 || kwnames) {
        PyErr_SetString(PyExc_TypeError, "lone call: (meta, buffers, reply_into) expected");
        return NULL;
    }
    PyObject *meta = args[0], *buffers = args[1], *reply_into = args[2], *into = NULL;
    if (reply_into != Py_None) {
        if ((!PyList_Check(reply_into) && !PyTuple_Check(reply_into)) || PySequence_Fast_GET_SIZE(reply_into) != 1)
            Py_RETURN_NONE;
        into = PySequence_Fast_ITEMS(reply_into)[0];
    }
    int busy = in_flight(L, 1);
    if (busy)
        return busy < 0 ? NULL : Py_NewRef(Py_None);
    int mine = begin_read(L);
    if (mine <= 0)
        return mine < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *packed = encode(L, meta);       /* raises before anything is sent */
    if (!packed) {
        end_read(L);
        return NULL;
    }
    uint64_t seq = 0;
    int claimed = claim_send(L, &seq);
    PyObject *reply = claimed > 0 ? exchange(L, seq, packed, buffers, reply_into, into)
                                  : claimed == 0 ? Py_NewRef(Py_None) : NULL;
    Py_DECREF(packed);
    end_read(L);
    return reply;
}

static int lone_traverse(PyObject *self, visitproc visit, void *arg) {
    LoneCall *L = (LoneCall *)self;
#define VISIT(name) Py_VISIT(L->name);
    LONE_OBJECTS(VISIT)
#undef VISIT
    return 0;
}

static int lone_clear(PyObject *self) {
    LoneCall *L = (LoneCall *)self;
#define CLEAR(name) Py_CLEAR(L->name);
    LONE_OBJECTS(CLEAR)
#undef CLEAR
    return 0;
}

static void lone_dealloc(PyObject *self) {
    PyObject_GC_UnTrack(self);
    lone_clear(self);
    Py_TYPE(self)->tp_free(self);
}

static PyTypeObject LoneCallType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_rgpu_shm_native.LoneCall",
    .tp_basicsize = sizeof(LoneCall),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "A connection's lone call over shm: lone(meta, buffers, reply_into) -> Reply or None.",
    .tp_traverse = lone_traverse,
    .tp_clear = lone_clear,
    .tp_dealloc = lone_dealloc,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(LoneCall, vectorcall),
};

static PyObject *getattr2(PyObject *obj, const char *name, const char *method) {   /* obj.name.method */
    PyObject *o = PyObject_GetAttrString(obj, name);
    PyObject *m = o && method ? PyObject_GetAttrString(o, method) : NULL;
    if (!method)
        return o;
    Py_XDECREF(o);
    return m;
}

static int limit(PyObject *limits, const char *name, uint64_t *out) {
    PyObject *v = PyObject_GetAttrString(limits, name);
    int ok = v && as_u64(v, out);
    Py_XDECREF(v);
    return ok;
}

/* lone_call(conn, transport, ring, frame, known_kinds, request, reply, unpack, pack, pack_meta, Reply,
 * Frame, kinds, as_bytes_view, RgpuError): the LoneCall of a Connection over a ShmTransport whose C
 * path is attached (ring and frame: its structs' addresses; known_kinds, request, reply, unpack: as
 * take and serve have them; pack: a Packer's pack of its own; the rest: wire's pack_meta, connection_recv's
 * Reply, wire's Frame, the MsgKind of each kind's number (by item), buffers' as_bytes_view, rgpu's base
 * error). It keeps the connection's _pending, _queue, _seq, stats, limits, its locks' and the
 * transport's locks' methods and both instance dicts, and reads their flags and ends on each call. */
static PyObject *new_lone_call(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    ARGS(15, "lone_call");
    U64(2, ring); U64(3, frame); U64(4, known_kinds); U64(5, request); U64(6, reply);
    LoneCall *L = PyObject_GC_New(LoneCall, &LoneCallType);
    if (!L)
        return NULL;
#define NULLED(name) L->name = NULL;
    LONE_OBJECTS(NULLED)
#undef NULLED
    L->vectorcall = lone_call;
    L->ring = (const rgpu_ring *)ring;
    L->frame = (rgpu_frame *)frame;
    L->known_kinds = known_kinds, L->request = request, L->reply = reply;
    PyObject *conn = args[0], *transport = args[1];
    PyObject **kept[] = {&L->conn, &L->transport, &L->unpack, &L->pack, &L->pack_meta, &L->reply_type,
                         &L->frame_type, &L->kinds, &L->as_bytes_view, &L->rgpu_error};
    int from[] = {0, 1, 7, 8, 9, 10, 11, 12, 13, 14};
    for (size_t i = 0; i < sizeof from / sizeof from[0]; i++)
        *kept[i] = Py_NewRef(args[from[i]]);
    PyObject_GC_Track((PyObject *)L);
    PyObject *yield = NULL;
    int ok = (L->cdict = PyObject_GenericGetDict(conn, NULL)) && (L->tdict = PyObject_GenericGetDict(transport, NULL))
        && (L->pending = getattr2(conn, "_pending", NULL)) && (L->queue = getattr2(conn, "_queue", NULL))
        && (L->seq = getattr2(conn, "_seq", NULL)) && (L->stats = getattr2(conn, "stats", NULL))
        && (L->limits = getattr2(conn, "limits", NULL))
        && (L->rcv_acquire = getattr2(conn, "_rcv_lock", "acquire"))
        && (L->rcv_release = getattr2(conn, "_rcv_lock", "release"))
        && (L->notify_all = getattr2(conn, "_rcv", "notify_all"))
        && (L->cv_acquire = getattr2(conn, "_cv_lock", "acquire"))
        && (L->cv_release = getattr2(conn, "_cv_lock", "release"))
        && (L->send_acquire = getattr2(conn, "_send_lock", "acquire"))
        && (L->send_release = getattr2(conn, "_send_lock", "release"))
        && (L->t_send_acquire = getattr2(transport, "_send_lock", "acquire"))
        && (L->t_send_release = getattr2(transport, "_send_lock", "release"))
        && (L->t_recv_acquire = getattr2(transport, "_recv_lock", "acquire"))
        && (L->t_recv_release = getattr2(transport, "_recv_lock", "release"))
        && limit(L->limits, "max_meta_bytes", &L->max_meta) && limit(L->limits, "max_buffers", &L->max_bufs)
        && limit(L->limits, "max_frame_bytes", &L->max_frame)
        && field_double(L->tdict, s_spin_s, &(double){0}) == 0         /* the per-call fields are there */
        && (yield = PyObject_GetAttr(transport, s_spin_yield)) && (L->spin_yield = PyObject_IsTrue(yield)) >= 0;
    Py_XDECREF(yield);
    PyObject *busy = ok ? PyObject_GetAttr(transport, s_busy_s) : NULL;
    ok = busy && as_double(busy, &L->busy_s) && PyDict_Check(L->pending) && PyDict_Check(L->stats)
        && PyIter_Check(L->seq) && PyType_Check(L->reply_type)
        && PyType_IsSubtype((PyTypeObject *)L->reply_type, &PyTuple_Type);
    Py_XDECREF(busy);
    if (!ok) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "lone_call: a connection and an attached shm transport expected");
        Py_DECREF(L);
        return NULL;
    }
    return (PyObject *)L;
}
