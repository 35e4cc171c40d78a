// The fp8_ds_mla consumer (Tr::kScaleGroups): per-page token split, FP8 WGMMAs with per-group scales.
// Member definitions of SplitKvMlaKernel<kFormat, kNarrow> (splitkv_mla.cuh), which
// includes this file after the class; not a standalone header.
#pragma once

namespace jax_flash_mla::sm90 {

// Design A of docs/NUMERICS.md; Traits<kFp8DsMla> has the arithmetic and the
// shared-memory plan. Only instantiated for that format.

// Q prologue: q's 512 NoPE channels are quantized to e4m3 with ONE scale per
// row, qs = 2^ceil(log2(amax / 448)) over all four 128-channel groups (1 for
// an all-zero row), and the 64 bf16 RoPE channels are stored divided by qs
// (exact: a power of two). S then factors as qs * (R' + sum_g k_scale[t, g] T_g),
// so the promotion is one FFMA per score and group and qs is applied once, when
// the scores leave the accumulator. (Per-row instead of per-group scales: the
// same error in emulation, even with the groups' magnitudes 2^9 apart, since
// e4m3's exponent covers the spread; docs/NUMERICS.md.) 256 consumer threads
// = 64 rows x 4 groups: thread (row, g) = (ctid / 4, ctid % 4) loads its 256
// NoPE bytes and 16 RoPE channels; the quad of a row reduces amax. Rows past
// q_rows_per_head_k are zeros (scale 1); their results are never stored.
//
// Two passes over the thread's 256 bytes (amax, then the quantization), so
// only a few registers are live next to O, which stays live across chunks.
// The 64-row kernel runs them over a copy in shared memory that cp.async
// makes with all 18 pieces of the thread (16 NoPE, 2 RoPE) in flight at once:
// read twice from global memory, the 72 KB tile overflowed L1 (what is left
// next to 206 KB of shared memory), so each pass and the RoPE load paid an L2
// round trip under the page stream's load (Q load 7.4 µs a chunk hand-over,
// 12 µs at the kernel's start; 4.2 and 9.3 µs with the copy: session 16's
// event trace). The copy lives in the V^T and P tiles, idle between chunks
// (the last chunk's WGMMAs retired before its epilogue's kSumReady), 304
// bytes a thread (288 and 16 of padding, so that eight threads' 16-byte reads
// hit distinct banks). The few-rows kernel (<= 16 valid rows: they fit L1)
// reads global memory twice.
template <config::KvFormat kFormat, bool kNarrow>
__device__ void SplitKvMlaKernel<kFormat, kNarrow>::load_q_ds(const SplitKvArgs& args, Plan& plan, int batch,
                                                             int head_k, int m_block, int ctid, int chunk) {
  using namespace cute;
  const DecodeParams& p = args.params;
  static_assert(kConsumers == decode_cfg::kBlockM * Tr::kNumGroups, "one thread per (row, group)");
  static_assert(Tr::kHeadDimRope == Tr::kNumGroups * 16, "16 RoPE channels per thread");
  // Opaque to the compiler: the addresses below are recomputed per chunk
  // rather than hoisted out of the chunk loop into registers (which spilled).
  asm volatile("" : "+r"(ctid));
  // The swizzle in the layout: CuTe's swizzled pointers lose the shared address space (generic stores).
  Tensor sQR = as_position_independent_swizzle_tensor(
      make_tensor(make_smem_ptr(plan.q_rope), typename Tr::SmemLayoutQRope{}));
  const __nv_bfloat16* q = static_cast<const __nv_bfloat16*>(p.q) + batch * p.q_batch_stride;
  const int row = ctid / Tr::kNumGroups;
  const int g = ctid % Tr::kNumGroups;
  const int r = m_block * kBlockM + row;
  const bool valid = r < p.q_rows_per_head_k;
  const __nv_bfloat16* q_row =
      q + (valid ? (r / p.heads_per_head_k) * p.q_seq_stride +
                       (head_k * p.heads_per_head_k + r % p.heads_per_head_k) * p.q_head_stride
                 : 0);
  const uint4* src = reinterpret_cast<const uint4*>(q_row + g * Tr::kGroupChannels);
  const uint4* rope_src = reinterpret_cast<const uint4*>(q_row + Tr::kHeadDimNope + 16 * g);
  constexpr int kPieces = Tr::kGroupChannels / 8;  // 16 x 8 bf16
  constexpr bool kStaged = !kNarrow;
  constexpr uint32_t kStageStride = 304;
  uint32_t stage = 0;
  // By the producer's TMA (kQByTmaCapable, args.q_by_tma): the tile lands in
  // the V^T / P tiles as nine 8 KB slabs (64 rows x 64 channels, 128-byte
  // swizzle: 16-byte piece k of row r at r * 128 + ((k ^ r % 8) * 16)); this
  // thread's pieces are slab 2g + i / 8 piece i % 8 (NoPE) and slab 8 piece
  // 2g + i (RoPE). Else each thread copies its own 18 pieces there.
  bool by_tma = false;
  uint32_t tma_row = 0;
  if constexpr (kQByTmaCapable) {
    by_tma = args.q_by_tma;
    tma_row = smem_addr(Tr::q_tma_destination(plan)) + uint32_t(row * q_tma_row_bytes());
  }
  constexpr int kTmaSlab = q_tma_slab_bytes();
  const int tma_sw = row & 7;
  if (by_tma) {
    if constexpr (kQByTmaCapable) mbarrier_wait(&plan.q_full, chunk & 1);
  } else if constexpr (kStaged) {
    static_assert(offsetof(Plan, p) == offsetof(Plan, vt) + sizeof(Plan::vt) &&
                      sizeof(Plan::vt) + sizeof(Plan::p) >= kConsumers * kStageStride,
                  "the Q staging copy fits the V^T and P tiles");
    stage = smem_addr(plan.vt) + uint32_t(ctid) * kStageStride;
    auto copy = [&](uint32_t dst, const uint4* from) {  // src-size 0: 16 zero bytes
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(from), "r"(valid ? 16 : 0)
                   : "memory");
    };
    CUTE_UNROLL
    for (int i = 0; i < kPieces; ++i) copy(stage + 16 * i, src + i);
    CUTE_UNROLL
    for (int i = 0; i < 2; ++i) copy(stage + 16 * (kPieces + i), rope_src + i);
    asm volatile("cp.async.wait_all;\n" ::: "memory");  // the thread reads back only its own pieces
  }
  auto piece = [&](int i) {  // NoPE pieces 0..15, then RoPE pieces 16, 17 (zeros for an invalid row)
    if constexpr (kStaged) {
      const uint32_t tma_addr =
          i < kPieces ? tma_row + uint32_t((2 * g + i / 8) * kTmaSlab + (((i % 8) ^ tma_sw) << 4))
                      : tma_row + uint32_t(8 * kTmaSlab + (((2 * g + i - kPieces) ^ tma_sw) << 4));
      uint4 x;
      asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w)
                   : "r"(by_tma ? tma_addr : stage + 16 * i)
                   : "memory");
      return x;
    } else {
      return valid ? __ldg(i < kPieces ? src + i : rope_src + (i - kPieces)) : make_uint4(0u, 0u, 0u, 0u);
    }
  };
  auto lo = [](uint32_t w) { return __uint_as_float(w << 16); };
  auto hi = [](uint32_t w) { return __uint_as_float(w & 0xffff0000u); };
  float amax = 0.f;
  CUTE_UNROLL
  for (int i = 0; i < kPieces; ++i) {
    const uint4 x = piece(i);
    const uint32_t w[4] = {x.x, x.y, x.z, x.w};
    CUTE_UNROLL
    for (int j = 0; j < 4; ++j) amax = fmaxf(amax, fmaxf(fabsf(lo(w[j])), fabsf(hi(w[j]))));
  }
  amax = quad_allreduce_max(amax);  // the row's four groups are lanes 4 row .. 4 row + 3
  // 2^ceil(log2(amax / 448)): round the fp32 quotient's exponent up unless
  // its mantissa is zero; at least 2^-64, so RoPE / scale cannot overflow for
  // a row whose NoPE part is all but zero. inv_scale = 1 / scale, also exact.
  const uint32_t bits = __float_as_uint(__fdiv_rn(amax, 448.f));
  const float scale = amax > 0.f ? fmaxf(__uint_as_float((bits + 0x007fffffu) & 0xff800000u), 0x1p-64f) : 1.f;
  const float inv_scale = __fdiv_rn(1.f, scale);
  auto cvt4 = [&](uint32_t w0, uint32_t w1) {  // 4 bf16 -> 4 e4m3 bytes
    const __nv_fp8x2_storage_t a = __nv_cvt_float2_to_fp8x2(make_float2(lo(w0) * inv_scale, hi(w0) * inv_scale),
                                                            __NV_SATFINITE, __NV_E4M3);
    const __nv_fp8x2_storage_t b = __nv_cvt_float2_to_fp8x2(make_float2(lo(w1) * inv_scale, hi(w1) * inv_scale),
                                                            __NV_SATFINITE, __NV_E4M3);
    return uint32_t(a) | (uint32_t(b) << 16);
  };
  // SW64 e4m3 tile: channel c of row `row` is at slab c / 64 (4 KB each),
  // byte row * 64 + (((c % 64) / 16) ^ ((row >> 1) & 3)) * 16 + c % 16.
  // Computed here in 32 bits (a table of hoisted generic pointers spilled).
  const uint32_t row_base = smem_addr(plan.q) + uint32_t((g * Tr::kGroupChannels / 64) * Tr::kQSlabBytes + row * 64);
  const int sw = (row >> 1) & 3;
  CUTE_UNROLL
  for (int i = 0; i < kPieces; i += 2) {  // 16 channels -> 16 e4m3 bytes
    const uint4 x0 = piece(i), x1 = piece(i + 1);
    const uint32_t addr = row_base + uint32_t((i / 8) * Tr::kQSlabBytes + ((((i / 2) % 4) ^ sw) << 4));
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(cvt4(x0.x, x0.y)),
                 "r"(cvt4(x0.z, x0.w)), "r"(cvt4(x1.x, x1.y)), "r"(cvt4(x1.z, x1.w))
                 : "memory");
  }
  // RoPE channels 16 g .. 16 g + 15 of the row, times 1 / scale (exact in bf16).
  CUTE_UNROLL
  for (int i = 0; i < 2; ++i) {
    const uint4 x = piece(kPieces + i);
    const uint32_t w[4] = {x.x, x.y, x.z, x.w};
    uint32_t y[4];
    CUTE_UNROLL
    for (int j = 0; j < 4; ++j) {
      const __nv_bfloat162 v = __floats2bfloat162_rn(lo(w[j]) * inv_scale, hi(w[j]) * inv_scale);
      y[j] = *reinterpret_cast<const uint32_t*>(&v);
    }
    *reinterpret_cast<uint4*>(raw_pointer_cast(&sQR(row, 16 * g + 8 * i))) = make_uint4(y[0], y[1], y[2], y[3]);
  }
  if (g == 0) {
    plan.q_scale[row] = scale;
    if constexpr (!kNarrow) plan.row_lag[row] = p.seqlen_q - 1 - r / p.heads_per_head_k;  // consumer_ds's limits
  }
  fence_proxy_async_smem();  // Q is read by WGMMA (async proxy)
  named_barrier_sync(NamedBarriers::kQReady, kConsumers);
}

