// Shared-memory lane mappings of the FP8 formats (fp8_per_tensor, fp8_ds_mla):
// the V^T transpose (ldmatrix.trans / PRMT / stmatrix) and the P store
// (stmatrix), which agree on one token order. Traits<> supplies the tiles'
// layouts; scripts/emulate_vt_transpose.py replays both mappings on the host
// (tests/test_smem_lane_mappings.py).
#pragma once

#include <cstdint>
#include <utility>

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cute/tensor.hpp>

#include "kernels/sm90/decode/named_barriers.h"
#include "kernels/sm90/decode/smem_matrix.h"
#include "kernels/sm90/decode/traits.h"

namespace jax_flash_mla::sm90 {

// Token order inside V^T rows and P columns ("p_column" below). The V^T
// transpose moves tokens in pairs (ldmatrix .trans works on 16-bit
// elements), so within each group of 16 tokens token u lands at column
//   p_column(u) = 4 ((u % 8) / 2) + 2 (u / 8) + u % 2,
// i.e. columns 4q..4q+3 hold tokens 2q, 2q+1, 2q+8, 2q+9. P V sums over
// tokens, so P's columns only have to follow the same order, which is also
// the order that lets P go out by stmatrix (store_p_e4m3).

// Four probabilities as e4m3 bytes in one word, lowest address first.
__device__ __forceinline__ uint32_t pack_e4m3x4(float a, float b, float c, float d) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
  return lo | (hi << 16);
}

// Two values as an f16 pair, the first in the low half (one F2FP).
__device__ __forceinline__ uint32_t pack_half2(float a, float b) {
  const __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// The product of two f16 pairs (one HMUL2).
__device__ __forceinline__ uint32_t mul_half2(uint32_t a, uint32_t b) {
  const __half2 r = __hmul2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
  return *reinterpret_cast<const uint32_t*>(&r);
}

// Two f16 pairs as four e4m3 bytes, lowest address first (two F2FP).
__device__ __forceinline__ uint32_t pack_e4m3x4_h2(uint32_t lo, uint32_t hi) {
  uint32_t r;
  asm("{\n .reg .b16 a, b;\n"
      " cvt.rn.satfinite.e4m3x2.f16x2 a, %1;\n"
      " cvt.rn.satfinite.e4m3x2.f16x2 b, %2;\n"
      " mov.b32 %0, {a, b};\n}\n"
      : "=r"(r)
      : "r"(lo), "r"(hi));
  return r;
}

// Packs a warp's e4m3 P (rows 16 warp .. 16 warp + 15 of the 64-row tile):
// value v of the S-shaped fragment `s` times scale(v). In p_column order,
// the accumulator fragment of a thread (rows lane / 4 and + 8, tokens
// 8j + 2 (lane % 4) + {0, 1}) puts, per row half h and token group k, 4
// contiguous bytes at columns 16k + 4 (lane % 4): tokens 2q, 2q + 1 of
// column block 2k and the same of block 2k + 1. That is exactly a thread's
// element of an 8x8 b16 stmatrix tile (row lane / 4, bytes 4 (lane % 4) ..):
// words[h][k] goes to tile (h, first_group + k).
template <int kTokenGroups, class Frag, class Scale>
__device__ __forceinline__ void pack_p_e4m3(const Frag& s, Scale scale, uint32_t (&words)[2][kTokenGroups]) {
  static_assert(kTokenGroups % 2 == 0, "two token groups x two row halves per stmatrix.x4");
  CUTE_UNROLL
  for (int k = 0; k < kTokenGroups; ++k) {
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      const int v = 8 * k + 2 * h;  // column block 2k (v) and 2k + 1 (v + 4), row half h
      words[h][k] = pack_e4m3x4(s(v) * scale(v), s(v + 1) * scale(v + 1), s(v + 4) * scale(v + 4),
                                s(v + 5) * scale(v + 5));
    }
  }
}

// Token groups k and k + 1 of `words`, both row halves, by one stmatrix.x4 at
// `row`: this lane's row address (p_store_offset) in the P tile.
template <int kTokenGroups>
__device__ __forceinline__ void store_p_pair(uint32_t row, const uint32_t (&words)[2][kTokenGroups], int k) {
  stmatrix_x4(row, words[0][k], words[1][k], words[0][k + 1], words[1][k + 1]);
}

