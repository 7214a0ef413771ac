// tests/cuda_emu.h - runs the generated CUDA kernels on the CPU, so that CI (no
// GPU) checks every kernel against its CPU twin. C++20.
//
// One block at a time (the blocks of a cluster at once); each CUDA thread of the block is a
// std::thread. A block barrier is __syncthreads, a per-warp barrier with an exchange buffer
// makes the warp shuffles, and __shared__ is `static`: correct because blocks never run
// concurrently (the fused forward's dynamic shared memory, KDA_SMEM, is each block's own). A
// kernel that deadlocks here (a __syncthreads some threads skip) is wrong on the GPU too.
// Timing means nothing here; only results do.
#pragma once
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#define KDA_EMU 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __restrict__

struct kda_emu_dim3 { unsigned x = 1, y = 1, z = 1; };
inline thread_local kda_emu_dim3 threadIdx, blockIdx;
inline kda_emu_dim3 blockDim, gridDim;

// A barrier on atomics: a count of arrivals and a phase, the waiters asleep on the phase
// (std::barrier's tree of arrivals cost more with hundreds of threads on few cores). The last
// of n arrivals (acquiring every earlier one through the count) ends the phase; a waiter
// acquires that. A thread's next arrival follows the phase it took part in, so the phase it
// reads first cannot end before its arrival. n: the block's or a warp's threads, fixed; a named
// barrier's, fixed by its first use (kda_emu_bar).
struct kda_emu_barrier {
    explicit kda_emu_barrier(int n = 0) : n(n) {}
    void arrive(int count, bool wait) {
        const unsigned ph = phase.load(std::memory_order_relaxed);
        if (arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == count) {
            arrived.store(0, std::memory_order_relaxed);
            phase.fetch_add(1, std::memory_order_release);
            phase.notify_all();
        } else if (wait) {
            while (phase.load(std::memory_order_acquire) == ph) phase.wait(ph, std::memory_order_acquire);
        }
    }
    void arrive_and_wait() { arrive(n.load(std::memory_order_relaxed), true); }
    std::atomic<int> n, arrived{0};
    std::atomic<unsigned> phase{0};
};
struct kda_emu_block {
    std::unique_ptr<kda_emu_barrier> block;
    std::vector<std::unique_ptr<kda_emu_barrier>> warp;
    // A warp operation (shuffle, mma, ldmatrix) exchanges values through these, two sets used
    // in turn: a lane writes the set of its operation k + 2 after the barrier of k + 1, which
    // every lane reaches after reading what k exchanged, so that a shuffle or an mma takes one
    // warp barrier, not two (the emulator's time is mostly these barriers)
    std::vector<uint64_t> xchg[2]; // one slot per thread
    std::vector<uint32_t> mma[2];  // 10 words per thread: the fragments of one mma
    // bar.sync / bar.arrive. Their state exists before the block's threads start and a first
    // use fixes a count by a relaxed exchange, so that using one orders only what bar.sync /
    // bar.arrive order on a GPU: the arrivals before a bar.sync's release. (Made on first use
    // under a mutex, it ordered, for ThreadSanitizer, everything any thread did before one
    // barrier before everything another did after the next, and hid a race: 53c4c1e.)
    kda_emu_barrier named[16];
    std::atomic<int> red[16][3] = {};           // bar.red.or: one slot per call, three in turn
};
inline thread_local kda_emu_block *kda_emu_state; // this thread's block
inline thread_local unsigned kda_emu_wops;         // this thread's warp operations so far (the lanes' counts agree)

