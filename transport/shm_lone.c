/* A connection's lone call over shm, whole in C, on state this file owns.
 *
 * On the GPU host a 64 B round trip over shm was mostly the client's Python around its C call: the connection's
 * checks and locks, its frame and reply objects (docs/perf/transport.md). Two objects own what that call touches,
 * each with a Python face, so Python and C share one copy and neither reaches into the other's private state:
 *
 * - ``Ends`` (shm_ends.c): a shm transport's ring ends, its closed flag, its shared-core deadline.
 * - ``LoneCall`` (here): a connection's exchange state (``transport/exchange.py`` is its Python twin, for every
 *   other transport): the sequence, the reader's token (``reading``, ``waiters``), the seq of the write in
 *   progress, why the connection died, a failed post's kept error, the stats counters; and, called, the lone
 *   call itself: ``LoneCaller._call_alone`` (``exchange.py``, the reference) and shm's round trip in one
 *   call, the GIL held except while it waits.
 *
 * What a LoneCall needs of others it is given when made: the connection's queue and pending requests (only their
 * sizes are read), its locks and condition, the transport's locks and its Ends, and the Python to call where the
 * call is not the common case: a frame the ring does not take (``exchange_alone``: the usual write and read), a
 * reply not here within the spin or not a plain one (``read_alone``), a transport that failed (``lost``), a reply
 * the ring's Python must read (``recv_c``). The Reply it returns is made through the tuple's constructor (Reply
 * is a tuple), never by its layout. Included by shm_native.c (one extension), after shm_ends.c.
 */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    /* owned: the exchange's state, the members of its Python face */
    char reading;
    Py_ssize_t waiters;
    long long seq, sending_seq, messages, round_trips, bytes_out, bytes_in;
    PyObject *dead, *async_error;
    /* given when made, fixed for its life */
    Ends *ends;
    PyObject *limits, *pending, *queue, *rcv_acquire, *rcv_release, *notify_all, *cv_acquire, *cv_release;
    PyObject *send_acquire, *send_release, *t_send_acquire, *t_send_release, *t_recv_acquire, *t_recv_release;
    PyObject *exchange_alone, *read_alone, *lost, *recv_c;
    PyObject *unpack, *pack, *pack_meta, *reply_type, *frame_type, *kinds, *as_bytes_view, *rgpu_error;
    const rgpu_ring *ring;
    rgpu_frame *frame;
    uint64_t max_meta, max_bufs, max_frame, known_kinds, request, reply;
    double busy_s, spin_s;
    int spin_yield;
} LoneCall;

#define LONE_OBJECTS(X) X(dead) X(async_error) X(ends) X(limits) X(pending) X(queue) X(rcv_acquire) \
    X(rcv_release) X(notify_all) X(cv_acquire) X(cv_release) X(send_acquire) X(send_release) X(t_send_acquire) \
    X(t_send_release) X(t_recv_acquire) X(t_recv_release) X(exchange_alone) X(read_alone) X(lost) X(recv_c) \
    X(unpack) X(pack) X(pack_meta) X(reply_type) X(frame_type) X(kinds) X(as_bytes_view) X(rgpu_error)

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

static int is_set(PyObject *o) { return o && o != Py_None; }   /* a T_OBJECT member: None or deleted is unset */

/* ---- the connection's side: Connection._call_alone's steps ------------------------------------ */

/* 1 when something is in flight (a request pending, frames queued) or the connection failed (and,
 * with ``async_too``, a post's error is kept): a lone call is not for now. */
static int in_flight(LoneCall *L, int async_too) {
    if (PyDict_GET_SIZE(L->pending))
        return 1;
    Py_ssize_t queued = PyObject_Size(L->queue);
    if (queued)
        return queued < 0 ? -1 : 1;
    return is_set(L->dead) || (async_too && is_set(L->async_error));
}

/* The reader's token taken for this thread: 1; 0 when another thread reads. */
static int begin_read(LoneCall *L) {
    if (call0(L->rcv_acquire) < 0)
        return -1;
    int reading = L->reading;
    L->reading = 1;
    release(L->rcv_release);
    return !reading;
}

