/* rgpu's cuBLAS forwarders (rgpu/protocol/lib_cublas.py): whole calls to the real library in the server's worker.
 *
 * A handle is a minted value (rgpu_door_mint), so the one torch passes to cuBLASLt names the same handle
 * on the server.  Its setters stay here, in a small table; every computing call copies the handle's
 * current stream, workspace, math mode and pointer mode into its record, and host scalars by value
 * (their width by the scale type), so the caller may reuse them at once.  GEMMs and GEMVs are queued
 * in the driver's ordered queue (a failing status is raised at the next synchronising CUDA call); the
 * first create and host-pointer-mode dot products are answered.  Declarations are ours: no NVIDIA header.
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "lib_door.h"
#include "lib_types.h"
#include "stub.h"

typedef int cublasStatus_t;
typedef void *cublasHandle_t;
typedef void *cudaStream_t;

enum { ST_OK = 0, ST_NOT_INITIALIZED = 1, ST_ALLOC_FAILED = 3, ST_INVALID_VALUE = 7, ST_INTERNAL = 14,
       ST_NOT_SUPPORTED = 15 };
enum { POINTER_HOST = 0, POINTER_DEVICE = 1 };                    /* cublasPointerMode_t */
#define RGPU_CUBLAS_HANDLES 256
/* workspace_size meaning "the library's own pool": where a handle starts, and where cublasSetStream_v2
 * puts it back (it "unconditionally resets the workspace", cuBLAS's documentation says). */
#define RGPU_DEFAULT_WORKSPACE UINT64_MAX

typedef struct {
    uint64_t id;            /* the minted value the program holds; 0: a free slot */
    uint64_t stream;
    uint64_t workspace, workspace_size;
    int32_t math_mode, pointer_mode;
} rgpu_cublas_handle;

/* Immortal: late thread-local destructors may destroy a handle at exit. */
static rgpu_cublas_handle rgpu_handles[RGPU_CUBLAS_HANDLES];
static pthread_mutex_t rgpu_handles_lock = PTHREAD_MUTEX_INITIALIZER;
static int rgpu_server_version;      /* the server's cuBLAS (major*10000 + minor*100 + patch), once answered */

static rgpu_cublas_handle *rgpu_find(uint64_t id) {
    for (int i = 0; id && i < RGPU_CUBLAS_HANDLES; i++)
        if (rgpu_handles[i].id == id) return &rgpu_handles[i];
    return NULL;
}

/* A copy of the handle's state (the caller's setters may race with another thread's GEMM). */
static int rgpu_state(cublasHandle_t handle, rgpu_cublas_handle *out) {
    pthread_mutex_lock(&rgpu_handles_lock);
    rgpu_cublas_handle *h = rgpu_find((uint64_t)(uintptr_t)handle);
    if (h) *out = *h;
    pthread_mutex_unlock(&rgpu_handles_lock);
    return h ? ST_OK : ST_NOT_INITIALIZED;
}

#define RGPU_FILL_STATE(p, s) \
    ((p).workspace = (s).workspace, (p).workspace_size = (s).workspace_size, \
     (p).math_mode = (s).math_mode, (p).pointer_mode = (s).pointer_mode)

/* A scalar as it travels: the value (width bytes) in host pointer mode, else the device address. */
static void rgpu_scalar(uint8_t dst[16], const void *src, size_t width, int pointer_mode) {
    memset(dst, 0, 16);
    if (pointer_mode == POINTER_DEVICE) {
        uint64_t addr = (uint64_t)(uintptr_t)src;
        memcpy(dst, &addr, sizeof addr);
    } else if (src) {
        memcpy(dst, src, width);
    }
}

/* alpha/beta's width by cublasComputeType_t (16F: half; 32F*: float; 64F*: double; 32I: int), doubled
 * for a complex output type; 0 for a compute type we do not know (refused rather than guessed). */
