/* rgpu's libcudnn.so.9 alone, with this program as its door: rgpu_lib_queue / rgpu_lib_call are defined
 * here (exported with -rdynamic; lib_door.c finds them by name), so what the library sends is recorded
 * and what it asks is answered from canned replies.  Checks the client side: Gets answered from a
 * Finalize's reply without a call, descriptors sent as their ids, a by-value tensor's host bytes
 * carried in the Execute record.  Prints "label v v v" lines for the test. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

int cudnnCreate(void **);
int cudnnBackendCreateDescriptor(int, void **);
int cudnnBackendSetAttribute(void *, int, int, int64_t, const void *);
int cudnnBackendGetAttribute(void *, int, int, int64_t, int64_t *, void *);
int cudnnBackendFinalize(void *);
int cudnnBackendExecute(void *, void *, void *);
int cudnnCreateTensorDescriptor(void **);
int cudnnSetTensorNdDescriptor(void *, int, int, const int *, const int *);
int cudnnGetBatchNormalizationTrainingExReserveSpaceSize(void *, int, int, void *, void *, size_t *);

static int calls, queued;
static uint32_t last_id;
static uint64_t last_handle, last_stream;
static uint8_t last[256];
static size_t last_n;
static int64_t last_requested = -1;

static void put(uint8_t **p, int32_t name, int32_t type, int64_t count, const void *data, int64_t n) {
    int32_t head[2] = {name, type};
    memcpy(*p, head, 8), memcpy(*p + 8, &count, 8), memcpy(*p + 16, &n, 8);
    if (n) memcpy(*p + 24, data, n);
    *p += 24 + n;
}

int rgpu_lib_queue(uint32_t id, uint64_t stream, uint64_t handle, const void *payload, size_t n) {
    queued++;
    last_id = id, last_stream = stream, last_handle = handle, last_n = n < sizeof last ? n : sizeof last;
    memcpy(last, payload, last_n);
    return 0;
}

int rgpu_lib_call(uint32_t id, uint64_t stream, uint64_t handle, const void *payload, size_t n, void *out, size_t cap,
                  int64_t *status, size_t *got) {
    uint8_t reply[256], *p = reply;
    calls++;
    if (id == 0x307) {                    /* a plan's Finalize: its workspace, its config (a count), a by-value scale */
        int64_t ws = 4096, pairs[2] = {9, 4};
        put(&p, 402, 3, 1, &ws, 8);
        put(&p, 401, 15 | 1 << 16, 1, NULL, 0);
        put(&p, -1, 3, 2, pairs, 16);
        int64_t three[3] = {11, 12, 13};
        put(&p, 403, 3, 3, three, 24);
    }
    if (id == 0x305) {                    /* a Get the client could not answer: 5 int32 sevens, as many as asked */
        int64_t requested, total = 5;
        memcpy(&requested, (const uint8_t *)payload + 8, 8);
        last_requested = requested;
        memcpy(p, &total, 8), p += 8;
        for (int64_t i = 0; i < requested && i < total; i++) { int32_t seven = 7; memcpy(p, &seven, 4), p += 4; }
    }
    if (id == 0x30f) {                    /* a BN reserve size: 100 + the payload's mode */
        uint64_t size = 100 + *(const int32_t *)payload;
        memcpy(p, &size, 8), p += 8;
    }
    *status = 0;
    *got = p - reply;
    if (out) memcpy(out, reply, *got < cap ? *got : cap);
    return 0;
}

