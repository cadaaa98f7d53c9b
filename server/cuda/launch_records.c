/* The real driver's batch launcher: walks the interceptor's launch records and launches each
 * (a ctypes call costs more than the launch itself), and cuBLAS's GEMM records in the same queue
 * (libs/cublas_records.c, built into the same library); loaded by real_batch.py. */
#include <stdint.h>
#include <string.h>

#include "rgpu_protocol.h"  /* rgpu/protocol: the records' kinds and sizes (generated) */

#define HEAD RGPU_CUDA_LAUNCH_HEADER_BYTES
typedef int (*launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *,
                         void **, void **);
typedef int (*set_ctx_fn)(void *);
struct rgpu_cublas;
int rgpu_cublas_record(struct rgpu_cublas *t, uint32_t call, uint64_t client, uint64_t stream, const char *p, size_t len);
/* Launch records [pos, len) (layout in rgpu/protocol/cuda.py, LAUNCH) in order, each with its packed
 * arguments passed through `extra`.  Stops at the first failure: returns its CUresult and leaves *pos at
 * that record (-1: malformed; -2: a kind this walker leaves to the executor, or a math-library record
 * that `cublas`, the session's cuBLAS table or NULL, did not run); returns 0 with *pos == len when all ran.
 * *ctx is the current context, kept up to date. */
int rgpu_walk_records(launch_fn launch, set_ctx_fn set_ctx, const char *rec, size_t len, size_t *pos,
                      uint64_t *ctx, struct rgpu_cublas *cublas) {
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
            if (h[0] != *ctx) {
                int rc = set_ctx((void *)(uintptr_t)h[0]);
                if (rc) return rc;
                *ctx = h[0];
            }
            if (rgpu_cublas_record(cublas, (uint32_t)h[2], h[3], h[1], r + RGPU_CUDA_OP_HEADER_BYTES, h[4]))
                return -2;                 /* not one it runs, or it failed: the executor runs it and explains */
            *pos += size;
            continue;
        }
        /* not a plain cuLaunchKernel (cuLaunchKernelEx, a memset, an event record, ...): the executor runs it,
         * checked first because those records may be shorter than a launch's fixed part */
        if (kind != RGPU_CUDA_REC_LAUNCH) return -2;
        if (*pos + HEAD > len) return -1;
        memcpy(&func, r + 8, 8);
        memcpy(&c, r + 16, 8);
        memcpy(&stream, r + 24, 8);
        memcpy(dims, r + 32, 32);
        if (size < HEAD + dims[7] || *pos + size > len) return -1;
        if (c != *ctx) {
            int rc = set_ctx((void *)(uintptr_t)c);
            if (rc) return rc;
            *ctx = c;
        }
        extra[1] = (void *)(r + HEAD);
        size_arg = dims[7];
        int rc = launch((void *)(uintptr_t)func, dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6],
                        (void *)(uintptr_t)stream, 0, dims[7] ? extra : 0);
        if (rc) return rc;
        *pos += size;
    }
    return 0;
}

/* The same walk with no math-library table: every math-library record goes to the executor. */
int rgpu_launch_records(launch_fn launch, set_ctx_fn set_ctx, const char *rec, size_t len, size_t *pos,
                        uint64_t *ctx) {
    return rgpu_walk_records(launch, set_ctx, rec, len, pos, ctx, 0);
}
