// The FP8 formats' consumer for few query rows (q_rows_per_head_k <= 16: h_q 16 with s_q
// 1, or fewer heads): the transposed problem, with the page's tokens and V's
// channels as the WGMMA's 64 rows instead of 16 query rows padded to 64.
// Member definitions of SplitKvMlaKernel<kFormat, kNarrow> (splitkv_mla.cuh),
// which includes this file after the class; not a standalone header.
#pragma once

namespace jax_flash_mla::sm90 {

// Per page, one warpgroup does all of it (the two WGs take alternate pages of
// a chunk, each with its own running maxima, row sums and O^T; they merge once
// at the chunk's end, so no page waits for the other WG):
//   S^T = K Q^T      m64 (tokens) n16 (query rows), operands from shared memory
//                    as loaded (K slot and Q, K-major): a quarter of the tensor
//                    work of the 64-row tile. fp8_ds_mla: the RoPE part as a
//                    bf16 WGMMA and one T_g^T per 128-channel group, promoted
//                    by k_scale[token, g], which is per accumulator row here
//                    (2 tokens x 4 groups of scales per thread).
//   P^T              softmax down S^T's columns: a column's 64 tokens lie in
//                    8 lanes x 2 values of each of the 4 warps (3 xor-shuffles,
//                    then one shared-memory exchange per WG and page); P goes
//                    to shared memory as e4m3 bytes, 16 rows x 64 tokens
//                    (fp8_ds_mla: one tile per group, scaled by k_scale *
//                    kPNormalizer / N_g as in consumer_ds).
//   O^T += V^T P^T   m64 (channels) n16, 8 channel blocks: 2 k-steps of RS
//                    WGMMA, V^T the A operand from registers, built straight
//                    from the K slot by ldmatrix.trans + PRMT (no V^T tile, no
//                    stmatrix, no proxy fence for it), so the slot is released
//                    as soon as S^T retired.
// The A fragment (PTX ISA register fragment of m64nNk32 .e4m3, CuTe's
// ALayout_64x32): a0 = row r = lane / 4 of the warp's 16 rows, k 4q..4q+3
// (q = lane % 4); a1 = row r + 8; a2, a3 = the same at k + 16. ldmatrix.trans
// of 8 tokens x 8 b16 (16 channel bytes) gives lane i channels c, c + 1
// (c = 2 (i / 4)) of tokens 2q, 2q + 1 in one register, so two PRMT per pair
// of matrices give channel c's bytes of tokens 2q, 2q+1, 2q+8, 2q+9 (p_column
// order, fp8_smem.h) and channel c + 1's. Row r of the warp's 16 A rows is
// thus channel 2r of its 16 channels and row r + 8 channel 2r + 1: thread
// (warp, lane) holds O^T of channels 16 warp + 2 (lane / 4) + {0, 1} of each
// 64-channel block, adjacent, for query rows 2q + {0, 1} and 2q + 8 + {0, 1}.
// P^T's columns follow p_column too (P V sums over tokens, so any order both
// agree on works). scripts/emulate_vt_transpose.py (run_narrow) replays these
// lane mappings on the host.
// Value v of an m64n16 accumulator fragment (CuTe's CLayout_64x16): row
// (token or channel) half (v >> 1) & 1, column (query row)
// 2 (lane % 4) + (v & 1) + 8 (v >> 2). A thread's four query rows go by the
// column index k4 = (v & 1) + 2 (v >> 2); scripts/emulate_vt_transpose.py
// (run_narrow) checks these against CuTe's layout.
struct NarrowFragment {
  __device__ __forceinline__ static int column(int lane, int k4) { return 2 * (lane % 4) + (k4 & 1) + 8 * (k4 >> 1); }
  __device__ __forceinline__ static int column_index(int v) { return (v & 1) + 2 * ((v >> 2) & 1); }
  __device__ __forceinline__ static int value(int k4, int half) { return (k4 & 1) + 4 * (k4 >> 1) + 2 * half; }
};

template <config::KvFormat kFormat, bool kNarrow>
__device__ void SplitKvMlaKernel<kFormat, kNarrow>::consumer_narrow(const SplitKvArgs& args, Plan& plan,
                                                                   const SchedMeta& meta, int head_k, int wg,
                                                                   int tid) {
  using namespace cute;
  constexpr int kRows = narrow_cfg::kRows;
  constexpr bool kGroups = Tr::kScaleGroups;    // fp8_ds_mla
  constexpr int kChannelBlocks = decode_cfg::kHeadDimV / 64;  // 8 m64 blocks of O^T
  static_assert(Tr::kNarrowRows == kRows, "one n16 column block of query rows");
  const DecodeParams& p = args.params;
  typename Tr::TiledMmaS mma_s;
  typename Tr::TiledMmaO mma_o;
  auto thr_s = mma_s.get_thread_slice(tid);
  auto thr_o = mma_o.get_thread_slice(tid);
  const int ctid = wg * 128 + tid;
  const int warp = tid / 32, lane = tid % 32;

  // fp8_per_tensor: logits are softmax_scale * descale_q * descale_k * q.k and
  // the output carries descale_k. fp8_ds_mla: the scores are q.k already.
  float out_scale = 1.f, descale_qk = 1.f;
  if constexpr (Tr::kUsesDescale) {
    out_scale = __ldg(p.descale_k);
    descale_qk = __ldg(p.descale_q) * out_scale;
  }
  const float logit_scale = p.softmax_scale * descale_qk;
  const float scale_log2 = p.softmax_scale_log2 * descale_qk;

  // Q's first 16 rows as the B operand of the NoPE / whole-576 S^T.
  Tensor sQ = make_tensor(make_smem_ptr(plan.q), typename Tr::SmemLayoutQ{});
  constexpr int kQChannels = decltype(size<1>(sQ))::value;  // 576, or fp8_ds_mla's 512 NoPE
  Tensor tSrQ = thr_s.partition_fragment_B(
      local_tile(sQ, Shape<Int<kRows>, Int<kQChannels>>{}, make_coord(0, 0)));  // (MMA, 1, k-steps)
  constexpr int kSteps = decltype(size<2>(tSrQ))::value;  // 18 (576 / k 32), or 16 (fp8_ds_mla's NoPE)
  Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<kBlockN>, Int<kRows>>{});  // 8 values
  // V^T A fragments, (16 e4m3, 8 channel blocks, 2 k-steps), column-major, so
  // word j + 4 (block + 8 k-step) of its uint32 view is register a_j.
  Tensor tOrV = make_tensor<Element>(Layout<Shape<Shape<_4, _2, _2>, Int<kChannelBlocks>, _2>>{});
  Tensor tOrVw = recast<uint32_t>(tOrV);
  Tensor tOrO = partition_fragment_C(mma_o, Shape<Int<decode_cfg::kHeadDimV>, Int<kRows>>{});  // (MMA, 8, 1)
  static_assert(size(tSrS) == 8 && size(tOrO) == 8 * kChannelBlocks, "m64n16 fragments: 8 values per block");

