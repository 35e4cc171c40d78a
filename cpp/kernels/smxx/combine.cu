// Split-KV combine: merges the partial results of every sequence that the
// scheduler cut into more than one split.
//
// For a query row with n splits: lse = log(sum_s exp(lse_s)) and
// out = sum_s exp(lse_s - lse) * o_s (lse_s natural log, -inf where split s
// saw no key). Sequences with a single split were written by the decode
// kernel directly and have nothing to merge.
//
// Work items are (split sequence, block of kRows query rows): only sequences
// with n >= 2 splits are visited, which each CTA lists from num_splits first.
// The grid has a CTA for every item that can exist (at most num_sm_parts
// sequences are split); those past the sequences that do exist leave after
// the scan, so a large batch of whole sequences costs little. The partials
// are read by float4 columns (a row's 512 floats = 128 threads' worth),
// several splits at a time per thread: one split at a time left each thread
// one L2 round trip per split, ~36 µs for a sequence cut into 66 splits
// (docs/PERF.md, session 48). Two shapes of CTA:
//   - deep (kRows 1, kPhases 4, 512 threads): few sequences with many splits
//     each (small batches): a row's splits are dealt out to 4 thread groups,
//     8 splits at a time each, whose sums meet in shared memory;
//   - wide (kRows 4, kPhases 1, 128 threads): many sequences with few splits:
//     each thread takes its column of 4 rows, 2 splits of each at a time.
// Both are held to 64 registers a thread, half the SM's thread slots: so
// that a grid of wide CTAs runs in one wave where the old warp-per-row
// combine did (session 48: 256-thread CTAs at 48 registers took two, ~3 µs
// slower than that combine at b 64, h_q 64, s_k 4096).
//
// Launched with programmatic dependent launch after the decode kernel; see
// combine_kernel for what it reads before griddepcontrol.wait.
#include "kernels/smxx/combine.h"

#include <algorithm>
#include <cmath>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "config.h"
#include "kernels/launch.h"

