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
// `scale` converts raw q.k to logits; `out_scale` (descale_k or 1)
// multiplies the output, in partials alike.
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
    if constexpr (Tr::kUsesDescale) {
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
  const int col0 = wg * decode_cfg::kHeadDimVPerWG;
  if (direct) {
    __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out);  // bf16 for every format
    CUTE_UNROLL
    for (int v = 0; v < size(tOrO); v += 2) {
      const int h = fragment_row_half(v);
      if (valid[h]) {
        const int col = col0 + get<1>(tOcO(v));
        // Select, not multiply: O is stale (never written) in a chunk without pages.
        *reinterpret_cast<__nv_bfloat162*>(out + out_off[h] + col) =
            seen[h] ? __floats2bfloat162_rn(tOrO(v) * inv[h], tOrO(v + 1) * inv[h]) : __floats2bfloat162_rn(0.f, 0.f);
      }
    }
  } else {
    CUTE_UNROLL
    for (int v = 0; v < size(tOrO); v += 2) {
      const int h = fragment_row_half(v);
      if (valid[h]) {
        const int col = col0 + get<1>(tOcO(v));
        *reinterpret_cast<float2*>(p.o_accum + out_off[h] + col) =
            seen[h] ? make_float2(tOrO(v) * inv[h], tOrO(v + 1) * inv[h]) : make_float2(0.f, 0.f);
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