static size_t rgpu_scale_width(int compute_type, int ctype) {
    size_t w;
    switch (compute_type) {
    case 64: case 65: w = 2; break;                                  /* COMPUTE_16F(_PEDANTIC) */
    case 68: case 69: case 74: case 75: case 77: case 78: w = 4; break;   /* COMPUTE_32F* */
    case 70: case 71: case 79: w = 8; break;                         /* COMPUTE_64F* */
    case 72: case 73: w = 4; break;                                  /* COMPUTE_32I(_PEDANTIC) */
    /* CUDA 10's form, a cudaDataType_t, which the library still takes: R_32F/C_32F, R_64F/C_64F, R_16F, R_32I */
    case 0: case 4: case 10: w = 4; break;
    case 1: case 5: w = 8; break;
    case 2: w = 2; break;
    default: return 0;
    }
    return rgpu_data_type_complex(ctype) ? 2 * w : w;
}

/* A type we cannot size is refused loudly, once per function, rather than its scalars guessed. */
#define RGPU_REFUSE_TYPE(name) do { static int said_; \
    return rgpu_stub_refuse(name " with this compute or result type", RGPU_LIB, &said_, ST_NOT_SUPPORTED); } while (0)

static int rgpu_queue(uint32_t id, const rgpu_cublas_handle *s, const void *p, size_t n) {
    return rgpu_door_queue(id, s->stream, s->id, p, n, ST_INTERNAL);
}

/* ---- handles and their setters -------------------------------------------------------------------- */

RGPU_API cublasStatus_t cublasCreate_v2(cublasHandle_t *handle) {
    static int answered;             /* the first create is answered (version check); later ones queued */
    if (!handle) return ST_INVALID_VALUE;
    uint64_t id = rgpu_door_mint();
    rgpu_lib_cublasCreate_v2_t p = {RGPU_VERSION_MAJOR * 10000 + RGPU_VERSION_MINOR * 100 + RGPU_VERSION_PATCH};
    int st;
    if (!__atomic_load_n(&answered, __ATOMIC_ACQUIRE)) {
        int32_t version = 0;
        size_t got = 0;
        st = rgpu_door_call(RGPU_LIB_cublasCreate_v2, 0, id, &p, sizeof p, &version, sizeof version, &got,
                            ST_NOT_INITIALIZED);
        if (st == ST_OK && got == sizeof version) {
            __atomic_store_n(&rgpu_server_version, version, __ATOMIC_RELEASE);
            __atomic_store_n(&answered, 1, __ATOMIC_RELEASE);
        }
    } else {
        st = rgpu_door_queue(RGPU_LIB_cublasCreate_v2, 0, id, &p, sizeof p, ST_NOT_INITIALIZED);
    }
    if (st != ST_OK) return st;
    pthread_mutex_lock(&rgpu_handles_lock);
    for (int i = 0; i < RGPU_CUBLAS_HANDLES; i++) {
        if (!rgpu_handles[i].id) {
            rgpu_handles[i] = (rgpu_cublas_handle){.id = id, .workspace_size = RGPU_DEFAULT_WORKSPACE};
            pthread_mutex_unlock(&rgpu_handles_lock);
            *handle = (cublasHandle_t)(uintptr_t)id;
            return ST_OK;
        }
    }
    pthread_mutex_unlock(&rgpu_handles_lock);
    rgpu_door_queue(RGPU_LIB_cublasDestroy_v2, 0, id, NULL, 0, ST_INTERNAL);   /* no room: give it back */
    return ST_ALLOC_FAILED;
}

RGPU_API cublasStatus_t cublasDestroy_v2(cublasHandle_t handle) {
    rgpu_cublas_handle s;
    pthread_mutex_lock(&rgpu_handles_lock);
    rgpu_cublas_handle *h = rgpu_find((uint64_t)(uintptr_t)handle);
    if (h) {
        s = *h;
        h->id = 0;
    }
    pthread_mutex_unlock(&rgpu_handles_lock);
    if (!h) return ST_NOT_INITIALIZED;
    /* A route that is gone (a destructor after exit) is no failure: the session's end frees the real handle. */
    (void)rgpu_queue(RGPU_LIB_cublasDestroy_v2, &s, NULL, 0);
    return ST_OK;
}

