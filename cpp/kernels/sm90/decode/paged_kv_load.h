// Paged K/V tile loads: a page (64 tokens x 576 channels of one KV head) in
// one or two TMA transaction groups, addressed through block_table.
//
// The cache [num_blocks, 64, h_kv, 576] is described to the TMA unit as a 4-D
// tensor (channel, head, token-in-page, block), so a page of head hk is the box
// {64 ch, 1, 64 tokens, 1} at coordinates {64c, hk, 0, block_table[b][page]};
// nine boxes cover the 576 channels. Each box lands as a contiguous slab with
// the swizzle that the WGMMA descriptors of Traits expect: 8 KB with the
// 128-byte swizzle for bf16, 4 KB with the 64-byte swizzle for e4m3. Runs of
// slabs go as one box of a second map (make_slab_tensor_map): a page takes
// three TMA instructions.
#pragma once

#include <cstdint>

#include <cuda.h>

#include "config.h"
#include "kernels/sm90/decode/named_barriers.h"
#include "kernels/sm90/decode/traits.h"

namespace jax_flash_mla::sm90 {

__device__ __forceinline__ void tma_prefetch_descriptor(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// An L2 evict-first hint on the streamed pages (splitkv_mla.cuh's producer
// decides per chunk): the stream's lines then replace each other rather than
// the dirty lines that other kernels left in L2 (split partials, a serving
// step's activations), whose write-back shares DRAM with the stream; FlashMLA
// marks its K loads so. Two cases, measured per call with a dirty L2
// (docs/PERF.md sessions 50-53):
// - A CTA that is its pages' only reader (one row tile per KV head) hints a
//   chunk of at most kEvictFirstMaxPages: b 8, h_q 16 -9 to -13 %, b 1-24 -5 to
//   -13 %; hinting every chunk cost ~3 % over long streams (b 128, s_k 8192:
//   chunks of 124 pages). The chunk's length stands for the partition's:
//   counting a partition's pages first delayed its first load by 1-2 µs.
// - Pages that several row tiles' CTAs read gain from the hint only while the
//   batch's cache fits in L2 (b 32 s_k 1024 h_q 128 -5 %; FP8 b 4 s_k 16384
//   -4 to -9 % in a loop) and lose 1-4 % beyond it, whatever the partition's
//   length; the scheduler hands over the batch's page count
//   (SchedMeta::total_pages) to weigh against kEvictFirstMaxSharedBytes,
//   below the 50 MB L2 of H100/H200.
//   An explicit evict-normal policy there measured slower than none.
inline constexpr int kEvictFirstMaxPages = 16;
inline constexpr int64_t kEvictFirstMaxSharedBytes = int64_t{48} << 20;
__device__ __forceinline__ uint64_t l2_evict_first() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

// cp.async.bulk.tensor (PTX ISA "Data Movement: cp.async.bulk.tensor"): the
// copy signals completion on `bar` with complete_tx of the box's byte count.
__device__ __forceinline__ void tma_load_4d(const CUtensorMap* map, uint64_t* bar, void* smem_dst,
                                            int c0, int c1, int c2, int c3, bool evict_first = false) {
  if (evict_first) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
        " [%0], [%1, {%3, %4, %5, %6}], [%2], %7;\n" ::"r"(smem_addr(smem_dst)),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
        "l"(l2_evict_first())
        : "memory");
  } else {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(smem_addr(smem_dst)),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
        : "memory");
  }
}

// The same through a 5-D map (q's: splitkv_mla.cuh, make_q_tensor_map).
__device__ __forceinline__ void tma_load_5d(const CUtensorMap* map, uint64_t* bar, void* smem_dst,
                                            int c0, int c1, int c2, int c3, int c4, bool evict_first = false) {
  if (evict_first) {
    asm volatile(
        "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
        " [%0], [%1, {%3, %4, %5, %6, %7}], [%2], %8;\n" ::"r"(smem_addr(smem_dst)),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4),
        "l"(l2_evict_first())
        : "memory");
  } else {
    asm volatile(
        "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4, %5, %6, %7}], [%2];\n" ::"r"(smem_addr(smem_dst)),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
        : "memory");
  }
}

