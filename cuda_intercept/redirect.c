/* rgpu's library redirector: an LD_AUDIT module that answers every look-up of a CUDA library rgpu
 * replaces with rgpu's own file, so the stock copy never loads.
 *
 * Why not LD_LIBRARY_PATH: torch loads its CUDA libraries by absolute path (ctypes.CDLL of
 * site-packages/nvidia/cu13/lib/libcublas.so.13) and through DT_RPATH, which is searched before
 * LD_LIBRARY_PATH.  The dynamic loader asks la_objsearch first (LA_SER_ORIG) for every request, by
 * name or by path, before any search, so a path returned here is what loads.
 *
 * rgpu's folder: $RGPU_LIBRARY_DIR, else this module's own folder (libraries.py builds them
 * together).  A replaced library missing from it is let through, with one line saying so.
 * RGPU_REDIRECT_DEBUG=1 prints every redirection.  This runs inside the loader, in the audit
 * namespace (a libc of its own), for every library every process loads: the paths are made once,
 * in la_version, and a look-up is a few string compares.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <limits.h>
#include <link.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* A request whose basename is `stem`, or `stem` + ".<major>" + anything, gets rgpu's `ours`.
 * Another major (libcudart.so.12) is left alone: its symbol versions are not ours. */
static struct {
    const char *stem, *major, *ours;
    char path[PATH_MAX];
    int present, warned;
} table[] = {
    {"libcuda.so", "", "libcuda.so.1"},             /* every driver name: libcuda.so.1, libcuda.so.580.159.04 */
    {"libcudart.so", "13", "libcudart.so.13"},
    {"libcublas.so", "13", "libcublas.so.13"},
    {"libcublasLt.so", "13", "libcublasLt.so.13"},
    {"libcudnn.so", "9", "libcudnn.so.9"},
};
enum { CUDNN = 4 };

static int debug;

/* What follows ".so" in a library's name: nothing (the linker's name), or "." + the major (any major where
 * `major` is empty) + nothing or ".<minor>..." */
static int tail_matches(const char *rest, const char *major) {
    if (!*rest) return 1;
    if (*rest != '.') return 0;
    rest++;
    if (!*major) return 1;
    size_t n = strlen(major);
    return strncmp(rest, major, n) == 0 && (rest[n] == 0 || rest[n] == '.');
}

static int matches(const char *base, const char *stem, const char *major) {
    size_t n = strlen(stem);
    return strncmp(base, stem, n) == 0 && tail_matches(base + n, major);
}

/* A copy vendored by a wheel under a hashed name (auditwheel: torchvision.libs/libcudart.faf08d9a.so.13, or
 * libcudart-faf08d9a.so.13): the stem without ".so", '.' or '-', the hash, ".so." and the major. Its importers
 * still ask for the stock version node (libcudart.so.13), which rgpu's library defines. */
static int vendored(const char *base, const char *stem, const char *major) {
    size_t n = strlen(stem) - 3;                        /* "libcudart" of "libcudart.so" */
    if (strncmp(base, stem, n) != 0 || (base[n] != '.' && base[n] != '-')) return 0;
    const char *hash = base + n + 1, *end = hash;
    while ((*end >= '0' && *end <= '9') || (*end >= 'a' && *end <= 'z') || (*end >= 'A' && *end <= 'Z')) end++;
    return end - hash >= 4 && strncmp(end, ".so.", 4) == 0 && tail_matches(end + 3, major);
}

/* cuDNN's sub-libraries (libcudnn_graph.so.9.19.0, the engines, libcudnn_ops.so.9) are loaded by the
 * stock libcudnn.so.9; rgpu's never asks for them.  Anyone else who does gets rgpu's libcudnn.so.9
 * (its exports refuse loudly), never a stock engine that would need the driver's private tables. */
static int cudnn_part(const char *base) {
    return strncmp(base, "libcudnn_", 9) == 0 && strstr(base, ".so.9") != NULL;
}

/* NVML counts and names the GPUs of *this* machine: torch's device_count() asks it first and would
 * report a laptop's own GPU (or none) instead of rgpu's.  Refused, torch falls back to the runtime's
 * count, which is rgpu's.  (A later NVML shim answering from the server would replace this.) */
static int nvml(const char *base) { return strncmp(base, "libnvidia-ml.so", 15) == 0; }

unsigned int la_version(unsigned int version) {
    const char *dir = getenv("RGPU_LIBRARY_DIR");
    char self[PATH_MAX];
    Dl_info info;
    debug = getenv("RGPU_REDIRECT_DEBUG") && *getenv("RGPU_REDIRECT_DEBUG") == '1';
    if (!dir || !*dir) {
        if (!dladdr((void *)&la_version, &info) || !info.dli_fname) return version;
        snprintf(self, sizeof self, "%s", info.dli_fname);
        char *slash = strrchr(self, '/');
        if (!slash) return version;
        *slash = 0;
        dir = self;
    }
    for (size_t i = 0; i < sizeof table / sizeof *table; i++) {
        snprintf(table[i].path, sizeof table[i].path, "%s/%s", dir, table[i].ours);
        table[i].present = access(table[i].path, R_OK) == 0;
    }
    /* the interface this module was built for; a loader that only knows an older one asks for that */
    return version < LAV_CURRENT ? version : LAV_CURRENT;
}

char *la_objsearch(const char *name, uintptr_t *cookie, unsigned int flag) {
    (void)cookie;
    const char *slash = strrchr(name, '/');
    const char *base = slash ? slash + 1 : name;
    if (nvml(base) && table[0].path[0]) {
        if (debug) fprintf(stderr, "rgpu-redirect: %s refused (NVML would describe this machine's GPUs)\n", name);
        return NULL;                                    /* the look-up fails: "cannot open shared object file" */
    }
    for (size_t i = 0; i < sizeof table / sizeof *table; i++) {
        if (!matches(base, table[i].stem, table[i].major) && !vendored(base, table[i].stem, table[i].major) &&
            !(i == CUDNN && cudnn_part(base)))
            continue;
        if (!table[i].path[0] || strcmp(name, table[i].path) == 0) return (char *)name;
        /* A vendored copy asked for by name is redirected at its search's first candidate, not here: the
         * loader then keeps the name asked for on the object it finds (rgpu's, often loaded already), and
         * an importer's version need on that file name (torchvision's _C.so on libcudart.<hash>.so.13)
         * finds it.  Replaced here, the name is lost and ld.so asserts in _dl_check_map_versions. */
        if (flag == LA_SER_ORIG && !slash && !matches(base, table[i].stem, table[i].major) &&
            vendored(base, table[i].stem, table[i].major))
            return (char *)name;
        if (!table[i].present) {
            if (!table[i].warned++)
                fprintf(stderr, "rgpu: %s is not built in rgpu's library folder (%s); the stock %s loads\n",
                        table[i].ours, table[i].path, base);
            return (char *)name;
        }
        if (debug) fprintf(stderr, "rgpu-redirect: %s (flag %#x) -> %s\n", name, flag, table[i].path);
        return table[i].path;
    }
    return (char *)name;
}
