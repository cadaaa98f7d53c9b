/* cuDNN through its two APIs, as torch 2.11 calls it: a convolution (forward, backward data, backward
 * filter) built with the backend graph API the way cudnn-frontend builds it (tensors, convolution, op,
 * op graph, heuristic, engine config, plan, variant pack, execute), then batch normalization with the
 * legacy calls (training forward, backward, inference).  Prints "label v v v ..." lines; the test
 * computes the same with torch.  Own prototypes: it builds without NVIDIA's headers, and links against
 * rgpu's libraries or the real ones. */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

typedef void *handle_t;
typedef void *desc_t;
int cudnnCreate(handle_t *);
int cudnnDestroy(handle_t);
int cudnnSetStream(handle_t, void *);
int cudnnGetStream(handle_t, void **);
size_t cudnnGetVersion(void);
int cudnnBackendCreateDescriptor(int, desc_t *);
int cudnnBackendDestroyDescriptor(desc_t);
int cudnnBackendSetAttribute(desc_t, int, int, int64_t, const void *);
int cudnnBackendGetAttribute(desc_t, int, int, int64_t, int64_t *, void *);
int cudnnBackendFinalize(desc_t);
int cudnnBackendExecute(handle_t, desc_t, desc_t);
int cudnnCreateTensorDescriptor(desc_t *);
int cudnnSetTensorNdDescriptor(desc_t, int, int, const int *, const int *);
int cudnnGetTensorNdDescriptor(desc_t, int, int *, int *, int *, int *);
int cudnnDestroyTensorDescriptor(desc_t);
int cudnnDeriveBNTensorDescriptor(desc_t, desc_t, int);
int cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize(handle_t, int, int, desc_t, desc_t, desc_t, desc_t, desc_t, size_t *);
int cudnnGetBatchNormalizationBackwardExWorkspaceSize(handle_t, int, int, desc_t, desc_t, desc_t, desc_t, desc_t, desc_t, desc_t, size_t *);
int cudnnGetBatchNormalizationTrainingExReserveSpaceSize(handle_t, int, int, desc_t, desc_t, size_t *);
int cudnnBatchNormalizationForwardTrainingEx(handle_t, int, int, const void *, const void *, desc_t, const void *, desc_t,
    const void *, desc_t, void *, desc_t, const void *, const void *, double, void *, void *, double, void *, void *,
    desc_t, void *, size_t, void *, size_t);
int cudnnBatchNormalizationBackwardEx(handle_t, int, int, const void *, const void *, const void *, const void *, desc_t,
    const void *, desc_t, const void *, desc_t, const void *, desc_t, void *, desc_t, void *, desc_t, const void *,
    const void *, void *, void *, double, const void *, const void *, desc_t, void *, size_t, void *, size_t);
int cudnnBatchNormalizationForwardInference(handle_t, int, const void *, const void *, desc_t, const void *, desc_t, void *,
    desc_t, const void *, const void *, const void *, const void *, double);
int cudaMalloc(void **, size_t);
int cudaMemcpy(void *, const void *, size_t, int);
int cudaFree(void *);
int cudaDeviceSynchronize(void);

#define OK(call) do { int r_ = (int)(call); if (r_) { printf("error %s = %d\n", #call, r_); exit(1); } } while (0)
/* attribute types, descriptor types (cudnn_graph.h) */
enum { T_HANDLE = 0, T_DATA_TYPE = 1, T_BOOLEAN = 2, T_INT64 = 3, T_FLOAT = 4, T_VOID_PTR = 6, T_CONV_MODE = 7,
       T_HEUR_MODE = 8, T_NUMERICAL_NOTE = 11, T_DESC = 15 };
enum { D_CONV = 1, D_ENGINE = 2, D_ENGINECFG = 3, D_HEUR = 4, D_PLAN = 5, D_GRAPH = 15, D_PACK = 16, D_TENSOR = 17 };
enum { H2D = 1, D2H = 2 };

static void print(const char *label, const float *v, int n) {
    printf("%s", label);
    for (int i = 0; i < n; i++) printf(" %.9g", v[i]);
    printf("\n");
}

static void *upload(const float *h, int n) {
    void *d;
    OK(cudaMalloc(&d, n * sizeof(float)));
    OK(cudaMemcpy(d, h, n * sizeof(float), H2D));
    return d;
}

static void download(const char *label, void *d, int n) {
    float *h = malloc(n * sizeof(float));
    OK(cudaMemcpy(h, d, n * sizeof(float), D2H));
    print(label, h, n);
    free(h);
}

