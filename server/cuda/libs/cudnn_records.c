/* cuDNN's execute records in C, run beside the launches and cuBLAS's GEMMs: the common case, a finalized plan
 * whose tensors all live on the device, run on a variant pack of this session.
 *
 * A session's table (rgpu_cudnn_t, made by cudnn_real.py) holds the client ids it may run with: the handles
 * (each with the stream last set on it: the table owns that, Python sets streams through it), the variant packs
 * and the plans Python found plain (no by-value tensors), each with its real object.  Python owns their lives
 * and tells this table of each creation and destruction (and unmarks a plan it changes); a record naming
 * anything else, or carrying by-value bytes, is left to Python (NOT_HERE).  cublas_records.c hands it the
 * cudnnBackendExecute records it walks. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "rgpu_protocol.h"
#include "rgpu_protocol_libs.h"

#define NOT_HERE (-2)
#define MALFORMED (-1)

typedef int (*execute_fn)(void *, void *, void *);
typedef int (*set_stream_fn)(void *, void *);

enum { HANDLE, PACK, PLAN, NKINDS };  /* what a client id names (rgpu_cudnn_add's kind) */

typedef struct {
    uint64_t client, real, stream;  /* stream: a handle's, as last set */
} entry_t;

typedef struct {
    entry_t *e;
    size_t n, cap;
} list_t;

typedef struct rgpu_cudnn {
    execute_fn execute;
    set_stream_fn set_stream;
    list_t kind[NKINDS];
} rgpu_cudnn_t;

rgpu_cudnn_t *rgpu_cudnn_new(void *execute, void *set_stream) {
    rgpu_cudnn_t *t = calloc(1, sizeof *t);
    if (t) t->execute = (execute_fn)execute, t->set_stream = (set_stream_fn)set_stream;
    return t;
}

void rgpu_cudnn_free(rgpu_cudnn_t *t) {
    if (!t) return;
    for (int k = 0; k < NKINDS; k++) free(t->kind[k].e);
    free(t);
}

static entry_t *find(list_t *l, uint64_t client) {
    for (size_t i = 0; i < l->n; i++)
        if (l->e[i].client == client) return &l->e[i];
    return 0;
}

/* A client id of `kind` over its real object (a handle's stream: the default).  0, or -1: a bad kind, or no
 * memory.  One known already keeps its stream and takes the real object given. */
int rgpu_cudnn_add(rgpu_cudnn_t *t, int kind, uint64_t client, uint64_t real) {
    if (kind < 0 || kind >= NKINDS) return -1;
    list_t *l = &t->kind[kind];
    entry_t *e = find(l, client);
    if (e) {
        e->real = real;
        return 0;
    }
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 16;
        entry_t *p = realloc(l->e, cap * sizeof *p);
        if (!p) return -1;
        l->e = p, l->cap = cap;
    }
    l->e[l->n++] = (entry_t){client, real, 0};
    return 0;
}

/* A client id of `kind` forgotten (destroyed, or a plan changed); nothing when it was not known. */
void rgpu_cudnn_remove(rgpu_cudnn_t *t, int kind, uint64_t client) {
    if (kind < 0 || kind >= NKINDS) return;
    list_t *l = &t->kind[kind];
    entry_t *e = find(l, client);
    if (e) *e = l->e[--l->n];
}

size_t rgpu_cudnn_count(rgpu_cudnn_t *t, int kind) { return kind >= 0 && kind < NKINDS ? t->kind[kind].n : 0; }

/* Bring a handle to `stream` (set only when it changed): 0, cudnnSetStream's status, or NOT_HERE (unknown). */
static int use(rgpu_cudnn_t *t, entry_t *h, uint64_t stream) {
    if (h->stream == stream) return 0;
    int rc = t->set_stream((void *)(uintptr_t)h->real, (void *)(uintptr_t)stream);
    if (!rc) h->stream = stream;
    return rc;
}

int rgpu_cudnn_stream(rgpu_cudnn_t *t, uint64_t client, uint64_t stream) {
    entry_t *h = find(&t->kind[HANDLE], client);
    return h ? use(t, h, stream == RGPU_CUDA_NO_STREAM ? 0 : stream) : NOT_HERE;
}

/* Run one cudnnBackendExecute record: its cudnnStatus_t (0: done), NOT_HERE (no table, by-value bytes, a
 * handle, plan or pack it does not hold) or MALFORMED (a payload shorter than the call's fixed part). */
int rgpu_cudnn_record(rgpu_cudnn_t *t, uint64_t client, uint64_t stream, const char *p, size_t len) {
    const rgpu_lib_cudnnBackendExecute_t *x = (const void *)p;
    if (!t) return NOT_HERE;
    if (len < sizeof *x) return MALFORMED;
    if (len > sizeof *x) return NOT_HERE; /* by-value tensors' bytes: Python rebuilds the pack */
    entry_t *h = find(&t->kind[HANDLE], client), *plan = find(&t->kind[PLAN], x->plan),
            *pack = find(&t->kind[PACK], x->pack);
    if (!h || !plan || !pack) return NOT_HERE;
    int rc = use(t, h, stream == RGPU_CUDA_NO_STREAM ? 0 : stream);
    if (rc) return rc;
    return t->execute((void *)(uintptr_t)h->real, (void *)(uintptr_t)plan->real, (void *)(uintptr_t)pack->real);
}