// Shared-window address of the four fp32 scales of token t in a K slot: the
// scale box lands unswizzled, 16 bytes per token.
template <config::KvFormat kFormat, bool kNarrow>
__device__ uint32_t SplitKvMlaKernel<kFormat, kNarrow>::ds_scale_addr(uint32_t slot_base, int t) {
  return slot_base + uint32_t(Tr::kScaleOffset + t * Tr::kScaleRowBytes);
}

// Slots past the chunk may hold NaN scales: a token's are loaded only if it
// is valid (P would compute 0 * NaN). The page maximum: two tokens per lane
// and one warp-wide integer max (REDUX) per group, since positive floats order
// as their bit patterns (instead of five shuffle + max steps); negative or NaN
// scales (not written by the quantizer) count as 0, and a group without any
// gets 1 (scales are positive: powers of two from our quantizer, any fp32
// from other writers; guard anyway).
template <config::KvFormat kFormat, bool kNarrow>
__device__ float4 SplitKvMlaKernel<kFormat, kNarrow>::ds_token_scales(uint32_t slot_base, int t, int valid) {
  float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
  asm volatile(
      "{\n .reg .pred ok;\n setp.lt.s32 ok, %4, %5;\n"
      " @ok ld.shared.v4.f32 {%0, %1, %2, %3}, [%6];\n}\n"
      : "+f"(x.x), "+f"(x.y), "+f"(x.z), "+f"(x.w)
      : "r"(t), "r"(valid), "r"(ds_scale_addr(slot_base, t))
      : "memory");
  return x;
}