static desc_t tensor(int64_t uid, const int64_t *dims) {
    desc_t t;
    int64_t strides[4] = {dims[1] * dims[2] * dims[3], dims[2] * dims[3], dims[3], 1}, align = 16;
    int dtype = 0;                                   /* CUDNN_DATA_FLOAT */
    bool virt = false;
    OK(cudnnBackendCreateDescriptor(D_TENSOR, &t));
    OK(cudnnBackendSetAttribute(t, 901, T_DATA_TYPE, 1, &dtype));
    OK(cudnnBackendSetAttribute(t, 902, T_INT64, 4, dims));
    OK(cudnnBackendSetAttribute(t, 903, T_INT64, 4, strides));
    OK(cudnnBackendSetAttribute(t, 906, T_INT64, 1, &uid));
    OK(cudnnBackendSetAttribute(t, 900, T_INT64, 1, &align));
    OK(cudnnBackendSetAttribute(t, 907, T_BOOLEAN, 1, &virt));
    OK(cudnnBackendFinalize(t));
    return t;
}

/* one convolution graph of `kind` over x (N,C,H,W), w (K,C,R,S), y (N,K,P,Q) bound to the three buffers */
static void convolve(handle_t h, int kind, void *xp, void *wp, void *yp, float alpha) {
    /* per op type: alpha, beta, conv, and the attributes x, w and y are bound to */
    static const int attrs[3][7] = {{10, 700, 701, 702, 704, 703, 705}, {12, 706, 707, 708, 710, 709, 711},
                                    {11, 712, 713, 714, 716, 715, 717}};
    const int *a = attrs[kind];
    int64_t xd[4] = {2, 3, 7, 7}, wd[4] = {4, 3, 3, 3}, yd[4] = {2, 4, 4, 5};
    desc_t x = tensor('x', xd), w = tensor('w', wd), y = tensor('y', yd), conv, op, graph, heur, engine, plan, pack;
    int64_t two = 2, pads[2] = {1, 1}, strides[2] = {2, 1}, dilations[2] = {1, 2};
    int ftype = 0, mode = 1;                         /* float compute, CUDNN_CROSS_CORRELATION */
    OK(cudnnBackendCreateDescriptor(D_CONV, &conv));
    OK(cudnnBackendSetAttribute(conv, 100, T_DATA_TYPE, 1, &ftype));
    OK(cudnnBackendSetAttribute(conv, 101, T_CONV_MODE, 1, &mode));
    OK(cudnnBackendSetAttribute(conv, 106, T_INT64, 1, &two));
    OK(cudnnBackendSetAttribute(conv, 102, T_INT64, 2, dilations));
    OK(cudnnBackendSetAttribute(conv, 103, T_INT64, 2, strides));
    OK(cudnnBackendSetAttribute(conv, 105, T_INT64, 2, pads));
    OK(cudnnBackendSetAttribute(conv, 104, T_INT64, 2, pads));
    OK(cudnnBackendFinalize(conv));
    float beta = 0.0f;
    OK(cudnnBackendCreateDescriptor(a[0], &op));
    OK(cudnnBackendSetAttribute(op, a[4], T_DESC, 1, &x));
    OK(cudnnBackendSetAttribute(op, a[5], T_DESC, 1, &w));
    OK(cudnnBackendSetAttribute(op, a[6], T_DESC, 1, &y));
    OK(cudnnBackendSetAttribute(op, a[3], T_DESC, 1, &conv));
    OK(cudnnBackendSetAttribute(op, a[1], T_FLOAT, 1, &alpha));
    OK(cudnnBackendSetAttribute(op, a[2], T_FLOAT, 1, &beta));
    OK(cudnnBackendFinalize(op));
    OK(cudnnBackendCreateDescriptor(D_GRAPH, &graph));
    OK(cudnnBackendSetAttribute(graph, 800, T_HANDLE, 1, &h));
    OK(cudnnBackendSetAttribute(graph, 801, T_DESC, 1, &op));
    OK(cudnnBackendFinalize(graph));
    int64_t engines = 0, n = 0;
    OK(cudnnBackendGetAttribute(graph, 802, T_INT64, 1, &n, &engines));
    int heur_mode = 0;                               /* CUDNN_HEUR_MODE_INSTANT */
    OK(cudnnBackendCreateDescriptor(D_HEUR, &heur));
    OK(cudnnBackendSetAttribute(heur, 201, T_DESC, 1, &graph));
    OK(cudnnBackendSetAttribute(heur, 200, T_HEUR_MODE, 1, &heur_mode));
    OK(cudnnBackendFinalize(heur));
    int64_t count = 0, got = 0;
    OK(cudnnBackendGetAttribute(heur, 202, T_DESC, 0, &count, NULL));
    if (count < 1) { printf("error no engine config\n"); exit(1); }
    desc_t *cfgs = calloc(count, sizeof *cfgs);
    for (int64_t i = 0; i < count; i++) OK(cudnnBackendCreateDescriptor(D_ENGINECFG, &cfgs[i]));
    OK(cudnnBackendGetAttribute(heur, 202, T_DESC, count, &got, cfgs));
    /* the frontend reads each config's engine and its notes before choosing; the first that finalizes wins */
    int64_t index = -1, notes = 0, workspace = -1, one = 0;
    int note[16];
    void *ws = NULL;
    OK(cudnnBackendCreateDescriptor(D_ENGINE, &engine));
    OK(cudnnBackendCreateDescriptor(D_PLAN, &plan));
    for (int64_t i = 0; i < got; i++) {
        OK(cudnnBackendGetAttribute(cfgs[i], 300, T_DESC, 1, &one, &engine));
        OK(cudnnBackendGetAttribute(engine, 1301, T_INT64, 1, &one, &index));
        OK(cudnnBackendGetAttribute(engine, 1303, T_NUMERICAL_NOTE, 16, &notes, note));
        OK(cudnnBackendSetAttribute(plan, 400, T_HANDLE, 1, &h));
        OK(cudnnBackendSetAttribute(plan, 401, T_DESC, 1, &cfgs[i]));
        if (cudnnBackendFinalize(plan) == 0) break;
        OK(cudnnBackendDestroyDescriptor(plan));
        OK(cudnnBackendCreateDescriptor(D_PLAN, &plan));
    }
    OK(cudnnBackendGetAttribute(plan, 402, T_INT64, 1, &one, &workspace));
    if (workspace > 0) OK(cudaMalloc(&ws, workspace));
    int64_t uids[3] = {'x', 'w', 'y'};
    void *ptrs[3] = {xp, wp, yp};
    OK(cudnnBackendCreateDescriptor(D_PACK, &pack));
    OK(cudnnBackendSetAttribute(pack, 1000, T_INT64, 3, uids));
    OK(cudnnBackendSetAttribute(pack, 1001, T_VOID_PTR, 3, ptrs));
    OK(cudnnBackendSetAttribute(pack, 1003, T_VOID_PTR, 1, &ws));
    OK(cudnnBackendFinalize(pack));
    OK(cudnnBackendExecute(h, plan, pack));
    OK(cudaDeviceSynchronize());
    printf("conv%d_plan %d %d %d\n", kind, engines >= 1, got >= 1, workspace >= 0);
    desc_t all[] = {pack, plan, engine, heur, graph, op, conv, x, w, y};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++) OK(cudnnBackendDestroyDescriptor(all[i]));
    for (int64_t i = 0; i < count; i++) OK(cudnnBackendDestroyDescriptor(cfgs[i]));
    free(cfgs);
    if (ws) OK(cudaFree(ws));
}