// Piece `piece` of a page's left (part 0: slabs 0-3, V channels 0-255) or
// right (part 1: slabs 4-8) part: Traits::kSlabsPerBox slabs as one box of
// `slab_map` on the piece's full barrier, and with the right part's first
// piece its RoPE slab, one box of `map`.
template <class Traits>
__device__ __forceinline__ void load_kv_piece(const CUtensorMap* map, const CUtensorMap* slab_map, uint64_t* full_bar,
                                              typename Traits::Element* slot, int head_k, int block, int part,
                                              int piece, bool evict_first) {
  constexpr int kSlabElems = config::kPageSize * Traits::kTmaBoxElems;
  constexpr int kSlabBytes = kSlabElems * int(sizeof(typename Traits::Element));
  constexpr int kRope = decode_cfg::kSlabs - 1;
  const int first = part * decode_cfg::kLeftSlabs + piece * Traits::kSlabsPerBox;
  const bool rope = part == 1 && piece == 0;
  mbarrier_arrive_expect_tx(full_bar, uint32_t((Traits::kSlabsPerBox + (rope ? 1 : 0)) * kSlabBytes));
  tma_load_5d(slab_map, full_bar, slot + first * kSlabElems, 0, 0, first, head_k, block, evict_first);
  if (rope) {
    tma_load_4d(map, full_bar, slot + kRope * kSlabElems, kRope * Traits::kTmaBoxElems, head_k, 0, block, evict_first);
  }
}

// A page's part, so the consumers can start S on one part while the other
// lands and hand the parts back apart: Traits::kPiecesPerPart pieces, each on
// its own full barrier (part_full[piece]).
template <class Traits>
__device__ __forceinline__ void load_kv_page_part(const CUtensorMap* map, const CUtensorMap* slab_map,
                                                  uint64_t* part_full, typename Traits::Element* slot, int head_k,
                                                  int block, int part, bool evict_first) {
  static_assert(decode_cfg::kSlabs == 2 * decode_cfg::kLeftSlabs + 1, "two V halves and the RoPE slab");
  static_assert(Traits::kSlabsPerBox * Traits::kPiecesPerPart == decode_cfg::kLeftSlabs,
                "a V half in kPiecesPerPart boxes of slab_map");
  if constexpr (Traits::kPiecesPerPart == 1) {
    load_kv_piece<Traits>(map, slab_map, part_full, slot, head_k, block, part, 0, evict_first);
  } else {
    // Not unrolled: the producer runs on 24 registers, and the per-stage, per-part and per-piece addresses of an
    // unrolled loop, hoisted out of its page loop, spill.
#pragma unroll 1
    for (int piece = 0; piece < Traits::kPiecesPerPart; ++piece) {
      load_kv_piece<Traits>(map, slab_map, &part_full[piece], slot, head_k, block, part, piece, evict_first);
    }
  }
}

// fp8_ds_mla (Traits<kFp8DsMla> has the slot plan): the four 128-byte NoPE
// slabs as one box of `slab_map`, the RoPE slab through the cache map, the
// scales through the scale map.
template <class Traits>
__device__ __forceinline__ void load_ds_page(const CUtensorMap* cache_map, const CUtensorMap* slab_map,
                                             const CUtensorMap* scale_map, uint64_t* full_bar,
                                             typename Traits::Element* slot, int head_k, int block,
                                             bool evict_first) {
  static_assert(Traits::kSlabsPerBox == Traits::kNopeSlabs, "the NoPE part in one box");
  mbarrier_arrive_expect_tx(full_bar, Traits::kKTileBytes);
  tma_load_5d(slab_map, full_bar, slot, 0, 0, 0, head_k, block, evict_first);
  tma_load_4d(cache_map, full_bar, slot + Traits::kRopeOffset, Traits::kRopeByte, head_k, 0, block, evict_first);
  tma_load_4d(scale_map, full_bar, slot + Traits::kScaleOffset, Traits::kScaleByte, head_k, 0, block, evict_first);
}

// fp8_ds_mla on the page pairs (Traits<kFp8DsMlaTokenScales>): part 0 is NoPE slabs 0-1, part 1 the scales (first:
// the prep warps read them before the rest lands), NoPE slabs 2-3 and the RoPE slab.
template <class Traits>
__device__ __forceinline__ void load_ds_page_part(const CUtensorMap* cache_map, const CUtensorMap* slab_map,
                                                  const CUtensorMap* scale_map, uint64_t* part_full,
                                                  typename Traits::Element* slot, int head_k, int block, int part,
                                                  bool evict_first) {
  static_assert(Traits::kSlabsPerBox * 2 == Traits::kNopeSlabs, "a part's NoPE slabs in one box of slab_map");
  if (part == 0) {
    mbarrier_arrive_expect_tx(part_full, Traits::kLeftBytes);
    tma_load_5d(slab_map, part_full, slot, 0, 0, 0, head_k, block, evict_first);
  } else {
    mbarrier_arrive_expect_tx(part_full, Traits::kRightBytes);
    tma_load_4d(scale_map, part_full, slot + Traits::kScaleOffset, Traits::kScaleByte, head_k, 0, block, evict_first);
    tma_load_5d(slab_map, part_full, slot + Traits::kLeftBytes, 0, 0, Traits::kSlabsPerBox, head_k, block,
                evict_first);
    tma_load_4d(cache_map, part_full, slot + Traits::kRopeOffset, Traits::kRopeByte, head_k, 0, block, evict_first);
  }
}

}  // namespace jax_flash_mla::sm90
