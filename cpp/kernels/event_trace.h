// Pipeline event trace, for debugging builds only (CMake option JAX_FLASH_MLA_EVENT_TRACE; release builds compile
// none of it). The decode kernel stamps clock64 where its warpgroups hand work to each other (S retired, a page's
// P published, a P V retired, a slot landed or refilled), for the first kCtas CTAs of the grid and kPages ring
// positions each. scripts/trace_pipeline.py lays the stamps out per page pair: which warpgroup waits for which, and
// for how long. Nsight Compute's stall samples cannot show that order, and session 12's profiles did not point at
// the chain that sets the pace (docs/DESIGN.md). The stamps cost a few instructions each; the figures are for
// reading the order of events, not for timing a build.
#pragma once

#include <cstddef>
#include <cstdint>

#ifdef JAX_FLASH_MLA_EVENT_TRACE
#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>
#include <vector>
#endif

namespace jax_flash_mla::event_trace {

// Buffer of uint64 words: stamps [cta][role][page][event], then per CTA kClockWords (clock64, globaltimer) pairs
// at the producer's start and end, which convert cycles to nanoseconds.
inline constexpr int kCtas = 16;    // CTAs (x, 0, 0) with x < kCtas: KV head 0, query-row tile 0
inline constexpr int kRoles = 3;    // consumer WG0, consumer WG1, producer
inline constexpr int kPages = 256;  // ring positions (pages a CTA consumed so far, across chunks)
inline constexpr int kEvents = 15;
inline constexpr int kClockWords = 4;
inline constexpr std::size_t kStampWords = std::size_t(kCtas) * kRoles * kPages * kEvents;
inline constexpr std::size_t kWords = kStampWords + std::size_t(kCtas) * kClockWords;

// Event ids; scripts/trace_pipeline.py names them in the same order.
// consumer() (bf16, fp8_per_tensor), per pair at ring position ia of its page A, and for issue_s at its page.
enum PairEvent : int {
  kPairTop,        // the pair's loop iteration starts
  kPairSRetired,   // WG0: S_A retired; WG1: S_B retired
  kPairAReady,     // past kPageAReady (WG0: and its P_A V_A,L issued)
  kPairBReady,     // past kPageBReady (WG1: P_B published)
  kPairPvRetired,  // WG0: P_A V_A,L retired; WG1: P_A V_A,R retired
  kPairEnd,        // the pair's last WGMMAs (and early S) issued
  kSLeftLanded,    // issue_s: the slot's left part landed (k_full[0] passed), at that page's ring position
  kSRightLanded,   // issue_s: the right part landed
  kSWaitStart,     // issue_s: before waiting for the left part (landed - this > 0: the S waited for its page)
  kPairStored,     // a WG's writes for the other (P, V^T) done, before their fence and barrier; at the page
                   // written: WG0 P_A at ia, V^T_B,L at ib; WG1 its V^T halves at ia, P_B at ib
};
// consumer_ds (fp8_ds_mla), per page.
enum DsEvent : int {
  kDsTop,          // the page's loop iteration starts
  kDsTransposed,   // this WG's V^T half written
  kDsHeadRetired,  // the S head (RoPE, group 0) and the last page's P V retired
  kDsSRetired,     // group 3 retired: the whole S
  kDsMaxReady,     // past kMaxReady (both WGs' row maxima)
  kDsPReady,       // past kPReady (all four P_g tiles)
  kDsEnd,          // P V issued
  kDsSlotLanded,   // issue_s_head: the slot landed, at that page's ring position
  kDsSlotWait,     // issue_s_head: before waiting for the slot
  kDsPStored,      // this WG's P_g stored and O rescaled, before the fence and kPReady
};
// Both consumers, per chunk (a run of one sequence's pages): at the ring position of the chunk's first page
// (start, Q loaded) or last page (pages done, epilogue done).
enum ChunkEvent : int {
  kChunkStart = 10,  // before the chunk's Q load
  kQLoaded,          // Q in shared memory (past kQReady)
  kPagesDone,        // the chunk's last WGMMA retired
  kEpilogueDone,     // O and lse (or the split partials) written
  kSumsShared,       // the epilogue past kSumReady (both WGs' row sums in shared memory)
};
static_assert(int(kPairStored) < int(kChunkStart) && int(kDsPStored) < int(kChunkStart) && int(kSumsShared) < kEvents,
              "event ids");
// producer, per page.
enum ProducerEvent : int {
  kLeftIssued,   // the (left part's) slot was free and its TMA issued
  kRightIssued,  // bf16 / fp8_per_tensor: the right part's
};

#if defined(JAX_FLASH_MLA_EVENT_TRACE) && defined(__CUDACC__)
// One thread per warpgroup stamps (its first thread), as a predicated store inside one asm block: a branch around
// it, next to WGMMAs in flight, would make ptxas serialize them (C7514).
// The clock read waits for a shared-memory load of an arbitrary word: a bar.sync compiles to
// BAR.SYNC.DEFER_BLOCKING, and a clock read right behind it may issue before the barrier completes (session 21's
// traces had a WG stamp "past kPageBReady" before the other WG stored P_B), while a load behind it waits. ptxas
// keeps the clock read after the compare on the loaded word (SASS: LDS, ISETP, CS2R, SEL), and issue is in order.
__device__ __forceinline__ void stamp(uint64_t* buf, int role, int page, int event) {
  const uint32_t on = uint32_t(buf != nullptr) & uint32_t(threadIdx.x % 128 == 0) & uint32_t(blockIdx.y == 0) &
                      uint32_t(blockIdx.z == 0) & uint32_t(blockIdx.x < kCtas) & uint32_t(uint32_t(page) < kPages);
  const std::size_t idx = on ? ((std::size_t(blockIdx.x) * kRoles + role) * kPages + page) * kEvents + event : 0;
  asm volatile(
      "{\n .reg .pred p, q;\n .reg .u64 t;\n .reg .b32 a, v;\n mov.u32 a, 0;\n"
      " ld.volatile.shared.b32 v, [a];\n setp.ne.b32 q, v, 0x7f7f7f7f;\n"
      " @q mov.u64 t, %%clock64;\n @!q mov.u64 t, 1;\n"
      " setp.ne.u32 p, %0, 0;\n @p st.global.u64 [%1], t;\n}\n" ::"r"(on),
      "l"(buf + idx)
      : "memory");
}

// (clock64, globaltimer) into clock words `which` * 2 and + 1 of this CTA (the producer: 0 at start, 1 at end).
__device__ __forceinline__ void stamp_clocks(uint64_t* buf, int which) {
  if (buf == nullptr || blockIdx.x >= kCtas || blockIdx.y != 0 || blockIdx.z != 0) return;
  uint64_t clock, ns;
  asm volatile("mov.u64 %0, %%clock64;\n mov.u64 %1, %%globaltimer;\n" : "=l"(clock), "=l"(ns));
  buf[kStampWords + blockIdx.x * kClockWords + 2 * which] = clock;
  buf[kStampWords + blockIdx.x * kClockWords + 2 * which + 1] = ns;
}
#endif

#ifdef JAX_FLASH_MLA_EVENT_TRACE
// Host side. The buffer lives for the process; the launcher passes it to every decode launch once armed (null
// before: nothing is stamped). A launch captured into a CUDA graph keeps the pointer it saw, so arm before the
// first call of a jitted decode.
inline uint64_t*& buffer_slot() {
  static uint64_t* buf = nullptr;
  return buf;
}

inline uint64_t* device_buffer() { return buffer_slot(); }

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("jax_flash_mla event_trace: ") + what + ": " + cudaGetErrorString(e));
}

// Allocates the buffer on first use and zeroes it (a zero stamp reads as "not reached").
inline void arm() {
  uint64_t*& buf = buffer_slot();
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  if (buf == nullptr) check(cudaMalloc(reinterpret_cast<void**>(&buf), kWords * sizeof(uint64_t)), "cudaMalloc");
  check(cudaMemset(buf, 0, kWords * sizeof(uint64_t)), "cudaMemset");
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

inline std::vector<uint64_t> read() {
  std::vector<uint64_t> words(kWords, 0);
  uint64_t* buf = buffer_slot();
  if (buf == nullptr) throw std::runtime_error("jax_flash_mla event_trace: read before arm");
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  check(cudaMemcpy(words.data(), buf, kWords * sizeof(uint64_t), cudaMemcpyDeviceToHost), "cudaMemcpy");
  return words;
}
#endif

}  // namespace jax_flash_mla::event_trace
