// tests/cuda_emu.h - runs the generated CUDA kernels on the CPU, so that CI (no
// GPU) checks every kernel against its CPU twin. C++20.
//
// One block at a time (the blocks of a cluster at once); each CUDA thread of the block is a
// fiber on one OS thread, switched where it waits at a barrier (the default), or a std::thread
// (-DKDA_EMU_FIBERS=0). Under ThreadSanitizer the fibers' switches order nothing, so that it
// reports an access that no barrier orders against another thread's as it does with threads
// (its checks follow the order barriers and atomics make, not which thread ran when). A block
// barrier is __syncthreads, a per-warp barrier (__syncwarp) with an exchange buffer makes the
// warp shuffles, and __shared__ is `static`: correct because blocks never run
// concurrently (the fused forward's dynamic shared memory, KDA_SMEM, is each block's own). A
// kernel that deadlocks here (a __syncthreads some threads skip) is wrong on the GPU too; with
// fibers the emulator says so and aborts. Timing means nothing here; only results do.
#pragma once
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

// Fibers: with 512 OS threads a block on 2 cores the emulator spent most of its time in the
// kernel's futex waits and wakes (the fused forward's --quick --paths: 91 s of system time
// against 35 of user time, 67 s; with fibers 6 s)
#ifndef KDA_EMU_FIBERS
#define KDA_EMU_FIBERS 1
#endif
#if defined(__SANITIZE_ADDRESS__)
#define KDA_EMU_ASAN 1
#elif defined(__SANITIZE_THREAD__)
#define KDA_EMU_TSAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KDA_EMU_ASAN 1
#elif __has_feature(thread_sanitizer)
#define KDA_EMU_TSAN 1
#endif
#endif
#if KDA_EMU_FIBERS
#include <sys/mman.h>
#include <unistd.h>
#if defined(__x86_64__) && !defined(KDA_EMU_UCONTEXT)
// a switch of stacks: pushes the callee-saved registers, stores the stack pointer in *from,
// loads to and pops the registers saved there (glibc's swapcontext also makes a system call
// for the signal mask: 20 of test_gpu_stages' 70 s)
#define KDA_EMU_SWAP 1
extern "C" void kda_emu_swap(void **from, void *to);
asm(".pushsection .text.kda_emu_swap,\"axG\",@progbits,kda_emu_swap,comdat\n"
    ".weak kda_emu_swap\n.type kda_emu_swap,@function\nkda_emu_swap:\n"
    "pushq %rbp\npushq %rbx\npushq %r12\npushq %r13\npushq %r14\npushq %r15\n"
    "movq %rsp, (%rdi)\nmovq %rsi, %rsp\n"
    "popq %r15\npopq %r14\npopq %r13\npopq %r12\npopq %rbx\npopq %rbp\nret\n"
    ".size kda_emu_swap, .-kda_emu_swap\n.popsection\n");
#else
#include <ucontext.h>
#endif
#ifdef KDA_EMU_ASAN
#include <sanitizer/common_interface_defs.h>
#endif
#ifdef KDA_EMU_TSAN
#include <sanitizer/tsan_interface.h>
extern "C" void AnnotateIgnoreWritesBegin(const char *file, int line);
extern "C" void AnnotateIgnoreWritesEnd(const char *file, int line);
#endif
#endif

#define KDA_EMU 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __restrict__

struct kda_emu_dim3 { unsigned x = 1, y = 1, z = 1; };
inline kda_emu_dim3 blockDim, gridDim;
struct kda_emu_block;
// cp.async's copies not yet landed (see kda_cp16)
struct kda_emu_copy { void *dst; unsigned char bytes[16]; unsigned group; };
// What a CUDA thread has of its own: the emulated thread's registers of the emulator
struct kda_emu_thread {
    kda_emu_dim3 tid, bid;
    kda_emu_block *state = nullptr;        // its block
    unsigned rank = 0;                     // its block in its cluster
    unsigned wops = 0;                     // its warp operations so far (the lanes' counts agree)
    unsigned red_calls[16] = {};           // its bar.red calls by barrier id
    std::vector<kda_emu_copy> copies;      // its cp.async copies not yet landed
    unsigned groups = 0;                   // the cp.async groups it has committed
};
inline thread_local kda_emu_thread *kda_emu_self; // the running one (a fiber's, or this OS thread's)
#define threadIdx (kda_emu_self->tid)
#define blockIdx (kda_emu_self->bid)

