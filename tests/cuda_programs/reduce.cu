// A shared-memory reduction: per-block partial sums (dynamic shared memory), then one block sums the partials.
#include "check.h"

extern "C" __global__ void block_sum(const float *in, float *out, int n) {
    extern __shared__ float s[];
    unsigned tid = threadIdx.x, i = blockIdx.x * blockDim.x + threadIdx.x;
    s[tid] = i < (unsigned)n ? in[i] : 0.0f;
    __syncthreads();
    for (unsigned stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (tid < stride) s[tid] += s[tid + stride];
        __syncthreads();
    }
    if (tid == 0) out[blockIdx.x] = s[0];
}

int main() {
    const int n = 10000, block = 256, blocks = (n + block - 1) / block;   // 40 blocks
    static float x[n];
    for (int i = 0; i < n; i++) x[i] = ((i * 7) % 13) * 0.5f - 3.0f;
    float *dx, *dpart, *dtotal;
    CHECK(cudaMalloc(&dx, n * sizeof(float)));
    CHECK(cudaMalloc(&dpart, blocks * sizeof(float)));
    CHECK(cudaMalloc(&dtotal, sizeof(float)));
    CHECK(cudaMemcpy(dx, x, n * sizeof(float), cudaMemcpyHostToDevice));
    block_sum<<<blocks, block, block * sizeof(float)>>>(dx, dpart, n);
    CHECK(cudaGetLastError());
    block_sum<<<1, 64, 64 * sizeof(float)>>>(dpart, dtotal, blocks);
    CHECK(cudaGetLastError());
    float part[blocks], total;
    CHECK(cudaMemcpy(part, dpart, sizeof part, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(&total, dtotal, sizeof total, cudaMemcpyDeviceToHost));
    print_floats("partials", part, blocks);
    print_floats("total", &total, 1);
    CHECK(cudaFree(dx));
    CHECK(cudaFree(dpart));
    CHECK(cudaFree(dtotal));
    return 0;
}