  // This thread's four query rows (NarrowFragment).
  auto col_of = [&](int k4) { return NarrowFragment::column(lane, k4); };
  auto col_index = [](int v) { return NarrowFragment::column_index(v); };
  auto value_of = [](int k4, int half) { return NarrowFragment::value(k4, half); };
  // Token of value v within the page, and its P^T column (p_column order).
  auto token_of = [&](int v) { return 16 * warp + lane / 4 + 8 * ((v >> 1) & 1); };
  auto pt_column = [](int t) {
    const int u = t % 16;
    return 16 * (t / 16) + 4 * ((u % 8) / 2) + 2 * (u / 8) + u % 2;
  };

  const typename Tr::SmemLayoutK layout_k{};
  const typename Tr::SmemLayoutPt layout_pt{};
  const uint32_t zero_row = smem_addr(plan.zeros);

  int it = 0;  // ring position of the chunk's first page (both WGs count every page)
  // Phase bit per stage of this WG's own k_full set: the WG waits on every
  // fill of that set in order, so a bit per stage is its whole state. (With
  // one set for both WGs, a WG waiting on the slot's fill after next saw the
  // parity of the previous one when the other WG's fill between them had not
  // landed yet: with 3 stages every second use of a slot was such a wait.)
  uint32_t full_phase_bits = 0;
  for_each_chunk(p, meta, [&](const Chunk& c) {
    if constexpr (kGroups) {
      load_q_ds(args, plan, c.batch, head_k, 0, ctid, 0);
    } else {
      load_q(p, plan, c.batch, head_k, 0, ctid);
    }
    float m_ref[4], l_part[4];
    int limit[4];
    int min_limit = c.end_token;
    CUTE_UNROLL
    for (int k4 = 0; k4 < 4; ++k4) {
      m_ref[k4] = -INFINITY;
      l_part[k4] = 0.f;
      limit[k4] = c.end_token;
      if (p.causal) limit[k4] = min(limit[k4], c.seqlen - p.seqlen_q + 1 + col_of(k4) / p.heads_per_head_k);
      min_limit = min(min_limit, limit[k4]);
    }
    // fp8_ds_mla: running per-group normalizer N_g of this WG's pages (O_g^T
    // holds the true O_g^T * kPNormalizer / N_g, as in consumer_ds).
    float norm[4] = {0.f, 0.f, 0.f, 0.f};
    const int page_begin = c.first_page();
    const int num_pages = c.end_page() - page_begin;
    for (int k = wg; k < num_pages; k += decode_cfg::kNumConsumerWGs) {
      const int i = it + k;
      const int stage = i % Tr::kNumStages;
      const uint32_t phase = (full_phase_bits >> stage) & 1u;
      full_phase_bits ^= 1u << stage;
      const int parity = (k / decode_cfg::kNumConsumerWGs) & 1;
      const int page = page_begin + k;
      const int valid = c.end_token - page * kBlockN;  // tokens of the page inside the chunk
      const uint32_t slot = smem_addr(plan.k[stage]);

      // ---- S^T (fp8_ds_mla: RoPE into S^T, group g into T_g^T), one batch.
      Tensor sK = make_tensor(make_smem_ptr(plan.k[stage]), typename Tr::SmemLayoutK{});
      Tensor tSrK = thr_s.partition_fragment_A(sK);  // (MMA, 1, k-steps)
      // fp8_ds_mla: T_g^T for the four groups side by side, (MMA, 1, 4) as an N = 64 tile.
      Tensor tSrT = partition_fragment_C(mma_s, Shape<Int<kBlockN>, Int<kRows * 4>>{});
      if constexpr (kGroups) {
        using Rope = typename Tr::ElementRope;
        typename Tr::TiledMmaRope mma_rope;
        auto thr_rope = mma_rope.get_thread_slice(tid);
        Tensor sKR = make_tensor(make_smem_ptr(reinterpret_cast<Rope*>(plan.k[stage] + Tr::kRopeOffset)),
                                 typename Tr::SmemLayoutKRope{});
        Tensor sQR = make_tensor(make_smem_ptr(plan.q_rope), typename Tr::SmemLayoutQRope{});
        Tensor tSrKR = thr_rope.partition_fragment_A(sKR);  // (MMA, 1, 4)
        Tensor tSrQR = thr_rope.partition_fragment_B(
            local_tile(sQR, Shape<Int<kRows>, Int<Tr::kHeadDimRope>>{}, make_coord(0, 0)));
        warpgroup_fence_operand(tSrS);
        warpgroup_fence_operand(tSrT);
        mbarrier_wait(&plan.k_full[wg][stage], phase);
        warpgroup_arrive();
        wgmma_k_steps(mma_rope, tSrKR, tSrQR, tSrS, false);
        constexpr int kGroupSteps = Tr::kGroupChannels / 32;
        CUTE_UNROLL
        for (int g = 0; g < Tr::kNumGroups; ++g) {
          Tensor tSrTg = tSrT(_, _, g);  // (MMA, 1) -> (MMA, 1, 1)
          Tensor tSrTg3 = make_tensor(tSrTg.data(), append<3>(tSrTg.layout(), Layout<_1, _0>{}));
          wgmma_k_steps<kGroupSteps>(mma_s, tSrK, tSrQ, tSrTg3, false, g * kGroupSteps);
        }
        warpgroup_commit_batch();
      } else {
        // The left part's k-steps while the right part may still land.
        constexpr int kLeftSteps = kSteps * decode_cfg::kLeftSlabs / decode_cfg::kSlabs;
        warpgroup_fence_operand(tSrS);
        mbarrier_wait(&plan.k_full[wg][stage][0], phase);
        warpgroup_arrive();
        wgmma_k_steps<kLeftSteps>(mma_s, tSrK, tSrQ, tSrS, false);
        mbarrier_wait(&plan.k_full[wg][stage][1], phase);
        warpgroup_arrive();  // after the wait loop's branch, or ptxas serializes (C7520)
        wgmma_k_steps<kSteps - kLeftSteps>(mma_s, tSrK, tSrQ, tSrS, true, kLeftSteps);
        warpgroup_commit_batch();
      }

      // ---- V^T fragments while S^T runs (the last page's O^T WGMMAs,
      // which read these registers, retired at its end). Tokens past the chunk
      // read the zero row: their slots may hold NaN, and 0 * NaN = NaN in P V.
      CUTE_UNROLL
      for (int ks = 0; ks < 2; ++ks) {
        const int token = 32 * ks + lane;  // ldmatrix.x4: lane i addresses row i % 8 of matrix i / 8
        CUTE_UNROLL
        for (int mb = 0; mb < kChannelBlocks; ++mb) {
          const uint32_t src = token < valid ? slot + uint32_t(layout_k(token, 64 * mb + 16 * warp)) : zero_row;
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

      // ---- fp8_ds_mla: this thread's two tokens' scales (0 past the chunk:
      // P would compute 0 * NaN) and the page's largest scale per group over
      // its valid tokens (each warp reduces all 64, as in consumer_ds).
      float tok_scales[2][4];  // [row half][group]
      float shrink[4] = {1.f, 1.f, 1.f, 1.f};
      if constexpr (kGroups) {
        CUTE_UNROLL
        for (int h = 0; h < 2; ++h) {
          const float4 x = ds_token_scales(slot, 16 * warp + lane / 4 + 8 * h, valid);
          tok_scales[h][0] = x.x;
          tok_scales[h][1] = x.y;
          tok_scales[h][2] = x.z;
          tok_scales[h][3] = x.w;
        }
        float n[4];
        ds_page_scale_max(slot, lane, valid, n);
        CUTE_UNROLL
        for (int g = 0; g < 4; ++g) {
          const float grown = fmaxf(norm[g], n[g]);
          // Exact for power-of-two scales (1 ulp otherwise), exactly 1 for an unchanged N_g; unused on the WG's
          // first page.
          shrink[g] = grown == norm[g] ? 1.f : norm[g] * rcp_ftz(grown);
          norm[g] = grown;
        }
      }
      warpgroup_wait<0>();
      warpgroup_fence_operand(tSrS);
      if constexpr (kGroups) warpgroup_fence_operand(tSrT);
      // S^T retired, V^T and the scales are in registers: the slot's last
      // reads by this WG, its only reader (k_empty counts its 4 warps).
      __syncwarp();
      if constexpr (kGroups) {
        mbarrier_arrive_if(&plan.k_empty[stage], lane == 0);
        // S^T = qs[row] * (RoPE' part + sum_g k_scale[t, g] * T_g^T).
        float qs[4];
        CUTE_UNROLL
        for (int k4 = 0; k4 < 4; ++k4) qs[k4] = plan.q_scale[col_of(k4)];
        CUTE_UNROLL
        for (int v = 0; v < 8; ++v) {
          float s = tSrS(v);
          CUTE_UNROLL
          for (int g = 0; g < 4; ++g) s = fmaf(tok_scales[(v >> 1) & 1][g], tSrT(v + 8 * g), s);
          tSrS(v) = s * qs[col_index(v)];
        }
      } else {
        mbarrier_arrive_if(&plan.k_empty[stage][0], lane == 0);
        mbarrier_arrive_if(&plan.k_empty[stage][1], lane == 0);
      }

      // ---- Mask by selection (slots past the sequence may hold NaN scores).
      if (page * kBlockN + kBlockN > min_limit) {
        CUTE_UNROLL
        for (int v = 0; v < 8; ++v) {
          if (page * kBlockN + token_of(v) >= limit[col_index(v)]) tSrS(v) = -INFINITY;
        }
      }
      // ---- Column maxima over the page: two tokens per thread, 8 lanes, 4 warps.
      float page_max[4];
      {
        float(*xmax)[kRows] = plan.col_max[wg][parity];
        CUTE_UNROLL
        for (int k4 = 0; k4 < 4; ++k4) {
          float m = fmaxf(tSrS(value_of(k4, 0)), tSrS(value_of(k4, 1)));
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 4));
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 8));
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
          page_max[k4] = m;
          if (lane < 4) xmax[warp][col_of(k4)] = m;
        }
        named_barrier_sync(wg_barrier(NamedBarriers::kNarrowMax0, wg), 128);
        CUTE_UNROLL
        for (int k4 = 0; k4 < 4; ++k4) {
          CUTE_UNROLL
          for (int w = 0; w < 4; ++w) page_max[k4] = fmaxf(page_max[k4], xmax[w][col_of(k4)]);
        }
      }
      // ---- Lazy online softmax per column (softmax.h's move_reference).
      float o_scale[4], base[4];
      bool rescale = false;
      CUTE_UNROLL
      for (int k4 = 0; k4 < 4; ++k4) {
        o_scale[k4] = move_reference<Tr::kLazyRescaleLog2>(m_ref[k4], page_max[k4], scale_log2, base[k4]);
        l_part[k4] *= o_scale[k4];
        rescale |= o_scale[k4] != 1.f;
      }
      CUTE_UNROLL
      for (int g = 0; g < 4; ++g) rescale |= shrink[g] != 1.f;
      const bool first = k == wg;  // this WG's first page of the chunk: O^T is written, not accumulated
      if (!first && rescale) {
        CUTE_UNROLL
        for (int v = 0; v < size(tOrO); ++v) {
          const int group = v / 16;  // channel blocks 2g, 2g + 1 (fp8_ds_mla)
          tOrO(v) *= o_scale[col_index(v)] * (kGroups ? shrink[group] : 1.f);
        }
      }
      // ---- P^T as e4m3 bytes: row = query row, column = pt_column(token);
      // fp8_ds_mla: one tile per group, P_g = p * k_scale[t, g] * kPNormalizer / N_g.
      float p_of[8];
      CUTE_UNROLL
      for (int v = 0; v < 8; ++v) {
        p_of[v] = exp2_ftz(fmaf(tSrS(v), scale_log2, -base[col_index(v)]));
        l_part[col_index(v)] += p_of[v];
      }
      auto store_pt = [&](uint32_t tile, auto scale_of) {
        CUTE_UNROLL
        for (int v = 0; v < 8; ++v) {
          const uint32_t byte = __nv_cvt_float_to_fp8(p_of[v] * scale_of(v), __NV_SATFINITE, __NV_E4M3);
          asm volatile("st.shared.u8 [%0], %1;\n" ::"r"(tile + uint32_t(layout_pt(col_of(col_index(v)),
                                                                                   pt_column(token_of(v))))),
                       "r"(byte)
                       : "memory");
        }
      };
      if constexpr (kGroups) {
        CUTE_UNROLL
        for (int g = 0; g < 4; ++g) {
          const float f = Tr::kPNormalizer * rcp_ftz(norm[g]);  // exact for a power-of-two N_g, else within 1 ulp
          store_pt(smem_addr(plan.p[wg][g][parity]), [&](int v) { return tok_scales[(v >> 1) & 1][g] * f; });
        }
      } else {
        store_pt(smem_addr(plan.p[wg][parity]), [](int) { return 1.f; });
      }
      fence_proxy_async_smem();
      named_barrier_sync(wg_barrier(NamedBarriers::kNarrowP0, wg), 128);

      // ---- O^T (+)= V^T P^T: channel block mb with its group's P^T tile.
      auto pt_tile = [&](int mb) {
        Element* base_ptr;
        if constexpr (kGroups) {
          base_ptr = plan.p[wg][mb / 2][parity];
        } else {
          base_ptr = plan.p[wg][parity];
        }
        return thr_o.partition_fragment_B(make_tensor(make_smem_ptr(base_ptr), typename Tr::SmemLayoutPt{}));
      };
      warpgroup_fence_operand(tOrVw);
      warpgroup_fence_operand(tOrO);
      warpgroup_arrive();
      CUTE_UNROLL
      for (int ks = 0; ks < 2; ++ks) {
        mma_o.accumulate_ = (ks > 0 || !first) ? GMMA::ScaleOut::One : GMMA::ScaleOut::Zero;
        CUTE_UNROLL
        for (int mb = 0; mb < kChannelBlocks; ++mb) {
          Tensor tOrOmb = tOrO(_, mb, 0);
          cute::gemm(mma_o, tOrV(_, mb, ks), pt_tile(mb)(_, 0, ks), tOrOmb);  // one m64n16k32 WGMMA
        }
      }
      warpgroup_commit_batch();
      // Retired before the next page rebuilds tOrV (ptxas serializes WGMMAs
      // around a wait_group carried across the loop, C7514).
      warpgroup_wait<0>();
      warpgroup_fence_operand(tOrO);
      warpgroup_fence_operand(tOrVw);
    }
    // With an odd page count WG1 took one page less: it passes that page's two
    // per-WG barriers here, so both WGs pass as many barriers per chunk.
    // Nothing needs it but compute-sanitizer's racecheck, which reports the
    // exchange below as a hazard when the counts differ (scripts/racecheck_probe.cu,
    // case 5 against 7).
    if (wg == 1 && (num_pages & 1)) {
      named_barrier_sync(wg_barrier(NamedBarriers::kNarrowMax0, 1), 128);
      named_barrier_sync(wg_barrier(NamedBarriers::kNarrowP0, 1), 128);
    }
    it += num_pages;
    if constexpr (kGroups) {
      // O_g^T * N_g / kPNormalizer: the true O_g^T before the WGs merge.
      CUTE_UNROLL
      for (int v = 0; v < size(tOrO); ++v) tOrO(v) *= norm[v / 16] * (1.f / Tr::kPNormalizer);
    }
    epilogue_narrow(p, plan, c, head_k, wg, tid, num_pages > wg, m_ref, l_part, tOrO, logit_scale, scale_log2,
                    out_scale);
  });
}