// ---- thread block clusters (the fused forward's pairs): the blocks of a cluster run at once,
// each with its own dynamic shared memory; a shared::cluster address is a pointer into the
// other block's. An mbarrier is its 8 bytes as one atomic word: phase (bit 63), arrivals
// expected (48-62) and pending (32-47), transaction bytes pending (0-31, signed). A bulk copy
// lands as late as the hardware may let it: when a thread waits on its barrier, so that a read
// or a rewrite of its source or destination that the protocol leaves unordered against it is
// a race that ThreadSanitizer (make test-race) reports.
struct kda_emu_bulk { void *dst; const void *src; unsigned bytes; };
struct kda_emu_cluster {
    std::unique_ptr<kda_emu_barrier> all;                // barrier.cluster: every thread of the cluster
    std::vector<std::vector<unsigned char>> smem;        // each block's dynamic shared memory
    std::mutex mu;                                       // the copies not yet landed, by barrier
    std::map<void *, std::vector<kda_emu_bulk>> pending;
};
inline kda_emu_cluster *kda_emu_cl;
inline thread_local unsigned kda_emu_rank; // this thread's block in its cluster
inline void *kda_emu_smem(size_t bytes) {
    std::vector<unsigned char> &m = kda_emu_cl->smem[kda_emu_rank];
    if (m.size() < bytes) {
        fprintf(stderr, "cuda_emu: %zu bytes of dynamic shared memory, the launch gave %zu\n", bytes, m.size());
        abort();
    }
    return m.data();
}
inline unsigned kda_emu_cl_rank() { return kda_emu_rank; }
inline void *kda_emu_cl_map(const void *p, unsigned rank) {
    const unsigned char *mine = kda_emu_cl->smem[kda_emu_rank].data();
    return kda_emu_cl->smem[rank].data() + ((const unsigned char *)p - mine);
}
inline void kda_emu_cl_sync() { kda_emu_cl->all->arrive_and_wait(); }
inline uint64_t kda_emu_mb_word(uint64_t phase, uint64_t expect, uint64_t left, int32_t tx) {
    return phase << 63 | expect << 48 | left << 32 | (uint32_t)tx;
}
inline void kda_emu_mb_init(void *b, int n) {
    std::atomic_ref<uint64_t>(*(uint64_t *)b).store(kda_emu_mb_word(0, (uint64_t)n, (uint64_t)n, 0), std::memory_order_release);
}
// arrivals and transaction bytes (tx added by expect_tx, taken by a copy's completion); the
// update that leaves neither pending ends the phase
inline void kda_emu_mb_update(void *b, int arrivals, int tx) {
    std::atomic_ref<uint64_t> w(*(uint64_t *)b);
    uint64_t s = w.load(std::memory_order_relaxed), n;
    do {
        uint64_t phase = s >> 63, expect = s >> 48 & 0x7fff, left = (s >> 32 & 0xffff) - (uint64_t)arrivals;
        const int32_t t = (int32_t)(uint32_t)s + tx;
        if (left == 0 && t == 0) phase ^= 1, left = expect;
        n = kda_emu_mb_word(phase, expect, left, t);
    } while (!w.compare_exchange_weak(s, n, std::memory_order_acq_rel, std::memory_order_relaxed));
    w.notify_all();
}
inline bool kda_emu_mb_land(void *b) { // the copies pending on barrier b land (one waiter does it)
    std::vector<kda_emu_bulk> c;
    {
        std::lock_guard<std::mutex> g(kda_emu_cl->mu);
        auto it = kda_emu_cl->pending.find(b);
        if (it == kda_emu_cl->pending.end() || it->second.empty()) return false;
        c.swap(it->second);
    }
    for (const kda_emu_bulk &x : c) {
        memcpy(x.dst, x.src, x.bytes);
        kda_emu_mb_update(b, 0, -(int)x.bytes);
    }
    return true;
}
inline void kda_emu_mb_wait(void *b, unsigned parity) { // until the phase of this parity has ended
    std::atomic_ref<uint64_t> w(*(uint64_t *)b);
    for (;;) {
        const uint64_t s = w.load(std::memory_order_acquire);
        if ((s >> 63) != parity) return;
        if (!kda_emu_mb_land(b)) w.wait(s, std::memory_order_acquire);
    }
}
inline void kda_emu_bulk_to(void *dst, const void *src, int bytes, void *b) {
    {
        std::lock_guard<std::mutex> g(kda_emu_cl->mu);
        kda_emu_cl->pending[b].push_back({dst, src, (unsigned)bytes});
    }
    kda_emu_mb_update(b, 1, bytes); // arrive.expect_tx
}

