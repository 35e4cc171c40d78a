// Design S on the page pairs (Traits<kFp8DsMlaTokenScales>): the producer warpgroup's warps 1 and 2 prepare each
// page the producer thread loads, one token a thread, so that the consumers' S is one accumulator (traits.h):
//   - k[t] = the token's largest scale, into the slot's page table, with the chunk's running N = max k so far;
//   - the RoPE slab's row t divided by k[t] in place (bf16: exact for the power-of-two scales of the reference
//     quantizer, short of underflow; one bf16 rounding for other scales);
//   - on a page where some valid token's four scales differ (a per-group cache, FlashMLA's writer), every such
//     token's NoPE bytes re-expressed at k[t]: e4m3(x8 * scale_g / k[t]) through f16 (exact for power-of-two
//     ratios while the result stays an e4m3 normal; e4m3's rounding otherwise). Correct for any cache, and slow:
//     such caches belong to design A (consumer_ds).
// Then the slot's `prepared` barrier. Member definitions of SplitKvMlaKernel<kFormat, kNarrow> (splitkv_mla.cuh),
// which includes this file after the class; not a standalone header. (WIP, session 63: compiled, not run.)
#pragma once

namespace jax_flash_mla::sm90 {

template <config::KvFormat kFormat, bool kNarrow>
__device__ void SplitKvMlaKernel<kFormat, kNarrow>::prep_pages(const SplitKvArgs& args, Plan& plan,
                                                              const SchedMeta& meta, int t) {
  if constexpr (Tr::kTokenScales) {
    const DecodeParams& p = args.params;
    const int lane = t % 32;
    // f on every 32-bit word of the 128 bytes at `row` (shared), 16 bytes at a time, in place.
    auto transform_row = [](uint32_t row, auto f) {
#pragma unroll 1
      for (int piece = 0; piece < 8; ++piece) {
        uint4 w;
        asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(w.x), "=r"(w.y), "=r"(w.z), "=r"(w.w)
                     : "r"(row + 16 * piece)
                     : "memory");
        w = make_uint4(f(w.x), f(w.y), f(w.z), f(w.w));
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(row + 16 * piece), "r"(w.x), "r"(w.y), "r"(w.z),
                     "r"(w.w)
                     : "memory");
      }
    };
    int it = 0;  // ring position, as the producer thread's
    for_each_chunk(p, meta, [&](const Chunk& c) {
      float running_n = 0.f;
      for (int page = c.first_page(); page < c.end_page(); ++page, ++it) {
        const int stage = it % Tr::kNumStages;
        const uint32_t phase = (it / Tr::kNumStages) & 1;
        auto& table = plan.table[stage];
        char* slot = reinterpret_cast<char*>(plan.k[stage]);
        const bool valid = page * kBlockN + t < c.end_token;
        mbarrier_wait(&plan.table_empty[stage], phase ^ 1);  // every consumer warp read this entry's last page
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
        if (valid) {
          // Row t of the RoPE slab: 128 contiguous bytes (the 128-byte swizzle permutes 16-byte pieces within it).
          const float inv = 1.f / k;
          const __nv_bfloat162 f = __floats2bfloat162_rn(inv, inv);
          transform_row(smem_addr(slot + Tr::kRopeOffset + t * 2 * Tr::kHeadDimRope), [&](uint32_t word) {
            const __nv_bfloat162 x = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&word), f);
            return *reinterpret_cast<const uint32_t*>(&x);
          });
        }
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
          if (!uniform) {
            // Token t's 512 NoPE bytes: slab g / 1 (128-byte slabs of 64 token rows), row t, in 16-byte pieces.
#pragma unroll 1
            for (int g = 0; g < Tr::kNumGroups; ++g) {
              const __half2 r2 = __float2half2_rn(s4[g] / k);
              const uint32_t r = *reinterpret_cast<const uint32_t*>(&r2);
              transform_row(smem_addr(slot + g * Tr::kNopeSlabBytes + t * Tr::kTmaBoxElems), [&](uint32_t word) {
                uint32_t lo, hi;  // four e4m3 bytes as two f16 pairs (exact), times the ratio, back to e4m3
                asm("{\n .reg .b16 a, b;\n mov.b32 {a, b}, %2;\n"
                    " cvt.rn.f16x2.e4m3x2 %0, a;\n cvt.rn.f16x2.e4m3x2 %1, b;\n}\n"
                    : "=r"(lo), "=r"(hi)
                    : "r"(word));
                return pack_e4m3x4_h2(mul_half2(lo, r), mul_half2(hi, r));
              });
            }
          }
        }
        // The RoPE and NoPE writes are read by WGMMA (the async proxy); the table by the consumers' loads.
        fence_proxy_async_smem();
        __syncwarp();
        mbarrier_arrive_if(&plan.prepared[stage], lane == 0);
      }
    });
  }
}

}  // namespace jax_flash_mla::sm90
