// Does a page's TMA load land later while the CTA's WGMMAs read shared memory?
//
// The event traces at C1 (docs/PERF.md session 23) time each K page from the producer's TMA issue to the consumer
// seeing it land: ~1 us for bf16, but ~3.2 us for fp8_ds_mla and for fp8_per_tensor's page A, and the pages land
// ~100 ns after a consumer starts waiting for them, that is, when its S WGMMAs stop. Two readings fit: the memory
// system is that slow under the decode's load, or the loads' writes into shared memory queue behind the WGMMAs'
// operand reads (an m64n64k32 SS WGMMA reads 128 bytes a cycle at the FP8 rate, all of what shared memory gives;
// m64n32k32 192). This tool separates them: one producer lane streams 64-token pages through a ring of slots (as
// paged_kv_load.h does), one releaser lane stamps each landing and frees the slot at once, and two warpgroups run
// nothing or an endless chain of FP8 WGMMAs over their own operand tiles (never the slots), so only shared-memory
// bandwidth couples the two.
//
// Build and run on the GPU machine:
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a scripts/tma_contention_bench.cu -o /tmp/tma_cont
//   /tmp/tma_cont
// One line per configuration: row bytes, stages, CTAs, page placement (dram: every CTA its own shuffled pages;
// pairs: CTAs c and c + 66 read the same pages, as the two m-blocks of C1 do), the WGMMA chain, then the load's
// latency (issue -> landed, median / p10 / p90 ns over every CTA's pages after the ring's first fill), each CTA's
// page stream in GB/s, and the two warpgroups' WGMMA rate in TFLOPS per SM and over the whole GPU.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "bench_ptx.h"

constexpr int kMaxStages = 4;
constexpr int kThreads = 384;  // WG0: producer warp and releaser warp; WG1, WG2: the WGMMA chains
constexpr int kKSteps = 16;    // a chain batch: 16 k-steps of 32 bytes (512 channels, as S's NoPE part)
constexpr int kOperandBytes = 32 * 1024;

enum Mma : int { kNone, kN32, kN64, kN256, kRs64, kNumMma };
const char* kMmaNames[kNumMma] = {"none", "SS m64n32k32", "SS m64n64k32", "SS m64n256k32", "RS m64n64k32"};
// N of each chain's WGMMA (its FLOPs per k-step are 2 x 64 x N x 32).
const int kMmaN[kNumMma] = {0, 32, 64, 256, 64};

struct Args {
  CUtensorMap main_map, tail_map;
  const int* table;  // [run][page]
  int pages, main_boxes, box_bytes, tail_bytes, slot_bytes, stages, mma, runs;
  uint64_t* issue;                  // [cta][page] clock64 at the TMA issue
  uint64_t* land;                   // [cta][page] clock64 when the releaser saw it land
  unsigned long long* batches;      // [cta] chain batches run by WG1 (WG2 runs as many, give or take one)
  unsigned long long* clocks;       // [cta][4] globaltimer and clock64 at the stream's start and end
};

// WGMMA chain of one warpgroup until the releaser raises `stop`. B's k-steps cycle through the 32 KB tile (n256:
// 8 KB each, so four). The stop flag is voted over the warpgroup (bar.red.or on named barrier 1 + wg), so its
// four warps run the same number of batches, which .sync.aligned WGMMAs require.
template <int kN, bool kRs>
__device__ unsigned long long run_chain(uint32_t a_base, uint32_t b_base, const volatile uint32_t* stop, int wg,
                                        float* sink) {
  float d[kN / 2];
  for (float& x : d) x = 0.f;
  uint32_t a_regs[4] = {0x38383838u ^ threadIdx.x, 0x30383038u, 0x38303830u, 0x3c343c34u};
  constexpr int kBStep = kN * 32;
  constexpr int kBSteps = kOperandBytes / kBStep < kKSteps ? kOperandBytes / kBStep : kKSteps;
  unsigned long long n = 0;
  int done = 0;
  while (!done) {
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < kKSteps; ++k) {
      const uint64_t b = descriptor(b_base + uint32_t((k % kBSteps) * kBStep));
      if constexpr (kRs) {
        wgmma_64x64x32_rs(d, a_regs, b, 1);
      } else {
        const uint64_t a = descriptor(a_base + uint32_t(k * 2048));
        if constexpr (kN == 32) wgmma_64x32x32(d, a, b, 1);
        if constexpr (kN == 64) wgmma_64x64x32(d, a, b, 1);
        if constexpr (kN == 256) wgmma_64x256x32(d, a, b, 1);
      }
    }
    wgmma_commit();
    wgmma_wait_all();
    ++n;
    const int flag = *stop != 0u;
    asm volatile(
        "{\n .reg .pred p, q;\n setp.ne.s32 p, %1, 0;\n bar.red.or.pred q, %2, 128, p;\n selp.s32 %0, 1, 0, q;\n}\n"
        : "=r"(done)
        : "r"(flag), "r"(1 + wg)
        : "memory");
  }
  float s = 0.f;
  for (float x : d) s += x;
  sink[blockIdx.x * kThreads + threadIdx.x] = s;
  return n;
}

