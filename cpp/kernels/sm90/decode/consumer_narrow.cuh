// The fp8_per_tensor consumer for few query rows (q_rows_per_head_k <= 16:
// h_q 16 with s_q 1, or fewer heads): the transposed problem, with the page's
// tokens and V's channels as the WGMMA's 64 rows instead of 16 query rows
// padded to 64. Member definitions of SplitKvMlaKernel<kFormat>
// (splitkv_mla.cuh), which includes this file after the class; not a
// standalone header.
#pragma once

namespace jax_flash_mla::sm90 {

// Per page, one warpgroup does all of it (the two WGs take alternate pages of
// a chunk, each with its own running max, row sums and O^T; they merge once
// at the chunk's end, so no page needs the other WG):
//   S^T = K Q^T      m64 (tokens) n16 (query rows) k32, both operands from
//                    shared memory as loaded (K slot and Q, K-major): 18 SS
//                    FP8 WGMMAs reading 36 KB, a quarter of the 64-row tile's
//                    tensor work.
//   P^T              softmax down S^T's columns: a column's 64 tokens lie in
//                    8 lanes x 2 values of each of the 4 warps (3 xor-shuffles,
//                    then one shared-memory exchange per WG and page); P goes
//                    to shared memory as e4m3 bytes, 16 rows x 64 tokens.
//   O^T += V^T P^T   m64 (channels) n16 k32, 8 channel blocks x 2 k-steps of
//                    RS FP8 WGMMA: V^T is the A operand from registers, built
//                    straight from the K slot by ldmatrix.trans + PRMT (no
//                    V^T tile, no stmatrix, no proxy fence for it).
// A fragment (PTX ISA register fragment of m64nNk32 .e4m3, CuTe's
// ALayout_64x32): a0 = row r = lane / 4 of the warp's 16 rows, k 4q..4q+3
// (q = lane % 4); a1 = row r + 8; a2, a3 = the same at k + 16. ldmatrix.trans
// of 8 tokens x 8 b16 (16 channel bytes) gives lane i channels c, c + 1
// (c = 2 (i / 4)) of tokens 2q, 2q + 1 in one register, so two PRMT per
// token pair of matrices give channel c's bytes of tokens 2q, 2q+1, 2q+8,
// 2q+9 (p_column order, fp8_smem.h) and channel c + 1's. Row r of the warp's
// 16 A rows is thus channel 2r of its 16 channels and row r + 8 channel
// 2r + 1: thread (warp, lane) holds O^T of channels 16 warp + 2 (lane / 4)
// + {0, 1} of each 64-channel block, adjacent, for query rows 2q + {0, 1}
// and 2q + 8 + {0, 1}. P^T's columns follow p_column too (P V sums over
// tokens, so any order both agree on works).
template <config::KvFormat kFormat>
__device__ void SplitKvMlaKernel<kFormat>::consumer_narrow(const SplitKvArgs& args, Plan& plan,
                                                          const SchedMeta& meta, int head_k, int wg, int tid) {
  using namespace cute;
  static_assert(Tr::kNarrowRows == 16, "one n16 WGMMA column block of query rows");
  constexpr int kRows = Tr::kNarrowRows;
  constexpr int kChannelBlocks = decode_cfg::kHeadDimV / 64;  // 8 m64 blocks of O^T
  const DecodeParams& p = args.params;
  typename Tr::TiledMmaNarrowS mma_s;
  typename Tr::TiledMmaNarrowO mma_o;
  auto thr_s = mma_s.get_thread_slice(tid);
  auto thr_o = mma_o.get_thread_slice(tid);
  const int ctid = wg * 128 + tid;
  const int warp = tid / 32, lane = tid % 32;

  const float out_scale = __ldg(p.descale_k);
  const float descale_qk = __ldg(p.descale_q) * out_scale;
  const float logit_scale = p.softmax_scale * descale_qk;
  const float scale_log2 = p.softmax_scale_log2 * descale_qk;

  Tensor sQ = make_tensor(make_smem_ptr(plan.q), typename Tr::SmemLayoutQ{});
  Tensor tSrQ = thr_s.partition_fragment_B(
      local_tile(sQ, Shape<Int<kRows>, Int<decode_cfg::kHeadDimQK>>{}, make_coord(0, 0)));  // (MMA, 1, 18)
  Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<kBlockN>, Int<kRows>>{});  // 8 values
  // V^T A fragments, (16 e4m3, 8 channel blocks, 2 k-steps), column-major, so
  // word j + 4 (block + 8 k-step) of its uint32 view is register a_j.
  Tensor tOrV = make_tensor<Element>(Layout<Shape<Shape<_4, _2, _2>, Int<kChannelBlocks>, _2>>{});
  Tensor tOrVw = recast<uint32_t>(tOrV);
  Tensor tOrO = partition_fragment_C(mma_o, Shape<Int<decode_cfg::kHeadDimV>, Int<kRows>>{});  // (MMA, 8, 1)
  static_assert(size(tSrS) == 8 && size(tOrO) == 8 * kChannelBlocks, "m64n16 fragments: 8 values per block");
  constexpr int kSteps = decode_cfg::kHeadDimQK / 32;  // 18
  constexpr int kLeftSteps = kSteps * decode_cfg::kLeftSlabs / decode_cfg::kSlabs;  // 8

