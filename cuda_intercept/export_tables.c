/* The driver's private export tables (cuGetExportTable), served in C so that a program carrying the CUDA
 * runtime linked statically (nvcc's default `-cudart static`; CuPy's wheels) runs through rgpu.
 *
 * A static runtime asks the driver for tables of function pointers by UUID and calls them for what the
 * public API lacks: loading its fatbins, the primary context, per-context storage, an integrity check.
 * Each slot served here maps onto rgpu's own driver entry points (the exported wrappers, later in this
 * translation unit), so the rest travels as every driver call does.  The tables' layout is what the ZLUDA
 * project reverse-engineered (dark_api/src/lib.rs); this is rgpu's own C.  Every slot not written here is
 * a stub that says which table and slot was called and fails (CUDA_ERROR_NOT_SUPPORTED): never silent.
 * A UUID not known here is refused by shim.c's message, which names the library that asked.
 */
#include <sys/types.h>
#include <unistd.h>
#include "export_tables.h"      /* the integrity hash */

#define RGPU_XT_SLOTS 32          /* slots per table: more than the runtime uses; the rest are loud stubs */

static CUresult rgpu_xt_missing(const char *table, int slot) {
    static char said[16][RGPU_XT_SLOTS];
    static const char *names[16];
    int t = 0;
    pthread_mutex_lock(&rgpu_lock);
    while (t < 15 && names[t] && names[t] != table) t++;
    names[t] = table;
    int first = !said[t][slot];
    said[t][slot] = 1;
    pthread_mutex_unlock(&rgpu_lock);
    if (first)
        fprintf(stderr, "rgpu: the driver's private table %s, slot %d, was called: rgpu does not implement it "
                        "(CUDA_ERROR_NOT_SUPPORTED)\n", table, slot);
    return CUDA_ERROR_NOT_SUPPORTED;
}

/* One stub per (table, slot): the SysV ABI lets a function taking nothing stand for any signature. */
#define RGPU_XT_STUB(tab, i) static CUresult rgpu_xt_##tab##_##i(void) { return rgpu_xt_missing(#tab, i); }
#define RGPU_XT_STUBS(tab) \
    RGPU_XT_STUB(tab, 0) RGPU_XT_STUB(tab, 1) RGPU_XT_STUB(tab, 2) RGPU_XT_STUB(tab, 3) RGPU_XT_STUB(tab, 4) \
    RGPU_XT_STUB(tab, 5) RGPU_XT_STUB(tab, 6) RGPU_XT_STUB(tab, 7) RGPU_XT_STUB(tab, 8) RGPU_XT_STUB(tab, 9) \
    RGPU_XT_STUB(tab, 10) RGPU_XT_STUB(tab, 11) RGPU_XT_STUB(tab, 12) RGPU_XT_STUB(tab, 13) RGPU_XT_STUB(tab, 14) \
    RGPU_XT_STUB(tab, 15) RGPU_XT_STUB(tab, 16) RGPU_XT_STUB(tab, 17) RGPU_XT_STUB(tab, 18) RGPU_XT_STUB(tab, 19) \
    RGPU_XT_STUB(tab, 20) RGPU_XT_STUB(tab, 21) RGPU_XT_STUB(tab, 22) RGPU_XT_STUB(tab, 23) RGPU_XT_STUB(tab, 24) \
    RGPU_XT_STUB(tab, 25) RGPU_XT_STUB(tab, 26) RGPU_XT_STUB(tab, 27) RGPU_XT_STUB(tab, 28) RGPU_XT_STUB(tab, 29) \
    RGPU_XT_STUB(tab, 30) RGPU_XT_STUB(tab, 31)
#define RGPU_XT_FILL(tab) { \
    (void *)rgpu_xt_##tab##_0, (void *)rgpu_xt_##tab##_1, (void *)rgpu_xt_##tab##_2, (void *)rgpu_xt_##tab##_3, \
    (void *)rgpu_xt_##tab##_4, (void *)rgpu_xt_##tab##_5, (void *)rgpu_xt_##tab##_6, (void *)rgpu_xt_##tab##_7, \
    (void *)rgpu_xt_##tab##_8, (void *)rgpu_xt_##tab##_9, (void *)rgpu_xt_##tab##_10, (void *)rgpu_xt_##tab##_11, \
    (void *)rgpu_xt_##tab##_12, (void *)rgpu_xt_##tab##_13, (void *)rgpu_xt_##tab##_14, (void *)rgpu_xt_##tab##_15, \
    (void *)rgpu_xt_##tab##_16, (void *)rgpu_xt_##tab##_17, (void *)rgpu_xt_##tab##_18, (void *)rgpu_xt_##tab##_19, \
    (void *)rgpu_xt_##tab##_20, (void *)rgpu_xt_##tab##_21, (void *)rgpu_xt_##tab##_22, (void *)rgpu_xt_##tab##_23, \
    (void *)rgpu_xt_##tab##_24, (void *)rgpu_xt_##tab##_25, (void *)rgpu_xt_##tab##_26, (void *)rgpu_xt_##tab##_27, \
    (void *)rgpu_xt_##tab##_28, (void *)rgpu_xt_##tab##_29, (void *)rgpu_xt_##tab##_30, (void *)rgpu_xt_##tab##_31 }

