#!/usr/bin/env python3
"""What the state warps' matmul chain costs on its own: wgmma round trips on a Hopper GPU.

    python3 bench/wgmma_chain.py                 (on a machine with an sm_90 GPU and nvcc)
    python3 bench/wgmma_chain.py --compile-only  (renders and compiles it: no GPU needed; make test)

The fused forward's state warps (templates/fwd_fused.cu.j2, `scan`) issue their products as
wgmma m64nNk16 with A from registers and B from shared memory by descriptor, each product
waited for before the next step that reads it. One block of one or two warpgroups (the
128-column kernels run two) times, with clock64, the rounds of

  * fence, a chain of CH wgmma on one accumulator, commit, wait:  N = 16, 32, 64, 128;
  * one chunk's chain of the 16-token kernel as it is: the residual in two parts of four
    m64n32k16 (xk and qg), d (three m64n16k16), o and the state update (m64n16k16 and
    m64n128k16), each step waited for;
  * the same chain for a 32-token state pass: parts of four m64n64k16, d six m64n32k16, o
    and the update two k16 steps each.

It prints cycles a round (clock64 at the SM clock). Tensor-core work only: no conversions,
no decay, no barriers; what the rest of a chunk adds is the difference to a measured chunk.
"""
import argparse
import os
import subprocess
import sys
import tempfile

NS = (16, 32, 64, 128)
CHAINS = {16: (1, 4, 8), 32: (1, 4, 8), 64: (1, 4, 8), 128: (1, 2, 4)}