  // Value v of an m64n16 accumulator: row (token or channel) half (v >> 1) & 1,
  // column (query row) 2 q + (v & 1) + 8 (v >> 2). This thread's four query
  // rows, by column index c = (v & 1) + 2 (v >> 2):
  auto col_of = [&](int c) { return 2 * (lane % 4) + (c & 1) + 8 * (c >> 1); };
  auto value_of = [](int c, int half) { return (c & 1) + 4 * (c >> 1) + 2 * half; };
  // Token of value v within the page, and its P^T column (p_column order).
  auto token_of = [&](int v) { return 16 * warp + lane / 4 + 8 * ((v >> 1) & 1); };
  auto pt_column = [](int t) {
    const int u = t % 16;
    return 16 * (t / 16) + 4 * ((u % 8) / 2) + 2 * (u / 8) + u % 2;
  };

  const typename Tr::SmemLayoutK layout_k{};
  const typename Tr::SmemLayoutPt layout_pt{};
  const uint32_t zero_row = smem_addr(plan.zeros);
  // ldmatrix.x4: lane i addresses row i % 8 of matrix i / 8 = tokens 8 (i / 8) .. of a 32-token k-step.
  const int ld_token = lane;  // 8 (lane / 8) + lane % 8
  // Per-WG page exchange of column maxima, double-buffered by page parity:
  // [warp][query row].
  auto max_buffer = [&](int parity) { return parity ? plan.row_sum[wg] : plan.ref_max[wg]; };

