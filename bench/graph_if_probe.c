/* Probe: can a CUDA graph's IF node skip the fused forward's exact passes where the bounded split
 * held, and what does a skipped IF cost against launches that end at once? A module calling
 * cudaGraphSetConditional must load; the IF body (three launches shaped like an exact pass) must
 * run only when the flag is set. Needs a GPU and the CUDA toolkit (it links the driver API; the
 * library itself loads it at run time):
 *   nvcc -arch=sm_90a -cubin -o build/graph_if_probe.cubin bench/graph_if_probe.cu
 *   cc -I/usr/local/cuda/include bench/graph_if_probe.c -o build/graph_if_probe -L/usr/local/cuda/lib64/stubs -lcuda
 *   build/graph_if_probe build/graph_if_probe.cubin
 * H200, 2026-11-30: loads; flag 0 runs no block, flag 1 all; 4.65 us an iteration against 11.4 us
 * for the three launches with PDL in a stream (bench/RESULTS.md). */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char *m; cuGetErrorString(r_, &m); printf("FAIL %s: %s\n", #x, m); exit(1); } } while (0)
static CUfunction fset, fpass;
static CUcontext ctx;
static const unsigned GRID = 320, SMEM = 160 * 1024;
static void add_kernel(CUgraph g, CUgraphNode *out, const CUgraphNode *dep, size_t ndep, CUfunction f, unsigned grid, unsigned threads, unsigned smem, void **args) {
    CUDA_KERNEL_NODE_PARAMS kp = {0};
    kp.func = f; kp.gridDimX = grid; kp.gridDimY = 1; kp.gridDimZ = 1; kp.blockDimX = threads; kp.blockDimY = 1; kp.blockDimZ = 1;
    kp.sharedMemBytes = smem; kp.kernelParams = args;
    CK(cuGraphAddKernelNode(out, g, dep, ndep, &kp));
}
int main(int argc, char **argv) {
    CUdevice dev; CUmodule mod; CUstream st; CUevent e0, e1;
    CK(cuInit(0)); CK(cuDeviceGet(&dev, 0)); CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
    int drv; cuDriverGetVersion(&drv); printf("driver API %d\n", drv);
    if (argc != 2) { printf("usage: %s graph_if_probe.cubin\n", argv[0]); return 2; }
    CK(cuModuleLoad(&mod, argv[1]));
    printf("module with cudaGraphSetConditional loaded\n");
    CK(cuModuleGetFunction(&fset, mod, "setc")); CK(cuModuleGetFunction(&fpass, mod, "pass"));
    CK(cuFuncSetAttribute(fpass, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, SMEM));
    CK(cuStreamCreate(&st, CU_STREAM_NON_BLOCKING)); CK(cuEventCreate(&e0, 0)); CK(cuEventCreate(&e1, 0));
    CUdeviceptr dflag, dout; CK(cuMemAlloc(&dflag, 4)); CK(cuMemAlloc(&dout, 4));
    /* graph: setc -> IF { pass, pass, pass } */
    CUgraph g; CUgraphExec ge; CUgraphConditionalHandle h; CUgraphNode nset, ncond, n1, n2, n3;
    CK(cuGraphCreate(&g, 0));
    CK(cuGraphConditionalHandleCreate(&h, g, ctx, 0, 0));
    void *aset[] = {&h, &dflag};
    add_kernel(g, &nset, NULL, 0, fset, 1, 32, 0, aset);
    CUgraphNodeParams cp; memset(&cp, 0, sizeof cp);
    cp.type = CU_GRAPH_NODE_TYPE_CONDITIONAL;
    cp.conditional.handle = h; cp.conditional.type = CU_GRAPH_COND_TYPE_IF; cp.conditional.size = 1; cp.conditional.ctx = ctx;
    CK(cuGraphAddNode(&ncond, g, &nset, NULL, 1, &cp));
    CUgraph body = cp.conditional.phGraph_out[0];
    void *apass[] = {&dflag, &dout};
    add_kernel(body, &n1, NULL, 0, fpass, GRID, 512, SMEM, apass);
    add_kernel(body, &n2, &n1, 1, fpass, GRID, 512, SMEM, apass);
    add_kernel(body, &n3, &n2, 1, fpass, GRID, 512, SMEM, apass);
    CK(cuGraphInstantiate(&ge, g, 0));
    for (int flag = 0; flag <= 1; flag++) {
        int out = 0;
        CK(cuMemcpyHtoD(dflag, &flag, 4)); CK(cuMemcpyHtoD(dout, &out, 4));
        CK(cuGraphLaunch(ge, st)); CK(cuStreamSynchronize(st));
        CK(cuMemcpyDtoH(&out, dout, 4));
        printf("flag %d: the body's blocks ran %d times (%s)\n", flag, out, out == 3 * (int)GRID * flag ? "as they should" : "WRONG");
    }
    const int N = 200;
    for (int flag = 0; flag <= 1; flag++) {
        CK(cuMemcpyHtoD(dflag, &flag, 4));
        float ms_graph, ms_plain, ms_pdl;
        for (int rep = 0; rep < 2; rep++) { /* the second of each is the one printed (warm) */
            CK(cuEventRecord(e0, st));
            for (int i = 0; i < N; i++) CK(cuGraphLaunch(ge, st));
            CK(cuEventRecord(e1, st)); CK(cuEventSynchronize(e1)); CK(cuEventElapsedTime(&ms_graph, e0, e1));
            CK(cuEventRecord(e0, st));
            for (int i = 0; i < N; i++) {
                CK(cuLaunchKernel(fpass, 1, 1, 1, 512, 1, 1, SMEM, st, apass, NULL)); /* (setc's place: one block) */
                for (int k = 0; k < 3; k++) CK(cuLaunchKernel(fpass, GRID, 1, 1, 512, 1, 1, SMEM, st, apass, NULL));
            }
            CK(cuEventRecord(e1, st)); CK(cuEventSynchronize(e1)); CK(cuEventElapsedTime(&ms_plain, e0, e1));
            /* the same with programmatic stream serialization after the first, as kda.h chains them */
            CK(cuEventRecord(e0, st));
            for (int i = 0; i < N; i++) {
                CK(cuLaunchKernel(fpass, 1, 1, 1, 512, 1, 1, SMEM, st, apass, NULL));
                for (int k = 0; k < 3; k++) {
                    CUlaunchAttribute at; memset(&at, 0, sizeof at);
                    at.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION; at.value.programmaticStreamSerializationAllowed = 1;
                    CUlaunchConfig lc; memset(&lc, 0, sizeof lc);
                    lc.gridDimX = GRID; lc.gridDimY = 1; lc.gridDimZ = 1; lc.blockDimX = 512; lc.blockDimY = 1; lc.blockDimZ = 1;
                    lc.sharedMemBytes = SMEM; lc.hStream = st; lc.attrs = &at; lc.numAttrs = 1;
                    CK(cuLaunchKernelEx(&lc, fpass, apass, NULL));
                }
            }
            CK(cuEventRecord(e1, st)); CK(cuEventSynchronize(e1)); CK(cuEventElapsedTime(&ms_pdl, e0, e1));
        }
        printf("flag %d: graph (setc + IF of 3 passes) %.2f us an iteration; stream (a 1-block kernel + 3 passes) %.2f us, with PDL %.2f us\n", flag,
               1000.0 * ms_graph / N, 1000.0 * ms_plain / N, 1000.0 * ms_pdl / N);
    }
    return 0;
}