inline void __syncthreads() { kda_emu_state->block->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) {
    kda_emu_state->warp[threadIdx.x / 32]->arrive_and_wait();
}
// bar.sync (wait) / bar.arrive id, n. A barrier's thread count is fixed by its first
// use in a launch; a different count later is a kernel bug (undefined on a GPU).
inline void kda_emu_bar(int id, int n, bool wait) {
    int earlier = 0;
    if (id <= 0 || id >= 16 || n <= 0 || n % 32) {
        fprintf(stderr, "cuda_emu: bar %d with %d threads\n", id, n);
        abort();
    }
    kda_emu_barrier &b = kda_emu_state->named[id];
    if (!b.n.compare_exchange_strong(earlier, n, std::memory_order_relaxed) && earlier != n) {
        fprintf(stderr, "cuda_emu: bar %d with %d threads (earlier %d)\n", id, n, earlier);
        abort();
    }
    // (the kernels' protocols: a producer arrives again only after its consumers released it)
    b.arrive(n, wait);
}
// bar.red.or.pred id, n: bar.sync that returns whether pred held in any thread. Call k
// of a thread (on this id) ORs into slot k % 3 and clears slot (k + 1) % 3 before it
// arrives: that slot's last readers (call k - 2) are all past call k - 1 by then.
inline thread_local unsigned kda_emu_red_calls[16];
inline bool kda_emu_bar_or(int id, int n, bool pred) {
    kda_emu_block *st = kda_emu_state;
    const unsigned k = kda_emu_red_calls[id & 15]++;
    st->red[id & 15][(k + 1) % 3].store(0);
    if (pred) st->red[id & 15][k % 3].fetch_or(1);
    kda_emu_bar(id, n, true);
    return st->red[id & 15][k % 3].load() != 0;
}
template <class T> inline T kda_emu_shfl(T v, int src_of_lane(int lane, int arg), int arg) {
    static_assert(sizeof(T) <= 8, "shuffle of a type wider than 8 bytes");
    const int tid = (int)threadIdx.x, warp = tid / 32, lane = tid % 32;
    uint64_t slot = 0;
    std::vector<uint64_t> &x = kda_emu_state->xchg[kda_emu_wops++ & 1];
    memcpy(&slot, &v, sizeof(T));
    x[tid] = slot;
    kda_emu_state->warp[warp]->arrive_and_wait();
    const int src = src_of_lane(lane, arg);
    slot = x[warp * 32 + (src & 31)];
    T r;
    memcpy(&r, &slot, sizeof(T));
    return r;
}
inline int kda_emu_xor(int lane, int m) { return lane ^ m; }
inline int kda_emu_idx(int, int src) { return src; }
inline int kda_emu_down(int lane, int d) { return lane + d < 32 ? lane + d : lane; }
inline int kda_emu_up(int lane, int d) { return lane - d >= 0 ? lane - d : lane; }
template <class T> inline T __shfl_xor_sync(unsigned, T v, int m, int = 32) { return kda_emu_shfl(v, kda_emu_xor, m); }
template <class T> inline T __shfl_sync(unsigned, T v, int src, int = 32) { return kda_emu_shfl(v, kda_emu_idx, src); }
template <class T> inline T __shfl_down_sync(unsigned, T v, int d, int = 32) { return kda_emu_shfl(v, kda_emu_down, d); }
template <class T> inline T __shfl_up_sync(unsigned, T v, int d, int = 32) { return kda_emu_shfl(v, kda_emu_up, d); }

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}: D = A B + C for one warp, with
// the PTX ISA's fragment layouts (groupID g = lane / 4, t = lane % 4):
//   A 16x16: reg r holds two elements (low half first) at row g + 8*(r & 1),
//            columns 2t + 8*(r >> 1) + {0, 1}
//   B 16x8:  reg r holds rows (k) 2t + 8r + {0, 1} of column g
//   C, D:    element i at row g + 8*(i >> 1), column 2t + (i & 1)
// The same layouts on a GPU are checked by test_gpu_stages' "selftest_mma" stage.
inline float kda_emu_half(uint32_t reg, int hi, bool bf16) {
    uint16_t h = (uint16_t)(hi ? reg >> 16 : reg & 0xffffu);
    if (bf16) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
    _Float16 x; memcpy(&x, &h, 2); return (float)x;
}
inline void kda_emu_mma16816(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4], bool bf16) {
    const int tid = (int)threadIdx.x, warp = tid / 32, lane = tid % 32;
    std::vector<uint32_t> &m = kda_emu_state->mma[kda_emu_wops++ & 1];
    uint32_t *mine = &m[(size_t)tid * 10];
    for (int i = 0; i < 4; i++) mine[i] = a[i];
    mine[4] = b[0]; mine[5] = b[1];
    for (int i = 0; i < 4; i++) memcpy(&mine[6 + i], &c[i], 4);
    kda_emu_state->warp[warp]->arrive_and_wait();
    const uint32_t *w = &m[(size_t)warp * 32 * 10];
    auto A = [&](int row, int k) { return kda_emu_half(w[((row % 8) * 4 + (k % 8) / 2) * 10 + (row >= 8) + 2 * (k >= 8)], k & 1, bf16); };
    auto B = [&](int k, int col) { return kda_emu_half(w[(col * 4 + (k % 8) / 2) * 10 + 4 + (k >= 8)], k & 1, bf16); };
    float out[4];
    for (int i = 0; i < 4; i++) {
        const int row = lane / 4 + 8 * (i >> 1), col = 2 * (lane % 4) + (i & 1);
        float acc = c[i];
        for (int k = 0; k < 16; k++) acc += A(row, k) * B(k, col);
        out[i] = acc;
    }
    for (int i = 0; i < 4; i++) d[i] = out[i];
}

