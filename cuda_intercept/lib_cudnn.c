/* rgpu's cudnn forwarders: see rgpu/protocol/lib_cudnn.py.
 *
 * A cudnnHandle_t, a backend descriptor and a tensor descriptor are C structs here holding the id minted
 * for them (the server maps ids to its real objects).  What the program can ask of them later is kept
 * here too: a handle's stream (it travels with every call that runs work), a tensor descriptor's shape
 * (the scalars' width, cudnnGetTensorNdDescriptor), a finalized backend descriptor's readable attributes
 * (the Finalize reply carries them, so a new conv shape's hundreds of Gets cost no round trip).
 * Creation, attribute setting, execution (a by-value tensor's bytes with it) and destruction are queued;
 * Finalize, GetAttribute misses and a BN size query's first asking (kept by contents) are answered.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE                        /* process_vm_readv */
#endif
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#include "lib_cudnn.h"
#include "stub.h"

static int width(int type) {
    switch (type) {
    case 0: case 3: case 5: case 6: case 15: return 8;
    case 2: case 24: return 1;              /* BOOLEAN is a C bool; CHAR */
    case 26: return 16;                     /* cudnnFraction_t: two int64 */
    default: return type >= 0 && type <= 30 ? 4 : 0;
    }
}

/* A call rgpu refuses says why, once per place, on stderr (as a refused export does), and returns `status`. */
static int say(int *said, const char *call, const char *why, int status) {
    if (!__atomic_exchange_n(said, 1, __ATOMIC_RELAXED)) fprintf(stderr, "rgpu: %s: %s (status %d)\n", call, why, status);
    return status;
}
static dnn_backend *as_backend(void *d) { return d && ((dnn_backend *)d)->magic == MAGIC_BACKEND ? d : NULL; }

#define queue dnn_queue

/* ---- handles: the stream stays here and travels with each call ---------------------------------- */
RGPU_API int cudnnCreate(void **handle) {
    if (!handle) return DNN_NULL_POINTER;
    dnn_handle *h = calloc(1, sizeof *h);
    if (!h) return DNN_ALLOC_FAILED;
    h->magic = MAGIC_HANDLE, h->id = rgpu_door_mint();
    rgpu_lib_cudnnCreate_t p = {.client_version = RGPU_VERSION_MAJOR * 10000 + RGPU_VERSION_MINOR * 100};
    int st = rgpu_door_call(RGPU_LIB_cudnnCreate, 0, h->id, &p, sizeof p, NULL, 0, NULL, DNN_NOT_INITIALIZED);
    if (st) free(h);
    else *handle = h;
    return st;
}

RGPU_API int cudnnDestroy(void *handle) {
    dnn_handle *h = as_handle(handle);
    if (!h) return DNN_BAD_PARAM;
    int st = queue(RGPU_LIB_cudnnDestroy, 0, h->id, NULL, 0);
    h->magic = 0, free(h);
    return st;
}

RGPU_API int cudnnSetStream(void *handle, void *stream) {
    dnn_handle *h = as_handle(handle);
    return h ? (h->stream = (uint64_t)(uintptr_t)stream, DNN_OK) : DNN_BAD_PARAM;
}

RGPU_API int cudnnGetStream(void *handle, void **stream) {
    dnn_handle *h = as_handle(handle);
    return h && stream ? (*stream = (void *)(uintptr_t)h->stream, DNN_OK) : DNN_BAD_PARAM;
}

/* ---- the backend graph API ------------------------------------------------------------------------ */
RGPU_API int cudnnBackendCreateDescriptor(int type, void **descriptor) {
    if (!descriptor) return DNN_NULL_POINTER;
    dnn_backend *d = calloc(1, sizeof *d);
    if (!d) return DNN_ALLOC_FAILED;
    d->magic = MAGIC_BACKEND, d->type = type, d->id = rgpu_door_mint();
    rgpu_lib_cudnnBackendCreateDescriptor_t p = {.type = type};
    int st = queue(RGPU_LIB_cudnnBackendCreateDescriptor, 0, d->id, &p, sizeof p);
    if (st) free(d);
    else *descriptor = d;
    return st;
}

static void forget(dnn_backend *d) { free(d->dump); d->dump = NULL; d->dump_n = 0; }
static void keep(dnn_backend *d, const uint8_t *dump, size_t n) {
    forget(d);
    if (n && (d->dump = malloc(n))) memcpy(d->dump, dump, d->dump_n = n);
}

