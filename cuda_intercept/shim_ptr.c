/* Pointer attributes of this process's device allocations, answered in C.
 *
 * Python notes each allocation (rgpu_alloc_note); frees forget them here, in C
 * when queued (shim_queue.c) or from Python.  This is the process's only table
 * of device allocations: Python's face on it is calls_memory.Allocations.  A
 * query about any other pointer (host memory, unknown addresses) goes to
 * Python, which knows the page-locked host allocations too.
 */
struct rgpu_alloc { uint64_t base, size, ctx, id; int dev; };
static struct rgpu_alloc *rgpu_allocs;  /* sorted by base */
static size_t rgpu_nalloc, rgpu_alloc_cap;

static size_t rgpu_alloc_index(uint64_t p) {  /* first allocation whose base is > p */
    size_t lo = 0, hi = rgpu_nalloc;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (rgpu_allocs[mid].base <= p) lo = mid + 1; else hi = mid;
    }
    return lo;
}

/* 0 when out of memory (Python fails the allocation's call: this table is the only one). */
static int rgpu_alloc_note(uint64_t base, uint64_t size, uint64_t ctx, int dev, uint64_t id) {
    pthread_mutex_lock(&rgpu_lock);
    if (rgpu_nalloc == rgpu_alloc_cap) {
        size_t cap = rgpu_alloc_cap ? 2 * rgpu_alloc_cap : 256;
        struct rgpu_alloc *t = realloc(rgpu_allocs, cap * sizeof *t);
        if (!t) { pthread_mutex_unlock(&rgpu_lock); return 0; }
        rgpu_allocs = t;
        rgpu_alloc_cap = cap;
    }
    size_t i = rgpu_alloc_index(base);
    memmove(rgpu_allocs + i + 1, rgpu_allocs + i, (rgpu_nalloc - i) * sizeof *rgpu_allocs);
    rgpu_allocs[i] = (struct rgpu_alloc){base, size, ctx, id, dev};
    rgpu_nalloc++;
    pthread_mutex_unlock(&rgpu_lock);
    return 1;
}

/* Whether `base` was an allocation's start (it is forgotten): a free queued in C asks, as Python's does. */
static int rgpu_alloc_forget(uint64_t base) {
    int found = 0;
    pthread_mutex_lock(&rgpu_lock);
    size_t i = rgpu_alloc_index(base);
    if (i > 0 && rgpu_allocs[i - 1].base == base) {
        memmove(rgpu_allocs + i - 1, rgpu_allocs + i, (rgpu_nalloc - i) * sizeof *rgpu_allocs);
        rgpu_nalloc--;
        found = 1;
    }
    pthread_mutex_unlock(&rgpu_lock);
    return found;
}

/* The allocation holding `p`: out = {base, size, ctx, device, buffer id}; 0 when none does. */
static int rgpu_alloc_find(uint64_t p, uint64_t *out) {
    pthread_mutex_lock(&rgpu_lock);
    size_t i = rgpu_alloc_index(p);
    int found = i > 0 && p < rgpu_allocs[i - 1].base + rgpu_allocs[i - 1].size;
    if (found) {
        struct rgpu_alloc *a = &rgpu_allocs[i - 1];
        out[0] = a->base, out[1] = a->size, out[2] = a->ctx, out[3] = (uint64_t)a->dev, out[4] = a->id;
    }
    pthread_mutex_unlock(&rgpu_lock);
    return found;
}

static CUresult rgpu_fast_cuPointerGetAttribute(void *data, CUpointer_attribute attr, CUdeviceptr ptr) {
    struct rgpu_alloc a;
    if (!rgpu_initialized || !data) return RGPU_PY;
    pthread_mutex_lock(&rgpu_lock);
    size_t i = rgpu_alloc_index(ptr);
    int found = i > 0 && ptr < rgpu_allocs[i - 1].base + rgpu_allocs[i - 1].size;
    if (found) a = rgpu_allocs[i - 1];
    pthread_mutex_unlock(&rgpu_lock);
    if (!found) return RGPU_PY;
    switch ((int)attr) {
    case CU_POINTER_ATTRIBUTE_CONTEXT: *(CUcontext *)data = (CUcontext)(uintptr_t)a.ctx; break;
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE: *(unsigned int *)data = CU_MEMORYTYPE_DEVICE; break;
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER: *(CUdeviceptr *)data = ptr; break;
    case CU_POINTER_ATTRIBUTE_SYNC_MEMOPS: *(int *)data = 1; break;
    case CU_POINTER_ATTRIBUTE_BUFFER_ID: *(unsigned long long *)data = a.id; break;
    case CU_POINTER_ATTRIBUTE_IS_MANAGED: *(int *)data = 0; break;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: *(int *)data = a.dev; break;
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: *(CUdeviceptr *)data = a.base; break;
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE: *(size_t *)data = a.size; break;
    case CU_POINTER_ATTRIBUTE_MAPPED: *(int *)data = 1; break;
    default: return RGPU_PY;              /* the rarer ones: Python's table */
    }
    return CUDA_SUCCESS;
}
