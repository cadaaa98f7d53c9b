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
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "lib_door.h"
#include "stub.h"

/* cudnnStatus_t; cudnnBackendAttributeType_t, cudnnDataType_t, cudnnBackendDescriptorType_t (cudnn_graph.h) */
enum { DNN_OK = 0, DNN_NOT_INITIALIZED = 1001, DNN_BAD_PARAM = 2000, DNN_NULL_POINTER = 2002, DNN_NOT_SUPPORTED = 3000,
       DNN_INTERNAL = 4000, DNN_ALLOC_FAILED = 4003 };
enum { TYPE_HANDLE = 0, TYPE_INT64 = 3, TYPE_BACKEND_DESCRIPTOR = 15, DATA_DOUBLE = 1, DATA_HALF = 2, DATA_BFLOAT16 = 9,
       VARIANT_PACK = 16 };
#define DIM_MAX 8                          /* CUDNN_DIM_MAX */
/* rgpu.protocol.lib_cudnn's dump: ENTRY "<iiqq" then the bytes; COUNT_ONLY marks descriptor attributes */
#define ENTRY_SIZE 24
#define COUNT_ONLY (1 << 16)
#define BY_VALUE (-1)                      /* a plan's by-value tensors: INT64 pairs (uid, bytes) */
#define BY_VALUE_MAX ((int64_t)1 << 16)
#define REPLY_CAP ((size_t)256 << 10)      /* a Finalize's dump; a longer one is not kept (Gets ask) */

enum { MAGIC_HANDLE = 0x444e4e48, MAGIC_BACKEND = 0x444e4e42, MAGIC_TENSOR = 0x444e4e54 };

typedef struct {
    uint32_t magic;
    uint64_t id, stream;
} dnn_handle;

typedef struct {
    uint32_t magic;
    int type;
    uint64_t id;
    uint8_t *dump;                          /* readable attributes once finalized or filled, else NULL */
    size_t dump_n;
    void *handle;                           /* the handle set on it, and as which attribute: that Get's answer */
    int handle_attr;
    int64_t nuids, nptrs, *uids;            /* a variant pack's: where its by-value tensors' bytes are */
    uint64_t *ptrs;
} dnn_backend;

typedef struct {
    uint32_t magic;
    int dtype, nbdims;
    uint64_t id;
    int dims[DIM_MAX], strides[DIM_MAX];
} dnn_tensor;

/* the BN size queries' answers by what they depend on: torch asks them for every BN, with new descriptors */
#define SIZES 64
static struct { uint64_t key, size; } sizes[SIZES];
static unsigned sizes_next;
static pthread_mutex_t sizes_lock = PTHREAD_MUTEX_INITIALIZER;

static int width(int type) {
    switch (type) {
    case 0: case 3: case 5: case 6: case 15: return 8;
    case 2: case 24: return 1;              /* BOOLEAN is a C bool; CHAR */
    case 26: return 16;                     /* cudnnFraction_t: two int64 */
    default: return type >= 0 && type <= 30 ? 4 : 0;
    }
}

static dnn_handle *as_handle(void *h) { return h && ((dnn_handle *)h)->magic == MAGIC_HANDLE ? h : NULL; }
static dnn_backend *as_backend(void *d) { return d && ((dnn_backend *)d)->magic == MAGIC_BACKEND ? d : NULL; }
static dnn_tensor *as_tensor(void *t) { return t && ((dnn_tensor *)t)->magic == MAGIC_TENSOR ? t : NULL; }
/* a tensor descriptor argument's id: 0 for NULL, ~0 for something that is not one of ours */
static uint64_t tensor_id(void *t) { return !t ? 0 : as_tensor(t) ? ((dnn_tensor *)t)->id : ~(uint64_t)0; }

static int queue(uint32_t id, uint64_t stream, uint64_t handle, const void *p, size_t n) {
    return rgpu_door_queue(id, stream, handle, p, n, DNN_INTERNAL);
}

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
    dnn_backend *d = as_backend(descriptor);
    int w = width(type);
    if (!d || !w || count < 0 || count > (1 << 24)) return DNN_BAD_PARAM;
    if (count && !elements) return DNN_NULL_POINTER;
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
            else if (e) st = DNN_BAD_PARAM;
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