static void batch_norm(handle_t h) {
    enum { N = 4, C = 3, H = 5, W = 5, NX = N * C * H * W };
    static float x[NX], dy[NX], scale[C], bias[C], rmean[C], rvar[C];
    for (int i = 0; i < NX; i++) { x[i] = ((i * 7) % 19) * 0.2f - 1.5f; dy[i] = ((i * 11) % 17) * 0.1f - 0.8f; }
    for (int c = 0; c < C; c++) { scale[c] = 1.0f + 0.5f * c; bias[c] = 0.1f * c - 0.2f; rmean[c] = 0; rvar[c] = 1; }
    void *xp = upload(x, NX), *dyp = upload(dy, NX), *sp = upload(scale, C), *bp = upload(bias, C);
    void *rmp = upload(rmean, C), *rvp = upload(rvar, C), *yp, *dxp, *smp, *sivp, *dsp, *dbp, *y2p;
    OK(cudaMalloc(&yp, NX * 4)); OK(cudaMalloc(&dxp, NX * 4)); OK(cudaMalloc(&y2p, NX * 4));
    OK(cudaMalloc(&smp, C * 4)); OK(cudaMalloc(&sivp, C * 4)); OK(cudaMalloc(&dsp, C * 4)); OK(cudaMalloc(&dbp, C * 4));
    desc_t xd, bnd;
    int dims[4] = {N, C, H, W}, strides[4] = {C * H * W, H * W, W, 1};
    OK(cudnnCreateTensorDescriptor(&xd));
    OK(cudnnSetTensorNdDescriptor(xd, 0, 4, dims, strides));
    OK(cudnnCreateTensorDescriptor(&bnd));
    OK(cudnnDeriveBNTensorDescriptor(bnd, xd, 1));   /* CUDNN_BATCHNORM_SPATIAL */
    int dt = -1, nd = 0, bdims[4] = {0}, bstrides[4] = {0};
    OK(cudnnGetTensorNdDescriptor(bnd, 4, &dt, &nd, bdims, bstrides));
    printf("bn_desc %d %d %d %d %d %d\n", dt, nd, bdims[0], bdims[1], bdims[2], bdims[3]);
    size_t wsize = 0, rsize = 0, bwsize = 0;
    OK(cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize(h, 1, 0, xd, NULL, xd, bnd, NULL, &wsize));
    OK(cudnnGetBatchNormalizationTrainingExReserveSpaceSize(h, 1, 0, NULL, xd, &rsize));
    OK(cudnnGetBatchNormalizationBackwardExWorkspaceSize(h, 1, 0, xd, xd, xd, NULL, xd, bnd, NULL, &bwsize));
    void *ws = NULL, *rs = NULL, *bws = NULL;
    if (wsize) OK(cudaMalloc(&ws, wsize));
    if (rsize) OK(cudaMalloc(&rs, rsize));
    if (bwsize) OK(cudaMalloc(&bws, bwsize));
    float one = 1.0f, zero = 0.0f;
    OK(cudnnBatchNormalizationForwardTrainingEx(h, 1, 0, &one, &zero, xd, xp, NULL, NULL, xd, yp, bnd, sp, bp, 0.1,
                                                rmp, rvp, 1e-5, smp, sivp, NULL, ws, wsize, rs, rsize));
    OK(cudnnBatchNormalizationBackwardEx(h, 1, 0, &one, &zero, &one, &zero, xd, xp, xd, yp, xd, dyp, NULL, NULL, xd, dxp,
                                         bnd, sp, bp, dsp, dbp, 1e-5, smp, sivp, NULL, bws, bwsize, rs, rsize));
    OK(cudnnBatchNormalizationForwardInference(h, 1, &one, &zero, xd, xp, xd, y2p, bnd, sp, bp, rmp, rvp, 1e-5));
    OK(cudaDeviceSynchronize());
    download("bn_y", yp, NX);
    download("bn_save_mean", smp, C);
    download("bn_save_inv_var", sivp, C);
    download("bn_running_mean", rmp, C);
    download("bn_running_var", rvp, C);
    download("bn_dx", dxp, NX);
    download("bn_dscale", dsp, C);
    download("bn_dbias", dbp, C);
    download("bn_infer_y", y2p, NX);
    OK(cudnnDestroyTensorDescriptor(bnd));
    OK(cudnnDestroyTensorDescriptor(xd));
    void *bufs[] = {xp, dyp, sp, bp, rmp, rvp, yp, dxp, y2p, smp, sivp, dsp, dbp, ws, rs, bws};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) if (bufs[i]) OK(cudaFree(bufs[i]));
}