// The byte offset in a P tile of the stmatrix row this lane addresses for
// token groups first_group and first_group + 1: row lane % 8 of matrix
// m = lane / 8, which is tile (h, k) = (m % 2, m / 2).
template <class Tr>
__device__ __forceinline__ uint32_t p_store_offset(int warp, int lane, int first_group) {
  const typename Tr::SmemLayoutP layout_p{};
  const int m = lane / 8;
  const int row = 16 * warp + 8 * (m % 2) + lane % 8;
  return uint32_t(layout_p(row, 16 * (first_group + m / 2)));
}

// Stores that P (pack_p_e4m3) as the P tile's token groups first_group ..
// first_group + kTokenGroups - 1.
template <class Tr, int kTokenGroups, class Frag, class Scale>
__device__ __forceinline__ void store_p_e4m3(uint32_t p_tile, int warp, int lane, const Frag& s, Scale scale,
                                             int first_group) {
  uint32_t words[2][kTokenGroups];
  pack_p_e4m3<kTokenGroups>(s, scale, words);
  CUTE_UNROLL
  for (int pair = 0; pair < kTokenGroups / 2; ++pair) {
    store_p_pair(p_tile + p_store_offset<Tr>(warp, lane, first_group + 2 * pair), words, 2 * pair);
  }
}

// fp8_ds_mla's P_g of two token groups at `p_row` (the P tile's address plus
// this lane's p_store_offset, kept in shared memory by its consumer), from
// one f16 copy of p: p_h[i] holds the fragment's values 2i and 2i + 1 (two
// adjacent tokens of one row), scale_h[m] the group's factors of tokens 2m
// and 2m + 1, which value pairs 2m and 2m + 1 (the two row halves) hold. One
// HMUL2 and one F2FP a value pair, where fp32 takes two FMUL and one F2FP.
// Numerics: p rounds to f16 (11 bits) before e4m3 (4 bits); P_g <= 256 is
// far inside f16's range, and a product small enough to be an f16 subnormal
// (< 2^-14) is 0 in e4m3 either way (< 2^-10). Stored as store_p_e4m3
// stores: words[h][k] = values 8k + 2h + {0, 1, 4, 5}.
__device__ __forceinline__ void store_p_e4m3_h2(uint32_t p_row, const uint32_t (&p_h)[8],
                                                const uint32_t (&scale_h)[4]) {
  uint32_t words[2][2];
  CUTE_UNROLL
  for (int k = 0; k < 2; ++k) {
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      const int i = 4 * k + h;  // value pairs i (column block 2k) and i + 2 (block 2k + 1)
      words[h][k] = pack_e4m3x4_h2(mul_half2(p_h[i], scale_h[i / 2]), mul_half2(p_h[i + 2], scale_h[(i + 2) / 2]));
    }
  }
  store_p_pair(p_row, words, 0);
}

// The address steps transpose_v takes between its blocks instead of
// evaluating the swizzled layouts per block (which ptxas did not simplify:
// ~150 integer instructions a page for fp8_ds_mla). Both tiles swizzle 16-byte
// chunks within an 8-row atom, which the checks below pin down for every
// address the transpose forms:
// - K slot (tokens x channels): 16 tokens down is kTokenStep bytes on (the
//   swizzle reads only a row's low three bits); 32 channels on, from a chunk
//   of an even pair (c % 64 < 32), flips address bit 5 (the chunk's bit 1).
// - V^T (channels x 64 tokens, one 64-byte row per channel): 16 tokens on is
//   an XOR of 16 k on the chunk bits; 32 channels down is kVtChannelStep on.
template <class Tr>
struct TransposeSteps {
  static constexpr int kChannels = decode_cfg::kHeadDimV;
  static constexpr int kTokenStep = typename Tr::SmemLayoutK{}(16, 0) - typename Tr::SmemLayoutK{}(0, 0);
  static constexpr int kVtChannelStep = typename Tr::SmemLayoutV{}(32, 0) - typename Tr::SmemLayoutV{}(0, 0);

