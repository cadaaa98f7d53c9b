/* A stand-in for NVIDIA's libcublasLt.so.13 with cublasLt.h's prototypes, for testing the server's ctypes
 * side (server/cuda/libs/cublaslt_real.py) without a GPU: "device" pointers are host addresses here.
 * It checks attribute sizes as cuBLASLt does, computes fp32 column-major matmuls (transposes, strided
 * batches, the bias epilogue, host or device scalars) and records what the last call was handed. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct { int kind; int64_t a[64]; } obj;
typedef struct { uint64_t algo[8]; size_t workspace; int state; float waves; int reserved[4]; } result_t;
_Static_assert(sizeof(result_t) == 96, "cublasLtMatmulHeuristicResult_t");

static int live;
uint64_t mock_stream, mock_workspace, mock_algo0, mock_pref_workspace;
size_t mock_workspace_size;
int mock_live(void) { return live; }

static int make(void **out, int kind) {
    obj *o = calloc(1, sizeof *o);
    o->kind = kind;
    *out = o;
    live++;
    return 0;
}
static int drop(void *o) { free(o); live--; return 0; }
static int set(void *p, int attr, const void *buf, size_t n) {
    obj *o = p;
    /* the sizes cublasLt.h gives: desc 0-7 int32, 8 a pointer; layout 0,1,5 int32, 2,3,4,6 64-bit; pref 1 uint64 */
    static const int desc[] = {4, 4, 4, 4, 4, 4, 4, 4, 8}, layout[] = {4, 4, 8, 8, 8, 4, 8};
    int want = o->kind == 1 && attr < 9 ? desc[attr] : o->kind == 2 && attr < 7 ? layout[attr]
             : o->kind == 3 && attr == 1 ? 8 : 0;
    if (!buf || attr < 0 || attr >= 64 || n > 8 || (want && (size_t)want != n)) return 7;
    o->a[attr] = 0;
    memcpy(&o->a[attr], buf, n);
    return 0;
}

int cublasLtCreate(void **h) { return make(h, 0); }
int cublasLtDestroy(void *h) { return drop(h); }
int cublasLtMatmulDescCreate(void **d, int compute, int scale) {
    make(d, 1);
    ((obj *)*d)->a[0] = compute, ((obj *)*d)->a[1] = scale, ((obj *)*d)->a[7] = 1;
    return 0;
}
int cublasLtMatmulDescDestroy(void *d) { return drop(d); }
int cublasLtMatmulDescSetAttribute(void *d, int attr, const void *buf, size_t n) { return set(d, attr, buf, n); }
int cublasLtMatrixLayoutCreate(void **l, int type, uint64_t rows, uint64_t cols, int64_t ld) {
    make(l, 2);
    obj *o = *l;
    o->a[0] = type, o->a[2] = (int64_t)rows, o->a[3] = (int64_t)cols, o->a[4] = ld, o->a[5] = 1;
    return 0;
}
int cublasLtMatrixLayoutDestroy(void *l) { return drop(l); }
int cublasLtMatrixLayoutSetAttribute(void *l, int attr, const void *buf, size_t n) { return set(l, attr, buf, n); }
int cublasLtMatmulPreferenceCreate(void **p) { return make(p, 3); }
int cublasLtMatmulPreferenceDestroy(void *p) { return drop(p); }
int cublasLtMatmulPreferenceSetAttribute(void *p, int attr, const void *buf, size_t n) { return set(p, attr, buf, n); }

int cublasLtMatmulAlgoGetHeuristic(void *h, obj *desc, obj *A, obj *B, obj *C, obj *D, obj *pref, int n,
                                   result_t *out, int *count) {
    if (!h || !desc || !A || !B || !C || !D || n <= 0) return 7;
    mock_pref_workspace = pref ? (uint64_t)pref->a[1] : 0;
    memset(out, 0, sizeof *out);
    out->algo[0] = 0xA160, out->algo[1] = (uint64_t)D->a[2], out->waves = 1.0f;
    *count = 1;
    return 0;
}

static float at(const float *p, const obj *L, int b, int64_t i, int64_t j) {
    return p[b * (L->a[5] > 1 ? L->a[6] : 0) + i + j * L->a[4]];
}

int cublasLtMatmul(void *h, obj *desc, const float *alpha, const float *A, obj *ad, const float *B, obj *bd,
                   const float *beta, const float *C, obj *cd, float *D, obj *dd, const result_t *algo,
                   void *workspace, size_t workspace_size, void *stream) {
    if (!h || desc->a[1] != 0 || ad->a[0] != 0) return 15;          /* fp32 only */
    mock_stream = (uint64_t)(uintptr_t)stream, mock_workspace = (uint64_t)(uintptr_t)workspace;
    mock_workspace_size = workspace_size, mock_algo0 = algo ? algo->algo[0] : 0;
    int ta = (int)desc->a[3], tb = (int)desc->a[4];
    int64_t m = dd->a[2], n = dd->a[3], k = ta ? ad->a[2] : ad->a[3];
    const float *bias = (const float *)(uintptr_t)desc->a[8];
    float al = *alpha, be = desc->a[2] == 3 ? 0 : *beta;
    for (int b = 0; b < dd->a[5]; b++)
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = 0; j < n; j++) {
                float s = 0;
                for (int64_t l = 0; l < k; l++)
                    s += (ta ? at(A, ad, b, l, i) : at(A, ad, b, i, l)) * (tb ? at(B, bd, b, j, l) : at(B, bd, b, l, j));
                float v = al * s + (be != 0 ? be * at(C, cd, b, i, j) : 0);
                if ((desc->a[7] & 4) && bias) v += bias[i];
                D[b * (dd->a[5] > 1 ? dd->a[6] : 0) + i + j * dd->a[4]] = v;
            }
    return 0;
}
