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
  Tensor sQR = make_tensor(make_smem_ptr(plan.q_rope), typename Tr::SmemLayoutQRope{});
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
  if (g == 0) plan.q_scale[row] = scale;
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
// gets 1 (scales are positive powers of two; guard anyway).
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

// k_scale[t, g] (times a factor) of one group for the 16 tokens a thread
// holds in an m64n64 fragment: value v is token 8 (v / 4) + 2 (lane % 4) +
// v % 2, so token pair v / 4 is one 8-byte word of the scale table.
struct TokenScales {
  float2 pair[8];
  __device__ __forceinline__ float operator()(int v) const { return v % 2 ? pair[v / 4].y : pair[v / 4].x; }
  __device__ __forceinline__ void scale_by(float f) {
    CUTE_UNROLL
    for (int j = 0; j < 8; ++j) pair[j] = make_float2(pair[j].x * f, pair[j].y * f);
  }
};

// Page pairs, as consumer() (consumer_pairs.cuh): WG0 computes S and the
// softmax of page A, WG1 those of page B; each WG accumulates both pages into
// its two output groups (2 wg, 2 wg + 1) of O. The running row max AND the
// group normalizers N_g are chained through shared memory: WG0 publishes
// m_A and N_A = max(N, n_A) with P_A (kPageAReady), WG1 m_B and N_B with P_B
// (kPageBReady), so both pages' P_g of a pair share one reference after each
// WG's rescale of O:
//   O_g = (O_g f_A + P_A,g V_A,g) f_B + P_B,g V_B,g,  f = e^(m_old - m_new) N_old / N_new
// Per pair:
//   WG0: S_A (V^T_A,L in its WGMMA gaps) -> softmax A, P_A,0..3, m_A, N_A
//        [kPageAReady] -> P_A V_A,L -> V^T_B,L -> [kPageBReady] -> P_B V_B,L
//   WG1: S_B (V^T_A,R and V^T_B,R in its gaps) -> row max of B
//        [kPageAReady] -> P_A V_A,R -> softmax B, P_B,0..3, m_B, N_B
//        (a register copy of S_B: see consumer()) -> [kPageBReady] -> P_B V_B,R
// The S of a page is a chain: RoPE into S and T_0 into T, then for each
// group S += k_scale[t, g] T_g once T_g retired, T_{g+1} issued behind it.
// One T accumulator (two would not fit next to O, S and the copy): the
// chain's gaps take this WG's V^T transposes, and the other WG's WGMMAs keep
// the tensor cores busy. Each WG tabulates its page's token scales by group
// in shared memory first (scale_table), so that the promotion and P read a
// thread's token pairs as 8-byte words.
// Every consumer warp reads every page (its S or its V^T half): a slot goes
// back when all eight warps arrived on k_empty.
template <config::KvFormat kFormat, bool kNarrow>
__device__ void SplitKvMlaKernel<kFormat, kNarrow>::consumer_ds(const SplitKvArgs& args, Plan& plan,
                                                               const SchedMeta& meta, int head_k, int m_block, int wg,
                                                               int tid) {
  using namespace cute;
  using Rope = typename Tr::ElementRope;
  constexpr int kGroups = Tr::kNumGroups;
  const DecodeParams& p = args.params;
  typename Tr::TiledMmaQKRope mma_rope;
  typename Tr::TiledMmaQKNope mma_nope;
  typename Tr::TiledMmaPV mma_pv;
  auto thr_rope = mma_rope.get_thread_slice(tid);
  auto thr_nope = mma_nope.get_thread_slice(tid);
  auto thr_pv = mma_pv.get_thread_slice(tid);
  const int ctid = wg * 128 + tid;
  const int lane = tid % 32;
  const int warp = tid / 32;  // within the WG
  const float scale_log2 = p.softmax_scale_log2;

  // Q operand descriptors, rebuilt per page from a pointer the compiler
  // cannot see through: hoisted out of the page loop, the twenty 64-bit
  // descriptors stayed live next to O and made ptxas spill.
  auto q_operands = [&] {
    Element* q_nope = plan.q;
    Rope* q_rope = plan.q_rope;
    asm volatile("" : "+l"(q_nope), "+l"(q_rope));
    Tensor sQ = make_tensor(make_smem_ptr(q_nope), typename Tr::SmemLayoutQ{});
    Tensor sQR = make_tensor(make_smem_ptr(q_rope), typename Tr::SmemLayoutQRope{});
    return cute::make_tuple(thr_nope.partition_fragment_A(sQ),   // (MMA, 1, 16) descriptors
                            thr_rope.partition_fragment_A(sQR));  // (MMA, 1, 4)
  };
  Tensor tSrS = partition_fragment_C(mma_rope, Shape<Int<kBlockM>, Int<kBlockN>>{});
  Tensor tSrT = partition_fragment_C(mma_nope, Shape<Int<kBlockM>, Int<kBlockN>>{});
  Tensor tScS = thr_rope.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  // O: this WG's two output groups (2 wg, 2 wg + 1) of 128 channels,
  // (MMA, 1, 2); block j is group 2 wg + j.
  constexpr int kPVBlocks = decode_cfg::kHeadDimVPerWG / Tr::kGroupChannels;  // 2
  Tensor tOrO = partition_fragment_C(mma_pv, Shape<Int<kBlockM>, Int<decode_cfg::kHeadDimVPerWG>>{});
  Tensor tOcO = thr_pv.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<decode_cfg::kHeadDimVPerWG>>{}));
  static_assert(size(tSrS) == kBlockN / 2, "two rows x N/4 columns per thread");
  static_assert(size(tSrT) == size(tSrS), "QK accumulators share the m64n64 layout");
  static_assert(decltype(size<2>(tOrO))::value == kPVBlocks, "one WGMMA block per output group");
  const int rows[2] = {int(get<0>(tScS(0))), int(get<0>(tScS(2)))};

  auto stage_of = [](int i) { return i % Tr::kNumStages; };
  auto phase_of = [](int i) { return uint32_t(i / Tr::kNumStages) & 1u; };
  auto release = [&](int i) { release_slot(plan, stage_of(i), lane); };
  auto k_nope = [&](int stage) {
    Tensor sK = make_tensor(make_smem_ptr(plan.k[stage]), typename Tr::SmemLayoutK{});
    return thr_nope.partition_fragment_B(sK);  // (MMA, 1, 16)
  };
  auto k_rope = [&](int stage) {
    Rope* base = reinterpret_cast<Rope*>(plan.k[stage] + Tr::kRopeOffset);
    Tensor sKR = make_tensor(make_smem_ptr(base), typename Tr::SmemLayoutKRope{});
    return thr_rope.partition_fragment_B(sKR);  // (MMA, 1, 4)
  };

  // The page's token scales by group into this WG's scale_table, 0 for tokens
  // past the chunk (slots there may hold NaN, and P would compute 0 * NaN);
  // n_g, the page's largest scale per group. Every warp reads all 64 tokens
  // (two per lane) and reduces n_g itself (REDUX: positive floats order as
  // their bit patterns; negative or NaN scales, which the quantizer never
  // writes, count as 0, and a group without any gets 1); warp w writes
  // group w's row.
  auto tabulate_scales = [&](int i, int valid, float (&n)[kGroups]) {
    const uint32_t slot = smem_addr(plan.k[stage_of(i)]);
    const float4 s0 = ds_token_scales(slot, 2 * lane, valid);
    const float4 s1 = ds_token_scales(slot, 2 * lane + 1, valid);
    const float mine[kGroups][2] = {{s0.x, s1.x}, {s0.y, s1.y}, {s0.z, s1.z}, {s0.w, s1.w}};
    CUTE_UNROLL
    for (int g = 0; g < kGroups; ++g) {
      auto bits = [](float x) { return x > 0.f ? __float_as_uint(x) : 0u; };
      const uint32_t m = __reduce_max_sync(0xffffffffu, max(bits(mine[g][0]), bits(mine[g][1])));
      n[g] = m != 0u ? __uint_as_float(m) : 1.f;
    }
    const float2 row = warp == 0 ? make_float2(s0.x, s1.x)
                       : warp == 1 ? make_float2(s0.y, s1.y)
                       : warp == 2 ? make_float2(s0.z, s1.z)
                                   : make_float2(s0.w, s1.w);
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(smem_addr(&plan.scale_table[wg][warp][2 * lane])),
                 "f"(row.x), "f"(row.y)
                 : "memory");
    named_barrier_sync(NamedBarriers(int(NamedBarriers::kScalesReady0) + wg), 128);
  };
  // k_scale[t, g] of this thread's 16 tokens (TokenScales).
  auto load_group_scales = [&](int g) {
    TokenScales k;
    const uint32_t base = smem_addr(&plan.scale_table[wg][g][2 * (lane % 4)]);
    CUTE_UNROLL
    for (int j = 0; j < 8; ++j) {
      asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(k.pair[j].x), "=f"(k.pair[j].y) : "r"(base + 32 * j)
                   : "memory");
    }
    return k;
  };

  // S of page i, owned by this WG: the chain described above, in steps that
  // the caller interleaves with its V^T transposes. s_begin waits for the
  // slot, issues RoPE into S and T_0 into T, and tabulates the scales;
  // s_group(i, g) (g = 0..3) waits for T_g, promotes it into S and issues
  // T_{g+1}.
  constexpr int kGroupSteps = Tr::kGroupChannels / 32;
  auto s_begin = [&](int i, int valid, float (&n)[kGroups]) __attribute__((always_inline)) {
    const int st = stage_of(i);
    stamp(args, wg, i, event_trace::kSWaitStart);
    mbarrier_wait(&plan.k_full[st], phase_of(i));
    stamp(args, wg, i, event_trace::kSLeftLanded);
    Tensor tSrKN = k_nope(st);
    Tensor tSrKR = k_rope(st);
    auto q_ops = q_operands();
    warpgroup_fence_operand(tSrS);
    warpgroup_fence_operand(tSrT);
    warpgroup_arrive();
    wgmma_k_steps(mma_rope, cute::get<1>(q_ops), tSrKR, tSrS, false);
    wgmma_k_steps<kGroupSteps>(mma_nope, cute::get<0>(q_ops), tSrKN, tSrT, false);
    warpgroup_commit_batch();
    tabulate_scales(i, valid, n);
  };
  auto s_group = [&](int i, int g) __attribute__((always_inline)) {
    warpgroup_wait<0>();
    warpgroup_fence_operand(tSrS);
    warpgroup_fence_operand(tSrT);
    const TokenScales k = load_group_scales(g);
    CUTE_UNROLL
    for (int v = 0; v < size(tSrS); ++v) tSrS(v) = fmaf(k(v), tSrT(v), tSrS(v));
    if (g + 1 < kGroups) {
      wgmma_batch<kGroupSteps>(mma_nope, cute::get<0>(q_operands()), k_nope(stage_of(i)), tSrT, false,
                               (g + 1) * kGroupSteps);
    } else {
      warpgroup_fence_operand(tSrS);
    }
  };
  // Scores in q.k units: times q's row scale (into `out`, which may be S).
  auto apply_q_scale = [&](const auto& s, auto& out) {
    const float qs[2] = {plan.q_scale[rows[0]], plan.q_scale[rows[1]]};
    CUTE_UNROLL
    for (int v = 0; v < size(s); ++v) out(v) = s(v) * qs[fragment_row_half(v)];
  };

  // N_g = max(N_g, n_g); shrink_g = N_old / N_new (0 before the chunk's
  // first page, where O is not read). One division per group and page.
  auto grow_norm = [](float (&norm)[kGroups], const float (&n)[kGroups], float (&shrink)[kGroups]) {
    CUTE_UNROLL
    for (int g = 0; g < kGroups; ++g) {
      const float grown = fmaxf(norm[g], n[g]);
      shrink[g] = __fdividef(norm[g], grown);
      norm[g] = grown;
    }
  };
  auto adopt_norm = [](float (&norm)[kGroups], const float* ref, float (&shrink)[kGroups]) {
    CUTE_UNROLL
    for (int g = 0; g < kGroups; ++g) {
      const float now = ref[g];
      shrink[g] = __fdividef(norm[g], now);
      norm[g] = now;
    }
  };
  auto publish = [&](const OnlineSoftmaxState& softmax, const float (&norm)[kGroups], int role) {
    if ((lane & 3) == 0) {
      plan.ref_max[role][rows[0]] = softmax.max[0];
      plan.ref_max[role][rows[1]] = softmax.max[1];
    }
    if (tid == 0) *reinterpret_cast<float4*>(plan.ref_norm[role]) = make_float4(norm[0], norm[1], norm[2], norm[3]);
  };
  auto adopt_max = [&](OnlineSoftmaxState& softmax, int role, float (&factor)[2]) {
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      const float m = plan.ref_max[role][rows[h]];
      factor[h] = m == -INFINITY ? 1.f : exp2_ftz((softmax.max[h] - m) * scale_log2);
      softmax.max[h] = m;
      softmax.sum[h] *= factor[h];
    }
  };
  // P_g = e4m3(p * k_scale[t, g] * kPNormalizer / N_g) of this WG's page, all four groups.
  auto store_p_groups = [&](const decltype(tSrS)& tP, int role, const float (&norm)[kGroups]) {
    CUTE_UNROLL
    for (int g = 0; g < kGroups; ++g) {
      // (Not a generic lambda, nor one capturing the scales: both made cudafe++ crash.)
      TokenScales k = load_group_scales(g);
      k.scale_by(Tr::kPNormalizer * rcp_ftz(norm[g]));  // exact: N_g is a power of two
      store_p_e4m3<Tr, kBlockN / 16>(smem_addr(plan.p[role][g]), warp, lane, tP, k, 0);
    }
  };
  // O_g *= factor(row) * shrink_g for this WG's groups (no WGMMA reads O here);
  // skipped when nothing moved, as on most pages.
  auto rescale_o = [&](const float (&factor)[2], const float (&shrink)[kGroups], bool accumulate) {
    CUTE_UNROLL
    for (int j = 0; j < kPVBlocks; ++j) {
      const float sh = wg == 0 ? shrink[j] : shrink[2 + j];  // group 2 wg + j, without dynamic indexing
      if (accumulate && (factor[0] != 1.f || factor[1] != 1.f || sh != 1.f)) {
        const float f[2] = {factor[0] * sh, factor[1] * sh};
        Tensor tOrOj = tOrO(_, _, j);
        CUTE_UNROLL
        for (int v = 0; v < size(tOrOj); ++v) tOrOj(v) *= f[fragment_row_half(v)];
      }
    }
  };
  // O_g (+)= P_g V_g of page role `role` (0: A, 1: B) for this WG's two groups.
  auto issue_pv = [&](int role, bool accumulate) __attribute__((always_inline)) {
    warpgroup_fence_operand(tOrO);
    warpgroup_arrive();
    CUTE_UNROLL
    for (int j = 0; j < kPVBlocks; ++j) {
      Tensor sP = make_tensor(make_smem_ptr(plan.p[role][2 * wg + j]), typename Tr::SmemLayoutP{});
      Tensor sV = make_tensor(make_smem_ptr(plan.vt[role]), typename Tr::SmemLayoutV{});
      Tensor tOrOj_mn = tOrO(_, _, j);  // (MMA, 1) -> (MMA, 1, 1), the rank gemm() expects of C
      Tensor tOrOj = make_tensor(tOrOj_mn.data(), append<3>(tOrOj_mn.layout(), Layout<_1, _0>{}));
      wgmma_k_steps(mma_pv, thr_pv.partition_fragment_A(sP),
                    thr_pv.partition_fragment_B(local_tile(
                        sV, Shape<Int<Tr::kGroupChannels>, Int<kBlockN>>{}, make_coord(wg * kPVBlocks + j, 0))),
                    tOrOj, accumulate);
    }
    warpgroup_commit_batch();
  };

  int it = 0;  // pages consumed by this CTA, across chunks (ring position)
  struct PagePair {
    bool has_b;
    int ia, ib;
  };
  auto take_pair = [&](int page, int page_end) {
    const PagePair pair{page + 1 < page_end, it, it + 1};
    it += pair.has_b ? 2 : 1;
    return pair;
  };
  // begin_split_idx is re-read from global memory at the epilogue: held in a
  // register for the whole CTA it was the last value ptxas spilled.
  SchedMeta walk = meta;
  walk.begin_split_idx = 0;
  for (int b = walk.begin_batch; b <= walk.end_batch; ++b) {
    const Chunk c = make_chunk(p, walk, b);
    stamp(args, wg, it, event_trace::kChunkStart);
    load_q_ds(args, plan, c.batch, head_k, m_block, ctid, b - walk.begin_batch);
    stamp(args, wg, it, event_trace::kQLoaded);

    int limit[2];
    const int min_limit = visible_limits(p, c, c.seqlen, m_block, rows, limit);
    auto mask = [&](auto& tS, int page) {
      if (page * kBlockN + kBlockN > min_limit) mask_invisible(tS, tScS, page * kBlockN, limit);
    };

    OnlineSoftmaxState softmax;
    softmax.reset();
    // Running N_g: the largest k_scale[., g] of the chunk's tokens so far. O_g
    // holds (true O_g) * kPNormalizer / N_g.
    float norm[kGroups] = {0.f, 0.f, 0.f, 0.f};
    // O is written (not accumulated) by the chunk's first P V.
    bool accumulate = false;
    const int page_begin = c.first_page(), page_end = c.end_page();

    // One pair loop per warpgroup (see consumer()).
    if (wg == 0) {
      for (int page = page_begin; page < page_end; page += 2) {
        const PagePair pair = take_pair(page, page_end);  // (no structured binding: the lambdas below capture)
        const bool has_b = pair.has_b;
        const int ia = pair.ia, ib = pair.ib;
        stamp(args, 0, ia, event_trace::kPairTop);
        // ---------------------------------------------------- WG0: page A
        const int valid_a = c.end_token - page * kBlockN;
        float n[kGroups], factor[2], shrink[kGroups];
        {
          Element* slot = plan.k[stage_of(ia)];
          s_begin(ia, valid_a, n);
          transpose_v<Tr>(slot, plan.vt[0], plan.zeros, 0, tid, valid_a);
          s_group(ia, 0);
          s_group(ia, 1);
          s_group(ia, 2);
          s_group(ia, 3);
        }
        stamp(args, 0, ia, event_trace::kPairSRetired);
        release(ia);  // WG0's reads of slot A: S_A, V^T_A,L and the scales
        apply_q_scale(tSrS, tSrS);
        mask(tSrS, page);
        float page_max[2];
        row_max(tSrS, page_max);
        softmax.template update<Tr::kLazyRescaleLog2>(tSrS, page_max, scale_log2, factor);
        grow_norm(norm, n, shrink);
        publish(softmax, norm, 0);
        store_p_groups(tSrS, 0, norm);
        stamp(args, 0, ia, event_trace::kPairStored);
        fence_proxy_async_smem();
        named_barrier_sync(NamedBarriers::kPageAReady, kConsumers);
        stamp(args, 0, ia, event_trace::kPairAReady);
        rescale_o(factor, shrink, accumulate);
        issue_pv(0, accumulate);
        accumulate = true;
        if (has_b) {
          // ------------------------------------------ WG0: page B's left half
          const int valid_b = c.end_token - (page + 1) * kBlockN;
          mbarrier_wait(&plan.k_full[stage_of(ib)], phase_of(ib));
          transpose_v<Tr>(plan.k[stage_of(ib)], plan.vt[1], plan.zeros, 0, tid, valid_b);
          stamp(args, 0, ib, event_trace::kPairStored);
          fence_proxy_async_smem();
          release(ib);  // V^T_B,L was WG0's only read of slot B
          named_barrier_sync(NamedBarriers::kPageBReady, kConsumers);
          stamp(args, 0, ia, event_trace::kPairBReady);
          warpgroup_wait<0>();
          warpgroup_fence_operand(tOrO);
          stamp(args, 0, ia, event_trace::kPairPvRetired);
          adopt_max(softmax, 1, factor);
          adopt_norm(norm, plan.ref_norm[1], shrink);
          rescale_o(factor, shrink, true);
          issue_pv(1, true);
        }
        warpgroup_wait<0>();
        warpgroup_fence_operand(tOrO);
        stamp(args, 0, ia, event_trace::kPairEnd);
      }
    } else {
      for (int page = page_begin; page < page_end; page += 2) {
        const PagePair pair = take_pair(page, page_end);
        const bool has_b = pair.has_b;
        const int ia = pair.ia, ib = pair.ib;
        stamp(args, 1, ia, event_trace::kPairTop);
        // ---------------------------------------------------- WG1: page B
        const int valid_a = c.end_token - page * kBlockN;
        const int valid_b = c.end_token - (page + 1) * kBlockN;
        float n[kGroups], factor[2], shrink[kGroups], page_max[2];
        auto& tSrSb = tSrS;
        if (has_b) {
          // V^T_A,R in the chain's first two gaps, V^T_B,R in the last two.
          Element* slot_a = plan.k[stage_of(ia)];
          Element* slot_b = plan.k[stage_of(ib)];
          s_begin(ib, valid_b, n);
          mbarrier_wait(&plan.k_full[stage_of(ia)], phase_of(ia));
          transpose_v<Tr>(slot_a, plan.vt[0], plan.zeros, 1, tid, valid_a);
          transpose_v<Tr>(slot_b, plan.vt[1], plan.zeros, 1, tid, valid_b);
          s_group(ib, 0);
          s_group(ib, 1);
          s_group(ib, 2);
          s_group(ib, 3);
          stamp(args, 1, ia, event_trace::kPairSRetired);
          release(ib);  // WG1's reads of slot B: S_B, V^T_B,R and the scales
          apply_q_scale(tSrSb, tSrSb);
          mask(tSrSb, page + 1);
          row_max(tSrSb, page_max);
        } else {
          mbarrier_wait(&plan.k_full[stage_of(ia)], phase_of(ia));
          transpose_v<Tr>(plan.k[stage_of(ia)], plan.vt[0], plan.zeros, 1, tid, valid_a);
        }
        stamp(args, 1, ia, event_trace::kPairStored);
        fence_proxy_async_smem();
        release(ia);  // V^T_A,R was WG1's only read of slot A
        named_barrier_sync(NamedBarriers::kPageAReady, kConsumers);
        stamp(args, 1, ia, event_trace::kPairAReady);
        adopt_max(softmax, 0, factor);
        adopt_norm(norm, plan.ref_norm[0], shrink);
        rescale_o(factor, shrink, accumulate);
        issue_pv(0, accumulate);
        accumulate = true;
        if (has_b) {
          softmax.template update<Tr::kLazyRescaleLog2>(tSrSb, page_max, scale_log2, factor);
          grow_norm(norm, n, shrink);
          publish(softmax, norm, 1);
          store_p_groups(tSrSb, 1, norm);
        }
        warpgroup_wait<0>();
        warpgroup_fence_operand(tOrO);
        stamp(args, 1, ia, event_trace::kPairPvRetired);
        if (has_b) {
          fence_proxy_async_smem();
          named_barrier_sync(NamedBarriers::kPageBReady, kConsumers);
          stamp(args, 1, ia, event_trace::kPairBReady);
          rescale_o(factor, shrink, true);
          issue_pv(1, true);
          warpgroup_wait<0>();
          warpgroup_fence_operand(tOrO);
        }
        stamp(args, 1, ia, event_trace::kPairEnd);
      }
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(tOrO);
    release_q(args, plan, lane);  // the V^T and P tiles may take the next chunk's q
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
    Chunk ce = c;
    ce.split_idx = c.batch == meta.begin_batch ? __ldg(&p.sched_meta[blockIdx.x].begin_split_idx) : 0;
    share_row_sums(plan, softmax, wg, tid, rows);
    stamp(args, wg, it - 1, event_trace::kSumsShared);
    epilogue(p, plan, ce, head_k, m_block, wg, tid, softmax, tOrO, tOcO, rows, p.softmax_scale, 1.f);
    stamp(args, wg, it - 1, event_trace::kEpilogueDone);
  }
}

}  // namespace jax_flash_mla::sm90
