// How long one SM's TMA unit takes to issue and land a bf16 page (64 tokens x 1152 bytes) by the shape of its
// boxes. Session 38's trace of the bf16 pair had the producer issue the next pair's four parts one after another,
// each ~250-300 ns behind the last (~6 ns a KB), with page B's critical right part queued behind page A's; this
// tells whether other boxes would issue faster.
//
// Build and run on the GPU machine:
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a scripts/tma_issue_bench.cu -o /tmp/tma_issue
//   /tmp/tma_issue
// Shapes (each a whole page into one 72 KB slot, 128-byte swizzle, as the decode kernel lands it):
//   9x4d      nine 4-D boxes of one 64-channel slab (8 KB) each (FlashMLA's tiles)
//   5d-k      the V slabs as boxes of k slabs of a 5-D map whose slab stride (128 B) is below its token stride
//             (make_slab_tensor_map: k = 2 is bf16's pieces, 4 its parts), and the RoPE slab as one 4-D box
// Each runs on 1 CTA (the unit alone, nothing else loading) and on 132 (every SM loading), over pages that stay in
// L2 (32 distinct pages) or come from DRAM (a shuffled table over 16384 pages). Per page, the producer thread reads
// clock64 before its first box, after its last box's issue, and when the page's mbarrier completes, with one or
// two pages in flight (two: the next page issues while the last lands). Printed: median ns (clock64 converted
// with the run's own globaltimer) from the first box to the last box's issue, and to the page's landing; with two
// in flight also ns a page over the run.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "bench_ptx.h"

namespace {

constexpr int kRowBytes = 1152;
constexpr int kSlabBytes = 128 * kPageTokens;  // 8 KB
constexpr int kSlabs = 9;
constexpr int kPageBytes = kSlabs * kSlabBytes;
constexpr int kPagesPerCta = 256;

struct Args {
  CUtensorMap page_map;  // (byte, head, token, block), boxes of one slab
  CUtensorMap slab_map;  // (byte in slab, token, slab, head, block), boxes of `slabs_per_box` slabs
  const int* table;
  int table_size, slabs_per_box, in_flight;  // slabs_per_box 1: nine 4-D boxes
  long long* out;                            // [cta][page][3]: issue cycles, land cycles; [cta] run cycles, ns
};

__device__ __forceinline__ void tma_5d(const CUtensorMap* map, uint64_t* bar, void* dst, int slab, int block) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6, %7}], [%2];" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(0), "r"(0), "r"(slab), "r"(0), "r"(block)
      : "memory");
}

__global__ void __launch_bounds__(32, 1) issue_kernel(const __grid_constant__ Args a) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* slots = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full = reinterpret_cast<uint64_t*>(slots + 2 * kPageBytes);
  if (threadIdx.x != 0) return;
  mbarrier_init(&full[0], 1);
  mbarrier_init(&full[1], 1);
  fence_mbarrier_init();
  long long* out = a.out + size_t(blockIdx.x) * (kPagesPerCta * 3 + 2);
  const uint64_t run_t0 = clock_now(), run_g0 = globaltimer_ns();
  uint64_t issued_at[2] = {0, 0};
  auto land = [&](int i) {  // waits for page i and records it
    const int s = i % 2;
    mbarrier_wait(&full[s], (i / 2) & 1);
    const uint64_t t = clock_now();
    out[i * 3 + 1] = (long long)(t - issued_at[s]);
  };
  for (int i = 0; i < kPagesPerCta; ++i) {
    const int s = i % 2;
    if (i >= a.in_flight) land(i - a.in_flight);  // the slot (and the unit) free of the page before
    const int block = a.table[(blockIdx.x * kPagesPerCta + i) % a.table_size];
    uint8_t* slot = slots + s * kPageBytes;
    const uint64_t t0 = clock_now();
    mbarrier_arrive_expect_tx(&full[s], kPageBytes);
    if (a.slabs_per_box == 1) {
      for (int slab = 0; slab < kSlabs; ++slab) {
        tma_4d(&a.page_map, &full[s], slot + slab * kSlabBytes, slab * 128, block);
      }
    } else {
      for (int slab = 0; slab < kSlabs - 1; slab += a.slabs_per_box) {
        tma_5d(&a.slab_map, &full[s], slot + slab * kSlabBytes, slab, block);
      }
      tma_4d(&a.page_map, &full[s], slot + (kSlabs - 1) * kSlabBytes, (kSlabs - 1) * 128, block);
    }
    const uint64_t t1 = clock_now();
    issued_at[s] = t0;
    out[i * 3] = (long long)(t1 - t0);
  }
  for (int i = max(0, kPagesPerCta - a.in_flight); i < kPagesPerCta; ++i) land(i);
  out[kPagesPerCta * 3] = (long long)(clock_now() - run_t0);
  out[kPagesPerCta * 3 + 1] = (long long)(globaltimer_ns() - run_g0);
}

