/* cuBLAS through rgpu: GEMMs, GEMVs and dot products with transposes, odd leading dimensions, strided
 * batches, fp32/fp64/bf16, host and device scalars, a second stream; every result copied back and printed
 * ("label v v ..."), whole buffers with their padding, for the test to compare with numpy.
 * Own declarations (no CUDA headers): built with gcc against rgpu's libraries, or natively against NVIDIA's.
 * Inputs: x_s(i) = ((i * s + 3) % 17 - 8) / 8, exact in bf16.  `cublas_gemms errors` checks the refusals. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef void *cublasHandle_t;
typedef void *cudaStream_t;
int cudaMalloc(void **p, size_t n);
int cudaFree(void *p);
int cudaMemcpy(void *dst, const void *src, size_t n, int kind);          /* 1: to device, 2: to host */
int cudaStreamCreate(cudaStream_t *s);
int cudaStreamSynchronize(cudaStream_t s);
int cudaDeviceSynchronize(void);
const char *cudaGetErrorString(int e);
int cudaStreamBeginCapture(cudaStream_t s, int mode);
int cudaStreamEndCapture(cudaStream_t s, void **graph);
int cudaGraphInstantiateWithFlags(void **exec, void *graph, unsigned long long flags);
int cudaGraphLaunch(void *exec, cudaStream_t s);
int cublasCreate_v2(cublasHandle_t *h);
int cublasDestroy_v2(cublasHandle_t h);
int cublasGetVersion_v2(cublasHandle_t h, int *v);
int cublasSetStream_v2(cublasHandle_t h, cudaStream_t s);
int cublasGetStream_v2(cublasHandle_t h, cudaStream_t *s);
int cublasSetPointerMode_v2(cublasHandle_t h, int mode);
int cublasGetPointerMode_v2(cublasHandle_t h, int *mode);
int cublasSetMathMode(cublasHandle_t h, int mode);
int cublasGetMathMode(cublasHandle_t h, int *mode);
int cublasSetWorkspace_v2(cublasHandle_t h, void *ws, size_t n);
int cublasSgemm_v2(cublasHandle_t, int, int, int, int, int, const float *, const float *, int, const float *, int,
                   const float *, float *, int);
int cublasDgemm_v2(cublasHandle_t, int, int, int, int, int, const double *, const double *, int, const double *,
                   int, const double *, double *, int);
int cublasGemmEx(cublasHandle_t, int, int, int, int, int, const void *, const void *, int, int, const void *, int,
                 int, const void *, void *, int, int, int, int);
int cublasSgemmStridedBatched(cublasHandle_t, int, int, int, int, int, const float *, const float *, int, long long,
                              const float *, int, long long, const float *, float *, int, long long, int);
int cublasGemmStridedBatchedEx(cublasHandle_t, int, int, int, int, int, const void *, const void *, int, int,
                               long long, const void *, int, int, long long, const void *, void *, int, int,
                               long long, int, int, int);
int cublasSgemmEx(cublasHandle_t, int, int, int, int, int, const float *, const void *, int, int, const void *, int,
                  int, const float *, void *, int, int);
int cublasDgemmStridedBatched(cublasHandle_t, int, int, int, int, int, const double *, const double *, int,
                              long long, const double *, int, long long, const double *, double *, int, long long,
                              int);
int cublasGemmBatchedEx(cublasHandle_t, int, int, int, int, int, const void *, const void *const *, int, int,
                        const void *const *, int, int, const void *, void *const *, int, int, int, int, int);
int cublasDdot_v2(cublasHandle_t, int, const double *, int, const double *, int, double *);
int cublasDotEx(cublasHandle_t, int, const void *, int, int, const void *, int, int, void *, int, int);
int cublasSgemv_v2(cublasHandle_t, int, int, int, const float *, const float *, int, const float *, int,
                   const float *, float *, int);
int cublasDgemv_v2(cublasHandle_t, int, int, int, const double *, const double *, int, const double *, int,
                   const double *, double *, int);
int cublasSdot_v2(cublasHandle_t, int, const float *, int, const float *, int, float *);

#define CK(call) do { int e_ = (call); if (e_) { printf("error %s: %d\n", #call, e_); exit(1); } } while (0)
#define RT(call) do { int e_ = (call); if (e_) { printf("error %s: %s\n", #call, cudaGetErrorString(e_)); exit(1); } } while (0)

static double x_of(int i, int s) { return (double)((i * s + 3) % 17 - 8) / 8.0; }

static float *floats(int n, int s) {
    float *v = malloc(n * sizeof *v);
    for (int i = 0; i < n; i++) v[i] = (float)x_of(i, s);
    return v;
}

static void *device(const void *host, size_t n) {
    void *d;
    RT(cudaMalloc(&d, n));
    RT(cudaMemcpy(d, host, n, 1));
    return d;
}

