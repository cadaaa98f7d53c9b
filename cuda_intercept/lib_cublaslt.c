/* rgpu's cuBLASLt forwarders (rgpu/protocol/lib_cublaslt.py): the matmul queued, its heuristic answered once.
 *
 * Descriptors, layouts and preferences never leave this process: each is an attribute set (attr id,
 * bytes as the program set them, sizes checked as cuBLASLt checks them) and Get answers here.  A
 * heuristic query serializes the whole state and is answered from a cache keyed by that content (and
 * the handle); a miss is one answered call.  A matmul is one queued record carrying the state, the
 * host scalars by value (read now, as cuBLASLt reads them) and the pointers, which are the server's.
 * Handles pass through: torch hands its cuBLAS handle in; the server maps it (or one made here).
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lib_door.h"
#include "lib_types.h"
#include "stub.h"

enum { ST_OK = 0, ST_NOT_INITIALIZED = 1, ST_ALLOC_FAILED = 3, ST_INVALID_VALUE = 7, ST_EXECUTION_FAILED = 13,
       ST_NOT_SUPPORTED = 15 };
enum { KIND_NULL, KIND_DESC, KIND_LAYOUT, KIND_PREF };
enum { ALGO_BYTES = 64, RESULT_BYTES = 96 };     /* cublasLtMatmulAlgo_t, cublasLtMatmulHeuristicResult_t */
enum { MAX_ATTRS = 40, VAL_MAX = 16 };           /* every documented attribute is at most 8 bytes */
#define MAGIC 0x52474c54u                        /* "RGLT": a stray pointer is refused, not read */

typedef struct { uint32_t attr, size; uint8_t val[VAL_MAX]; } lt_attr;
typedef struct { uint32_t magic, kind, n; lt_attr a[MAX_ATTRS]; } lt_obj;

/* Documented attributes (cublasLt.h): their size and the default Get answers when never set.
 * A descriptor's pointer-valued ones are device addresses; keyed by alignment only (see key_attr). */
typedef struct { uint8_t kind, attr, size, pointer; uint64_t def; } lt_known;
static const lt_known KNOWN[] = {
    {KIND_DESC, 0, 4, 0, 0}, {KIND_DESC, 1, 4, 0, 0}, {KIND_DESC, 2, 4, 0, 0}, {KIND_DESC, 3, 4, 0, 0},
    {KIND_DESC, 4, 4, 0, 0}, {KIND_DESC, 5, 4, 0, 0}, {KIND_DESC, 6, 4, 0, 2}, {KIND_DESC, 7, 4, 0, 1},
    {KIND_DESC, 8, 8, 1, 0}, {KIND_DESC, 10, 8, 0, 0}, {KIND_DESC, 11, 8, 1, 0}, {KIND_DESC, 12, 8, 0, 0},
    {KIND_DESC, 13, 8, 0, 0}, {KIND_DESC, 14, 8, 0, 0}, {KIND_DESC, 15, 4, 0, 0}, {KIND_DESC, 17, 8, 1, 0},
    {KIND_DESC, 18, 8, 1, 0}, {KIND_DESC, 19, 8, 1, 0}, {KIND_DESC, 20, 8, 1, 0}, {KIND_DESC, 21, 8, 1, 0},
    {KIND_DESC, 22, 4, 0, (uint32_t)-1}, {KIND_DESC, 23, 8, 1, 0}, {KIND_DESC, 24, 8, 1, 0},
    {KIND_DESC, 25, 1, 0, 0}, {KIND_DESC, 26, 4, 0, (uint32_t)-1}, {KIND_DESC, 31, 4, 0, 0},
    {KIND_DESC, 32, 4, 0, 0}, {KIND_DESC, 33, 4, 0, 0}, {KIND_DESC, 34, 4, 0, 0}, {KIND_DESC, 35, 4, 0, 0},
    {KIND_DESC, 36, 8, 1, 0}, {KIND_DESC, 37, 4, 0, 0}, {KIND_DESC, 39, 8, 0, 0}, {KIND_DESC, 40, 8, 0, 0},
    {KIND_DESC, 41, 4, 0, 0x8000},
    {KIND_LAYOUT, 0, 4, 0, 0}, {KIND_LAYOUT, 1, 4, 0, 0}, {KIND_LAYOUT, 2, 8, 0, 0}, {KIND_LAYOUT, 3, 8, 0, 0},
    {KIND_LAYOUT, 4, 8, 0, 0}, {KIND_LAYOUT, 5, 4, 0, 1}, {KIND_LAYOUT, 6, 8, 0, 0}, {KIND_LAYOUT, 7, 8, 0, 0},
    {KIND_LAYOUT, 8, 4, 0, 0}, {KIND_LAYOUT, 9, 8, 0, 0}, {KIND_LAYOUT, 10, 8, 0, 0}, {KIND_LAYOUT, 11, 8, 0, 0},
    {KIND_LAYOUT, 12, 4, 0, 0}, {KIND_LAYOUT, 13, 4, 0, 0},
    {KIND_PREF, 0, 4, 0, 0}, {KIND_PREF, 1, 8, 0, 0}, {KIND_PREF, 3, 4, 0, 7}, {KIND_PREF, 5, 4, 0, 256},
    {KIND_PREF, 6, 4, 0, 256}, {KIND_PREF, 7, 4, 0, 256}, {KIND_PREF, 8, 4, 0, 256}, {KIND_PREF, 9, 4, 0, 0},
    {KIND_PREF, 12, 8, 0, ~(uint64_t)0},
    /* the grouped averages: uint32_t by the header, 8 bytes by the library (13.10's Get says so) */
    {KIND_PREF, 13, 8, 0, 0}, {KIND_PREF, 14, 8, 0, 0}, {KIND_PREF, 15, 8, 0, 0},
};
#define DESC_EMULATION_DESCRIPTOR 38              /* a client-side object: nothing the server could use */