RGPU_API int cudnnBackendDestroyDescriptor(void *descriptor) {
    dnn_backend *d = as_backend(descriptor);
    if (!d) return DNN_BAD_PARAM;
    int st = queue(RGPU_LIB_cudnnBackendDestroyDescriptor, 0, d->id, NULL, 0);
    forget(d);
    free(d->uids);
    free(d->ptrs);
    d->magic = 0, free(d);
    return st;
}

RGPU_API int cudnnBackendSetAttribute(void *descriptor, int name, int type, int64_t count, const void *elements) {
    static int said_desc, said_type, said_null, said_elem;
    dnn_backend *d = as_backend(descriptor);
    int w = width(type);
    if (!d) return say(&said_desc, "cudnnBackendSetAttribute", "a descriptor that is not rgpu's", DNN_BAD_PARAM);
    if (!w || count < 0 || count > (1 << 24))
        return say(&said_type, "cudnnBackendSetAttribute", "an attribute type or element count out of range",
                   DNN_BAD_PARAM);
    if (count && !elements) return say(&said_null, "cudnnBackendSetAttribute", "no elements", DNN_NULL_POINTER);
    size_t n = sizeof(rgpu_lib_cudnnBackendSetAttribute_t) + (size_t)count * w;
    uint8_t small[1024], *buf = n <= sizeof small ? small : malloc(n);
    if (!buf) return DNN_ALLOC_FAILED;
    rgpu_lib_cudnnBackendSetAttribute_t p = {.name = name, .type = type, .count = count};
    memcpy(buf, &p, sizeof p);
    uint8_t *tail = buf + sizeof p;
    int st = DNN_OK;
    if (type == TYPE_HANDLE || type == TYPE_BACKEND_DESCRIPTOR) {     /* our structs -> their ids */
        for (int64_t i = 0; i < count && !st; i++) {
            void *e = ((void *const *)elements)[i];
            uint64_t id = 0;
            if (type == TYPE_HANDLE && as_handle(e)) id = ((dnn_handle *)e)->id, d->handle = e, d->handle_attr = name;
            else if (type == TYPE_BACKEND_DESCRIPTOR && as_backend(e)) id = ((dnn_backend *)e)->id;
            else if (e) st = say(&said_elem, "cudnnBackendSetAttribute", "a handle or descriptor element that is not "
                                 "rgpu's", DNN_BAD_PARAM);
            memcpy(tail + i * 8, &id, 8);
        }
    } else {
        memcpy(tail, elements, (size_t)count * w);
    }
    if (!st && d->type == VARIANT_PACK && (name == 1000 || name == 1001) && w == 8) {   /* kept for Execute */
        void *copy = malloc((size_t)count * 8 + 1);
        if (!copy) st = DNN_ALLOC_FAILED;
        else if (name == 1000) { free(d->uids); d->uids = memcpy(copy, elements, count * 8); d->nuids = count; }
        else { free(d->ptrs); d->ptrs = memcpy(copy, elements, count * 8); d->nptrs = count; }
    }
    if (!st) {
        forget(d);                          /* what was kept of it is stale now */
        st = queue(RGPU_LIB_cudnnBackendSetAttribute, 0, d->id, buf, n);
    }
    if (buf != small) free(buf);
    return st;
}

/* The kept entry for (name, type): its count and bytes (NULL for a descriptor attribute's count; *nb of them). */
static int lookup(const dnn_backend *d, int name, int type, int64_t *count, const uint8_t **data, size_t *nbytes) {
    size_t pos = 0;
    while (d->dump && pos + ENTRY_SIZE <= d->dump_n) {
        int32_t en, et;
        int64_t ec, nb;
        memcpy(&en, d->dump + pos, 4);
        memcpy(&et, d->dump + pos + 4, 4);
        memcpy(&ec, d->dump + pos + 8, 8);
        memcpy(&nb, d->dump + pos + 16, 8);
        pos += ENTRY_SIZE;
        if (nb < 0 || ec < 0 || (size_t)nb > d->dump_n - pos) return 0;
        if (en == name && (et & ~COUNT_ONLY) == type) {
            *count = ec;
            *data = et & COUNT_ONLY ? NULL : d->dump + pos;
            *nbytes = (size_t)nb;
            return 1;
        }
        pos += nb;
    }
    return 0;
}

