/* cuBLASLt's matmul records in C, run beside the launches and cuBLAS's GEMMs.
 *
 * A session's table (rgpu_cublaslt_t, made by cublaslt_real.py when cuBLAS's C table exists) owns two things:
 * the states it knows (a matmul's serialized descriptors -> the real descriptors Python made for them once,
 * the desc's pointer mode, its device-address attributes) and, per real matmul descriptor, the addresses last
 * set on it, so they are set only when they change.  Python parses a new state and hands it here; a record
 * whose state or handle this table does not know is left to Python (NOT_HERE), which resolves it and runs it
 * through here.  The handle is a cuBLAS one (torch's), looked up in cuBLAS's table at each call: that table
 * owns handles; a cublasLtCreate handle is Python's.  cublas_records.c hands it cublasLtMatmul records. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "rgpu_protocol.h"
#include "rgpu_protocol_libs.h"

#define NOT_HERE (-2)
#define MALFORMED (-1)
#define MAX_POINTERS 10  /* rgpu.protocol.lib_cublaslt.DESC_POINTERS: the attributes that are device addresses */
#define MAX_STATES 4096  /* cublaslt_real.MAX_KEPT: past it Python forgets them all */

typedef int (*set_attr_fn)(void *, int, const void *, size_t);
typedef int (*matmul_fn)(void *, void *, const void *, const void *, void *, const void *, void *, const void *,
                         const void *, void *, void *, void *, const void *, void *, size_t, void *);
struct rgpu_cublas;
uint64_t rgpu_cublas_real(struct rgpu_cublas *t, uint64_t client, int remove);

typedef struct {
    size_t n;
    int32_t attr[MAX_POINTERS];
    uint64_t value[MAX_POINTERS];
} pointers_t;

typedef struct {
    uint64_t hash;
    char *key;  /* the serialized state (a copy) */
    size_t len;
    uint64_t real[5];  /* desc, A, B, C, D layouts */
    int32_t mode;      /* the desc's cublasLtPointerMode_t */
    pointers_t pointers;
} state_t;

typedef struct {
    uint64_t desc;
    pointers_t set;
} desc_t;

typedef struct rgpu_cublaslt {
    matmul_fn matmul;
    set_attr_fn set_attr;
    state_t *s;
    size_t ns, scap;
    desc_t *d;
    size_t nd, dcap;
    uint64_t scalars[4];  /* host scalars, aligned: the library reads them during the call */
    uint64_t algo[8];      /* cublasLtMatmulAlgo_t, aligned */
} rgpu_cublaslt_t;

rgpu_cublaslt_t *rgpu_cublaslt_new(void *matmul, void *set_attr) {
    rgpu_cublaslt_t *t = calloc(1, sizeof *t);
    if (t) t->matmul = (matmul_fn)matmul, t->set_attr = (set_attr_fn)set_attr;
    return t;
}

/* Every state and every descriptor's last-set addresses forgotten (Python destroyed a descriptor). */
void rgpu_cublaslt_forget(rgpu_cublaslt_t *t) {
    for (size_t i = 0; i < t->ns; i++) free(t->s[i].key);
    t->ns = t->nd = 0;
}

void rgpu_cublaslt_free(rgpu_cublaslt_t *t) {
    if (!t) return;
    rgpu_cublaslt_forget(t);
    free(t->s);
    free(t->d);
    free(t);
}

size_t rgpu_cublaslt_states(rgpu_cublaslt_t *t) { return t->ns; }

/* FNV-1a over 8-byte words (a state is a few hundred bytes, hashed per record), then the tail's bytes */
static uint64_t fnv(const char *p, size_t n) {
    uint64_t h = 1469598103934665603ull, w;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        memcpy(&w, p + i, 8);
        h = (h ^ w) * 1099511628211ull;
    }
    for (; i < n; i++) h = (h ^ (uint8_t)p[i]) * 1099511628211ull;
    return h;
}

static state_t *find_state(rgpu_cublaslt_t *t, const char *key, size_t len) {
    uint64_t h = fnv(key, len);
    for (size_t i = 0; i < t->ns; i++)
        if (t->s[i].hash == h && t->s[i].len == len && !memcmp(t->s[i].key, key, len)) return &t->s[i];
    return 0;
}

static int grow(void **p, size_t *cap, size_t n, size_t size) {
    if (n < *cap) return 0;
    size_t c = *cap ? *cap * 2 : 16;
    void *q = realloc(*p, c * size);
    if (!q) return -1;
    *p = q, *cap = c;
    return 0;
}

/* A state Python resolved: its key (the serialized descriptors), real descriptors, pointer mode and its
 * desc's device-address attributes (one known already: kept as it is).  0, or -1: too many addresses, too many
 * states, or no memory. */