static const lt_known *known(uint32_t kind, uint32_t attr) {
    for (size_t i = 0; i < sizeof KNOWN / sizeof *KNOWN; i++)
        if (KNOWN[i].kind == kind && KNOWN[i].attr == attr) return &KNOWN[i];
    return NULL;
}

static lt_obj *obj_of(void *p, uint32_t kind) {
    lt_obj *o = p;
    return o && o->magic == MAGIC && o->kind == kind ? o : NULL;
}

static lt_attr *find(lt_obj *o, uint32_t attr) {
    for (uint32_t i = 0; i < o->n; i++)
        if (o->a[i].attr == attr) return &o->a[i];
    return NULL;
}

/* Set an attribute, keeping them in attr order so equal contents serialize equally. */
static int set_attr(lt_obj *o, uint32_t attr, const void *buf, size_t size) {
    const lt_known *k = known(o->kind, attr);
    if (!buf || !size || size > VAL_MAX || (k && k->size != size)) return ST_INVALID_VALUE;
    if (o->kind == KIND_DESC && attr == DESC_EMULATION_DESCRIPTOR) {
        static int said;
        return rgpu_stub_refuse("CUBLASLT_MATMUL_DESC_EMULATION_DESCRIPTOR", RGPU_LIB, &said, ST_NOT_SUPPORTED);
    }
    lt_attr *a = find(o, attr);
    if (!a) {
        uint32_t i = o->n;
        if (o->n == MAX_ATTRS) return ST_ALLOC_FAILED;
        while (i && o->a[i - 1].attr > attr) { o->a[i] = o->a[i - 1]; i--; }
        a = &o->a[i];
        o->n++;
    }
    a->attr = attr;
    a->size = (uint32_t)size;
    memcpy(a->val, buf, size);
    return ST_OK;
}

/* cuBLASLt's Get contract: size 0 asks the size; otherwise the size must match. */
static int get_attr(lt_obj *o, uint32_t attr, void *buf, size_t size, size_t *written) {
    lt_attr *a = find(o, attr);
    const lt_known *k = known(o->kind, attr);
    uint64_t def = k ? k->def : 0;
    size_t have = a ? a->size : k ? k->size : 0;
    if (!have || (!size && !written) || (size && (!buf || size != have))) return ST_INVALID_VALUE;
    if (written) *written = have;
    if (size) memcpy(buf, a ? (const void *)a->val : (const void *)&def, have);
    return ST_OK;
}

static uint64_t u64_of(const lt_obj *o, uint32_t attr, uint64_t def) {
    for (uint32_t i = 0; i < o->n; i++)
        if (o->a[i].attr == attr) {
            uint64_t v = 0;
            memcpy(&v, o->a[i].val, o->a[i].size < 8 ? o->a[i].size : 8);
            return v;
        }
    return def;
}

static int create(void **out, uint32_t kind) {
    if (!out) return ST_INVALID_VALUE;
    lt_obj *o = calloc(1, sizeof *o);
    if (!o) return ST_ALLOC_FAILED;
    o->magic = MAGIC;
    o->kind = kind;
    *out = o;
    return ST_OK;
}