CUtensorMap make_slab_map(EncodeFn enc, void* base, int num_blocks, int slabs_per_box) {
  CUtensorMap m;
  const cuuint64_t dims[5] = {128, kPageTokens, kSlabs, 1, cuuint64_t(num_blocks)};
  const cuuint64_t strides[4] = {kRowBytes, 128, kRowBytes, cuuint64_t(kRowBytes) * kPageTokens};
  const cuuint32_t box[5] = {128, kPageTokens, cuuint32_t(slabs_per_box), 1, 1};
  const cuuint32_t es[5] = {1, 1, 1, 1, 1};
  const CUresult r = enc(&m, CU_TENSOR_MAP_DATA_TYPE_UINT8, 5, base, dims, strides, box, es,
                         CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                         CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::printf("cuTensorMapEncodeTiled (5-D) failed (%d)\n", int(r));
    std::exit(1);
  }
  return m;
}

long long median(std::vector<long long> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main() {
  const int num_blocks = 16384;
  EncodeFn enc = tensor_map_encoder();
  void* cache = nullptr;
  const size_t bytes = size_t(num_blocks) * kPageTokens * kRowBytes;
  CHECK(cudaMalloc(&cache, bytes));
  fill_kernel<<<1024, 256>>>(static_cast<uint32_t*>(cache), bytes / 4);
  int* d_table = shuffled_block_table(num_blocks);
  const int max_ctas = 132;
  long long* d_out = nullptr;
  const size_t per_cta = kPagesPerCta * 3 + 2;
  CHECK(cudaMalloc(&d_out, max_ctas * per_cta * sizeof(long long)));
  const int smem = 2 * kPageBytes + 1024 + 64;
  CHECK(cudaFuncSetAttribute(issue_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));

  std::printf("%-6s %4s %6s %9s | %9s %9s %9s\n", "boxes", "ctas", "pages", "in-flight", "issue ns", "land ns",
              "ns/page");
  for (int slabs_per_box : {1, 2, 4, 8}) {
    for (int ctas : {1, max_ctas}) {
      for (int table_size : {32, num_blocks}) {
        for (int in_flight : {1, 2}) {
          Args a{};
          a.page_map = make_page_map(enc, cache, kRowBytes, num_blocks, 128, 128);
          a.slab_map = make_slab_map(enc, cache, num_blocks, slabs_per_box == 1 ? 2 : slabs_per_box);
          a.table = d_table;
          a.table_size = table_size;
          a.slabs_per_box = slabs_per_box;
          a.in_flight = in_flight;
          a.out = d_out;
          std::vector<long long> issue, land, per_page;
          for (int rep = 0; rep < 3; ++rep) {  // the first warms L2 and the clocks
            issue_kernel<<<ctas, 32, smem>>>(a);
            CHECK(cudaGetLastError());
            CHECK(cudaDeviceSynchronize());
            if (rep == 0) continue;
            std::vector<long long> h(ctas * per_cta);
            CHECK(cudaMemcpy(h.data(), d_out, h.size() * sizeof(long long), cudaMemcpyDeviceToHost));
            for (int c = 0; c < ctas; ++c) {
              const long long* o = &h[c * per_cta];
              const double ns_per_cycle = double(o[kPagesPerCta * 3 + 1]) / double(o[kPagesPerCta * 3]);
              for (int i = 1; i < kPagesPerCta; ++i) {
                issue.push_back((long long)(o[i * 3] * ns_per_cycle));
                land.push_back((long long)(o[i * 3 + 1] * ns_per_cycle));
              }
              per_page.push_back(o[kPagesPerCta * 3 + 1] / kPagesPerCta);
            }
          }
          const std::string name = slabs_per_box == 1 ? "9x4d" : "5d-" + std::to_string(slabs_per_box);
          std::printf("%-6s %4d %6s %9d | %9lld %9lld %9lld\n", name.c_str(), ctas, table_size == 32 ? "L2" : "DRAM",
                      in_flight, median(issue), median(land), median(per_page));
        }
      }
    }
  }
  return 0;
}
