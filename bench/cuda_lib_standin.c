/* A stand-in for NVIDIA's libcublas.so.13, libcublasLt.so.13 and libcudnn.so.9 (one file, loaded under all
 * three names): every function the server's math-library path binds, doing nothing, so a bench measures the
 * server's own cost per record (bench/cuda_lib_records.py) and a test compares what two paths called
 * (tests/test_cuda_lib_records.py).  standin_record(1) logs each call as a line of its integer arguments
 * (host scalars as the 8 bytes they point to, so two paths' own buffers compare equal); standin_take()
 * returns the lines since the last take; standin_calls() counts every call. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

static char log_[1 << 20];
static size_t len_;
static int record_, pmode_;
static unsigned long long calls_;

const char *standin_take(void) {
    static char out[sizeof log_];
    memcpy(out, log_, len_);
    out[len_] = 0;
    len_ = 0;
    return out;
}
unsigned long long standin_calls(void) { return calls_; }

static void logf_(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
#include <stdarg.h>
static void logf_(const char *fmt, ...) {
    if (!record_ || len_ + 512 >= sizeof log_) return;
    va_list ap;
    va_start(ap, fmt);
    len_ += (size_t)vsnprintf(log_ + len_, sizeof log_ - len_, fmt, ap);
    va_end(ap);
}
#define U(p) ((unsigned long long)(uintptr_t)(p))
#define CALL(...) (calls_++, logf_(__VA_ARGS__), 0)
/* a host scalar's first 8 bytes (host pointer mode), else the device address */
static unsigned long long sc(const void *p) {
    unsigned long long v = 0;
    if (pmode_ || !p) return U(p);
    memcpy(&v, p, 8);
    return v;
}

/* the driver's side, for the record walker: a launch and a context switch that do nothing */
int standin_launch(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned shared, void *s, void **params, void **extra) {
    (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)shared; (void)params; (void)extra;
    return CALL("launch %llx %llx\n", U(f), U(s));
}
int standin_set_ctx(void *c) { return CALL("ctx %llx\n", U(c)); }

/* ---- cuBLAS ---- */
static char handle_;
int cublasCreate_v2(void **h) { *h = &handle_; return CALL("create\n"); }
int cublasDestroy_v2(void *h) { return CALL("destroy %llx\n", U(h)); }
int cublasGetVersion_v2(void *h, int *v) { (void)h; *v = 130100; return 0; }
int cublasSetStream_v2(void *h, void *s) { return CALL("stream %llx %llx\n", U(h), U(s)); }
int cublasSetWorkspace_v2(void *h, void *w, size_t n) { return CALL("workspace %llx %llx %zu\n", U(h), U(w), n); }
int cublasSetMathMode(void *h, int m) { return CALL("math %llx %d\n", U(h), m); }
int cublasSetPointerMode_v2(void *h, int m) { pmode_ = m; return CALL("pointer %llx %d\n", U(h), m); }

