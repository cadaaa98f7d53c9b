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
#define RGPU_MSG_PEER_RECV 19
#define RGPU_MSG_PEER_SEND 20
#define RGPU_MSG_GROUP_STORE 21
#define RGPU_MSG_GROUP_JOIN 22
#define RGPU_MSG_COLLECTIVE 23
#define RGPU_MSG_GROUP_LEAVE 24
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
/* cuda.py: the queue's other records (memsets, events, waits, frees, copies, graph launches) */
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
#define RGPU_CUDA_REC_MEMCPY_DTOD 10

#endif /* RGPU_PROTOCOL_H */