__global__ void __launch_bounds__(kThreads, 1) contention_kernel(const __grid_constant__ Args a, const uint8_t* init,
                                                                 float* sink) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* base = smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024);
  uint8_t* operands = base;                        // A (16 k-steps x 64 rows x 32 bytes), then B
  uint8_t* slots = base + 2 * kOperandBytes;       // the page ring
  uint64_t* full = reinterpret_cast<uint64_t*>(slots + a.stages * a.slot_bytes);
  uint64_t* empty = full + kMaxStages;
  volatile uint32_t* stop = reinterpret_cast<volatile uint32_t*>(empty + kMaxStages);
  for (int i = threadIdx.x; i < 2 * kOperandBytes / 16; i += kThreads)
    reinterpret_cast<uint4*>(operands)[i] = reinterpret_cast<const uint4*>(init)[i];
  if (threadIdx.x == 0) {
    for (int s = 0; s < kMaxStages; ++s) {
      mbarrier_init(&full[s], 1);
      mbarrier_init(&empty[s], 1);
    }
    *stop = 0u;
    fence_mbarrier_init();
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wg = threadIdx.x / 128;
  const int* table = a.table + (blockIdx.x % a.runs) * a.pages;
  uint64_t* issue = a.issue + size_t(blockIdx.x) * a.pages;
  uint64_t* land = a.land + size_t(blockIdx.x) * a.pages;
  if (warp == 0) {
    if (lane == 0) {
      const uint32_t bytes = uint32_t(kPageTokens * (a.main_boxes * a.box_bytes + a.tail_bytes));
      for (int i = 0; i < a.pages; ++i) {
        const int stage = i % a.stages;
        const int block = table[i];
        mbarrier_wait(&empty[stage], ((i / a.stages) & 1) ^ 1);
        mbarrier_arrive_expect_tx(&full[stage], bytes);
        issue[i] = clock_now();
        uint8_t* slot = slots + stage * a.slot_bytes;
        for (int b = 0; b < a.main_boxes; ++b)
          tma_4d(&a.main_map, &full[stage], slot + b * kPageTokens * a.box_bytes, b * a.box_bytes, block);
        if (a.tail_bytes > 0)
          tma_4d(&a.tail_map, &full[stage], slot + a.main_boxes * kPageTokens * a.box_bytes,
                 a.main_boxes * a.box_bytes, block);
      }
    }
  } else if (warp == 1) {
    if (lane == 0) {
      const uint64_t ns0 = globaltimer_ns(), c0 = clock_now();
      for (int i = 0; i < a.pages; ++i) {
        const int stage = i % a.stages;
        mbarrier_wait(&full[stage], (i / a.stages) & 1);
        land[i] = clock_now();
        mbarrier_arrive_if(&empty[stage], true);
      }
      const uint64_t ns1 = globaltimer_ns(), c1 = clock_now();
      *stop = 1u;
      unsigned long long* c = a.clocks + blockIdx.x * 4;
      c[0] = ns0;
      c[1] = ns1;
      c[2] = c0;
      c[3] = c1;
    }
  } else if (wg >= 1 && a.mma != kNone) {
    const uint32_t a_base = smem_addr(operands), b_base = a_base + kOperandBytes;
    unsigned long long n = 0;
    switch (a.mma) {
      case kN32: n = run_chain<32, false>(a_base, b_base, stop, wg, sink); break;
      case kN64: n = run_chain<64, false>(a_base, b_base, stop, wg, sink); break;
      case kN256: n = run_chain<256, false>(a_base, b_base, stop, wg, sink); break;
      default: n = run_chain<64, true>(a_base, b_base, stop, wg, sink); break;
    }
    if (wg == 1 && threadIdx.x % 128 == 0) a.batches[blockIdx.x] = n;
  }
}

struct Config {
  int row_bytes, stages, ctas;
  bool pairs;
  int mma;
};

static double percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, size_t(q * (v.size() - 1) + 0.5))];
}

