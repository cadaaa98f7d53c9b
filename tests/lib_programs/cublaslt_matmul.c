/* cuBLASLt through rgpu: what torch's Linear does (x @ W^T + b as transa=T, the bias epilogue, fp32 and bf16,
 * RELU_BIAS, GELU_BIAS), a strided batched matmul in place (baddbmm) on a second stream, fp64 with device
 * scalars; the heuristic asked twice alike (the second from the cache) and once more; the descriptors' Get
 * answered; an unknown handle refused.  Each result is printed ("label v v ...") for the test to compare
 * with numpy.  Own declarations (no CUDA headers): built against rgpu's libraries, run natively too.
 * The linears run on a cuBLAS handle, as torch's do.  Inputs: x_s(i) = ((i * s + 3) % 17 - 8) / 8, exact in bf16. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef void *lt_t;
int cuInit(unsigned flags);
int cuDeviceGet(int *dev, int ordinal);
int cuDevicePrimaryCtxRetain(void **ctx, int dev);
int cuCtxSetCurrent(void *ctx);
int cuCtxSynchronize(void);
int cuMemAlloc_v2(uint64_t *p, size_t n);
int cuMemcpyHtoD_v2(uint64_t dst, const void *src, size_t n);
int cuMemcpyDtoH_v2(void *dst, uint64_t src, size_t n);
int cuStreamCreate(void **s, unsigned flags);
int cuStreamSynchronize(void *s);
int cuStreamBeginCapture_v2(void *s, int mode);
int cuStreamEndCapture(void *s, void **graph);
int cuGraphInstantiateWithFlags(void **exec, void *graph, unsigned long long flags);
int cuGraphLaunch(void *exec, void *s);
int cublasCreate_v2(lt_t *h);
int cublasDestroy_v2(lt_t h);
int cublasLtCreate(lt_t *h);
int cublasLtDestroy(lt_t h);
int cublasLtMatmulDescCreate(lt_t *d, int compute, int scale);
int cublasLtMatmulDescDestroy(lt_t d);
int cublasLtMatmulDescSetAttribute(lt_t d, int attr, const void *buf, size_t n);
int cublasLtMatmulDescGetAttribute(lt_t d, int attr, void *buf, size_t n, size_t *written);
int cublasLtMatrixLayoutCreate(lt_t *l, int type, uint64_t rows, uint64_t cols, int64_t ld);
int cublasLtMatrixLayoutDestroy(lt_t l);
int cublasLtMatrixLayoutSetAttribute(lt_t l, int attr, const void *buf, size_t n);
int cublasLtMatmulPreferenceCreate(lt_t *p);
int cublasLtMatmulPreferenceDestroy(lt_t p);
int cublasLtMatmulPreferenceSetAttribute(lt_t p, int attr, const void *buf, size_t n);
typedef struct { uint64_t algo[8]; size_t workspace; int state; float waves; int reserved[4]; } result_t;
int cublasLtMatmulAlgoGetHeuristic(lt_t h, lt_t desc, lt_t a, lt_t b, lt_t c, lt_t d, lt_t pref, int n,
                                   result_t *out, int *got);
int cublasLtMatmul(lt_t h, lt_t desc, const void *alpha, uint64_t A, lt_t ad, uint64_t B, lt_t bd, const void *beta,
                   uint64_t C, lt_t cd, uint64_t D, lt_t dd, const void *algo, uint64_t ws, size_t wsn, void *s);

enum { R_32F = 0, R_64F = 1, R_16BF = 14, COMPUTE_32F = 68, COMPUTE_64F = 70 };
enum { TRANSA = 3, TRANSB = 4, EPILOGUE = 7, BIAS = 8, POINTER_MODE = 2, BATCH = 5, STRIDE = 6, WS = 1 };
#define OK(call) do { int r_ = (call); if (r_) { printf("error %s = %d\n", #call, r_); return 1; } } while (0)

static double x(int i, int s) { return ((i * s + 3) % 17 - 8) / 8.0; }
static uint16_t bf16(float f) { uint32_t u; memcpy(&u, &f, 4); return (uint16_t)(u >> 16); }   /* exact inputs */
static float unbf16(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static uint64_t dev(const void *host, size_t n) {
    uint64_t p = 0;
    if (cuMemAlloc_v2(&p, n) || cuMemcpyHtoD_v2(p, host, n)) { printf("error alloc\n"); exit(1); }
    return p;
}
static lt_t layout(int type, uint64_t rows, uint64_t cols, int64_t ld) {
    lt_t l;
    if (cublasLtMatrixLayoutCreate(&l, type, rows, cols, ld)) { printf("error layout\n"); exit(1); }
    return l;
}
static lt_t h, blas, pref;          /* a cuBLASLt handle; a cuBLAS one, which torch hands cuBLASLt */
static uint64_t ws;

/* torch's addmm through cuBLASLt: y (n x m, row-major) = x (n x k) @ w^T (w: m x k) + b, i.e. column-major
 * y^T (m x n) = op(A = w as k x m, T) @ (B = x^T as k x n). */
static int linear(const char *label, int type, int epilogue, int m, int n, int k) {
    size_t es = type == R_32F ? 4 : 2;
    char *hx = malloc(n * k * es), *hw = malloc(m * k * es), *hb = malloc(m * es), *hy = calloc(m * n, es);
    for (int i = 0; i < n * k; i++) { if (es == 4) ((float *)hx)[i] = x(i, 5); else ((uint16_t *)hx)[i] = bf16(x(i, 5)); }
    for (int i = 0; i < m * k; i++) { if (es == 4) ((float *)hw)[i] = x(i, 7); else ((uint16_t *)hw)[i] = bf16(x(i, 7)); }
    for (int i = 0; i < m; i++) { if (es == 4) ((float *)hb)[i] = x(i, 3); else ((uint16_t *)hb)[i] = bf16(x(i, 3)); }
    uint64_t dx = dev(hx, n * k * es), dw = dev(hw, m * k * es), db = dev(hb, m * es), dy = dev(hy, m * n * es);
    lt_t desc, la = layout(type, k, m, k), lb = layout(type, k, n, k), ly = layout(type, m, n, m);
    int t = 1, nt = 0, got = 0;
    OK(cublasLtMatmulDescCreate(&desc, COMPUTE_32F, R_32F));
    OK(cublasLtMatmulDescSetAttribute(desc, TRANSA, &t, sizeof t));
    OK(cublasLtMatmulDescSetAttribute(desc, TRANSB, &nt, sizeof nt));
    OK(cublasLtMatmulDescSetAttribute(desc, EPILOGUE, &epilogue, sizeof epilogue));
    OK(cublasLtMatmulDescSetAttribute(desc, BIAS, &db, sizeof db));
    result_t r[4];
    OK(cublasLtMatmulAlgoGetHeuristic(blas, desc, la, lb, ly, ly, pref, 4, r, &got));
    if (got < 1 || r[0].state) { printf("error no algo for %s\n", label); return 1; }
    float one = 1, zero = 0;
    OK(cublasLtMatmul(blas, desc, &one, dw, la, dx, lb, &zero, dy, ly, dy, ly, &r[0].algo, ws, 1 << 22, NULL));
    OK(cuCtxSynchronize());
    OK(cuMemcpyDtoH_v2(hy, dy, m * n * es));
    printf("%s", label);
    for (int i = 0; i < m * n; i++) printf(" %.9g", es == 4 ? ((float *)hy)[i] : unbf16(((uint16_t *)hy)[i]));
    printf("\n");
    cublasLtMatmulDescDestroy(desc);
    cublasLtMatrixLayoutDestroy(la), cublasLtMatrixLayoutDestroy(lb), cublasLtMatrixLayoutDestroy(ly);
    free(hx), free(hw), free(hb), free(hy);
    return 0;
}

/* baddbmm: C (b x m x n, column-major, batch stride m*n) = 0.5 * A @ B + 2 * C, in place, on its own stream. */
static int batched(void) {
    enum { B = 3, M = 4, N = 5, K = 3 };
    float ha[B * M * K], hb[B * K * N], hc[B * M * N];
    for (int i = 0; i < B * M * K; i++) ha[i] = x(i, 5);
    for (int i = 0; i < B * K * N; i++) hb[i] = x(i, 7);
    for (int i = 0; i < B * M * N; i++) hc[i] = x(i, 3);
    uint64_t da = dev(ha, sizeof ha), db = dev(hb, sizeof hb), dc = dev(hc, sizeof hc);
    lt_t desc, la = layout(R_32F, M, K, M), lb = layout(R_32F, K, N, K), lc = layout(R_32F, M, N, M);
    int batch = B;
    int64_t sa = M * K, sb = K * N, sc = M * N;
    OK(cublasLtMatrixLayoutSetAttribute(la, BATCH, &batch, 4));
    OK(cublasLtMatrixLayoutSetAttribute(la, STRIDE, &sa, 8));
    OK(cublasLtMatrixLayoutSetAttribute(lb, BATCH, &batch, 4));
    OK(cublasLtMatrixLayoutSetAttribute(lb, STRIDE, &sb, 8));
    OK(cublasLtMatrixLayoutSetAttribute(lc, BATCH, &batch, 4));
    OK(cublasLtMatrixLayoutSetAttribute(lc, STRIDE, &sc, 8));
    OK(cublasLtMatmulDescCreate(&desc, COMPUTE_32F, R_32F));
    void *s;
    OK(cuStreamCreate(&s, 0));
    float alpha = 0.5f, beta = 2;
    OK(cublasLtMatmul(h, desc, &alpha, da, la, db, lb, &beta, dc, lc, dc, lc, NULL, ws, 1 << 22, s));
    alpha = 100, beta = 100;                                  /* host scalars are read at the call */
    OK(cuStreamSynchronize(s));
    OK(cuMemcpyDtoH_v2(hc, dc, sizeof hc));
    printf("batched");
    for (int i = 0; i < B * M * N; i++) printf(" %.9g", hc[i]);
    printf("\n");
    cublasLtMatmulDescDestroy(desc);
    cublasLtMatrixLayoutDestroy(la), cublasLtMatrixLayoutDestroy(lb), cublasLtMatrixLayoutDestroy(lc);
    return 0;
}

/* fp64, A transposed and B transposed, scalars in device memory: D = 1.5 * A^T @ B^T - 1 * C into a separate D. */
static int fp64_device_scalars(void) {
    enum { M = 3, N = 2, K = 4 };
    double ha[K * M], hb[N * K], hc[M * N], hd[M * N] = {0}, sc[2] = {1.5, -1};
    for (int i = 0; i < K * M; i++) ha[i] = x(i, 5);
    for (int i = 0; i < N * K; i++) hb[i] = x(i, 7);
    for (int i = 0; i < M * N; i++) hc[i] = x(i, 3);
    uint64_t da = dev(ha, sizeof ha), db = dev(hb, sizeof hb), dc = dev(hc, sizeof hc), dd = dev(hd, sizeof hd);
    uint64_t ds = dev(sc, sizeof sc);
    lt_t desc, la = layout(R_64F, K, M, K), lb = layout(R_64F, N, K, N), lc = layout(R_64F, M, N, M);
    int t = 1, device = 1;
    OK(cublasLtMatmulDescCreate(&desc, COMPUTE_64F, R_64F));
    OK(cublasLtMatmulDescSetAttribute(desc, TRANSA, &t, 4));
    OK(cublasLtMatmulDescSetAttribute(desc, TRANSB, &t, 4));
    OK(cublasLtMatmulDescSetAttribute(desc, POINTER_MODE, &device, 4));
    OK(cublasLtMatmul(h, desc, (void *)(uintptr_t)ds, da, la, db, lb, (void *)(uintptr_t)(ds + 8), dc, lc, dd, lc,
                      NULL, ws, 1 << 22, NULL));
    OK(cuCtxSynchronize());
    OK(cuMemcpyDtoH_v2(hd, dd, sizeof hd));
    printf("fp64");
    for (int i = 0; i < M * N; i++) printf(" %.17g", hd[i]);
    printf("\n");
    return 0;
}

/* The heuristic twice alike (cached), then for another shape; the descriptors' Get answered here. */
static int heuristic_and_get(void) {
    lt_t desc, l = layout(R_32F, 8, 8, 8), l2 = layout(R_32F, 16, 8, 16);
    OK(cublasLtMatmulDescCreate(&desc, COMPUTE_32F, R_32F));
    result_t r[3][1];
    int got[3], t = 1, back = -1, epi = -1;
    size_t written = 0, need = 0;
    OK(cublasLtMatmulAlgoGetHeuristic(h, desc, l, l, l, l, pref, 1, r[0], &got[0]));
    OK(cublasLtMatmulAlgoGetHeuristic(h, desc, l, l, l, l, pref, 1, r[1], &got[1]));
    OK(cublasLtMatmulAlgoGetHeuristic(h, desc, l2, l, l2, l2, pref, 1, r[2], &got[2]));   /* 16x8 @ 8x8 */
    printf("algo %d %d %d %llu %llu %llu %d\n", got[0], got[1], got[2], (unsigned long long)r[0][0].algo[1],
           (unsigned long long)r[1][0].algo[1], (unsigned long long)r[2][0].algo[1],
           !memcmp(r[0], r[1], sizeof r[0]));
    OK(cublasLtMatmulDescSetAttribute(desc, TRANSA, &t, 4));
    OK(cublasLtMatmulDescGetAttribute(desc, TRANSA, &back, 4, &written));
    OK(cublasLtMatmulDescGetAttribute(desc, EPILOGUE, NULL, 0, &need));
    OK(cublasLtMatmulDescGetAttribute(desc, EPILOGUE, &epi, 4, NULL));
    printf("get %d %zu %zu %d %d %d\n", back, written, need, epi,
           cublasLtMatmulDescGetAttribute(desc, TRANSA, &back, 8, NULL),       /* the wrong size: 7 */
           cublasLtMatmulDescSetAttribute(desc, TRANSA, &t, 2));
    cublasLtMatmulDescDestroy(desc);
    return 0;
}

/* A matmul captured into a graph (torch's reduce-overhead mode): the scalars are the capture's, the inputs the
 * replay's. */
static int captured(void) {
    float ha[4] = {1, 2, 3, 4}, hb[4] = {1, 0, 0, 1}, hb2[4] = {0, 1, 1, 0}, hd[4] = {0};
    uint64_t da = dev(ha, sizeof ha), db = dev(hb, sizeof hb), dd = dev(hd, sizeof hd);
    lt_t desc, l = layout(R_32F, 2, 2, 2);
    void *s, *graph, *exec;
    float alpha = 3, beta = 0;
    OK(cublasLtMatmulDescCreate(&desc, COMPUTE_32F, R_32F));
    OK(cuStreamCreate(&s, 0));
    OK(cuStreamBeginCapture_v2(s, 2));                       /* CU_STREAM_CAPTURE_MODE_RELAXED */
    OK(cublasLtMatmul(h, desc, &alpha, da, l, db, l, &beta, dd, l, dd, l, NULL, ws, 1 << 22, s));
    OK(cuStreamEndCapture(s, &graph));
    alpha = 100;
    OK(cuMemcpyHtoD_v2(db, hb2, sizeof hb2));
    OK(cuGraphInstantiateWithFlags(&exec, graph, 0));
    OK(cuGraphLaunch(exec, s));
    OK(cuStreamSynchronize(s));
    OK(cuMemcpyDtoH_v2(hd, dd, sizeof hd));
    printf("captured %g %g %g %g\n", hd[0], hd[1], hd[2], hd[3]);
    cublasLtMatmulDescDestroy(desc);
    cublasLtMatrixLayoutDestroy(l);
    return 0;
}

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }

