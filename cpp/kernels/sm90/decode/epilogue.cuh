// The epilogue of both consumers: normalization and the writes of a chunk's result.
// Member definitions of SplitKvMlaKernel<kFormat, kNarrow> (splitkv_mla.cuh), which
// includes this file after the class; not a standalone header.
#pragma once

namespace jax_flash_mla::sm90 {

// Each WG's partial row sums (quad-reduced) meet in shared memory: both WGs
// normalize all 64 rows of their column half by the sum over both.
template <config::KvFormat kFormat, bool kNarrow>
__device__ void SplitKvMlaKernel<kFormat, kNarrow>::share_row_sums(Plan& plan, const OnlineSoftmaxState& softmax,
                                                                  int wg, int tid, const int (&rows)[2]) {
  const float sum[2] = {quad_allreduce_sum(softmax.sum[0]), quad_allreduce_sum(softmax.sum[1])};
  if ((tid & 3) == 0) {
    plan.row_sum[wg][rows[0]] = sum[0];
    plan.row_sum[wg][rows[1]] = sum[1];
  }
  named_barrier_sync(NamedBarriers::kSumReady, kConsumers);
}

// After share_row_sums. A chunk that is its sequence's only split writes out (bf16) and lse
// directly; otherwise o_accum / lse_accum at num_splits[b] + split_idx.
// `scale` converts raw q.k to logits; `out_scale` (descale_k, design S's
// N / 16, or 1) multiplies the output, in partials alike.
template <config::KvFormat kFormat, bool kNarrow>
template <class FragO, class CoordO>
__device__ void SplitKvMlaKernel<kFormat, kNarrow>::epilogue(const DecodeParams& p, Plan& plan, const Chunk& c,
                                                            int head_k, int m_block, int wg, int tid,
                                                            const OnlineSoftmaxState& softmax, FragO& tOrO,
                                                            const CoordO& tOcO, const int (&rows)[2], float scale,
                                                            float out_scale) {
  using namespace cute;
  const int lane = tid % 32;
  const int split_begin = p.num_splits[c.batch];
  const bool direct = p.num_splits[c.batch + 1] - split_begin == 1;
  const int64_t accum_row0 =
      (int64_t(split_begin + c.split_idx) * p.num_heads_k + head_k) * p.q_rows_per_head_k;

  float inv[2], lse[2];
  bool valid[2], seen[2];
  int64_t out_off[2], lse_off[2];
  CUTE_UNROLL
  for (int h = 0; h < 2; ++h) {
    const float l = plan.row_sum[0][rows[h]] + plan.row_sum[1][rows[h]];
    seen[h] = l > 0.f;
    if constexpr (Tr::kUsesDescale || Tr::kTokenScales) {  // design S: out_scale carries O's units, N / 16
      inv[h] = seen[h] ? out_scale / l : 0.f;
    } else {
      inv[h] = seen[h] ? 1.f / l : 0.f;
    }
    // No visible key: +inf for a final result, -inf for a partial that the
    // combine must ignore (params.h).
    lse[h] = l > 0.f ? softmax.max[h] * scale + logf(l) : (direct ? INFINITY : -INFINITY);
    const int r = m_block * kBlockM + rows[h];
    valid[h] = r < p.q_rows_per_head_k;
    const int s = r / p.heads_per_head_k;
    const int hq = head_k * p.heads_per_head_k + r % p.heads_per_head_k;
    if (direct) {
      out_off[h] = c.batch * p.out_batch_stride + s * p.out_seq_stride + hq * p.out_head_stride;
      lse_off[h] = (int64_t(c.batch) * p.num_heads_q + hq) * p.seqlen_q + s;
    } else {
      out_off[h] = (accum_row0 + r) * config::kHeadDimV;
      lse_off[h] = accum_row0 + r;
    }
  }
  // The writes go out as whole 32-byte sectors of a row (bf16) or 64-byte
  // runs (fp32): a thread holds 2 adjacent columns of a row per 8-column
  // block b (value 4b + 2h + e of the fragment is row half h, column
  // 8b + 2 (lane % 4) + e), so lanes q and q ^ 1 of a quad swap one pair of
  // blocks b, b + 1: even q then holds columns 8b + 2q .. + 3, odd q
  // 8b + 8 + 2 (q - 1) .. + 3, and the quad covers 16 adjacent columns with
  // one store each. (Two columns per lane took twice the store
  // instructions, and left every 32-byte sector of bf16 half written; a
  // chunk end's writes drain slowly under the other SMs' page stream.)
  const int col0 = wg * decode_cfg::kHeadDimVPerWG;
  const bool odd = lane & 1;
  const int quad_col = odd ? 8 + 2 * ((lane & 3) - 1) : 2 * (lane & 3);
  constexpr int kBlocks = decltype(size(tOrO))::value / 4;
  static_assert(kBlocks % 2 == 0, "8-column blocks in pairs");
  CUTE_UNROLL
  for (int b = 0; b < kBlocks; b += 2) {
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      const int v0 = 4 * b + 2 * h, v1 = v0 + 4;  // this row half's values in blocks b, b + 1
      const int col = col0 + int(get<1>(tOcO(v0))) - 2 * (lane & 3) + quad_col;
      // Select, not multiply: O is stale (never written) in a chunk without pages.
      const float x0 = seen[h] ? tOrO(v0) * inv[h] : 0.f, x1 = seen[h] ? tOrO(v0 + 1) * inv[h] : 0.f;
      const float y0 = seen[h] ? tOrO(v1) * inv[h] : 0.f, y1 = seen[h] ? tOrO(v1 + 1) * inv[h] : 0.f;
      if (direct) {
        const __nv_bfloat162 xb = __floats2bfloat162_rn(x0, x1), yb = __floats2bfloat162_rn(y0, y1);
        const uint32_t x = reinterpret_cast<const uint32_t&>(xb), y = reinterpret_cast<const uint32_t&>(yb);
        const uint32_t got = __shfl_xor_sync(0xffffffffu, odd ? x : y, 1);
        if (valid[h]) {
          __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out);  // bf16 for every format
          *reinterpret_cast<uint2*>(out + out_off[h] + col) = odd ? make_uint2(got, y) : make_uint2(x, got);
        }
      } else {
        const float g0 = __shfl_xor_sync(0xffffffffu, odd ? x0 : y0, 1);
        const float g1 = __shfl_xor_sync(0xffffffffu, odd ? x1 : y1, 1);
        if (valid[h]) {
          *reinterpret_cast<float4*>(p.o_accum + out_off[h] + col) =
              odd ? make_float4(g0, g1, y0, y1) : make_float4(x0, x1, g0, g1);
        }
      }
    }
  }
  if (wg == 0 && (lane & 3) == 0) {
    float* dst = direct ? p.lse : p.lse_accum;
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h)
      if (valid[h]) dst[lse_off[h]] = lse[h];
  }
}

}  // namespace jax_flash_mla::sm90
