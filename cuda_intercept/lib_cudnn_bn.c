/* rgpu's cudnn forwarders, the legacy half: tensor descriptors (kept here too: the scalars' width,
 * cudnnGetTensorNdDescriptor) and batch normalization (torch's BN), queued; a BN size query is answered
 * once per (call, handle, descriptor contents).  See rgpu/protocol/lib_cudnn.py. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "lib_cudnn.h"
#include "stub.h"

/* the BN size queries' answers by what they depend on: torch asks them for every BN, with new descriptors */
#define SIZES 64
static struct { uint64_t key, size; } sizes[SIZES];
static unsigned sizes_next;
static pthread_mutex_t sizes_lock = PTHREAD_MUTEX_INITIALIZER;

#define queue dnn_queue
static uint64_t tensor_id(void *t) { return !t ? 0 : as_tensor(t) ? ((dnn_tensor *)t)->id : ~(uint64_t)0; }

/* ---- legacy tensor descriptors: kept here too (the scalars' width, cudnnGetTensorNdDescriptor) ---- */
RGPU_API int cudnnCreateTensorDescriptor(void **desc) {
    if (!desc) return DNN_NULL_POINTER;
    dnn_tensor *t = calloc(1, sizeof *t);
    if (!t) return DNN_ALLOC_FAILED;
    t->magic = MAGIC_TENSOR, t->id = rgpu_door_mint();
    int st = queue(RGPU_LIB_cudnnCreateTensorDescriptor, 0, t->id, NULL, 0);
    if (st) free(t);
    else *desc = t;
    return st;
}

RGPU_API int cudnnSetTensorNdDescriptor(void *desc, int dtype, int nbdims, const int *dims, const int *strides) {
    dnn_tensor *t = as_tensor(desc);
    if (!t || nbdims < 1 || nbdims > DIM_MAX) return DNN_BAD_PARAM;
    if (!dims || !strides) return DNN_NULL_POINTER;
    for (int i = 0; i < nbdims; i++)
        if (dims[i] <= 0 || strides[i] <= 0) return DNN_BAD_PARAM;
    t->dtype = dtype;
    t->nbdims = nbdims;
    memcpy(t->dims, dims, nbdims * sizeof(int));
    memcpy(t->strides, strides, nbdims * sizeof(int));
    struct { rgpu_lib_cudnnSetTensorNdDescriptor_t p; int32_t v[2 * DIM_MAX]; } m = {{dtype, nbdims}, {0}};
    memcpy(m.v, dims, nbdims * sizeof(int));
    memcpy(m.v + nbdims, strides, nbdims * sizeof(int));
    return queue(RGPU_LIB_cudnnSetTensorNdDescriptor, 0, t->id, &m, sizeof m.p + 2 * nbdims * sizeof(int32_t));
}

RGPU_API int cudnnGetTensorNdDescriptor(const void *desc, int requested, int *dtype, int *nbdims, int *dims, int *strides) {
    const dnn_tensor *t = as_tensor((void *)desc);
    if (!t || requested < 0 || !t->nbdims) return DNN_BAD_PARAM;       /* not ours, or never set */
    if (dtype) *dtype = t->dtype;
    if (nbdims) *nbdims = t->nbdims;
    for (int i = 0; i < requested && i < t->nbdims; i++) {
        if (dims) dims[i] = t->dims[i];
        if (strides) strides[i] = t->strides[i];
    }
    return DNN_OK;
}

RGPU_API int cudnnDestroyTensorDescriptor(void *desc) {
    dnn_tensor *t = as_tensor(desc);
    if (!t) return desc ? DNN_BAD_PARAM : DNN_OK;
    int st = queue(RGPU_LIB_cudnnDestroyTensorDescriptor, 0, t->id, NULL, 0);
    t->magic = 0, free(t);
    return st;
}

/* cuDNN's rule, kept here as well: 1xCx1x1 (spatial) or 1xCxHxW (per activation), packed; half and
 * bfloat16 data get float parameters.  The server derives its own from the real x. */
RGPU_API int cudnnDeriveBNTensorDescriptor(void *derived, const void *x_desc, int mode) {
    dnn_tensor *d = as_tensor(derived), *x = as_tensor((void *)x_desc);
    if (!d || !x || !x->nbdims || mode < 0 || mode > 2) return DNN_BAD_PARAM;
    d->nbdims = x->nbdims;
    d->dtype = x->dtype == DATA_HALF || x->dtype == DATA_BFLOAT16 ? 0 : x->dtype;
    for (int i = 0; i < x->nbdims; i++) d->dims[i] = i == 1 || (mode == 0 && i > 1) ? x->dims[i] : 1;
    for (int i = x->nbdims - 1, s = 1; i >= 0; s *= d->dims[i--]) d->strides[i] = s;
    rgpu_lib_cudnnDeriveBNTensorDescriptor_t p = {.x = x->id, .mode = mode};
    return queue(RGPU_LIB_cudnnDeriveBNTensorDescriptor, 0, d->id, &p, sizeof p);
}