template <config::KvFormat kFormat, bool kNarrow>
__device__ void SplitKvMlaKernel<kFormat, kNarrow>::ds_page_scale_max(uint32_t slot_base, int lane, int valid,
                                                                     float (&n)[4]) {
  float4 s0, s1;
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(s0.x), "=f"(s0.y), "=f"(s0.z), "=f"(s0.w)
               : "r"(ds_scale_addr(slot_base, lane))
               : "memory");
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(s1.x), "=f"(s1.y), "=f"(s1.z), "=f"(s1.w)
               : "r"(ds_scale_addr(slot_base, lane + 32))
               : "memory");
  const bool ok0 = lane < valid, ok1 = lane + 32 < valid;
  const float mine[4][2] = {{s0.x, s1.x}, {s0.y, s1.y}, {s0.z, s1.z}, {s0.w, s1.w}};
  CUTE_UNROLL
  for (int g = 0; g < 4; ++g) {
    auto bits = [](bool ok, float x) { return ok && x > 0.f ? __float_as_uint(x) : 0u; };
    const uint32_t m = __reduce_max_sync(0xffffffffu, max(bits(ok0, mine[g][0]), bits(ok1, mine[g][1])));
    n[g] = m != 0u ? __uint_as_float(m) : 1.f;
  }
}