namespace jax_flash_mla {
namespace {

constexpr int kColumnSlots = config::kHeadDimV / 4;  // float4 columns of a row: 128
constexpr int kWeightTile = 256;                     // splits whose weights sit in shared memory at once
constexpr int kLsePerLane = kWeightTile / 32;        // split lse a lane of a row's warp keeps in registers
constexpr int kListed = 2048;                        // split sequences a CTA lists in shared memory
constexpr int kLoadsInFlight = 8;                    // partial loads a thread issues before it adds them up

// A CTA takes kRows query rows of one split sequence; its 128 * kPhases
// threads each own one float4 column of all kRows rows, and phase p of them
// the splits p, p + kPhases, ... A thread loads kLoadsInFlight float4 at a
// time: kLoadsInFlight / kRows splits of each of its rows.
template <int kRows, int kPhases>
struct CombineShape {
  static constexpr int kThreads = kColumnSlots * kPhases;
  static constexpr int kSplitsPerBatch = kLoadsInFlight / kRows;
  static constexpr int kCtasPerSm = 2048 / kThreads / 2;  // launch_bounds: 64 registers a thread
  static_assert(kLoadsInFlight % kRows == 0 && kRows <= kThreads / 32);
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
// the CTA (kThreads of them) calls it and gets the same count.
template <int kThreads>
__device__ int list_split_sequences(const int32_t* num_splits, int batch, int* list) {
  __shared__ int warp_counts[kThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int count = 0;
  for (int base = 0; base < batch; base += kThreads) {
    const int b = base + int(threadIdx.x);
    const bool split = b < batch && num_splits[b + 1] - num_splits[b] >= 2;
    const unsigned ballot = __ballot_sync(0xffffffffu, split);
    if (lane == 0) warp_counts[warp] = __popc(ballot);
    __syncthreads();
    int before = count, total = 0;
    for (int w = 0; w < kThreads / 32; ++w) {
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
    combine_kernel(const __grid_constant__ DecodeParams p) {
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
  const int count = list_split_sequences<Shape::kThreads>(p.num_splits, p.batch, list);
  const int rows = p.num_heads_k * p.q_rows_per_head_k;
  const int row_blocks = (rows + kRows - 1) / kRows;
  const int64_t items = int64_t(count) * row_blocks;  // (split sequence, row block), sequence-major
  if (blockIdx.x >= items) return;
  asm volatile("griddepcontrol.wait;\n" ::: "memory");

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int slot = threadIdx.x % kColumnSlots, phase = threadIdx.x / kColumnSlots;
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

    float4 acc[kRows];
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
      // This tile's partials at this thread's column: row first_row + r of
      // split s at o_tile + s * split_floats4 + row_at[r] (rows past the last
      // read the last row, with weight 0).
      const float4* o_tile = reinterpret_cast<const float4*>(
                                 p.o_accum + (int64_t(split_begin + tile) * split_stride + first_row) *
                                                 config::kHeadDimV) +
                             slot;
      const int64_t split_floats4 = split_stride * kColumnSlots;
      int row_at[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) row_at[r] = min(r, rows - 1 - first_row) * kColumnSlots;
      constexpr int kStep = Shape::kSplitsPerBatch * kPhases;
      for (int s0 = phase; s0 < tile_n; s0 += kStep) {
        float w[kRows][Shape::kSplitsPerBatch];
        float4 v[kRows][Shape::kSplitsPerBatch];
        // All loads first (past the tile's end they re-read its last split),
        // then the sums.
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
#pragma unroll
          for (int j = 0; j < Shape::kSplitsPerBatch; ++j) {
            const int s = min(s0 + j * kPhases, tile_n - 1);
            w[r][j] = s0 + j * kPhases < tile_n && first_row + r < rows ? weights[r][s] : 0.f;
            v[r][j] = load_partial(o_tile + s * split_floats4 + row_at[r]);
          }
        }
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
#pragma unroll
          for (int j = 0; j < Shape::kSplitsPerBatch; ++j) {
            // A zero weight (a split where the row saw no key) is skipped, not
            // multiplied: that partial row may never have been written.
            if (w[r][j] != 0.f) {
              acc[r].x += w[r][j] * v[r][j].x;
              acc[r].y += w[r][j] * v[r][j].y;
              acc[r].z += w[r][j] * v[r][j].z;
              acc[r].w += w[r][j] * v[r][j].w;
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
      for (int k = 0; k < kRows; ++k) {
        const int idx = first_row + k;
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

// Grid: one CTA per (split sequence, row block) item that can exist; those
// past the sequences that do exist leave after the scan.
template <int kRows, int kPhases>
void launch_combine(const DecodeParams& p, int rows, int split_sequences) {
  using Shape = CombineShape<kRows, kPhases>;
  const int64_t items = int64_t(split_sequences) * ((rows + kRows - 1) / kRows);
  launch_with_pdl(combine_kernel<kRows, kPhases>, dim3(unsigned(std::min<int64_t>(items, INT32_MAX))),
                  dim3(Shape::kThreads), 0, p.stream, "combine", p);
}

}  // namespace

void run_combine(const DecodeParams& params) {
  if (params.batch == 0 || params.num_heads_k == 0 || params.q_rows_per_head_k == 0) return;
  const int rows = params.num_heads_k * params.q_rows_per_head_k;
  // A split sequence spans at least two partitions, so at most num_sm_parts
  // sequences have two splits or more (CTAs past the last one return).
  const int split_sequences = std::max(std::min(params.batch, params.num_sm_parts), 1);
  // Sequences average num_sm_parts / split_sequences splits or more: deep
  // CTAs once that is 8 or more (one round of loads per group and then some).
  if (split_sequences * 8 <= params.num_sm_parts) {
    launch_combine<1, 4>(params, rows, split_sequences);
  } else {
    launch_combine<4, 1>(params, rows, split_sequences);
  }
}

}  // namespace jax_flash_mla
