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
  // O goes out through shared memory and bulk copies of whole rows: its
  // fragment's own stores write 8 rows x 32 bytes a warp instruction, and
  // that took ~4 us a chunk for 128 KB of partials (session 17's trace). Each
  // warp stages 8 rows at a time (one row half of its fragment) in its own
  // part of Tr::epilogue_staging, which nothing reads between the chunk's
  // last WGMMA (kSumReady) and the next chunk's first; the lanes holding a
  // row's first columns (lane % 4 == 0) copy it out.
  static_assert(kConsumers / 32 * kStageWarpBytes <= Tr::kEpilogueStagingBytes, "the epilogue's stage");
  const int col0 = wg * decode_cfg::kHeadDimVPerWG;
  char* stage = Tr::epilogue_staging(plan) + (wg * 4 + tid / 32) * kStageWarpBytes;
  char* row_stage = stage + (lane / 4) * kStageRowBytes;
  const uint32_t row_addr = smem_addr(row_stage);
  // out (bf16, `direct`) or the fp32 partials by the same instructions, the
  // element chosen by predicate: two instantiations behind a branch moved
  // bf16's WGMMA descriptors out of the uniform datapath (+347 R2UR).
  const int elem_bytes = direct ? 2 : 4;
  char* const base = direct ? static_cast<char*>(p.out) : reinterpret_cast<char*>(p.o_accum);
  CUTE_UNROLL
  for (int h = 0; h < 2; ++h) {
    if (h == 1) {  // the stage holds row half 0 until its copies have read it
      bulk_wait_read();
      __syncwarp();
    }
    CUTE_UNROLL
    for (int v = 0; v < size(tOrO); v += 2) {
      if (fragment_row_half(v) != h) continue;
      // Select, not multiply: O is stale (never written) in a chunk without pages.
      const float a = seen[h] ? tOrO(v) * inv[h] : 0.f, b = seen[h] ? tOrO(v + 1) * inv[h] : 0.f;
      const int col = get<1>(tOcO(v));
      const __nv_bfloat162 ab = __floats2bfloat162_rn(a, b);
      asm volatile(
          "{\n .reg .pred p;\n setp.ne.b32 p, %0, 0;\n @p st.shared.b32 [%1], %2;\n"
          " @!p st.shared.v2.f32 [%3], {%4, %5};\n}\n" ::"r"(int(direct)),
          "r"(row_addr + col * 2), "r"(*reinterpret_cast<const uint32_t*>(&ab)), "r"(row_addr + col * 4), "f"(a),
          "f"(b)
          : "memory");
    }
    fence_proxy_async_smem();  // the stage is read by the bulk copies (async proxy)
    __syncwarp();
    if ((lane & 3) == 0 && valid[h]) {
      bulk_store(base + (out_off[h] + col0) * elem_bytes, row_stage, decode_cfg::kHeadDimVPerWG * elem_bytes);
    }
    bulk_commit();
  }
  bulk_wait_read();
  if (wg == 0 && (lane & 3) == 0) {
    float* dst = direct ? p.lse : p.lse_accum;
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h)
      if (valid[h]) dst[lse_off[h]] = lse[h];
  }
  // Every warp's copies have read their stage before the next chunk writes
  // there (bf16's Q load, fp8_ds_mla's q staging, the V^T transposes).
  named_barrier_sync(NamedBarriers::kSumReady, kConsumers);
}

}  // namespace jax_flash_mla::sm90
