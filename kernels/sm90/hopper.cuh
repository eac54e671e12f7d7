/* hopper.cuh -- sm_90 building blocks in inline PTX: mbarriers, TMA (cp.async.bulk.tensor), wgmma fences and
 * shared-memory descriptors, register reallocation, named barriers.
 *
 * Shared-memory tiles here are "panels" of 64 columns (128 bytes of fp16/bf16) by `rows` rows, 128-byte swizzled
 * the way TMA writes them with CU_TENSOR_MAP_SWIZZLE_128B: 16-byte chunk c of row r sits at chunk c ^ (r % 8).
 * A panel starts on a 1024-byte boundary (the swizzle pattern repeats every 8 rows of 128 bytes); a tile of D
 * columns is D / 64 panels back to back.
 */
#ifndef FATTN_HOPPER_CUH
#define FATTN_HOPPER_CUH

#include "../common.cuh"

DEV unsigned smem_addr(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }
/* The dynamic shared array advanced to its first 1024-byte boundary (128-byte-swizzled tiles start on one), by pointer
 * arithmetic on the array itself: a round trip through an integer would lose the address space, and every access
 * through the result would compile to a generic load or store (the L1TEX path, a long-scoreboard wait). */
DEV unsigned char *smem_align1024(unsigned char *raw) { return raw + ((1024u - smem_addr(raw)) & 1023u); }

/* ---- mbarriers ------------------------------------------------------------------------------------------ */

DEV void mbar_init(uint64_t *bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count));
}
/* Makes the initialised barriers visible to the async proxy (TMA); follow with a block-wide barrier. */
DEV void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }

/* One arrival that also tells the barrier to expect `bytes` more bytes of TMA transactions in this phase. */
DEV void mbar_arrive_expect_tx(uint64_t *bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
DEV void mbar_arrive(uint64_t *bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
DEV void mbar_arrive_cnt(uint64_t *bar, unsigned count) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
/* Waits until the phase with parity `parity` has completed. */
DEV void mbar_wait(uint64_t *bar, unsigned parity) {
    const unsigned a = smem_addr(bar);
    unsigned done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(a), "r"(parity) : "memory");
    } while (!done);
}

/* ---- TMA ---------------------------------------------------------------------------------------------------- */

/* Box (c0, c1, c2, c3) of the 4-D tensor map `map` -> shared memory at dst; completes `bytes` on bar.  Out-of-bounds
 * elements are written as zeros (and still counted in the transaction bytes). */
DEV void tma_load_4d(void *dst, const void *map, uint64_t *bar, int c0, int c1, int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
        ::"r"(smem_addr(dst)), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_addr(bar))
        : "memory");
}
/* bytes (a multiple of 16, both addresses 16-byte aligned) from global src -> shared memory at dst, one bulk copy;
 * completes `bytes` on bar. */
DEV void bulk_load(void *dst, const void *src, unsigned bytes, uint64_t *bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar))
                 : "memory");
}
/* Shared memory at src -> box (c0, c1, c2, c3) of `map`; elements out of the tensor's bounds are not written. */
DEV void tma_store_4d(const void *map, const void *src, int c0, int c1, int c2, int c3) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n"
                 ::"l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_addr(src))
                 : "memory");
}
/* box (c0, c1, c2, c3) of `map` += shared memory at src, element-wise in the map's type (fp16 / bf16 / float32), as
 * one TMA reduction; elements out of the tensor's bounds are dropped.  Same bulk groups as the stores. */
DEV void tma_reduce_add_4d(const void *map, const void *src, int c0, int c1, int c2, int c3) {
    asm volatile("cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n"
                 ::"l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_addr(src))
                 : "memory");
}
/* dst[0 .. bytes) += src[0 .. bytes) (float32, global <- shared, bytes a multiple of 16): one bulk reduction, in the
 * same bulk groups as the TMA stores (commit, wait as they do). */
DEV void bulk_reduce_add_f32(float *dst, const float *src, unsigned bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                 ::"l"(dst), "r"(smem_addr(src)), "r"(bytes) : "memory");
}
/* dst[0 .. bytes) = src[0 .. bytes) (global <- shared, bytes a multiple of 16): a bulk copy in the same groups. */
DEV void bulk_store(void *dst, const void *src, unsigned bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n"
                 ::"l"(dst), "r"(smem_addr(src)), "r"(bytes) : "memory");
}
DEV void tma_store_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
/* Waits until the committed stores have finished reading shared memory. */
DEV void tma_store_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
/* Waits until the committed stores / reductions have finished writing global memory. */
DEV void tma_store_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
DEV void tma_prefetch_map(const void *map) { asm volatile("prefetch.tensormap [%0];\n" ::"l"(map) : "memory"); }

/* Counters between blocks: acquire load, release add. */
DEV int ld_acquire(const int *a) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(a) : "memory");
    return v;
}
DEV void red_release_add(int *a, int v) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(a), "r"(v) : "memory");
}
/* The same in parts, for several counters at once: relaxed loads polled until they show the count, then one fence
 * (the acquire pattern); one fence, then relaxed adds (the release pattern).  Each ld.acquire invalidates the SM's
 * L1 and waits, and each red.release fences: v3_bwd_wide.cu's turn keeper fences once each way for its four
 * counters instead. */