def wgmma_fn(n):
    """D[64][n] += A[64][16] B[16][n], A from registers (bf16), B by descriptor"""
    regs = ", ".join(f"%{i}" for i in range(n // 2))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(n // 2))
    a = ", ".join(f"%{n // 2 + i}" for i in range(4))
    return (f"__device__ __forceinline__ void wg{n}(float *d, const unsigned a[4], unsigned long long b) {{\n"
            f'    asm volatile("wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{ {regs} }}, {{ {a} }}, %{n // 2 + 4}, 1, 1, 1, 0;"\n'
            f'                 : {outs} : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));\n}}\n')


BODY = r"""
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
template <int R> __device__ __forceinline__ void keep(float *r) { // accumulators stay put across the asm
#pragma unroll
    for (int i = 0; i < R; i++) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N> __device__ __forceinline__ void wg(float *d, const unsigned a[4], unsigned long long b) {
    if constexpr (N == 16) wg16(d, a, b);
    else if constexpr (N == 32) wg32(d, a, b);
    else if constexpr (N == 64) wg64(d, a, b);
    else wg128(d, a, b);
}
// B: no-swizzle descriptor of 16-bit values (what they are does not change the timing)
__device__ __forceinline__ unsigned long long desc(const void *p) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(p);
    return (unsigned long long)((s & 0x3FFFF) >> 4) | (unsigned long long)(128 >> 4) << 16 | (unsigned long long)(256 >> 4) << 32;
}
constexpr int SMEM = 65536;
struct Setup {
    unsigned a[4];
    unsigned long long b;
    __device__ Setup(unsigned char *sm) {
        for (int i = threadIdx.x; i < SMEM / 4; i += blockDim.x) ((unsigned *)sm)[i] = 0x3c003c00u;
        __syncthreads();
        a[0] = 0x3f803f80u + threadIdx.x, a[1] = a[2] = a[3] = 0x3f803f80u;
        b = desc(sm + 1024 * (threadIdx.x / 128));
    }
};
// each warpgroup's thread 0 writes its cycles; every thread its sum (so nothing is dead)
__device__ void report(long long *out, float *sink, long long cycles, float sum) {
    sink[threadIdx.x] = sum;
    if (threadIdx.x % 128 == 0) out[threadIdx.x / 128] = cycles;
}
template <int N, int CH> __global__ void chain(long long *out, float *sink, int rounds) {
    extern __shared__ __align__(1024) unsigned char sm[];
    const Setup st(sm);
    float d[N / 2] = {};
    long long t0 = 0;
    for (int it = -8; it < rounds; it++) { // 8 rounds of warm-up
        if (it == 0) t0 = clock64();
        keep<N / 2>(d);
        fence();
#pragma unroll
        for (int c = 0; c < CH; c++) wg<N>(d, st.a, st.b);
        commit();
        wait0();
        keep<N / 2>(d);
    }
    const long long t1 = clock64();
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < N / 2; i++) s += d[i];
    report(out, sink, t1 - t0, s);
}
// one chunk of the state warps' chain, C = 16 tokens (W = 1) or 32 (W = 2)
template <int W> __global__ void chunk(long long *out, float *sink, int rounds) {
    extern __shared__ __align__(1024) unsigned char sm[];
    const Setup st(sm);
    float s[64] = {}, ro[16 * W] = {}, dd[8 * W] = {}, oq[8 * W] = {};
    long long t0 = 0;
    for (int it = -8; it < rounds; it++) {
        if (it == 0) t0 = clock64();
        for (int part = 0; part < 2; part++) { // the residual and o's S part, four key tiles a part
            keep<16 * W>(ro), fence();
#pragma unroll
            for (int x = 0; x < 4; x++) wg<32 * W>(ro, st.a, st.b);
            commit(), wait0(), keep<16 * W>(ro);
        }
        fence(); // d = residual M in hi + lo
#pragma unroll
        for (int x = 0; x < 3 * W; x++) wg<16 * W>(dd, st.a, st.b);
        commit(), wait0(), keep<8 * W>(dd);
        fence(); // o's d part, then the state update
#pragma unroll
        for (int x = 0; x < W; x++) wg<16 * W>(oq, st.a, st.b);
        commit(), keep<64>(s), fence();
#pragma unroll
        for (int x = 0; x < W; x++) wg<128>(s, st.a, st.b);
        commit(), wait0(), keep<64>(s), keep<8 * W>(oq);
    }
    const long long t1 = clock64();
    float z = 0.0f;
#pragma unroll
    for (int i = 0; i < 64; i++) z += s[i];
#pragma unroll
    for (int i = 0; i < 16 * W; i++) z += ro[i];
#pragma unroll
    for (int i = 0; i < 8 * W; i++) z += oq[i] + dd[i];
    report(out, sink, t1 - t0, z);
}
template <class F> void run(const char *name, F k, int groups, int rounds, double per) {
    long long *out, h[2] = {0, 0};
    float *sink;
    cudaMalloc(&out, sizeof h), cudaMalloc(&sink, 256 * sizeof(float));
    cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM);
    k<<<1, 128 * groups, SMEM>>>(out, sink, rounds);
    const cudaError_t e = cudaMemcpy(h, out, sizeof h, cudaMemcpyDeviceToHost);
    if (e != cudaSuccess) { printf("%s: %s\n", name, cudaGetErrorString(e)); exit(1); }
    printf("%-30s %d warpgroup%s  %7.1f cycles a round%s", name, groups, groups > 1 ? "s" : " ", (double)h[0] / rounds,
           per > 0 ? "" : "\n");
    if (per > 0) printf(", %6.1f a 16-token chunk\n", (double)h[0] / rounds / per);
    cudaFree(out), cudaFree(sink);
}
int main() {
    cudaDeviceProp pr;
    if (cudaGetDeviceProperties(&pr, 0) != cudaSuccess || pr.major != 9) { printf("needs an sm_90 GPU\n"); return 1; }
    int mhz = 0;
    cudaDeviceGetAttribute(&mhz, cudaDevAttrClockRate, 0);
    printf("%s, %d MHz\n", pr.name, mhz / 1000);
    const int rounds = 2000;
    for (int g = 1; g <= 2; g++) {
%RUNS%
        run("one chunk, 16 tokens (now)", chunk<1>, g, rounds, 1.0);
        run("one chunk, 32 tokens", chunk<2>, g, rounds, 2.0);
    }
    return 0;
}
"""


def source():
    runs = "\n".join(f'        run("m64n{n}k16 x {c}", chain<{n}, {c}>, g, rounds, 0.0);' for n in NS for c in CHAINS[n])
    return "#include <cstdio>\n#include <cstdlib>\n#include <cuda_runtime.h>\n\n" + "".join(map(wgmma_fn, NS)) + BODY.replace("%RUNS%", runs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compile-only", action="store_true", help="render and compile, do not run")
    cuda = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    ap.add_argument("--nvcc", default=os.path.join(cuda, "bin", "nvcc"), help="nvcc (default: $CUDA_HOME/bin/nvcc)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cu, exe = os.path.join(tmp, "wgmma_chain.cu"), os.path.join(tmp, "wgmma_chain")
        with open(cu, "w") as f:
            f.write(source())
        r = subprocess.run([a.nvcc, "-O3", "-gencode", "arch=compute_90a,code=sm_90a", "-o", exe, cu], capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"nvcc failed:\n{r.stdout}{r.stderr}")
        if a.compile_only:
            print("compiled for sm_90a")
            return 0
        return subprocess.run([exe]).returncode


if __name__ == "__main__":
    sys.exit(main())