/* Set one field of a known handle, under the lock. */
#define RGPU_SET(handle, field, value) do { \
    pthread_mutex_lock(&rgpu_handles_lock); \
    rgpu_cublas_handle *h_ = rgpu_find((uint64_t)(uintptr_t)(handle)); \
    if (h_) h_->field = (value); \
    pthread_mutex_unlock(&rgpu_handles_lock); \
    return h_ ? ST_OK : ST_NOT_INITIALIZED; \
} while (0)

RGPU_API cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, cudaStream_t stream) {
    pthread_mutex_lock(&rgpu_handles_lock);
    rgpu_cublas_handle *h = rgpu_find((uint64_t)(uintptr_t)handle);
    if (h) {
        h->stream = (uint64_t)(uintptr_t)stream;
        h->workspace = 0;
        h->workspace_size = RGPU_DEFAULT_WORKSPACE;
    }
    pthread_mutex_unlock(&rgpu_handles_lock);
    return h ? ST_OK : ST_NOT_INITIALIZED;
}

RGPU_API cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t handle, void *workspace, size_t size) {
    pthread_mutex_lock(&rgpu_handles_lock);
    rgpu_cublas_handle *h = rgpu_find((uint64_t)(uintptr_t)handle);
    if (h) {
        h->workspace = (uint64_t)(uintptr_t)workspace;
        h->workspace_size = size;
    }
    pthread_mutex_unlock(&rgpu_handles_lock);
    return h ? ST_OK : ST_NOT_INITIALIZED;
}

RGPU_API cublasStatus_t cublasSetMathMode(cublasHandle_t handle, int mode) { RGPU_SET(handle, math_mode, mode); }

RGPU_API cublasStatus_t cublasSetPointerMode_v2(cublasHandle_t handle, int mode) {
    if (mode != POINTER_HOST && mode != POINTER_DEVICE) return ST_INVALID_VALUE;
    RGPU_SET(handle, pointer_mode, mode);
}

RGPU_API cublasStatus_t cublasGetStream_v2(cublasHandle_t handle, cudaStream_t *stream) {
    rgpu_cublas_handle s;
    if (!stream) return ST_INVALID_VALUE;
    int st = rgpu_state(handle, &s);
    if (st == ST_OK) *stream = (cudaStream_t)(uintptr_t)s.stream;
    return st;
}

RGPU_API cublasStatus_t cublasGetMathMode(cublasHandle_t handle, int *mode) {
    rgpu_cublas_handle s;
    if (!mode) return ST_INVALID_VALUE;
    int st = rgpu_state(handle, &s);
    if (st == ST_OK) *mode = s.math_mode;
    return st;
}

RGPU_API cublasStatus_t cublasGetPointerMode_v2(cublasHandle_t handle, int *mode) {
    rgpu_cublas_handle s;
    if (!mode) return ST_INVALID_VALUE;
    int st = rgpu_state(handle, &s);
    if (st == ST_OK) *mode = s.pointer_mode;
    return st;
}

/* The server's version once a handle was created there, else the one rgpu's stand-in was built as. */
static int rgpu_version(void) {
    int v = __atomic_load_n(&rgpu_server_version, __ATOMIC_ACQUIRE);
    return v ? v : RGPU_VERSION_MAJOR * 10000 + RGPU_VERSION_MINOR * 100 + RGPU_VERSION_PATCH;
}

RGPU_API cublasStatus_t cublasGetVersion_v2(cublasHandle_t handle, int *version) {
    rgpu_cublas_handle s;
    if (!version) return ST_INVALID_VALUE;
    int st = rgpu_state(handle, &s);
    if (st == ST_OK) *version = rgpu_version();
    return st;
}

/* libraryPropertyType: MAJOR_VERSION 0, MINOR_VERSION 1, PATCH_LEVEL 2 */
RGPU_API cublasStatus_t cublasGetProperty(int type, int *value) {
    if (!value || type < 0 || type > 2) return ST_INVALID_VALUE;
    int v = rgpu_version();
    *value = type == 0 ? v / 10000 : type == 1 ? v / 100 % 100 : v % 100;
    return ST_OK;
}