DEV int ld_relaxed(const int *a) {
    int v;
    asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(a) : "memory");
    return v;
}
DEV void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;\n" ::: "memory"); }
DEV void red_relaxed_add(int *a, int v) {
    asm volatile("red.relaxed.gpu.global.add.s32 [%0], %1;\n" ::"l"(a), "r"(v) : "memory");
}
/* a[0..3] += (x, y, z, w): one 16-byte reduction in L2 (sm_90's vector red), no value returned. */
DEV void red_add_v4(float *a, float x, float y, float z, float w) {
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(a), "f"(x), "f"(y), "f"(z), "f"(w) : "memory");
}
/* a[0..3] += the four fp16 / bf16 of lo, hi (packed pairs; a 8-byte aligned): one 8-byte reduction in L2 (sm_90's
 * vector red), .noftz keeping fp16 subnormals. */
DEV void red_add_x4(__half *a, unsigned lo, unsigned hi) {
    asm volatile("red.global.add.noftz.v2.f16x2 [%0], {%1, %2};\n" ::"l"(a), "r"(lo), "r"(hi) : "memory");
}
DEV void red_add_x4(__nv_bfloat16 *a, unsigned lo, unsigned hi) {
    asm volatile("red.global.add.noftz.v2.bf16x2 [%0], {%1, %2};\n" ::"l"(a), "r"(lo), "r"(hi) : "memory");
}
/* Programmatic dependent launch: a grid launched behind this one with the programmatic-serialization attribute
 * may start once every block of this grid has issued launch_dependents (or exited) -- it then runs beside this
 * grid's last blocks, and must synchronise with them itself; wait blocks the calling thread until the grids this
 * one was launched behind have completed and their writes are visible. */
DEV void griddep_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }
DEV void griddep_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }

/* Orders this thread's async-proxy global writes (bulk copies, once waited for) with its generic accesses after. */
DEV void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;\n" ::: "memory"); }

/* Orders this thread's ordinary shared-memory writes before later async-proxy (TMA, wgmma) reads of them. */
DEV void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

/* ---- warpgroups ----------------------------------------------------------------------------------------- */

/* This thread's warpgroup, as a value the compiler knows is the same across the warp (a shuffle from lane 0): what is
 * computed from it -- the warpgroup's tile offsets, the wgmma descriptors built from them -- then lives in uniform
 * registers, instead of being copied into them (R2UR) before every wgmma. */
DEV int warpgroup_index() { return __shfl_sync(0xffffffffu, (int)(threadIdx.x / 128), 0); }

template <int N> DEV void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N> DEV void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }

/* bar.sync on named barrier `id` (1..15; 0 is __syncthreads) for `threads` threads. */
DEV void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
DEV void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

/* ---- wgmma ---------------------------------------------------------------------------------------------- */

/* Before the first wgmma of a batch: orders earlier register writes (accumulators, A fragments) before it. */
DEV void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
DEV void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
/* Waits until at most N committed groups of this warpgroup are still running. */
template <int N> DEV void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

/* Keeps the compiler from moving reads or writes of accumulator registers across a wgmma fence / wait. */
template <int N> DEV void reg_fence(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(r[i])::"memory");
}

/* Four 8 x 8 matrices of 16-bit elements from the mma accumulator layout (register k is matrix k; a thread holds
 * its row lane / 4, columns 2 (lane % 4) and + 1, packed) stored transposed: lane 8 k + j gives the address of the
 * stored row j of matrix k, which holds the matrix's column j (16 bytes). */
DEV void stmatrix_x4_trans(unsigned addr, unsigned r0, unsigned r1, unsigned r2, unsigned r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0),
                 "r"(r1), "r"(r2), "r"(r3)
                 : "memory");
}

/* Shared-memory matrix descriptor, 128-byte swizzle (layout type 1 in bits 62-63).  Fields are byte values >> 4:
 * start address (bits 0-13), leading-dimension byte offset (16-29), stride-dimension byte offset (32-45).
 *   K-major operand (S = Q K^T: Q and K rows hold the reduction dim): 8-row groups 1024 bytes apart (SBO); the
 *     leading offset is unused; the k-th 16-column step starts 32 * (k % 4) bytes into the panel, the next panel
 *     after four steps.
 *   N-major operand (O += P V: V rows are keys, the reduction dim): 64-column panels `panel_bytes` apart (LBO),
 *     8-key groups 1024 bytes apart (SBO); the k-th 16-key step starts 2048 * k bytes in.
 * desc_lo: the low word (start address, LBO) of a tile's descriptor; the wgmma wrappers (wgmma_ops.cuh) add the
 * high word: SBO = 1024 bytes, 128-byte swizzle. */
DEV unsigned desc_lo(const void *smem, unsigned lbo_bytes) {
    return ((smem_addr(smem) & 0x3FFFF) >> 4) | (((lbo_bytes >> 4) & 0x3FFF) << 16);
}

#endif
