/* What every rgpu stand-in for an NVIDIA math library shares (libcublas.so.13, libcublasLt.so.13, libcudnn.so.9).
 *
 * A library is stub.c + its hand-written bodies (stub_<lib>.c) + the stubs stubs.py generates for
 * every other export of the stock library.  Everything is hidden except RGPU_API names, which the
 * version script puts under the library's node.  A generated file defines RGPU_LIB (the SONAME) and
 * RGPU_NOT_SUPPORTED (the library's "not supported" status) before including this header.
 */
#ifndef RGPU_STUB_H
#define RGPU_STUB_H
#include <stddef.h>

#define RGPU_API __attribute__((visibility("default")))
#define RGPU_HIDDEN __attribute__((visibility("hidden")))

/* Log "rgpu: NAME (LIB) is not supported over rgpu yet" once per name, remember it for the
 * library's last-error call, and return status. */
RGPU_HIDDEN int rgpu_stub_refuse(const char *name, const char *lib, int *said, int status);
/* The last refusal on this thread, "" when none. */
RGPU_HIDDEN const char *rgpu_stub_last(void);
RGPU_HIDDEN void rgpu_stub_clear(void);

/* A stub that returns a status.  Declared without parameters: on the C calling conventions we
 * build for, a callee that ignores its arguments is called correctly whatever the caller passes. */
#define RGPU_STUB(name) \
    RGPU_API int name(void) { static int said; return rgpu_stub_refuse(#name, RGPU_LIB, &said, RGPU_NOT_SUPPORTED); }

/* A stub for a function that returns a value, not a status (cuBLAS's legacy dot products, norms):
 * it still says so once, and returns ``value``. */
#define RGPU_STUB_AS(type, name, value) \
    RGPU_API type name(void) { static int said; rgpu_stub_refuse(#name, RGPU_LIB, &said, 0); return value; }

#endif