static int destroy(void *p, uint32_t kind) {
    lt_obj *o = p;
    if (!o) return ST_OK;
    if (!obj_of(o, kind)) return ST_INVALID_VALUE;
    o->magic = 0;
    free(o);
    return ST_OK;
}

/* ---- the descriptors: local ------------------------------------------------------------------ */
RGPU_API int cublasLtMatmulDescCreate(void **desc, int32_t compute_type, int32_t scale_type) {
    int st = create(desc, KIND_DESC);
    if (st) return st;
    set_attr(*desc, 0, &compute_type, 4);
    set_attr(*desc, 1, &scale_type, 4);
    return ST_OK;
}
RGPU_API int cublasLtMatmulDescDestroy(void *desc) { return destroy(desc, KIND_DESC); }
RGPU_API int cublasLtMatmulDescSetAttribute(void *desc, int attr, const void *buf, size_t size) {
    lt_obj *o = obj_of(desc, KIND_DESC);
    return o ? set_attr(o, (uint32_t)attr, buf, size) : ST_INVALID_VALUE;
}
RGPU_API int cublasLtMatmulDescGetAttribute(void *desc, int attr, void *buf, size_t size, size_t *written) {
    lt_obj *o = obj_of(desc, KIND_DESC);
    return o ? get_attr(o, (uint32_t)attr, buf, size, written) : ST_INVALID_VALUE;
}

RGPU_API int cublasLtMatrixLayoutCreate(void **layout, uint32_t type, uint64_t rows, uint64_t cols, int64_t ld) {
    int st = create(layout, KIND_LAYOUT);
    if (st) return st;
    set_attr(*layout, 0, &type, 4);
    set_attr(*layout, 2, &rows, 8);
    set_attr(*layout, 3, &cols, 8);
    set_attr(*layout, 4, &ld, 8);
    return ST_OK;
}
RGPU_API int cublasLtMatrixLayoutDestroy(void *layout) { return destroy(layout, KIND_LAYOUT); }
RGPU_API int cublasLtMatrixLayoutSetAttribute(void *layout, int attr, const void *buf, size_t size) {
    lt_obj *o = obj_of(layout, KIND_LAYOUT);
    return o ? set_attr(o, (uint32_t)attr, buf, size) : ST_INVALID_VALUE;
}
RGPU_API int cublasLtMatrixLayoutGetAttribute(void *layout, int attr, void *buf, size_t size, size_t *written) {
    lt_obj *o = obj_of(layout, KIND_LAYOUT);
    return o ? get_attr(o, (uint32_t)attr, buf, size, written) : ST_INVALID_VALUE;
}

RGPU_API int cublasLtMatmulPreferenceCreate(void **pref) { return create(pref, KIND_PREF); }
RGPU_API int cublasLtMatmulPreferenceDestroy(void *pref) { return destroy(pref, KIND_PREF); }
RGPU_API int cublasLtMatmulPreferenceSetAttribute(void *pref, int attr, const void *buf, size_t size) {
    lt_obj *o = obj_of(pref, KIND_PREF);
    return o ? set_attr(o, (uint32_t)attr, buf, size) : ST_INVALID_VALUE;
}
RGPU_API int cublasLtMatmulPreferenceGetAttribute(void *pref, int attr, void *buf, size_t size, size_t *written) {
    lt_obj *o = obj_of(pref, KIND_PREF);
    return o ? get_attr(o, (uint32_t)attr, buf, size, written) : ST_INVALID_VALUE;
}

/* ---- serialization (the protocol module's STATE) ----------------------------------------------- */
enum { STATE_MAX = 6 * (8 + MAX_ATTRS * (8 + VAL_MAX)) };

static void put32(uint8_t **p, uint32_t v) { memcpy(*p, &v, 4); *p += 4; }

/* A pointer attribute in a cache key: its alignment class (what the heuristic reads of it), not its value,
 * so every layer's bias finds the same answer. */
static uint64_t key_pointer(uint64_t ptr) {
    if (!ptr) return 0;
    uint64_t align = 1;
    while (align < 256 && !(ptr & align)) align <<= 1;
    return align;
}