RGPU_XT_STUBS(CUDART_INTERFACE)
RGPU_XT_STUBS(TOOLS_TLS)
RGPU_XT_STUBS(TOOLS_RUNTIME_CALLBACK_HOOKS)
RGPU_XT_STUBS(CONTEXT_LOCAL_STORAGE)
RGPU_XT_STUBS(CTX_CREATE_BYPASS)
RGPU_XT_STUBS(HEAP_ACCESS)
RGPU_XT_STUBS(DEVICE_EXTENDED_RT)
RGPU_XT_STUBS(INTEGRITY_CHECK)
RGPU_XT_STUBS(CONTEXT_CHECKS)

static void *xt_cudart[RGPU_XT_SLOTS] = RGPU_XT_FILL(CUDART_INTERFACE);
static void *xt_tools_tls[RGPU_XT_SLOTS] = RGPU_XT_FILL(TOOLS_TLS);
static void *xt_hooks[RGPU_XT_SLOTS] = RGPU_XT_FILL(TOOLS_RUNTIME_CALLBACK_HOOKS);
static void *xt_cls[RGPU_XT_SLOTS] = RGPU_XT_FILL(CONTEXT_LOCAL_STORAGE);
static void *xt_bypass[RGPU_XT_SLOTS] = RGPU_XT_FILL(CTX_CREATE_BYPASS);
static void *xt_heap[RGPU_XT_SLOTS] = RGPU_XT_FILL(HEAP_ACCESS);
static void *xt_devext[RGPU_XT_SLOTS] = RGPU_XT_FILL(DEVICE_EXTENDED_RT);
static void *xt_integrity[RGPU_XT_SLOTS] = RGPU_XT_FILL(INTEGRITY_CHECK);
static void *xt_checks[RGPU_XT_SLOTS] = RGPU_XT_FILL(CONTEXT_CHECKS);

/* ---- CUDART_INTERFACE: the runtime's fatbins and primary contexts ------------------------------------- */
struct rgpu_fatbin_wrapper { uint32_t magic, version; const void *data; const void *filename; };

/* The runtime hands its fatbin wrapper (or, in _ext2, the container); the driver layer reads either, by
 * content (the server keeps each image once). */
static CUresult xt_module_from_cubin(CUmodule *mod, const struct rgpu_fatbin_wrapper *w) {
    if (!mod || !w) return CUDA_ERROR_INVALID_VALUE;
    return cuModuleLoadData(mod, w);
}

static CUresult xt_module_from_cubin_ext1(CUmodule *mod, const struct rgpu_fatbin_wrapper *w, void *a3, void *a4,
                                          unsigned a5) {
    (void)a3; (void)a4; (void)a5;     /* seen NULL, NULL, 0; what else they carry is unknown (ZLUDA refuses it) */
    return xt_module_from_cubin(mod, w);
}

static CUresult xt_module_from_cubin_ext2(const void *fatbin, CUmodule *mod, void *a3, void *a4, unsigned a5) {
    (void)a3; (void)a4; (void)a5;
    if (!mod || !fatbin) return CUDA_ERROR_INVALID_VALUE;
    return cuModuleLoadData(mod, fatbin);
}

/* The device's primary context, retained once per device (the runtime never releases it either). */
static CUresult xt_primary_ctx(CUcontext *pctx, CUdevice dev) {
    static CUcontext primary[64];
    CUresult r = CUDA_SUCCESS;
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    if (dev < 0 || dev >= 64) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&rgpu_lock);
    CUcontext c = primary[dev];
    pthread_mutex_unlock(&rgpu_lock);
    if (!c && (r = cuDevicePrimaryCtxRetain(&c, dev)) == CUDA_SUCCESS) {
        pthread_mutex_lock(&rgpu_lock);
        primary[dev] = c;
        pthread_mutex_unlock(&rgpu_lock);
    }
    *pctx = c;
    return r;
}

static void xt_nothing(void *arg) { (void)arg; }                  /* slot 7: a notification */
static CUresult xt_load_compilers(void) { return CUDA_SUCCESS; }  /* slot 12: the driver's JIT is the server's */

