/* A stand-in for NVIDIA's libcublas.so.13 that records its arguments: tests server/cuda/libs/cublas_real.py's
 * ctypes calls (argument order, widths, scalars by pointer mode) where there is no GPU.  Pointers print as
 * hex; host scalars as the values they point to (device ones as addresses); mock_log() returns the record. */
#include <stdint.h>
#include <stdio.h>

static char log_[1 << 16];
static size_t len_;
static int pmode;
#define LOG(...) (len_ += (size_t)snprintf(log_ + len_, sizeof log_ - len_, __VA_ARGS__))
#define PTR(p) ((unsigned long)(uintptr_t)(p))

const char *mock_log(void) { return log_; }

static double sc(const void *p, int width) {
    if (pmode) return (double)PTR(p);
    return width == 8 ? *(const double *)p : *(const float *)p;
}

int cublasCreate_v2(void **h) { static char handle; *h = &handle; LOG("create\n"); return 0; }
int cublasDestroy_v2(void *h) { (void)h; LOG("destroy\n"); return 0; }
int cublasGetVersion_v2(void *h, int *v) { (void)h; *v = 131000; return 0; }
int cublasSetStream_v2(void *h, void *s) { (void)h; LOG("stream %lx\n", PTR(s)); return 0; }
int cublasSetWorkspace_v2(void *h, void *w, size_t n) { (void)h; LOG("workspace %lx %zu\n", PTR(w), n); return 0; }
int cublasSetMathMode(void *h, int m) { (void)h; LOG("math %d\n", m); return 0; }
int cublasSetPointerMode_v2(void *h, int m) { (void)h; pmode = m; LOG("pointer %d\n", m); return 0; }

#define G_ARGS void *h, int ta, int tb, int m, int n, int k
#define G_LOG(name, w) LOG(name " %d %d %d %d %d %g %lx %d %lx %d %g %lx %d\n", ta, tb, m, n, k, sc(al, w), PTR(A), \
                           lda, PTR(B), ldb, sc(be, w), PTR(C), ldc)
int cublasSgemm_v2(G_ARGS, const void *al, const void *A, int lda, const void *B, int ldb, const void *be, void *C,
                   int ldc) { (void)h; G_LOG("sgemm", 4); return lda < m ? 7 : 0; }
int cublasDgemm_v2(G_ARGS, const void *al, const void *A, int lda, const void *B, int ldb, const void *be, void *C,
                   int ldc) { (void)h; G_LOG("dgemm", 8); return 0; }
int cublasGemmEx(G_ARGS, const void *al, const void *A, int at, int lda, const void *B, int bt, int ldb,
                 const void *be, void *C, int ct, int ldc, int ctype, int algo) {
    (void)h; G_LOG("gemmex", ctype == 70 ? 8 : 4); LOG("  types %d %d %d %d %d\n", at, bt, ct, ctype, algo); return 0;
}
int cublasSgemmEx(G_ARGS, const void *al, const void *A, int at, int lda, const void *B, int bt, int ldb,
                  const void *be, void *C, int ct, int ldc) {
    (void)h; G_LOG("sgemmex", 4); LOG("  types %d %d %d\n", at, bt, ct); return 0;
}
int cublasSgemmStridedBatched(G_ARGS, const void *al, const void *A, int lda, long long sa, const void *B, int ldb,
                              long long sb, const void *be, void *C, int ldc, long long scc, int batch) {
    (void)h; G_LOG("sgemm_strided", 4); LOG("  strides %lld %lld %lld %d\n", sa, sb, scc, batch); return 0;
}
int cublasDgemmStridedBatched(G_ARGS, const void *al, const void *A, int lda, long long sa, const void *B, int ldb,
                              long long sb, const void *be, void *C, int ldc, long long scc, int batch) {
    (void)h; G_LOG("dgemm_strided", 8); LOG("  strides %lld %lld %lld %d\n", sa, sb, scc, batch); return 0;
}
int cublasGemmStridedBatchedEx(G_ARGS, const void *al, const void *A, int at, int lda, long long sa, const void *B,
                               int bt, int ldb, long long sb, const void *be, void *C, int ct, int ldc, long long scc,
                               int batch, int ctype, int algo) {
    (void)h; G_LOG("gemm_strided_ex", 4);
    LOG("  types %d %d %d %d %d strides %lld %lld %lld %d\n", at, bt, ct, ctype, algo, sa, sb, scc, batch); return 0;
}
int cublasGemmBatchedEx(G_ARGS, const void *al, const void *A, int at, int lda, const void *B, int bt, int ldb,
                        const void *be, void *C, int ct, int ldc, int batch, int ctype, int algo) {
    (void)h; G_LOG("gemm_batched_ex", 4); LOG("  types %d %d %d %d %d batch %d\n", at, bt, ct, ctype, algo, batch);
    return 0;
}
int cublasSgemv_v2(void *h, int t, int m, int n, const void *al, const void *A, int lda, const void *x, int incx,
                   const void *be, void *y, int incy) {
    (void)h; LOG("sgemv %d %d %d %g %lx %d %lx %d %g %lx %d\n", t, m, n, sc(al, 4), PTR(A), lda, PTR(x), incx,
                 sc(be, 4), PTR(y), incy); return 0;
}
int cublasDgemv_v2(void *h, int t, int m, int n, const void *al, const void *A, int lda, const void *x, int incx,
                   const void *be, void *y, int incy) {
    (void)h; LOG("dgemv %d %d %d %g %lx %d %lx %d %g %lx %d\n", t, m, n, sc(al, 8), PTR(A), lda, PTR(x), incx,
                 sc(be, 8), PTR(y), incy); return 0;
}
int cublasSdot_v2(void *h, int n, const void *x, int incx, const void *y, int incy, float *r) {
    (void)h; LOG("sdot %d %lx %d %lx %d\n", n, PTR(x), incx, PTR(y), incy); if (!pmode) *r = 2.5f; return 0;
}
int cublasDdot_v2(void *h, int n, const void *x, int incx, const void *y, int incy, double *r) {
    (void)h; LOG("ddot %d %lx %d %lx %d\n", n, PTR(x), incx, PTR(y), incy); if (!pmode) *r = -0.75; return 0;
}
int cublasDotEx(void *h, int n, const void *x, int xt, int incx, const void *y, int yt, int incy, void *r, int rt,
                int et) {
    (void)h; LOG("dotex %d %lx %d %d %lx %d %d %d %d\n", n, PTR(x), xt, incx, PTR(y), yt, incy, rt, et);
    if (!pmode) *(float *)r = 4.0f; return 0;
}
