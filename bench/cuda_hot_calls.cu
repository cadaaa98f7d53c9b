// The runtime calls a CUDA program makes thousands of times per step, timed in a loop.
//
//   cuda_hot_calls N     prints one JSON line: nanoseconds per call of each, over N calls
//
// rgpu answers these in C from client state (no round trip, no Python); natively they are
// answered by the stock runtime. `rgpu bench cuda` runs this binary both ways.
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

extern "C" __global__ void noop(void) {}

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 1000000;
    int dev = -1, sink = 0;
    cudaStream_t stream;
    cudaStreamCaptureStatus status;
    if (cudaSetDevice(0) != cudaSuccess || cudaStreamCreate(&stream) != cudaSuccess) {
        fprintf(stderr, "hot_calls: no device: %s\n", cudaGetErrorString(cudaGetLastError()));
        return 1;
    }
    noop<<<1, 1, 0, stream>>>();          // the kernel's module loaded before timing
    cudaStreamSynchronize(stream);
    double t0 = now_ns();
    for (long i = 0; i < n; i++) { cudaGetDevice(&dev); sink += dev; }
    double t1 = now_ns();
    for (long i = 0; i < n; i++) sink += (int)cudaGetLastError();
    double t2 = now_ns();
    for (long i = 0; i < n; i++) { cudaStreamIsCapturing(stream, &status); sink += (int)status; }
    double t3 = now_ns();
    long launches = n / 100;
    for (long i = 0; i < launches; i++) noop<<<1, 1, 0, stream>>>();
    double t4 = now_ns();
    cudaError_t rc = cudaStreamSynchronize(stream);
    double t5 = now_ns();
    printf("{\"cudaGetDevice_ns\": %.2f, \"cudaGetLastError_ns\": %.2f, \"cudaStreamIsCapturing_ns\": %.2f, "
           "\"launch_enqueue_ns\": %.1f, \"sync_after_launches_us\": %.1f, \"status\": %d, \"sink\": %d}\n",
           (t1 - t0) / n, (t2 - t1) / n, (t3 - t2) / n, (t4 - t3) / launches, (t5 - t4) / 1e3, (int)rc, sink & 1);
    return rc == cudaSuccess ? 0 : 2;
}