  // Checked per 32-channel range: one constant evaluation over the whole
  // tile exceeds the front end's budget.
  static constexpr bool hold(int c_begin) {
    const typename Tr::SmemLayoutK k{};
    const typename Tr::SmemLayoutV vt{};
    // The K slot: a lane's ldmatrix row of block (h, j) from its block-(0, 0) row (token t < 16, a chunk c with
    // c % 64 < 32), as transpose_v forms it.
    for (int c = c_begin; c < c_begin + 32; c += 16) {
      for (int t = 0; c % 64 < 32 && t < 16; ++t) {
        for (int h = 0; h < 2; ++h) {
          for (int j = 0; j < 4; ++j) {
            if (k(t + 16 * j, c + 32 * h) != (k(t, c) ^ (32 * h)) + j * kTokenStep) return false;
          }
        }
      }
    }
    // V^T: a lane's stmatrix row (one channel) of block (h, j) from its block-(0, 0) row.
    for (int c = c_begin; c < c_begin + 32; ++c) {
      for (int h = 0; h < 2 && c + 32 * h < kChannels; ++h) {
        for (int j = 0; j < 4; ++j) {
          if (vt(c + 32 * h, 16 * j) != (vt(c, 0) ^ (16 * j)) + h * kVtChannelStep) return false;
        }
      }
    }
    return true;
  }
  template <int... kRanges>
  static constexpr bool hold_each(std::integer_sequence<int, kRanges...>) {
    return (Check<32 * kRanges>::value && ...);
  }
  template <int kBegin>
  struct Check {
    static constexpr bool value = hold(kBegin);
    static_assert(value, "the K slot and V^T layouts step as TransposeSteps says");
  };
  static constexpr bool kHold = hold_each(std::make_integer_sequence<int, kChannels / 32>{});
};

// What a lane of transpose_v addresses on every page, from its warpgroup and
// thread index alone: its block-(0, 0) ldmatrix row in the K slot (as byte
// offsets: h = 0, and h = 1 by TransposeSteps' XOR), its block-(0, 0)
// stmatrix row in V^T, its PRMT selectors and its ldmatrix row's token.
struct TransposeLane {
  uint32_t ld_offset[2];  // K slot, blocks (0, 0) and (1, 0)
  uint32_t st_offset;     // V^T, block (0, 0)
  uint32_t sel_first, sel_second;
  int ld_token;  // within a block of 16 tokens
};

template <class Tr>
__device__ __forceinline__ TransposeLane transpose_lane(int wg, int tid) {
  const typename Tr::SmemLayoutK layout_k{};
  const typename Tr::SmemLayoutV layout_vt{};
  const int lane = tid % 32;
  const int m = lane / 8, r = lane % 8;  // the matrix and row this lane addresses
  const int ld_token = 8 * (m % 2) + r;
  const int ld_channel = 16 * (m / 2);
  const bool odd_first = r >= 4;  // stmatrix rows: see transpose_v
  const int st_channel = 16 * (m / 2) + 2 * r + ((m % 2) ^ int(odd_first));
  // This lane's registers go to stmatrix row lane / 4.
  const bool lane_odd_first = lane / 4 >= 4;
  const int warp_channels = wg * decode_cfg::kHeadDimVPerWG + (tid / 32) * 64;
  const uint32_t ld_first = uint32_t(layout_k(ld_token, warp_channels + ld_channel));
  TransposeLane t;
  t.ld_offset[0] = ld_first;
  t.ld_offset[1] = ld_first ^ 32u;
  t.st_offset = uint32_t(layout_vt(warp_channels + st_channel, 0));
  constexpr uint32_t kOddBytes = 0x7531u, kEvenBytes = 0x6420u;
  static_assert(((kOddBytes | kEvenBytes) & 0x8888u) == 0, "no sign-replication bit: prmt.b32 reads as __byte_perm");
  t.sel_first = lane_odd_first ? kOddBytes : kEvenBytes;
  t.sel_second = lane_odd_first ? kEvenBytes : kOddBytes;
  t.ld_token = ld_token;
  return t;
}