/* ---- GEMMs: one queued record each, the same real function called on the server ---------------- */

/* The fields every GEMM record shares; `w` the scalars' width. */
#define RGPU_GEMM_FILL(p, s, w) do { \
    RGPU_FILL_STATE(p, s); \
    (p).transa = transa; (p).transb = transb; (p).m = m; (p).n = n; (p).k = k; \
    (p).lda = lda; (p).ldb = ldb; (p).ldc = ldc; \
    rgpu_scalar((p).alpha, alpha, (w), (s).pointer_mode); rgpu_scalar((p).beta, beta, (w), (s).pointer_mode); \
    (p).A = (uint64_t)(uintptr_t)A; (p).B = (uint64_t)(uintptr_t)B; (p).C = (uint64_t)(uintptr_t)C; \
} while (0)

#define RGPU_GEMM_ARGS cublasHandle_t handle, int transa, int transb, int m, int n, int k

/* The generator finds a forwarder by its "RGPU_API type name(" line, so the names stay written out. */
#define RGPU_GEMM_PLAIN_PARAMS(T) RGPU_GEMM_ARGS, const T *alpha, const T *A, int lda, const T *B, int ldb, \
                                  const T *beta, T *C, int ldc
#define RGPU_GEMM_BODY(name, T, extra) {                                                               \
    rgpu_cublas_handle s;                                                                               \
    rgpu_lib_##name##_t p;                                                                              \
    int st = rgpu_state(handle, &s);                                                                    \
    if (st) return st;                                                                                  \
    if (!alpha || !beta) return ST_INVALID_VALUE;                                                       \
    RGPU_GEMM_FILL(p, s, sizeof(T));                                                                    \
    extra;                                                                                              \
    return rgpu_queue(RGPU_LIB_##name, &s, &p, sizeof p);                                               \
}
RGPU_API cublasStatus_t cublasSgemm_v2(RGPU_GEMM_PLAIN_PARAMS(float)) RGPU_GEMM_BODY(cublasSgemm_v2, float, (void)0)
RGPU_API cublasStatus_t cublasDgemm_v2(RGPU_GEMM_PLAIN_PARAMS(double)) RGPU_GEMM_BODY(cublasDgemm_v2, double, (void)0)

#define RGPU_GEMM_STRIDED_PARAMS(T) RGPU_GEMM_ARGS, const T *alpha, const T *A, int lda, long long stride_a,     \
                                    const T *B, int ldb, long long stride_b, const T *beta, T *C, int ldc,       \
                                    long long stride_c, int batch
#define RGPU_STRIDES (p.stride_a = stride_a, p.stride_b = stride_b, p.stride_c = stride_c, p.batch = batch)
RGPU_API cublasStatus_t cublasSgemmStridedBatched(RGPU_GEMM_STRIDED_PARAMS(float))
    RGPU_GEMM_BODY(cublasSgemmStridedBatched, float, RGPU_STRIDES)
RGPU_API cublasStatus_t cublasDgemmStridedBatched(RGPU_GEMM_STRIDED_PARAMS(double))
    RGPU_GEMM_BODY(cublasDgemmStridedBatched, double, RGPU_STRIDES)

RGPU_API cublasStatus_t cublasSgemmEx(RGPU_GEMM_ARGS, const float *alpha, const void *A, int atype, int lda,
                                      const void *B, int btype, int ldb, const float *beta, void *C, int ctype,
                                      int ldc) {
    rgpu_cublas_handle s;
    rgpu_lib_cublasSgemmEx_t p;
    int st = rgpu_state(handle, &s);
    if (st) return st;
    if (!alpha || !beta) return ST_INVALID_VALUE;
    RGPU_GEMM_FILL(p, s, sizeof(float));
    p.atype = atype; p.btype = btype; p.ctype = ctype;
    return rgpu_queue(RGPU_LIB_cublasSgemmEx, &s, &p, sizeof p);
}

