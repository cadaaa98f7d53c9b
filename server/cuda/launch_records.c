/* The real driver's batch launcher: walks the interceptor's queued records and runs each (a ctypes call
 * costs more than the launch itself): launches, event records, stream waits, graph launches, copies,
 * and the math libraries' records in the same queue (libs/cublas_records.c and its siblings, built into the same library);
 * loaded by real_batch.py. */
#include <stdint.h>
#include <string.h>

#include "rgpu_protocol.h"  /* rgpu/protocol: the records' kinds and sizes (generated) */

#define HEAD RGPU_CUDA_LAUNCH_HEADER_BYTES
typedef int (*launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *,
                         void **, void **);
typedef int (*set_ctx_fn)(void *);
struct rgpu_cublas;
int rgpu_cublas_record(struct rgpu_cublas *t, uint32_t call, uint64_t client, uint64_t stream, const char *p, size_t len);
/* The driver's entry points a walk calls; a NULL one leaves its records to the executor (real_code.py fills
 * them from the driver it loaded; cuEventRecordWithFlags is absent from old drivers). */
struct rgpu_driver_ops {
    launch_fn launch;
    set_ctx_fn set_ctx;
    int (*event_record)(void *event, void *stream);
    int (*event_record_with_flags)(void *event, void *stream, unsigned flags);
    int (*stream_wait_event)(void *stream, void *event, unsigned flags);
    int (*graph_launch)(void *exec, void *stream);
    int (*memcpy_htod)(uint64_t dst, const void *src, size_t n);
    int (*memcpy_htod_async)(uint64_t dst, const void *src, size_t n, void *stream);
    int (*memcpy_dtod)(uint64_t dst, uint64_t src, size_t n);
    int (*memcpy_dtod_async)(uint64_t dst, uint64_t src, size_t n, void *stream);
};

#define PTR(v) ((void *)(uintptr_t)(v))

/* Whether this walk runs an event record, stream wait, graph launch or copy (OP header:
 * ctx, stream, a, b, c; decoded as records.py does): it has the entry point and the record is well formed.
 * Memsets and frees (their quota is the executor's) are left, and so is anything malformed. */
static int runs_here(const struct rgpu_driver_ops *ops, uint32_t kind, uint32_t size, const uint64_t h[5]) {
    uint64_t stream = h[1], b = h[3];
    switch (kind) {
    case RGPU_CUDA_REC_EVENT_RECORD: return b ? ops->event_record_with_flags != 0 : ops->event_record != 0;
    case RGPU_CUDA_REC_STREAM_WAIT: return ops->stream_wait_event != 0;
    case RGPU_CUDA_REC_GRAPH_LAUNCH: return ops->graph_launch != 0;
    case RGPU_CUDA_REC_MEMCPY_HTOD:
        if (b > RGPU_CUDA_QUEUED_COPY_BYTES || RGPU_CUDA_OP_HEADER_BYTES + b > size) return 0;
        return stream == RGPU_CUDA_NO_STREAM ? ops->memcpy_htod != 0 : ops->memcpy_htod_async != 0;
    case RGPU_CUDA_REC_MEMCPY_DTOD:
        return stream == RGPU_CUDA_NO_STREAM ? ops->memcpy_dtod != 0 : ops->memcpy_dtod_async != 0;
    default: return 0;
    }
}

/* Run one that runs_here accepted: its CUresult. */
static int queued_op(const struct rgpu_driver_ops *ops, uint32_t kind, const char *r, const uint64_t h[5]) {
    uint64_t stream = h[1], a = h[2], b = h[3], c = h[4];
    const char *bytes = r + RGPU_CUDA_OP_HEADER_BYTES;
    switch (kind) {
    case RGPU_CUDA_REC_EVENT_RECORD:
        return b ? ops->event_record_with_flags(PTR(a), PTR(stream), (unsigned)b) : ops->event_record(PTR(a), PTR(stream));
    case RGPU_CUDA_REC_STREAM_WAIT: return ops->stream_wait_event(PTR(stream), PTR(a), (unsigned)b);
    case RGPU_CUDA_REC_GRAPH_LAUNCH: return ops->graph_launch(PTR(a), PTR(stream));
    case RGPU_CUDA_REC_MEMCPY_DTOD:
        return stream == RGPU_CUDA_NO_STREAM ? ops->memcpy_dtod(a, b, c) : ops->memcpy_dtod_async(a, b, c, PTR(stream));
    default:                                /* RGPU_CUDA_REC_MEMCPY_HTOD */
        return stream == RGPU_CUDA_NO_STREAM ? ops->memcpy_htod(a, bytes, b)
                                             : ops->memcpy_htod_async(a, bytes, b, PTR(stream));
    }
}