// Consumer WG `wg` writes V^T[c][p_column(t)] = K[t][c] for its channels
// c in [256 wg, 256 wg + 256) and the page's 64 tokens, with zeros for tokens
// t >= `valid` (slots past the chunk's end may hold NaN, 0x7F / 0xFF in e4m3,
// and 0 * NaN = NaN in P V): their ldmatrix rows point at a 16-byte zero
// row instead, so the code stays branch-free while this WG's S WGMMA runs.
// Per warp, eight blocks (h, k) of 16 tokens 16 k .. x 32 channels 32 h ..
// (512 bytes), each:
//   ldmatrix.x4.trans: matrix m = tokens 8 (m % 2) + 0..7 x channels
//     16 (m / 2) + 0..15 as 8x8 b16; lane i gets, of channels c, c + 1
//     (c = 2 (i / 4) [+ 16 for m >= 2]), tokens 2q, 2q + 1 (q = i % 4)
//     [+ 8 for odd m], one register per matrix;
//   two PRMT per matrix pair: channel c's bytes of tokens 2q, 2q+1, 2q+8,
//     2q+9 in one register, channel c + 1's in the other;
//   stmatrix.x4: row r of a matrix is one channel's 16 token bytes. Rows of
//     the first matrix hold channels 0, 2, 4, 6, 9, 11, 13, 15 (the second
//     the others): with the 64-byte swizzle those 8 rows fall in 8 distinct
//     16-byte bank groups (even channels only would conflict 2-way), the
//     per-lane choice costing nothing (a PRMT selector register).
// The loads are conflict-free too (8 consecutive tokens of one swizzle
// unit). A lane's addresses come from its block (0, 0) ones by
// TransposeSteps: k and h as immediate offsets, the rest one XOR each. The
// writer's fence.proxy.async and a barrier both WGs pass (a page-ready
// barrier, or kPReady) order the stores before the P V WGMMA.
template <class Tr>
__device__ __forceinline__ void transpose_v(const typename Tr::Element* k_slot, typename Tr::Element* vt,
                                            const typename Tr::Element* zeros, const TransposeLane& lane, int valid) {
  static_assert(sizeof(typename Tr::Element) == 1, "byte transpose");
  using Steps = TransposeSteps<Tr>;
  static_assert(Steps::kHold);
  constexpr uint32_t kTokenStep = Steps::kTokenStep, kVtChannelStep = Steps::kVtChannelStep;
  const uint32_t ld_from[2] = {smem_addr(k_slot) + lane.ld_offset[0], smem_addr(k_slot) + lane.ld_offset[1]};
  const uint32_t zero_row = smem_addr(zeros);
  const uint32_t vt_base = smem_addr(vt);
  // prmt.b32 as such: __byte_perm reads only a selector's low three bits, so ptxas masks a selector it cannot
  // see (one loaded from shared memory) on every call; ours have the fourth (sign replication) bit clear.
  auto prmt = [](uint32_t a, uint32_t b, uint32_t sel) {
    uint32_t d;
    asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
  };
  // Blocks go in batches: the batch's ldmatrix are issued back to back
  // before its first PRMT, so their latencies overlap (one block at a time,
  // every PRMT waited on its own ldmatrix: the top short-scoreboard stall of
  // fp8_per_tensor in Nsight Compute, session 6). The asm statements keep
  // their source order (volatile, memory clobbers); loads from the K slot
  // may pass stores to V^T, a different buffer.
  constexpr int kBlocks = 8, kBatch = Tr::kTransposeBatch;
  static_assert(kBlocks % kBatch == 0, "whole batches");
  CUTE_UNROLL
  for (int first = 0; first < kBlocks; first += kBatch) {
    uint32_t d[kBatch][4];
    CUTE_UNROLL
    for (int b = 0; b < kBatch; ++b) {
      const int h = (first + b) / 4, k = (first + b) % 4;
      const uint32_t from = 16 * k + lane.ld_token < valid ? ld_from[h] + k * kTokenStep : zero_row;
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(d[b][0]), "=r"(d[b][1]), "=r"(d[b][2]), "=r"(d[b][3])
                   : "r"(from)
                   : "memory");  // stays after the k_full wait
    }
    CUTE_UNROLL
    for (int b = 0; b < kBatch; ++b) {
      const int h = (first + b) / 4, k = (first + b) % 4;
      const uint32_t o0 = prmt(d[b][0], d[b][1], lane.sel_first), o1 = prmt(d[b][0], d[b][1], lane.sel_second);
      const uint32_t o2 = prmt(d[b][2], d[b][3], lane.sel_first), o3 = prmt(d[b][2], d[b][3], lane.sel_second);
      stmatrix_x4(vt_base + (lane.st_offset ^ uint32_t(16 * k)) + h * kVtChannelStep, o0, o1, o2, o3);
    }
  }
}

// The lane's addressing from its thread index on every call (fp8_per_tensor).
template <class Tr>
__device__ __forceinline__ void transpose_v(const typename Tr::Element* k_slot, typename Tr::Element* vt,
                                            const typename Tr::Element* zeros, int wg, int tid, int valid) {
  transpose_v<Tr>(k_slot, vt, zeros, transpose_lane<Tr>(wg, tid), valid);
}

}  // namespace jax_flash_mla::sm90
