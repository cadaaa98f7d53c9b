/* rgpu_protocol.h: the numbers both languages agree on, generated from rgpu.protocol's tables
 * by rgpu/protocol/header.py; do not edit (python -m rgpu.protocol.header --write). */
#ifndef RGPU_PROTOCOL_H
#define RGPU_PROTOCOL_H

/* wire.py: the frame */
#define RGPU_WIRE_MAGIC "RGPU"
#define RGPU_WIRE_MAGIC_U32 0x55504752u
#define RGPU_PROTOCOL_VERSION 1
#define RGPU_WIRE_HEADER_BYTES 36
#define RGPU_KIND_HELLO 1
#define RGPU_KIND_CHALLENGE 2
#define RGPU_KIND_PROOF 3
#define RGPU_KIND_WELCOME 4
#define RGPU_KIND_REFUSED 5
#define RGPU_KIND_WAIT 6
#define RGPU_KIND_POST 10
#define RGPU_KIND_REQUEST 11
#define RGPU_KIND_REPLY 12
#define RGPU_KIND_ERROR 13
#define RGPU_KIND_BYE 14
#define RGPU_KIND_UPGRADE 15
#define RGPU_FLAG_LAST_IN_BATCH 1

/* wire.py: the shm ring's records */
#define RGPU_SHM_RECORD_BYTES 24
#define RGPU_SHM_KIND_FRAME 1
#define RGPU_SHM_KIND_WRAP 2
#define RGPU_SHM_NO_SLOT 0xFFFFFFFFu

/* ops.py: messages (the first item of each), allocator events, value tags */
#define RGPU_MSG_DEFINE 1
#define RGPU_MSG_OP 2
#define RGPU_MSG_CALL 3
#define RGPU_MSG_UPLOAD 4
#define RGPU_MSG_DOWNLOAD 5
#define RGPU_MSG_EVENTS 6
#define RGPU_MSG_SEED 7
#define RGPU_MSG_SYNC 8
#define RGPU_MSG_MEMORY 9
#define RGPU_MSG_PROFILE 10
#define RGPU_MSG_GRAPH 11
#define RGPU_MSG_RUN 12
#define RGPU_MSG_GRAPH_FREE 13
#define RGPU_MSG_GRAPH_INFO 14
#define RGPU_MSG_UPLOAD_PART 15
#define RGPU_MSG_UPLOAD_INFO 16
#define RGPU_MSG_GET_RNG_STATE 17
#define RGPU_MSG_SET_RNG_STATE 18
#define RGPU_EVENT_FREE 0
#define RGPU_EVENT_COPY 1
#define RGPU_EVENT_FREE_FIELDS 1
#define RGPU_EVENT_COPY_FIELDS 5
#define RGPU_TAG_TENSOR "t"
#define RGPU_TAG_MATH_BITS "j"
#define RGPU_TAG_CPU_SCALAR "s"
#define RGPU_TAG_DTYPE "d"
#define RGPU_TAG_DEVICE "v"
#define RGPU_TAG_LAYOUT "l"
#define RGPU_TAG_MEMORY_FORMAT "m"
#define RGPU_TAG_COMPLEX "c"
#define RGPU_TAG_GENERATOR "g"

/* cuda.py: the interceptor's launch record (its fixed part, then the arguments) */
#define RGPU_CUDA_REC_LAUNCH 1
#define RGPU_CUDA_REC_LAUNCH_EX 2
#define RGPU_CUDA_LAUNCH_HEADER_BYTES 64
/* cuda.py: the queue's other records (memsets, events, waits, frees, small copies, graph launches) */
#define RGPU_CUDA_RECORD_HEAD_BYTES 8
#define RGPU_CUDA_OP_HEADER_BYTES 48
#define RGPU_CUDA_REC_MEMSET 3
#define RGPU_CUDA_REC_EVENT_RECORD 4
#define RGPU_CUDA_REC_STREAM_WAIT 5
#define RGPU_CUDA_REC_MEM_FREE 6
#define RGPU_CUDA_REC_MEMCPY_HTOD 7
#define RGPU_CUDA_REC_GRAPH_LAUNCH 8
#define RGPU_CUDA_NO_STREAM 0xFFFFFFFFFFFFFFFFull
#define RGPU_CUDA_QUEUED_COPY_BYTES 65536
#define RGPU_CUDA_REC_LIB 9