int main() {
  const int kCtas = 132, kPages = 128;
  EncodeFn enc = tensor_map_encoder();
  // Distinct shuffled pages for every CTA's run: 132 x 128 pages of 64 rows (up to 1.2 GB at bf16's 1152 bytes),
  // far past the 50 MB L2.
  const int blocks = kCtas * kPages;
  int* d_table = shuffled_block_table(blocks);
  const size_t max_bytes = size_t(blocks) * kPageTokens * 1152;
  void* cache = nullptr;
  CHECK(cudaMalloc(&cache, max_bytes));
  fill_kernel<<<1024, 256>>>(static_cast<uint32_t*>(cache), max_bytes / 4);
  // WGMMA operands: small e4m3 values (exponent field 4..7, never the NaN pattern 0x7F / 0xFF).
  std::vector<uint8_t> init(2 * kOperandBytes);
  std::mt19937 rng(1);
  for (auto& x : init) x = uint8_t((rng() & 0x80) | ((4 + rng() % 4) << 3) | (rng() & 7));
  uint8_t* d_init = nullptr;
  CHECK(cudaMalloc(&d_init, init.size()));
  CHECK(cudaMemcpy(d_init, init.data(), init.size(), cudaMemcpyHostToDevice));
  uint64_t *d_issue, *d_land;
  unsigned long long *d_batches, *d_clocks;
  float* d_sink;
  CHECK(cudaMalloc(&d_issue, size_t(kCtas) * kPages * 8));
  CHECK(cudaMalloc(&d_land, size_t(kCtas) * kPages * 8));
  CHECK(cudaMalloc(&d_batches, kCtas * 8));
  CHECK(cudaMalloc(&d_clocks, kCtas * 4 * 8));
  CHECK(cudaMalloc(&d_sink, kCtas * kThreads * 4));
  CHECK(cudaFuncSetAttribute(contention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024));

  std::vector<Config> sweep;
  for (int mma : {kNone, kN64}) sweep.push_back({576, 1, 1, false, mma});  // one load at a time, one SM
  for (int row : {576, 656, 1152})
    for (int stages : {2, 3})
      for (bool pairs : {false, true})
        for (int mma = 0; mma < kNumMma; ++mma)
          if (row != 1152 || stages == 2) sweep.push_back({row, stages, kCtas, pairs, mma});

  std::printf("%5s %6s %4s %6s %-14s | %8s %8s %8s | %9s | %9s %9s\n", "row", "stages", "ctas", "pages",
              "wgmma (2 WGs)", "lat med", "p10", "p90", "GB/s/SM", "TF/SM", "TF total");
  for (const Config& c : sweep) {
    const int main_boxes = c.row_bytes / 128, tail = c.row_bytes % 128;
    const int slot = ((kPageTokens * c.row_bytes + 1023) / 1024) * 1024;
    const int smem = 1024 + 2 * kOperandBytes + c.stages * slot + 2 * kMaxStages * 8 + 16;
    if (smem > 227 * 1024) continue;
    Args a{};
    a.main_map = make_page_map(enc, cache, c.row_bytes, blocks, 128, 128);
    a.tail_map = make_page_map(enc, cache, c.row_bytes, blocks, tail > 0 ? tail : 16, 128);
    a.table = d_table;
    a.pages = kPages;
    a.main_boxes = main_boxes;
    a.box_bytes = 128;
    a.tail_bytes = tail;
    a.slot_bytes = slot;
    a.stages = c.stages;
    a.mma = c.mma;
    a.runs = c.pairs ? c.ctas / 2 : c.ctas;
    a.issue = d_issue;
    a.land = d_land;
    a.batches = d_batches;
    a.clocks = d_clocks;
    std::vector<double> lat;
    double gbs = 0, tf_sm = 0;
    for (int rep = 0; rep < 4; ++rep) {  // the first launch warms up
      contention_kernel<<<c.ctas, kThreads, smem>>>(a, d_init, d_sink);
      CHECK(cudaGetLastError());
      CHECK(cudaDeviceSynchronize());
      if (rep == 0) continue;
      std::vector<uint64_t> issue(size_t(c.ctas) * kPages), land(size_t(c.ctas) * kPages);
      std::vector<unsigned long long> batches(c.ctas), clocks(c.ctas * 4);
      CHECK(cudaMemcpy(issue.data(), d_issue, issue.size() * 8, cudaMemcpyDeviceToHost));
      CHECK(cudaMemcpy(land.data(), d_land, land.size() * 8, cudaMemcpyDeviceToHost));
      CHECK(cudaMemcpy(batches.data(), d_batches, batches.size() * 8, cudaMemcpyDeviceToHost));
      CHECK(cudaMemcpy(clocks.data(), d_clocks, clocks.size() * 8, cudaMemcpyDeviceToHost));
      for (int cta = 0; cta < c.ctas; ++cta) {
        const unsigned long long* k = &clocks[cta * 4];
        const double ns = double(k[1] - k[0]), cycles = double(k[3] - k[2]);
        const double ghz = cycles / ns;
        for (int i = c.stages; i < kPages; ++i)
          lat.push_back(double(land[size_t(cta) * kPages + i] - issue[size_t(cta) * kPages + i]) / ghz);
        gbs += double(kPages) * kPageTokens * c.row_bytes / ns / (3.0 * c.ctas);
        if (c.mma != kNone) tf_sm += 2.0 * batches[cta] * kKSteps * 2.0 * 64 * kMmaN[c.mma] * 32 / ns / 1e3 /
                                    (3.0 * c.ctas);
      }
    }
    std::printf("%5d %6d %4d %6s %-14s | %8.0f %8.0f %8.0f | %9.1f | %9.2f %9.0f\n", c.row_bytes, c.stages, c.ctas,
                c.pairs ? "pairs" : "dram", kMmaNames[c.mma], percentile(lat, 0.5), percentile(lat, 0.1),
                percentile(lat, 0.9), gbs, tf_sm, tf_sm * c.ctas);
  }
  return 0;
}
