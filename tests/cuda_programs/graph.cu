// A captured graph replayed: two kernels captured on a stream (x = 0.5*x + 1; y = 2*x + y), launched 10 times.
#include "check.h"

extern "C" __global__ void scale_shift(float *x, float a, float b, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = a * x[i] + b;
}

extern "C" __global__ void saxpy(float a, const float *x, float *y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}

int main() {
    const int n = 700, replays = 10;
    float x[n], y[n];
    for (int i = 0; i < n; i++) { x[i] = (i % 11) * 1.5f; y[i] = -(float)(i % 3); }
    float *dx, *dy;
    CHECK(cudaMalloc(&dx, sizeof x));
    CHECK(cudaMalloc(&dy, sizeof y));
    CHECK(cudaMemcpy(dx, x, sizeof x, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(dy, y, sizeof y, cudaMemcpyHostToDevice));
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    scale_shift<<<(n + 255) / 256, 256, 0, s>>>(dx, 0.5f, 1.0f, n);
    saxpy<<<(n + 255) / 256, 256, 0, s>>>(2.0f, dx, dy, n);
    CHECK(cudaStreamEndCapture(s, &graph));
    size_t nodes = 0;
    CHECK(cudaGraphGetNodes(graph, nullptr, &nodes));
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int r = 0; r < replays; r++) CHECK(cudaGraphLaunch(exec, s));
    CHECK(cudaStreamSynchronize(s));
    CHECK(cudaMemcpy(x, dx, sizeof x, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(y, dy, sizeof y, cudaMemcpyDeviceToHost));
    std::printf("nodes %zu\n", nodes);
    print_floats("x", x, n);
    print_floats("y", y, n);
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(graph));
    CHECK(cudaStreamDestroy(s));
    CHECK(cudaFree(dx));
    CHECK(cudaFree(dy));
    return 0;
}
