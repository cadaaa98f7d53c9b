/* A stand-in for the real libcudnn.so.9 that records what it is given, so the server's ctypes side
 * (server/cuda/libs/cudnn_real.py) is checked without a GPU: prototypes, argument order, doubles, the
 * ids mapped to real pointers, the descriptors filled.  Backend descriptors keep their attributes;
 * a heuristic's results are MOCK_RESULTS engine configs; mock_* functions let the test look inside. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MOCK_RESULTS 2
typedef struct { int name, type; int64_t count; uint8_t data[256]; } attr;
typedef struct { int type, finalized, n; attr a[32]; } desc;
typedef struct { void *stream; } handle;

static int live;                 /* handles and descriptors not destroyed */
static int stream_sets;
static uint64_t last[40];        /* the last execution or BN call's arguments, as integers */
static double last_d[8];         /* ... and its floating-point ones */
static int read_mask;            /* which of an execution's pointers are host ones, to read a float from */

static int width(int type) { return type == 2 || type == 24 ? 1 : type == 26 ? 16 :
                                    (type == 0 || type == 3 || type == 5 || type == 6 || type == 15) ? 8 : 4; }

static attr *find(desc *d, int name) {
    for (int i = 0; i < d->n; i++) if (d->a[i].name == name) return &d->a[i];
    return NULL;
}

size_t cudnnGetVersion(void) { return 91901; }
const char *cudnnGetErrorString(int s) { return s ? "MOCK_ERROR" : "MOCK_SUCCESS"; }
void cudnnGetLastErrorString(char *m, size_t n) { if (n) m[0] = 0; }
int cudnnCreate(void **h) { *h = calloc(1, sizeof(handle)); live++; return 0; }
int cudnnDestroy(void *h) { free(h); live--; return 0; }
int cudnnSetStream(void *h, void *s) { ((handle *)h)->stream = s; stream_sets++; return 0; }

int cudnnBackendCreateDescriptor(int type, void **d) {
    if (type < 0 || type > 43) return 2000;
    desc *x = calloc(1, sizeof *x);
    x->type = type;
    *d = x;
    live++;
    return 0;
}
int cudnnBackendDestroyDescriptor(void *d) { free(d); live--; return 0; }
int cudnnBackendInitialize(void *d) { ((desc *)d)->n = 0; return 0; }

int cudnnBackendSetAttribute(void *p, int name, int type, int64_t count, const void *el) {
    desc *d = p;
    size_t n = (size_t)count * width(type);
    if (d->finalized || n > sizeof d->a[0].data) return 2000;
    attr *a = find(d, name);
    if (!a) { if (d->n == 32) return 2000; a = &d->a[d->n++]; }
    a->name = name, a->type = type, a->count = count;
    memcpy(a->data, el, n);
    return 0;
}

int cudnnBackendFinalize(void *p) {
    desc *d = p;
    if (d->type == 5 && !find(d, 401)) return 3000;          /* a plan without an engine config */
    if (d->type == 4) {                                       /* a heuristic: its results, by count */
        attr *a = &d->a[d->n++];
        a->name = 202, a->type = 15, a->count = MOCK_RESULTS;
    }
    if (d->type == 5) {
        int64_t ws = 4096;
        cudnnBackendSetAttribute(d, 402, 3, 1, &ws);
    }
    d->finalized = 1;
    return 0;
}

int cudnnBackendGetAttribute(void *p, int name, int type, int64_t req, int64_t *count, void *el) {
    desc *d = p;
    attr *a = find(d, name);
    if (!d->finalized) return 2004;
    if (!a || a->type != type) return 2000;
    *count = a->count;
    int64_t k = req < a->count ? req : a->count;
    if (type == 15 && name == 202) {                          /* fill the caller's engine configs */
        for (int64_t i = 0; i < k; i++) {
            desc *t = ((desc **)el)[i];
            if (t->type != 3) return 2012;
            int64_t ws = 1000 + i;
            t->n = 0, t->finalized = 0;
            cudnnBackendSetAttribute(t, 303, 3, 1, &ws);
            t->finalized = 1;
        }
    } else if (k) {
        memcpy(el, a->data, (size_t)k * width(type));
    }
    return 0;
}

