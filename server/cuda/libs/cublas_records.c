/* cuBLAS's hot records in C: the GEMMs and the handle state they carry, run beside the launches.
 *
 * A session's table (rgpu_cublas_t, made by cublas_real.py when the real cuBLAS loads) owns the map from the
 * client's handles to the real ones and each real handle's stream, workspace, math mode and pointer mode as
 * last applied; the function pointers are resolved once, from the loaded library.  launch_records.c hands it
 * the math-library records it walks; cublas_real.py hands it the same calls when they come another way, so
 * both paths share one state and one code.  What it does not run (another call, an unknown handle, a
 * failure) it leaves to Python, which runs it again and explains it. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rgpu_protocol.h"       /* the records' kinds (generated from rgpu/protocol) */
#include "rgpu_protocol_libs.h"  /* the calls' ids and payload structs (generated) */

#define DEFAULT_WORKSPACE UINT64_MAX /* rgpu.protocol.lib_cublas.DEFAULT_WORKSPACE: the library's own pool */
#define NOT_HERE (-2)                /* not run here: Python runs it */
#define MALFORMED (-1)
/* STATE: workspace, workspace_size, math_mode, pointer_mode, at the start of every computing call's payload */
#define STATE_BYTES offsetof(rgpu_lib_cublasSgemm_v2_t, transa)

typedef int (*set_ptr_fn)(void *, void *);
typedef int (*set_ws_fn)(void *, void *, size_t);
typedef int (*set_int_fn)(void *, int);
typedef const void *cp;
#define GEMM_HEAD void *, int, int, int, int, int, cp
typedef int (*gemm_fn)(GEMM_HEAD, cp, int, cp, int, cp, void *, int);
typedef int (*gemm_ex_fn)(GEMM_HEAD, cp, int, int, cp, int, int, cp, void *, int, int, int, int);
typedef int (*strided_fn)(GEMM_HEAD, cp, int, long long, cp, int, long long, cp, void *, int, long long, int);
typedef int (*strided_ex_fn)(GEMM_HEAD, cp, int, int, long long, cp, int, int, long long, cp, void *, int, int,
                             long long, int, int, int);

/* the functions, in the order cublas_real.py binds them (FAST_FUNCTIONS) */
enum { SET_STREAM, SET_WORKSPACE, SET_MATH, SET_POINTER, SGEMM, DGEMM, GEMM_EX, SGEMM_STRIDED, DGEMM_STRIDED,
       GEMM_STRIDED_EX, NFUNCS };

typedef struct {
    uint64_t client, real, stream, workspace, workspace_size;
    int32_t math_mode, pointer_mode;
} handle_t;

struct rgpu_cublas;
/* cublaslt_records.c's matmuls and cudnn_records.c's executes, handed on from here (the walker's one table) */
struct rgpu_cublaslt;
struct rgpu_cudnn;
int rgpu_cublaslt_record(struct rgpu_cublaslt *t, struct rgpu_cublas *cublas, uint64_t client, uint64_t stream,
                         const char *p, size_t len);
int rgpu_cudnn_record(struct rgpu_cudnn *t, uint64_t client, uint64_t stream, const char *p, size_t len);
int rgpu_cudnn_desc_record(struct rgpu_cudnn *t, uint32_t call, uint64_t client, const char *p, size_t len);
int rgpu_cudnn_bn_record(struct rgpu_cudnn *t, uint32_t call, uint64_t client, uint64_t stream, const char *p,
                         size_t len);

typedef struct rgpu_cublas {
    void *fn[NFUNCS];
    struct rgpu_cublaslt *lt;  /* set by cublaslt_real.py, not owned: cleared before it is freed */
    struct rgpu_cudnn *dnn;    /* the same, by cudnn_real.py */
    handle_t *h;
    size_t n, cap;
    char error[160];  /* why the last call failed here (a setter), for Python's message */
} rgpu_cublas_t;

