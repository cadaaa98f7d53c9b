// Shared by the test programs: stop at the first failing runtime call, naming it.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

#define CHECK(call)                                                                  \
    do {                                                                             \
        cudaError_t err_ = (call);                                                   \
        if (err_ != cudaSuccess) {                                                   \
            std::printf("error %s: %s (%d)\n", #call, cudaGetErrorString(err_),      \
                        (int)err_);                                                  \
            std::exit(1);                                                            \
        }                                                                            \
    } while (0)

// One labelled line of floats, exact enough (%.9g) for a test to compare with numpy.
static void print_floats(const char *label, const float *v, int n) {
    std::printf("%s", label);
    for (int i = 0; i < n; i++) std::printf(" %.9g", v[i]);
    std::printf("\n");
}
