/* cuDNN's per-execution records in C, run beside the launches and cuBLAS's GEMMs: a convolution's variant pack
 * (created, its workspace, unique ids and data pointers set, finalized, destroyed: one per execution, as
 * cudnn-frontend makes them), the execute of a finalized plan whose tensors all live on the device, and the
 * legacy tensor descriptors torch makes around each batch norm (created, set, derived, destroyed) and the batch
 * norm itself (forward training, backward, forward inference) on them.
 *
 * A session's table (rgpu_cudnn_t, made by cudnn_real.py) holds the client ids it may run with: the handles
 * (each with the stream last set on it: the table owns that, Python sets streams through it), the plans Python
 * found plain (no by-value tensors), each with its real object, and the variant packs, which it owns: it
 * creates and destroys their real objects and keeps each attribute set on them (Python reads those to rebuild
 * a pack around by-value bytes), and the legacy tensor descriptors, which it owns too (each with its data type:
 * the batch norms' scalars' width).  Python owns the handles' and plans' lives and tells this table of each
 * creation and destruction (and unmarks a plan it changes); a record naming anything else, carrying by-value
 * bytes or an attribute type a pack never takes, is left to Python (NOT_HERE), which explains it.
 * cublas_records.c hands it the cuDNN records it walks; cudnn_real.py hands it the same pack and tensor calls
 * when they come another way, so both paths share one state and one code (a batch norm that comes another way
 * is Python's own, on this table's tensors). */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "rgpu_protocol.h"
#include "rgpu_protocol_libs.h"

#define NOT_HERE (-2)
#define MALFORMED (-1)
#define ALLOC_FAILED 4001  /* CUDNN_STATUS_ALLOC_FAILED */
#define VARIANT_PACK 16    /* CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR */
#define MAX_ATTRS 8        /* a pack's attributes: unique ids, data pointers, intermediates, workspace */

typedef int (*execute_fn)(void *, void *, void *);
typedef int (*set_stream_fn)(void *, void *);
typedef int (*create_fn)(int, void **);
typedef int (*set_fn)(void *, int, int, int64_t, const void *);
typedef int (*one_fn)(void *);
typedef int (*create_tensor_fn)(void **);
typedef int (*set_nd_fn)(void *, int, int, const int *, const int *);
typedef int (*derive_fn)(void *, void *, int);
typedef const void *cp;
typedef int (*bn_train_fn)(void *, int, int, cp, cp, void *, cp, void *, cp, void *, void *, void *, cp, cp, double,
                           void *, void *, double, void *, void *, void *, void *, size_t, void *, size_t);
typedef int (*bn_back_fn)(void *, int, int, cp, cp, cp, cp, void *, cp, void *, cp, void *, cp, void *, cp, void *,
                          void *, void *, cp, cp, void *, void *, double, cp, cp, void *, void *, size_t, void *, size_t);
typedef int (*bn_infer_fn)(void *, int, cp, cp, void *, cp, void *, void *, void *, cp, cp, cp, cp, double);
enum { BN_TRAIN, BN_BACK, BN_INFER, NBN };    /* the batch-norm calls, in rgpu_cudnn_bind_bn's order */

enum { HANDLE, PACK, PLAN, TENSOR, NKINDS };  /* what a client id names (rgpu_cudnn_add's kind) */
#define DIM_MAX 8                             /* a legacy tensor's dimensions at most (CUDNN_DIM_MAX) */

typedef struct {
    int32_t name, type;
    int64_t count;
    uint64_t *v;  /* count elements, 8 bytes each (INT64 and VOID_PTR: what a pack takes) */
} attr_t;

typedef struct {
    int n;
    attr_t a[MAX_ATTRS];
} attrs_t;

typedef struct {
    uint64_t client, real, stream;  /* stream: a handle's, as last set */
    attrs_t *attrs;                 /* a pack's, as set */
    int32_t dtype;                  /* a tensor's cudnnDataType_t, as set or derived */
} entry_t;

