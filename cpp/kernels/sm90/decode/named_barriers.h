// Named barriers and mbarrier helpers of the Hopper decode kernel.
//
// Named barriers (PTX "bar.sync") synchronize a subset of the CTA: only the
// 256 consumer threads take part, the producer warp never waits on them.
// Id 0 is __syncthreads(); ours start at 1 (16 exist per CTA).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace jax_flash_mla::sm90 {

enum class NamedBarriers : int {
  kQReady = 1,    // Q tile of the next chunk is in shared memory
  kMaxReady = 2,  // fp8_ds_mla: both warpgroups published this page's row maxima
  kPReady = 3,    // fp8_ds_mla: both halves of P are in shared memory (and stale V rows zeroed)
  kSumReady = 4,  // both warpgroups published their partial row sums
  // bf16 / fp8_per_tensor page pairs (both warpgroups sync: compute-sanitizer's racecheck
  // reported the P and row-max hand-offs as hazards with a bar.arrive on the publishing side).
  // Both WGs take part in every page hand-off, so these also order each WG's
  // own writes (P, V^T, zeroed rows) before its WGMMAs read them.
  kPageAReady = 5,  // WG0 published page A's P and running row max (stale V rows of A zeroed)
  kPageBReady = 6,  // WG1 published page B's P and running row max (stale V rows of B zeroed)
  // FP8 formats with few query rows (consumer_narrow): kNarrowMax0 / kNarrowP0 + wg
  // are per-WG barriers (128 threads), kExchangeRead takes both WGs.
  kNarrowMax0 = 7,     // and 8: the WG's warps published this page's column maxima
  kNarrowP0 = 9,       // and 10: the WG's P^T tile is in shared memory
  kExchangeRead = 11,  // both WGs read the chunk-end exchange (epilogue_narrow)
  kPrepExchange = 12,  // design S: the producer's two prep warps combined a page's maxima and votes (ds_page_prep.cuh)
};

// The per-WG barrier `base` + wg of a pair (kNarrowMax0, kNarrowP0).
__device__ __forceinline__ NamedBarriers wg_barrier(NamedBarriers base, int wg) {
  return NamedBarriers(static_cast<int>(base) + wg);
}

__device__ __forceinline__ void named_barrier_sync(NamedBarriers id, int num_threads) {
  // "bar.sync a, b": b threads (a multiple of the warp size) must arrive.
  asm volatile("bar.sync %0, %1;\n" ::"r"(static_cast<int>(id)), "r"(num_threads) : "memory");
}

// The same barrier for threads that reach it from different instructions
// (the page-pair hand-offs, which each WG passes in its own loop). bar.sync
// is barrier.sync.aligned, whose threads must all execute the same
// instruction (PTX ISA "barrier"); compute-sanitizer's synccheck reports
// the split use as divergent threads. barrier.sync drops that requirement.
__device__ __forceinline__ void named_barrier_sync_unaligned(NamedBarriers id, int num_threads) {
  asm volatile("barrier.sync %0, %1;\n" ::"r"(static_cast<int>(id)), "r"(num_threads) : "memory");
}

// Makes this thread's generic-proxy shared-memory writes (st.shared) visible
// to the async proxy (WGMMA operand reads, TMA): PTX ISA "membar/fence",
// fence.proxy.async. Each writing thread issues it before the barrier that
// orders the writes with the consumer WGMMA.
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- mbarrier (PTX ISA "Parallel Synchronization and Communication
// Instructions: mbarrier") -------------------------------------------------

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

// Makes the initializations visible to the async proxy (TMA's complete_tx).
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// Arrives when `pred` holds. Predicated inside the asm rather than behind a
// C++ branch: a divergent branch while a WGMMA is in flight makes ptxas
// serialize the warpgroup's WGMMAs (warning C7518).
__device__ __forceinline__ void mbarrier_arrive_if(uint64_t* bar, bool pred) {
  asm volatile(
      "{\n .reg .pred p;\n .reg .b64 st;\n setp.ne.b32 p, %1, 0;\n"
      " @p mbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(smem_addr(bar)),
      "r"(int(pred))
      : "memory");
}

// Arrives once and announces `bytes` of incoming async-copy transactions; the
// phase completes when the arrival count and the byte count both drain.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile(
      "{\n .reg .b64 st;\n mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(
          smem_addr(bar)),
      "r"(bytes)
      : "memory");
}

// Blocks until the phase with the given parity has completed. A freshly
// initialized barrier is in phase 0, and "the phase before it" (parity 1)
// counts as complete, so a producer can wait on parity 1 for free slots.
//
// Debugging builds (CMake option JAX_FLASH_MLA_HANG_TRAP): a wait still unmet
// after kHangTrapNs traps, so a protocol mistake fails the launch with a CUDA
// error instead of hanging the process (and a GPU call's whole time limit).
// Waits that never end elsewhere (bar.sync, setmaxnreg.inc) are not covered,
// but the warps spinning on mbarriers behind them are. 10 s: far above any
// wait of a real decode (a whole C2 decode takes ~1 ms on an H200).
#ifdef JAX_FLASH_MLA_HANG_TRAP
inline constexpr uint64_t kHangTrapNs = 10'000'000'000ull;
#endif

__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
#ifdef JAX_FLASH_MLA_HANG_TRAP
  // One asm block, as below: waits written in C++ around __trap() made ptxas
  // spill kilobytes and serialize the WGMMAs (C7512).
  asm volatile(
      "{\n"
      " .reg .pred done, late;\n"
      " .reg .u64 t0, t;\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @done bra DONE_%=;\n"
      " mov.u64 t0, %%globaltimer;\n"
      "WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @done bra DONE_%=;\n"
      " mov.u64 t, %%globaltimer;\n"
      " sub.u64 t, t, t0;\n"
      " setp.gt.u64 late, t, %2;\n"
      " @late trap;\n"
      " bra WAIT_%=;\n"
      "DONE_%=:\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity), "l"(kHangTrapNs)
      : "memory");
#else
  asm volatile(
      "{\n"
      " .reg .pred done;\n"
      "WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT_%=;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
#endif
}

}  // namespace jax_flash_mla::sm90
