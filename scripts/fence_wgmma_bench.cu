// How a warpgroup's WGMMA issue overlaps its other work, in two measurements:
// 1. How long issuing a chain of WGMMAs holds the issuing warp: if the tensor pipe's queue is shallow, a long chain
//    (an S of 18 k-steps, a P V) keeps the warp in its issue loop until most of the chain has run, and whatever the
//    code puts after the issue (a softmax, a transpose) waits for that.
// 2. Whether an operation waits for WGMMAs in flight: the decode kernels publish P (and fp8_per_tensor its V^T)
//    with st.shared + fence.proxy.async + a named barrier, often while the publishing warpgroup's own P V WGMMA
//    still runs; the event trace of session 15 (scripts/trace_pipeline.py) shows that publish ending ~25 ns
//    before that WGMMA retires.
// One warpgroup per SM; operand values do not matter to the timing (the tiles hold small random e4m3 values).
//
// Build and run on the GPU machine:
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a scripts/fence_wgmma_bench.cu -o /tmp/fence_wgmma
//   /tmp/fence_wgmma
// Prints median cycles (over the 132 CTAs' first threads): of the chain's issue and of its wait_group 0; then, with
// 4 x m64n128k32 in flight, of the issue, the operation and the wait. If the operation waits for the WGMMAs, its
// cycles take what the wait had.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "bench_ptx.h"

enum Op : int { kNothing, kStoreFenceProxyAsync, kFenceProxyAsyncOnly, kMembarCta, kStoreOnly, kNamedBarrier,
                kStoreFenceNoWgmma, kNumOps };
const char* kOpNames[kNumOps] = {"nothing",
                                 "st.shared + fence.proxy.async",
                                 "fence.proxy.async alone",
                                 "membar.cta (fence.acq_rel.cta)",
                                 "st.shared alone",
                                 "bar.sync (named, 128 threads)",
                                 "st.shared + fence.proxy.async, no WGMMA in flight"};

// kChain a compile-time count: a loop with a run-time count made ptxas serialize the WGMMAs (C7515).
template <int kN, int kChain>
__global__ void __launch_bounds__(128, 1) fence_kernel(const uint8_t* init, uint64_t* out, float* sink, int op) {
  __shared__ alignas(1024) uint8_t tiles[3][8192];  // A (64 x 32 bytes), B (kN x 32), and a P-like tile
  for (int i = threadIdx.x; i < 3 * 8192; i += 128) tiles[i / 8192][i % 8192] = init[i];
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  const uint32_t base = smem_addr(tiles);
  const uint64_t a = descriptor(base), b = descriptor(base + 8192);
  float d[kN / 2];
  for (float& x : d) x = 0.f;
  const bool in_flight = op != kStoreFenceNoWgmma;

  uint64_t t0 = clock_now();
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
  for (int i = 0; i < kChain; ++i) {
    if constexpr (kN == 64) {
      wgmma_64x64x32(d, a, b, i > 0);
    } else {
      wgmma_64x128x32(d, a, b, i > 0);
    }
  }
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
  if (!in_flight) asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  uint64_t t1 = clock_now();
  uint32_t* p = reinterpret_cast<uint32_t*>(tiles[2]) + threadIdx.x;
  switch (op) {
    case kStoreFenceProxyAsync:
    case kStoreFenceNoWgmma:
      *reinterpret_cast<volatile uint32_t*>(p) = t1;
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      break;
    case kFenceProxyAsyncOnly:
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      break;
    case kMembarCta:
      asm volatile("fence.acq_rel.cta;" ::: "memory");
      break;
    case kStoreOnly:
      *reinterpret_cast<volatile uint32_t*>(p) = t1;
      break;
    case kNamedBarrier:
      asm volatile("bar.sync 1, 128;" ::: "memory");
      break;
    default:
      break;
  }
  uint64_t t2 = clock_now();
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  for (float& x : d) asm volatile("" : "+f"(x)::"memory");
  uint64_t t3 = clock_now();
  float s = 0.f;
  for (float x : d) s += x;
  sink[blockIdx.x * 128 + threadIdx.x] = s;
  if (threadIdx.x == 0) {
    out[blockIdx.x * 3 + 0] = t1 - t0;
    out[blockIdx.x * 3 + 1] = t2 - t1;
    out[blockIdx.x * 3 + 2] = t3 - t2;
  }
}