typedef struct {
    entry_t *e;
    size_t n, cap;
} list_t;

typedef struct rgpu_cudnn {
    execute_fn execute;
    set_stream_fn set_stream;
    create_fn create;
    set_fn set;
    one_fn finalize, destroy;
    create_tensor_fn create_tensor;
    set_nd_fn set_nd;
    one_fn destroy_tensor;
    derive_fn derive;
    void *bn[NBN];
    list_t kind[NKINDS];
} rgpu_cudnn_t;

rgpu_cudnn_t *rgpu_cudnn_new(void *execute, void *set_stream) {
    rgpu_cudnn_t *t = calloc(1, sizeof *t);
    if (t) t->execute = (execute_fn)execute, t->set_stream = (set_stream_fn)set_stream;
    return t;
}

/* The library's descriptor calls, with which the table runs the variant packs' records (none bound: it runs
 * none, Python does). */
void rgpu_cudnn_bind_packs(rgpu_cudnn_t *t, void *create, void *set, void *finalize, void *destroy) {
    t->create = (create_fn)create, t->set = (set_fn)set, t->finalize = (one_fn)finalize,
    t->destroy = (one_fn)destroy;
}

/* The legacy tensor descriptor calls, with which it runs their records (none bound: Python does). */
void rgpu_cudnn_bind_tensors(rgpu_cudnn_t *t, void *create, void *set_nd, void *destroy, void *derive) {
    t->create_tensor = (create_tensor_fn)create, t->set_nd = (set_nd_fn)set_nd, t->destroy_tensor = (one_fn)destroy,
    t->derive = (derive_fn)derive;
}

/* The batch-norm calls (forward training, backward, forward inference), with which it runs their records. */
void rgpu_cudnn_bind_bn(rgpu_cudnn_t *t, void *train, void *back, void *infer) {
    t->bn[BN_TRAIN] = train, t->bn[BN_BACK] = back, t->bn[BN_INFER] = infer;
}

static void free_attrs(entry_t *e) {
    if (!e->attrs) return;
    for (int i = 0; i < e->attrs->n; i++) free(e->attrs->a[i].v);
    free(e->attrs);
    e->attrs = 0;
}

/* Everything freed, the packs and tensors it still owns destroyed (the session's end). */
void rgpu_cudnn_free(rgpu_cudnn_t *t) {
    if (!t) return;
    list_t *packs = &t->kind[PACK], *tensors = &t->kind[TENSOR];
    for (size_t i = 0; i < packs->n; i++) {
        if (t->destroy) t->destroy((void *)(uintptr_t)packs->e[i].real);
        free_attrs(&packs->e[i]);
    }
    for (size_t i = 0; i < tensors->n; i++)
        if (t->destroy_tensor) t->destroy_tensor((void *)(uintptr_t)tensors->e[i].real);
    for (int k = 0; k < NKINDS; k++) free(t->kind[k].e);
    free(t);
}

static entry_t *find(list_t *l, uint64_t client) {
    for (size_t i = 0; i < l->n; i++)
        if (l->e[i].client == client) return &l->e[i];
    return 0;
}

static entry_t *append(list_t *l, uint64_t client, uint64_t real) {
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 16;
        entry_t *p = realloc(l->e, cap * sizeof *p);
        if (!p) return 0;
        l->e = p, l->cap = cap;
    }
    l->e[l->n] = (entry_t){client, real, 0, 0, 0};
    return &l->e[l->n++];
}

/* A client id of `kind` (HANDLE or PLAN: packs and tensors are made here) over its real object (a handle's stream: the
 * default).  0, or -1: a bad kind, or no memory.  One known already keeps its stream and takes the real object
 * given. */
int rgpu_cudnn_add(rgpu_cudnn_t *t, int kind, uint64_t client, uint64_t real) {
    if (kind != HANDLE && kind != PLAN) return -1;
    entry_t *e = find(&t->kind[kind], client);
    if (e) {
        e->real = real;
        return 0;
    }
    return append(&t->kind[kind], client, real) ? 0 : -1;
}

