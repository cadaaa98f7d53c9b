/* A CUDA C program on the driver API, unchanged whether it runs on a GPU or through rgpu's libcuda.so.1.
 *
 *   demo_vecadd            allocate, copy, load PTX, launch (kernelParams, extra, cuLaunchKernelEx),
 *                          capture a stream into a graph and replay it, copy back, check; prints OK
 *   demo_vecadd bench N    JSON timings: a round trip, N launches + synchronise, a 64 MiB host-to-device copy
 *
 * Kernels (extern "C", compiled to PTX with nvcc -ptx -arch=compute_75): vecAdd, saxpy, noop.
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static const char *PTX =
    ".version 7.5\n"
    ".target sm_75\n"
    ".address_size 64\n"
    "\n"
    "	// .globl	vecAdd\n"
    "\n"
    ".visible .entry vecAdd(\n"
    "	.param .u64 vecAdd_param_0,\n"
    "	.param .u64 vecAdd_param_1,\n"
    "	.param .u64 vecAdd_param_2,\n"
    "	.param .u32 vecAdd_param_3\n"
    ")\n"
    "{\n"
    "	.reg .pred 	%p<2>;\n"
    "	.reg .f32 	%f<4>;\n"
    "	.reg .b32 	%r<6>;\n"
    "	.reg .b64 	%rd<11>;\n"
    "\n"
    "\n"
    "	ld.param.u64 	%rd1, [vecAdd_param_0];\n"
    "	ld.param.u64 	%rd2, [vecAdd_param_1];\n"
    "	ld.param.u64 	%rd3, [vecAdd_param_2];\n"
    "	ld.param.u32 	%r2, [vecAdd_param_3];\n"
    "	mov.u32 	%r3, %ctaid.x;\n"
    "	mov.u32 	%r4, %ntid.x;\n"
    "	mov.u32 	%r5, %tid.x;\n"
    "	mad.lo.s32 	%r1, %r3, %r4, %r5;\n"
    "	setp.ge.s32 	%p1, %r1, %r2;\n"
    "	@%p1 bra 	$L__BB0_2;\n"
    "\n"
    "	cvta.to.global.u64 	%rd4, %rd1;\n"
    "	mul.wide.s32 	%rd5, %r1, 4;\n"
    "	add.s64 	%rd6, %rd4, %rd5;\n"
    "	cvta.to.global.u64 	%rd7, %rd2;\n"
    "	add.s64 	%rd8, %rd7, %rd5;\n"
    "	ld.global.f32 	%f1, [%rd8];\n"
    "	ld.global.f32 	%f2, [%rd6];\n"
    "	add.f32 	%f3, %f2, %f1;\n"
    "	cvta.to.global.u64 	%rd9, %rd3;\n"
    "	add.s64 	%rd10, %rd9, %rd5;\n"
    "	st.global.f32 	[%rd10], %f3;\n"
    "\n"
    "$L__BB0_2:\n"
    "	ret;\n"
    "\n"
    "}\n"
    "	// .globl	saxpy\n"
    ".visible .entry saxpy(\n"
    "	.param .f32 saxpy_param_0,\n"
    "	.param .u64 saxpy_param_1,\n"
    "	.param .u64 saxpy_param_2,\n"
    "	.param .u32 saxpy_param_3\n"
    ")\n"
    "{\n"
    "	.reg .pred 	%p<2>;\n"
    "	.reg .f32 	%f<5>;\n"
    "	.reg .b32 	%r<6>;\n"
    "	.reg .b64 	%rd<8>;\n"
    "\n"
    "\n"
    "	ld.param.f32 	%f1, [saxpy_param_0];\n"
    "	ld.param.u64 	%rd1, [saxpy_param_1];\n"
    "	ld.param.u64 	%rd2, [saxpy_param_2];\n"
    "	ld.param.u32 	%r2, [saxpy_param_3];\n"
    "	mov.u32 	%r3, %ctaid.x;\n"
    "	mov.u32 	%r4, %ntid.x;\n"
    "	mov.u32 	%r5, %tid.x;\n"
    "	mad.lo.s32 	%r1, %r3, %r4, %r5;\n"
    "	setp.ge.s32 	%p1, %r1, %r2;\n"
    "	@%p1 bra 	$L__BB1_2;\n"
    "\n"
    "	cvta.to.global.u64 	%rd3, %rd2;\n"
    "	cvta.to.global.u64 	%rd4, %rd1;\n"
    "	mul.wide.s32 	%rd5, %r1, 4;\n"
    "	add.s64 	%rd6, %rd4, %rd5;\n"
    "	ld.global.f32 	%f2, [%rd6];\n"
    "	add.s64 	%rd7, %rd3, %rd5;\n"
    "	ld.global.f32 	%f3, [%rd7];\n"
    "	fma.rn.f32 	%f4, %f2, %f1, %f3;\n"
    "	st.global.f32 	[%rd7], %f4;\n"
    "\n"
    "$L__BB1_2:\n"
    "	ret;\n"
    "\n"
    "}\n"
    "	// .globl	noop\n"
    ".visible .entry noop()\n"
    "{\n"
    "\n"
    "\n"
    "\n"
    "	ret;\n"
    "\n"
    "}\n";

#define CHECK(call) do { CUresult r_ = (call); if (r_ != CUDA_SUCCESS) { const char *s_ = 0; \
    cuGetErrorName(r_, &s_); fprintf(stderr, "%s:%d %s -> %d (%s)\n", __FILE__, __LINE__, #call, r_, s_ ? s_ : "?"); \
    exit(1); } } while (0)

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int check(CUfunction vecadd, CUfunction saxpy) {
    enum { N = 1000 };
    float a[N], b[N], c[N];
    for (int i = 0; i < N; i++) { a[i] = (float)i; b[i] = 2.0f * i; c[i] = -1.0f; }
    CUdeviceptr da, db, dc;
    CHECK(cuMemAlloc(&da, sizeof a));
    CHECK(cuMemAlloc(&db, sizeof b));
    CHECK(cuMemAlloc(&dc, sizeof c));
    CHECK(cuMemcpyHtoD(da, a, sizeof a));
    CHECK(cuMemcpyHtoD(db, b, sizeof b));
    CHECK(cuMemsetD32(dc, 0, N));
    int n = N;
    void *params[] = {&da, &db, &dc, &n};
    CHECK(cuLaunchKernel(vecadd, (N + 255) / 256, 1, 1, 256, 1, 1, 0, NULL, params, NULL));
    CHECK(cuMemcpyDtoH(c, dc, sizeof c));
    for (int i = 0; i < N; i++)
        if (c[i] != 3.0f * i) { fprintf(stderr, "vecAdd: c[%d] = %f, want %f\n", i, c[i], 3.0f * i); return 1; }

    /* saxpy through `extra`: one packed buffer, laid out as the kernel's parameters */
    struct { float alpha; int pad; CUdeviceptr x, y; int n; int pad2; } packed = {0.5f, 0, da, dc, N, 0};
    size_t size = 28;
    void *extra[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, &packed, CU_LAUNCH_PARAM_BUFFER_SIZE, &size, CU_LAUNCH_PARAM_END};
    CHECK(cuLaunchKernel(saxpy, (N + 127) / 128, 1, 1, 128, 1, 1, 0, NULL, NULL, extra));

    /* cuLaunchKernelEx on a stream, then capture that stream into a graph and replay it twice */
    CUstream s;
    CHECK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    float alpha = 1.0f;
    void *sp[] = {&alpha, &da, &dc, &n};
    CUlaunchConfig cfg = {0};
    cfg.gridDimX = (N + 127) / 128; cfg.gridDimY = cfg.gridDimZ = 1;
    cfg.blockDimX = 128; cfg.blockDimY = cfg.blockDimZ = 1;
    cfg.hStream = s;
    CHECK(cuLaunchKernelEx(&cfg, saxpy, sp, NULL));
    CUgraph g;
    CUgraphExec ge;
    CHECK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
    CHECK(cuLaunchKernel(saxpy, (N + 127) / 128, 1, 1, 128, 1, 1, 0, s, sp, NULL));
    CHECK(cuStreamEndCapture(s, &g));
    CHECK(cuGraphInstantiate(&ge, g, 0));
    CHECK(cuGraphLaunch(ge, s));
    CHECK(cuGraphLaunch(ge, s));
    CHECK(cuStreamSynchronize(s));
    CHECK(cuMemcpyDtoH(c, dc, sizeof c));
    /* c = 3i, then + 0.5 i (extra), + i (Ex), + i + i (graph twice) = 6.5 i */
    for (int i = 0; i < N; i++)
        if (c[i] != 6.5f * i) { fprintf(stderr, "saxpy: c[%d] = %f, want %f\n", i, c[i], 6.5f * i); return 1; }
    CHECK(cuGraphExecDestroy(ge));
    CHECK(cuGraphDestroy(g));
    CHECK(cuStreamDestroy(s));
    CHECK(cuMemFree(da));
    CHECK(cuMemFree(db));
    CHECK(cuMemFree(dc));
    return 0;
}