// ---- waiting: a thread waits until a word changes from a value it read, and whoever changes
// it wakes the waiters. Fibers: the waiter parks under the word's address and the next
// runnable fiber runs; the scheduler (kda_emu_run) aborts when none is left to run.
#if KDA_EMU_FIBERS
struct kda_emu_fiber {
#ifdef KDA_EMU_SWAP
    void *sp = nullptr;                    // its stack pointer while it does not run
#else
    ucontext_t ctx;
#endif
    kda_emu_thread self;
    void *stack = nullptr;
    size_t size = 0;
    bool done = false;
    unsigned index = 0;                    // its thread of the launch
    void *tsan = nullptr;                  // its ThreadSanitizer context
};
struct kda_emu_sched {
    std::vector<kda_emu_fiber *> run;      // runnable, in turn (a ring: head..)
    size_t head = 0;
    std::unordered_map<const void *, std::vector<kda_emu_fiber *>> parked;
    kda_emu_fiber main;                    // the launching OS thread's context
    kda_emu_fiber *cur = nullptr;
    std::function<void(unsigned)> body;    // what fiber i runs
    std::vector<kda_emu_fiber> fibers;
    unsigned live = 0;
    const void *main_lo = nullptr;         // the OS thread's stack, for AddressSanitizer's switches
    size_t main_size = 0;
    std::atomic<unsigned> ended{0};        // fibers ended: each releases its work to the launching thread
};
inline kda_emu_sched *kda_emu_sched_cur;
// The scheduler's own state passes from fiber to fiber in no order ThreadSanitizer sees (the
// switches do not synchronise): its container work is hidden from it (kda_emu_hide), and the
// switch itself is not instrumented. A hidden stretch never spans a switch (a fiber must end
// with nothing hidden).
#ifdef KDA_EMU_TSAN
struct kda_emu_hide {
    kda_emu_hide() { AnnotateIgnoreWritesBegin(__FILE__, __LINE__); }
    ~kda_emu_hide() { AnnotateIgnoreWritesEnd(__FILE__, __LINE__); }
};
#define KDA_EMU_UNCHECKED __attribute__((noinline, no_sanitize("thread")))
#else
struct kda_emu_hide {};
#define KDA_EMU_UNCHECKED
#endif
KDA_EMU_UNCHECKED inline void kda_emu_swap_to(kda_emu_fiber *from, kda_emu_fiber *to) {
#ifdef KDA_EMU_SWAP
    kda_emu_swap(&from->sp, to->sp);
#else
    swapcontext(&from->ctx, &to->ctx);
#endif
}
// from the running fiber to `to` (the running one is parked, runnable or done)
KDA_EMU_UNCHECKED inline void kda_emu_switch(kda_emu_fiber *to) {
    kda_emu_sched &sc = *kda_emu_sched_cur;
    kda_emu_fiber *from = sc.cur;
    sc.cur = to;
    kda_emu_self = &to->self;
#ifdef KDA_EMU_TSAN
    __tsan_switch_to_fiber(to->tsan, __tsan_switch_to_fiber_no_sync);
#endif
#ifdef KDA_EMU_ASAN
    void *fake = nullptr;
    __sanitizer_start_switch_fiber(from->done ? nullptr : &fake, to == &sc.main ? sc.main_lo : to->stack,
                                   to == &sc.main ? sc.main_size : to->size);
    kda_emu_swap_to(from, to);
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
    kda_emu_swap_to(from, to);
#endif
}
// the next runnable fiber, or the launching thread's context once every fiber is done
inline kda_emu_fiber *kda_emu_next() {
    kda_emu_sched &sc = *kda_emu_sched_cur;
    if (sc.head < sc.run.size()) {
        kda_emu_fiber *f = sc.run[sc.head++];
        if (sc.head == sc.run.size()) sc.run.clear(), sc.head = 0;
        return f;
    }
    if (sc.live == 0) return &sc.main;
    fprintf(stderr, "cuda_emu: deadlock: %u threads wait and none can run (block %u,%u,%u)\n", sc.live, sc.cur->self.bid.x,
            sc.cur->self.bid.y, sc.cur->self.bid.z);
    abort();
}
KDA_EMU_UNCHECKED inline void kda_emu_park(const void *key) {
    kda_emu_sched &sc = *kda_emu_sched_cur;
    kda_emu_fiber *next;
    {
        [[maybe_unused]] kda_emu_hide h;
        sc.parked[key].push_back(sc.cur);
        next = kda_emu_next();
    }
    kda_emu_switch(next);
}
KDA_EMU_UNCHECKED inline void kda_emu_unpark(const void *key) {
    kda_emu_sched &sc = *kda_emu_sched_cur;
    [[maybe_unused]] kda_emu_hide h;
    auto it = sc.parked.find(key);
    if (it == sc.parked.end()) return;
    for (kda_emu_fiber *f : it->second) sc.run.push_back(f);
    it->second.clear();
}
#endif
// until a (at address key) no longer holds old; kda_emu_notify(a, key) after a change
template <class A, class T> inline void kda_emu_wait_while(A &a, T old, [[maybe_unused]] const void *key) {
#if KDA_EMU_FIBERS
    while (a.load(std::memory_order_acquire) == old) kda_emu_park(key);
#else
    while (a.load(std::memory_order_acquire) == old) a.wait(old, std::memory_order_acquire);
#endif
}
template <class A> inline void kda_emu_notify([[maybe_unused]] A &a, [[maybe_unused]] const void *key) {
#if KDA_EMU_FIBERS
    kda_emu_unpark(key);
#else
    a.notify_all();
#endif
}

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
            kda_emu_notify(phase, &phase);
        } else if (wait) {
            kda_emu_wait_while(phase, ph, &phase);
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
// block rank's dynamic shared memory, aligned as on the GPU (the kernels' tiles ask for 128
// bytes; each block's vector holds KDA_EMU_SMEM_ALIGN bytes more)
constexpr size_t KDA_EMU_SMEM_ALIGN = 1024;
inline unsigned char *kda_emu_smem_of(unsigned rank) {
    const uintptr_t a = (uintptr_t)kda_emu_cl->smem[rank].data();
    return (unsigned char *)((a + KDA_EMU_SMEM_ALIGN - 1) & ~(uintptr_t)(KDA_EMU_SMEM_ALIGN - 1));
}
inline void *kda_emu_smem(size_t bytes) {
    const size_t have = kda_emu_cl->smem[kda_emu_self->rank].size() - KDA_EMU_SMEM_ALIGN;
    if (have < bytes) {
        fprintf(stderr, "cuda_emu: %zu bytes of dynamic shared memory, the launch gave %zu\n", bytes, have);
        abort();
    }
    return kda_emu_smem_of(kda_emu_self->rank);
}
inline unsigned kda_emu_cl_rank() { return kda_emu_self->rank; }
inline void *kda_emu_cl_map(const void *p, unsigned rank) {
    return kda_emu_smem_of(rank) + ((const unsigned char *)p - kda_emu_smem_of(kda_emu_self->rank));
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
    kda_emu_notify(w, b);
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
        if (!kda_emu_mb_land(b)) kda_emu_wait_while(w, s, b);
    }
}
inline void kda_emu_bulk_to(void *dst, const void *src, int bytes, void *b) {
    {
        std::lock_guard<std::mutex> g(kda_emu_cl->mu);
        kda_emu_cl->pending[b].push_back({dst, src, (unsigned)bytes});
    }
    kda_emu_mb_update(b, 1, bytes); // arrive.expect_tx
}

