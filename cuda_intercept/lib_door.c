/* The door into rgpu's libcuda.so.1 for the math libraries (lib_door.h): rgpu_lib_queue / rgpu_lib_call
 * of shim_libs.c, found with dlsym at the first call, so a library loaded beside a stock driver says so. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>

#include "lib_door.h"

typedef int (*rgpu_queue_fn)(uint32_t, uint64_t, uint64_t, const void *, size_t);
typedef int (*rgpu_call_fn)(uint32_t, uint64_t, uint64_t, const void *, size_t, void *, size_t, int64_t *, size_t *);

static rgpu_queue_fn rgpu_door_q;
static rgpu_call_fn rgpu_door_c;
static pthread_once_t rgpu_door_once = PTHREAD_ONCE_INIT;

static void rgpu_door_find(void) {
    rgpu_door_q = (rgpu_queue_fn)dlsym(RTLD_DEFAULT, "rgpu_lib_queue");
    rgpu_door_c = (rgpu_call_fn)dlsym(RTLD_DEFAULT, "rgpu_lib_call");
    if (!rgpu_door_q || !rgpu_door_c)
        fprintf(stderr, "rgpu: %s is rgpu's, but the CUDA driver loaded is not rgpu's libcuda.so.1: "
                        "run the program through `rgpu intercept run`\n", RGPU_LIB);
}

static int rgpu_door_ready(void) {
    pthread_once(&rgpu_door_once, rgpu_door_find);
    return rgpu_door_q && rgpu_door_c;
}

int rgpu_door_queue(uint32_t id, uint64_t stream, uint64_t handle, const void *payload, size_t n, int failed) {
    if (!rgpu_door_ready()) return failed;
    return rgpu_door_q(id, stream, handle, payload, n) ? failed : 0;
}

int rgpu_door_call(uint32_t id, uint64_t stream, uint64_t handle, const void *payload, size_t n,
                   void *out, size_t cap, size_t *got, int failed) {
    int64_t status = 0;
    size_t have = 0;
    if (!rgpu_door_ready()) return failed;
    if (rgpu_door_c(id, stream, handle, payload, n, out, cap, &status, &have)) return failed;
    if (got) *got = have;
    return (int)status;
}

uint64_t rgpu_door_mint(void) {
    static uint64_t next;
    return (uint64_t)0x52475055 << 32 | __atomic_add_fetch(&next, 1, __ATOMIC_RELAXED);   /* "RGPU" << 32 | n */
}