int main(void) {
    handle_t h;
    void *stream = (void *)1;
    OK(cudaFree(NULL));                               /* the runtime's idiom, as torch: a context before cuDNN */
    OK(cudnnCreate(&h));
    OK(cudnnSetStream(h, NULL));
    OK(cudnnGetStream(h, &stream));
    printf("stream %d\n", stream == NULL);
    printf("version %d\n", (int)(cudnnGetVersion() / 10000));
    enum { NX = 2 * 3 * 7 * 7, NW = 4 * 3 * 3 * 3, NY = 2 * 4 * 4 * 5 };
    static float x[NX], w[NW], dy[NY];
    for (int i = 0; i < NX; i++) x[i] = ((i * 7) % 13) * 0.25f - 1.5f;
    for (int i = 0; i < NW; i++) w[i] = ((i * 5) % 11) * 0.125f - 0.5f;
    for (int i = 0; i < NY; i++) dy[i] = ((i * 3) % 7) * 0.5f - 1.0f;
    void *xp = upload(x, NX), *wp = upload(w, NW), *dyp = upload(dy, NY), *yp, *dxp, *dwp;
    OK(cudaMalloc(&yp, NY * 4)); OK(cudaMalloc(&dxp, NX * 4)); OK(cudaMalloc(&dwp, NW * 4));
    convolve(h, 0, xp, wp, yp, 1.0f);                 /* y = conv(x, w) */
    convolve(h, 1, dxp, wp, dyp, 0.5f);               /* dx = 0.5 * conv's input gradient from dy */
    convolve(h, 2, xp, dwp, dyp, 1.0f);               /* dw = the filter gradient from x and dy */
    download("conv_y", yp, NY);
    download("conv_dx", dxp, NX);
    download("conv_dw", dwp, NW);
    batch_norm(h);
    void *bufs[] = {xp, wp, dyp, yp, dxp, dwp};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) OK(cudaFree(bufs[i]));
    OK(cudnnDestroy(h));
    OK(cudaDeviceSynchronize());                      /* the queued destroys have run: the server counts none left */
    printf("done\n");
    return 0;
}