/* Append object `o` (NULL: a NULL object); `key`: pointer attributes reduced to their alignment. */
static void serialize(uint8_t **p, const lt_obj *o, int key) {
    uint8_t *start;
    put32(p, o ? o->kind : KIND_NULL);
    start = *p;
    put32(p, 0);
    if (!o) return;
    for (uint32_t i = 0; i < o->n; i++) {
        const lt_attr *a = &o->a[i];
        const lt_known *k = key ? known(o->kind, a->attr) : NULL;
        put32(p, a->attr);
        put32(p, a->size);
        if (k && k->pointer) {
            uint64_t v;
            memcpy(&v, a->val, 8);
            v = key_pointer(v);
            memcpy(*p, &v, 8);
        } else {
            memcpy(*p, a->val, a->size);
        }
        *p += a->size;
    }
    uint32_t n = (uint32_t)(*p - start - 4);
    memcpy(start, &n, 4);
}

/* ---- the heuristic cache: content -> the server's answer ------------------------------------ */
typedef struct entry { struct entry *next; uint64_t hash; size_t klen; int count; uint8_t *key, *results; } entry;
enum { BUCKETS = 1024, MAX_ENTRIES = 8192 };
static entry *buckets[BUCKETS];
static size_t entries;
static pthread_mutex_t cache_lock = PTHREAD_MUTEX_INITIALIZER;

static uint64_t fnv(const uint8_t *p, size_t n) {
    uint64_t h = 1469598103934665603ull;
    while (n--) h = (h ^ *p++) * 1099511628211ull;
    return h;
}

static int cache_get(const uint8_t *key, size_t klen, uint64_t h, void *results, int *count) {
    int hit = 0;
    pthread_mutex_lock(&cache_lock);
    for (entry *e = buckets[h % BUCKETS]; e; e = e->next)
        if (e->hash == h && e->klen == klen && !memcmp(e->key, key, klen)) {
            memcpy(results, e->results, (size_t)e->count * RESULT_BYTES);
            *count = e->count;
            hit = 1;
            break;
        }
    pthread_mutex_unlock(&cache_lock);
    return hit;
}

static void cache_put(const uint8_t *key, size_t klen, uint64_t h, const void *results, int count) {
    entry *e = malloc(sizeof *e);
    if (!e) return;
    e->key = malloc(klen);
    e->results = malloc((size_t)count * RESULT_BYTES + 1);
    if (!e->key || !e->results) { free(e->key); free(e->results); free(e); return; }
    memcpy(e->key, key, klen);
    memcpy(e->results, results, (size_t)count * RESULT_BYTES);
    e->hash = h, e->klen = klen, e->count = count;
    pthread_mutex_lock(&cache_lock);
    if (entries < MAX_ENTRIES) {         /* full: answered by the server from then on, still right */
        e->next = buckets[h % BUCKETS];
        buckets[h % BUCKETS] = e;
        entries++;
        e = NULL;
    }
    pthread_mutex_unlock(&cache_lock);
    if (e) { free(e->key); free(e->results); free(e); }
}

/* ---- the forwarded calls --------------------------------------------------------------------- */
RGPU_API int cublasLtCreate(void **handle) {
    if (!handle) return ST_INVALID_VALUE;
    uint64_t h = rgpu_door_mint();
    rgpu_lib_cublasLtCreate_t p = {.client_version = RGPU_VERSION_MAJOR * 10000 + RGPU_VERSION_MINOR * 100};
    int st = rgpu_door_call(RGPU_LIB_cublasLtCreate, 0, h, &p, sizeof p, NULL, 0, NULL, ST_NOT_INITIALIZED);
    if (!st) *handle = (void *)(uintptr_t)h;
    return st;
}

RGPU_API int cublasLtDestroy(void *handle) {
    rgpu_lib_cublasLtDestroy_t p = {0};
    if (!handle) return ST_NOT_INITIALIZED;
    /* succeeds when the route is gone (a destructor after exit): the session's end frees the real handle */
    return rgpu_door_queue(RGPU_LIB_cublasLtDestroy, 0, (uint64_t)(uintptr_t)handle, &p, sizeof p, ST_OK);
}