/* What a training step's small GEMMs cost the caller: a cached heuristic and a queued matmul, each. */
static int timing(void) {
    enum { CALLS = 2000 };
    float ha[4] = {1, 2, 3, 4}, one = 1, zero = 0;
    uint64_t da = dev(ha, sizeof ha), dd = dev(ha, sizeof ha);
    lt_t desc, l = layout(R_32F, 2, 2, 2);
    result_t r[1];
    int got;
    OK(cublasLtMatmulDescCreate(&desc, COMPUTE_32F, R_32F));
    OK(cublasLtMatmulAlgoGetHeuristic(h, desc, l, l, l, l, pref, 1, r, &got));
    double t0 = now();
    for (int i = 0; i < CALLS; i++) OK(cublasLtMatmulAlgoGetHeuristic(h, desc, l, l, l, l, pref, 1, r, &got));
    double t1 = now();
    for (int i = 0; i < CALLS; i++) OK(cublasLtMatmul(h, desc, &one, da, l, da, l, &zero, dd, l, dd, l, r, ws, 0, NULL));
    double t2 = now();
    OK(cuCtxSynchronize());
    printf("per_call_us %.3f %.3f\n", (t1 - t0) / CALLS * 1e6, (t2 - t1) / CALLS * 1e6);
    cublasLtMatmulDescDestroy(desc);
    cublasLtMatrixLayoutDestroy(l);
    return 0;
}

