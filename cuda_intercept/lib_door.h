/* What rgpu's math libraries (lib_cublas.c, lib_cublaslt.c, lib_cudnn.c) share: the door into rgpu's libcuda.so.1.
 *
 * A forwarded call is a numbered payload (rgpu.protocol.cuda_libs; ids and packed structs in
 * rgpu_protocol_libs.h).  rgpu_door_queue() puts it in the driver's ordered queue (never waited for; a
 * failing status is raised at the next synchronising CUDA call); rgpu_door_call() sends it and waits for
 * the library's status and the call's output.  Both return the library's status; when the route itself
 * failed (no rgpu driver loaded, the server gone) they return `failed`, having said why once.
 */
#ifndef RGPU_LIB_DOOR_H
#define RGPU_LIB_DOOR_H
#include <stddef.h>
#include <stdint.h>

#include "rgpu_protocol_libs.h"

/* Queue call `id` on `stream` (0: the legacy default) for `handle`; `failed` if it cannot reach the driver. */
__attribute__((visibility("hidden")))
int rgpu_door_queue(uint32_t id, uint64_t stream, uint64_t handle, const void *payload, size_t n, int failed);

/* Send call `id` and wait: its status; up to `cap` bytes of output into `out`, their full count in *got. */
__attribute__((visibility("hidden")))
int rgpu_door_call(uint32_t id, uint64_t stream, uint64_t handle, const void *payload, size_t n,
                   void *out, size_t cap, size_t *got, int failed);

/* A client-minted handle or descriptor value: tagged, so a stray one is recognisable on the server. */
__attribute__((visibility("hidden")))
uint64_t rgpu_door_mint(void);

#endif