static void bench(CUfunction noop, int launches) {
    size_t free_b, total_b;
    double t = now();
    for (int i = 0; i < 100; i++) CHECK(cuMemGetInfo(&free_b, &total_b));
    double rt = (now() - t) / 100;
    CHECK(cuLaunchKernel(noop, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL));   /* warm up */
    CHECK(cuCtxSynchronize());
    t = now();
    for (int i = 0; i < launches; i++) CHECK(cuLaunchKernel(noop, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL));
    CHECK(cuCtxSynchronize());
    double lt = now() - t;
    size_t bytes = 64u << 20;
    char *host = malloc(bytes);
    memset(host, 1, bytes);
    CUdeviceptr d;
    CHECK(cuMemAlloc(&d, bytes));
    CHECK(cuMemcpyHtoD(d, host, bytes));                                     /* warm up */
    t = now();
    CHECK(cuMemcpyHtoD(d, host, bytes));
    double ct = now() - t;
    CHECK(cuMemFree(d));
    free(host);
    printf("{\"roundtrip_us\": %.3f, \"launches\": %d, \"launches_ms\": %.3f, \"htod_64mib_ms\": %.3f}\n",
           rt * 1e6, launches, lt * 1e3, ct * 1e3);
}

int main(int argc, char **argv) {
    CUdevice dev;
    CUcontext ctx;
    CUmodule mod;
    CUfunction vecadd, saxpy, noop;
    char name[128];
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuDeviceGetName(name, sizeof name, dev));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(cuCtxSetCurrent(ctx));
    CHECK(cuModuleLoadData(&mod, PTX));
    CHECK(cuModuleGetFunction(&vecadd, mod, "vecAdd"));
    CHECK(cuModuleGetFunction(&saxpy, mod, "saxpy"));
    CHECK(cuModuleGetFunction(&noop, mod, "noop"));
    if (argc > 2 && strcmp(argv[1], "bench") == 0) {
        bench(noop, atoi(argv[2]));
    } else {
        if (check(vecadd, saxpy)) return 1;
        Dl_info info;                          /* which libcuda.so.1 answered: proof of who was in front */
        printf("OK device=%s libcuda=%s\n", name, dladdr((void *)cuInit, &info) ? info.dli_fname : "?");
    }
    CHECK(cuModuleUnload(mod));
    CHECK(cuDevicePrimaryCtxRelease(dev));
    return 0;
}