/* A client id of `kind` forgotten (destroyed, or a plan changed; a pack's or tensor's real object is not destroyed);
 * nothing when it was not known. */
void rgpu_cudnn_remove(rgpu_cudnn_t *t, int kind, uint64_t client) {
    if (kind < 0 || kind >= NKINDS) return;
    list_t *l = &t->kind[kind];
    entry_t *e = find(l, client);
    if (!e) return;
    free_attrs(e);
    *e = l->e[--l->n];
}

size_t rgpu_cudnn_count(rgpu_cudnn_t *t, int kind) { return kind >= 0 && kind < NKINDS ? t->kind[kind].n : 0; }

/* The real object of a client id of `kind`; 0 when unknown. */
uint64_t rgpu_cudnn_real(rgpu_cudnn_t *t, int kind, uint64_t client) {
    entry_t *e = kind >= 0 && kind < NKINDS ? find(&t->kind[kind], client) : 0;
    return e ? e->real : 0;
}

/* A tensor's real descriptor (0: unknown) and, in *dtype, its data type. */
uint64_t rgpu_cudnn_tensor(rgpu_cudnn_t *t, uint64_t client, int32_t *dtype) {
    entry_t *e = find(&t->kind[TENSOR], client);
    if (e && dtype) *dtype = e->dtype;
    return e ? e->real : 0;
}

/* A pack's i-th attribute as set: its count (name and type in out[0], out[1]; up to `cap` elements in v), or
 * -1 past its last (or an unknown pack). */
int64_t rgpu_cudnn_pack_attr(rgpu_cudnn_t *t, uint64_t client, int i, int32_t out[2], uint64_t *v, size_t cap) {
    entry_t *e = find(&t->kind[PACK], client);
    if (!e || i < 0 || !e->attrs || i >= e->attrs->n) return -1;
    attr_t *a = &e->attrs->a[i];
    out[0] = a->name, out[1] = a->type;
    if (v && cap) memcpy(v, a->v, (size_t)(a->count < (int64_t)cap ? a->count : (int64_t)cap) * 8);
    return a->count;
}

/* Keep what a set gave a pack: the attribute's elements replaced (a copy, 8 bytes each). */
static int keep(entry_t *e, int32_t name, int32_t type, int64_t count, const char *elements) {
    if (!e->attrs && !(e->attrs = calloc(1, sizeof *e->attrs))) return -1;
    attrs_t *s = e->attrs;
    int i = 0;
    while (i < s->n && s->a[i].name != name) i++;
    if (i == MAX_ATTRS) return -1;
    uint64_t *v = malloc((size_t)count * 8 + 8);
    if (!v) return -1;
    memcpy(v, elements, (size_t)count * 8);
    if (i == s->n) s->n++;
    else free(s->a[i].v);
    s->a[i] = (attr_t){name, type, count, v};
    return 0;
}

static int pack_set(rgpu_cudnn_t *t, entry_t *e, const char *p, size_t len) {
    rgpu_lib_cudnnBackendSetAttribute_t s;
    if (len < sizeof s) return MALFORMED;
    memcpy(&s, p, sizeof s);
    /* INT64 and VOID_PTR only (device addresses and ids pass as they are); anything else is Python's to refuse */
    if ((s.type != 3 && s.type != 6) || s.count < 0 || s.count > (1 << 24) || len - sizeof s != (size_t)s.count * 8)
        return NOT_HERE;
    if (keep(e, s.name, s.type, s.count, p + sizeof s)) return ALLOC_FAILED;
    attr_t *a = e->attrs->a;
    while (a->name != s.name) a++;
    return t->set((void *)(uintptr_t)e->real, s.name, s.type, s.count, a->v);
}

