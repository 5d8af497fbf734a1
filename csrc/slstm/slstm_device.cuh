// Device helpers for the sLSTM kernels (built at run time with NVRTC; no CUDA headers needed):
// 16-bit float conversions, the m16n8k16 tensor-core MMA (and 3xTF32 m16n8k8 products for fp32), and
// the Hopper thread-block-cluster primitives (distributed shared memory stores, the cluster barrier).
#pragma once

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64_t;

// ---- 16-bit floats as raw bits (XACCEL_F16 selects fp16, else bf16) ---------------------------
__device__ __forceinline__ float half_to_float(u16 h) {
#ifdef XACCEL_F16
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    return __uint_as_float(((u32)h) << 16);
#endif
}

__device__ __forceinline__ u16 float_to_half(float f) {
    u16 h;
#ifdef XACCEL_F16
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
#else
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
#endif
    return h;
}

// two floats as one 32-bit word of 16-bit floats (x in the low half)
__device__ __forceinline__ u32 pack_half2(float x, float y) {
    return (u32)float_to_half(x) | ((u32)float_to_half(y) << 16);
}

// acc[4] += A (16x16, row-major fragment a[4]) * B (16x8, column fragment b[2]), fp32 accumulate
__device__ __forceinline__ void mma_16816(float* acc, const u32* a, const u32* b) {
#ifdef XACCEL_F16
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// ---- fp32 products on tensor cores: 3xTF32 ------------------------------------------------------
// x = big + small, each a TF32 value (10 explicit mantissa bits): big * big + big * small + small *
// big recovers the fp32 product to about 2^-21 relative (small * small is below that), so an fp32
// sequence keeps fp32's precision in its recurrent products where one TF32 MMA would lose 13 bits.
__device__ __forceinline__ u32 to_tf32(float x) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ void split_tf32(float x, u32& big, u32& small) {
    big = to_tf32(x);
    small = to_tf32(x - __uint_as_float(big));
}

// the same, split anew where it is used: volatile, so that the compiler does not hoist the split
// of loop-invariant values (R's fragments) out of the time loop, which would hold both halves of R
// in registers for the whole sequence (twice its registers: spills)
__device__ __forceinline__ void split_tf32_here(float x, u32& big, u32& small) {
    asm volatile("cvt.rna.tf32.f32 %0, %1;" : "=r"(big) : "f"(x));
    const float rest = x - __uint_as_float(big);
    asm volatile("cvt.rna.tf32.f32 %0, %1;" : "=r"(small) : "f"(rest));
}

// acc[4] += A (16x8, row-major fragment a[4]) * B (8x8, column fragment b[2]), TF32 in, fp32 accumulate
__device__ __forceinline__ void mma_1688_tf32(float* acc, const u32* a, const u32* b) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// the m16n8k8 A fragment of fp32 values a (row g, g + 8 at column t; the same at column t + 4),
// split into its TF32 halves once for every B fragment it meets
struct SplitA {
    u32 big[4], small[4];
};

__device__ __forceinline__ SplitA split_a(float a0, float a1, float a2, float a3) {
    SplitA s;
    split_tf32(a0, s.big[0], s.small[0]);
    split_tf32(a1, s.big[1], s.small[1]);
    split_tf32(a2, s.big[2], s.small[2]);
    split_tf32(a3, s.big[3], s.small[3]);
    return s;
}

// acc[4] += A * B in fp32 precision (3xTF32): b0, b1 the fp32 B fragment (rows t and t + 4)
__device__ __forceinline__ void mma_3xtf32(float* acc, const SplitA& a, float b0, float b1) {
    u32 bb[2], bs[2];
    split_tf32_here(b0, bb[0], bs[0]);
    split_tf32_here(b1, bb[1], bs[1]);
    mma_1688_tf32(acc, a.small, bb);  // the small terms first: they are lost last in the fp32 sum
    mma_1688_tf32(acc, a.big, bs);
    mma_1688_tf32(acc, a.big, bb);
}

// ---- thread-block clusters ---------------------------------------------------------------------
__device__ __forceinline__ u32 cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

__device__ __forceinline__ u32 shared_address(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// the address of the same shared-memory variable in CTA `rank` of this cluster
__device__ __forceinline__ u32 remote_address(u32 local, u32 rank) {
    u32 r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(local), "r"(rank));
    return r;
}

__device__ __forceinline__ void store_remote_u32(u32 address, u32 value) {
    asm volatile("st.shared::cluster.u32 [%0], %1;" :: "r"(address), "r"(value) : "memory");
}

__device__ __forceinline__ void store_remote_u16(u32 address, u16 value) {
    asm volatile("st.shared::cluster.u16 [%0], %1;" :: "r"(address), "h"(value) : "memory");
}

// every thread of every CTA in the cluster; orders the stores before it with the loads after it
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" :: "l"(p));
}

// ---- the sLSTM cell, fp32 (reference.py's expressions) -----------------------------------------
__device__ __forceinline__ float log_sigmoid(float x) {
    return fminf(x, 0.f) - log1pf(expf(-fabsf(x)));
}

__device__ __forceinline__ float sigmoid(float x) {
    return 1.f / (1.f + expf(-x));
}

// ---- asynchronous copies: a per-thread ring of 32-bit words prefetched steps ahead -------------
// Each thread copies and later reads back only its own words, so cp.async.wait_group alone makes
// them visible (no barrier needed). src_bytes == 0 fills the word with zeros (rows past B).
__device__ __forceinline__ void copy_async_u32(u32* dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;"
                 :: "r"(shared_address(dst)), "l"(src), "r"(valid ? 4 : 0) : "memory");
}

