// Design S on the page pairs (Traits<kFp8DsMlaTokenScales>): the producer warpgroup's warps 1 and 2 prepare each
// page the producer thread loads, so that the consumers' S needs one factor per token (traits.h). One token a
// thread: k[t] = the token's largest scale, into the page's table, with the chunk's running N = max k so far.
// On a page where some valid token's four scales differ (a per-group cache, FlashMLA's writer), the slot's rows
// then, eight threads a row: each group whose scale is not its token's k re-expressed at k[t], e4m3(x8 * scale_g /
// k[t]) through f16 (exact for power-of-two ratios while the result stays an e4m3 normal; e4m3's rounding
// otherwise). Correct for any cache, and slow: such caches belong to design A (consumer_ds).
// Then the slot's `prepared` barrier. Member definitions of SplitKvMlaKernel<kFormat, kNarrow> (splitkv_mla.cuh),
// which includes this file after the class; not a standalone header.
#pragma once

namespace jax_flash_mla::sm90 {

template <config::KvFormat kFormat, bool kNarrow>
__device__ void SplitKvMlaKernel<kFormat, kNarrow>::prep_pages(const SplitKvArgs& args, Plan& plan,
                                                              const SchedMeta& meta, int t) {
  if constexpr (Tr::kTokenScales) {
    const DecodeParams& p = args.params;
    const int lane = t % 32;
    // f(row, word) on every 32-bit word of a slab's 64 rows of 128 bytes (shared, in place), the prep threads
    // cooperating: eight threads a row, 16 bytes each, so a quarter-warp's accesses cover one row's 32 banks (one
    // row a thread put a quarter-warp's eight rows on the same four banks). Loads go out kInFlight at a time (the
    // producer warpgroup keeps 24 registers).
    // The swizzle only permutes 16-byte pieces within a row, which an elementwise f ignores. f returns false to
    // leave a piece as it was.
    constexpr int kRowsPerPass = Tr::kPrepWarps * 32 / 8;
    constexpr int kPasses = kBlockN / kRowsPerPass;
    constexpr int kInFlight = 2;
    const int piece = t % 8;
    auto transform_slab = [&](uint32_t slab, auto f) {
#pragma unroll 1
      for (int j0 = 0; j0 < kPasses; j0 += kInFlight) {
        uint4 w[kInFlight];
#pragma unroll
        for (int j = 0; j < kInFlight; ++j) {
          const uint32_t at = slab + ((j0 + j) * kRowsPerPass + t / 8) * 128 + 16 * piece;
          asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                       : "=r"(w[j].x), "=r"(w[j].y), "=r"(w[j].z), "=r"(w[j].w)
                       : "r"(at)
                       : "memory");
        }
#pragma unroll
        for (int j = 0; j < kInFlight; ++j) {
          const int row = (j0 + j) * kRowsPerPass + t / 8;
          if (f(row, w[j])) {
            asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(slab + row * 128 + 16 * piece),
                         "r"(w[j].x), "r"(w[j].y), "r"(w[j].z), "r"(w[j].w)
                         : "memory");
          }
        }
      }
    };
    int it = 0;  // ring position, as the producer thread's
    for_each_chunk(p, meta, [&](const Chunk& c) {
      float running_n = 0.f;
      for (int page = c.first_page(); page < c.end_page(); ++page, ++it) {
        const int stage = it % Tr::kNumStages;
        const uint32_t phase = (it / Tr::kNumStages) & 1;
        auto& table = plan.table[it % Tr::kTableSlots];
        char* slot = reinterpret_cast<char*>(plan.k[stage]);
        const bool valid = page * kBlockN + t < c.end_token;
        // Every consumer warp read this table's last page (kTableSlots pages ago).
        mbarrier_wait(&plan.table_empty[it % Tr::kTableSlots], ((it / Tr::kTableSlots) & 1) ^ 1);
        mbarrier_wait(&plan.k_full[stage][1], phase);        // the scales, NoPE slabs 2-3 and the RoPE slab
        float4 s = make_float4(1.f, 1.f, 1.f, 1.f);
        if (valid) s = *reinterpret_cast<const float4*>(slot + Tr::kScaleOffset + t * Tr::kScaleRowBytes);
        // Positive finite scales only (others are no writer's): anything else counts as 0, and a token without a
        // positive scale gets k = 1 with its bytes re-expressed (to zeros).
        auto clean = [](float x) { return x > 0.f && x <= 3.0e38f ? x : 0.f; };
        const float s4[4] = {clean(s.x), clean(s.y), clean(s.z), clean(s.w)};
        const float largest = fmaxf(fmaxf(s4[0], s4[1]), fmaxf(s4[2], s4[3]));
        const float k = largest > 0.f ? largest : 1.f;
        const bool uniform = !valid || (s4[0] == k && s4[1] == k && s4[2] == k && s4[3] == k);
        table.k[t] = k;
        // The page's largest k and its vote: positive floats order as their bits.
        const uint32_t max_bits = __reduce_max_sync(0xffffffffu, valid ? __float_as_uint(k) : 0u);
        const bool warp_uniform = __all_sync(0xffffffffu, uniform);
        if (lane == 0) {
          table.warp_max[t / 32] = max_bits;
          table.warp_uniform[t / 32] = warp_uniform;
        }
        named_barrier_sync(NamedBarriers::kPrepExchange, Tr::kPrepWarps * 32);
        const uint32_t page_max = max(table.warp_max[0], table.warp_max[1]);
        const bool page_uniform = table.warp_uniform[0] && table.warp_uniform[1];
        running_n = fmaxf(running_n, page_max != 0u ? __uint_as_float(page_max) : 0.f);
        if (t == 0) {
          table.running_n = running_n > 0.f ? running_n : 1.f;
          table.shifted = !page_uniform;
        }
        if (!page_uniform) {
          mbarrier_wait(&plan.k_full[stage][0], phase);  // NoPE slabs 0-1
          // Slab g's valid rows whose scale g is not their k: four e4m3 bytes at a time as two f16 pairs (exact),
          // times scale_g / k, back to e4m3.
          const int valid_rows = c.end_token - page * kBlockN;
#pragma unroll 1
          for (int g = 0; g < Tr::kNumGroups; ++g) {
            transform_slab(smem_addr(slot + g * Tr::kNopeSlabBytes), [&](int row, uint4& w) {
              const float k_row = table.k[row];
              const float s_g = clean(*reinterpret_cast<const float*>(slot + Tr::kScaleOffset +
                                                                      row * Tr::kScaleRowBytes + 4 * g));
              if (row >= valid_rows || s_g == k_row) return false;
              const __half2 r2 = __float2half2_rn(s_g / k_row);
              const uint32_t r = *reinterpret_cast<const uint32_t*>(&r2);
              auto shift = [&](uint32_t& word) {
                uint32_t lo, hi;
                asm("{\n .reg .b16 a, b;\n mov.b32 {a, b}, %2;\n"
                    " cvt.rn.f16x2.e4m3x2 %0, a;\n cvt.rn.f16x2.e4m3x2 %1, b;\n}\n"
                    : "=r"(lo), "=r"(hi)
                    : "r"(word));
                word = pack_e4m3x4_h2(mul_half2(lo, r), mul_half2(hi, r));
              };
              shift(w.x), shift(w.y), shift(w.z), shift(w.w);
              return true;
            });
          }
        }
        // Shifted NoPE bytes are read by WGMMA (the async proxy); the table by the consumers' loads.
        if (!page_uniform) fence_proxy_async_smem();
        __syncwarp();
        mbarrier_arrive_if(&plan.prepared[stage], lane == 0);
      }
    });
  }
}

}  // namespace jax_flash_mla::sm90