#define G_ARGS void *h, int ta, int tb, int m, int n, int k, const void *al
#define G_FMT "%llx %d %d %d %d %d %llx"
#define G_VALS U(h), ta, tb, m, n, k, sc(al)
int cublasSgemm_v2(G_ARGS, const void *A, int lda, const void *B, int ldb, const void *be, void *C, int ldc) {
    if (lda < m) {
        calls_++;
        logf_("sgemm refused: lda %d < m %d\n", lda, m);
        return 7; /* CUBLAS_STATUS_INVALID_VALUE */
    }
    return CALL("sgemm " G_FMT " %llx %d %llx %d %llx %llx %d\n", G_VALS, U(A), lda, U(B), ldb, sc(be), U(C), ldc);
}
int cublasDgemm_v2(G_ARGS, const void *A, int lda, const void *B, int ldb, const void *be, void *C, int ldc) {
    return CALL("dgemm " G_FMT " %llx %d %llx %d %llx %llx %d\n", G_VALS, U(A), lda, U(B), ldb, sc(be), U(C), ldc);
}
int cublasGemmEx(G_ARGS, const void *A, int at, int lda, const void *B, int bt, int ldb, const void *be, void *C,
                 int ct, int ldc, int compute, int algo) {
    return CALL("gemmex " G_FMT " %llx %d %d %llx %d %d %llx %llx %d %d %d %d\n", G_VALS, U(A), at, lda, U(B), bt,
                ldb, sc(be), U(C), ct, ldc, compute, algo);
}
int cublasSgemmEx(G_ARGS, const void *A, int at, int lda, const void *B, int bt, int ldb, const void *be, void *C,
                  int ct, int ldc) {
    return CALL("sgemmex " G_FMT " %llx %d %d %llx %d %d %llx %llx %d %d\n", G_VALS, U(A), at, lda, U(B), bt, ldb,
                sc(be), U(C), ct, ldc);
}
int cublasSgemmStridedBatched(G_ARGS, const void *A, int lda, long long sa, const void *B, int ldb, long long sb,
                              const void *be, void *C, int ldc, long long scc, int batch) {
    return CALL("sgemm_strided " G_FMT " %llx %d %lld %llx %d %lld %llx %llx %d %lld %d\n", G_VALS, U(A), lda, sa,
                U(B), ldb, sb, sc(be), U(C), ldc, scc, batch);
}
int cublasDgemmStridedBatched(G_ARGS, const void *A, int lda, long long sa, const void *B, int ldb, long long sb,
                              const void *be, void *C, int ldc, long long scc, int batch) {
    return CALL("dgemm_strided " G_FMT " %llx %d %lld %llx %d %lld %llx %llx %d %lld %d\n", G_VALS, U(A), lda, sa,
                U(B), ldb, sb, sc(be), U(C), ldc, scc, batch);
}
int cublasGemmStridedBatchedEx(G_ARGS, const void *A, int at, int lda, long long sa, const void *B, int bt, int ldb,
                               long long sb, const void *be, void *C, int ct, int ldc, long long scc, int batch,
                               int compute, int algo) {
    return CALL("gemm_strided_ex " G_FMT " %llx %d %d %lld %llx %d %d %lld %llx %llx %d %d %lld %d %d %d\n", G_VALS,
                U(A), at, lda, sa, U(B), bt, ldb, sb, sc(be), U(C), ct, ldc, scc, batch, compute, algo);
}
int cublasGemmBatchedEx(G_ARGS, const void *A, int at, int lda, const void *B, int bt, int ldb, const void *be,
                        void *C, int ct, int ldc, int batch, int compute, int algo) {
    return CALL("gemm_batched_ex " G_FMT " %llx %d %d %llx %d %d %llx %llx %d %d %d %d %d\n", G_VALS, U(A), at, lda,
                U(B), bt, ldb, sc(be), U(C), ct, ldc, batch, compute, algo);
}
int cublasSgemv_v2(void *h, int t, int m, int n, const void *al, const void *A, int lda, const void *x, int incx,
                   const void *be, void *y, int incy) {
    return CALL("sgemv %llx %d %d %d %llx %llx %d %llx %d %llx %llx %d\n", U(h), t, m, n, sc(al), U(A), lda, U(x),
                incx, sc(be), U(y), incy);
}
int cublasDgemv_v2(void *h, int t, int m, int n, const void *al, const void *A, int lda, const void *x, int incx,
                   const void *be, void *y, int incy) {
    return CALL("dgemv %llx %d %d %d %llx %llx %d %llx %d %llx %llx %d\n", U(h), t, m, n, sc(al), U(A), lda, U(x),
                incx, sc(be), U(y), incy);
}
int cublasSdot_v2(void *h, int n, const void *x, int incx, const void *y, int incy, float *r) {
    if (!pmode_) *r = 0;
    return CALL("sdot %llx %d %llx %d %llx %d\n", U(h), n, U(x), incx, U(y), incy);
}
int cublasDdot_v2(void *h, int n, const void *x, int incx, const void *y, int incy, double *r) {
    if (!pmode_) *r = 0;
    return CALL("ddot %llx %d %llx %d %llx %d\n", U(h), n, U(x), incx, U(y), incy);
}
int cublasDotEx(void *h, int n, const void *x, int xt, int incx, const void *y, int yt, int incy, void *r, int rt,
                int et) {
    (void)r;
    return CALL("dotex %llx %d %llx %d %d %llx %d %d %d %d\n", U(h), n, U(x), xt, incx, U(y), yt, incy, rt, et);
}