// cp.async: a thread's copies land when it waits for their group (kda_cp_wait<N>), the
// latest the hardware allows, so that a read of the destination not ordered after that wait
// reads stale data here, and ThreadSanitizer (make test-race) reports it as a race. A copy
// belongs to the group the thread's next commit closes; one not yet committed stays pending
// through every wait, as with cp.async.wait_group, and lands when the block ends.
struct kda_emu_copy { void *dst; unsigned char bytes[16]; unsigned group; };
inline thread_local std::vector<kda_emu_copy> kda_emu_copies;
inline thread_local unsigned kda_emu_groups; // groups this thread has committed
inline void kda_emu_cp_land() {
    for (const kda_emu_copy &c : kda_emu_copies) memcpy(c.dst, c.bytes, 16);
    kda_emu_copies.clear();
}
// cp.async.wait_group n: every committed group but the n latest lands (in place: the
// copies still pending keep their order)
inline void kda_emu_cp_land_groups(unsigned n) {
    size_t kept = 0;
    for (const kda_emu_copy &c : kda_emu_copies)
        if (c.group + n < kda_emu_groups) memcpy(c.dst, c.bytes, 16);
        else kda_emu_copies[kept++] = c;
    kda_emu_copies.resize(kept);
}
// cp.async of 16 bytes and ldmatrix rows need 16-byte aligned addresses
inline void kda_emu_check_align16(const void *dst, const void *src) {
    if (((uintptr_t)dst | (uintptr_t)src) & 15) {
        fprintf(stderr, "cuda_emu: 16-byte access (cp.async, ldmatrix) at misaligned %p <- %p\n", dst, src);
        abort();
    }
}
// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16 (see kda_ldsm4 in the common header)
inline void kda_emu_ldmatrix(uint32_t r[4], const void *row, bool trans) {
    const int tid = (int)threadIdx.x, warp = tid / 32, lane = tid % 32;
    kda_emu_check_align16(row, nullptr);
    std::vector<uint64_t> &x = kda_emu_state->xchg[kda_emu_wops++ & 1];
    x[tid] = (uint64_t)(uintptr_t)row;
    kda_emu_state->warp[warp]->arrive_and_wait();
    auto at = [&](int m, int rr, int c) { // element (row rr, column c) of matrix m
        const uint16_t *p = (const uint16_t *)(uintptr_t)x[warp * 32 + 8 * m + rr];
        return (uint32_t)p[c];
    };
    uint32_t out[4];
    for (int m = 0; m < 4; m++) {
        const int a = lane / 4, b = 2 * (lane % 4);
        out[m] = trans ? (at(m, b, a) | at(m, b + 1, a) << 16) : (at(m, a, b) | at(m, a, b + 1) << 16);
    }
    kda_emu_state->warp[warp]->arrive_and_wait(); // (its reads of shared memory end before any lane goes on, as on a GPU)
    for (int m = 0; m < 4; m++) r[m] = out[m];
}
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
inline int __float_as_int(float f) { int u; memcpy(&u, &f, 4); return u; }
inline float __expf(float x) { return expf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float rsqrtf(float a) { return 1.0f / sqrtf(a); }
inline double rsqrt(double a) { return 1.0 / sqrt(a); }
inline float atomicAdd(float *p, float v) { return std::atomic_ref<float>(*p).fetch_add(v); }
inline double atomicAdd(double *p, double v) { return std::atomic_ref<double>(*p).fetch_add(v); }
inline int atomicAdd(int *p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }
inline void __threadfence() {}
inline void __threadfence_block() {}
inline float kda_emu_f16_to_f32(unsigned short h) { _Float16 x; memcpy(&x, &h, 2); return (float)x; }
inline unsigned short kda_emu_f32_to_f16(float f) { _Float16 x = (_Float16)f; unsigned short h; memcpy(&h, &x, 2); return h; }

// Runs kernel<<<grid, threads, smem>>>(arg): every block in order, threads of a block
// concurrently; in clusters of `cluster` blocks along x (axis 0) or z (axis 2), the blocks of
// a cluster concurrently.
template <class P>
inline void kda_emu_launch(void (*kernel)(const P), kda_emu_dim3 grid, unsigned threads, const P &arg, size_t smem = 0,
                           unsigned cluster = 1, int axis = 0) {
    std::vector<kda_emu_block> st(cluster);
    for (kda_emu_block &b : st) {
        b.block = std::make_unique<kda_emu_barrier>((int)threads);
        for (unsigned w = 0; w < (threads + 31) / 32; w++) {
            unsigned n = threads - 32 * w < 32 ? threads - 32 * w : 32;
            b.warp.push_back(std::make_unique<kda_emu_barrier>((int)n));
        }
        for (int i = 0; i < 2; i++) b.xchg[i].assign(threads + 32, 0), b.mma[i].assign((size_t)(threads + 32) * 10, 0);
    }
    kda_emu_cluster cl;
    cl.all = std::make_unique<kda_emu_barrier>((int)(threads * cluster));
    cl.smem.assign(cluster, std::vector<unsigned char>(smem));
    kda_emu_cl = &cl;
    blockDim.x = threads; blockDim.y = blockDim.z = 1;
    gridDim = grid;
    const unsigned sx = axis == 0 ? cluster : 1, sz = axis == 2 ? cluster : 1;
    if (grid.x % sx || grid.z % sz) {
        fprintf(stderr, "cuda_emu: clusters of %u do not divide the grid\n", cluster);
        abort();
    }
    std::vector<std::thread> pool;
    for (unsigned r = 0; r < cluster; r++)
        for (unsigned t = 0; t < threads; t++)
            pool.emplace_back([&, r, t] {
                threadIdx.x = t;
                kda_emu_rank = r;
                kda_emu_state = &st[r];
                for (unsigned &c : kda_emu_red_calls) c = 0;
                for (unsigned z = 0; z < grid.z; z += sz)
                    for (unsigned y = 0; y < grid.y; y++)
                        for (unsigned x = 0; x < grid.x; x += sx) {
                            blockIdx.x = x + (axis == 0 ? r : 0); blockIdx.y = y; blockIdx.z = z + (axis == 2 ? r : 0);
                            kernel(arg);
                            kda_emu_cp_land(); // copies nothing waited for (the hardware lands them too)
                            st[r].block->arrive_and_wait(); // the block ends for every thread together
                        }
            });
    for (auto &th : pool) th.join();
    kda_emu_cl = nullptr;
}