/* ---- legacy batch normalization (torch's fp32 BN) ------------------------------------------------- */
static double scalar(const void *p, const dnn_tensor *x) {      /* a host scalar: double for double data, else float */
    return x->dtype == DATA_DOUBLE ? *(const double *)p : (double)*(const float *)p;
}
#define P(x) ((uint64_t)(uintptr_t)(x))
static uint64_t mix(uint64_t h, uint64_t v) { return (h ^ v) * 0x100000001b3ull; }   /* FNV-1a, a word at a time */

/* A size is the server's answer for the call, its handle (its GPU) and the descriptors' contents: asked once */
static int bn_size(uint32_t call, dnn_handle *h, const void *act, const void *p, size_t n, const void *const *t,
                   int nt, size_t *size) {
    if (!h || act || !size) return !h ? DNN_BAD_PARAM : act ? DNN_NOT_SUPPORTED : DNN_NULL_POINTER;
    uint64_t key, mode_ops;
    memcpy(&mode_ops, p, 8);                /* every size query's payload starts with mode and ops */
    key = mix(mix(mix(0xcbf29ce484222325ull, call), h->id), mode_ops);
    for (int i = 0; i < nt; i++) {
        const dnn_tensor *x = as_tensor((void *)t[i]);
        key = mix(key, x ? (uint64_t)x->dtype << 32 | (uint32_t)x->nbdims : t[i] != NULL);
        for (int j = 0; x && j < x->nbdims; j++)
            key = mix(key, (uint64_t)(uint32_t)x->dims[j] << 32 | (uint32_t)x->strides[j]);
    }
    pthread_mutex_lock(&sizes_lock);
    for (int i = 0; i < SIZES; i++)
        if (sizes[i].key == key) { *size = sizes[i].size; pthread_mutex_unlock(&sizes_lock); return DNN_OK; }
    pthread_mutex_unlock(&sizes_lock);
    uint64_t v = 0;
    size_t got = 0;
    int st = rgpu_door_call(call, h->stream, h->id, p, n, &v, sizeof v, &got, DNN_INTERNAL);
    if (st || got != sizeof v) return st ? st : DNN_INTERNAL;
    pthread_mutex_lock(&sizes_lock);
    unsigned i = sizes_next++ % SIZES;
    sizes[i].key = key, sizes[i].size = v;
    pthread_mutex_unlock(&sizes_lock);
    *size = (size_t)v;
    return DNN_OK;
}

/* an activation descriptor is never ours (cudnnCreateActivationDescriptor is refused), so none travels */
RGPU_API int cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize(void *handle, int mode, int ops, const void *x,
        const void *z, const void *y, const void *bn, const void *act, size_t *size) {
    rgpu_lib_cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize_t p = {
        mode, ops, tensor_id((void *)x), tensor_id((void *)z), tensor_id((void *)y), tensor_id((void *)bn), 0};
    const void *t[] = {x, z, y, bn};
    return bn_size(RGPU_LIB_cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize, as_handle(handle), act, &p, sizeof p,
                   t, 4, size);
}

RGPU_API int cudnnGetBatchNormalizationBackwardExWorkspaceSize(void *handle, int mode, int ops, const void *x,
        const void *y, const void *dy, const void *dz, const void *dx, const void *dbn, const void *act, size_t *size) {
    rgpu_lib_cudnnGetBatchNormalizationBackwardExWorkspaceSize_t p = {
        mode, ops, tensor_id((void *)x), tensor_id((void *)y), tensor_id((void *)dy), tensor_id((void *)dz),
        tensor_id((void *)dx), tensor_id((void *)dbn), 0};
    const void *t[] = {x, y, dy, dz, dx, dbn};
    return bn_size(RGPU_LIB_cudnnGetBatchNormalizationBackwardExWorkspaceSize, as_handle(handle), act, &p, sizeof p, t, 6,
                   size);
}

RGPU_API int cudnnGetBatchNormalizationTrainingExReserveSpaceSize(void *handle, int mode, int ops, const void *act,
        const void *x, size_t *size) {
    rgpu_lib_cudnnGetBatchNormalizationTrainingExReserveSpaceSize_t p = {mode, ops, 0, tensor_id((void *)x)};
    const void *t[] = {x};
    return bn_size(RGPU_LIB_cudnnGetBatchNormalizationTrainingExReserveSpaceSize, as_handle(handle), act, &p, sizeof p, t, 1,
                   size);
}

