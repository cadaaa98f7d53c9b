// A multi-stream pipeline: chunks copied in, transformed and copied out on 3 streams from pinned memory,
// a cross-stream event wait, and events timing the whole (printed as a bool: timings vary).
#include "check.h"

extern "C" __global__ void scale_shift(float *x, float a, float b, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = a * x[i] + b;
}

int main() {
    const int chunks = 6, chunk = 512, n = chunks * chunk, nstreams = 3;
    float *host, *dev;
    CHECK(cudaMallocHost(&host, n * sizeof(float)));
    CHECK(cudaMalloc(&dev, n * sizeof(float)));
    for (int i = 0; i < n; i++) host[i] = (i % 29) * 0.125f;
    cudaStream_t s[nstreams];
    for (int k = 0; k < nstreams; k++) CHECK(cudaStreamCreateWithFlags(&s[k], cudaStreamNonBlocking));
    cudaEvent_t start, stop, done0;
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&stop));
    CHECK(cudaEventCreateWithFlags(&done0, cudaEventDisableTiming));
    CHECK(cudaEventRecord(start, s[0]));
    for (int c = 0; c < chunks; c++) {
        cudaStream_t st = s[c % nstreams];
        float *d = dev + c * chunk, *h = host + c * chunk;
        CHECK(cudaMemcpyAsync(d, h, chunk * sizeof(float), cudaMemcpyHostToDevice, st));
        scale_shift<<<(chunk + 127) / 128, 128, 0, st>>>(d, 2.0f, (float)c, chunk);
        CHECK(cudaGetLastError());
        CHECK(cudaMemcpyAsync(h, d, chunk * sizeof(float), cudaMemcpyDeviceToHost, st));
    }
    // stream 0 finishes only after the others: their work joins it through events
    for (int k = 1; k < nstreams; k++) {
        CHECK(cudaEventRecord(done0, s[k]));
        CHECK(cudaStreamWaitEvent(s[0], done0, 0));
    }
    CHECK(cudaEventRecord(stop, s[0]));
    CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    CHECK(cudaDeviceSynchronize());
    std::printf("elapsed_positive %d\n", ms > 0.0f ? 1 : 0);
    print_floats("x", host, n);
    for (int k = 0; k < nstreams; k++) CHECK(cudaStreamDestroy(s[k]));
    CHECK(cudaEventDestroy(start));
    CHECK(cudaEventDestroy(stop));
    CHECK(cudaEventDestroy(done0));
    CHECK(cudaFree(dev));
    CHECK(cudaFreeHost(host));
    return 0;
}