/* ---- cuBLASLt: descriptors are counters' addresses, never read ---- */
static char objs_[1 << 16];
static size_t next_;
static void *obj(void) { return &objs_[next_++ % sizeof objs_]; }
static int dmode_[sizeof objs_];  /* each matmul descriptor's pointer mode (attribute 2), for the log */
void standin_record(int on) { record_ = on, len_ = 0; }
/* the objects' addresses from the start again (the last session's are gone): two sessions' logs compare equal */
void standin_reset(void) {
    next_ = 0;
    memset(dmode_, 0, sizeof dmode_);
}
int cublasLtCreate(void **h) { *h = obj(); return CALL("lt_create\n"); }
int cublasLtDestroy(void *h) { return CALL("lt_destroy %llx\n", U(h)); }
int cublasLtMatmulDescCreate(void **d, int compute, int scale) { *d = obj(); return CALL("desc %d %d\n", compute, scale); }
int cublasLtMatmulDescDestroy(void *d) { (void)d; return CALL("desc_destroy\n"); }
int cublasLtMatmulDescSetAttribute(void *d, int a, const void *v, size_t n) {
    unsigned long long x = 0;
    memcpy(&x, v, n < 8 ? n : 8);
    if (a == 2) dmode_[(char *)d - objs_] = (int)x;
    return CALL("desc_set %llx %d %llx %zu\n", U(d), a, x, n);
}
int cublasLtMatrixLayoutCreate(void **l, int t, uint64_t r, uint64_t c, int64_t ld) {
    *l = obj();
    return CALL("layout %d %llu %llu %lld\n", t, (unsigned long long)r, (unsigned long long)c, (long long)ld);
}
int cublasLtMatrixLayoutDestroy(void *l) { (void)l; return CALL("layout_destroy\n"); }
int cublasLtMatrixLayoutSetAttribute(void *l, int a, const void *v, size_t n) {
    (void)v;
    return CALL("layout_set %llx %d %zu\n", U(l), a, n);
}
int cublasLtMatmulPreferenceCreate(void **p) { *p = obj(); return CALL("pref\n"); }
int cublasLtMatmulPreferenceDestroy(void *p) { (void)p; return CALL("pref_destroy\n"); }
int cublasLtMatmulPreferenceSetAttribute(void *p, int a, const void *v, size_t n) {
    (void)p; (void)v;
    return CALL("pref_set %d %zu\n", a, n);
}
int cublasLtMatmulAlgoGetHeuristic(void *h, void *d, void *a, void *b, void *c, void *dd, void *p, int req, void *res,
                                   int *count) {
    (void)h; (void)d; (void)a; (void)b; (void)c; (void)dd; (void)p; (void)req;
    memset(res, 0, 96);
    *count = 1;
    return CALL("heuristic\n");
}
int cublasLtMatmul(void *h, void *desc, const void *al, const void *A, void *ad, const void *B, void *bd,
                   const void *be, const void *C, void *cd, void *D, void *dd, const void *algo, void *w, size_t wn,
                   void *s) {
    /* host scalars (pointer mode 0; beta also in 4) as their first 8 bytes, else the device address; the algo's
     * first word */
    int mode = dmode_[(char *)desc - objs_];
    unsigned long long a8 = U(al), b8 = U(be), g = 0;
    if (mode == 0 && al) memcpy(&a8, al, 8);
    if ((mode == 0 || mode == 4) && be) memcpy(&b8, be, 8);
    if (algo) memcpy(&g, algo, 8);
    return CALL("lt_matmul %llx %llx %llx %llx %llx %llx %llx %llx %llx %llx %llx %llx %d %llx %llx %zu %llx\n",
                U(h), U(desc), a8, U(A), U(ad), U(B), U(bd), b8, U(C), U(cd), U(D), U(dd), algo != 0, g, U(w), wn,
                U(s));
}

