// Shared-memory lane mappings of the FP8 formats (fp8_per_tensor, fp8_ds_mla):
// the V^T transpose (ldmatrix.trans / PRMT / stmatrix) and the P store
// (stmatrix), which agree on one token order. Traits<> supplies the tiles'
// layouts; scripts/emulate_vt_transpose.py replays both mappings on the host
// (tests/test_smem_lane_mappings.py).
#pragma once

#include <cstdint>

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

// Stores a warp's e4m3 P (rows 16 warp .. 16 warp + 15 of the 64-row tile):
// value v of the S-shaped fragment `s` times scale(v). In p_column order,
// the accumulator fragment of a thread (rows lane / 4 and + 8, tokens
// 8j + 2 (lane % 4) + {0, 1}) puts, per row half h and token group k, 4
// contiguous bytes at columns 16k + 4 (lane % 4): tokens 2q, 2q + 1 of
// column block 2k and the same of block 2k + 1. That is exactly a thread's
// element of an 8x8 b16 stmatrix tile (row lane / 4, bytes 4 (lane % 4) ..):
// words[h][k] goes to tile (h, first_group + k).
template <class Tr, int kTokenGroups, class Frag, class Scale>
__device__ __forceinline__ void store_p_e4m3(uint32_t p_tile, int warp, int lane, const Frag& s, Scale scale,
                                             int first_group) {
  static_assert(kTokenGroups % 2 == 0, "two token groups x two row halves per stmatrix.x4");
  uint32_t words[2][kTokenGroups];
  CUTE_UNROLL
  for (int k = 0; k < kTokenGroups; ++k) {
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      const int v = 8 * k + 2 * h;  // column block 2k (v) and 2k + 1 (v + 4), row half h
      words[h][k] = pack_e4m3x4(s(v) * scale(v), s(v + 1) * scale(v + 1), s(v + 4) * scale(v + 4),
                                s(v + 5) * scale(v + 5));
    }
  }
  const typename Tr::SmemLayoutP layout_p{};
  const int m = lane / 8;  // the matrix whose row this lane addresses: (h, k) = (m % 2, m / 2)
  const int row = 16 * warp + 8 * (m % 2) + lane % 8;
  CUTE_UNROLL
  for (int pair = 0; pair < kTokenGroups / 2; ++pair) {
    const int col = 16 * (first_group + 2 * pair + m / 2);
    stmatrix_x4(p_tile + uint32_t(layout_p(row, col)), words[0][2 * pair], words[1][2 * pair],
                words[0][2 * pair + 1], words[1][2 * pair + 1]);
  }
}

// Consumer WG `wg` writes V^T[c][p_column(t)] = K[t][c] for its channels
// c in [256 wg, 256 wg + 256) and the page's 64 tokens, with zeros for tokens
// t >= `valid` (slots past the chunk's end may hold NaN, 0x7F / 0xFF in e4m3,
// and 0 * NaN = NaN in P V): their ldmatrix rows point at a 16-byte zero
// row instead, so the code stays branch-free while this WG's S WGMMA runs.
// Per warp, eight blocks of 16 tokens x 32 channels (512 bytes), each:
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
// unit). The writer's fence.proxy.async and a barrier both WGs pass (a
// page-ready barrier, or kPReady) order the stores before the P V WGMMA.
template <class Tr>
__device__ __forceinline__ void transpose_v(const typename Tr::Element* k_slot, typename Tr::Element* vt,
                                            const typename Tr::Element* zeros, int wg, int tid, int valid) {
  static_assert(sizeof(typename Tr::Element) == 1, "byte transpose");
  const typename Tr::SmemLayoutK layout_k{};
  const typename Tr::SmemLayoutV layout_vt{};
  const uint32_t k_base = smem_addr(k_slot);
  const uint32_t vt_base = smem_addr(vt);
  const uint32_t zero_row = smem_addr(zeros);
  const int lane = tid % 32;
  const int m = lane / 8, r = lane % 8;  // the matrix and row this lane addresses
  const int ld_token = 8 * (m % 2) + r;
  const int ld_channel = 16 * (m / 2);
  const bool odd_first = r >= 4;  // stmatrix rows: see above
  const int st_channel = 16 * (m / 2) + 2 * r + ((m % 2) ^ int(odd_first));
  // This lane's registers go to stmatrix row lane / 4.
  const bool lane_odd_first = lane / 4 >= 4;
  const uint32_t sel_first = lane_odd_first ? 0x7531u : 0x6420u;
  const uint32_t sel_second = lane_odd_first ? 0x6420u : 0x7531u;
  const int warp_channels = wg * decode_cfg::kHeadDimVPerWG + (tid / 32) * 64;
  // Blocks go in batches: the batch's ldmatrix are issued back to back
  // before its first PRMT, so their latencies overlap (one block at a time,
  // every PRMT waited on its own ldmatrix: the top short-scoreboard stall of
  // fp8_per_tensor in Nsight Compute, session 6). The asm statements keep
  // their source order (volatile, memory clobbers); loads from the K slot
  // may pass stores to V^T, a different buffer.
  constexpr int kBlocks = 8, kBatch = Tr::kTransposeBatch;
  static_assert(kBlocks % kBatch == 0, "whole batches");
  auto block_origin = [&](int block, int& ch0, int& t0) {
    ch0 = warp_channels + (block / 4) * 32;
    t0 = (block % 4) * 16;
  };
  CUTE_UNROLL
  for (int first = 0; first < kBlocks; first += kBatch) {
    uint32_t d[kBatch][4];
    CUTE_UNROLL
    for (int b = 0; b < kBatch; ++b) {
      int ch0, t0;
      block_origin(first + b, ch0, t0);
      const int token = t0 + ld_token;
      const uint32_t src = token < valid ? k_base + uint32_t(layout_k(token, ch0 + ld_channel)) : zero_row;
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(d[b][0]), "=r"(d[b][1]), "=r"(d[b][2]), "=r"(d[b][3])
                   : "r"(src)
                   : "memory");  // stays after the k_full wait
    }
    CUTE_UNROLL
    for (int b = 0; b < kBatch; ++b) {
      int ch0, t0;
      block_origin(first + b, ch0, t0);
      const uint32_t o0 = __byte_perm(d[b][0], d[b][1], sel_first), o1 = __byte_perm(d[b][0], d[b][1], sel_second);
      const uint32_t o2 = __byte_perm(d[b][2], d[b][3], sel_first), o3 = __byte_perm(d[b][2], d[b][3], sel_second);
      stmatrix_x4(vt_base + uint32_t(layout_vt(ch0 + st_channel, t0)), o0, o1, o2, o3);
    }
  }
}

}  // namespace jax_flash_mla::sm90