rgpu_cublas_t *rgpu_cublas_new(void) { return calloc(1, sizeof(rgpu_cublas_t)); }

void rgpu_cublas_free(rgpu_cublas_t *t) {
    if (!t) return;
    free(t->h);
    free(t);
}

int rgpu_cublas_bind(rgpu_cublas_t *t, int slot, void *fn) {
    if (slot < 0 || slot >= NFUNCS) return -1;
    t->fn[slot] = fn;
    return 0;
}

const char *rgpu_cublas_error(rgpu_cublas_t *t) { return t->error; }

void rgpu_cublas_set_lt(rgpu_cublas_t *t, struct rgpu_cublaslt *lt) { t->lt = lt; }
void rgpu_cublas_set_dnn(rgpu_cublas_t *t, struct rgpu_cudnn *dnn) { t->dnn = dnn; }

static handle_t *find(rgpu_cublas_t *t, uint64_t client) {
    for (size_t i = 0; i < t->n; i++)
        if (t->h[i].client == client) return &t->h[i];
    return 0;
}

/* A new client handle over a real one, in a new handle's state.  -1: it exists already, or no memory. */
int rgpu_cublas_add(rgpu_cublas_t *t, uint64_t client, uint64_t real) {
    if (find(t, client)) return -1;
    if (t->n == t->cap) {
        size_t cap = t->cap ? t->cap * 2 : 16;
        handle_t *h = realloc(t->h, cap * sizeof *h);
        if (!h) return -1;
        t->h = h, t->cap = cap;
    }
    t->h[t->n++] = (handle_t){client, real, 0, 0, DEFAULT_WORKSPACE, 0, 0};
    return 0;
}

/* The real handle of a client one (0 when unknown); with remove, the client handle is forgotten. */
uint64_t rgpu_cublas_real(rgpu_cublas_t *t, uint64_t client, int remove) {
    handle_t *h = find(t, client);
    if (!h) return 0;
    uint64_t real = h->real;
    if (remove) *h = t->h[--t->n];
    return real;
}

/* The i-th handle's real value (0 past the end): what closing the session destroys. */
uint64_t rgpu_cublas_nth(rgpu_cublas_t *t, size_t i) { return i < t->n ? t->h[i].real : 0; }

#define APPLY(call, name)                                                                     \
    do {                                                                                      \
        int rc_ = (call);                                                                     \
        if (rc_) {                                                                            \
            snprintf(t->error, sizeof t->error, "%s failed", name);                          \
            return rc_;                                                                       \
        }                                                                                     \
    } while (0)

/* Bring the real handle to the state a record carries (its fixed part starts with rgpu.protocol.lib_cublas's
 * STATE); the setters only for what changed, as cublas_real.py's Python path does. */
static int use(rgpu_cublas_t *t, handle_t *h, uint64_t stream, const rgpu_lib_cublasSgemm_v2_t *s) {
    void *real = (void *)(uintptr_t)h->real;
    if (stream != h->stream) {
        APPLY(((set_ptr_fn)t->fn[SET_STREAM])(real, (void *)(uintptr_t)stream), "cublasSetStream_v2");
        h->stream = stream, h->workspace = 0, h->workspace_size = DEFAULT_WORKSPACE;
    }
    if (s->workspace != h->workspace || s->workspace_size != h->workspace_size) {
        if (s->workspace_size == DEFAULT_WORKSPACE) /* back to the library's pool: what SetStream does */
            APPLY(((set_ptr_fn)t->fn[SET_STREAM])(real, (void *)(uintptr_t)stream), "cublasSetStream_v2");
        else
            APPLY(((set_ws_fn)t->fn[SET_WORKSPACE])(real, (void *)(uintptr_t)s->workspace, s->workspace_size),
                  "cublasSetWorkspace_v2");
        h->workspace = s->workspace, h->workspace_size = s->workspace_size;
    }
    if (s->math_mode != h->math_mode) {
        APPLY(((set_int_fn)t->fn[SET_MATH])(real, s->math_mode), "cublasSetMathMode");
        h->math_mode = s->math_mode;
    }
    if (s->pointer_mode != h->pointer_mode) {
        APPLY(((set_int_fn)t->fn[SET_POINTER])(real, s->pointer_mode), "cublasSetPointerMode_v2");
        h->pointer_mode = s->pointer_mode;
    }
    return 0;
}