/* Each filled descriptor's dump, as the server sent them: u32 length, then the dump. */
static void keep_filled(void *const *elements, int64_t filled, const uint8_t *p, size_t n) {
    size_t pos = 0;
    for (int64_t i = 0; i < filled && pos + 4 <= n; i++) {
        uint32_t len;
        memcpy(&len, p + pos, 4);
        pos += 4;
        if (len > n - pos) break;
        dnn_backend *e = as_backend(elements[i]);
        if (e) keep(e, p + pos, len);
        pos += len;
    }
}

/* cuDNN 9's answer, as measured on the stock library: with no elements array (whatever `requested`) the
 * count is the attribute's total, a count query; with one, the count is what was written: at most
 * `requested` (0 for 0).  The frontend asks its notes with (requested = the type count, NULL) first. */
static void answer_count(int64_t *count, const void *elements, int64_t requested, int64_t total) {
    if (count) *count = !elements ? total : requested < total ? requested : total;
}

RGPU_API int cudnnBackendGetAttribute(void *descriptor, int name, int type, int64_t requested, int64_t *count,
                                      void *elements) {
    static int said_type, said_desc, said_reply;
    dnn_backend *d = as_backend(descriptor);
    int w = width(type);
    if (!d) return say(&said_desc, "cudnnBackendGetAttribute", "a descriptor that is not rgpu's", DNN_BAD_PARAM);
    if (!w || requested < 0 || requested > (1 << 24))
        return say(&said_type, "cudnnBackendGetAttribute", "an attribute type or element count out of range",
                   DNN_BAD_PARAM);
    if (!elements) requested = 0;           /* a count query, as the stock library takes it */
    int64_t have;
    const uint8_t *data;
    size_t nb;
    if (type == TYPE_HANDLE && name == d->handle_attr && as_handle(d->handle)) {     /* set here */
        answer_count(count, elements, requested, 1);
        if (requested) *(void **)elements = d->handle;
        return DNN_OK;
    }
    if (lookup(d, name, type, &have, &data, &nb) && (data || requested == 0)) {     /* answered here */
        answer_count(count, elements, requested, have);
        size_t k = (size_t)(requested < have ? requested : have) * w;
        if (data && k) memcpy(elements, data, k < nb ? k : nb);
        return DNN_OK;
    }
    int descs = type == TYPE_BACKEND_DESCRIPTOR;
    size_t n = sizeof(rgpu_lib_cudnnBackendGetAttribute_t) + (descs ? (size_t)requested * 8 : 0);
    size_t cap = descs ? REPLY_CAP : 8 + (size_t)requested * w, got = 0;
    uint8_t *buf = malloc(n), *out = malloc(cap);
    int st = DNN_ALLOC_FAILED;
    if (buf && out) {
        rgpu_lib_cudnnBackendGetAttribute_t p = {.name = name, .type = type, .requested = requested};
        memcpy(buf, &p, sizeof p);
        st = DNN_OK;
        for (int64_t i = 0; descs && i < requested && !st; i++) {     /* the caller's descriptors to fill */
            dnn_backend *e = as_backend(((void **)elements)[i]);
            if (!e) st = say(&said_desc, "cudnnBackendGetAttribute", "a descriptor to fill that is not rgpu's",
                             DNN_BAD_PARAM);
            else memcpy(buf + sizeof p + i * 8, &e->id, 8);
        }
        if (!st) st = rgpu_door_call(RGPU_LIB_cudnnBackendGetAttribute, 0, d->id, buf, n, out, cap, &got, DNN_INTERNAL);
        if (!st && got < 8) st = say(&said_reply, "cudnnBackendGetAttribute", "a reply without its count", DNN_INTERNAL);
    }
    if (!st) {
        int64_t total;
        memcpy(&total, out, 8);
        if (total < 0) total = 0;
        int64_t k = requested < total ? requested : total;
        size_t body = (got < cap ? got : cap) - 8;
        answer_count(count, elements, requested, total);
        if (descs) {
            keep_filled(elements, k, out + 8, body);
        } else if (type == TYPE_HANDLE) {       /* one the client never set here (answered above when it did) */
            memset(elements, 0, (size_t)k * 8);
        } else if (k) {
            memcpy(elements, out + 8, (size_t)k * w < body ? (size_t)k * w : body);
        }
    }
    free(buf);
    free(out);
    return st;
}