/* cuda_libs.py: the math libraries' forwarded calls (ids, payloads; C only: the C++ parts need none) */
#ifndef __cplusplus
#include <stdint.h>
#define RGPU_LIB_cublasCreate_v2 0x100u
typedef struct __attribute__((packed)) {
    int32_t client_version;
} rgpu_lib_cublasCreate_v2_t;
_Static_assert(sizeof(rgpu_lib_cublasCreate_v2_t) == 4, "cublasCreate_v2's payload");
#define RGPU_LIB_cublasDestroy_v2 0x101u
typedef struct __attribute__((packed)) {
    uint8_t _none;
} rgpu_lib_cublasDestroy_v2_t;
_Static_assert(sizeof(rgpu_lib_cublasDestroy_v2_t) == 1, "cublasDestroy_v2's payload");
#define RGPU_LIB_cublasSgemm_v2 0x110u
typedef struct __attribute__((packed)) {
    uint64_t workspace;
    uint64_t workspace_size;
    int32_t math_mode;
    int32_t pointer_mode;
    int32_t transa;
    int32_t transb;
    int32_t m;
    int32_t n;
    int32_t k;
    int32_t lda;
    int32_t ldb;
    int32_t ldc;
    uint8_t alpha[16];
    uint8_t beta[16];
    uint64_t A;
    uint64_t B;
    uint64_t C;
} rgpu_lib_cublasSgemm_v2_t;
_Static_assert(sizeof(rgpu_lib_cublasSgemm_v2_t) == 112, "cublasSgemm_v2's payload");
#define RGPU_LIB_cublasDgemm_v2 0x111u
typedef struct __attribute__((packed)) {
    uint64_t workspace;
    uint64_t workspace_size;
    int32_t math_mode;
    int32_t pointer_mode;
    int32_t transa;
    int32_t transb;
    int32_t m;
    int32_t n;
    int32_t k;
    int32_t lda;
    int32_t ldb;
    int32_t ldc;
    uint8_t alpha[16];
    uint8_t beta[16];
    uint64_t A;
    uint64_t B;
    uint64_t C;
} rgpu_lib_cublasDgemm_v2_t;
_Static_assert(sizeof(rgpu_lib_cublasDgemm_v2_t) == 112, "cublasDgemm_v2's payload");
#define RGPU_LIB_cublasGemmEx 0x112u
typedef struct __attribute__((packed)) {
    uint64_t workspace;
    uint64_t workspace_size;
    int32_t math_mode;
    int32_t pointer_mode;
    int32_t transa;
    int32_t transb;
    int32_t m;
    int32_t n;
    int32_t k;
    int32_t lda;
    int32_t ldb;
    int32_t ldc;
    uint8_t alpha[16];
    uint8_t beta[16];
    uint64_t A;
    uint64_t B;
    uint64_t C;
    int32_t atype;
    int32_t btype;
    int32_t ctype;
    int32_t compute_type;
    int32_t algo;
} rgpu_lib_cublasGemmEx_t;
_Static_assert(sizeof(rgpu_lib_cublasGemmEx_t) == 132, "cublasGemmEx's payload");
#define RGPU_LIB_cublasSgemmEx 0x113u
typedef struct __attribute__((packed)) {
    uint64_t workspace;
    uint64_t workspace_size;
    int32_t math_mode;
    int32_t pointer_mode;
    int32_t transa;
    int32_t transb;
    int32_t m;
    int32_t n;
    int32_t k;
    int32_t lda;
    int32_t ldb;
    int32_t ldc;
    uint8_t alpha[16];
    uint8_t beta[16];
    uint64_t A;
    uint64_t B;
    uint64_t C;
    int32_t atype;
    int32_t btype;
    int32_t ctype;
} rgpu_lib_cublasSgemmEx_t;
_Static_assert(sizeof(rgpu_lib_cublasSgemmEx_t) == 124, "cublasSgemmEx's payload");
#define RGPU_LIB_cublasSgemmStridedBatched 0x114u
typedef struct __attribute__((packed)) {
    uint64_t workspace;
    uint64_t workspace_size;
    int32_t math_mode;
    int32_t pointer_mode;
    int32_t transa;
    int32_t transb;
    int32_t m;
    int32_t n;
    int32_t k;
    int32_t lda;
    int32_t ldb;
    int32_t ldc;
    uint8_t alpha[16];
    uint8_t beta[16];
    uint64_t A;
    uint64_t B;
    uint64_t C;
    int64_t stride_a;
    int64_t stride_b;
    int64_t stride_c;
    int32_t batch;
} rgpu_lib_cublasSgemmStridedBatched_t;
_Static_assert(sizeof(rgpu_lib_cublasSgemmStridedBatched_t) == 140, "cublasSgemmStridedBatched's payload");
#define RGPU_LIB_cublasDgemmStridedBatched 0x115u
typedef struct __attribute__((packed)) {
    uint64_t workspace;
    uint64_t workspace_size;
    int32_t math_mode;
    int32_t pointer_mode;
    int32_t transa;
    int32_t transb;
    int32_t m;
    int32_t n;
    int32_t k;
    int32_t lda;
    int32_t ldb;
    int32_t ldc;
    uint8_t alpha[16];
    uint8_t beta[16];
    uint64_t A;
    uint64_t B;
    uint64_t C;
    int64_t stride_a;
    int64_t stride_b;
    int64_t stride_c;
    int32_t batch;
} rgpu_lib_cublasDgemmStridedBatched_t;
_Static_assert(sizeof(rgpu_lib_cublasDgemmStridedBatched_t) == 140, "cublasDgemmStridedBatched's payload");
#define RGPU_LIB_cublasGemmStridedBatchedEx 0x116u
typedef struct __attribute__((packed)) {
    uint64_t workspace;
    uint64_t workspace_size;
    int32_t math_mode;
    int32_t pointer_mode;
    int32_t transa;
    int32_t transb;
    int32_t m;
    int32_t n;
    int32_t k;
    int32_t lda;
    int32_t ldb;
    int32_t ldc;
    uint8_t alpha[16];
    uint8_t beta[16];
    uint64_t A;
    uint64_t B;
    uint64_t C;
    int32_t atype;
    int32_t btype;
    int32_t ctype;
    int32_t compute_type;
    int32_t algo;
    int64_t stride_a;
    int64_t stride_b;
    int64_t stride_c;
    int32_t batch;
} rgpu_lib_cublasGemmStridedBatchedEx_t;
_Static_assert(sizeof(rgpu_lib_cublasGemmStridedBatchedEx_t) == 160, "cublasGemmStridedBatchedEx's payload");
#define RGPU_LIB_cublasGemmBatchedEx 0x117u
typedef struct __attribute__((packed)) {
    uint64_t workspace;
    uint64_t workspace_size;
    int32_t math_mode;
    int32_t pointer_mode;
    int32_t transa;
    int32_t transb;
    int32_t m;
    int32_t n;
    int32_t k;
    int32_t lda;
    int32_t ldb;
    int32_t ldc;
    uint8_t alpha[16];
    uint8_t beta[16];
    uint64_t A;
    uint64_t B;
    uint64_t C;
    int32_t atype;
    int32_t btype;
    int32_t ctype;
    int32_t compute_type;
    int32_t algo;
    int32_t batch;
} rgpu_lib_cublasGemmBatchedEx_t;
_Static_assert(sizeof(rgpu_lib_cublasGemmBatchedEx_t) == 136, "cublasGemmBatchedEx's payload");
#define RGPU_LIB_cublasSgemv_v2 0x120u
typedef struct __attribute__((packed)) {
    uint64_t workspace;
    uint64_t workspace_size;
    int32_t math_mode;
    int32_t pointer_mode;
    int32_t trans;
    int32_t m;
    int32_t n;
    int32_t lda;
    int32_t incx;
    int32_t incy;
    uint8_t alpha[16];
    uint8_t beta[16];
    uint64_t A;
    uint64_t x;
    uint64_t y;
} rgpu_lib_cublasSgemv_v2_t;
_Static_assert(sizeof(rgpu_lib_cublasSgemv_v2_t) == 104, "cublasSgemv_v2's payload");
#define RGPU_LIB_cublasDgemv_v2 0x121u
typedef struct __attribute__((packed)) {
    uint64_t workspace;
    uint64_t workspace_size;
    int32_t math_mode;
    int32_t pointer_mode;
    int32_t trans;
    int32_t m;
    int32_t n;
    int32_t lda;
    int32_t incx;
    int32_t incy;
    uint8_t alpha[16];
    uint8_t beta[16];
    uint64_t A;
    uint64_t x;
    uint64_t y;
} rgpu_lib_cublasDgemv_v2_t;
_Static_assert(sizeof(rgpu_lib_cublasDgemv_v2_t) == 104, "cublasDgemv_v2's payload");
#define RGPU_LIB_cublasSdot_v2 0x130u
typedef struct __attribute__((packed)) {
    uint64_t workspace;
    uint64_t workspace_size;
    int32_t math_mode;
    int32_t pointer_mode;
    int32_t n;
    int32_t incx;
    int32_t incy;
    uint64_t x;
    uint64_t y;
    uint64_t result;
} rgpu_lib_cublasSdot_v2_t;
_Static_assert(sizeof(rgpu_lib_cublasSdot_v2_t) == 60, "cublasSdot_v2's payload");
#define RGPU_LIB_cublasDdot_v2 0x131u
typedef struct __attribute__((packed)) {
    uint64_t workspace;
    uint64_t workspace_size;
    int32_t math_mode;
    int32_t pointer_mode;
    int32_t n;
    int32_t incx;
    int32_t incy;
    uint64_t x;
    uint64_t y;
    uint64_t result;
} rgpu_lib_cublasDdot_v2_t;
_Static_assert(sizeof(rgpu_lib_cublasDdot_v2_t) == 60, "cublasDdot_v2's payload");
#define RGPU_LIB_cublasDotEx 0x132u
typedef struct __attribute__((packed)) {
    uint64_t workspace;
    uint64_t workspace_size;
    int32_t math_mode;
    int32_t pointer_mode;
    int32_t n;
    int32_t incx;
    int32_t incy;
    uint64_t x;
    uint64_t y;
    uint64_t result;
    int32_t xtype;
    int32_t ytype;
    int32_t result_type;
    int32_t exec_type;
} rgpu_lib_cublasDotEx_t;
_Static_assert(sizeof(rgpu_lib_cublasDotEx_t) == 76, "cublasDotEx's payload");
#define RGPU_LIB_cublasLtCreate 0x200u
typedef struct __attribute__((packed)) {
    uint64_t client_version;
} rgpu_lib_cublasLtCreate_t;
_Static_assert(sizeof(rgpu_lib_cublasLtCreate_t) == 8, "cublasLtCreate's payload");
#define RGPU_LIB_cublasLtDestroy 0x201u
typedef struct __attribute__((packed)) {
    uint8_t _none;
} rgpu_lib_cublasLtDestroy_t;
_Static_assert(sizeof(rgpu_lib_cublasLtDestroy_t) == 1, "cublasLtDestroy's payload");
#define RGPU_LIB_cublasLtMatmulAlgoGetHeuristic 0x202u
typedef struct __attribute__((packed)) {
    int32_t requested;
} rgpu_lib_cublasLtMatmulAlgoGetHeuristic_t;
_Static_assert(sizeof(rgpu_lib_cublasLtMatmulAlgoGetHeuristic_t) == 4, "cublasLtMatmulAlgoGetHeuristic's payload");
#define RGPU_LIB_cublasLtMatmul 0x203u
typedef struct __attribute__((packed)) {
    uint8_t alpha[16];
    uint8_t beta[16];
    uint64_t alpha_ptr;
    uint64_t beta_ptr;
    uint64_t a;
    uint64_t b;
    uint64_t c;
    uint64_t d;
    uint64_t workspace;
    uint64_t workspace_size;
    uint8_t algo[64];
    uint32_t has_algo;
} rgpu_lib_cublasLtMatmul_t;
_Static_assert(sizeof(rgpu_lib_cublasLtMatmul_t) == 164, "cublasLtMatmul's payload");
#define RGPU_LIB_cudnnCreate 0x300u
typedef struct __attribute__((packed)) {
    int64_t client_version;
} rgpu_lib_cudnnCreate_t;
_Static_assert(sizeof(rgpu_lib_cudnnCreate_t) == 8, "cudnnCreate's payload");
#define RGPU_LIB_cudnnDestroy 0x301u
typedef struct __attribute__((packed)) {
    uint8_t _none;
} rgpu_lib_cudnnDestroy_t;
_Static_assert(sizeof(rgpu_lib_cudnnDestroy_t) == 1, "cudnnDestroy's payload");
#define RGPU_LIB_cudnnBackendCreateDescriptor 0x302u
typedef struct __attribute__((packed)) {
    int32_t type;
} rgpu_lib_cudnnBackendCreateDescriptor_t;
_Static_assert(sizeof(rgpu_lib_cudnnBackendCreateDescriptor_t) == 4, "cudnnBackendCreateDescriptor's payload");
#define RGPU_LIB_cudnnBackendDestroyDescriptor 0x303u
typedef struct __attribute__((packed)) {
    uint8_t _none;
} rgpu_lib_cudnnBackendDestroyDescriptor_t;
_Static_assert(sizeof(rgpu_lib_cudnnBackendDestroyDescriptor_t) == 1, "cudnnBackendDestroyDescriptor's payload");
#define RGPU_LIB_cudnnBackendSetAttribute 0x304u
typedef struct __attribute__((packed)) {
    int32_t name;
    int32_t type;
    int64_t count;
} rgpu_lib_cudnnBackendSetAttribute_t;
_Static_assert(sizeof(rgpu_lib_cudnnBackendSetAttribute_t) == 16, "cudnnBackendSetAttribute's payload");
#define RGPU_LIB_cudnnBackendGetAttribute 0x305u
typedef struct __attribute__((packed)) {
    int32_t name;
    int32_t type;
    int64_t requested;
} rgpu_lib_cudnnBackendGetAttribute_t;
_Static_assert(sizeof(rgpu_lib_cudnnBackendGetAttribute_t) == 16, "cudnnBackendGetAttribute's payload");
#define RGPU_LIB_cudnnBackendInitialize 0x306u
typedef struct __attribute__((packed)) {
    uint8_t _none;
} rgpu_lib_cudnnBackendInitialize_t;
_Static_assert(sizeof(rgpu_lib_cudnnBackendInitialize_t) == 1, "cudnnBackendInitialize's payload");
#define RGPU_LIB_cudnnBackendFinalize 0x307u
typedef struct __attribute__((packed)) {
    uint8_t _none;
} rgpu_lib_cudnnBackendFinalize_t;
_Static_assert(sizeof(rgpu_lib_cudnnBackendFinalize_t) == 1, "cudnnBackendFinalize's payload");
#define RGPU_LIB_cudnnBackendExecute 0x308u
typedef struct __attribute__((packed)) {
    uint64_t plan;
    uint64_t pack;
} rgpu_lib_cudnnBackendExecute_t;
_Static_assert(sizeof(rgpu_lib_cudnnBackendExecute_t) == 16, "cudnnBackendExecute's payload");
#define RGPU_LIB_cudnnCreateTensorDescriptor 0x309u
typedef struct __attribute__((packed)) {
    uint8_t _none;
} rgpu_lib_cudnnCreateTensorDescriptor_t;
_Static_assert(sizeof(rgpu_lib_cudnnCreateTensorDescriptor_t) == 1, "cudnnCreateTensorDescriptor's payload");
#define RGPU_LIB_cudnnSetTensorNdDescriptor 0x30Au
typedef struct __attribute__((packed)) {
    int32_t dtype;
    int32_t nbdims;
} rgpu_lib_cudnnSetTensorNdDescriptor_t;
_Static_assert(sizeof(rgpu_lib_cudnnSetTensorNdDescriptor_t) == 8, "cudnnSetTensorNdDescriptor's payload");
#define RGPU_LIB_cudnnDestroyTensorDescriptor 0x30Bu
typedef struct __attribute__((packed)) {
    uint8_t _none;
} rgpu_lib_cudnnDestroyTensorDescriptor_t;
_Static_assert(sizeof(rgpu_lib_cudnnDestroyTensorDescriptor_t) == 1, "cudnnDestroyTensorDescriptor's payload");
#define RGPU_LIB_cudnnDeriveBNTensorDescriptor 0x30Cu
typedef struct __attribute__((packed)) {
    uint64_t x;
    int32_t mode;
} rgpu_lib_cudnnDeriveBNTensorDescriptor_t;
_Static_assert(sizeof(rgpu_lib_cudnnDeriveBNTensorDescriptor_t) == 12, "cudnnDeriveBNTensorDescriptor's payload");
#define RGPU_LIB_cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize 0x30Du
typedef struct __attribute__((packed)) {
    int32_t mode;
    int32_t ops;
    uint64_t x;
    uint64_t z;
    uint64_t y;
    uint64_t bn;
    uint64_t act;
} rgpu_lib_cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize_t;
_Static_assert(sizeof(rgpu_lib_cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize_t) == 48, "cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize's payload");
#define RGPU_LIB_cudnnGetBatchNormalizationBackwardExWorkspaceSize 0x30Eu
typedef struct __attribute__((packed)) {
    int32_t mode;
    int32_t ops;
    uint64_t x;
    uint64_t y;
    uint64_t dy;
    uint64_t dz;
    uint64_t dx;
    uint64_t dbn;
    uint64_t act;
} rgpu_lib_cudnnGetBatchNormalizationBackwardExWorkspaceSize_t;
_Static_assert(sizeof(rgpu_lib_cudnnGetBatchNormalizationBackwardExWorkspaceSize_t) == 64, "cudnnGetBatchNormalizationBackwardExWorkspaceSize's payload");
#define RGPU_LIB_cudnnGetBatchNormalizationTrainingExReserveSpaceSize 0x30Fu
typedef struct __attribute__((packed)) {
    int32_t mode;
    int32_t ops;
    uint64_t act;
    uint64_t x;
} rgpu_lib_cudnnGetBatchNormalizationTrainingExReserveSpaceSize_t;
_Static_assert(sizeof(rgpu_lib_cudnnGetBatchNormalizationTrainingExReserveSpaceSize_t) == 24, "cudnnGetBatchNormalizationTrainingExReserveSpaceSize's payload");
#define RGPU_LIB_cudnnBatchNormalizationForwardTrainingEx 0x310u
typedef struct __attribute__((packed)) {
    int32_t mode;
    int32_t ops;
    double alpha;
    double beta;
    uint64_t x;
    uint64_t x_data;
    uint64_t z;
    uint64_t z_data;
    uint64_t y;
    uint64_t y_data;
    uint64_t bn;
    uint64_t scale;
    uint64_t bias;
    double factor;
    uint64_t running_mean;
    uint64_t running_var;
    double epsilon;
    uint64_t save_mean;
    uint64_t save_inv_var;
    uint64_t act;
    uint64_t workspace;
    uint64_t workspace_size;
    uint64_t reserve;
    uint64_t reserve_size;
} rgpu_lib_cudnnBatchNormalizationForwardTrainingEx_t;
_Static_assert(sizeof(rgpu_lib_cudnnBatchNormalizationForwardTrainingEx_t) == 184, "cudnnBatchNormalizationForwardTrainingEx's payload");
#define RGPU_LIB_cudnnBatchNormalizationBackwardEx 0x311u
typedef struct __attribute__((packed)) {
    int32_t mode;
    int32_t ops;
    double alpha_data;
    double beta_data;
    double alpha_param;
    double beta_param;
    uint64_t x;
    uint64_t x_data;
    uint64_t y;
    uint64_t y_data;
    uint64_t dy;
    uint64_t dy_data;
    uint64_t dz;
    uint64_t dz_data;
    uint64_t dx;
    uint64_t dx_data;
    uint64_t dbn;
    uint64_t scale;
    uint64_t bias;
    uint64_t dscale;
    uint64_t dbias;
    double epsilon;
    uint64_t save_mean;
    uint64_t save_inv_var;
    uint64_t act;
    uint64_t workspace;
    uint64_t workspace_size;
    uint64_t reserve;
    uint64_t reserve_size;
} rgpu_lib_cudnnBatchNormalizationBackwardEx_t;
_Static_assert(sizeof(rgpu_lib_cudnnBatchNormalizationBackwardEx_t) == 224, "cudnnBatchNormalizationBackwardEx's payload");
#define RGPU_LIB_cudnnBatchNormalizationForwardInference 0x312u
typedef struct __attribute__((packed)) {
    int32_t mode;
    double alpha;
    double beta;
    uint64_t x;
    uint64_t x_data;
    uint64_t y;
    uint64_t y_data;
    uint64_t bn;
    uint64_t scale;
    uint64_t bias;
    uint64_t mean;
    uint64_t var;
    double epsilon;
} rgpu_lib_cudnnBatchNormalizationForwardInference_t;
_Static_assert(sizeof(rgpu_lib_cudnnBatchNormalizationForwardInference_t) == 100, "cudnnBatchNormalizationForwardInference's payload");
#define RGPU_LIB_cudnnBackendFinalizeQueued 0x313u
typedef struct __attribute__((packed)) {
    uint8_t _none;
} rgpu_lib_cudnnBackendFinalizeQueued_t;
_Static_assert(sizeof(rgpu_lib_cudnnBackendFinalizeQueued_t) == 1, "cudnnBackendFinalizeQueued's payload");
#endif

#endif /* RGPU_PROTOCOL_H */
