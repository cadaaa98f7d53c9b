/* The door rgpu's math libraries (libcublas.so.13, libcublasLt.so.13, libcudnn.so.9: lib_*.c) call through.
 *
 * They find these two with dlsym, so they load beside rgpu's libcuda.so.1 only (a stock driver has
 * neither, and the libraries then say so).  A call is a numbered payload (rgpu.protocol.cuda_libs):
 *   rgpu_lib_queue: one record in shim_launch.c's queue (RGPU_CUDA_REC_LIB), in order with the launches,
 *                   never waited for; a failing status is raised at the next synchronising call;
 *   rgpu_lib_call:  a request through Python (the queue goes first), its status and output back.
 * Both return a CUresult for the route itself (0 when the call reached the server); *status is the
 * library's own status.
 */
#define RGPU_LIB_QUEUED_MAX ((size_t)1 << 20)   /* a bigger payload is answered rather than queued */

static CUresult _py_rgpu_lib_call(uint32_t call, uint64_t stream, uint64_t handle, const void *payload, size_t n,
                                  void *out, size_t cap, int64_t *status, size_t *got);

__attribute__((visibility("default")))
int rgpu_lib_call(uint32_t call, uint64_t stream, uint64_t handle, const void *payload, size_t n,
                  void *out, size_t cap, int64_t *status, size_t *got) {
    int64_t st = 0;
    size_t len = 0;
    if (rgpu_finalized) return CUDA_ERROR_DEINITIALIZED;      /* after exit: no Python to go to */
    CUresult rc = _py_rgpu_lib_call(call, stream, handle, payload, n, out, cap, &st, &len);
    if (status) *status = st;
    if (got) *got = len;
    return rc;
}

__attribute__((visibility("default")))
int rgpu_lib_queue(uint32_t call, uint64_t stream, uint64_t handle, const void *payload, size_t n) {
    if (rgpu_finalized) return CUDA_ERROR_DEINITIALIZED;
    if (!rgpu_queueing() || RGPU_OP_HEADER + n > RGPU_LIB_QUEUED_MAX) {   /* answered instead, in order too */
        int64_t st = 0;
        CUresult rc = rgpu_lib_call(call, stream, handle, payload, n, NULL, 0, &st, NULL);
        return rc ? rc : (st ? CUDA_ERROR_LAUNCH_FAILED : CUDA_SUCCESS);
    }
    return rgpu_queue_op(RGPU_CUDA_REC_LIB, stream, call, handle, n, payload, n);
}