RGPU_API int cudnnBackendInitialize(void *descriptor) {
    dnn_backend *d = as_backend(descriptor);
    if (!d) return DNN_BAD_PARAM;
    forget(d);
    return rgpu_door_call(RGPU_LIB_cudnnBackendInitialize, 0, d->id, NULL, 0, NULL, 0, NULL, DNN_INTERNAL);
}

RGPU_API int cudnnBackendFinalize(void *descriptor) {
    dnn_backend *d = as_backend(descriptor);
    if (!d) return DNN_BAD_PARAM;
    forget(d);
    if (d->type == VARIANT_PACK)            /* one per execution: queued, its failure deferred like Execute's */
        return queue(RGPU_LIB_cudnnBackendFinalizeQueued, 0, d->id, NULL, 0);
    uint8_t *out = malloc(REPLY_CAP);
    if (!out) return DNN_ALLOC_FAILED;
    size_t got = 0;
    int st = rgpu_door_call(RGPU_LIB_cudnnBackendFinalize, 0, d->id, NULL, 0, out, REPLY_CAP, &got, DNN_INTERNAL);
    if (!st && got <= REPLY_CAP) keep(d, out, got);
    free(out);
    return st;
}

/* A by-value tensor's host bytes, read without trusting the address: an unmapped one (a device address
 * mistaken for a host one) is refused, not a fault.  Where the kernel refuses the read itself, a plain copy. */
static int read_host(void *dst, const void *src, size_t n) {
    struct iovec mine = {dst, n}, theirs = {(void *)src, n};
    if (!n || process_vm_readv(getpid(), &mine, 1, &theirs, 1, 0) == (ssize_t)n) return 1;
    if (errno == EFAULT) return 0;
    memcpy(dst, src, n);
    return 1;
}

/* A plan's by-value tensors (an attention scale) have host addresses in the variant pack: their bytes
 * travel in the record, each as (uid, bytes) then the bytes padded to 8, and the server points at them. */
RGPU_API int cudnnBackendExecute(void *handle, void *plan, void *pack) {
    static int said_args, said_size, said_uid;
    dnn_handle *h = as_handle(handle);
    dnn_backend *p = as_backend(plan), *v = as_backend(pack);
    if (!h || !p || !v) return say(&said_args, "cudnnBackendExecute", "a handle, plan or pack that is not rgpu's",
                                   DNN_BAD_PARAM);
    rgpu_lib_cudnnBackendExecute_t x = {.plan = p->id, .pack = v->id};
    int64_t n = 0, size = sizeof x;
    const uint8_t *pairs = NULL;
    size_t nb = 0;
    if (!lookup(p, BY_VALUE, TYPE_INT64, &n, &pairs, &nb) || !pairs || n < 2 || (size_t)n * 8 > nb)
        return queue(RGPU_LIB_cudnnBackendExecute, h->stream, h->id, &x, sizeof x);
    int64_t pv[2];
    for (int64_t k = 0; k + 1 < n; k += 2) {
        memcpy(pv, pairs + k * 8, 16);
        if (pv[1] < 0 || pv[1] > BY_VALUE_MAX)
            return say(&said_size, "cudnnBackendExecute", "a by-value tensor larger than 64 KiB", DNN_BAD_PARAM);
        size += 16 + (pv[1] + 7) / 8 * 8;
    }
    uint8_t *buf = calloc(1, size), *at = buf + sizeof x;
    if (!buf) return DNN_ALLOC_FAILED;
    memcpy(buf, &x, sizeof x);
    for (int64_t k = 0; k + 1 < n; k += 2) {
        memcpy(pv, pairs + k * 8, 16);
        int64_t i = 0;
        while (i < v->nuids && v->uids[i] != pv[0]) i++;
        if (i >= v->nuids || i >= v->nptrs || !v->ptrs[i]) {
            free(buf);
            return say(&said_uid, "cudnnBackendExecute", "the variant pack has no host pointer for a by-value tensor",
                       DNN_BAD_PARAM);
        }
        memcpy(at, pv, 16);
        if (!read_host(at + 16, (const void *)(uintptr_t)v->ptrs[i], pv[1])) {      /* the host value, read now */
            free(buf);
            return say(&said_uid, "cudnnBackendExecute", "a by-value tensor's pointer is not readable host memory",
                       DNN_BAD_PARAM);
        }
        at += 16 + (pv[1] + 7) / 8 * 8;
    }
    int st = queue(RGPU_LIB_cudnnBackendExecute, h->stream, h->id, buf, size);
    free(buf);
    return st;
}

