// Paged-KV streaming through TMA alone: how fast can 132 CTAs pull pages of
// 64 tokens x row_bytes through a block table into a ring of shared-memory
// stages, with consumers that only wait, hold the slot, release it and "work"?
// It isolates the load path of the decode kernels (paged_kv_load.h) from their
// math, to tell which of box width, stage count and consumer chain bounds the
// few-rows kernels (docs/DESIGN.md "Few query rows").
//
// Build and run on the GPU machine (no link against libcuda: the tensor-map
// encoder comes through the runtime's driver entry point):
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a scripts/tma_stream_bench.cu -o /tmp/tma_stream
//   /tmp/tma_stream            # box widths x stages x consumer chains, one line per configuration
//   /tmp/tma_stream l2         # L2 sector promotion x an evict-first cache hint on the loads
//
// Shape: M1's 128 sequences x 128 pages (16384 pages, 604 MB at 576 B/token,
// far past the 50 MB L2), shuffled over the cache by the block table, split in
// equal runs over 132 CTAs. Consumers: `wgs` warps, each standing for a
// consumer warpgroup, taking alternate pages as consumer_narrow's WGs do; each
// waits for its page, spins `hold` ns (the S^T that reads the slot), releases
// the slot, then spins `work` ns (the rest of its page chain).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "bench_ptx.h"

constexpr int kMaxStages = 8;
constexpr int kMaxWgs = 4;

struct Config {
  int row_bytes;   // 576 (fp8_per_tensor) or 656 (fp8_ds_mla)
  int box_bytes;   // inner box width: 64 (SW64), 128 (SW128), other multiples of 16 (no swizzle)
  int stages;
  int wgs;
  int hold_ns;
  int work_ns;
  int l2_promotion = 256;    // bytes the L2 fetches per miss (0: no promotion)
  bool evict_first = false;  // L2::cache_hint with an evict_first policy on every load
};

struct Args {
  CUtensorMap main_map;  // boxes of box_bytes
  CUtensorMap tail_map;  // one box over the rest of the row, if any
  const int* table;
  int pages_per_cta_floor, pages_total, num_ctas;
  int main_boxes, box_bytes, tail_bytes, slot_bytes, stages, wgs;
  bool evict_first;
  long long hold_cycles, work_cycles;
};

__device__ __forceinline__ void load_box(const Args& a, const CUtensorMap* map, uint64_t* bar, void* dst, int c0,
                                         int c3, uint64_t policy) {
  if (a.evict_first) {
    tma_4d_hint(map, bar, dst, c0, c3, policy);
  } else {
    tma_4d(map, bar, dst, c0, c3);
  }
}
__global__ void __launch_bounds__(32 * (1 + kMaxWgs), 1) stream_kernel(const __grid_constant__ Args a) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* slots = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full = reinterpret_cast<uint64_t*>(slots + a.stages * a.slot_bytes);  // [wg][stage]
  uint64_t* empty = full + kMaxWgs * kMaxStages;                                 // [stage]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int i = 0; i < kMaxWgs * kMaxStages; ++i) mbarrier_init(&full[i], 1);
    for (int s = 0; s < kMaxStages; ++s) mbarrier_init(&empty[s], 1);
    fence_mbarrier_init();
  }
  __syncthreads();
  // This CTA's run of logical pages.
  const int extra = a.pages_total - a.pages_per_cta_floor * a.num_ctas;
  const int begin = blockIdx.x * a.pages_per_cta_floor + min(int(blockIdx.x), extra);
  const int count = a.pages_per_cta_floor + (int(blockIdx.x) < extra ? 1 : 0);
  if (warp == 0) {
    if (lane == 0) {
      uint64_t policy;
      asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
      for (int i = 0; i < count; ++i) {
        const int stage = i % a.stages;
        const int block = a.table[begin + i];
        mbarrier_wait(&empty[stage], ((i / a.stages) & 1) ^ 1);
        uint64_t* f = &full[(i % a.wgs) * kMaxStages + stage];
        mbarrier_arrive_expect_tx(f, uint32_t(kPageTokens * (a.main_boxes * a.box_bytes + a.tail_bytes)));
        uint8_t* slot = slots + stage * a.slot_bytes;
        for (int b = 0; b < a.main_boxes; ++b) {
          load_box(a, &a.main_map, f, slot + b * kPageTokens * a.box_bytes, b * a.box_bytes, block, policy);
        }
        if (a.tail_bytes > 0)
          load_box(a, &a.tail_map, f, slot + a.main_boxes * kPageTokens * a.box_bytes, a.main_boxes * a.box_bytes,
                   block, policy);
      }
    }
  } else if (warp - 1 < a.wgs) {
    const int wg = warp - 1;
    uint32_t phase_bits = 0;
    for (int k = wg; k < count; k += a.wgs) {
      const int stage = k % a.stages;
      mbarrier_wait(&full[wg * kMaxStages + stage], (phase_bits >> stage) & 1u);
      phase_bits ^= 1u << stage;
      spin(a.hold_cycles);
      __syncwarp();
      if (lane == 0) mbarrier_arrive_if(&empty[stage], true);
      spin(a.work_cycles);
    }
  }
}