/* Apply a record's STATE (its first bytes) to the client handle's real one: 0, a setter's status, or NOT_HERE
 * (an unknown handle); out[0] the real handle, out[1] its pointer mode (what Python's calls need). */
int rgpu_cublas_use(rgpu_cublas_t *t, uint64_t client, uint64_t stream, const char *state, size_t len,
                    uint64_t out[2]) {
    handle_t *h = find(t, client);
    rgpu_lib_cublasSgemm_v2_t s;
    if (!h) return NOT_HERE;
    if (len < STATE_BYTES) return MALFORMED;
    memset(&s, 0, sizeof s);
    memcpy(&s, state, STATE_BYTES);
    t->error[0] = 0;
    int rc = use(t, h, stream == RGPU_CUDA_NO_STREAM ? 0 : stream, &s);
    out[0] = h->real, out[1] = (uint64_t)h->pointer_mode;
    return rc;
}

static int slot_of(uint32_t call, size_t *need) {
    switch (call) {
    case RGPU_LIB_cublasSgemm_v2: *need = sizeof(rgpu_lib_cublasSgemm_v2_t); return SGEMM;
    case RGPU_LIB_cublasDgemm_v2: *need = sizeof(rgpu_lib_cublasDgemm_v2_t); return DGEMM;
    case RGPU_LIB_cublasGemmEx: *need = sizeof(rgpu_lib_cublasGemmEx_t); return GEMM_EX;
    case RGPU_LIB_cublasSgemmStridedBatched: *need = sizeof(rgpu_lib_cublasSgemmStridedBatched_t); return SGEMM_STRIDED;
    case RGPU_LIB_cublasDgemmStridedBatched: *need = sizeof(rgpu_lib_cublasDgemmStridedBatched_t); return DGEMM_STRIDED;
    case RGPU_LIB_cublasGemmStridedBatchedEx:
        *need = sizeof(rgpu_lib_cublasGemmStridedBatchedEx_t);
        return GEMM_STRIDED_EX;
    default: return -1;
    }
}

/* Whether this table runs `call` (a GEMM it has the function for). */
int rgpu_cublas_runs(rgpu_cublas_t *t, uint32_t call) {
    size_t need;
    int slot = slot_of(call, &need);
    return t && slot >= 0 && t->fn[slot] && t->fn[SET_STREAM] && t->fn[SET_WORKSPACE] && t->fn[SET_MATH] &&
           t->fn[SET_POINTER];
}

/* Run one GEMM record: its cublasStatus_t (0: done), NOT_HERE (another call, an unknown handle) or
 * MALFORMED (a payload shorter than the call's fixed part).  `stream` is the record's
 * (RGPU_CUDA_NO_STREAM: the legacy stream); host scalars are read where they lie in the payload. */