// Merges the two WGs' partial results of a chunk and writes out / lse or the
// split partials (the layout of epilogue.cuh). WG w keeps O^T channels
// 256 w .. 256 w + 255 and hands the other half to the other WG; both compute
// the same merged column statistics.
template <config::KvFormat kFormat, bool kNarrow>
template <class FragO>
__device__ void SplitKvMlaKernel<kFormat, kNarrow>::epilogue_narrow(const DecodeParams& p, Plan& plan,
                                                                   const Chunk& c, int head_k, int wg,
                                                                   int tid, bool has_pages, const float (&m_ref)[4],
                                                                   const float (&l_part)[4], FragO& tOrO,
                                                                   float logit_scale, float scale_log2,
                                                                   float out_scale) {
  constexpr int kOwnBlocks = decode_cfg::kHeadDimV / 64 / decode_cfg::kNumConsumerWGs;  // 4 of the 8 m64 blocks
  const int warp = tid / 32, lane = tid % 32;
  auto col_of = [&](int k4) { return NarrowFragment::column(lane, k4); };
  narrow_cfg::Exchange& x = plan.exchange;
  static_assert(sizeof(x.o[0]) / sizeof(x.o[0][0]) == 8 * kOwnBlocks, "a thread gives 8 values per block");
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
  const int split_begin = p.num_splits[c.batch];
  const bool direct = p.num_splits[c.batch + 1] - split_begin == 1;
  CUTE_UNROLL
  for (int k4 = 0; k4 < 4; ++k4) {
    const int col = col_of(k4);
    const float m_own = x.m[wg][col], m_other = x.m[1 - wg][col];
    const float m = fmaxf(m_own, m_other);
    a_own[k4] = m_own == -INFINITY ? 0.f : exp2_ftz((m_own - m) * scale_log2);
    a_other[k4] = m_other == -INFINITY ? 0.f : exp2_ftz((m_other - m) * scale_log2);
    float l_own = 0.f, l_other = 0.f;
    CUTE_UNROLL
    for (int w = 0; w < 4; ++w) {
      l_own += x.l[wg][w][col];
      l_other += x.l[1 - wg][w][col];
    }
    const float l = l_own * a_own[k4] + l_other * a_other[k4];
    // No visible key: out 0, lse +inf for a final result, -inf for a partial
    // that the combine must ignore (params.h).
    inv[k4] = l > 0.f ? out_scale / l : 0.f;
    lse[k4] = l > 0.f ? m * logit_scale + logf(l) : (direct ? INFINITY : -INFINITY);
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
      // Channels ch, ch + 1 (row halves 0, 1): written as pairs.
      const int ch = 64 * (kOwnBlocks * wg + j) + 16 * warp + 2 * (lane / 4);
      float o[2];
      CUTE_UNROLL
      for (int h = 0; h < 2; ++h) {
        const int v = NarrowFragment::value(k4, h);
        // Select, not multiply: a WG without pages never wrote its O^T.
        const float own = a_own[k4] > 0.f ? own_value(j, v) * a_own[k4] : 0.f;
        const float other = a_other[k4] > 0.f ? x.o[1 - wg][8 * j + v][tid] * a_other[k4] : 0.f;
        o[h] = (own + other) * inv[k4];
      }
      __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out) + c.batch * p.out_batch_stride +
                           s * p.out_seq_stride + hq * p.out_head_stride + ch;
      float* accum = p.o_accum + (accum_row0 + r) * config::kHeadDimV + ch;
      if (direct) {
        *reinterpret_cast<__nv_bfloat162*>(out) = __floats2bfloat162_rn(o[0], o[1]);
      } else {
        *reinterpret_cast<float2*>(accum) = make_float2(o[0], o[1]);
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
  // The next chunk's epilogue rewrites the exchange. kQReady (load_q)
  // already lies between, but racecheck reported these reads against those
  // writes (session 8); a barrier right after the reads orders them directly.
  named_barrier_sync(NamedBarriers::kExchangeRead, kConsumers);
}

}  // namespace jax_flash_mla::sm90