static int tensor_record(rgpu_cudnn_t *t, uint32_t call, uint64_t client, const char *p, size_t len) {
    list_t *tensors = &t->kind[TENSOR];
    entry_t *e = find(tensors, client);
    if (call == RGPU_LIB_cudnnCreateTensorDescriptor) {
        if (e) return NOT_HERE;
        if (!(e = append(tensors, client, 0))) return ALLOC_FAILED;
        void *real = 0;
        int rc = t->create_tensor(&real);
        if (rc) tensors->n--;
        else e->real = (uint64_t)(uintptr_t)real;
        return rc;
    }
    if (!e) return NOT_HERE;
    void *real = (void *)(uintptr_t)e->real;
    if (call == RGPU_LIB_cudnnDestroyTensorDescriptor) {
        int rc = t->destroy_tensor(real);
        if (!rc) rgpu_cudnn_remove(t, TENSOR, client);
        return rc;
    }
    if (call == RGPU_LIB_cudnnSetTensorNdDescriptor) {
        rgpu_lib_cudnnSetTensorNdDescriptor_t s;
        int32_t v[2 * DIM_MAX];
        if (len < sizeof s) return MALFORMED;
        memcpy(&s, p, sizeof s);
        if (s.nbdims < 1 || s.nbdims > DIM_MAX || len - sizeof s != (size_t)s.nbdims * 8) return NOT_HERE;
        memcpy(v, p + sizeof s, (size_t)s.nbdims * 8);      /* dims, then strides */
        int rc = t->set_nd(real, s.dtype, s.nbdims, v, v + s.nbdims);
        if (!rc) e->dtype = s.dtype;
        return rc;
    }
    rgpu_lib_cudnnDeriveBNTensorDescriptor_t d;             /* cudnnDeriveBNTensorDescriptor: e is the derived */
    if (len < sizeof d) return MALFORMED;
    memcpy(&d, p, sizeof d);
    entry_t *x = find(tensors, d.x);
    if (!x) return NOT_HERE;
    int rc = t->derive(real, (void *)(uintptr_t)x->real, d.mode);
    if (!rc) e->dtype = x->dtype == 2 || x->dtype == 9 ? 0 : x->dtype;    /* half, bfloat16: float parameters */
    return rc;
}

/* Run one record of a variant pack's life (cudnnBackendCreateDescriptor of a pack, SetAttribute,
 * FinalizeQueued, DestroyDescriptor of one this table holds) or of a legacy tensor descriptor's (create, set,
 * derive, destroy): the library's cudnnStatus_t (0: done), NOT_HERE (another call or descriptor, an id made
 * twice, an attribute type a pack never takes, dimensions out of range: Python's) or MALFORMED.  A failed
 * destroy keeps the descriptor (Python's retry says why). */
int rgpu_cudnn_desc_record(rgpu_cudnn_t *t, uint32_t call, uint64_t client, const char *p, size_t len) {
    if (!t) return NOT_HERE;
    if (call == RGPU_LIB_cudnnCreateTensorDescriptor || call == RGPU_LIB_cudnnSetTensorNdDescriptor ||
        call == RGPU_LIB_cudnnDestroyTensorDescriptor || call == RGPU_LIB_cudnnDeriveBNTensorDescriptor)
        return t->create_tensor ? tensor_record(t, call, client, p, len) : NOT_HERE;
    if (!t->create) return NOT_HERE;
    list_t *packs = &t->kind[PACK];
    entry_t *e = find(packs, client);
    if (call == RGPU_LIB_cudnnBackendCreateDescriptor) {
        rgpu_lib_cudnnBackendCreateDescriptor_t c;
        if (len < sizeof c) return MALFORMED;
        memcpy(&c, p, sizeof c);
        if (c.type != VARIANT_PACK || e) return NOT_HERE;
        if (!(e = append(packs, client, 0))) return ALLOC_FAILED;
        void *real = 0;
        int rc = t->create(VARIANT_PACK, &real);
        if (rc) packs->n--;
        else e->real = (uint64_t)(uintptr_t)real;
        return rc;
    }
    if (!e) return NOT_HERE;
    void *real = (void *)(uintptr_t)e->real;
    switch (call) {
    case RGPU_LIB_cudnnBackendSetAttribute: return pack_set(t, e, p, len);
    case RGPU_LIB_cudnnBackendFinalizeQueued: return t->finalize(real);
    case RGPU_LIB_cudnnBackendDestroyDescriptor: {
        int rc = t->destroy(real);
        if (!rc) rgpu_cudnn_remove(t, PACK, client);
        return rc;
    }
    default: return NOT_HERE;
    }
}