inline void __syncthreads() { kda_emu_self->state->block->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) {
    kda_emu_self->state->warp[threadIdx.x / 32]->arrive_and_wait();
}
// bar.sync (wait) / bar.arrive id, n. A barrier's thread count is fixed by its first
// use in a launch; a different count later is a kernel bug (undefined on a GPU).
inline void kda_emu_bar(int id, int n, bool wait) {
    int earlier = 0;
    if (id <= 0 || id >= 16 || n <= 0 || n % 32) {
        fprintf(stderr, "cuda_emu: bar %d with %d threads\n", id, n);
        abort();
    }
    kda_emu_barrier &b = kda_emu_self->state->named[id];
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
inline bool kda_emu_bar_or(int id, int n, bool pred) {
    kda_emu_block *st = kda_emu_self->state;
    const unsigned k = kda_emu_self->red_calls[id & 15]++;
    st->red[id & 15][(k + 1) % 3].store(0);
    if (pred) st->red[id & 15][k % 3].fetch_or(1);
    kda_emu_bar(id, n, true);
    return st->red[id & 15][k % 3].load() != 0;
}
template <class T> inline T kda_emu_shfl(T v, int src_of_lane(int lane, int arg), int arg) {
    static_assert(sizeof(T) <= 8, "shuffle of a type wider than 8 bytes");
    const int tid = (int)threadIdx.x, warp = tid / 32, lane = tid % 32;
    uint64_t slot = 0;
    std::vector<uint64_t> &x = kda_emu_self->state->xchg[kda_emu_self->wops++ & 1];
    memcpy(&slot, &v, sizeof(T));
    x[tid] = slot;
    __syncwarp();
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
    std::vector<uint32_t> &m = kda_emu_self->state->mma[kda_emu_self->wops++ & 1];
    uint32_t *mine = &m[(size_t)tid * 10];
    for (int i = 0; i < 4; i++) mine[i] = a[i];
    mine[4] = b[0]; mine[5] = b[1];
    for (int i = 0; i < 4; i++) memcpy(&mine[6 + i], &c[i], 4);
    __syncwarp();
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
inline void kda_emu_cp_land() {
    std::vector<kda_emu_copy> &cs = kda_emu_self->copies;
    for (const kda_emu_copy &c : cs) memcpy(c.dst, c.bytes, 16);
    cs.clear();
}
// cp.async.wait_group n: every committed group but the n latest lands (in place: the
// copies still pending keep their order)
inline void kda_emu_cp_land_groups(unsigned n) {
    std::vector<kda_emu_copy> &cs = kda_emu_self->copies;
    size_t kept = 0;
    for (const kda_emu_copy &c : cs)
        if (c.group + n < kda_emu_self->groups) memcpy(c.dst, c.bytes, 16);
        else cs[kept++] = c;
    cs.resize(kept);
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
    std::vector<uint64_t> &x = kda_emu_self->state->xchg[kda_emu_self->wops++ & 1];
    x[tid] = (uint64_t)(uintptr_t)row;
    __syncwarp();
    auto at = [&](int m, int rr, int c) { // element (row rr, column c) of matrix m
        const uint16_t *p = (const uint16_t *)(uintptr_t)x[warp * 32 + 8 * m + rr];
        return (uint32_t)p[c];
    };
    uint32_t out[4];
    for (int m = 0; m < 4; m++) {
        const int a = lane / 4, b = 2 * (lane % 4);
        out[m] = trans ? (at(m, b, a) | at(m, b + 1, a) << 16) : (at(m, a, b) | at(m, a, b + 1) << 16);
    }
    __syncwarp(); // (its reads of shared memory end before any lane goes on, as on a GPU)
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

// Runs body(thread, i) for i < n, each as its own emulated thread, until all return. (Fibers:
// launches come from one OS thread at a time.)
#if KDA_EMU_FIBERS
// Fiber stacks, kept for later launches (a launch has up to 1,024 threads): 1 MiB each, reserved
// rather than committed, below a page that faults on an overflow
inline void *kda_emu_stack(size_t i, size_t size) {
    static std::vector<void *> pool;
    while (pool.size() <= i) {
        const size_t page = (size_t)sysconf(_SC_PAGESIZE);
        void *m = mmap(nullptr, size + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED || mprotect(m, page, PROT_NONE)) {
            fprintf(stderr, "cuda_emu: no memory for a fiber's stack\n");
            abort();
        }
        pool.push_back((char *)m + page);
    }
    return pool[i];
}
// a fiber's work, released to the launching thread as it ends (here: the unchecked
// kda_emu_fiber_main's atomics are not seen)
__attribute__((noinline)) inline void kda_emu_fiber_run(kda_emu_sched &sc, unsigned i) {
    sc.body(i);
    sc.ended.fetch_add(1, std::memory_order_release);
}
KDA_EMU_UNCHECKED inline void kda_emu_fiber_main() {
    kda_emu_sched &sc = *kda_emu_sched_cur;
#ifdef KDA_EMU_ASAN
    const void *lo = nullptr;
    size_t size = 0;
    __sanitizer_finish_switch_fiber(nullptr, &lo, &size);
    if (!sc.main_lo) sc.main_lo = lo, sc.main_size = size; // the first switch came from the OS thread's stack
#endif
    kda_emu_fiber *f = sc.cur;
    kda_emu_fiber_run(sc, f->index);
    kda_emu_fiber *next;
    {
        [[maybe_unused]] kda_emu_hide h;
        f->done = true;
        sc.live--;
        next = kda_emu_next();
    }
    kda_emu_switch(next); // (never returns here)
}
KDA_EMU_UNCHECKED inline void kda_emu_run_first() {
    kda_emu_fiber *first;
    {
        [[maybe_unused]] kda_emu_hide h;
        first = kda_emu_next();
    }
    kda_emu_switch(first); // (back when every fiber has ended)
}
inline void kda_emu_fiber_init(kda_emu_fiber &f, void *stack, size_t size) {
    f.stack = stack, f.size = size;
#ifdef KDA_EMU_SWAP
    // kda_emu_swap's frame: six registers, then its return address, the fiber's entry, which
    // starts as if called (its own return address slot below a 16-byte aligned top; it never returns)
    void **sp = (void **)(((uintptr_t)stack + size) & ~(uintptr_t)15) - 1;
    *sp = nullptr;
    *--sp = (void *)kda_emu_fiber_main;
    for (int r = 0; r < 6; r++) *--sp = nullptr;
    f.sp = sp;
#else
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = stack;
    f.ctx.uc_stack.ss_size = size;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, kda_emu_fiber_main, 0);
#endif
}
template <class F> inline void kda_emu_run(unsigned n, F body) {
    constexpr size_t size = (size_t)1 << 20;
    kda_emu_sched sc;
    sc.fibers.resize(n);
    sc.body = [&](unsigned i) { body(sc.fibers[i].self, i); };
    for (unsigned i = 0; i < n; i++) {
        kda_emu_fiber_init(sc.fibers[i], kda_emu_stack(i, size), size);
        sc.fibers[i].index = i;
        sc.run.push_back(&sc.fibers[i]);
    }
    sc.live = n;
    sc.cur = &sc.main;
    kda_emu_sched_cur = &sc;
#ifdef KDA_EMU_TSAN
    // (a fiber made here starts after everything this thread did before; with the contexts
    // kept for later launches instead, make test-race's run took 277 s against 208)
    sc.main.tsan = __tsan_get_current_fiber();
    for (kda_emu_fiber &f : sc.fibers) f.tsan = __tsan_create_fiber(0);
#endif
    kda_emu_thread *const outer = kda_emu_self;
    kda_emu_run_first();
    sc.ended.load(std::memory_order_acquire); // (every fiber's work before what follows)
    kda_emu_self = outer;
    kda_emu_sched_cur = nullptr;
#ifdef KDA_EMU_TSAN
    for (kda_emu_fiber &f : sc.fibers) __tsan_destroy_fiber(f.tsan);
#endif
}
#else
template <class F> inline void kda_emu_run(unsigned n, F body) {
    std::vector<std::thread> pool;
    for (unsigned i = 0; i < n; i++)
        pool.emplace_back([&, i] {
            kda_emu_thread me;
            kda_emu_self = &me;
            body(me, i);
        });
    for (auto &th : pool) th.join();
}
#endif

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
    cl.smem.assign(cluster, std::vector<unsigned char>(smem + KDA_EMU_SMEM_ALIGN));
    kda_emu_cl = &cl;
    blockDim.x = threads; blockDim.y = blockDim.z = 1;
    gridDim = grid;
    const unsigned sx = axis == 0 ? cluster : 1, sz = axis == 2 ? cluster : 1;
    if (grid.x % sx || grid.z % sz) {
        fprintf(stderr, "cuda_emu: clusters of %u do not divide the grid\n", cluster);
        abort();
    }
    kda_emu_run(cluster * threads, [&](kda_emu_thread &me, unsigned i) {
        const unsigned r = i / threads;
        me.tid.x = i % threads;
        me.rank = r;
        me.state = &st[r];
        for (unsigned z = 0; z < grid.z; z += sz)
            for (unsigned y = 0; y < grid.y; y++)
                for (unsigned x = 0; x < grid.x; x += sx) {
                    me.bid.x = x + (axis == 0 ? r : 0), me.bid.y = y, me.bid.z = z + (axis == 2 ? r : 0);
                    kernel(arg);
                    kda_emu_cp_land(); // copies nothing waited for (the hardware lands them too)
                    st[r].block->arrive_and_wait(); // the block ends for every thread together
                }
    });
    kda_emu_cl = nullptr;
}