int rgpu_cublaslt_state(rgpu_cublaslt_t *t, const char *key, size_t len, const uint64_t real[5], int32_t mode,
                        size_t n, const int32_t *attr, const uint64_t *value) {
    if (n > MAX_POINTERS) return -1;
    if (find_state(t, key, len)) return 0;
    if (t->ns >= MAX_STATES || grow((void **)&t->s, &t->scap, t->ns, sizeof *t->s)) return -1;
    char *copy = malloc(len ? len : 1);
    if (!copy) return -1;
    memcpy(copy, key, len);
    state_t *s = &t->s[t->ns++];
    *s = (state_t){fnv(key, len), copy, len, {0}, mode, {n, {0}, {0}}};
    memcpy(s->real, real, sizeof s->real);
    memcpy(s->pointers.attr, attr, n * sizeof *attr);
    memcpy(s->pointers.value, value, n * sizeof *value);
    return 0;
}

/* Set a matmul descriptor's device addresses where they differ from the last set on it: 0 or a status. */
static int set_pointers(rgpu_cublaslt_t *t, uint64_t desc, const pointers_t *p) {
    if (!p->n) return 0;
    desc_t *d = 0;
    for (size_t i = 0; i < t->nd; i++)
        if (t->d[i].desc == desc) d = &t->d[i];
    if (d && d->set.n == p->n && !memcmp(d->set.attr, p->attr, p->n * sizeof *p->attr) &&
        !memcmp(d->set.value, p->value, p->n * sizeof *p->value))
        return 0;
    if (!d) {
        if (grow((void **)&t->d, &t->dcap, t->nd, sizeof *t->d)) return -1;
        d = &t->d[t->nd++];
        d->desc = desc;
    }
    d->set.n = 0; /* partly set on a failure: set again next time */
    for (size_t i = 0; i < p->n; i++) {
        int rc = t->set_attr((void *)(uintptr_t)desc, p->attr[i], &p->value[i], 8);
        if (rc) return rc;
    }
    d->set = *p;
    return 0;
}

/* The same for a call Python runs itself (the heuristic, a cublasLtCreate handle's matmul). */
int rgpu_cublaslt_pointers(rgpu_cublaslt_t *t, uint64_t desc, size_t n, const int32_t *attr, const uint64_t *value) {
    pointers_t p = {n, {0}, {0}};
    if (n > MAX_POINTERS) return -1;
    memcpy(p.attr, attr, n * sizeof *attr);
    memcpy(p.value, value, n * sizeof *value);
    return set_pointers(t, desc, &p);
}

/* Run one cublasLtMatmul record (the payload: rgpu_lib_cublasLtMatmul_t, then the serialized state): its
 * cublasStatus_t (0: done), NOT_HERE (no table, an unknown state, a handle not cuBLAS's) or MALFORMED. */
int rgpu_cublaslt_record(rgpu_cublaslt_t *t, struct rgpu_cublas *cublas, uint64_t client, uint64_t stream,
                         const char *p, size_t len) {
    const size_t fixed = sizeof(rgpu_lib_cublasLtMatmul_t);
    if (!t || !cublas) return NOT_HERE;
    if (len < fixed) return MALFORMED;
    state_t *s = find_state(t, p + fixed, len - fixed);
    uint64_t real = s ? rgpu_cublas_real(cublas, client, 0) : 0;
    if (!real) return NOT_HERE;
    const rgpu_lib_cublasLtMatmul_t *m = (const void *)p;
    int rc = set_pointers(t, s->real[0], &s->pointers);
    if (rc) return rc;
    /* cublasLtPointerMode_t: 0 both host; 1, 2 both device; 3 alpha device, beta unread; 4 alpha device,
     * beta host (as cublaslt_real.py's Python path) */
    memcpy(t->scalars, m->alpha, 16);
    memcpy(t->scalars + 2, m->beta, 16);
    const void *al = s->mode == 0 ? (const void *)t->scalars : (const void *)(uintptr_t)m->alpha_ptr;
    const void *be = (s->mode == 0 || s->mode == 4) ? (const void *)(t->scalars + 2)
                                                    : (const void *)(uintptr_t)m->beta_ptr;
    if (m->has_algo) memcpy(t->algo, m->algo, sizeof t->algo);
#define A_(x) ((void *)(uintptr_t)(x))
    return t->matmul(A_(real), A_(s->real[0]), al, A_(m->a), A_(s->real[1]), A_(m->b), A_(s->real[2]), be, A_(m->c),
                     A_(s->real[3]), A_(m->d), A_(s->real[4]), m->has_algo ? (const void *)t->algo : 0,
                     A_(m->workspace), (size_t)m->workspace_size, A_(stream == RGPU_CUDA_NO_STREAM ? 0 : stream));
#undef A_
}
