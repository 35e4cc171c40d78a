// Split-KV combine: merges the partial results of every sequence that the
// scheduler cut into more than one split.
//
// Grid:  (ceil(num_heads_k * q_rows_per_head_k / 4), batch); block: 128
// threads = 4 warps, one warp per (KV head, query row). A warp reads the
// row's num_splits partial lse values (natural log, -inf where the split saw
// no key), forms lse = log(sum_s exp(lse_s)), and sums the fp32 partial
// outputs weighted by exp(lse_s - lse); each lane owns 16 of the 512 columns
// as four float4 loads (coalesced 512 B per warp and step).
// Sequences with a single split were written by the decode kernel directly;
// their warps return at once.
//
// Launched with programmatic dependent launch after the decode kernel: the
// grid may start early and waits in griddepcontrol.wait until the decode grid
// has completed and its writes are visible (PTX ISA "griddepcontrol").
#include "kernels/smxx/combine.h"

#include <cmath>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "config.h"
#include "kernels/launch.h"

namespace jax_flash_mla {
namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kColsPerLane = config::kHeadDimV / 32;  // 16

__global__ void __launch_bounds__(kWarpsPerBlock * 32) combine_kernel(const __grid_constant__ DecodeParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int batch = blockIdx.y;
  const int idx = blockIdx.x * kWarpsPerBlock + warp;  // head_k * q_rows + row
  if (idx >= p.num_heads_k * p.q_rows_per_head_k) return;
  const int split_begin = p.num_splits[batch];
  const int n = p.num_splits[batch + 1] - split_begin;
  if (n <= 1) return;

  const int head_k = idx / p.q_rows_per_head_k;
  const int r = idx % p.q_rows_per_head_k;
  // Partial s of this row lives at [(split_begin + s) * h_kv + head_k, r].
  const int64_t split_stride = int64_t(p.num_heads_k) * p.q_rows_per_head_k;
  const int64_t row0 = int64_t(split_begin) * split_stride + idx;

  // Pass 1: global max and sum of exp over the splits (lanes stride the splits).
  float m = -INFINITY;
  for (int s = lane; s < n; s += 32) m = fmaxf(m, p.lse_accum[row0 + s * split_stride]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  float sum = 0.f;
  if (m != -INFINITY)
    for (int s = lane; s < n; s += 32) sum += expf(p.lse_accum[row0 + s * split_stride] - m);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  // No split saw a key: out = 0, lse = +inf (README section 1).
  const float lse = sum > 0.f ? m + logf(sum) : INFINITY;

  // Pass 2: out = sum_s exp(lse_s - lse) * o_s.
  float acc[kColsPerLane] = {};
  if (sum > 0.f) {
    for (int s = 0; s < n; ++s) {
      const float w = expf(p.lse_accum[row0 + s * split_stride] - lse);  // 0 for a -inf partial
      if (w == 0.f) continue;  // also skips rows a split never wrote meaningfully
      const float4* src =
          reinterpret_cast<const float4*>(p.o_accum + (row0 + s * split_stride) * config::kHeadDimV);
#pragma unroll
      for (int i = 0; i < kColsPerLane / 4; ++i) {
        const float4 v = src[lane + 32 * i];
        acc[4 * i + 0] += w * v.x;
        acc[4 * i + 1] += w * v.y;
        acc[4 * i + 2] += w * v.z;
        acc[4 * i + 3] += w * v.w;
      }
    }
  }

  const int s_q = r / p.heads_per_head_k;
  const int head_q = head_k * p.heads_per_head_k + r % p.heads_per_head_k;
  __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out) + batch * p.out_batch_stride +
                       s_q * p.out_seq_stride + head_q * p.out_head_stride;
#pragma unroll
  for (int i = 0; i < kColsPerLane / 4; ++i) {
    __nv_bfloat162 lo = __floats2bfloat162_rn(acc[4 * i + 0], acc[4 * i + 1]);
    __nv_bfloat162 hi = __floats2bfloat162_rn(acc[4 * i + 2], acc[4 * i + 3]);
    uint2 packed;
    packed.x = *reinterpret_cast<uint32_t*>(&lo);
    packed.y = *reinterpret_cast<uint32_t*>(&hi);
    *reinterpret_cast<uint2*>(out + 4 * (lane + 32 * i)) = packed;
  }
  if (lane == 0) p.lse[(int64_t(batch) * p.num_heads_q + head_q) * p.seqlen_q + s_q] = lse;
}

}  // namespace

void run_combine(const DecodeParams& params) {
  if (params.batch == 0 || params.num_heads_k == 0 || params.q_rows_per_head_k == 0) return;
  const int rows = params.num_heads_k * params.q_rows_per_head_k;
  launch_with_pdl(combine_kernel, dim3((rows + kWarpsPerBlock - 1) / kWarpsPerBlock, params.batch),
                  dim3(kWarpsPerBlock * 32), 0, params.stream, "combine", params);
}

}  // namespace jax_flash_mla