#define RGPU_EX_FILL(p) do { \
    (p).atype = atype; (p).btype = btype; (p).ctype = ctype; (p).compute_type = compute_type; (p).algo = algo; \
} while (0)

RGPU_API cublasStatus_t cublasGemmEx(RGPU_GEMM_ARGS, const void *alpha, const void *A, int atype, int lda,
                                     const void *B, int btype, int ldb, const void *beta, void *C, int ctype,
                                     int ldc, int compute_type, int algo) {
    rgpu_cublas_handle s;
    rgpu_lib_cublasGemmEx_t p;
    size_t w = rgpu_scale_width(compute_type, ctype);
    int st = rgpu_state(handle, &s);
    if (st) return st;
    if (!w) RGPU_REFUSE_TYPE("cublasGemmEx");
    if (!alpha || !beta) return ST_INVALID_VALUE;
    RGPU_GEMM_FILL(p, s, w);
    RGPU_EX_FILL(p);
    return rgpu_queue(RGPU_LIB_cublasGemmEx, &s, &p, sizeof p);
}

RGPU_API cublasStatus_t cublasGemmStridedBatchedEx(RGPU_GEMM_ARGS, const void *alpha, const void *A, int atype,
                                                   int lda, long long stride_a, const void *B, int btype, int ldb,
                                                   long long stride_b, const void *beta, void *C, int ctype,
                                                   int ldc, long long stride_c, int batch, int compute_type,
                                                   int algo) {
    rgpu_cublas_handle s;
    rgpu_lib_cublasGemmStridedBatchedEx_t p;
    size_t w = rgpu_scale_width(compute_type, ctype);
    int st = rgpu_state(handle, &s);
    if (st) return st;
    if (!w) RGPU_REFUSE_TYPE("cublasGemmStridedBatchedEx");
    if (!alpha || !beta) return ST_INVALID_VALUE;
    RGPU_GEMM_FILL(p, s, w);
    RGPU_EX_FILL(p);
    RGPU_STRIDES;
    return rgpu_queue(RGPU_LIB_cublasGemmStridedBatchedEx, &s, &p, sizeof p);
}

/* Aarray, Barray, Carray are device arrays of device pointers: they pass through. */
RGPU_API cublasStatus_t cublasGemmBatchedEx(RGPU_GEMM_ARGS, const void *alpha, const void *const A[], int atype,
                                            int lda, const void *const B[], int btype, int ldb, const void *beta,
                                            void *const C[], int ctype, int ldc, int batch, int compute_type,
                                            int algo) {
    rgpu_cublas_handle s;
    rgpu_lib_cublasGemmBatchedEx_t p;
    size_t w = rgpu_scale_width(compute_type, ctype);
    int st = rgpu_state(handle, &s);
    if (st) return st;
    if (!w) RGPU_REFUSE_TYPE("cublasGemmBatchedEx");
    if (!alpha || !beta) return ST_INVALID_VALUE;
    RGPU_GEMM_FILL(p, s, w);
    RGPU_EX_FILL(p);
    p.batch = batch;
    return rgpu_queue(RGPU_LIB_cublasGemmBatchedEx, &s, &p, sizeof p);
}

/* ---- GEMV (torch's mv, addmv) ----------------------------------------------------------------------- */

#define RGPU_GEMV_PARAMS(T) cublasHandle_t handle, int trans, int m, int n, const T *alpha, const T *A, int lda, \
                            const T *x, int incx, const T *beta, T *y, int incy