int rgpu_cublas_record(rgpu_cublas_t *t, uint32_t call, uint64_t client, uint64_t stream, const char *p, size_t len) {
    if (call == RGPU_LIB_cublasLtMatmul)
        return t && t->lt ? rgpu_cublaslt_record(t->lt, t, client, stream, p, len) : NOT_HERE;
    if (call == RGPU_LIB_cudnnBackendExecute)
        return t && t->dnn ? rgpu_cudnn_record(t->dnn, client, stream, p, len) : NOT_HERE;
    if (call == RGPU_LIB_cudnnBackendCreateDescriptor || call == RGPU_LIB_cudnnBackendSetAttribute ||
        call == RGPU_LIB_cudnnBackendFinalizeQueued || call == RGPU_LIB_cudnnBackendDestroyDescriptor ||
        call == RGPU_LIB_cudnnCreateTensorDescriptor || call == RGPU_LIB_cudnnSetTensorNdDescriptor ||
        call == RGPU_LIB_cudnnDestroyTensorDescriptor || call == RGPU_LIB_cudnnDeriveBNTensorDescriptor)
        return t && t->dnn ? rgpu_cudnn_desc_record(t->dnn, call, client, p, len) : NOT_HERE;  /* packs, tensors */
    if (call == RGPU_LIB_cudnnBatchNormalizationForwardTrainingEx || call == RGPU_LIB_cudnnBatchNormalizationBackwardEx ||
        call == RGPU_LIB_cudnnBatchNormalizationForwardInference)
        return t && t->dnn ? rgpu_cudnn_bn_record(t->dnn, call, client, stream, p, len) : NOT_HERE;
    size_t need;
    int slot = slot_of(call, &need);
    if (!t || slot < 0 || !rgpu_cublas_runs(t, call)) return NOT_HERE;
    if (len < need) return MALFORMED;
    handle_t *h = find(t, client);
    if (!h) return NOT_HERE;
    t->error[0] = 0;
    const rgpu_lib_cublasSgemm_v2_t *g = (const void *)p;  /* every GEMM's payload starts so */
    int rc = use(t, h, stream == RGPU_CUDA_NO_STREAM ? 0 : stream, g);
    if (rc) return rc;
    void *real = (void *)(uintptr_t)h->real;
    uint64_t ap, bp;
    memcpy(&ap, g->alpha, 8);
    memcpy(&bp, g->beta, 8);
    /* host pointer mode: the values in the payload (packed, so copied to aligned room); device: addresses */
    uint64_t scal[4];
    memcpy(scal, g->alpha, 16);
    memcpy(scal + 2, g->beta, 16);
    cp al = h->pointer_mode ? (cp)(uintptr_t)ap : (cp)scal, be = h->pointer_mode ? (cp)(uintptr_t)bp : (cp)(scal + 2);
    cp A = (cp)(uintptr_t)g->A, B = (cp)(uintptr_t)g->B;
    void *C = (void *)(uintptr_t)g->C;
    switch (slot) {
    case SGEMM:
    case DGEMM:
        return ((gemm_fn)t->fn[slot])(real, g->transa, g->transb, g->m, g->n, g->k, al, A, g->lda, B, g->ldb, be, C,
                                      g->ldc);
    case GEMM_EX: {
        const rgpu_lib_cublasGemmEx_t *x = (const void *)p;
        return ((gemm_ex_fn)t->fn[slot])(real, x->transa, x->transb, x->m, x->n, x->k, al, A, x->atype, x->lda, B,
                                         x->btype, x->ldb, be, C, x->ctype, x->ldc, x->compute_type, x->algo);
    }
    case SGEMM_STRIDED:
    case DGEMM_STRIDED: {
        const rgpu_lib_cublasSgemmStridedBatched_t *x = (const void *)p;
        return ((strided_fn)t->fn[slot])(real, x->transa, x->transb, x->m, x->n, x->k, al, A, x->lda, x->stride_a,
                                         B, x->ldb, x->stride_b, be, C, x->ldc, x->stride_c, x->batch);
    }
    default: {
        const rgpu_lib_cublasGemmStridedBatchedEx_t *x = (const void *)p;
        return ((strided_ex_fn)t->fn[slot])(real, x->transa, x->transb, x->m, x->n, x->k, al, A, x->atype, x->lda,
                                            x->stride_a, B, x->btype, x->ldb, x->stride_b, be, C, x->ctype, x->ldc,
                                            x->stride_c, x->batch, x->compute_type, x->algo);
    }
    }
}