  SchedMeta walk = meta;
  walk.begin_split_idx = 0;
  int it = 0;  // ring position of the chunk's first page (both WGs count every page)
  for_each_chunk(p, walk, [&](const Chunk& c) {
    load_q(p, plan, c.batch, head_k, 0, ctid);
    float m_ref[4], l_part[4];
    int limit[4];
    int min_limit = c.end_token;
    CUTE_UNROLL
    for (int k = 0; k < 4; ++k) {
      m_ref[k] = -INFINITY;
      l_part[k] = 0.f;
      limit[k] = c.end_token;
      if (p.causal) limit[k] = min(limit[k], c.seqlen - p.seqlen_q + 1 + col_of(k) / p.heads_per_head_k);
      min_limit = min(min_limit, limit[k]);
    }
    const int page_begin = c.first_page();
    const int num_pages = c.end_page() - page_begin;
    for (int k = wg; k < num_pages; k += decode_cfg::kNumConsumerWGs) {
      const int i = it + k;
      const int stage = i % Tr::kNumStages;
      const uint32_t phase = uint32_t(i / Tr::kNumStages) & 1u;
      const int parity = (k / decode_cfg::kNumConsumerWGs) & 1;
      const int page = page_begin + k;
      const int valid = c.end_token - page * kBlockN;  // tokens of the page inside the chunk

      // S^T over the left part while the right part may still land.
      Tensor sK = make_tensor(make_smem_ptr(plan.k[stage]), typename Tr::SmemLayoutK{});
      Tensor tSrK = thr_s.partition_fragment_A(sK);  // (MMA, 1, 18)
      warpgroup_fence_operand(tSrS);
      mbarrier_wait(&plan.k_full[stage][0], phase);
      warpgroup_arrive();
      wgmma_k_steps<kLeftSteps>(mma_s, tSrK, tSrQ, tSrS, false);
      mbarrier_wait(&plan.k_full[stage][1], phase);
      warpgroup_arrive();  // after the wait loop's branch, or ptxas serializes (C7520)
      wgmma_k_steps<kSteps - kLeftSteps>(mma_s, tSrK, tSrQ, tSrS, true, kLeftSteps);
      warpgroup_commit_batch();

      // V^T fragments while S^T runs (the last page's O^T WGMMAs, which read
      // these registers, retired at its end). Tokens past the chunk read the
      // zero row: their slots may hold NaN, and 0 * NaN = NaN in P V.
      {
        const uint32_t k_base = smem_addr(plan.k[stage]);
        CUTE_UNROLL
        for (int ks = 0; ks < 2; ++ks) {
          const int token = 32 * ks + ld_token;
          CUTE_UNROLL
          for (int mb = 0; mb < kChannelBlocks; ++mb) {
            const uint32_t src = token < valid ? k_base + uint32_t(layout_k(token, 64 * mb + 16 * warp)) : zero_row;
            uint32_t d[4];
            asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                         : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                         : "r"(src)
                         : "memory");
            const int w = 4 * (mb + kChannelBlocks * ks);
            tOrVw(w + 0) = __byte_perm(d[0], d[1], 0x6420);  // channel 2r,     tokens 0-15 of the k-step
            tOrVw(w + 1) = __byte_perm(d[0], d[1], 0x7531);  // channel 2r + 1
            tOrVw(w + 2) = __byte_perm(d[2], d[3], 0x6420);  // channel 2r,     tokens 16-31
            tOrVw(w + 3) = __byte_perm(d[2], d[3], 0x7531);
          }
        }
      }
      warpgroup_wait<0>();
      warpgroup_fence_operand(tSrS);
      // S^T retired and V^T is in registers: the slot's last reads by this WG,
      // which is its only reader (k_empty counts 4 warps per part).
      __syncwarp();
      mbarrier_arrive_if(&plan.k_empty[stage][0], lane == 0);
      mbarrier_arrive_if(&plan.k_empty[stage][1], lane == 0);

      // Mask by selection (slots past the sequence may hold NaN scores).
      if (page * kBlockN + kBlockN > min_limit) {
        CUTE_UNROLL
        for (int v = 0; v < 8; ++v) {
          const int cidx = (v & 1) + 2 * (v >> 2);
          if (page * kBlockN + token_of(v) >= limit[cidx]) tSrS(v) = -INFINITY;
        }
      }
      // Column maxima over the page: two tokens per thread, 8 lanes, 4 warps.
      float page_max[4];
      {
        float* xmax = max_buffer(parity);
        CUTE_UNROLL
        for (int k4 = 0; k4 < 4; ++k4) {
          float m = fmaxf(tSrS(value_of(k4, 0)), tSrS(value_of(k4, 1)));
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 4));
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 8));
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
          page_max[k4] = m;
          if (lane < 4) xmax[warp * kRows + col_of(k4)] = m;
        }
        named_barrier_sync(NamedBarriers(int(NamedBarriers::kNarrowMax0) + wg), 128);
        CUTE_UNROLL
        for (int k4 = 0; k4 < 4; ++k4) {
          CUTE_UNROLL
          for (int w = 0; w < 4; ++w) page_max[k4] = fmaxf(page_max[k4], xmax[w * kRows + col_of(k4)]);
        }
      }
      // Lazy online softmax per column (softmax.h's rule: the reference moves
      // only when a column's max exceeds it by more than 2^kLazyRescaleLog2).
      float o_scale[4], base[4];
      bool rescale = false;
      CUTE_UNROLL
      for (int k4 = 0; k4 < 4; ++k4) {
        float new_max = fmaxf(m_ref[k4], page_max[k4]);
        if ((new_max - m_ref[k4]) * scale_log2 <= float(Tr::kLazyRescaleLog2)) new_max = m_ref[k4];
        o_scale[k4] = new_max == -INFINITY ? 1.f : exp2f((m_ref[k4] - new_max) * scale_log2);
        base[k4] = new_max == -INFINITY ? 0.f : new_max * scale_log2;
        m_ref[k4] = new_max;
        l_part[k4] *= o_scale[k4];
        rescale |= o_scale[k4] != 1.f;
      }
      const bool first = k == wg;  // this WG's first page of the chunk: O^T is written, not accumulated
      if (!first && rescale) {
        CUTE_UNROLL
        for (int v = 0; v < size(tOrO); ++v) tOrO(v) *= o_scale[(v & 1) + 2 * ((v >> 2) & 1)];
      }
      // P^T as e4m3 bytes: row = query row, column = pt_column(token).
      const uint32_t pt_base = smem_addr(plan.p[wg]) + uint32_t(parity * Tr::kPtBytes);
      CUTE_UNROLL
      for (int v = 0; v < 8; ++v) {
        const int cidx = (v & 1) + 2 * (v >> 2);
        const float pv = exp2f(fmaf(tSrS(v), scale_log2, -base[cidx]));
        l_part[cidx] += pv;
        const uint32_t byte = __nv_cvt_float_to_fp8(pv, __NV_SATFINITE, __NV_E4M3);
        asm volatile("st.shared.u8 [%0], %1;\n" ::"r"(pt_base + uint32_t(layout_pt(col_of(cidx), pt_column(token_of(v))))),
                     "r"(byte)
                     : "memory");
      }
      fence_proxy_async_smem();
      named_barrier_sync(NamedBarriers(int(NamedBarriers::kNarrowP0) + wg), 128);

      Tensor sPt = make_tensor(make_smem_ptr(plan.p[wg] + parity * Tr::kPtBytes), typename Tr::SmemLayoutPt{});
      Tensor tOrPt = thr_o.partition_fragment_B(sPt);  // (MMA, 1, 2)
      warpgroup_fence_operand(tOrVw);
      warpgroup_fence_operand(tOrO);
      warpgroup_arrive();
      wgmma_k_steps(mma_o, tOrV, tOrPt, tOrO, !first);
      warpgroup_commit_batch();
      // Retired before the next page rebuilds tOrV (ptxas serializes WGMMAs
      // around a wait_group carried across the loop, C7514).
      warpgroup_wait<0>();
      warpgroup_fence_operand(tOrO);
      warpgroup_fence_operand(tOrVw);
    }
    it += num_pages;
    epilogue_narrow(p, plan, c, head_k, wg, tid, num_pages > wg, m_ref, l_part, tOrO, logit_scale, scale_log2,
                    out_scale);
  });
}

