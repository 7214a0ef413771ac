// tests/cluster_racecheck_probe.cu - why `make test-gpu` runs racecheck with the pairs off.
//
// The smallest kernel with the fused forward's pair hand-over (fwd_fused.cu.j2, PAIRS): a
// cluster of two blocks, each copying a shared-memory buffer into the other's by
// cp.async.bulk.shared::cluster, counted in by an mbarrier there, and released by a remote
// mbarrier arrive. It runs right alone and under memcheck. Under racecheck it runs right
// while racecheck instruments it, and fails where racecheck leaves it out
// (--kernel-name-exclude): "Internal Sanitizer Error: The Sanitizer failed to handle a
// hardware exception", an illegal address (H100, compute-sanitizer 2025.3.1, driver
// 580.159.04, 2026-11-26). The pairs kernels do the same under racecheck (left out or not),
// so the failure is the tool's with such kernels, not the pairs'.
//
//   nvcc -arch=sm_90a -o build/cluster_probe tests/cluster_racecheck_probe.cu
//   build/cluster_probe                                          # "ok"
//   compute-sanitizer --tool racecheck build/cluster_probe       # "ok", 0 hazards
//   compute-sanitizer --tool racecheck --kernel-name-exclude kns=probe build/cluster_probe  # fails
#include <cstdio>
#include <cuda_runtime.h>

constexpr int N = 1024, ITERS = 8;
__device__ unsigned saddr(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ unsigned peer_addr(const void *p, unsigned rank) {
    unsigned a;
    asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(saddr(p)), "r"(rank));
    return a;
}
__device__ void wait_parity(unsigned long long *b, unsigned parity) {
    asm volatile("{ .reg .pred p; W%=: mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%0], %1; @!p bra W%=; }"
                 ::"r"(saddr(b)), "r"(parity) : "memory");
}

// Each iteration: fill src, wait until the other block has read the last copy (empty), copy
// src into its dst (full counts the bytes in), wait for its copy here, sum it, release it.
__global__ void __cluster_dims__(2, 1, 1) probe(float *out) {
    __shared__ alignas(128) float src[N], dst[N];
    __shared__ alignas(8) unsigned long long full, empty;
    unsigned rank;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    const unsigned other = rank ^ 1;
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(saddr(&full)) : "memory");
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(saddr(&empty)) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    asm volatile("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;" ::: "memory");
    float sum = 0;
    for (int it = 0; it < ITERS; it++) {
        for (int i = threadIdx.x; i < N; i += blockDim.x) src[i] = rank * 1000 + it + i;
        __syncthreads();
        if (it > 0) wait_parity(&empty, (it - 1) & 1);
        if (threadIdx.x == 0) {
            const unsigned bar = peer_addr(&full, other);
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            asm volatile("mbarrier.arrive.expect_tx.relaxed.cluster.shared::cluster.b64 _, [%0], %1;" ::"r"(bar), "r"(4 * N) : "memory");
            asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                         ::"r"(peer_addr(dst, other)), "r"(saddr(src)), "r"(4 * N), "r"(bar) : "memory");
        }
        wait_parity(&full, it & 1);
        for (int i = threadIdx.x; i < N; i += blockDim.x) sum += dst[i];
        __syncthreads();
        if (threadIdx.x == 0)
            asm volatile("mbarrier.arrive.relaxed.cluster.shared::cluster.b64 _, [%0];" ::"r"(peer_addr(&empty, other)) : "memory");
    }
    asm volatile("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;" ::: "memory");
    out[blockIdx.x * blockDim.x + threadIdx.x] = sum;
}

int main() {
    constexpr int BLOCKS = 4, THREADS = 128;
    float *d, h[BLOCKS * THREADS];
    cudaMalloc(&d, sizeof h);
    probe<<<BLOCKS, THREADS>>>(d);
    cudaError_t e = cudaDeviceSynchronize();
    if (e == cudaSuccess) e = cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost);
    int bad = e != cudaSuccess;
    for (int b = 0; b < BLOCKS && !bad; b++)
        for (int t = 0; t < THREADS; t++) { // thread t of block b sums the other block's elements t, t + THREADS, ..
            double want = 0;
            for (int it = 0; it < ITERS; it++)
                for (int i = t; i < N; i += THREADS) want += (b % 2 ^ 1) * 1000 + it + i;
            bad |= h[b * THREADS + t] != (float)want;
        }
    printf("%s\n", e != cudaSuccess ? cudaGetErrorString(e) : bad ? "wrong sums" : "ok");
    return bad;
}