RGPU_API int cudnnBatchNormalizationForwardTrainingEx(void *handle, int mode, int ops, const void *alpha,
        const void *beta, const void *x_desc, const void *x, const void *z_desc, const void *z, const void *y_desc,
        void *y, const void *bn_desc, const void *scale, const void *bias, double factor, void *running_mean,
        void *running_var, double epsilon, void *save_mean, void *save_inv_var, void *act, void *workspace,
        size_t workspace_size, void *reserve, size_t reserve_size) {
    dnn_handle *h = as_handle(handle);
    dnn_tensor *xt = as_tensor((void *)x_desc);
    if (!h || !xt || !as_tensor((void *)y_desc) || !as_tensor((void *)bn_desc)) return DNN_BAD_PARAM;
    if (!alpha || !beta || act) return act ? DNN_NOT_SUPPORTED : DNN_NULL_POINTER;
    rgpu_lib_cudnnBatchNormalizationForwardTrainingEx_t p = {
        mode, ops, scalar(alpha, xt), scalar(beta, xt), xt->id, P(x), tensor_id((void *)z_desc), P(z),
        tensor_id((void *)y_desc), P(y), tensor_id((void *)bn_desc), P(scale), P(bias), factor, P(running_mean),
        P(running_var), epsilon, P(save_mean), P(save_inv_var), 0, P(workspace), workspace_size, P(reserve),
        reserve_size};
    return queue(RGPU_LIB_cudnnBatchNormalizationForwardTrainingEx, h->stream, h->id, &p, sizeof p);
}

RGPU_API int cudnnBatchNormalizationBackwardEx(void *handle, int mode, int ops, const void *alpha_data,
        const void *beta_data, const void *alpha_param, const void *beta_param, const void *x_desc, const void *x,
        const void *y_desc, const void *y, const void *dy_desc, const void *dy, const void *dz_desc, void *dz,
        const void *dx_desc, void *dx, const void *dbn_desc, const void *scale, const void *bias, void *dscale,
        void *dbias, double epsilon, const void *save_mean, const void *save_inv_var, void *act, void *workspace,
        size_t workspace_size, void *reserve, size_t reserve_size) {
    dnn_handle *h = as_handle(handle);
    dnn_tensor *xt = as_tensor((void *)x_desc);
    if (!h || !xt || !as_tensor((void *)dy_desc) || !as_tensor((void *)dx_desc) || !as_tensor((void *)dbn_desc))
        return DNN_BAD_PARAM;
    if (act) return DNN_NOT_SUPPORTED;
    if (!alpha_data || !beta_data || !alpha_param || !beta_param) return DNN_NULL_POINTER;
    rgpu_lib_cudnnBatchNormalizationBackwardEx_t p = {
        mode, ops, scalar(alpha_data, xt), scalar(beta_data, xt), scalar(alpha_param, xt), scalar(beta_param, xt),
        xt->id, P(x), tensor_id((void *)y_desc), P(y), tensor_id((void *)dy_desc), P(dy), tensor_id((void *)dz_desc),
        P(dz), tensor_id((void *)dx_desc), P(dx), tensor_id((void *)dbn_desc), P(scale), P(bias), P(dscale), P(dbias),
        epsilon, P(save_mean), P(save_inv_var), 0, P(workspace), workspace_size, P(reserve), reserve_size};
    return queue(RGPU_LIB_cudnnBatchNormalizationBackwardEx, h->stream, h->id, &p, sizeof p);
}

RGPU_API int cudnnBatchNormalizationForwardInference(void *handle, int mode, const void *alpha, const void *beta,
        const void *x_desc, const void *x, const void *y_desc, void *y, const void *bn_desc, const void *scale,
        const void *bias, const void *mean, const void *var, double epsilon) {
    dnn_handle *h = as_handle(handle);
    dnn_tensor *xt = as_tensor((void *)x_desc);
    if (!h || !xt || !as_tensor((void *)y_desc) || !as_tensor((void *)bn_desc)) return DNN_BAD_PARAM;
    if (!alpha || !beta) return DNN_NULL_POINTER;
    rgpu_lib_cudnnBatchNormalizationForwardInference_t p = {
        mode, scalar(alpha, xt), scalar(beta, xt), xt->id, P(x), tensor_id((void *)y_desc), P(y),
        tensor_id((void *)bn_desc), P(scale), P(bias), P(mean), P(var), epsilon};
    return queue(RGPU_LIB_cudnnBatchNormalizationForwardInference, h->stream, h->id, &p, sizeof p);
}