// Merges the two WGs' partial results of a chunk and writes out / lse or the
// split partials (the layout of epilogue.cuh). WG w keeps O^T channels
// 256 w .. 256 w + 255 and hands the other half to the other WG through the
// (here unused) V^T tiles; both compute the same merged column statistics.
template <config::KvFormat kFormat>
template <class FragO>
__device__ void SplitKvMlaKernel<kFormat>::epilogue_narrow(const DecodeParams& p, Plan& plan, const Chunk& c,
                                                          int head_k, int wg, int tid, bool has_pages,
                                                          const float (&m_ref)[4], const float (&l_part)[4],
                                                          FragO& tOrO, float logit_scale, float scale_log2,
                                                          float out_scale) {
  constexpr int kRows = Tr::kNarrowRows;
  constexpr int kOwnBlocks = decode_cfg::kHeadDimV / 64 / decode_cfg::kNumConsumerWGs;  // 4 of the 8 m64 blocks
  constexpr int kOwnValues = 8 * kOwnBlocks;
  const int warp = tid / 32, lane = tid % 32;
  auto col_of = [&](int k4) { return 2 * (lane % 4) + (k4 & 1) + 8 * (k4 >> 1); };
  struct Exchange {
    float o[decode_cfg::kNumConsumerWGs][kOwnValues][128];  // [from WG][value][thread]
    float l[decode_cfg::kNumConsumerWGs][4][kRows];         // [WG][warp][query row]
    float m[decode_cfg::kNumConsumerWGs][kRows];
  };
  static_assert(sizeof(Exchange) <= sizeof(plan.vt), "the exchange fits the V^T tiles");
  Exchange& x = *reinterpret_cast<Exchange*>(plan.vt);
  CUTE_UNROLL
  for (int k4 = 0; k4 < 4; ++k4) {
    float l = l_part[k4];
    l += __shfl_xor_sync(0xffffffffu, l, 4);
    l += __shfl_xor_sync(0xffffffffu, l, 8);
    l += __shfl_xor_sync(0xffffffffu, l, 16);
    if (lane < 4) x.l[wg][warp][col_of(k4)] = has_pages ? l : 0.f;
    if (warp == 0 && lane < 4) x.m[wg][col_of(k4)] = has_pages ? m_ref[k4] : -INFINITY;
  }
  // Value v of channel block b is tOrO(v + 8 b) of the (MMA, 8, 1) fragment;
  // WG w keeps blocks 4 w .. 4 w + 3 and gives the others. (Selected with
  // static indices: indexing by wg put the fragment in local memory.)
  auto own_value = [&](int j, int v) { return wg == 0 ? tOrO(v + 8 * j) : tOrO(v + 8 * (kOwnBlocks + j)); };
  auto given_value = [&](int j, int v) { return wg == 0 ? tOrO(v + 8 * (kOwnBlocks + j)) : tOrO(v + 8 * j); };
  CUTE_UNROLL
  for (int j = 0; j < kOwnBlocks; ++j) {
    CUTE_UNROLL
    for (int v = 0; v < 8; ++v) x.o[wg][8 * j + v][tid] = has_pages ? given_value(j, v) : 0.f;
  }
  named_barrier_sync(NamedBarriers::kSumReady, kConsumers);

  float inv[4], lse[4], a_own[4], a_other[4];
  bool seen[4];
  const int split_begin = p.num_splits[c.batch];
  const bool direct = p.num_splits[c.batch + 1] - split_begin == 1;
  CUTE_UNROLL
  for (int k4 = 0; k4 < 4; ++k4) {
    const int col = col_of(k4);
    const float m_own = x.m[wg][col], m_other = x.m[1 - wg][col];
    const float m = fmaxf(m_own, m_other);
    a_own[k4] = m_own == -INFINITY ? 0.f : exp2f((m_own - m) * scale_log2);
    a_other[k4] = m_other == -INFINITY ? 0.f : exp2f((m_other - m) * scale_log2);
    float l_own = 0.f, l_other = 0.f;
    CUTE_UNROLL
    for (int w = 0; w < 4; ++w) {
      l_own += x.l[wg][w][col];
      l_other += x.l[1 - wg][w][col];
    }
    const float l = l_own * a_own[k4] + l_other * a_other[k4];
    seen[k4] = l > 0.f;
    inv[k4] = seen[k4] ? out_scale / l : 0.f;
    lse[k4] = seen[k4] ? m * logit_scale + logf(l) : (direct ? INFINITY : -INFINITY);
  }
  const int64_t accum_row0 =
      (int64_t(split_begin + c.split_idx) * p.num_heads_k + head_k) * p.q_rows_per_head_k;
  CUTE_UNROLL
  for (int k4 = 0; k4 < 4; ++k4) {
    const int r = col_of(k4);
    if (r >= p.q_rows_per_head_k) continue;
    const int s = r / p.heads_per_head_k;
    const int hq = head_k * p.heads_per_head_k + r % p.heads_per_head_k;
    CUTE_UNROLL
    for (int j = 0; j < kOwnBlocks; ++j) {
      const int block = kOwnBlocks * wg + j;
      const int ch = 64 * block + 16 * warp + 2 * (lane / 4);  // and ch + 1 (row half 1)
      float o[2];
      CUTE_UNROLL
      for (int h = 0; h < 2; ++h) {
        const int v = (k4 & 1) + 4 * (k4 >> 1) + 2 * h;
        // Select, not multiply: a WG without pages never wrote its O^T.
        const float own = a_own[k4] > 0.f ? own_value(j, v) * a_own[k4] : 0.f;
        const float other = a_other[k4] > 0.f ? x.o[1 - wg][8 * j + v][tid] * a_other[k4] : 0.f;
        o[h] = (own + other) * inv[k4];
      }
      if (direct) {
        __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out) + c.batch * p.out_batch_stride +
                             s * p.out_seq_stride + hq * p.out_head_stride;
        *reinterpret_cast<__nv_bfloat162*>(out + ch) = __floats2bfloat162_rn(o[0], o[1]);
      } else {
        *reinterpret_cast<float2*>(p.o_accum + (accum_row0 + r) * config::kHeadDimV + ch) = make_float2(o[0], o[1]);
      }
    }
    if (wg == 0 && warp == 0 && lane < 4) {
      if (direct) {
        p.lse[(int64_t(c.batch) * p.num_heads_q + hq) * p.seqlen_q + s] = lse[k4];
      } else {
        p.lse_accum[accum_row0 + r] = lse[k4];
      }
    }
  }
}

}  // namespace jax_flash_mla::sm90