/* ---- TOOLS_RUNTIME_CALLBACK_HOOKS: buffers the runtime writes its tool hooks into (no tool reads them) --- */
static uint32_t xt_hook_buf1[1024], xt_hook_buf2[14];
static void xt_hook_buffer1(void **p, size_t *n) { *p = xt_hook_buf1; *n = 1024; }
static void xt_hook_buffer2(void **p, size_t *n) { *p = xt_hook_buf2; *n = 14; }

/* ---- CONTEXT_LOCAL_STORAGE: (context, key) -> value, with the destructor the runtime gives ----------- */
typedef void (*xt_cls_dtor)(CUcontext, void *, void *);
struct xt_cls_entry { CUcontext ctx; void *key, *value; xt_cls_dtor dtor; };
static struct xt_cls_entry xt_cls_entries[256];

static CUresult xt_cls_ctx(CUcontext *ctx) {
    if (*ctx) return CUDA_SUCCESS;
    CUresult r = cuCtxGetCurrent(ctx);
    return r != CUDA_SUCCESS ? r : *ctx ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

static struct xt_cls_entry *xt_cls_find(CUcontext ctx, void *key, int make) {
    struct xt_cls_entry *free_one = NULL;
    for (int i = 0; i < 256; i++) {
        struct xt_cls_entry *e = &xt_cls_entries[i];
        if (e->ctx == ctx && e->key == key) return e;
        if (!e->ctx && !free_one) free_one = e;
    }
    return make ? free_one : NULL;
}

static CUresult xt_cls_put(CUcontext ctx, void *key, void *value, xt_cls_dtor dtor) {
    CUresult r = xt_cls_ctx(&ctx);
    if (r != CUDA_SUCCESS) return r;
    pthread_mutex_lock(&rgpu_lock);
    struct xt_cls_entry *e = xt_cls_find(ctx, key, 1);
    if (e) *e = (struct xt_cls_entry){ctx, key, value, dtor};
    pthread_mutex_unlock(&rgpu_lock);
    if (!e) fprintf(stderr, "rgpu: context-local storage is full (256 entries)\n");
    return e ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

static CUresult xt_cls_delete(CUcontext ctx, void *key) {
    CUresult r = xt_cls_ctx(&ctx);
    if (r != CUDA_SUCCESS) return r;
    pthread_mutex_lock(&rgpu_lock);
    struct xt_cls_entry *e = xt_cls_find(ctx, key, 0);
    if (e) memset(e, 0, sizeof *e);
    pthread_mutex_unlock(&rgpu_lock);
    return CUDA_SUCCESS;
}

static CUresult xt_cls_get(void **value, CUcontext ctx, void *key) {
    CUresult r = xt_cls_ctx(&ctx);
    if (r != CUDA_SUCCESS) return r;
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&rgpu_lock);
    struct xt_cls_entry *e = xt_cls_find(ctx, key, 0);
    if (e) *value = e->value;
    pthread_mutex_unlock(&rgpu_lock);
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;   /* the runtime asks first, then puts */
}

/* ---- INTEGRITY_CHECK ---------------------------------------------------------------------------------- */
static CUresult xt_integrity_check(uint32_t version, uint64_t unix_seconds, uint64_t out[2]) {
    struct rgpu_ih_device devs[16];
    int driver = 0, n = 0;
    CUresult r;
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    if ((r = cuDriverGetVersion(&driver)) != CUDA_SUCCESS || (r = cuDeviceGetCount(&n)) != CUDA_SUCCESS) return r;
    if (n > 16) n = 16;
    for (int d = 0; d < n; d++) {
        CUuuid id;
        if ((r = cuDeviceGetUuid_v2(&id, d)) != CUDA_SUCCESS) return r;
        memcpy(devs[d].uuid, id.bytes, 16);
        if ((r = cuDeviceGetAttribute(&devs[d].pci_domain, CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID, d)) != CUDA_SUCCESS ||
            (r = cuDeviceGetAttribute(&devs[d].pci_bus, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, d)) != CUDA_SUCCESS ||
            (r = cuDeviceGetAttribute(&devs[d].pci_device, CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID, d)) != CUDA_SUCCESS)
            return r;
    }
    struct rgpu_ih_input in = {(uint32_t)driver, version, (uint32_t)getpid(), (uint32_t)(uintptr_t)pthread_self(),
                               (uint64_t)(uintptr_t)xt_cudart, (uint64_t)(uintptr_t)xt_integrity,
                               (uint64_t)(uintptr_t)xt_integrity[1], unix_seconds};
    rgpu_integrity_hash(&in, devs, n, out);
    return CUDA_SUCCESS;
}

/* ---- CONTEXT_CHECKS: flags that are never set on a context rgpu makes ------------------------------------ */
static CUresult xt_context_check(CUcontext ctx, uint32_t *flags, const void **p) {
    (void)ctx; (void)p;
    if (flags) *flags = 0;
    return CUDA_SUCCESS;
}
static uint32_t xt_check3(void) { return 0; }

/* ---- the tables by UUID ------------------------------------------------------------------------------- */
struct rgpu_xtable { const char *name; uint8_t id[16]; void **slots; int sized; };
static const struct rgpu_xtable rgpu_xtables[] = {
    {"CUDART_INTERFACE", {0x6b, 0xd5, 0xfb, 0x6c, 0x5b, 0xf4, 0xe7, 0x4a, 0x89, 0x87, 0xd9, 0x39, 0x12, 0xfd, 0x9d, 0xf9},
     xt_cudart, 1},
    {"TOOLS_TLS", {0x42, 0xd8, 0x5a, 0x81, 0x23, 0xf6, 0xcb, 0x47, 0x82, 0x98, 0xf6, 0xe7, 0x8a, 0x3a, 0xec, 0xdc},
     xt_tools_tls, 1},
    {"TOOLS_RUNTIME_CALLBACK_HOOKS",
     {0xa0, 0x94, 0x79, 0x8c, 0x2e, 0x74, 0x2e, 0x74, 0x93, 0xf2, 0x08, 0x00, 0x20, 0x0c, 0x0a, 0x66}, xt_hooks, 1},
    {"CONTEXT_LOCAL_STORAGE", {0xc6, 0x93, 0x33, 0x6e, 0x11, 0x21, 0xdf, 0x11, 0xa8, 0xc3, 0x68, 0xf3, 0x55, 0xd8,
                               0x95, 0x93}, xt_cls, 0},
    {"CTX_CREATE_BYPASS", {0x0c, 0xa5, 0x0b, 0x8c, 0x10, 0x04, 0x92, 0x9a, 0x89, 0xa7, 0xd0, 0xdf, 0x10, 0xe7, 0x72,
                           0x86}, xt_bypass, 1},
    {"HEAP_ACCESS", {0x19, 0x5b, 0xcb, 0xf4, 0xd6, 0x7d, 0x02, 0x4a, 0xac, 0xc5, 0x1d, 0x29, 0xce, 0xa6, 0x31, 0xae},
     xt_heap, 1},
    {"DEVICE_EXTENDED_RT", {0xb1, 0x05, 0x41, 0xe1, 0xf7, 0xc7, 0xc7, 0x4a, 0x9f, 0x64, 0xf2, 0x23, 0xbe, 0x99, 0xf1,
                            0xe2}, xt_devext, 1},
    {"INTEGRITY_CHECK", {0xd4, 0x08, 0x20, 0x55, 0xbd, 0xe6, 0x70, 0x4b, 0x8d, 0x34, 0xba, 0x12, 0x3c, 0x66, 0xe1, 0xf2},
     xt_integrity, 1},
    {"CONTEXT_CHECKS", {0x26, 0x3e, 0x88, 0x60, 0x7c, 0xd2, 0x61, 0x43, 0x92, 0xf6, 0xbb, 0xd5, 0x00, 0x6d, 0xfa, 0x7e},
     xt_checks, 1},
};

/* Slot 0 of most tables is its size in bytes, not a function. */
__attribute__((constructor)) static void rgpu_xt_fill(void) {
    for (size_t i = 0; i < sizeof rgpu_xtables / sizeof *rgpu_xtables; i++)
        if (rgpu_xtables[i].sized) rgpu_xtables[i].slots[0] = (void *)(uintptr_t)(RGPU_XT_SLOTS * sizeof(void *));
    xt_cudart[1] = (void *)xt_module_from_cubin;
    xt_cudart[2] = (void *)xt_primary_ctx;
    xt_cudart[6] = (void *)xt_module_from_cubin_ext1;
    xt_cudart[7] = (void *)xt_nothing;
    xt_cudart[8] = (void *)xt_module_from_cubin_ext2;
    xt_cudart[12] = (void *)xt_load_compilers;
    xt_hooks[2] = (void *)xt_hook_buffer1;
    xt_hooks[6] = (void *)xt_hook_buffer2;
    xt_cls[0] = (void *)xt_cls_put;
    xt_cls[1] = (void *)xt_cls_delete;
    xt_cls[2] = (void *)xt_cls_get;
    xt_integrity[1] = (void *)xt_integrity_check;
    xt_checks[2] = (void *)xt_context_check;
    xt_checks[3] = (void *)xt_check3;
}

/* The slots of the table for `id`, or NULL (then shim.c refuses, naming the caller). */
static void **rgpu_export_slots(const CUuuid *id) {
    for (size_t i = 0; id && i < sizeof rgpu_xtables / sizeof *rgpu_xtables; i++)
        if (!memcmp(rgpu_xtables[i].id, id->bytes, 16)) return rgpu_xtables[i].slots;
    return NULL;
}
