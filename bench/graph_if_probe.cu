// The kernels of bench/graph_if_probe.c (nvcc -arch=sm_90a -cubin; see there)
extern "C" __global__ void setc(cudaGraphConditionalHandle h, const int *flag) {
    if (threadIdx.x == 0 && blockIdx.x == 0) cudaGraphSetConditional(h, *flag != 0);
}
// an exact pass's shape: many 512-thread blocks with a large shared-memory need, all of which end
// at once unless the flag is set (as kda_fz_idle)
extern "C" __global__ void __launch_bounds__(512, 1) pass(const int *flag, int *out) {
    extern __shared__ int s[];
    asm volatile("griddepcontrol.launch_dependents;");
    asm volatile("griddepcontrol.wait;" ::: "memory");
    if (!*flag) return;
    if (threadIdx.x == 0) { s[0] = 1; atomicAdd(out, s[0]); }
}