struct Timing {
  uint64_t issue, op, wait;
};

// Median over the CTAs' first threads and four runs (a fifth, first, is a warm-up).
template <int kN, int kChain>
Timing measure(int sms, const uint8_t* d_init, uint64_t* d_out, float* d_sink, int op) {
  std::vector<std::vector<uint64_t>> runs(3);
  for (int rep = 0; rep < 5; ++rep) {
    fence_kernel<kN, kChain><<<sms, 128>>>(d_init, d_out, d_sink, op);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    if (rep == 0) continue;
    std::vector<uint64_t> out(sms * 3);
    CHECK(cudaMemcpy(out.data(), d_out, out.size() * sizeof(uint64_t), cudaMemcpyDeviceToHost));
    for (int c = 0; c < sms; ++c)
      for (int j = 0; j < 3; ++j) runs[j].push_back(out[c * 3 + j]);
  }
  uint64_t med[3];
  for (int j = 0; j < 3; ++j) {
    std::nth_element(runs[j].begin(), runs[j].begin() + runs[j].size() / 2, runs[j].end());
    med[j] = runs[j][runs[j].size() / 2];
  }
  return {med[0], med[1], med[2]};
}

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  std::vector<uint8_t> init(3 * 8192);
  std::srand(1);
  // Small e4m3 values (exponent field 4..7, never the NaN pattern 0x7F / 0xFF).
  for (auto& x : init) x = uint8_t((std::rand() & 0x80) | ((4 + std::rand() % 4) << 3) | (std::rand() & 7));
  uint8_t* d_init;
  uint64_t* d_out;
  float* d_sink;
  CHECK(cudaMalloc(&d_init, init.size()));
  CHECK(cudaMalloc(&d_out, sms * 3 * sizeof(uint64_t)));
  CHECK(cudaMalloc(&d_sink, sms * 128 * sizeof(float)));
  CHECK(cudaMemcpy(d_init, init.data(), init.size(), cudaMemcpyHostToDevice));

  std::printf("How long issuing a chain of WGMMAs holds the warp (median cycles over %d CTAs):\n", sms);
  std::printf("%-22s %6s %10s %10s\n", "shape", "chain", "issue", "wait 0");
  auto row = [&](const char* shape, int chain, Timing t) {
    std::printf("%-22s %6d %10llu %10llu\n", shape, chain, (unsigned long long)t.issue, (unsigned long long)t.wait);
  };
  row("m64n64k32 e4m3", 1, measure<64, 1>(sms, d_init, d_out, d_sink, kNothing));
  row("m64n64k32 e4m3", 2, measure<64, 2>(sms, d_init, d_out, d_sink, kNothing));
  row("m64n64k32 e4m3", 4, measure<64, 4>(sms, d_init, d_out, d_sink, kNothing));
  row("m64n64k32 e4m3", 8, measure<64, 8>(sms, d_init, d_out, d_sink, kNothing));
  row("m64n64k32 e4m3", 18, measure<64, 18>(sms, d_init, d_out, d_sink, kNothing));
  row("m64n64k32 e4m3", 36, measure<64, 36>(sms, d_init, d_out, d_sink, kNothing));
  row("m64n128k32 e4m3", 1, measure<128, 1>(sms, d_init, d_out, d_sink, kNothing));
  row("m64n128k32 e4m3", 2, measure<128, 2>(sms, d_init, d_out, d_sink, kNothing));
  row("m64n128k32 e4m3", 4, measure<128, 4>(sms, d_init, d_out, d_sink, kNothing));
  row("m64n128k32 e4m3", 8, measure<128, 8>(sms, d_init, d_out, d_sink, kNothing));
  row("m64n128k32 e4m3", 16, measure<128, 16>(sms, d_init, d_out, d_sink, kNothing));
  std::printf("\nOne operation while WGMMAs are in flight (chain of 4 m64n128k32, median cycles):\n");
  std::printf("%-52s %10s %10s %10s\n", "operation", "issue", "operation", "wait 0");
  for (int op = 0; op < kNumOps; ++op) {
    const Timing t = measure<128, 4>(sms, d_init, d_out, d_sink, op);
    std::printf("%-52s %10llu %10llu %10llu\n", kOpNames[op], (unsigned long long)t.issue,
                (unsigned long long)t.op, (unsigned long long)t.wait);
  }
  return 0;
}