int main(void) {
    void *h, *plan, *plan2, *pack;
    int64_t n = -1, ws = 0;
    cudnnCreate(&h);
    printf("create_calls %d\n", calls);
    cudnnBackendCreateDescriptor(5, &plan);
    uint64_t plan_id = last_handle;
    cudnnBackendFinalize(plan);
    int before = calls;
    cudnnBackendGetAttribute(plan, 402, 3, 1, &n, &ws);
    printf("workspace %lld %lld\n", (long long)n, (long long)ws);
    cudnnBackendGetAttribute(plan, 401, 15, 0, &n, NULL);
    printf("config_count %lld\n", (long long)n);
    printf("answered_here %d\n", calls == before);
    /* cuDNN's counts: no array is a count query whatever is requested; with one, what was written */
    int64_t got[4] = {0, 0, -5, 0}, c1 = -1, c2 = -1, c3 = -1;
    int s1 = cudnnBackendGetAttribute(plan, 403, 3, 44, &c1, NULL);
    int s2 = cudnnBackendGetAttribute(plan, 403, 3, 2, &c2, got);
    int s3 = cudnnBackendGetAttribute(plan, 403, 3, 0, &c3, got);
    int s4 = cudnnBackendGetAttribute(plan, 402, 3, 1, NULL, &ws);
    printf("counts %d %lld %d %lld %lld %lld %lld %d %lld %d %d\n", s1, (long long)c1, s2, (long long)c2,
           (long long)got[0], (long long)got[1], (long long)got[2], s3, (long long)c3, s4, calls == before);
    int32_t notes[10] = {0};
    c1 = c2 = -1;
    s1 = cudnnBackendGetAttribute(plan, 1303, 11, 10, &c1, NULL);
    long long sent1 = last_requested;
    s2 = cudnnBackendGetAttribute(plan, 1303, 11, 3, &c2, notes);
    printf("asked %d %lld %lld %d %lld %lld %d %d\n", s1, (long long)c1, sent1, s2, (long long)c2,
           (long long)last_requested, notes[2], notes[3]);
    cudnnBackendCreateDescriptor(5, &plan2);
    cudnnBackendSetAttribute(plan2, 401, 15, 1, &plan);        /* a descriptor element travels as its id */
    uint64_t sent;
    memcpy(&sent, last + 16, 8);
    printf("desc_as_id %d\n", sent == plan_id);
    cudnnBackendCreateDescriptor(16, &pack);
    int64_t uids[2] = {3, 9};
    float scale = 0.125f;
    void *ptrs[2] = {(void *)0x7f0000001000, &scale};
    cudnnBackendSetAttribute(pack, 1000, 3, 2, uids);
    cudnnBackendSetAttribute(pack, 1001, 6, 2, ptrs);
    before = calls;
    cudnnBackendFinalize(pack);
    printf("pack_finalize_queued %d %x\n", calls == before, last_id);
    scale = 0.125f;
    cudnnBackendExecute(h, plan, pack);
    int64_t uid, bytes;
    float value;
    memcpy(&uid, last + 16, 8), memcpy(&bytes, last + 24, 8), memcpy(&value, last + 32, 4);
    printf("execute %x %zu %lld %lld %g\n", last_id, last_n, (long long)uid, (long long)bytes, value);
    void *bad[2] = {(void *)0x7f0000001000, (void *)0x10};      /* uid 9's "host" value unmapped: refused */
    cudnnBackendSetAttribute(pack, 1001, 6, 2, bad);
    int before_q = queued;
    printf("unreadable %d %d\n", cudnnBackendExecute(h, plan, pack), queued - before_q);
    printf("calls %d queued %d\n", calls, queued - 1);          /* less the SetAttribute just above */
    /* a HANDLE attribute set on a descriptor is answered here */
    void *back = NULL;
    before = calls;
    cudnnBackendSetAttribute(plan2, 400, 0, 1, &h);
    cudnnBackendGetAttribute(plan2, 400, 0, 1, &n, &back);
    printf("handle_here %d %d\n", back == h && n == 1, calls == before);
    /* a BN size: asked once per contents, whatever descriptors carry them */
    void *x1, *x2, *x3;
    int dims[4] = {2, 3, 4, 5}, strides[4] = {60, 20, 5, 1}, other[4] = {2, 3, 4, 6};
    cudnnCreateTensorDescriptor(&x1), cudnnCreateTensorDescriptor(&x2), cudnnCreateTensorDescriptor(&x3);
    cudnnSetTensorNdDescriptor(x1, 0, 4, dims, strides);
    cudnnSetTensorNdDescriptor(x2, 0, 4, dims, strides);
    cudnnSetTensorNdDescriptor(x3, 0, 4, other, strides);
    size_t s[4] = {0};
    before = calls;
    cudnnGetBatchNormalizationTrainingExReserveSpaceSize(h, 1, 0, NULL, x1, &s[0]);
    cudnnGetBatchNormalizationTrainingExReserveSpaceSize(h, 1, 0, NULL, x2, &s[1]);
    cudnnGetBatchNormalizationTrainingExReserveSpaceSize(h, 1, 0, NULL, x3, &s[2]);
    cudnnGetBatchNormalizationTrainingExReserveSpaceSize(h, 2, 0, NULL, x1, &s[3]);
    printf("sizes %zu %zu %zu %zu asked %d\n", s[0], s[1], s[2], s[3], calls - before);
    return 0;
}
