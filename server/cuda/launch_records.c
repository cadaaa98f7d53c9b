/* The real driver's batch launcher: walks the interceptor's launch records and launches each
 * (a ctypes call costs more than the launch itself); loaded by real_batch.py. */
#include <stdint.h>
#include <string.h>

#include "rgpu_protocol.h"  /* rgpu/protocol: the records' kinds and sizes (generated) */

#define HEAD RGPU_CUDA_LAUNCH_HEADER_BYTES
typedef int (*launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *,
                         void **, void **);
typedef int (*set_ctx_fn)(void *);
/* Launch records [pos, len) (layout in rgpu/protocol/cuda.py, LAUNCH) in order, each with its packed
 * arguments passed through `extra`.  Stops at the first failure: returns its CUresult and leaves *pos at
 * that record (-1: malformed; -2: a kind this walker leaves to the executor); returns 0 with *pos == len
 * when all ran.  *ctx is the current context, kept up to date. */
int rgpu_launch_records(launch_fn launch, set_ctx_fn set_ctx, const char *rec, size_t len, size_t *pos,
                        uint64_t *ctx) {
    size_t size_arg = 0;
    void *extra[5] = {(void *)1, 0, (void *)2, &size_arg, 0};
    while (*pos + RGPU_CUDA_RECORD_HEAD_BYTES <= len) {
        const char *r = rec + *pos;
        uint32_t size, kind, dims[8];
        uint64_t func, c, stream;
        memcpy(&size, r, 4);
        memcpy(&kind, r + 4, 4);
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