/* Bring a handle to `stream` (set only when it changed): 0, cudnnSetStream's status, or NOT_HERE (unknown). */
static int use(rgpu_cudnn_t *t, entry_t *h, uint64_t stream) {
    if (h->stream == stream) return 0;
    int rc = t->set_stream((void *)(uintptr_t)h->real, (void *)(uintptr_t)stream);
    if (!rc) h->stream = stream;
    return rc;
}

int rgpu_cudnn_stream(rgpu_cudnn_t *t, uint64_t client, uint64_t stream) {
    entry_t *h = find(&t->kind[HANDLE], client);
    return h ? use(t, h, stream == RGPU_CUDA_NO_STREAM ? 0 : stream) : NOT_HERE;
}

/* Run one cudnnBackendExecute record: its cudnnStatus_t (0: done), NOT_HERE (no table, by-value bytes, a
 * handle, plan or pack it does not hold) or MALFORMED (a payload shorter than the call's fixed part). */
int rgpu_cudnn_record(rgpu_cudnn_t *t, uint64_t client, uint64_t stream, const char *p, size_t len) {
    const rgpu_lib_cudnnBackendExecute_t *x = (const void *)p;
    if (!t) return NOT_HERE;
    if (len < sizeof *x) return MALFORMED;
    if (len > sizeof *x) return NOT_HERE; /* by-value tensors' bytes: Python rebuilds the pack */
    entry_t *h = find(&t->kind[HANDLE], client), *plan = find(&t->kind[PLAN], x->plan),
            *pack = find(&t->kind[PACK], x->pack);
    if (!h || !plan || !pack) return NOT_HERE;
    int rc = use(t, h, stream == RGPU_CUDA_NO_STREAM ? 0 : stream);
    if (rc) return rc;
    return t->execute((void *)(uintptr_t)h->real, (void *)(uintptr_t)plan->real, (void *)(uintptr_t)pack->real);
}

/* A legacy tensor's real descriptor into *real (0, an optional one's id 0: NULL), or NOT_HERE (unknown). */
static int tensor_of(rgpu_cudnn_t *t, uint64_t id, int optional, void **real, int32_t *dtype) {
    entry_t *e = id || !optional ? find(&t->kind[TENSOR], id) : 0;
    if (!e && !(optional && !id)) return NOT_HERE;
    *real = e ? (void *)(uintptr_t)e->real : 0;
    if (dtype && e) *dtype = e->dtype;
    return 0;
}

/* A scalar as the library reads it: a double for a double tensor, else a float (as cudnn_real.py's _scalar). */
typedef struct {
    double d;
    float f;
} scalar_t;
static cp scalar(scalar_t *s, int32_t dtype, double v) {
    s->d = v, s->f = (float)v;
    return dtype == 1 ? (cp)&s->d : (cp)&s->f;
}

#define P(v) ((void *)(uintptr_t)(v))
#define TENSOR_OR_LEAVE(id, optional, out, dtype) \
    if (tensor_of(t, id, optional, &out, dtype)) return NOT_HERE

/* Run one batch-norm record (forward training, backward, forward inference) on this table's tensors: the
 * library's cudnnStatus_t, NOT_HERE (no table or function, an unknown handle or tensor: Python's, which explains)
 * or MALFORMED.  The activation descriptor is never passed, as on Python's path. */