/* The kept entry for (name, type): its bytes (NULL for a descriptor attribute's count) and count. */
static int lookup(const dnn_backend *d, int name, int type, int64_t *count, const uint8_t **data) {
    size_t pos = 0;
    while (d->dump && pos + ENTRY_SIZE <= d->dump_n) {
        int32_t en, et;
        int64_t ec, nb;
        memcpy(&en, d->dump + pos, 4);
        memcpy(&et, d->dump + pos + 4, 4);
        memcpy(&ec, d->dump + pos + 8, 8);
        memcpy(&nb, d->dump + pos + 16, 8);
        pos += ENTRY_SIZE;
        if (nb < 0 || pos + (size_t)nb > d->dump_n) return 0;
        if (en == name && (et & ~COUNT_ONLY) == type) {
            *count = ec;
            *data = et & COUNT_ONLY ? NULL : d->dump + pos;
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
        if (pos + len > n) break;
        dnn_backend *e = as_backend(elements[i]);
        if (e) keep(e, p + pos, len);
        pos += len;
    }
}

RGPU_API int cudnnBackendGetAttribute(void *descriptor, int name, int type, int64_t requested, int64_t *count,
                                      void *elements) {
    dnn_backend *d = as_backend(descriptor);
    int w = width(type);
    if (!d || !w || requested < 0 || requested > (1 << 24)) return DNN_BAD_PARAM;
    if (requested && !elements) return DNN_NULL_POINTER;
    int64_t have;
    const uint8_t *data;
    if (type == TYPE_HANDLE && name == d->handle_attr && as_handle(d->handle) && requested) {   /* set here */
        if (count) *count = 1;
        *(void **)elements = d->handle;
        return DNN_OK;
    }
    if (lookup(d, name, type, &have, &data) && (data || requested == 0)) {     /* answered here */
        if (count) *count = have;
        if (data && requested) memcpy(elements, data, (size_t)(requested < have ? requested : have) * w);
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
            if (!e) st = DNN_BAD_PARAM;
            else memcpy(buf + sizeof p + i * 8, &e->id, 8);
        }
        if (!st) st = rgpu_door_call(RGPU_LIB_cudnnBackendGetAttribute, 0, d->id, buf, n, out, cap, &got, DNN_INTERNAL);
        if (!st && got < 8) st = DNN_INTERNAL;
    }
    if (!st) {
        int64_t total;
        memcpy(&total, out, 8);
        int64_t k = requested < total ? requested : total;
        size_t body = (got < cap ? got : cap) - 8;
        if (count) *count = total;
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

/* A plan's by-value tensors (an attention scale) have host addresses in the variant pack: their bytes
 * travel in the record, each as (uid, bytes) then the bytes padded to 8, and the server points at them. */
RGPU_API int cudnnBackendExecute(void *handle, void *plan, void *pack) {
    dnn_handle *h = as_handle(handle);
    dnn_backend *p = as_backend(plan), *v = as_backend(pack);
    if (!h || !p || !v) return DNN_BAD_PARAM;
    rgpu_lib_cudnnBackendExecute_t x = {.plan = p->id, .pack = v->id};
    int64_t n = 0, size = sizeof x;
    const uint8_t *pairs = NULL;
    if (!lookup(p, BY_VALUE, TYPE_INT64, &n, &pairs) || !pairs || n < 2)
        return queue(RGPU_LIB_cudnnBackendExecute, h->stream, h->id, &x, sizeof x);
    int64_t pv[2];
    for (int64_t k = 0; k + 1 < n; k += 2) {
        memcpy(pv, pairs + k * 8, 16);
        if (pv[1] < 0 || pv[1] > BY_VALUE_MAX) return DNN_BAD_PARAM;
        size += 16 + (pv[1] + 7) / 8 * 8;
    }
    uint8_t *buf = calloc(1, size), *at = buf + sizeof x;
    if (!buf) return DNN_ALLOC_FAILED;
    memcpy(buf, &x, sizeof x);
    for (int64_t k = 0; k + 1 < n; k += 2) {
        memcpy(pv, pairs + k * 8, 16);
        int64_t i = 0;
        while (i < v->nuids && v->uids[i] != pv[0]) i++;
        if (i >= v->nuids || i >= v->nptrs || !v->ptrs[i]) { free(buf); return DNN_BAD_PARAM; }
        memcpy(at, pv, 16);
        memcpy(at + 16, (const void *)(uintptr_t)v->ptrs[i], pv[1]);     /* the host value, read now */
        at += 16 + (pv[1] + 7) / 8 * 8;
    }
    int st = queue(RGPU_LIB_cudnnBackendExecute, h->stream, h->id, buf, size);
    free(buf);
    return st;
}

/* ---- legacy tensor descriptors: kept here too (the scalars' width, cudnnGetTensorNdDescriptor) ---- */
RGPU_API int cudnnCreateTensorDescriptor(void **desc) {
    if (!desc) return DNN_NULL_POINTER;
    dnn_tensor *t = calloc(1, sizeof *t);
    if (!t) return DNN_ALLOC_FAILED;
    t->magic = MAGIC_TENSOR, t->id = rgpu_door_mint();
    int st = queue(RGPU_LIB_cudnnCreateTensorDescriptor, 0, t->id, NULL, 0);
    if (st) free(t);
    else *desc = t;
    return st;
}

RGPU_API int cudnnSetTensorNdDescriptor(void *desc, int dtype, int nbdims, const int *dims, const int *strides) {
    dnn_tensor *t = as_tensor(desc);
    if (!t || nbdims < 1 || nbdims > DIM_MAX) return DNN_BAD_PARAM;
    if (!dims || !strides) return DNN_NULL_POINTER;
    for (int i = 0; i < nbdims; i++)
        if (dims[i] <= 0 || strides[i] <= 0) return DNN_BAD_PARAM;
    t->dtype = dtype;
    t->nbdims = nbdims;
    memcpy(t->dims, dims, nbdims * sizeof(int));
    memcpy(t->strides, strides, nbdims * sizeof(int));
    struct { rgpu_lib_cudnnSetTensorNdDescriptor_t p; int32_t v[2 * DIM_MAX]; } m = {{dtype, nbdims}, {0}};
    memcpy(m.v, dims, nbdims * sizeof(int));
    memcpy(m.v + nbdims, strides, nbdims * sizeof(int));
    return queue(RGPU_LIB_cudnnSetTensorNdDescriptor, 0, t->id, &m, sizeof m.p + 2 * nbdims * sizeof(int32_t));
}

RGPU_API int cudnnGetTensorNdDescriptor(const void *desc, int requested, int *dtype, int *nbdims, int *dims, int *strides) {
    const dnn_tensor *t = as_tensor((void *)desc);
    if (!t || requested < 0 || !t->nbdims) return DNN_BAD_PARAM;       /* not ours, or never set */
    if (dtype) *dtype = t->dtype;
    if (nbdims) *nbdims = t->nbdims;
    for (int i = 0; i < requested && i < t->nbdims; i++) {
        if (dims) dims[i] = t->dims[i];
        if (strides) strides[i] = t->strides[i];
    }
    return DNN_OK;
}

RGPU_API int cudnnDestroyTensorDescriptor(void *desc) {
    dnn_tensor *t = as_tensor(desc);
    if (!t) return desc ? DNN_BAD_PARAM : DNN_OK;
    int st = queue(RGPU_LIB_cudnnDestroyTensorDescriptor, 0, t->id, NULL, 0);
    t->magic = 0, free(t);
    return st;
}

/* cuDNN's rule, kept here as well: 1xCx1x1 (spatial) or 1xCxHxW (per activation), packed; half and
 * bfloat16 data get float parameters.  The server derives its own from the real x. */
RGPU_API int cudnnDeriveBNTensorDescriptor(void *derived, const void *x_desc, int mode) {
    dnn_tensor *d = as_tensor(derived), *x = as_tensor((void *)x_desc);
    if (!d || !x || !x->nbdims || mode < 0 || mode > 2) return DNN_BAD_PARAM;
    d->nbdims = x->nbdims;
    d->dtype = x->dtype == DATA_HALF || x->dtype == DATA_BFLOAT16 ? 0 : x->dtype;
    for (int i = 0; i < x->nbdims; i++) d->dims[i] = i == 1 || (mode == 0 && i > 1) ? x->dims[i] : 1;
    for (int i = x->nbdims - 1, s = 1; i >= 0; s *= d->dims[i--]) d->strides[i] = s;
    rgpu_lib_cudnnDeriveBNTensorDescriptor_t p = {.x = x->id, .mode = mode};
    return queue(RGPU_LIB_cudnnDeriveBNTensorDescriptor, 0, d->id, &p, sizeof p);
}

/* ---- legacy batch normalization (torch's fp32 BN) ------------------------------------------------- */
static double scalar(const void *p, const dnn_tensor *x) {      /* a host scalar: double for double data, else float */
    return x->dtype == DATA_DOUBLE ? *(const double *)p : (double)*(const float *)p;
}
#define P(x) ((uint64_t)(uintptr_t)(x))
static uint64_t mix(uint64_t h, uint64_t v) { return (h ^ v) * 0x100000001b3ull; }   /* FNV-1a, a word at a time */

/* A size is the server's answer for the call, its handle (its GPU) and the descriptors' contents: asked once */
static int bn_size(uint32_t call, dnn_handle *h, const void *act, const void *p, size_t n, const void *const *t,
                   int nt, size_t *size) {
    if (!h || act || !size) return !h ? DNN_BAD_PARAM : act ? DNN_NOT_SUPPORTED : DNN_NULL_POINTER;
    uint64_t key, mode_ops;
    memcpy(&mode_ops, p, 8);                /* every size query's payload starts with mode and ops */
    key = mix(mix(mix(0xcbf29ce484222325ull, call), h->id), mode_ops);
    for (int i = 0; i < nt; i++) {
        const dnn_tensor *x = as_tensor((void *)t[i]);
        key = mix(key, x ? (uint64_t)x->dtype << 32 | (uint32_t)x->nbdims : t[i] != NULL);
        for (int j = 0; x && j < x->nbdims; j++)
            key = mix(key, (uint64_t)(uint32_t)x->dims[j] << 32 | (uint32_t)x->strides[j]);
    }
    pthread_mutex_lock(&sizes_lock);
    for (int i = 0; i < SIZES; i++)
        if (sizes[i].key == key) { *size = sizes[i].size; pthread_mutex_unlock(&sizes_lock); return DNN_OK; }
    pthread_mutex_unlock(&sizes_lock);
    uint64_t v = 0;
    size_t got = 0;
    int st = rgpu_door_call(call, h->stream, h->id, p, n, &v, sizeof v, &got, DNN_INTERNAL);
    if (st || got != sizeof v) return st ? st : DNN_INTERNAL;
    pthread_mutex_lock(&sizes_lock);
    unsigned i = sizes_next++ % SIZES;
    sizes[i].key = key, sizes[i].size = v;
    pthread_mutex_unlock(&sizes_lock);
    *size = (size_t)v;
    return DNN_OK;
}

/* an activation descriptor is never ours (cudnnCreateActivationDescriptor is refused), so none travels */
RGPU_API int cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize(void *handle, int mode, int ops, const void *x,
        const void *z, const void *y, const void *bn, const void *act, size_t *size) {
    rgpu_lib_cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize_t p = {
        mode, ops, tensor_id((void *)x), tensor_id((void *)z), tensor_id((void *)y), tensor_id((void *)bn), 0};
    const void *t[] = {x, z, y, bn};
    return bn_size(RGPU_LIB_cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize, as_handle(handle), act, &p, sizeof p,
                   t, 4, size);
}

RGPU_API int cudnnGetBatchNormalizationBackwardExWorkspaceSize(void *handle, int mode, int ops, const void *x,
        const void *y, const void *dy, const void *dz, const void *dx, const void *dbn, const void *act, size_t *size) {
    rgpu_lib_cudnnGetBatchNormalizationBackwardExWorkspaceSize_t p = {
        mode, ops, tensor_id((void *)x), tensor_id((void *)y), tensor_id((void *)dy), tensor_id((void *)dz),
        tensor_id((void *)dx), tensor_id((void *)dbn), 0};
    const void *t[] = {x, y, dy, dz, dx, dbn};
    return bn_size(RGPU_LIB_cudnnGetBatchNormalizationBackwardExWorkspaceSize, as_handle(handle), act, &p, sizeof p, t, 6,
                   size);
}

RGPU_API int cudnnGetBatchNormalizationTrainingExReserveSpaceSize(void *handle, int mode, int ops, const void *act,
        const void *x, size_t *size) {
    rgpu_lib_cudnnGetBatchNormalizationTrainingExReserveSpaceSize_t p = {mode, ops, 0, tensor_id((void *)x)};
    const void *t[] = {x};
    return bn_size(RGPU_LIB_cudnnGetBatchNormalizationTrainingExReserveSpaceSize, as_handle(handle), act, &p, sizeof p, t, 1,
                   size);
}

RGPU_API int cudnnBatchNormalizationForwardTrainingEx(void *handle, int mode, int ops, const void *alpha,
        const void *beta, const void *x_desc, const void *x, const void *z_desc, const void *z, const void *y_desc,
        void *y, const void *bn_desc, const void *scale, const void *bias, double factor, void *running_mean,
        void *running_var, double epsilon, void *save_mean, void *save_inv_var, void *act, void *workspace,
        size_t workspace_size, void *reserve, size_t reserve_size) {
    dnn_handle *h = as_handle(handle);
    dnn_tensor *xt = as_tensor((void *)x_desc);
    if (!h || !xt || !as_tensor((void *)y_desc) || !as_tensor((void *)bn_desc)) return DNN_BAD_PARAM;
    if (!alpha || !beta || act) return act ? DNN_NOT_SUPPORTED : DNN_NULL_POINTER;
    rgpu_lib_cudnnBatchNormalizationForwardTrainingEx_t p = {
        mode, ops, scalar(alpha, xt), scalar(beta, xt), xt->id, P(x), tensor_id((void *)z_desc), P(z),
        tensor_id((void *)y_desc), P(y), tensor_id((void *)bn_desc), P(scale), P(bias), factor, P(running_mean),
        P(running_var), epsilon, P(save_mean), P(save_inv_var), 0, P(workspace), workspace_size, P(reserve),
        reserve_size};
    return queue(RGPU_LIB_cudnnBatchNormalizationForwardTrainingEx, h->stream, h->id, &p, sizeof p);
}

RGPU_API int cudnnBatchNormalizationBackwardEx(void *handle, int mode, int ops, const void *alpha_data,
        const void *beta_data, const void *alpha_param, const void *beta_param, const void *x_desc, const void *x,
        const void *y_desc, const void *y, const void *dy_desc, const void *dy, const void *dz_desc, void *dz,
        const void *dx_desc, void *dx, const void *dbn_desc, const void *scale, const void *bias, void *dscale,
        void *dbias, double epsilon, const void *save_mean, const void *save_inv_var, void *act, void *workspace,
        size_t workspace_size, void *reserve, size_t reserve_size) {
    dnn_handle *h = as_handle(handle);
    dnn_tensor *xt = as_tensor((void *)x_desc);
    if (!h || !xt || !as_tensor((void *)dy_desc) || !as_tensor((void *)dx_desc) || !as_tensor((void *)dbn_desc))
        return DNN_BAD_PARAM;
    if (act) return DNN_NOT_SUPPORTED;
    if (!alpha_data || !beta_data || !alpha_param || !beta_param) return DNN_NULL_POINTER;
    rgpu_lib_cudnnBatchNormalizationBackwardEx_t p = {
        mode, ops, scalar(alpha_data, xt), scalar(beta_data, xt), scalar(alpha_param, xt), scalar(beta_param, xt),
        xt->id, P(x), tensor_id((void *)y_desc), P(y), tensor_id((void *)dy_desc), P(dy), tensor_id((void *)dz_desc),
        P(dz), tensor_id((void *)dx_desc), P(dx), tensor_id((void *)dbn_desc), P(scale), P(bias), P(dscale), P(dbias),
        epsilon, P(save_mean), P(save_inv_var), 0, P(workspace), workspace_size, P(reserve), reserve_size};
    return queue(RGPU_LIB_cudnnBatchNormalizationBackwardEx, h->stream, h->id, &p, sizeof p);
}

RGPU_API int cudnnBatchNormalizationForwardInference(void *handle, int mode, const void *alpha, const void *beta,
        const void *x_desc, const void *x, const void *y_desc, void *y, const void *bn_desc, const void *scale,
        const void *bias, const void *mean, const void *var, double epsilon) {
    dnn_handle *h = as_handle(handle);
    dnn_tensor *xt = as_tensor((void *)x_desc);
    if (!h || !xt || !as_tensor((void *)y_desc) || !as_tensor((void *)bn_desc)) return DNN_BAD_PARAM;
    if (!alpha || !beta) return DNN_NULL_POINTER;
    rgpu_lib_cudnnBatchNormalizationForwardInference_t p = {
        mode, scalar(alpha, xt), scalar(beta, xt), xt->id, P(x), tensor_id((void *)y_desc), P(y),
        tensor_id((void *)bn_desc), P(scale), P(bias), P(mean), P(var), epsilon};
    return queue(RGPU_LIB_cudnnBatchNormalizationForwardInference, h->stream, h->id, &p, sizeof p);
}