template <config::KvFormat kFormat, bool kNarrow>
__device__ void SplitKvMlaKernel<kFormat, kNarrow>::consumer_ds(const SplitKvArgs& args, Plan& plan,
                                                               const SchedMeta& meta, int head_k, int m_block, int wg,
                                                               int tid) {
  using namespace cute;
  using Rope = typename Tr::ElementRope;
  constexpr int kGroups = Tr::kNumGroups;
  constexpr int kNPerWG = decode_cfg::kBlockNPerWG;
  const DecodeParams& p = args.params;
  typename Tr::TiledMmaQKRope mma_rope;
  typename Tr::TiledMmaQKNope mma_nope;
  typename Tr::TiledMmaPV mma_pv;
  auto thr_rope = mma_rope.get_thread_slice(tid);
  auto thr_nope = mma_nope.get_thread_slice(tid);
  auto thr_pv = mma_pv.get_thread_slice(tid);
  const int ctid = wg * 128 + tid;
  const int lane = tid % 32;

  // Q operand descriptors, rebuilt per page from shared addresses the
  // compiler cannot see through: hoisted out of the page loop, the twenty
  // 64-bit descriptors stayed live next to O and made ptxas spill. Opaque
  // 32-bit shared addresses, not generic pointers: from an opaque generic
  // pointer every rebuild converted it through the shared window's base.
  auto q_operands = [&] {
    uint32_t q_nope_addr = smem_addr(plan.q), q_rope_addr = smem_addr(plan.q_rope);
    asm volatile("" : "+r"(q_nope_addr), "+r"(q_rope_addr));
    Element* q_nope = static_cast<Element*>(__cvta_shared_to_generic(q_nope_addr));
    Rope* q_rope = static_cast<Rope*>(__cvta_shared_to_generic(q_rope_addr));
    Tensor sQ = make_tensor(make_smem_ptr(q_nope), typename Tr::SmemLayoutQ{});
    Tensor sQR = make_tensor(make_smem_ptr(q_rope), typename Tr::SmemLayoutQRope{});
    return cute::make_tuple(thr_nope.partition_fragment_A(sQ),   // (MMA, 1, 16) descriptors
                            thr_rope.partition_fragment_A(sQR));  // (MMA, 1, 4)
  };
  Tensor tSrS = partition_fragment_C(mma_rope, Shape<Int<kBlockM>, Int<kNPerWG>>{});
  // Two NoPE group accumulators: group g+1 (or g+2) runs while g is promoted.
  Tensor tSrT0 = partition_fragment_C(mma_nope, Shape<Int<kBlockM>, Int<kNPerWG>>{});
  Tensor tSrT1 = partition_fragment_C(mma_nope, Shape<Int<kBlockM>, Int<kNPerWG>>{});
  Tensor tScS = thr_rope.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kNPerWG>>{}));
  // O: this WG's two output groups (2 wg, 2 wg + 1) of 128 channels,
  // (MMA, 1, 2); block j is group 2 wg + j.
  constexpr int kPVBlocks = decode_cfg::kHeadDimVPerWG / Tr::kGroupChannels;  // 2
  Tensor tOrO = partition_fragment_C(mma_pv, Shape<Int<kBlockM>, Int<decode_cfg::kHeadDimVPerWG>>{});
  Tensor tOcO = thr_pv.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<decode_cfg::kHeadDimVPerWG>>{}));
  static_assert(size(tSrS) == kNPerWG / 2, "two rows x N/4 columns per thread");
  static_assert(size(tSrT0) == size(tSrS), "QK accumulators share the m64n32 layout");
  static_assert(decltype(size<2>(tOrO))::value == kPVBlocks, "one WGMMA block per output group");
  const int rows[2] = {int(get<0>(tScS(0))), int(get<0>(tScS(2)))};
  // Value v of an m64n32 fragment is column 8 (v / 4) + 2 (lane % 4) + v % 2
  // of the WG's 32 tokens; offsets from this thread's first token locate its
  // 8 tokens' scale rows.
  const int tok_first = wg * kNPerWG + int(get<1>(tScS(0)));  // within the page
  // The 8 tokens among them: value v is token j = 2 (v / 4) + v % 2 of the
  // thread, at offset 8 (j / 2) + j % 2 from tok_first.
  auto token_of = [](int v) { return 2 * (v / 4) + v % 2; };
  auto token_offset = [](int j) { return 8 * (j / 2) + j % 2; };

  // This thread's page-invariant addressing, kept in plan.page_lane: its
  // transpose_v lane, its P-store offset in the group tiles (this WG's token
  // groups 2 wg, 2 wg + 1) and tok_first. Only this thread writes and reads
  // its entry (program order), and nothing else touches the region. The
  // loads are volatile: hoisted out of the page loop, the values would take
  // registers next to O.
  struct PageLane {
    TransposeLane transpose;
    uint32_t p_store;
    int tok_first;
  };
  static_assert(sizeof(PageLane) == sizeof(plan.page_lane[0]), "one 32-byte entry a consumer thread");
  const uint32_t page_lane_addr = smem_addr(plan.page_lane[ctid]);
  {
    const PageLane mine{transpose_lane<Tr>(wg, tid), p_store_offset<Tr>(tid / 32, lane, 2 * wg), tok_first};
    uint32_t w[8];
    memcpy(w, &mine, sizeof(w));
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n"
                 "st.shared.v4.b32 [%0 + 16], {%5, %6, %7, %8};\n" ::"r"(page_lane_addr),
                 "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3]), "r"(w[4]), "r"(w[5]), "r"(w[6]), "r"(w[7])
                 : "memory");
  }
  auto load_page_lane = [&] {
    uint32_t w[8];
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%8];\n"
                 "ld.shared.v4.b32 {%4, %5, %6, %7}, [%8 + 16];\n"
                 : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]), "=r"(w[4]), "=r"(w[5]), "=r"(w[6]), "=r"(w[7])
                 : "r"(page_lane_addr)
                 : "memory");
    PageLane l;
    memcpy(&l, w, sizeof(w));
    return l;
  };

  auto k_nope = [&](int stage) {
    Tensor sK = make_tensor(make_smem_ptr(plan.k[stage]), typename Tr::SmemLayoutK{});
    return thr_nope.partition_fragment_B(
        local_tile(sK, Shape<Int<kNPerWG>, Int<Tr::kHeadDimNope>>{}, make_coord(wg, 0)));  // (MMA, 1, 16)
  };
  auto k_rope = [&](int stage) {
    Rope* base = reinterpret_cast<Rope*>(plan.k[stage] + Tr::kRopeOffset);
    Tensor sKR = make_tensor(make_smem_ptr(base), typename Tr::SmemLayoutKRope{});
    return thr_rope.partition_fragment_B(
        local_tile(sKR, Shape<Int<kNPerWG>, Int<Tr::kHeadDimRope>>{}, make_coord(wg, 0)));  // (MMA, 1, 4)
  };

  // The head of page i's S: RoPE into S and NoPE group 0 into T0, one batch.
  // Issued for the next page right after this page's S is complete, so these
  // WGMMAs run under this page's softmax and P stores. (Group 1 into T1 as
  // well made ptxas spill: T1 would be live next to the cached token scales,
  // 84 B in session 6, 128 B with them cached in session 7.)
  constexpr int kGroupSteps = Tr::kGroupChannels / 32;
  auto issue_s_head = [&](int i) __attribute__((always_inline)) {
    const int st = i % Tr::kNumStages;
    stamp(args, wg, i, event_trace::kDsSlotWait);
    mbarrier_wait(&plan.k_full[st], (i / Tr::kNumStages) & 1);
    stamp(args, wg, i, event_trace::kDsSlotLanded);
    Tensor tSrKN = k_nope(st);
    Tensor tSrKR = k_rope(st);
    auto q_ops = q_operands();
    warpgroup_fence_operand(tSrS);
    warpgroup_fence_operand(tSrT0);
    warpgroup_arrive();
    wgmma_k_steps(mma_rope, cute::get<1>(q_ops), tSrKR, tSrS, false);
    wgmma_k_steps<kGroupSteps>(mma_nope, cute::get<0>(q_ops), tSrKN, tSrT0, false);
    warpgroup_commit_batch();
  };

  int it = 0;
  for_each_chunk(p, meta, [&](const Chunk& c) {
    stamp(args, wg, it, event_trace::kChunkStart);
    load_q_ds(args, plan, c.batch, head_k, m_block, ctid, c.batch - meta.begin_batch);
    stamp(args, wg, it, event_trace::kQLoaded);
    if (c.first_page() < c.end_page()) issue_s_head(it);

    OnlineSoftmaxState softmax;
    softmax.reset();
    // O is written (not accumulated) at the chunk's first page.
    // Running per-group normalizer N_g: the largest k_scale[., g] of the
    // chunk's tokens so far. O_g holds (true O_g) * kPNormalizer / N_g.
    float norm[kGroups] = {0.f, 0.f, 0.f, 0.f};
    // kPNormalizer / N_g, P's group factor: formed only where some N_g grows (every N_g grows from 0 at the
    // first page, rarely after it), not per page (ph3, session 59: four MUFU.RCP off the page's chain).
    float p_factor[kGroups] = {0.f, 0.f, 0.f, 0.f};

    const int page_begin = c.first_page();
    const int page_end = c.end_page();
    for (int page = page_begin; page < page_end; ++page, ++it) {
      stamp(args, wg, it, event_trace::kDsTop);
      const int stage = it % Tr::kNumStages;
      const int valid = c.end_token - page * kBlockN;  // tokens of the page inside the chunk
      // (The slot's k_full was waited for by issue_s_head.)
      const uint32_t slot = smem_addr(plan.k[stage]);
      const PageLane pl = load_page_lane();
      const uint32_t my_scales = ds_scale_addr(slot, pl.tok_first);
      // The transpose while this page's S head (RoPE, group 0) and the last
      // page's P V are in flight.
      transpose_v<Tr>(plan.k[stage], plan.vt[it & 1], plan.zeros, pl.transpose, valid);
      stamp(args, wg, it, event_trace::kDsTransposed);
      // All retired here: a wait_group 1 over batches carried around the page
      // loop makes ptxas serialize every WGMMA (C7514).
      warpgroup_wait<0>();
      warpgroup_fence_operand(tSrS);
      warpgroup_fence_operand(tSrT0);
      warpgroup_fence_operand(tSrT1);
      stamp(args, wg, it, event_trace::kDsHeadRetired);
      Tensor tSrKN = k_nope(stage);
      auto issue_group = [&](auto& T, int g) {
        wgmma_batch<kGroupSteps>(mma_nope, cute::get<0>(q_operands()), tSrKN, T, false, g * kGroupSteps);
      };
      issue_group(tSrT1, 1);  // under the scale loads below and group 0's promotion

      // n_g: the page's largest k_scale[., g] over its tokens in the chunk.
      // Every warp reduces all 64 tokens on its own, so all agree on the
      // running N_g = max(N_g, n_g) and on how much O_g shrinks.
      float n[kGroups];
      ds_page_scale_max(slot, lane, valid, n);
      // k_scale[t_j, g] of this thread's 8 tokens (value v of the fragment is
      // token j = token_of(v), at offset token_offset(j) from tok_first), one
      // 16-byte load per token, 0 past the chunk (slots there may hold NaN:
      // those scores are masked by selection after the promotion, and P would
      // compute 0 * NaN). Used by the promotion, then (times kPNormalizer / N_g) for P.
      // Token tok_first + o is valid iff o < valid - tok_first: one compare with an immediate a token.
      const int valid_mine = valid - pl.tok_first;
      float ksc[8][kGroups];
      CUTE_UNROLL
      for (int j = 0; j < 8; ++j) {
        float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
        asm volatile(
            "{\n .reg .pred ok;\n setp.lt.s32 ok, %4, %5;\n"
            " @ok ld.shared.v4.f32 {%0, %1, %2, %3}, [%6];\n}\n"
            : "+f"(x.x), "+f"(x.y), "+f"(x.z), "+f"(x.w)
            : "r"(token_offset(j)), "r"(valid_mine), "r"(my_scales + uint32_t(token_offset(j) * Tr::kScaleRowBytes))
            : "memory");
        ksc[j][0] = x.x;
        ksc[j][1] = x.y;
        ksc[j][2] = x.z;
        ksc[j][3] = x.w;
      }
      // N_g old / new: exact for power-of-two scales; unused at the first page. IEEE divisions, taken only on
      // the pages where some N_g grows (warp-uniform: the n_g are REDUX results): replaced by rcp.approx
      // (session 12) or by exponent arithmetic, the quotients made ptxas serialize the page's WGMMAs (C7515).
      float shrink[kGroups] = {1.f, 1.f, 1.f, 1.f};
      bool grows = false;
      CUTE_UNROLL
      for (int g = 0; g < kGroups; ++g) grows |= n[g] > norm[g];
      if (grows) {
        CUTE_UNROLL
        for (int g = 0; g < kGroups; ++g) {
          const float grown = fmaxf(norm[g], n[g]);
          shrink[g] = norm[g] / grown;
          norm[g] = grown;
          p_factor[g] = Tr::kPNormalizer * rcp_ftz(grown);  // exact for a power-of-two N_g, else within 1 ulp
        }
      }

      // S += k_scale[t, g] * T_g, in fp32 (q's row scale comes last).
      auto promote = [&](auto& T, int g) {
        warpgroup_fence_operand(T);
        CUTE_UNROLL
        for (int v = 0; v < size(tSrS); ++v) tSrS(v) = fmaf(ksc[token_of(v)][g], T(v), tSrS(v));
      };
      promote(tSrT0, 0);
      issue_group(tSrT0, 2);
      warpgroup_wait<1>();  // group 1
      promote(tSrT1, 1);
      issue_group(tSrT1, 3);
      warpgroup_wait<1>();  // group 2
      promote(tSrT0, 2);
      warpgroup_wait<0>();  // group 3
      stamp(args, wg, it, event_trace::kDsSRetired);
      // The slot's last reads (S retired, V^T and the scales copied): the
      // producer may refill it while this page's softmax and P V run.
      release_slot(plan, stage, lane);
      promote(tSrT1, 3);
      warpgroup_fence_operand(tSrS);
      // This page's scores leave the accumulator, times q's row scale (the
      // softmax writes them while the next page's S head is in flight:
      // modifying registers of an in-flight batch's kind makes ptxas
      // serialize, C7515), and the head of the next page's S goes out.
      Tensor sc = make_fragment_like(tSrS);
      {
        const float qs[2] = {plan.q_scale[rows[0]], plan.q_scale[rows[1]]};
        CUTE_UNROLL
        for (int v = 0; v < size(tSrS); ++v) sc(v) = tSrS(v) * qs[fragment_row_half(v)];
      }
      if (page + 1 < page_end) issue_s_head(it + 1);

      // Visible keys per row (visible_limits' arithmetic), recomputed per page
      // from an opaque copy of the length and the rows' lags in shared memory:
      // kept across the page loop, these three registers made ptxas spill next
      // to O, and the lags' integer divisions took ~50 instructions a page.
      int limit[2] = {c.end_token, c.end_token};
      int seqlen = c.seqlen;
      asm volatile("" : "+r"(seqlen));
      int min_limit = c.end_token;
      if (p.causal) {
        limit[0] = min(limit[0], seqlen - plan.row_lag[rows[0]]);
        limit[1] = min(limit[1], seqlen - plan.row_lag[rows[1]]);
        min_limit = min(min_limit, seqlen - p.seqlen_q + 1);
      }
      const int tok0 = page * kBlockN + wg * kNPerWG;
      if (page * kBlockN + kBlockN > min_limit) mask_invisible(sc, tScS, tok0, limit);

      float page_max[2];
      page_row_max(plan, sc, it, wg, lane, rows, page_max);
      stamp(args, wg, it, event_trace::kDsMaxReady);

      float o_scale[2];
      // Lazy: p <= 2^kLazyRescaleLog2, and o_scale is 1 on most pages (no O rescale). The
      // row sums add the unrounded p.
      softmax.template update<Tr::kLazyRescaleLog2>(sc, page_max, p.softmax_scale_log2, o_scale);

      // P_g = e4m3(p * k_scale[t, g] * kPNormalizer / N_g) for all four groups of this WG's 32 tokens, as f16
      // pairs: p once, then one HMUL2 a pair and group (store_p_e4m3_h2). The factors (<= kPNormalizer) are
      // formed in fp32, since N_g alone may lie outside f16's range.
      static_assert(kNPerWG / 16 == 2, "one stmatrix.x4 a group");
      uint32_t p_h[8];
      CUTE_UNROLL
      for (int i = 0; i < 8; ++i) p_h[i] = pack_half2(sc(2 * i), sc(2 * i + 1));
      CUTE_UNROLL
      for (int g = 0; g < kGroups; ++g) {
        uint32_t scale_h[4];
        CUTE_UNROLL
        for (int m = 0; m < 4; ++m) {
          scale_h[m] = pack_half2(ksc[2 * m][g] * p_factor[g], ksc[2 * m + 1][g] * p_factor[g]);
        }
        // This WG's 32 tokens are token groups 2 wg and 2 wg + 1 of the page.
        store_p_e4m3_h2(smem_addr(plan.p[g]) + pl.p_store, p_h, scale_h);
      }
      // Rescale O (no WGMMA reads it now: the last P V retired before this
      // page's S did) by the row-max factor and, per group, N_g old / new;
      // then O_g += P_g V_g for this WG's two groups, left in flight until
      // the next page's S waits (or the chunk's end).
      const bool first_page = page == page_begin;
      CUTE_UNROLL
      for (int j = 0; j < kPVBlocks; ++j) {
        const float sh = wg == 0 ? shrink[j] : shrink[2 + j];  // group 2 wg + j, without dynamic indexing
        if (!first_page && (o_scale[0] != 1.f || o_scale[1] != 1.f || sh != 1.f)) {
          const float f[2] = {o_scale[0] * sh, o_scale[1] * sh};
          Tensor tOrOj = tOrO(_, _, j);
          CUTE_UNROLL
          for (int v = 0; v < size(tOrOj); ++v) tOrOj(v) *= f[fragment_row_half(v)];
        }
      }
      stamp(args, wg, it, event_trace::kDsPStored);
      fence_proxy_async_smem();
      named_barrier_sync(NamedBarriers::kPReady, kConsumers);
      stamp(args, wg, it, event_trace::kDsPReady);
      warpgroup_fence_operand(tOrO);
      warpgroup_arrive();
      CUTE_UNROLL
      for (int j = 0; j < kPVBlocks; ++j) {
        Tensor sP = make_tensor(make_smem_ptr(plan.p[2 * wg + j]), typename Tr::SmemLayoutP{});
        Tensor sV = make_tensor(make_smem_ptr(plan.vt[it & 1]), typename Tr::SmemLayoutV{});
        Tensor tOrOj_mn = tOrO(_, _, j);  // (MMA, 1) -> (MMA, 1, 1), the rank gemm() expects of C
        Tensor tOrOj = make_tensor(tOrOj_mn.data(), append<3>(tOrOj_mn.layout(), Layout<_1, _0>{}));
        wgmma_k_steps(mma_pv, thr_pv.partition_fragment_A(sP),
                      thr_pv.partition_fragment_B(local_tile(
                          sV, Shape<Int<Tr::kGroupChannels>, Int<kBlockN>>{}, make_coord(wg * kPVBlocks + j, 0))),
                      tOrOj, !first_page);
      }
      warpgroup_commit_batch();
      stamp(args, wg, it, event_trace::kDsEnd);
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(tOrO);
    release_q(args, plan, tid % 32);  // the V^T and P tiles may take the next chunk's q
    stamp(args, wg, it - 1, event_trace::kPagesDone);
    // O_g * N_g / kPNormalizer: the true O_g (a chunk without pages leaves O unread:
    // the epilogue writes zeros for rows without keys).
    if (page_begin < page_end) {
      CUTE_UNROLL
      for (int j = 0; j < kPVBlocks; ++j) {
        const float f = (wg == 0 ? norm[j] : norm[2 + j]) * (1.f / Tr::kPNormalizer);
        Tensor tOrOj = tOrO(_, _, j);
        CUTE_UNROLL
        for (int v = 0; v < size(tOrOj); ++v) tOrOj(v) *= f;
      }
    }
    share_row_sums(plan, softmax, wg, tid, rows);
    stamp(args, wg, it - 1, event_trace::kSumsShared);
    epilogue(p, plan, c, head_k, m_block, wg, tid, softmax, tOrO, tOcO, rows, p.softmax_scale, 1.f);
    stamp(args, wg, it - 1, event_trace::kEpilogueDone);
  });
}

}  // namespace jax_flash_mla::sm90