int rgpu_cudnn_bn_record(rgpu_cudnn_t *t, uint32_t call, uint64_t client, uint64_t stream, const char *p, size_t len) {
    int which = call == RGPU_LIB_cudnnBatchNormalizationForwardTrainingEx ? BN_TRAIN
                : call == RGPU_LIB_cudnnBatchNormalizationBackwardEx      ? BN_BACK
                : call == RGPU_LIB_cudnnBatchNormalizationForwardInference ? BN_INFER : -1;
    if (!t || which < 0 || !t->bn[which]) return NOT_HERE;
    entry_t *h = find(&t->kind[HANDLE], client);
    if (!h) return NOT_HERE;
    void *x, *y, *z, *bn, *dy, *dz, *dx;
    int32_t dtype = 0;
    scalar_t a, b, ap, bp;
    if (which == BN_TRAIN) {
        rgpu_lib_cudnnBatchNormalizationForwardTrainingEx_t f;
        if (len < sizeof f) return MALFORMED;
        memcpy(&f, p, sizeof f);
        TENSOR_OR_LEAVE(f.x, 0, x, &dtype);
        TENSOR_OR_LEAVE(f.z, 1, z, 0);
        TENSOR_OR_LEAVE(f.y, 0, y, 0);
        TENSOR_OR_LEAVE(f.bn, 0, bn, 0);
        int rc = use(t, h, stream == RGPU_CUDA_NO_STREAM ? 0 : stream);
        return rc ? rc : ((bn_train_fn)t->bn[which])(
            P(h->real), f.mode, f.ops, scalar(&a, dtype, f.alpha), scalar(&b, dtype, f.beta), x, P(f.x_data), z,
            P(f.z_data), y, P(f.y_data), bn, P(f.scale), P(f.bias), f.factor, P(f.running_mean), P(f.running_var),
            f.epsilon, P(f.save_mean), P(f.save_inv_var), 0, P(f.workspace), f.workspace_size, P(f.reserve),
            f.reserve_size);
    }
    if (which == BN_BACK) {
        rgpu_lib_cudnnBatchNormalizationBackwardEx_t f;
        if (len < sizeof f) return MALFORMED;
        memcpy(&f, p, sizeof f);
        TENSOR_OR_LEAVE(f.x, 0, x, &dtype);
        TENSOR_OR_LEAVE(f.y, 1, y, 0);
        TENSOR_OR_LEAVE(f.dy, 0, dy, 0);
        TENSOR_OR_LEAVE(f.dz, 1, dz, 0);
        TENSOR_OR_LEAVE(f.dx, 0, dx, 0);
        TENSOR_OR_LEAVE(f.dbn, 0, bn, 0);
        int rc = use(t, h, stream == RGPU_CUDA_NO_STREAM ? 0 : stream);
        return rc ? rc : ((bn_back_fn)t->bn[which])(
            P(h->real), f.mode, f.ops, scalar(&a, dtype, f.alpha_data), scalar(&b, dtype, f.beta_data),
            scalar(&ap, dtype, f.alpha_param), scalar(&bp, dtype, f.beta_param), x, P(f.x_data), y, P(f.y_data), dy,
            P(f.dy_data), dz, P(f.dz_data), dx, P(f.dx_data), bn, P(f.scale), P(f.bias), P(f.dscale), P(f.dbias),
            f.epsilon, P(f.save_mean), P(f.save_inv_var), 0, P(f.workspace), f.workspace_size, P(f.reserve),
            f.reserve_size);
    }
    rgpu_lib_cudnnBatchNormalizationForwardInference_t f;
    if (len < sizeof f) return MALFORMED;
    memcpy(&f, p, sizeof f);
    TENSOR_OR_LEAVE(f.x, 0, x, &dtype);
    TENSOR_OR_LEAVE(f.y, 0, y, 0);
    TENSOR_OR_LEAVE(f.bn, 0, bn, 0);
    int rc = use(t, h, stream == RGPU_CUDA_NO_STREAM ? 0 : stream);
    return rc ? rc : ((bn_infer_fn)t->bn[which])(P(h->real), f.mode, scalar(&a, dtype, f.alpha),
                                                 scalar(&b, dtype, f.beta), x, P(f.x_data), y, P(f.y_data), bn,
                                                 P(f.scale), P(f.bias), P(f.mean), P(f.var), f.epsilon);
}
