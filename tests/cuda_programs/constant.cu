// cudaMemcpyToSymbol into __constant__ memory: y = c0 + c1*x + c2*x^2 + c3*x^3 (Horner), coefficients as a symbol.
#include "check.h"

__constant__ float coeffs[4];

extern "C" __global__ void poly3(const float *x, float *y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float v = x[i];
        y[i] = ((coeffs[3] * v + coeffs[2]) * v + coeffs[1]) * v + coeffs[0];
    }
}

int main() {
    const int n = 300;
    float x[n], y[n];
    for (int i = 0; i < n; i++) x[i] = (i - 150) * 0.01f;
    const float c[4] = {1.0f, -0.5f, 0.25f, 2.0f};
    CHECK(cudaMemcpyToSymbol(coeffs, c, sizeof c));
    float back[4];
    CHECK(cudaMemcpyFromSymbol(back, coeffs, sizeof back));
    float *dx, *dy;
    CHECK(cudaMalloc(&dx, sizeof x));
    CHECK(cudaMalloc(&dy, sizeof y));
    CHECK(cudaMemcpy(dx, x, sizeof x, cudaMemcpyHostToDevice));
    poly3<<<(n + 127) / 128, 128>>>(dx, dy, n);
    CHECK(cudaGetLastError());
    CHECK(cudaMemcpy(y, dy, sizeof y, cudaMemcpyDeviceToHost));
    print_floats("coeffs", back, 4);
    print_floats("y", y, n);
    CHECK(cudaFree(dx));
    CHECK(cudaFree(dy));
    return 0;
}