int main(int argc, char** argv) {
  const bool l2_sweep = argc > 1 && std::string(argv[1]) == "l2";
  const int sequences = 128, pages_per_seq = 128, num_ctas = 132;
  const int pages = sequences * pages_per_seq;
  EncodeFn enc = tensor_map_encoder();
  int clock_khz = 0;
  CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  int* d_table = shuffled_block_table(pages);
  const size_t max_bytes = size_t(pages) * kPageTokens * 1152;  // bf16's rows are the longest
  void* cache = nullptr;
  CHECK(cudaMalloc(&cache, max_bytes));
  fill_kernel<<<1024, 256>>>(static_cast<uint32_t*>(cache), max_bytes / 4);
  CHECK(cudaFuncSetAttribute(stream_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024));

  std::vector<Config> sweep;
  // The decode kernels' boxes (fp8_per_tensor 64 bytes, fp8_ds_mla and bf16 128), no chain; bf16's two
  // stages of 72 KB.
  for (int row : l2_sweep ? std::vector<int>{576, 656, 1152} : std::vector<int>{})
    for (int promo : {0, 64, 128, 256})
      for (bool evict : {false, true})
        sweep.push_back({row, row == 576 ? 64 : 128, row == 1152 ? 2 : 3, 2, 0, 0, promo, evict});
  for (int row : l2_sweep ? std::vector<int>{} : std::vector<int>{576, 656})
    for (int box : {64, 128})
      for (int st : {2, 3, 4, 5, 6}) sweep.push_back({row, box, st, 2, 0, 0});
  for (int box : l2_sweep ? std::vector<int>{} : std::vector<int>{192, 256}) sweep.push_back({576, box, 4, 2, 0, 0});
  // The few-rows kernels' chains (session 9 arithmetic: ~2.8 us per WG page at
  // 576 B, ~3.7 us at 656 B, ~0.4 us of it holding the slot).
  for (int row : l2_sweep ? std::vector<int>{} : std::vector<int>{576, 656})
    for (int box : {64, 128})
      for (int st : {3, 4, 5, 6})
        for (int work : {1600, 2400}) sweep.push_back({row, box, st, 2, 400, work});

  std::printf("%5s %4s %6s %3s %6s %6s %5s %5s | %9s %9s\n", "row", "box", "stages", "wgs", "hold", "work", "promo",
              "evict", "us", "GB/s");
  for (const Config& c : sweep) {
    const int main_boxes = c.row_bytes / c.box_bytes;
    const int tail = c.row_bytes - main_boxes * c.box_bytes;
    const int slot = ((kPageTokens * c.row_bytes + 1023) / 1024) * 1024;
    const int smem = c.stages * slot + 1024 + (kMaxWgs + 1) * kMaxStages * 8;
    if (smem > 227 * 1024) continue;
    Args a{};
    a.main_map = make_page_map(enc, cache, c.row_bytes, pages, c.box_bytes, c.l2_promotion);
    a.tail_map = make_page_map(enc, cache, c.row_bytes, pages, tail > 0 ? tail : 16, c.l2_promotion);
    a.evict_first = c.evict_first;
    a.table = d_table;
    a.pages_total = pages;
    a.num_ctas = num_ctas;
    a.pages_per_cta_floor = pages / num_ctas;
    a.main_boxes = main_boxes;
    a.box_bytes = c.box_bytes;
    a.tail_bytes = tail;
    a.slot_bytes = slot;
    a.stages = c.stages;
    a.wgs = c.wgs;
    a.hold_cycles = (long long)c.hold_ns * clock_khz / 1000000;
    a.work_cycles = (long long)c.work_ns * clock_khz / 1000000;
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    std::vector<float> times;
    for (int rep = 0; rep < 7; ++rep) {
      CHECK(cudaEventRecord(e0));
      stream_kernel<<<num_ctas, 32 * (1 + kMaxWgs), smem>>>(a);
      CHECK(cudaEventRecord(e1));
      CHECK(cudaEventSynchronize(e1));
      CHECK(cudaGetLastError());
      float ms = 0.f;
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      if (rep > 0) times.push_back(ms * 1000.f);  // the first launch warms up
    }
    std::sort(times.begin(), times.end());
    const float us = times[times.size() / 2];
    const double bytes = double(pages) * kPageTokens * c.row_bytes;
    std::printf("%5d %4d %6d %3d %6d %6d %5d %5d | %9.1f %9.0f\n", c.row_bytes, c.box_bytes, c.stages, c.wgs,
                c.hold_ns, c.work_ns, c.l2_promotion, int(c.evict_first), us, bytes / us / 1e3);
  }
  return 0;
}
