// The bf16 / fp8_per_tensor consumer: page pairs split between the two consumer warpgroups.
// Member definitions of SplitKvMlaKernel<kFormat, kNarrow> (splitkv_mla.cuh), which
// includes this file after the class; not a standalone header.
#pragma once

namespace jax_flash_mla::sm90 {

// bf16 and fp8_per_tensor. Pages go in pairs (A, B) (B absent at the odd
// end of a chunk). WG0 computes S_A and the softmax of A, WG1 those of B;
// each WG accumulates both pages into its half of O. The running row max
// is chained through shared memory: m_A = max(m, rowmax S_A) by WG0,
// m_B = max(m_A, rowmax S_B) by WG1, so both P tiles of a pair share one
// reference m_B once each WG rescaled its O:
//   WG0: O_L = (O_L e^(m-m_A) + P_A V_A,L) e^(m_A-m_B) + P_B V_B,L
//   WG1: O_R = (O_R e^(m-m_A) + P_A V_A,R) e^(m_A-m_B) + P_B V_B,R
// The WGs thus run half a step apart ("seesaw"): while one runs its
// softmax, the tensor cores work on the other's WGMMAs. Per pair:
//   WG0: S_A -> softmax A, publish P_A, m_A (kPageAReady) -> P_A V_A,L
//        -> [kPageBReady] -> rescale -> P_B V_B,L
//   WG1: S_B -> [kPageAReady] -> rescale -> P_A V_A,R, softmax B (a
//        register copy of S_B, as an accumulator written by other
//        instructions while a WGMMA is in flight makes ptxas serialize
//        every WGMMA, C7515; bf16 issues P_A V_A,R's k-steps half before
//        and half after it) -> retire -> publish P_B, m_B (kPageBReady)
//        -> rescale -> P_B V_B,R (bf16 publishes P_B, which has a tile of
//        its own, before the retire)
// WG w hands back part w of both slots (the left part holds V_L, the
// right one V_R and RoPE); the other WG's reads of that part (its S) have
// retired before the pair's ready barrier it passed.
template <config::KvFormat kFormat, bool kNarrow>
__device__ void SplitKvMlaKernel<kFormat, kNarrow>::consumer(const SplitKvArgs& args, Plan& plan,
                                                            const SchedMeta& meta, int head_k, int m_block, int wg,
                                                            int tid) {
  using namespace cute;
  const DecodeParams& p = args.params;
  typename Tr::TiledMmaQK mma_qk;
  typename Tr::TiledMmaPV mma_pv;
  auto thr_qk = mma_qk.get_thread_slice(tid);
  auto thr_pv = mma_pv.get_thread_slice(tid);
  const int ctid = wg * 128 + tid;
  const int lane = tid % 32;
  // fp8_per_tensor: logits are softmax_scale * descale_q * descale_k * q.k
  // and the output carries descale_k (V shares K's scale). Read once per
  // CTA from device memory.
  float descale_qk = 1.f, out_scale = 1.f;
  if constexpr (Tr::kUsesDescale) {
    out_scale = __ldg(p.descale_k);
    descale_qk = __ldg(p.descale_q) * out_scale;
  }
  const float logit_scale = Tr::kUsesDescale ? p.softmax_scale * descale_qk : p.softmax_scale;
  const float scale_log2 = Tr::kUsesDescale ? p.softmax_scale_log2 * descale_qk : p.softmax_scale_log2;

  Tensor sQ = make_tensor(make_smem_ptr(plan.q), typename Tr::SmemLayoutQ{});
  Tensor tSrQ = thr_qk.partition_fragment_A(sQ);  // (MMA, 1, k-steps) descriptors
  Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
  // Design S: the RoPE k-steps' own accumulator (the NoPE one is scaled by k[t] before the two add up).
  Tensor tSrR = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
  Tensor tOrO = partition_fragment_C(mma_pv, Shape<Int<kBlockM>, Int<decode_cfg::kHeadDimVPerWG>>{});
  Tensor tScS = thr_qk.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor tOcO = thr_pv.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<decode_cfg::kHeadDimVPerWG>>{}));
  static_assert(size(tSrS) == kBlockN / 2, "two rows x N/4 columns per thread");
  // The two rows this thread holds (fragment row halves 0 and 1).
  const int rows[2] = {int(get<0>(tScS(0))), int(get<0>(tScS(2)))};
  constexpr int kSteps = decltype(size<2>(tSrQ))::value;
  auto table_of = [](int i) {  // design S: page i's table (traits.h, kTableSlots)
    if constexpr (Tr::kTokenScales) {
      return i % Tr::kTableSlots;
    } else {
      return 0;
    }
  };
  // Design S (Tr::kTokenScales, traits.h): q's row scales (load_q_ds, per chunk), the token factors of a page
  // from its page table, and the running N that this WG's O is in units of (O holds O_true * 16 / n_ref).
  float q_row_scale[2] = {1.f, 1.f};
  float n_ref = 0.f;
  // Value v of an m64n64 fragment is token 8 (v / 4) + 2 (lane % 4) + v % 2: factor kf[2 (v / 4) + v % 2].
  auto kf_of = [](int v) { return 2 * (v / 4) + v % 2; };
  auto load_token_factors = [&](int i, float (&kf)[16]) {
    if constexpr (Tr::kTokenScales) {
      const uint32_t base = smem_addr(&plan.table[table_of(i)].k[0]) + uint32_t(8 * (lane % 4));
      CUTE_UNROLL
      for (int j = 0; j < 8; ++j) {
        asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(kf[2 * j]), "=f"(kf[2 * j + 1]) : "r"(base + 32 * j)
                     : "memory");
      }
    }
  };
  // The scores as they leave the accumulators: S = qs[r] * (k[t] * T + R'), T the NoPE dot product in units of
  // the token's scale and R' the RoPE one with q's RoPE stored divided by qs (load_q_ds).
  auto token_score = [&](float nope, float rope, const float (&kf)[16], int v) {
    return fmaf(nope, kf[kf_of(v)], rope) * q_row_scale[fragment_row_half(v)];
  };
  // Folds page i's running N into this WG's O factor (O's units move from n_ref to N; the row sums, of the
  // unscaled p, keep the row-max factor alone).
  auto adopt_n = [&](int i, float (&factor)[2]) {
    if constexpr (Tr::kTokenScales) {
      const float n = plan.table[table_of(i)].running_n;
      if (n_ref > 0.f && n != n_ref) {
        // __fdividef: exact for the power-of-two scales of the package's quantizer, 2 ulp otherwise, and no
        // IEEE slow-path call (whose calling convention spilled the consumers' registers).
        const float shrink = __fdividef(n_ref, n);
        factor[0] *= shrink;
        factor[1] *= shrink;
      }
      n_ref = n;
    }
  };
  // This warp has read page i's table for the last time.
  auto release_table = [&](int i) {
    if constexpr (Tr::kTokenScales) {
      __syncwarp();
      mbarrier_arrive_if(&plan.table_empty[table_of(i)], lane == 0);
    }
  };

  auto stage_of = [](int i) { return i % Tr::kNumStages; };
  auto phase_of = [](int i) { return uint32_t(i / Tr::kNumStages) & 1u; };
  auto release = [&](int i) {  // this WG's part of page i's slot
    __syncwarp();
    mbarrier_arrive_if(&plan.k_empty[stage_of(i)][wg], lane == 0);
  };
  // The P tile of page i (page_role 0: A, 1: B): the pair's tile of that
  // role, or for bf16's P_A its slot's RoPE slab.
  auto p_tile = [&](int i, int page_role) {
    Element* base;
    if constexpr (Tr::kPInRopeSlab) {
      static_assert(Tr::kNumPTiles == 1, "P_A in the RoPE slab, P_B in the tile");
      base = page_role == 0 ? plan.k[stage_of(i)] + decode_cfg::kHeadDimV * kBlockN : plan.p[0];  // slab 8
    } else {
      base = plan.p[page_role];
    }
    return make_tensor(make_smem_ptr(base), typename Tr::SmemLayoutP{});
  };
  // Page i's slot part `part` is done with by this WG (kPInRopeSlab: WG0's
  // arrivals on the right parts, which hold the RoPE slab).
  auto release_part = [&](int i, int part) {
    __syncwarp();
    mbarrier_arrive_if(&plan.k_empty[stage_of(i)][part], lane == 0);
  };
  // B operand of O_w += P V: this WG's 256 channels of V, from the K slot
  // (bf16, MN-major) or from the page's V^T buffer (e4m3, K-major).
  auto v_operand = [&](int i, int page_role) {
    Element* v_base;
    if constexpr (Tr::kVNeedsTranspose) {
      v_base = plan.vt[page_role];
    } else {
      v_base = plan.k[stage_of(i)];
    }
    Tensor sV = make_tensor(make_smem_ptr(v_base), typename Tr::SmemLayoutV{});
    return thr_pv.partition_fragment_B(
        local_tile(sV, Shape<Int<decode_cfg::kHeadDimVPerWG>, Int<kBlockN>>{}, make_coord(wg, 0)));
  };

  // Page i's part `part` has landed: every piece of it.
  auto wait_part = [&](int i, int part) {
    CUTE_UNROLL
    for (int piece = 0; piece < Tr::kPiecesPerPart; ++piece) {
      mbarrier_wait(&plan.k_full[stage_of(i)][part * Tr::kPiecesPerPart + piece], phase_of(i));
    }
  };
  // S = Q K^T of page i over the 576 channels, issued piece by piece as the
  // slot's pieces land (the left part first, or the right one for a page B
  // with kBRightFirst), so a piece's k-steps run while the next may still be
  // landing. The right part's RoPE slab lands with its first piece.
  // (always_inline: called from three places, it would otherwise become a
  // call, with the accumulators passed through the stack.)
  constexpr int kStepsPerSlab = Tr::kTokenScales ? 1 : kSteps / decode_cfg::kSlabs;
  static_assert(Tr::kTokenScales || kStepsPerSlab * decode_cfg::kSlabs == kSteps, "k-steps per slab");
  constexpr int kPieceSteps = Tr::kSlabsPerBox * kStepsPerSlab;
  constexpr int kRopeStep = (decode_cfg::kSlabs - 1) * kStepsPerSlab;
  auto issue_s = [&](int i, bool right_first) __attribute__((always_inline)) {
    Tensor sK = make_tensor(make_smem_ptr(plan.k[stage_of(i)]), typename Tr::SmemLayoutK{});
    Tensor tSrK = thr_qk.partition_fragment_B(sK);
    warpgroup_fence_operand(tSrS);
    stamp(args, wg, i, event_trace::kSWaitStart);
    if constexpr (Tr::kTokenScales) {
      // Design S: the page whole and prepared (its NoPE shifted where its scales differed), then the 16 NoPE FP8
      // k-steps and the 4 RoPE bf16 k-steps, each into its own accumulator.
      warpgroup_fence_operand(tSrR);
      mbarrier_wait(&plan.k_full[stage_of(i)][0], phase_of(i));
      mbarrier_wait(&plan.k_full[stage_of(i)][1], phase_of(i));
      mbarrier_wait(&plan.prepared[stage_of(i)], phase_of(i));
      warpgroup_arrive();
      wgmma_k_steps(mma_qk, tSrQ, tSrK, tSrS, false);
      typename Tr::TiledMmaQKRope mma_rope;
      auto thr_rope = mma_rope.get_thread_slice(tid);
      Tensor sQR = make_tensor(make_smem_ptr(plan.q_rope), typename Tr::SmemLayoutQRope{});
      Tensor sKR = make_tensor(make_smem_ptr(reinterpret_cast<typename Tr::ElementRope*>(plan.k[stage_of(i)] +
                                                                                          Tr::kRopeOffset)),
                               typename Tr::SmemLayoutKRope{});
      wgmma_k_steps(mma_rope, thr_rope.partition_fragment_A(sQR), thr_rope.partition_fragment_B(sKR), tSrR, false);
      warpgroup_commit_batch();
      return;
    }
    CUTE_UNROLL
    for (int n = 0; n < 2; ++n) {
      const int part = right_first ? 1 - n : n;
      CUTE_UNROLL
      for (int piece = 0; piece < Tr::kPiecesPerPart; ++piece) {
        mbarrier_wait(&plan.k_full[stage_of(i)][part * Tr::kPiecesPerPart + piece], phase_of(i));
        if (piece == Tr::kPiecesPerPart - 1) {
          stamp(args, wg, i, part == 0 ? event_trace::kSLeftLanded : event_trace::kSRightLanded);
        }
        warpgroup_arrive();  // after every wait loop's branch, or ptxas serializes (C7520)
        const int slab = part * decode_cfg::kLeftSlabs + piece * Tr::kSlabsPerBox;
        wgmma_k_steps<kPieceSteps>(mma_qk, tSrQ, tSrK, tSrS, n + piece > 0, slab * kStepsPerSlab);
        if (part == 1 && piece == 0) wgmma_k_steps<kStepsPerSlab>(mma_qk, tSrQ, tSrK, tSrS, true, kRopeStep);
      }
    }
    warpgroup_commit_batch();
  };
  // O_w (+)= P V_w with P from shared memory ...
  auto issue_pv_smem = [&](int i, int page_role, bool accumulate) __attribute__((always_inline)) {
    wgmma_batch(mma_pv, thr_pv.partition_fragment_A(p_tile(i, page_role)), v_operand(i, page_role), tOrO,
                accumulate);
  };
  // ... or with the WG's own P (fp32 probabilities in the S fragment)
  // rounded to bf16 in registers.
  auto issue_pv_regs = [&](const auto& tP, int i, int page_role, bool accumulate) __attribute__((always_inline)) {
    if constexpr (Tr::kOwnPInRegisters) {
      typename Tr::TiledMmaPVRegs mma_pv_regs;
      auto thr_pv_regs = mma_pv_regs.get_thread_slice(tid);
      Tensor tOrP = thr_pv_regs.partition_fragment_A(p_tile(i, page_role));  // registers, (MMA, 1, 4)
      static_assert(decltype(size(tOrP))::value == decltype(size(tP))::value, "P fragment size");
      CUTE_UNROLL
      for (int v = 0; v < size(tOrP); ++v) tOrP(v) = Element(tP(v));
      warpgroup_fence_operand(tOrP);
      wgmma_batch(mma_pv_regs, tOrP, v_operand(i, page_role), tOrO, accumulate);
      warpgroup_fence_operand(tOrP);
    }
  };
  // P (bf16, or e4m3 unscaled: P <= 256 with the lazy rescale) into the
  // page's shared tile, its columns in V^T's token order.
  auto store_p = [&](const auto& tP, int i, int page_role) {
    if constexpr (std::is_same_v<Element, cutlass::bfloat16_t>) {
      // By stmatrix: a thread's two values of row lane / 4 (+ 8 for row half
      // h) and tokens 8j + 2 (lane % 4) + {0, 1}, packed in one b32, are its
      // element of the 8x8 b16 tile (h, j); one stmatrix.x4 stores the tiles
      // h = 0, 1 of token blocks j = 2k and 2k + 1, lane l addressing row
      // l % 8 of tile l / 8. (The swizzle goes into the layout, in elements:
      // SmemLayoutP's own acts on byte addresses.)
      const auto layout_p = as_position_independent_swizzle_layout(typename Tr::SmemLayoutP{});
      const uint32_t base = smem_addr(raw_pointer_cast(p_tile(i, page_role).data()));
      const int m = lane / 8;
      const int row = 16 * (tid / 32) + 8 * (m % 2) + lane % 8;
      CUTE_UNROLL
      for (int k = 0; k < kBlockN / 16; ++k) {
        uint32_t words[4];
        CUTE_UNROLL
        for (int t = 0; t < 4; ++t) {
          const int v = 4 * (2 * k + t / 2) + 2 * (t % 2);  // tile (h, j) = (t % 2, 2k + t / 2)
          const __nv_bfloat162 pair = __floats2bfloat162_rn(tP(v), tP(v + 1));
          words[t] = reinterpret_cast<const uint32_t&>(pair);
        }
        const uint32_t addr = base + uint32_t(layout_p(row, 8 * (2 * k + m / 2))) * uint32_t(sizeof(Element));
        stmatrix_x4(addr, words[0], words[1], words[2], words[3]);
      }
    } else {
      static_assert(std::is_same_v<Element, cutlass::float_e4m3_t>);
      const uint32_t tile = smem_addr(raw_pointer_cast(p_tile(i, page_role).data()));
      if constexpr (Tr::kTokenScales) {
        // P = e4m3(p * k[t] * 16 / N): the factors read again here (held from the S, they cost registers).
        float kf[16];
        load_token_factors(i, kf);
        const float to_n = __fdividef(Tr::kPNormalizer, plan.table[table_of(i)].running_n);  // as in adopt_n
        store_p_e4m3<Tr, kBlockN / 16>(tile, tid / 32, lane, tP, [&](int v) { return kf[kf_of(v)] * to_n; }, 0);
      } else {
        store_p_e4m3<Tr, kBlockN / 16>(tile, tid / 32, lane, tP, [](int) { return 1.f; }, 0);
      }
    }
  };
  auto rescale_o = [&](const float (&factor)[2]) {
    // Row maxima settle after a few pages: skip the 128 multiplies when
    // neither of this thread's rows moved (no WGMMA is in flight here).
    if (factor[0] != 1.f || factor[1] != 1.f) {
      CUTE_UNROLL
      for (int v = 0; v < size(tOrO); ++v) tOrO(v) *= factor[fragment_row_half(v)];
    }
  };
  // Adopts a new running max published by the other WG: returns the factor
  // for O and the row sums (exp2(-inf) = 0 cannot occur: the max only grows,
  // and a row that still has none keeps factor 1).
  auto adopt_max = [&](OnlineSoftmaxState& softmax, const float* ref, float (&factor)[2]) {
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      const float m = ref[rows[h]];
      factor[h] = m == -INFINITY ? 1.f : exp2_ftz((softmax.max[h] - m) * scale_log2);
      softmax.max[h] = m;
      softmax.sum[h] *= factor[h];
    }
  };
  auto publish_max = [&](const OnlineSoftmaxState& softmax, float* ref) {
    if ((lane & 3) == 0) {
      ref[rows[0]] = softmax.max[0];
      ref[rows[1]] = softmax.max[1];
    }
  };
  // bf16: slots past the chunk's end get P = 0, but 0 * NaN = NaN in P V:
  // the page's owner zeroes their V rows (all 512 channels) after its S
  // retired, before the ready barrier that lets the other WG read them.
  // (fp8_per_tensor zeroes them in the V^T transpose instead.)
  auto zero_stale_v = [&](int i, int page, const Chunk& c) {
    if constexpr (!Tr::kVNeedsTranspose) {
      const int first = c.end_token - page * kBlockN;
      if (first >= kBlockN) return;
      Tensor sK = as_position_independent_swizzle_tensor(
          make_tensor(make_smem_ptr(plan.k[stage_of(i)]), typename Tr::SmemLayoutK{}));
      constexpr int kPiecesPerRow = decode_cfg::kHeadDimV / 8;  // 16-byte pieces
      for (int j = tid; j < (kBlockN - first) * kPiecesPerRow; j += 128) {
        const int t = first + j / kPiecesPerRow;
        *reinterpret_cast<uint4*>(raw_pointer_cast(&sK(t, (j % kPiecesPerRow) * 8))) = make_uint4(0, 0, 0, 0);
      }
    }
  };
  // Publishing this WG's page of the pair (page_role 0: A at kPageAReady by
  // WG0, 1: B at kPageBReady by WG1): stage_p zeroes its stale V rows and
  // stores P in its tile, fenced for the WGMMAs; the ready barrier then
  // hands them over (publish_p: both steps at once; bf16's WG1 stages P_B
  // earlier). publish_page then rescales O by `factor` and queues the WG's
  // own P V.
  auto stage_p = [&](const auto& tP, int i, int page, int page_role, const Chunk& c) {
    zero_stale_v(i, page, c);
    store_p(tP, i, page_role);
    stamp(args, wg, i, event_trace::kPairStored);
    fence_proxy_async_smem();
  };
  auto publish_p = [&](const auto& tP, int i, int page, int page_role, const Chunk& c) {
    stage_p(tP, i, page, page_role, c);
    // Both WGs pass the ready barrier, so it also orders this WG's own
    // writes (P, zeroed V rows) before its WGMMA reads them.
    named_barrier_sync_unaligned(page_role == 0 ? NamedBarriers::kPageAReady : NamedBarriers::kPageBReady,
                                 kConsumers);
  };
  auto accumulate_own_page = [&](const auto& tP, int i, int page_role, const float (&factor)[2], bool accumulate)
                                 __attribute__((always_inline)) {
    rescale_o(factor);
    if constexpr (Tr::kOwnPInRegisters) {
      issue_pv_regs(tP, i, page_role, accumulate);
    } else {
      issue_pv_smem(i, page_role, accumulate);
    }
  };
  static_assert(Tr::kPInRopeSlab || Tr::kNumPTiles == 2, "P_A and P_B need tiles of their own");
  auto publish_page = [&](const auto& tP, int i, int page, int page_role, const Chunk& c,
                          const float (&factor)[2], bool accumulate) __attribute__((always_inline)) {
    publish_p(tP, i, page, page_role, c);
    accumulate_own_page(tP, i, page_role, factor, accumulate);
  };
  // Each WG queues its S of the next pair right behind its last P V of this
  // pair when the ring holds three pages or more (fp8_per_tensor); with two
  // (bf16), page B' reuses B's slot, which is free only once P_B V_B
  // retired. Early S also relies on V^T: the K slot is released before the
  // P V that follows it, so nothing is left to release after the S.
  // Design S keeps it on two stages: V^T frees both slots early in the pair (session 63's st2e).
  constexpr bool kEarlyS = Tr::kNumStages >= 3 || Tr::kTokenScales;
  static_assert(!kEarlyS || Tr::kVNeedsTranspose, "early S releases K slots before their P V");

  int it = 0;  // pages consumed by this CTA, across chunks (ring position)
  // The pair at `page` of a chunk ending at page_end: whether it has a page
  // B, whether another pair follows and has a B; the ring positions of A
  // and B. Advances the ring past the pair.
  struct PagePair {
    bool has_b, has_next, next_has_b;
    int ia, ib;
  };
  auto take_pair = [&](int page, int page_end) {
    const PagePair pair{page + 1 < page_end, page + 2 < page_end, page + 3 < page_end, it, it + 1};
    it += pair.has_b ? 2 : 1;
    return pair;
  };
  // A plain loop rather than for_each_chunk: a lambda this large is not
  // inlined, and O would then live in local memory.
  for (int b = meta.begin_batch; b <= meta.end_batch; ++b) {
    const Chunk c = make_chunk(p, meta, b);
    stamp(args, wg, it, event_trace::kChunkStart);
    if constexpr (Tr::kTokenScales) {
      load_q_ds(args, plan, c.batch, head_k, m_block, ctid, b - meta.begin_batch);  // ends at kQReady
      q_row_scale[0] = plan.q_scale[rows[0]];
      q_row_scale[1] = plan.q_scale[rows[1]];
      n_ref = 0.f;
    } else {
      acquire_q(args, plan, c.batch, head_k, m_block, ctid, b - meta.begin_batch);
    }
    stamp(args, wg, it, event_trace::kQLoaded);

    int limit[2];
    const int min_limit = visible_limits(p, c, c.seqlen, m_block, rows, limit);
    auto mask = [&](auto& tS, int page) {
      if (page * kBlockN + kBlockN > min_limit) mask_invisible(tS, tScS, page * kBlockN, limit);
    };

    OnlineSoftmaxState softmax;
    softmax.reset();
    // O needs no clear: the chunk's first P V WGMMA runs with scale-d = 0
    // (D = P V; the old accumulator is not read), and the epilogue selects
    // zeros for rows without keys, so a chunk with no page never exposes it.
    bool accumulate = false;

    // With early S, the first pair's S are issued here.
    const int page_begin = c.first_page(), page_end = c.end_page();
    if (page_begin < page_end) {
      if (wg == 0 && kEarlyS) issue_s(it, false);
      if (wg == 1 && kEarlyS && page_begin + 1 < page_end) issue_s(it + 1, Tr::kBRightFirst);
    }

    // One pair loop per warpgroup (the branch outside the loops), so that
    // no control-flow path joins one WG's in-flight WGMMAs with the other's
    // code: ptxas would serialize every WGMMA (C7514).
    if (wg == 0) {
      for (int page = page_begin; page < page_end; page += 2) {
        const auto [has_b, has_next, next_has_b, ia, ib] = take_pair(page, page_end);
        float factor[2];
        stamp(args, 0, ia, event_trace::kPairTop);
        // ---------------------------------------------------- WG0: page A
        if (!kEarlyS) issue_s(ia, false);
        if constexpr (Tr::kVNeedsTranspose) {
          transpose_v<Tr>(plan.k[stage_of(ia)], plan.vt[0], plan.zeros, 0, tid, c.end_token - page * kBlockN);
        }
        // S_A, and (early S) the last pair's P_B V_B,L queued before it.
        warpgroup_wait<0>();
        warpgroup_fence_operand(tSrS);
        if constexpr (Tr::kTokenScales) warpgroup_fence_operand(tSrR);
        stamp(args, 0, ia, event_trace::kPairSRetired);
        if constexpr (Tr::kVNeedsTranspose) release(ia);  // S_A and V^T_A,L have read the left part
        release_part(ia, 1);  // S_A was WG0's last read of A's right part
        if constexpr (Tr::kTokenScales) {
          float kf[16];
          load_token_factors(ia, kf);
          CUTE_UNROLL
          for (int v = 0; v < size(tSrS); ++v) tSrS(v) = token_score(tSrS(v), tSrR(v), kf, v);
        }
        mask(tSrS, page);
        float page_max[2];
        row_max(tSrS, page_max);
        softmax.template update<Tr::kLazyRescaleLog2>(tSrS, page_max, scale_log2, factor);
        publish_max(softmax, plan.ref_max[0]);
        adopt_n(ia, factor);
        publish_page(tSrS, ia, page, 0, c, factor, accumulate);
        release_table(ia);
        stamp(args, 0, ia, event_trace::kPairAReady);
        accumulate = true;
        if (has_b) {
          // ------------------------------------------ WG0: page B's left half
          if constexpr (Tr::kVNeedsTranspose) {
            // V^T_B's last reader (the last pair's P_B V_B,L) retired
            // before this pair's S_A did.
            wait_part(ib, 0);
            if constexpr (Tr::kTokenScales) mbarrier_wait(&plan.prepared[stage_of(ib)], phase_of(ib));  // as WG1's A
            transpose_v<Tr>(plan.k[stage_of(ib)], plan.vt[1], plan.zeros, 0, tid, c.end_token - (page + 1) * kBlockN);
            // That transpose was the left part's last read: S_B retired
            // before kPageAReady. Handing it back here rather than after
            // kPageBReady lets the producer refill it ~200 ns sooner (the
            // page two ahead, whose load has about a pair of lead). WG0
            // never reads the right part; its arrival completes the count.
            release(ib);
            release_part(ib, 1);
            stamp(args, 0, ib, event_trace::kPairStored);
            fence_proxy_async_smem();
          }
          named_barrier_sync_unaligned(NamedBarriers::kPageBReady, kConsumers);
          stamp(args, 0, ia, event_trace::kPairBReady);
          // WG0 never reads page B's right part (P_B has its own tile); all
          // arrivals for the slot's last page came before this barrier.
          if constexpr (!Tr::kVNeedsTranspose) release_part(ib, 1);
          warpgroup_wait<0>();
          warpgroup_fence_operand(tOrO);
          stamp(args, 0, ia, event_trace::kPairPvRetired);
          if constexpr (!Tr::kVNeedsTranspose) release(ia);  // P_A V_A,L retired
          adopt_max(softmax, plan.ref_max[1], factor);
          adopt_n(ib, factor);
          release_table(ib);
          rescale_o(factor);
          issue_pv_smem(ib, 1, true);
          if (kEarlyS && has_next) {
            issue_s(ib + 1, false);
          } else {
            warpgroup_wait<0>();
            warpgroup_fence_operand(tOrO);
            if constexpr (!Tr::kVNeedsTranspose) release(ib);  // P_B V_B,L retired
          }
        } else {
          warpgroup_wait<0>();
          warpgroup_fence_operand(tOrO);
          stamp(args, 0, ia, event_trace::kPairPvRetired);
          if constexpr (!Tr::kVNeedsTranspose) release(ia);
        }
        stamp(args, 0, ia, event_trace::kPairEnd);
      }
    } else {
      for (int page = page_begin; page < page_end; page += 2) {
        const auto [has_b, has_next, next_has_b, ia, ib] = take_pair(page, page_end);
        float factor[2];
        stamp(args, 1, ia, event_trace::kPairTop);
        // ---------------------------------------------------- WG1: page B
        if (!kEarlyS && has_b) issue_s(ib, Tr::kBRightFirst);
        if constexpr (Tr::kVNeedsTranspose) {
          // V^T_A,R was last read by the last pair's P_A V_A,R (retired);
          // V^T_B,R by its P_B V_B,R, queued before S_B.
          wait_part(ia, 1);
          // Design S: WG0's S_A waited for A's prep, not this WG; the prep may rewrite NoPE bytes of the slot.
          if constexpr (Tr::kTokenScales) mbarrier_wait(&plan.prepared[stage_of(ia)], phase_of(ia));
          transpose_v<Tr>(plan.k[stage_of(ia)], plan.vt[0], plan.zeros, 1, tid, c.end_token - page * kBlockN);
          // WG1's last read of A's right part (WG0 hands back its own, S_A's,
          // when S_A retires): ~330 ns before kPageAReady.
          release(ia);
          if (has_b) {
            warpgroup_wait<1>();
            transpose_v<Tr>(plan.k[stage_of(ib)], plan.vt[1], plan.zeros, 1, tid, c.end_token - (page + 1) * kBlockN);
          }
          stamp(args, 1, ia, event_trace::kPairStored);
          fence_proxy_async_smem();
        }
        Tensor tSrSb = make_fragment_like(tSrS);  // the softmax copy (see above)
        float page_max[2];
        if (has_b) {
          warpgroup_wait<0>();
          warpgroup_fence_operand(tSrS);
          if constexpr (Tr::kTokenScales) warpgroup_fence_operand(tSrR);
          stamp(args, 1, ia, event_trace::kPairSRetired);
          if constexpr (Tr::kVNeedsTranspose) release(ib);  // S_B and V^T_B,R have read the right part
          if constexpr (Tr::kTokenScales) {
            float kf[16];
            load_token_factors(ib, kf);
            CUTE_UNROLL
            for (int v = 0; v < size(tSrS); ++v) tSrSb(v) = token_score(tSrS(v), tSrR(v), kf, v);
          } else {
            CUTE_UNROLL
            for (int v = 0; v < size(tSrS); ++v) tSrSb(v) = tSrS(v);
          }
          mask(tSrSb, page + 1);
          row_max(tSrSb, page_max);
        } else {
          warpgroup_wait<0>();  // the last pair's P_B V_B,R
        }
        named_barrier_sync_unaligned(NamedBarriers::kPageAReady, kConsumers);
        stamp(args, 1, ia, event_trace::kPairAReady);
        adopt_max(softmax, plan.ref_max[0], factor);
        adopt_n(ia, factor);
        release_table(ia);
        rescale_o(factor);
        // The softmax of B and its reference m_B, for WG0 at kPageBReady.
        auto softmax_b = [&] {
          softmax.template update<Tr::kLazyRescaleLog2>(tSrSb, page_max, scale_log2, factor);
          publish_max(softmax, plan.ref_max[1]);
        };
        auto tPA = thr_pv.partition_fragment_A(p_tile(ia, 0));
        constexpr int kPvSteps = decltype(size<2>(tPA))::value;
        if (kPvSteps > 2 && has_b) {
          // P_A V_A,R's k-steps go out half before and half after the
          // softmax of B. A warp issuing a third m64n256 WGMMA waits until
          // its queue, which holds WG0's P_A V_A,L too, has room
          // (scripts/fence_wgmma_bench.cu: two fit), so bf16's four at once
          // held the exponentials, and with them P_B and kPageBReady, behind
          // WG0's P V (experiment pvs, session 41: C2 ~0.8 % less time per
          // call against FlashMLA's, C1 unchanged). fp8_per_tensor's two fit.
          // bf16 stores P_B before the last two too, so that only
          // kPageBReady's barrier waits behind their issue (pvs3, session 43:
          // C2 ~0.3 % less time per call against FlashMLA's). Its tile is not
          // P_A's, and its last reader, the last pair's P_B V_B,L, retired
          // before kPageAReady.
          auto tVA = v_operand(ia, 0);
          warpgroup_fence_operand(tOrO);
          warpgroup_arrive();
          wgmma_k_steps<kPvSteps / 2>(mma_pv, tPA, tVA, tOrO, accumulate, 0);
          softmax_b();
          if constexpr (Tr::kPInRopeSlab) stage_p(tSrSb, ib, page + 1, 1, c);
          wgmma_k_steps<kPvSteps - kPvSteps / 2>(mma_pv, tPA, tVA, tOrO, true, kPvSteps / 2);
          warpgroup_commit_batch();
        } else {
          issue_pv_smem(ia, 0, accumulate);
          if (has_b) softmax_b();
        }
        accumulate = true;
        // bf16: P_B, stored above, goes out while P_A V_A,R runs, which
        // retires before O is rescaled. (fp8_per_tensor, whose P_B has a tile
        // of its own too, measured no gain from publishing it early:
        // experiment pbearly, session 15.)
        static_assert(!Tr::kPInRopeSlab || kPvSteps > 2, "P_B is stored inside P_A V_A,R's split issue");
        if constexpr (Tr::kPInRopeSlab) {
          if (has_b) named_barrier_sync_unaligned(NamedBarriers::kPageBReady, kConsumers);
          stamp(args, 1, ia, event_trace::kPairBReady);
        }
        warpgroup_wait<0>();
        warpgroup_fence_operand(tOrO);
        stamp(args, 1, ia, event_trace::kPairPvRetired);
        if constexpr (!Tr::kVNeedsTranspose) release(ia);
        if (has_b) {
          if constexpr (Tr::kPInRopeSlab) {
            accumulate_own_page(tSrSb, ib, 1, factor, true);
          } else {
            adopt_n(ib, factor);
            publish_page(tSrSb, ib, page + 1, 1, c, factor, true);
            release_table(ib);
            stamp(args, 1, ia, event_trace::kPairBReady);
          }
          if (kEarlyS && next_has_b) {
            issue_s(ib + 2, Tr::kBRightFirst);
          } else {
            warpgroup_wait<0>();
            warpgroup_fence_operand(tOrO);
            if constexpr (!Tr::kVNeedsTranspose) release(ib);
          }
        }
        stamp(args, 1, ia, event_trace::kPairEnd);
      }
    }
    // Nothing is in flight here; ptxas cannot tell (it would serialize every
    // WGMMA, C7514), so say it.
    warpgroup_wait<0>();
    warpgroup_fence_operand(tOrO);
    release_q(args, plan, lane);
    stamp(args, wg, it - 1, event_trace::kPagesDone);
    share_row_sums(plan, softmax, wg, tid, rows);
    stamp(args, wg, it - 1, event_trace::kSumsShared);
    float o_scale = out_scale;
    if constexpr (Tr::kTokenScales) o_scale = n_ref > 0.f ? n_ref / Tr::kPNormalizer : 1.f;  // O: O_true * 16 / n_ref
    epilogue(p, plan, c, head_k, m_block, wg, tid, softmax, tOrO, tOcO, rows, logit_scale, o_scale);
    stamp(args, wg, it - 1, event_trace::kEpilogueDone);
  }
}

}  // namespace jax_flash_mla::sm90