RGPU_API int cublasLtMatmulAlgoGetHeuristic(void *handle, void *desc, void *a, void *b, void *c, void *d, void *pref,
                                            int requested, void *results, int *returned) {
    lt_obj *o[6] = {obj_of(desc, KIND_DESC), obj_of(a, KIND_LAYOUT), obj_of(b, KIND_LAYOUT), obj_of(c, KIND_LAYOUT),
                    obj_of(d, KIND_LAYOUT), obj_of(pref, KIND_PREF)};
    if (!handle) return ST_NOT_INITIALIZED;
    if (requested <= 0 || !results || !returned || !o[0] || !o[1] || !o[2] || !o[3] || !o[4]) return ST_INVALID_VALUE;
    if (pref && !o[5]) return ST_INVALID_VALUE;
    uint64_t hv = (uint64_t)(uintptr_t)handle;
    rgpu_lib_cublasLtMatmulAlgoGetHeuristic_t fixed = {.requested = requested};
    uint8_t key[8 + sizeof fixed + STATE_MAX], state[sizeof fixed + STATE_MAX], *k = key, *s = state;
    memcpy(k, &hv, 8), k += 8;
    memcpy(k, &fixed, sizeof fixed), k += sizeof fixed;
    memcpy(s, &fixed, sizeof fixed), s += sizeof fixed;
    for (int i = 0; i < 6; i++) {
        serialize(&k, o[i], 1);
        serialize(&s, o[i], 0);
    }
    uint64_t h = fnv(key, (size_t)(k - key));
    int count = 0;
    if (cache_get(key, (size_t)(k - key), h, results, &count)) {
        *returned = count;
        return ST_OK;
    }
    size_t got = 0;
    int st = rgpu_door_call(RGPU_LIB_cublasLtMatmulAlgoGetHeuristic, 0, hv, state, (size_t)(s - state), results,
                            (size_t)requested * RESULT_BYTES, &got, ST_NOT_INITIALIZED);
    count = (int)(got / RESULT_BYTES);
    if (count > requested) count = requested;
    *returned = st ? 0 : count;
    if (!st && count) cache_put(key, (size_t)(k - key), h, results, count);
    return st;
}

RGPU_API int cublasLtMatmul(void *handle, void *desc, const void *alpha, const void *A, void *adesc, const void *B,
                            void *bdesc, const void *beta, const void *C, void *cdesc, void *D, void *ddesc,
                            const void *algo, void *workspace, size_t workspace_size, void *stream) {
    lt_obj *o[5] = {obj_of(desc, KIND_DESC), obj_of(adesc, KIND_LAYOUT), obj_of(bdesc, KIND_LAYOUT),
                    obj_of(cdesc, KIND_LAYOUT), obj_of(ddesc, KIND_LAYOUT)};
    if (!handle) return ST_NOT_INITIALIZED;
    if (!o[0] || !o[1] || !o[2] || !o[3] || !o[4]) return ST_INVALID_VALUE;
    uint64_t mode = u64_of(o[0], 2, 0), width = rgpu_data_type_width((int32_t)u64_of(o[0], 1, 0));
    if (!width) {
        static int said;
        return rgpu_stub_refuse("cublasLtMatmul with this scale type", RGPU_LIB, &said, ST_NOT_SUPPORTED);
    }
    /* pointer mode (cublasLtPointerMode_t): 0 both host; 1, 2 both device; 3 alpha device, beta unread;
     * 4 alpha device, beta host */
    int alpha_host = mode == 0, beta_host = mode == 0 || mode == 4;
    if (mode > 4 || !alpha || (!beta && mode != 3)) return ST_INVALID_VALUE;
    struct { rgpu_lib_cublasLtMatmul_t f; uint8_t state[STATE_MAX]; } p;
    memset(&p.f, 0, sizeof p.f);
    if (alpha_host) memcpy(p.f.alpha, alpha, width);
    else p.f.alpha_ptr = (uint64_t)(uintptr_t)alpha;
    if (beta_host) memcpy(p.f.beta, beta, width);
    else p.f.beta_ptr = (uint64_t)(uintptr_t)beta;
    p.f.a = (uint64_t)(uintptr_t)A, p.f.b = (uint64_t)(uintptr_t)B;
    p.f.c = (uint64_t)(uintptr_t)C, p.f.d = (uint64_t)(uintptr_t)D;
    p.f.workspace = (uint64_t)(uintptr_t)workspace, p.f.workspace_size = workspace_size;
    if (algo) memcpy(p.f.algo, algo, ALGO_BYTES), p.f.has_algo = 1;
    uint8_t *s = p.state;
    for (int i = 0; i < 5; i++) serialize(&s, o[i], 0);
    return rgpu_door_queue(RGPU_LIB_cublasLtMatmul, (uint64_t)(uintptr_t)stream, (uint64_t)(uintptr_t)handle, &p,
                           sizeof p.f + (size_t)(s - p.state), ST_EXECUTION_FAILED);
}
