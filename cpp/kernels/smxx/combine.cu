// Split-KV combine: merges the partial results of every sequence that the
// scheduler cut into more than one split.
//
// For a query row with n splits: lse = log(sum_s exp(lse_s)) and
// out = sum_s exp(lse_s - lse) * o_s (lse_s natural log, -inf where split s
// saw no key). Sequences with a single split were written by the decode
// kernel directly and have nothing to merge. Two kernels, picked by how many
// splits a split sequence can have (run_combine):
//   - combine_rows_kernel, many sequences with a few splits each: a warp per
//     (sequence, query row), one split after another;
//   - combine_deep_kernel, a few sequences with many splits each (small
//     batches): a CTA per (split sequence, query row), whose 512 threads deal
//     the row's splits out in 4 phases with 8 loads in flight each. One
//     split at a time, as the rows kernel goes, took ~36 µs for a sequence
//     cut into 66 splits (docs/PERF.md, session 48).
// Both are launched with programmatic dependent launch after the decode
// kernel and read its partials only after wait_for_decode_grid.
#include "kernels/smxx/combine.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "config.h"
#include "kernels/launch.h"

namespace jax_flash_mla {
namespace {

// Programmatic dependent launch: wait until the decode grid has completed and
// its writes are visible (PTX ISA "griddepcontrol").
__device__ __forceinline__ void wait_for_decode_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// ---------------------------------------------------------------- rows kernel
// Grid: (ceil(num_heads_k * q_rows_per_head_k / 4), batch); block: 128
// threads = 4 warps, one warp per (KV head, query row). A warp reads the
// row's num_splits partial lse values, forms lse, and sums the fp32 partial
// outputs weighted by exp(lse_s - lse); each lane owns 16 of the 512 columns
// as four float4 loads (coalesced 512 B per warp and step). Warps of
// sequences with a single split return at once.

constexpr int kWarpsPerBlock = 4;
constexpr int kColsPerLane = config::kHeadDimV / 32;  // 16

__global__ void __launch_bounds__(kWarpsPerBlock * 32) combine_rows_kernel(const __grid_constant__ DecodeParams p) {
  wait_for_decode_grid();
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
  // Partial s of this row lives at [(split_begin + s) * h_kv * q_rows + idx].
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

// ---------------------------------------------------------------- deep kernel
// Work items are (split sequence, query row); only sequences with n >= 2
// splits are visited, which every CTA lists from num_splits first. The grid
// has a CTA for each item that can exist (at most num_sm_parts sequences are
// split); CTAs past the existing ones leave after the scan. Thread t owns
// float4 column t % 128 of the row and, in phase t / 128, the splits
// phase, phase + 4, ...; the phases' sums meet in shared memory.

constexpr int kColumnSlots = config::kHeadDimV / 4;  // float4 columns of a row: 128
constexpr int kWeightTile = 256;                     // splits whose weights sit in shared memory at once
constexpr int kLsePerLane = kWeightTile / 32;        // split lse a lane of a row's warp keeps in registers
constexpr int kScanThreads = 256;                    // threads of the 512 that scan num_splits
constexpr int kListed = 2048;                        // split sequences a CTA lists in shared memory

// The deep kernel's shape: a CTA takes kRows query rows of one split
// sequence (1, its only instantiation); its threads own one float4 column
// each, and phase p of them the splits p, p + kPhases, ... (kPhases 4).
// The kernel keeps the source of the build that passed its GPU tests (session
// 48's comb2, where kRows 4 was also instantiated), so that its SASS is that
// build's (0f330f1f): written for one row only it compiled differently. Fold
// kRows and kRowGroups away once a GPU run has tested that form.
template <int kRows, int kPhases>
struct CombineShape {
  static constexpr int kRowGroups = 1;  // thread groups that take different rows
  static constexpr int kThreads = kColumnSlots * kRowGroups * kPhases;
  static constexpr int kLoadsInFlight = 8;  // splits a thread loads before it adds them up
  // launch_bounds: 2 CTAs an SM, 64 registers a thread, which hold the 8
  // loads in flight (at 40, ptxas kept ~2 of them in flight).
  static constexpr int kCtasPerSm = 2;
  static_assert(kRows % kRowGroups == 0 && kThreads >= kScanThreads);
};

// One float4 of a partial row. Volatile, so that the loads of a batch stay
// ahead of the sums that use them.
__device__ __forceinline__ float4 load_partial(const float4* src) {
  float4 v;
  asm volatile("ld.global.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "l"(src));
  return v;
}

// Lists the sequences with two splits or more, in batch order, into `list`
// (the first kListed of them) and returns how many there are. Every thread of
// the CTA calls it and gets the same count.
__device__ int list_split_sequences(const int32_t* num_splits, int batch, int* list) {
  __shared__ int warp_counts[kScanThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int count = 0;
  for (int base = 0; base < batch; base += kScanThreads) {
    const int b = base + int(threadIdx.x);
    const bool split = threadIdx.x < kScanThreads && b < batch && num_splits[b + 1] - num_splits[b] >= 2;
    const unsigned ballot = __ballot_sync(0xffffffffu, split);
    if (threadIdx.x < kScanThreads && lane == 0) warp_counts[warp] = __popc(ballot);
    __syncthreads();
    int before = count, total = 0;
    for (int w = 0; w < kScanThreads / 32; ++w) {
      before += w < warp ? warp_counts[w] : 0;
      total += warp_counts[w];
    }
    const int at = before + __popc(ballot & ((1u << lane) - 1u));
    if (split && at < kListed) list[at] = b;
    count += total;
    __syncthreads();  // warp_counts is rewritten next round
  }
  return count;
}

// The batch index of split sequence `rank`: listed, or (past kListed, which
// takes more partitions than any GPU has SMs) found by counting again.
__device__ int split_sequence(const int32_t* num_splits, int batch, const int* list, int rank) {
  if (rank < kListed) return list[rank];
  for (int b = 0; b < batch; ++b)
    if (num_splits[b + 1] - num_splits[b] >= 2 && rank-- == 0) return b;
  return batch - 1;  // not reached: rank < the listed count
}

template <int kRows, int kPhases>
__global__ void __launch_bounds__(CombineShape<kRows, kPhases>::kThreads, CombineShape<kRows, kPhases>::kCtasPerSm)
    combine_deep_kernel(const __grid_constant__ DecodeParams p) {
  using Shape = CombineShape<kRows, kPhases>;
  __shared__ int list[kListed];
  __shared__ float weights[kRows][kWeightTile];
  __shared__ float row_lse[kRows];
  __shared__ float4 phase_sums[kPhases > 1 ? kPhases - 1 : 1][kColumnSlots];

  // num_splits comes from the scheduler, which finished before the decode
  // kernel passed its own griddepcontrol.wait, and every decode CTA passes it
  // before it lets this grid start (launch_dependents): so the scan runs
  // under the decode kernel's tail, and a CTA with nothing to merge leaves
  // before the decode kernel ends. The partials are read only after the
  // wait below.
  const int count = list_split_sequences(p.num_splits, p.batch, list);
  const int rows = p.num_heads_k * p.q_rows_per_head_k;
  const int row_blocks = (rows + kRows - 1) / kRows;
  const int64_t items = int64_t(count) * row_blocks;  // (split sequence, row block), sequence-major
  if (blockIdx.x >= items) return;
  wait_for_decode_grid();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int slot = threadIdx.x % kColumnSlots;
  const int group = threadIdx.x / kColumnSlots;
  const int row_group = group % Shape::kRowGroups, phase = group / Shape::kRowGroups;
  const int64_t split_stride = rows;  // partial s of row idx: [(split_begin + s) * rows + idx]

  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int batch = split_sequence(p.num_splits, p.batch, list, int(item / row_blocks));
    const int first_row = int(item % row_blocks) * kRows;
    const int split_begin = p.num_splits[batch];
    const int n = p.num_splits[batch + 1] - split_begin;

    // Each row's lse, by warp r: each lane keeps up to kLsePerLane of the
    // row's split lse (lane, lane + 32, ...), from which it also writes the
    // first weight tile. Splits past that (more than kWeightTile) are read
    // again where their tile is filled.
    if (warp < kRows && first_row + warp < rows) {
      const float* lse_s = p.lse_accum + int64_t(split_begin) * split_stride + first_row + warp;
      float kept[kLsePerLane];
      float m = -INFINITY;
#pragma unroll
      for (int i = 0; i < kLsePerLane; ++i) {
        const int s = lane + 32 * i;
        kept[i] = s < n ? lse_s[s * split_stride] : -INFINITY;
        m = fmaxf(m, kept[i]);
      }
      for (int s = lane + kWeightTile; s < n; s += 32) m = fmaxf(m, lse_s[s * split_stride]);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      float sum = 0.f;
      if (m != -INFINITY) {
#pragma unroll
        for (int i = 0; i < kLsePerLane; ++i) sum += expf(kept[i] - m);  // 0 for the -inf fill
        for (int s = lane + kWeightTile; s < n; s += 32) sum += expf(lse_s[s * split_stride] - m);
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      // No split saw a key: out = 0, lse = +inf (README section 1); every weight is then exp(-inf) = 0.
      const float lse = sum > 0.f ? m + logf(sum) : INFINITY;
#pragma unroll
      for (int i = 0; i < kLsePerLane; ++i) {
        if (lane + 32 * i < n) weights[warp][lane + 32 * i] = expf(kept[i] - lse);
      }
      if (lane == 0) {
        row_lse[warp] = lse;
        const int idx = first_row + warp, r = idx % p.q_rows_per_head_k;
        const int head_q = (idx / p.q_rows_per_head_k) * p.heads_per_head_k + r % p.heads_per_head_k;
        p.lse[(int64_t(batch) * p.num_heads_q + head_q) * p.seqlen_q + r / p.heads_per_head_k] = lse;
      }
    }

    float4 acc[kRows / Shape::kRowGroups];
    for (float4& a : acc) a = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int tile = 0; tile < n; tile += kWeightTile) {
      const int tile_n = min(n - tile, kWeightTile);
      __syncthreads();  // the first tile's weights and row_lse written; a later tile: the last one's weights read
      if (tile > 0) {
        for (int i = threadIdx.x; i < kRows * tile_n; i += Shape::kThreads) {
          const int r = i / tile_n, s = i % tile_n;
          if (first_row + r < rows) {
            weights[r][s] = expf(p.lse_accum[int64_t(split_begin + tile + s) * split_stride + first_row + r] -
                                 row_lse[r]);
          }
        }
        __syncthreads();
      }
#pragma unroll
      for (int k = 0; k < kRows / Shape::kRowGroups; ++k) {
        const int r = row_group + k * Shape::kRowGroups;
        if (first_row + r >= rows) continue;
        const float4* o_s = reinterpret_cast<const float4*>(
                                p.o_accum + (int64_t(split_begin + tile) * split_stride + first_row + r) *
                                                config::kHeadDimV) +
                            slot;
        for (int s0 = phase; s0 < tile_n; s0 += Shape::kLoadsInFlight * kPhases) {
          float w[Shape::kLoadsInFlight];
          float4 v[Shape::kLoadsInFlight];
          // All loads first (past the tile's end they re-read its last
          // split), then the sums.
#pragma unroll
          for (int j = 0; j < Shape::kLoadsInFlight; ++j) {
            const int s = min(s0 + j * kPhases, tile_n - 1);
            w[j] = s0 + j * kPhases < tile_n ? weights[r][s] : 0.f;
            v[j] = load_partial(o_s + int64_t(s) * split_stride * kColumnSlots);
          }
#pragma unroll
          for (int j = 0; j < Shape::kLoadsInFlight; ++j) {
            // A zero weight (a split where the row saw no key) is skipped, not
            // multiplied: that partial row may never have been written.
            if (w[j] != 0.f) {
              acc[k].x += w[j] * v[j].x;
              acc[k].y += w[j] * v[j].y;
              acc[k].z += w[j] * v[j].z;
              acc[k].w += w[j] * v[j].w;
            }
          }
        }
      }
    }

    if constexpr (kPhases > 1) {
      if (phase > 0) phase_sums[phase - 1][slot] = acc[0];
      __syncthreads();
      if (phase == 0) {
#pragma unroll
        for (int ph = 0; ph < kPhases - 1; ++ph) {
          const float4 x = phase_sums[ph][slot];
          acc[0].x += x.x;
          acc[0].y += x.y;
          acc[0].z += x.z;
          acc[0].w += x.w;
        }
      }
    }
    if (phase == 0) {
#pragma unroll
      for (int k = 0; k < kRows / Shape::kRowGroups; ++k) {
        const int idx = first_row + row_group + k * Shape::kRowGroups;
        if (idx >= rows) continue;
        const int r = idx % p.q_rows_per_head_k;
        const int head_q = (idx / p.q_rows_per_head_k) * p.heads_per_head_k + r % p.heads_per_head_k;
        __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out) + batch * p.out_batch_stride +
                             (r / p.heads_per_head_k) * p.out_seq_stride + head_q * p.out_head_stride;
        const __nv_bfloat162 lo = __floats2bfloat162_rn(acc[k].x, acc[k].y);
        const __nv_bfloat162 hi = __floats2bfloat162_rn(acc[k].z, acc[k].w);
        uint2 packed;
        packed.x = *reinterpret_cast<const uint32_t*>(&lo);
        packed.y = *reinterpret_cast<const uint32_t*>(&hi);
        *reinterpret_cast<uint2*>(out + 4 * slot) = packed;
      }
    }
    __syncthreads();  // row_lse, weights and phase_sums are reused by the next item
  }
}

}  // namespace

void run_combine(const DecodeParams& params) {
  if (params.batch == 0 || params.num_heads_k == 0 || params.q_rows_per_head_k == 0) return;
  const int rows = params.num_heads_k * params.q_rows_per_head_k;
  // A split sequence spans at least two partitions, so at most num_sm_parts
  // sequences have two splits or more, and they average num_sm_parts / min(batch,
  // num_sm_parts) splits or more. The deep kernel once that is
  // kDeepMinAverageSplits or more, else the rows kernel (session 48, H100: b 1-2
  // decodes at 0.76-0.97x FlashMLA's time, 1.5-1.7x with the rows kernel). At 8
  // (b 16 of 16 heads, b 8 of 128) the rows kernel is the faster: equal long
  // sequences get ~8 splits each there, short ones 2, and the deep kernel's CTA
  // per (sequence, row) does little for its 512 threads (session 54, H200, per
  // call: b 8 s_k 256 / 4096 h_q 128 -27 / -13.5 %, b 16 s_k 256 h_q 16 -7.5 %,
  // b 16 s_k 4096 +0.8 %). For many sequences, CTAs of 4 rows each built like the
  // deep ones were 1-3 µs slower than the rows kernel at b 16-128 (docs/PERF.md).
  // The deep grid (a CTA per split sequence and row, kCtasPerSm of them an SM of
  // the decode grid) must also give each wave 8 splits a sequence on average:
  // with 128 heads, 5-7 sequences average 9-13 splits over 3-4 waves, and the
  // rows kernel was the faster there (session 57, H100, per call: b 5-7 s_k
  // 8192 / 16384 -1 to -8.5 %; at 16 heads, one wave, the deep one stays).
  constexpr int kDeepMinAverageSplits = 9;
  constexpr int kDeepMinSplitsPerWave = 8;
  using Deep = CombineShape<1, 4>;
  const int split_sequences = std::max(std::min(params.batch, params.num_sm_parts), 1);
  const int64_t items = int64_t(split_sequences) * rows;
  const int64_t resident = int64_t(params.num_sm_parts) * params.num_heads_k * params.num_m_blocks * Deep::kCtasPerSm;
  const int64_t waves = (items + resident - 1) / resident;
  const int64_t min_average = std::max<int64_t>(kDeepMinAverageSplits, kDeepMinSplitsPerWave * waves);
  if (split_sequences * min_average <= params.num_sm_parts) {
    launch_with_pdl(combine_deep_kernel<1, 4>, dim3(unsigned(std::min<int64_t>(items, INT32_MAX))),
                    dim3(Deep::kThreads), 0, params.stream, "combine", params);
  } else {
    launch_with_pdl(combine_rows_kernel, dim3((rows + kWarpsPerBlock - 1) / kWarpsPerBlock, params.batch),
                    dim3(kWarpsPerBlock * 32), 0, params.stream, "combine", params);
  }
}

}  // namespace jax_flash_mla