/* ---- cuDNN ---- */
size_t cudnnGetVersion(void) { return 91000; }
const char *cudnnGetErrorString(int s) { (void)s; return "CUDNN_STATUS_STANDIN"; }
void cudnnGetLastErrorString(char *buf, size_t n) { if (n) buf[0] = 0; }
int cudnnCreate(void **h) { *h = obj(); return CALL("dnn_create\n"); }
int cudnnDestroy(void *h) { return CALL("dnn_destroy %llx\n", U(h)); }
int cudnnSetStream(void *h, void *s) { return CALL("dnn_stream %llx %llx\n", U(h), U(s)); }
int cudnnBackendCreateDescriptor(int type, void **d) { *d = obj(); return CALL("dnn_desc %d\n", type); }
int cudnnBackendDestroyDescriptor(void *d) { return CALL("dnn_desc_destroy %llx\n", U(d)); }
int cudnnBackendInitialize(void *d) { return CALL("dnn_init %llx\n", U(d)); }
int cudnnBackendFinalize(void *d) { return CALL("dnn_finalize %llx\n", U(d)); }
/* an int64 or pointer attribute's elements logged (at most 8): two paths' values compare */
int cudnnBackendSetAttribute(void *d, int name, int type, int64_t n, const void *v) {
    char el[8 * 20 + 1] = "";
    for (int64_t i = 0; (type == 3 || type == 6) && v && i < n && i < 8; i++) {
        unsigned long long x;
        memcpy(&x, (const char *)v + 8 * i, 8);
        snprintf(el + strlen(el), sizeof el - strlen(el), " %llx", x);
    }
    return CALL("dnn_set %llx %d %d %lld%s\n", U(d), name, type, (long long)n, el);
}
int cudnnBackendGetAttribute(void *d, int name, int type, int64_t req, int64_t *n, void *v) {
    (void)d; (void)name; (void)type; (void)req; (void)v;
    if (n) *n = 0;
    return CALL("dnn_get\n");
}
int cudnnBackendExecute(void *h, void *plan, void *pack) {
    return CALL("dnn_execute %llx %llx %llx\n", U(h), U(plan), U(pack));
}
/* the legacy tensor descriptors (objects like the others, their arguments logged) */
int cudnnCreateTensorDescriptor(void **d) { *d = obj(); return CALL("dnn_tensor\n"); }
int cudnnDestroyTensorDescriptor(void *d) { return CALL("dnn_tensor_destroy %llx\n", U(d)); }
int cudnnSetTensorNdDescriptor(void *d, int t, int n, const int *dims, const int *strides) {
    char el[8 * 24 + 1] = "";
    for (int i = 0; i < n && i < 8; i++) snprintf(el + strlen(el), sizeof el - strlen(el), " %dx%d", dims[i], strides[i]);
    return CALL("dnn_tensor_set %llx %d %d%s\n", U(d), t, n, el);
}
int cudnnDeriveBNTensorDescriptor(void *d, void *x, int mode) { return CALL("dnn_derive %llx %llx %d\n", U(d), U(x), mode); }
/* a scalar's first 4 bytes (a float's; Python's path hands a float or a double by the x tensor's type) */
static unsigned s4(const void *p) {
    unsigned v = 0;
    if (p) memcpy(&v, p, 4);
    return v;
}
int cudnnBatchNormalizationForwardTrainingEx(void *h, int mode, int ops, const void *al, const void *be, void *xd,
                                             const void *x, void *zd, const void *z, void *yd, void *y, void *bnd) {
    (void)x; (void)z; (void)y;
    return CALL("dnn_bn_forward %llx %d %d %x %x %llx %llx %llx %llx\n", U(h), mode, ops, s4(al), s4(be), U(xd), U(zd),
                U(yd), U(bnd));
}
/* the rest: bound by the server, never reached by the bench */
#define NOTHING(name, ...) int name(__VA_ARGS__) { return CALL(#name "\n"); }
NOTHING(cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize, void *h)
NOTHING(cudnnGetBatchNormalizationBackwardExWorkspaceSize, void *h)
NOTHING(cudnnGetBatchNormalizationTrainingExReserveSpaceSize, void *h)
NOTHING(cudnnBatchNormalizationBackwardEx, void *h)
NOTHING(cudnnBatchNormalizationForwardInference, void *h)