/* The token given back, waiting threads woken. An error already set is kept. */
static void end_read(LoneCall *L) {
    PyObject *exc = fetch_error();
    if (call0(L->rcv_acquire) == 0) {
        L->reading = 0;
        if (L->waiters > 0)
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
    if (!busy)
        *seq = (uint64_t)++L->seq;
    release(L->cv_release);
    return busy < 0 ? -1 : !busy;
}

/* ---- the transport's side: the round trip in the ring -------------------------------------------- */

typedef struct {
    uint64_t sent, kind, seq, ack;
    int copied;
    PyObject *meta;             /* the reply's, decoded here (its record consumed), or NULL */
    PyObject *frame;            /* else the Frame the transport's recv_c read, or NULL */
} round_trip;

/* Under the transport's locks: the request put in the ring, the answer waited for and taken, its
 * metadata decoded, its one buffer copied into ``into``; the transport's ends moved. 1: sent;
 * 0: nothing written (closed, not plain memory, too big for the ring alone, no room now). */
static int ring_round_trip(LoneCall *L, uint64_t seq, PyObject *packed, PyObject *buffers, PyObject *into,
                           PyObject *sent, round_trip *rt) {
    Ends *ends = L->ends;
    if (ends->closed)
        return 0;                             /* the usual way names it */
    /* the peer shares our core: yield it from the start (shm_recv.py's _busy_s; perf_counter is CLOCK_MONOTONIC) */
    double busy_s = now_s() < ends->shared_until ? 0.0 : L->busy_s;
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
    int64_t t = rgpu_shm_put(L->ring, ends->tail, (uint32_t)L->request, 0, seq, 0, meta, (uint32_t)meta_len,
                             (uint32_t)h.n, h.ptrs, h.lens);
    for (Py_ssize_t i = 0; i < h.n; i++)
        rt->sent += h.lens[i];
    release_buffers(&h);
    if (t < 0) {
        if (into)
            PyBuffer_Release(&target);
        return 0;
    }
    ends->tail = (uint64_t)t;
    if (sent)                                 /* the caller's: its error cannot stop a call sent (unraisable) */
        release(sent);
    uint64_t head = ends->head;
    rgpu_frame *f = L->frame;
    int copied = 0;
    int got = wait_for_peer(L->ring, head, busy_s, L->spin_s, L->spin_yield)
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
    ends->head = head;
    if (got == 1 && !rt->meta)                /* read by the transport's Python, from the frame's words */
        return (rt->frame = PyObject_CallFunctionObjArgs(L->recv_c, L->limits, Py_None, NULL)) ? 1 : -1;
    return 1;
}

/* ring_round_trip with the transport's send and receive locks held (close() waits on them). */
static int locked_round_trip(LoneCall *L, uint64_t seq, PyObject *packed, PyObject *buffers, PyObject *into,
                             PyObject *sent, round_trip *rt) {
    if (call0(L->t_send_acquire) < 0)
        return -1;
    if (call0(L->t_recv_acquire) < 0) {
        release(L->t_send_release);
        return -1;
    }
    int r = ring_round_trip(L, seq, packed, buffers, into, sent, rt);
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

static PyObject *read_alone(LoneCall *L, uint64_t seq, PyObject *reply_into, PyObject *frame) {
    PyObject *n = PyLong_FromUnsignedLongLong(seq);
    PyObject *got = n ? PyObject_CallFunctionObjArgs(L->read_alone, n, reply_into, frame, NULL) : NULL;
    Py_XDECREF(n);
    return got;
}

/* The reply as Python's path gives it: a Reply when it is this request's plain answer, else what
 * the connection's ``read_alone`` makes of it (an error, a failed post's error first, more frames). */
static PyObject *answer(LoneCall *L, uint64_t seq, PyObject *reply_into, PyObject *into, round_trip *rt) {
    if (!rt->meta)
        return read_alone(L, seq, reply_into, rt->frame ? rt->frame : Py_None);
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
    PyObject *result = NULL;
    if (bufs && !is_set(L->async_error) && rt->kind == L->reply && rt->seq == seq) {
        if (view)
            L->bytes_in += PyMemoryView_GET_BUFFER(view)->len;
        result = new_reply(L, rt->meta, bufs);
    } else if (bufs) {                        /* an ERROR, another request's reply, a post's error kept */
        PyObject *number = PyLong_FromUnsignedLongLong(rt->kind);
        PyObject *kind = number ? PyObject_GetItem(L->kinds, number) : NULL;
        Py_XDECREF(number);
        PyObject *frame = kind ? PyObject_CallFunction(L->frame_type, "OKKOO", kind, (unsigned long long)rt->seq,
                                                       (unsigned long long)rt->ack, rt->meta, bufs) : NULL;
        result = frame ? read_alone(L, seq, reply_into, frame) : NULL;
        Py_XDECREF(kind);
        Py_XDECREF(frame);
    }
    Py_XDECREF(view);
    Py_XDECREF(bufs);
    return result;
}

/* The claimed call (the send lock held; released here): written and read through the ring, or the
 * usual way where the ring declines it. */
static PyObject *exchange(LoneCall *L, uint64_t seq, PyObject *packed, PyObject *buffers,
                          PyObject *reply_into, PyObject *into, PyObject *sent) {
    round_trip rt = {0};
    L->messages++, L->round_trips++, L->sending_seq = (long long)seq;
    int r = locked_round_trip(L, seq, packed, buffers, into, sent, &rt);
    if (!r) {                                 /* nothing written: the usual way, which releases the send lock */
        PyObject *n = PyLong_FromUnsignedLongLong(seq);
        PyObject *got = n ? PyObject_CallFunctionObjArgs(L->exchange_alone, n, packed, buffers, reply_into, sent, NULL)
                          : NULL;        /* (sent NULL: the list ends before it) */
        Py_XDECREF(n);
        return got;
    }
    release(L->send_release);
    PyObject *result = NULL;
    if (r > 0) {
        L->bytes_out += (long long)rt.sent;
        result = answer(L, seq, reply_into, into, &rt);
    } else if (PyErr_ExceptionMatches(L->rgpu_error)) {   /* the transport failed: the connection is lost */
        PyObject *exc = raised();
        PyObject *why = PyObject_CallOneArg(L->lost, exc);
        Py_DECREF(exc);
        if (why)
            PyErr_SetObject((PyObject *)Py_TYPE(why), why);
        Py_XDECREF(why);
    }
    Py_XDECREF(rt.meta);
    Py_XDECREF(rt.frame);
    return result;
}

/* ``meta`` packed by this call's own Packer: the reader's (the token's holder), so no other thread's at
 * once. What it refuses goes through wire's pack_meta, which names the fault (or encodes it). */
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

/* lone(meta, buffers, reply_into[, sent]) -> Reply, or None when the call is not for now (another thread
 * reads or writes, a request is pending, frames are queued, the connection failed, ``reply_into`` is
 * not one target): nothing sent, request() does it. Connection.call()'s lone call, as _call_alone;
 * ``sent()`` once the request is written. */
static PyObject *lone_call(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    LoneCall *L = (LoneCall *)self;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if ((nargs != 3 && nargs != 4) || kwnames) {
        PyErr_SetString(PyExc_TypeError, "lone call: (meta, buffers, reply_into[, sent]) expected");
        return NULL;
    }
    PyObject *meta = args[0], *buffers = args[1], *reply_into = args[2], *into = NULL;
    PyObject *sent = nargs == 4 && args[3] != Py_None ? args[3] : NULL;
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
    PyObject *reply = claimed > 0 ? exchange(L, seq, packed, buffers, reply_into, into, sent)
                                  : claimed == 0 ? Py_NewRef(Py_None) : NULL;
    Py_DECREF(packed);
    end_read(L);
    return reply;
}

static PyObject *lone_next_seq(PyObject *self, PyObject *unused) {
    return PyLong_FromLongLong(++((LoneCall *)self)->seq);
}

/* sent(nbytes): a frame of ``nbytes`` buffer bytes counted (one call: a member += from Python costs more) */
static PyObject *lone_sent(PyObject *self, PyObject *arg) {
    long long n = PyLong_AsLongLong(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    LoneCall *L = (LoneCall *)self;
    L->messages++, L->bytes_out += n;
    Py_RETURN_NONE;
}

static PyMethodDef lone_methods[] = {
    {"next_seq", lone_next_seq, METH_NOARGS, "The connection's next sequence number (1, 2, ...)."},
    {"sent", lone_sent, METH_O, "sent(nbytes): one frame and its buffer bytes counted."},
    {NULL},
};

#define MEMBER(name, type, doc) {#name, type, offsetof(LoneCall, name), 0, doc}
static PyMemberDef lone_members[] = {
    MEMBER(reading, T_BOOL, "a thread holds the reader's token (reads frames for everyone)"),
    MEMBER(waiters, T_PYSSIZET, "threads waiting for the reader to hand them their answer"),
    MEMBER(sending_seq, T_LONGLONG, "the last seq of the write in progress"),
    MEMBER(dead, T_OBJECT, "why the connection failed (an RgpuError), or None"),
    MEMBER(async_error, T_OBJECT, "(seq, RemoteError) of a failed post, kept for the next wait, or None"),
    MEMBER(messages, T_LONGLONG, "frames sent"),
    MEMBER(round_trips, T_LONGLONG, "requests sent"),
    MEMBER(bytes_out, T_LONGLONG, "buffer bytes sent"),
    MEMBER(bytes_in, T_LONGLONG, "buffer bytes received"),
    {NULL},
};
#undef MEMBER

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
    .tp_doc = "A connection's exchange state over shm and its lone call: lone(meta, buffers, reply_into) -> "
              "Reply or None (transport/exchange.py is the same face in Python).",
    .tp_traverse = lone_traverse,
    .tp_clear = lone_clear,
    .tp_dealloc = lone_dealloc,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(LoneCall, vectorcall),
    .tp_methods = lone_methods,
    .tp_members = lone_members,
};

static int limit(PyObject *limits, const char *name, uint64_t *out) {
    PyObject *v = PyObject_GetAttrString(limits, name);
    int ok = v && as_u64(v, out);
    Py_XDECREF(v);
    return ok;
}

static PyObject *method(PyObject *obj, const char *name) { return PyObject_GetAttrString(obj, name); }

/* lone_call(<the transport's 20>, <the connection's 10>): a LoneCall (see shm_native.py's NativeCalls.lone_call).
 * The transport's: its Ends, ring and frame (its structs' addresses), known_kinds, request, reply (as
 * take and serve have them), busy_s, spin_s, spin_yield, its send and receive locks, its recv_c, unpack,
 * a Packer's pack of this call's own, wire's pack_meta, Reply, Frame, kinds (MsgKind by number), buffers'
 * as_bytes_view, RgpuError. The connection's: its Limits, pending dict, queue, reader's lock and
 * condition, condition lock, send lock, and its exchange_alone, read_alone and lost. */
static PyObject *new_lone_call(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    ARGS(30, "lone_call");
    if (!PyObject_TypeCheck(args[0], &EndsType)) {
        PyErr_SetString(PyExc_TypeError, "lone_call: the transport's Ends expected first");
        return NULL;
    }
    U64(1, ring); U64(2, frame); U64(3, known_kinds); U64(4, request); U64(5, reply);
    DBL(6, busy_s); DBL(7, spin_s);
    int spin_yield = PyObject_IsTrue(args[8]);
    if (spin_yield < 0)
        return NULL;
    LoneCall *L = PyObject_GC_New(LoneCall, &LoneCallType);
    if (!L)
        return NULL;
#define NULLED(name) L->name = NULL;
    LONE_OBJECTS(NULLED)
#undef NULLED
    L->vectorcall = lone_call;
    L->reading = 0, L->waiters = 0;
    L->seq = L->sending_seq = L->messages = L->round_trips = L->bytes_out = L->bytes_in = 0;
    L->dead = Py_NewRef(Py_None), L->async_error = Py_NewRef(Py_None);
    L->ring = (const rgpu_ring *)ring, L->frame = (rgpu_frame *)frame;
    L->known_kinds = known_kinds, L->request = request, L->reply = reply;
    L->busy_s = busy_s, L->spin_s = spin_s, L->spin_yield = spin_yield;
    PyObject *t_send = args[9], *t_recv = args[10], *rcv_lock = args[23], *rcv = args[24], *cv_lock = args[25];
    PyObject *send_lock = args[26];
    PyObject **kept[] = {(PyObject **)&L->ends, &L->recv_c, &L->unpack, &L->pack, &L->pack_meta, &L->reply_type,
                         &L->frame_type, &L->kinds, &L->as_bytes_view, &L->rgpu_error, &L->limits, &L->pending,
                         &L->queue, &L->exchange_alone, &L->read_alone, &L->lost};
    int from[] = {0, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 27, 28, 29};
    for (size_t i = 0; i < sizeof from / sizeof from[0]; i++)
        *kept[i] = Py_NewRef(args[from[i]]);
    PyObject_GC_Track((PyObject *)L);
    int ok = (L->rcv_acquire = method(rcv_lock, "acquire")) && (L->rcv_release = method(rcv_lock, "release"))
        && (L->notify_all = method(rcv, "notify_all"))
        && (L->cv_acquire = method(cv_lock, "acquire")) && (L->cv_release = method(cv_lock, "release"))
        && (L->send_acquire = method(send_lock, "acquire")) && (L->send_release = method(send_lock, "release"))
        && (L->t_send_acquire = method(t_send, "acquire")) && (L->t_send_release = method(t_send, "release"))
        && (L->t_recv_acquire = method(t_recv, "acquire")) && (L->t_recv_release = method(t_recv, "release"))
        && limit(L->limits, "max_meta_bytes", &L->max_meta) && limit(L->limits, "max_buffers", &L->max_bufs)
        && limit(L->limits, "max_frame_bytes", &L->max_frame)
        && PyDict_Check(L->pending) && PyType_Check(L->reply_type)
        && PyType_IsSubtype((PyTypeObject *)L->reply_type, &PyTuple_Type);
    if (!ok) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "lone_call: a pending dict and a Reply that is a tuple expected");
        Py_DECREF(L);
        return NULL;
    }
    return (PyObject *)L;
}
