/* What rgpu's cudnn forwarders share (lib_cudnn.c: handles and the backend graph API; lib_cudnn_bn.c: legacy
 * tensor descriptors and batch normalization): the client-side objects, cuDNN's constants they use.
 * See rgpu/protocol/lib_cudnn.py for what travels. */
#ifndef RGPU_LIB_CUDNN_H
#define RGPU_LIB_CUDNN_H
#include <stddef.h>
#include <stdint.h>

#include "lib_door.h"

/* cudnnStatus_t; cudnnBackendAttributeType_t, cudnnDataType_t, cudnnBackendDescriptorType_t (cudnn_graph.h) */
enum { DNN_OK = 0, DNN_NOT_INITIALIZED = 1001, DNN_BAD_PARAM = 2000, DNN_NULL_POINTER = 2002, DNN_NOT_SUPPORTED = 3000,
       DNN_INTERNAL = 4000, DNN_ALLOC_FAILED = 4003 };
enum { TYPE_HANDLE = 0, TYPE_INT64 = 3, TYPE_BACKEND_DESCRIPTOR = 15, DATA_DOUBLE = 1, DATA_HALF = 2, DATA_BFLOAT16 = 9,
       VARIANT_PACK = 16 };
#define DIM_MAX 8                          /* CUDNN_DIM_MAX */
/* rgpu.protocol.lib_cudnn's dump: ENTRY "<iiqq" then the bytes; COUNT_ONLY marks descriptor attributes */
#define ENTRY_SIZE 24
#define COUNT_ONLY (1 << 16)
#define BY_VALUE (-1)                      /* a plan's by-value tensors: INT64 pairs (uid, bytes) */
#define BY_VALUE_MAX ((int64_t)1 << 16)
#define REPLY_CAP ((size_t)256 << 10)      /* a Finalize's dump; a longer one is not kept (Gets ask) */

enum { MAGIC_HANDLE = 0x444e4e48, MAGIC_BACKEND = 0x444e4e42, MAGIC_TENSOR = 0x444e4e54 };

typedef struct {
    uint32_t magic;
    uint64_t id, stream;
} dnn_handle;

typedef struct {
    uint32_t magic;
    int type;
    uint64_t id;
    uint8_t *dump;                          /* readable attributes once finalized or filled, else NULL */
    size_t dump_n;
    void *handle;                           /* the handle set on it, and as which attribute: that Get's answer */
    int handle_attr;
    int64_t nuids, nptrs, *uids;            /* a variant pack's: where its by-value tensors' bytes are */
    uint64_t *ptrs;
} dnn_backend;

typedef struct {
    uint32_t magic;
    int dtype, nbdims;
    uint64_t id;
    int dims[DIM_MAX], strides[DIM_MAX];
} dnn_tensor;

static inline dnn_handle *as_handle(void *h) { return h && ((dnn_handle *)h)->magic == MAGIC_HANDLE ? h : NULL; }
static inline dnn_tensor *as_tensor(void *t) { return t && ((dnn_tensor *)t)->magic == MAGIC_TENSOR ? t : NULL; }
static inline int dnn_queue(uint32_t id, uint64_t stream, uint64_t handle, const void *p, size_t n) {
    return rgpu_door_queue(id, stream, handle, p, n, DNN_INTERNAL);
}

#endif