int main(int argc, char **argv) {
    void *ctx;
    int d;
    OK(cuInit(0));
    OK(cuDeviceGet(&d, 0));
    OK(cuDevicePrimaryCtxRetain(&ctx, d));
    OK(cuCtxSetCurrent(ctx));
    OK(cublasLtCreate(&h));
    OK(cublasCreate_v2(&blas));
    OK(cublasLtMatmulPreferenceCreate(&pref));
    uint64_t wsn = 1 << 22;
    OK(cublasLtMatmulPreferenceSetAttribute(pref, WS, &wsn, sizeof wsn));
    OK(cuMemAlloc_v2(&ws, wsn));
    /* bf16 with 16-byte leading dimensions (what cuBLASLt's kernels for it want); fp32 odd ones */
    if (linear("linear_fp32", R_32F, 4, 6, 5, 7) || linear("linear_bf16", R_16BF, 4, 8, 5, 8)
        || linear("relu_bias_bf16", R_16BF, 6, 8, 3, 16) || linear("gelu_bias_fp32", R_32F, 36, 5, 4, 6)
        || batched() || fp64_device_scalars() || heuristic_and_get() || captured() || timing())
        return 1;
    if (argc > 1 && !strcmp(argv[1], "bogus")) {
        /* a handle nobody made: the answered call says so now, the queued one at the next synchronisation */
        lt_t desc, l = layout(R_32F, 2, 2, 2), bogus = (lt_t)(uintptr_t)0x1234;
        result_t r[1];
        int got = 0;
        float one = 1;
        cublasLtMatmulDescCreate(&desc, COMPUTE_32F, R_32F);
        int heur = cublasLtMatmulAlgoGetHeuristic(bogus, desc, l, l, l, l, pref, 1, r, &got);
        int mm = cublasLtMatmul(bogus, desc, &one, ws, l, ws, l, &one, ws, l, ws, l, NULL, ws, 0, NULL);
        int sync = cuCtxSynchronize();
        printf("bogus %d %d %d\n", heur, mm, sync);
        return 0;
    }
    cublasLtMatmulPreferenceDestroy(pref);
    OK(cublasLtDestroy(h));
    OK(cublasDestroy_v2(blas));
    OK(cuCtxSynchronize());
    printf("done\n");
    return 0;
}
