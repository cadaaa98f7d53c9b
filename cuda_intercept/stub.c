/* The refusal every rgpu math-library stub returns through: said once per name, kept for the last-error call. */
#include <stdio.h>
#include <string.h>

#include "stub.h"

static __thread char last[256];

int rgpu_stub_refuse(const char *name, const char *lib, int *said, int status) {
    snprintf(last, sizeof last, "rgpu: %s (%s) is not supported over rgpu yet", name, lib);
    /* once per name, from any thread; stderr is unbuffered, so the line is whole */
    if (!__atomic_exchange_n(said, 1, __ATOMIC_RELAXED))
        fprintf(stderr, "%s\n", last);
    return status;
}

const char *rgpu_stub_last(void) { return last; }

void rgpu_stub_clear(void) { last[0] = 0; }