int cudnnBackendExecute(void *h, void *plan, void *pack) {
    attr *ptrs = find(pack, 1001);
    last[0] = (uintptr_t)h, last[1] = (uintptr_t)plan, last[2] = (uintptr_t)pack;
    last[3] = (uintptr_t)((handle *)h)->stream;
    for (int64_t i = 0; ptrs && i < ptrs->count && i < 8; i++) {    /* each pointer, and what a host one holds */
        memcpy(&last[4 + i], ptrs->data + 8 * i, 8);
        if (read_mask >> i & 1) { float f; memcpy(&f, (void *)(uintptr_t)last[4 + i], 4); last_d[i] = f; }
    }
    return 0;
}

int cudnnCreateTensorDescriptor(void **t) { *t = calloc(1, 64); live++; return 0; }
int cudnnDestroyTensorDescriptor(void *t) { free(t); live--; return 0; }
int cudnnSetTensorNdDescriptor(void *t, int dtype, int nb, const int *dims, const int *strides) {
    int *v = t;
    v[0] = dtype, v[1] = nb;
    for (int i = 0; i < nb && i < 4; i++) v[2 + i] = dims[i] * 1000 + strides[i];
    return 0;
}
int cudnnDeriveBNTensorDescriptor(void *d, void *x, int mode) { memcpy(d, x, 64); ((int *)d)[7] = mode; return 0; }

int cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize(void *h, int m, int o, void *x, void *z, void *y, void *bn,
                                                             void *act, size_t *size) {
    *size = (size_t)m * 100 + o * 10 + (x && y && bn && !z && !act); return 0;
}
int cudnnGetBatchNormalizationBackwardExWorkspaceSize(void *h, int m, int o, void *x, void *y, void *dy, void *dz,
                                                      void *dx, void *dbn, void *act, size_t *size) {
    *size = 7 + (x && dy && dx && dbn && !dz && !act); return 0;
}
int cudnnGetBatchNormalizationTrainingExReserveSpaceSize(void *h, int m, int o, void *act, void *x, size_t *size) {
    *size = 5 + (x && !act); return 0;
}

/* the arguments by position: pointers and sizes into last[], alpha/beta as given (float), doubles */
int cudnnBatchNormalizationForwardTrainingEx(void *h, int mode, int ops, const float *alpha, const float *beta,
        void *xd, void *x, void *zd, void *z, void *yd, void *y, void *bnd, void *scale, void *bias, double factor,
        void *rm, void *rv, double eps, void *sm, void *siv, void *act, void *ws, size_t wss, void *rs, size_t rss) {
    void *p[] = {h, xd, x, zd, z, yd, y, bnd, scale, bias, rm, rv, sm, siv, act, ws, (void *)wss, rs, (void *)rss};
    for (int i = 0; i < 19; i++) last[i] = (uintptr_t)p[i];
    last[19] = mode, last[20] = ops;
    last_d[0] = *alpha, last_d[1] = *beta, last_d[2] = factor, last_d[3] = eps;
    return 0;
}

int cudnnBatchNormalizationBackwardEx(void *h, int mode, int ops, const float *ad, const float *bd, const float *ap,
        const float *bp, void *xd, void *x, void *yd, void *y, void *dyd, void *dy, void *dzd, void *dz, void *dxd,
        void *dx, void *dbnd, void *scale, void *bias, void *dscale, void *dbias, double eps, void *sm, void *siv,
        void *act, void *ws, size_t wss, void *rs, size_t rss) {
    void *p[] = {h, xd, x, yd, y, dyd, dy, dzd, dz, dxd, dx, dbnd, scale, bias, dscale, dbias, sm, siv, act, ws,
                 (void *)wss, rs, (void *)rss};
    for (int i = 0; i < 23; i++) last[i] = (uintptr_t)p[i];
    last[23] = mode, last[24] = ops;
    last_d[0] = *ad, last_d[1] = *bd, last_d[2] = *ap, last_d[3] = *bp, last_d[4] = eps;
    return 0;
}

int cudnnBatchNormalizationForwardInference(void *h, int mode, const double *alpha, const double *beta, void *xd,
        void *x, void *yd, void *y, void *bnd, void *scale, void *bias, void *mean, void *var, double eps) {
    void *p[] = {h, xd, x, yd, y, bnd, scale, bias, mean, var};
    for (int i = 0; i < 10; i++) last[i] = (uintptr_t)p[i];
    last[10] = mode;
    last_d[0] = *alpha, last_d[1] = *beta, last_d[2] = eps;      /* double data: double scalars */
    return 0;
}

int mock_live(void) { return live; }
void mock_read(int mask) { read_mask = mask; }
int mock_stream_sets(void) { return stream_sets; }
uint64_t mock_last(int i) { return last[i]; }
double mock_last_d(int i) { return last_d[i]; }
const int *mock_tensor(void *t) { return t; }