// 8 bytes (8-byte aligned on both sides), zeros where !valid
__device__ __forceinline__ void copy_async_u64(uint2* dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;"
                 :: "r"(shared_address(dst)), "l"(src), "r"(valid ? 8 : 0) : "memory");
}

__device__ __forceinline__ void copy_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}

template <int PENDING>
__device__ __forceinline__ void copy_async_wait() {
    asm volatile("cp.async.wait_group %0;" :: "n"(PENDING) : "memory");
}

// ---- fast fp32 math with bounded error (the state math stays fp32) -----------------------------
__device__ __forceinline__ float exp_f(float x) { return __expf(x); }

__device__ __forceinline__ float log_sigmoid_f(float x) {
    return fminf(x, 0.f) - __logf(1.f + __expf(-fabsf(x)));
}

__device__ __forceinline__ float sigmoid_f(float x) { return __fdividef(1.f, 1.f + __expf(-x)); }

__device__ __forceinline__ float tanh_f(float x) {
    // 1 - 2 / (exp(2x) + 1): exact limits at +-inf, absolute error ~1e-7
    return 1.f - __fdividef(2.f, __expf(2.f * x) + 1.f);
}

// ---- data-driven exchange: stores into peers' shared memory that count bytes on their mbarrier ----
// A CTA waits until the bytes a step needs have landed, instead of a whole-cluster barrier.
__device__ __forceinline__ void mbarrier_init(u64_t* bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(shared_address(bar)), "r"(count) : "memory");
}

// makes the initialised barriers visible to the cluster's other CTAs (before a cluster barrier)
__device__ __forceinline__ void fence_mbarrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// this CTA's one arrival for the phase, announcing the bytes the phase receives
__device__ __forceinline__ void mbarrier_expect_bytes(u64_t* bar, u32 bytes) {
    asm volatile("{ .reg .b64 state; mbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1; }"
                 :: "r"(shared_address(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbarrier_wait(u64_t* bar, u32 parity) {
    const u32 address = shared_address(bar);
    u32 done;
    do {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2; "
                     "selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(address), "r"(parity) : "memory");
    } while (!done);
}

// 4 bytes into a peer's shared memory (address from remote_address), counted on its mbarrier
__device__ __forceinline__ void store_async_u32(u32 address, u32 value, u32 remote_bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];"
                 :: "r"(address), "r"(value), "r"(remote_bar) : "memory");
}

// 16 bytes (16-byte aligned on both sides) into a peer's shared memory, counted on its mbarrier
__device__ __forceinline__ void store_async_v4(u32 address, uint4 value, u32 remote_bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];"
                 :: "r"(address), "r"(value.x), "r"(value.y), "r"(value.z), "r"(value.w), "r"(remote_bar)
                 : "memory");
}

// 8 bytes (8-byte aligned on both sides) into a peer's shared memory, counted on its mbarrier
__device__ __forceinline__ void store_async_v2(u32 address, float x, float y, u32 remote_bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];"
                 :: "r"(address), "f"(x), "f"(y), "r"(remote_bar) : "memory");
}

// ---- exchange through global memory (the grid kernels: heads wider than one cluster holds, GPUs
// without clusters; the launch is cooperative, so every CTA a reader waits for is resident):
// flagged words, 32 bits of data beside 32 bits of the step that wrote them, one 64-bit
// access (single-copy atomic), so a reader that sees the step's tag sees its data: no counter,
// no fence, one trip through L2 (buffers start zeroed; tags start at 1)
__device__ __forceinline__ void store_flagged(void* p, u32 data, u32 tag) {
    const u64_t word = ((u64_t)tag << 32) | data;
    asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" :: "l"(p), "l"(word) : "memory");
}

// two flagged words (16 bytes, 16-byte aligned)
__device__ __forceinline__ void store_flagged2(void* p, u32 d0, u32 d1, u32 tag) {
    const u64_t w0 = ((u64_t)tag << 32) | d0, w1 = ((u64_t)tag << 32) | d1;
    asm volatile("st.relaxed.gpu.global.v2.b64 [%0], {%1, %2};" :: "l"(p), "l"(w0), "l"(w1) : "memory");
}

// the BYTES / 2 data bytes of BYTES of flagged words (16 bytes per load, two words) into dst,
// once every word carries `tag`; each thread spins on its own loads only
template <int BYTES, int NTHREADS_, typename Place>
__device__ __forceinline__ void receive_flagged(const unsigned char* src, u32 tag, Place place) {
    constexpr int N = BYTES / 16, ITER = (N + NTHREADS_ - 1) / NTHREADS_;
    static_assert(ITER <= 32, "one pending bit per load");
    u32 pending = 0;
#pragma unroll
    for (int i = 0; i < ITER; ++i)
        if (threadIdx.x + i * NTHREADS_ < N) pending |= 1u << i;
    u64_t lo[ITER], hi[ITER];
    while (pending) {
#pragma unroll
        for (int i = 0; i < ITER; ++i)
            if (pending >> i & 1)
                asm volatile("ld.relaxed.gpu.global.v2.b64 {%0, %1}, [%2];" : "=l"(lo[i]), "=l"(hi[i])
                             : "l"(src + (threadIdx.x + i * NTHREADS_) * 16) : "memory");
#pragma unroll
        for (int i = 0; i < ITER; ++i)
            if ((pending >> i & 1) && (u32)(lo[i] >> 32) == tag && (u32)(hi[i] >> 32) == tag) {
                place(threadIdx.x + i * NTHREADS_, (u32)lo[i], (u32)hi[i]);  // words 2k, 2k + 1
                pending &= ~(1u << i);
            }
    }
}