/* The record's context made current when it is not already (*ctx): its CUresult. */
static int switch_to(const struct rgpu_driver_ops *ops, uint64_t want, uint64_t *ctx) {
    if (want == *ctx) return 0;
    int rc = ops->set_ctx(PTR(want));
    if (!rc) *ctx = want;
    return rc;
}

/* Walk records [pos, len) (layouts in rgpu/protocol/cuda.py: LAUNCH, OP) in order: launches with their
 * packed arguments passed through `extra`, the queued ops `ops` has entry points for, and the math
 * libraries' records through `cublas` (the session's table, or NULL).  Stops at the first record it leaves
 * or that fails: returns its CUresult and leaves *pos at that record (-1: malformed; -2: a kind or form
 * this walk leaves to the executor, or a math-library record the table did not run); returns 0 with
 * *pos == len when all ran.  *ctx is the current context, kept up to date. */
int rgpu_walk_all(const struct rgpu_driver_ops *ops, const char *rec, size_t len, size_t *pos, uint64_t *ctx,
                  struct rgpu_cublas *cublas) {
    size_t size_arg = 0;
    void *extra[5] = {(void *)1, 0, (void *)2, &size_arg, 0};
    while (*pos + RGPU_CUDA_RECORD_HEAD_BYTES <= len) {
        const char *r = rec + *pos;
        uint32_t size, kind, dims[8];
        uint64_t func, c, stream;
        memcpy(&size, r, 4);
        memcpy(&kind, r + 4, 4);
        if (kind == RGPU_CUDA_REC_LIB && cublas) {  /* OP header: ctx, stream, a = call, b = handle, c = bytes */
            uint64_t h[5];
            if (*pos + RGPU_CUDA_OP_HEADER_BYTES > len) return -1;
            memcpy(h, r + 8, 40);
            if (size < RGPU_CUDA_OP_HEADER_BYTES + h[4] || *pos + size > len) return -1;
            int rc = switch_to(ops, h[0], ctx);
            if (rc) return rc;
            if (rgpu_cublas_record(cublas, (uint32_t)h[2], h[3], h[1], r + RGPU_CUDA_OP_HEADER_BYTES, h[4]))
                return -2;                 /* not one it runs, or it failed: the executor runs it and explains */
            *pos += size;
            continue;
        }
        if (kind >= RGPU_CUDA_REC_MEMSET && kind != RGPU_CUDA_REC_LIB) {   /* OP header: ctx, stream, a, b, c */
            uint64_t h[5];
            /* a malformed one is the executor's too: it names the record's kind */
            if (*pos + RGPU_CUDA_OP_HEADER_BYTES > len || size < RGPU_CUDA_OP_HEADER_BYTES || size % 8 ||
                *pos + size > len)
                return -2;
            memcpy(h, r + 8, 40);
            if (!runs_here(ops, kind, size, h)) return -2;
            int rc = switch_to(ops, h[0], ctx);
            if (rc) return rc;
            rc = queued_op(ops, kind, r, h);
            if (rc) return rc;              /* the executor runs it again and names the failure */
            *pos += size;
            continue;
        }
        /* cuLaunchKernelEx (its attributes) is the executor's */
        if (kind != RGPU_CUDA_REC_LAUNCH) return -2;
        if (*pos + HEAD > len) return -1;
        memcpy(&func, r + 8, 8);
        memcpy(&c, r + 16, 8);
        memcpy(&stream, r + 24, 8);
        memcpy(dims, r + 32, 32);
        if (size < HEAD + dims[7] || *pos + size > len) return -1;
        int rc = switch_to(ops, c, ctx);
        if (rc) return rc;
        extra[1] = (void *)(r + HEAD);
        size_arg = dims[7];
        rc = ops->launch(PTR(func), dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6], PTR(stream),
                             0, dims[7] ? extra : 0);
        if (rc) return rc;
        *pos += size;
    }
    return 0;
}

/* The walk with only a launcher and a context switch (the records bench's stand-in): every other queued op
 * goes to the executor. */
int rgpu_walk_records(launch_fn launch, set_ctx_fn set_ctx, const char *rec, size_t len, size_t *pos,
                      uint64_t *ctx, struct rgpu_cublas *cublas) {
    struct rgpu_driver_ops ops = {.launch = launch, .set_ctx = set_ctx};
    return rgpu_walk_all(&ops, rec, len, pos, ctx, cublas);
}