#define RGPU_GEMV_BODY(name, T) {                                                                       \
    rgpu_cublas_handle s;                                                                               \
    rgpu_lib_##name##_t p;                                                                              \
    int st = rgpu_state(handle, &s);                                                                    \
    if (st) return st;                                                                                  \
    if (!alpha || !beta) return ST_INVALID_VALUE;                                                       \
    RGPU_FILL_STATE(p, s);                                                                              \
    p.trans = trans; p.m = m; p.n = n; p.lda = lda; p.incx = incx; p.incy = incy;                       \
    rgpu_scalar(p.alpha, alpha, sizeof(T), s.pointer_mode);                                             \
    rgpu_scalar(p.beta, beta, sizeof(T), s.pointer_mode);                                               \
    p.A = (uint64_t)(uintptr_t)A; p.x = (uint64_t)(uintptr_t)x; p.y = (uint64_t)(uintptr_t)y;           \
    return rgpu_queue(RGPU_LIB_##name, &s, &p, sizeof p);                                               \
}
RGPU_API cublasStatus_t cublasSgemv_v2(RGPU_GEMV_PARAMS(float)) RGPU_GEMV_BODY(cublasSgemv_v2, float)
RGPU_API cublasStatus_t cublasDgemv_v2(RGPU_GEMV_PARAMS(double)) RGPU_GEMV_BODY(cublasDgemv_v2, double)

/* ---- dot products: into device memory queued, into host memory answered --------------------------- */

/* Bytes of one element of a cudaDataType_t a dot product returns (0: not one we forward: the float ones,
 * R_32F, R_64F, R_16F, R_16BF and their complex forms). */
static size_t rgpu_type_width(int type) {
    switch (type) {
    case 0: case 1: case 2: case 14: case 4: case 5: case 6: case 15: return rgpu_data_type_width(type);
    default: return 0;
    }
}

static int rgpu_dot(uint32_t id, const rgpu_cublas_handle *s, void *p, size_t n, void *result, size_t width) {
    size_t got = 0;
    if (!result) return ST_INVALID_VALUE;
    if (s->pointer_mode == POINTER_DEVICE) return rgpu_queue(id, s, p, n);
    uint8_t out[16];
    int st = rgpu_door_call(id, s->stream, s->id, p, n, out, sizeof out, &got, ST_INTERNAL);
    if (st == ST_OK) {
        if (got != width) return ST_INTERNAL;
        memcpy(result, out, width);
    }
    return st;
}

#define RGPU_DOT_FILL(p, s) do { \
    RGPU_FILL_STATE(p, s); \
    (p).n = n; (p).incx = incx; (p).incy = incy; \
    (p).x = (uint64_t)(uintptr_t)x; (p).y = (uint64_t)(uintptr_t)y; (p).result = (uint64_t)(uintptr_t)result; \
} while (0)

#define RGPU_DOT_PARAMS(T) cublasHandle_t handle, int n, const T *x, int incx, const T *y, int incy, T *result
#define RGPU_DOT_BODY(name, T) {                                                                        \
    rgpu_cublas_handle s;                                                                               \
    rgpu_lib_##name##_t p;                                                                              \
    int st = rgpu_state(handle, &s);                                                                    \
    if (st) return st;                                                                                  \
    RGPU_DOT_FILL(p, s);                                                                                \
    return rgpu_dot(RGPU_LIB_##name, &s, &p, sizeof p, result, sizeof(T));                              \
}
RGPU_API cublasStatus_t cublasSdot_v2(RGPU_DOT_PARAMS(float)) RGPU_DOT_BODY(cublasSdot_v2, float)
RGPU_API cublasStatus_t cublasDdot_v2(RGPU_DOT_PARAMS(double)) RGPU_DOT_BODY(cublasDdot_v2, double)

RGPU_API cublasStatus_t cublasDotEx(cublasHandle_t handle, int n, const void *x, int xtype, int incx,
                                    const void *y, int ytype, int incy, void *result, int result_type,
                                    int exec_type) {
    rgpu_cublas_handle s;
    rgpu_lib_cublasDotEx_t p;
    size_t w = rgpu_type_width(result_type);
    int st = rgpu_state(handle, &s);
    if (st) return st;
    if (!w) RGPU_REFUSE_TYPE("cublasDotEx");
    RGPU_DOT_FILL(p, s);
    p.xtype = xtype; p.ytype = ytype; p.result_type = result_type; p.exec_type = exec_type;
    return rgpu_dot(RGPU_LIB_cublasDotEx, &s, &p, sizeof p, result, w);
}