static void print_back(const char *label, const void *d, int n, int width) {
    unsigned char *h = malloc((size_t)n * width);
    RT(cudaMemcpy(h, d, (size_t)n * width, 2));
    printf("%s", label);
    for (int i = 0; i < n; i++) {
        double v;
        if (width == 8) { memcpy(&v, h + 8 * i, 8); }
        else if (width == 4) { float f; memcpy(&f, h + 4 * i, 4); v = f; }
        else { uint32_t b = (uint32_t)(h[2 * i] | h[2 * i + 1] << 8) << 16; float f; memcpy(&f, &b, 4); v = f; }
        printf(" %.17g", v);
    }
    printf("\n");
    free(h);
}

static uint16_t *bf16s(int n, int s) {               /* exact: x_s(i) has 4 significant bits */
    uint16_t *v = malloc(n * sizeof *v);
    for (int i = 0; i < n; i++) { float f = (float)x_of(i, s); uint32_t b; memcpy(&b, &f, 4); v[i] = b >> 16; }
    return v;
}

static int errors(void) {
    cublasHandle_t h;
    float one = 1, *d;
    int v = 0;
    RT(cudaMalloc((void **)&d, 64 * sizeof(float)));
    CK(cublasCreate_v2(&h));
    /* lda 1 < m 4: the server's library refuses it; queued, the refusal comes at the next synchronisation */
    int queued = cublasSgemm_v2(h, 0, 0, 4, 4, 4, &one, d, 1, d, 4, &one, d + 32, 4);
    int sync = cudaDeviceSynchronize();
    CK(cublasDestroy_v2(h));
    printf("bad_lda queued=%d sync=%d\n", queued, sync != 0);
    printf("destroyed sgemm=%d version=%d\n", cublasSgemm_v2(h, 0, 0, 1, 1, 1, &one, d, 1, d, 1, &one, d, 1),
           cublasGetVersion_v2(h, &v));
    printf("after sync=%d\n", cudaDeviceSynchronize());
    return 0;
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "errors")) return errors();
    cublasHandle_t h;
    cudaStream_t s2, got;
    int version = 0, mode = -1, math = -1;
    RT(cudaStreamCreate(&s2));                           /* the context first, as torch has it */
    CK(cublasCreate_v2(&h));
    CK(cublasGetVersion_v2(h, &version));
    printf("version_major %d\n", version / 10000);

    /* Sgemm N,T: C(5x4, ldc 8) = 1.5 A(5x3, lda 7) B(4x3, ldb 6)^T + 0.5 C */
    float *A = floats(7 * 3, 3), *B = floats(6 * 3, 5), *C = floats(8 * 4, 7);
    float *dA = device(A, 7 * 3 * 4), *dB = device(B, 6 * 3 * 4), *dC = device(C, 8 * 4 * 4);
    float alpha = 1.5f, beta = 0.5f;
    CK(cublasSgemm_v2(h, 0, 1, 5, 4, 3, &alpha, dA, 7, dB, 6, &beta, dC, 8));
    alpha = 99.0f;                                       /* the call copied it: this must not count */
    print_back("sgemm_nt", dC, 8 * 4, 4);

    /* Sgemm T,N on the second stream, device alpha/beta: C(3x4, ldc 5) = -1 A(5x3)^T B2(5x4, ldb 5) + 2 C */
    float sc[2] = {-1.0f, 2.0f}, *dS = device(sc, sizeof sc);
    float *B2 = floats(5 * 4, 9), *C2 = floats(5 * 4, 11);
    float *dB2 = device(B2, 5 * 4 * 4), *dC2 = device(C2, 5 * 4 * 4);
    CK(cublasSetStream_v2(h, s2));
    CK(cublasGetStream_v2(h, &got));
    CK(cublasSetPointerMode_v2(h, 1));
    CK(cublasGetPointerMode_v2(h, &mode));
    CK(cublasSgemm_v2(h, 1, 0, 3, 4, 5, dS, dA, 7, dB2, 5, dS + 1, dC2, 5));
    RT(cudaStreamSynchronize(s2));
    printf("stream_kept %d pointer_mode %d\n", got == s2, mode);
    print_back("sgemm_tn_device", dC2, 5 * 4, 4);
    CK(cublasSetPointerMode_v2(h, 0));
    CK(cublasSetStream_v2(h, 0));

    /* Dgemm T,T: C(2x3, ldc 3) = 0.25 A(4x2, lda 4)^T B(3x4, ldb 3)^T, beta 0 over a NaN C */
    double dAh[16], dBh[12], dCh[9], da = 0.25, db = 0.0;
    for (int i = 0; i < 16; i++) dAh[i] = x_of(i, 2);
    for (int i = 0; i < 12; i++) dBh[i] = x_of(i, 4);
    for (int i = 0; i < 9; i++) dCh[i] = 0.0 / 0.0;
    double *ddA = device(dAh, sizeof dAh), *ddB = device(dBh, sizeof dBh), *ddC = device(dCh, sizeof dCh);
    CK(cublasDgemm_v2(h, 1, 1, 2, 3, 4, &da, ddA, 4, ddB, 3, &db, ddC, 3));
    print_back("dgemm_tt_beta0", ddC, 9, 8);

    /* GemmEx bf16 in and out, fp32 compute, default math: C(4x3, ldc 6) = 1 A(4x5, lda 5) B(3x5, ldb 3)^T + 1 C */
    CK(cublasSetMathMode(h, 0));
    CK(cublasGetMathMode(h, &math));
    uint16_t *hA = bf16s(5 * 5, 6), *hB = bf16s(3 * 5, 8), *hC = bf16s(6 * 3, 10);
    void *bA = device(hA, 25 * 2), *bB = device(hB, 15 * 2), *bC = device(hC, 18 * 2);
    float one = 1.0f;
    CK(cublasGemmEx(h, 0, 1, 4, 3, 5, &one, bA, 14, 5, bB, 14, 3, &one, bC, 14, 6, 68, -1));
    printf("math_mode %d\n", math);
    print_back("gemmex_bf16", bC, 18, 2);

    /* SgemmStridedBatched N,N, 3 batches, padded strides: C_i(3x2, ldc 4) = 2 A_i(3x4, lda 3) B_i(4x2, ldb 5) - C_i */
    float *sA = floats(40 * 3, 12), *sB = floats(11 * 3, 13), *sC = floats(9 * 3, 14);
    float *dsA = device(sA, 40 * 3 * 4), *dsB = device(sB, 11 * 3 * 4), *dsC = device(sC, 9 * 3 * 4);
    float two = 2.0f, minus = -1.0f;
    CK(cublasSgemmStridedBatched(h, 0, 0, 3, 2, 4, &two, dsA, 3, 40, dsB, 5, 11, &minus, dsC, 4, 9, 3));
    print_back("sgemm_strided", dsC, 9 * 3, 4);

    /* GemmStridedBatchedEx fp32, T,N, 2 batches, A shared (stride 0): C_i(2x2, ldc 2) = A(3x2)^T B_i(3x2, ldb 4) */
    float zero = 0.0f;
    float *eB = floats(8 * 2, 15), *eC = floats(4 * 2, 16);
    float *deB = device(eB, 16 * 4), *deC = device(eC, 8 * 4);
    CK(cublasGemmStridedBatchedEx(h, 1, 0, 2, 2, 3, &one, dA, 0, 7, 0, deB, 0, 4, 8, &zero, deC, 0, 2, 4, 2, 68, -1));
    print_back("gemm_strided_ex", deC, 8, 4);

    /* Sgemv N (x stride 2) and Dgemv T (y stride 3): A(5x3, lda 7) */
    float *gx = floats(6, 17), *gy = floats(5, 18);
    float *dgx = device(gx, 6 * 4), *dgy = device(gy, 5 * 4), gb = 0.5f;
    CK(cublasSgemv_v2(h, 0, 5, 3, &alpha, dA, 7, dgx, 2, &gb, dgy, 1));
    print_back("sgemv_n", dgy, 5, 4);
    double Dx[5], Dy[7], dal = -2.0, dbe = 1.0;
    for (int i = 0; i < 5; i++) Dx[i] = x_of(i, 19);
    for (int i = 0; i < 7; i++) Dy[i] = x_of(i, 20);
    double *dDA = device(dAh, sizeof dAh), *dDx = device(Dx, sizeof Dx), *dDy = device(Dy, sizeof Dy);
    CK(cublasDgemv_v2(h, 1, 4, 3, &dal, dDA, 5, dDx, 1, &dbe, dDy, 3));
    print_back("dgemv_t", dDy, 7, 8);

    /* Sdot into host memory (answered), then into device memory (queued) */
    float r = 0.0f, *dr;
    CK(cublasSdot_v2(h, 3, dgx, 2, dgy, 1, &r));
    printf("sdot_host %.17g\n", (double)r);
    RT(cudaMalloc((void **)&dr, 4));
    CK(cublasSetPointerMode_v2(h, 1));
    CK(cublasSdot_v2(h, 5, dA, 1, dgy, 1, dr));
    print_back("sdot_device", dr, 1, 4);
    CK(cublasSetPointerMode_v2(h, 0));

    /* GemmEx complex float, A conjugate-transposed: alpha (1, 0.5), beta (0.5, -1), complex scalars (8 bytes) */
    float *zA = floats(2 * 2 * 2, 21), *zB = floats(2 * 2 * 2, 22), *zC = floats(2 * 2 * 2, 23);
    float za[2] = {1.0f, 0.5f}, zb[2] = {0.5f, -1.0f};
    void *dzA = device(zA, 32), *dzB = device(zB, 32), *dzC = device(zC, 32);
    CK(cublasGemmEx(h, 2, 0, 2, 2, 2, za, dzA, 4, 2, dzB, 4, 2, zb, dzC, 4, 2, 68, -1));
    print_back("gemmex_complex", dzC, 8, 4);

    /* GemmBatchedEx fp32 over device arrays of pointers, 2 batches: C_i(2x3, ldc 3) = A_i(2x4, lda 2) B_i(4x3) + C_i */
    float *pA = floats(16, 24), *pB = floats(24, 25), *pC = floats(18, 26);
    float *dpA = device(pA, 16 * 4), *dpB = device(pB, 24 * 4), *dpC = device(pC, 18 * 4);
    float *arr[6] = {dpA, dpA + 8, dpB, dpB + 12, dpC, dpC + 9};
    float **darr = device(arr, sizeof arr);
    CK(cublasGemmBatchedEx(h, 0, 0, 2, 3, 4, &one, (const void *const *)darr, 0, 2, (const void *const *)darr + 2,
                           0, 4, &one, (void *const *)darr + 4, 0, 3, 2, 68, -1));
    print_back("gemm_batched_ex", dpC, 18, 4);

    /* SgemmEx: bf16 inputs, fp32 output, torch's reduced-precision-disallowed math mode */
    CK(cublasSetMathMode(h, 16));
    float *xC = floats(4 * 3, 27), *dxC = device(xC, 12 * 4);
    CK(cublasSgemmEx(h, 0, 1, 4, 3, 5, &two, bA, 14, 5, bB, 14, 3, &minus, dxC, 0, 4));
    print_back("sgemmex_bf16", dxC, 12, 4);
    CK(cublasSetMathMode(h, 0));

    /* DgemmStridedBatched N,T, 2 batches: C_i(3x2, ldc 3) = 0.5 A_i(3x2, lda 4) B_i(2x2, ldb 2)^T */
    double qA[14], qB[8], qC[12], half = 0.5, dz = 0.0;
    for (int i = 0; i < 14; i++) qA[i] = x_of(i, 28);
    for (int i = 0; i < 8; i++) qB[i] = x_of(i, 29);
    for (int i = 0; i < 12; i++) qC[i] = x_of(i, 30);
    double *dqA = device(qA, sizeof qA), *dqB = device(qB, sizeof qB), *dqC = device(qC, sizeof qC);
    CK(cublasDgemmStridedBatched(h, 0, 1, 3, 2, 2, &half, dqA, 4, 7, dqB, 2, 4, &dz, dqC, 3, 6, 2));
    print_back("dgemm_strided", dqC, 12, 8);

    /* Ddot into device memory, DotEx (fp32) into host memory */
    double *ddr;
    RT(cudaMalloc((void **)&ddr, 8));
    CK(cublasSetPointerMode_v2(h, 1));
    CK(cublasDdot_v2(h, 4, dqA, 3, dqC, 2, ddr));
    CK(cublasSetPointerMode_v2(h, 0));
    print_back("ddot_device", ddr, 1, 8);
    float rx = 0.0f;
    CK(cublasDotEx(h, 4, dpA, 0, 2, dpB, 0, 1, &rx, 0, 0));
    printf("dotex_host %.17g\n", (double)rx);

    /* A GEMM captured on the second stream (with a workspace of ours) replays over the inputs of the replay */
    void *ws, *graph, *exec;
    RT(cudaMalloc(&ws, 1 << 22));
    CK(cublasSetStream_v2(h, s2));
    CK(cublasSetWorkspace_v2(h, ws, 1 << 22));
    float *cA = floats(4, 31), *cB = floats(4, 32), *cC = floats(4, 33);
    float *dcA = device(cA, 16), *dcB = device(cB, 16), *dcC = device(cC, 16);
    RT(cudaStreamBeginCapture(s2, 2));                   /* cudaStreamCaptureModeRelaxed */
    CK(cublasSgemm_v2(h, 0, 0, 2, 2, 2, &one, dcA, 2, dcB, 2, &zero, dcC, 2));
    RT(cudaStreamEndCapture(s2, &graph));
    RT(cudaGraphInstantiateWithFlags(&exec, graph, 0));
    RT(cudaMemcpy(dcA, cB, 16, 1));                      /* the replay's A is the old B */
    RT(cudaGraphLaunch(exec, s2));
    RT(cudaStreamSynchronize(s2));
    print_back("sgemm_graph", dcC, 4, 4);

    RT(cudaDeviceSynchronize());
    CK(cublasDestroy_v2(h));
    printf("done\n");
    return 0;
}
