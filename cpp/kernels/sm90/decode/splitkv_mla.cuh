// Hopper (sm_90a) split-KV MLA decode: the kernel skeleton and its host
// launcher, templated on the cache format through Traits<kFormat>.
//
// Grid:  (num_sm_parts, num_heads_k, num_m_blocks); block: 384 threads.
//   blockIdx.x  partition ("SM part") of the scheduler metadata: a run of
//               (batch, token range) chunks, DESIGN.md "Split-KV scheduling";
//   blockIdx.y  KV head hk;  blockIdx.z  tile of 64 query rows of that head.
// Warp roles:
//   warps 0-3 (WG0), 4-7 (WG1)  consumers. bf16 / fp8_per_tensor (consumer()):
//                               pages in pairs (A, B); WG0 computes S and the
//                               softmax of A, WG1 of B, each accumulates both
//                               pages into its half of O's 512 columns.
//                               fp8_ds_mla (consumer_ds): each WG computes S on
//                               half of every page's tokens, meeting the other
//                               at kMaxReady / kPReady per page;
//   warps 8-11 (WG2)            producer: one lane walks the same chunks and
//                               streams K pages by TMA into a kNumStages-slot ring; the
//                               warpgroup gives its registers to the consumers.
// Slots (bf16 / fp8_per_tensor: each of their two parts) are handed back
// through k_empty once the WGMMAs and transposes that read them are done.
//
// Format differences come from Traits<kFormat>; the few code paths that
// differ are `if constexpr` on its flags:
//   kVNeedsTranspose (fp8_per_tensor): FP8 WGMMA reads B only K-major, so each
//     consumer WG transposes its 256 V channels of the page into V^T (while its
//     S WGMMA runs) and zeroes the tokens past the chunk there, instead of
//     zeroing them in the K slot; P is stored as e4m3.
//   kUsesDescale: descale_q * descale_k (device scalars) fold into the softmax
//     scale, and descale_k multiplies the output (partials too, so the combine
//     stays format-agnostic); lse is of the scaled logits.
//   kScaleGroups (fp8_ds_mla): the producer loads eleven slabs per page
//     (load_ds_page) and the consumers run consumer_ds (design A of
//     docs/NUMERICS.md: q quantized in the prologue, per-group promoted QK and
//     PV, P per output group); consumer() is not instantiated for it.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>

#include "config.h"
#include "params.h"
#include "kernels/launch.h"
#include "kernels/sm90/decode/named_barriers.h"
#include "kernels/sm90/decode/paged_kv_load.h"
#include "kernels/sm90/decode/softmax.h"
#include "kernels/sm90/decode/splitkv_mla.h"
#include "kernels/sm90/decode/traits.h"
#include "kernels/sm90/decode/wgmma.h"

namespace jax_flash_mla::sm90 {

// Everything the kernel needs, passed by value as one __grid_constant__
// parameter: the TMA descriptor must live in param/const/global space
// (PTX ISA "Tensor-map"), and a by-value copy is also what keeps the launch
// CUDA-graph friendly (no device-side state).
struct SplitKvArgs {
  DecodeParams params;
  CUtensorMap k_map;
};

// One (batch, token range) piece of a partition.
struct Chunk {
  int batch;
  int seqlen;       // cache_seqlens[batch]
  int begin_token;  // multiple of the page size
  int end_token;    // exclusive
  int split_idx;    // index among the sequence's splits

  // Pages the chunk touches: [first_page, end_page), never past its last one.
  __device__ __forceinline__ int first_page() const { return begin_token / config::kPageSize; }
  __device__ __forceinline__ int end_page() const { return (end_token + config::kPageSize - 1) / config::kPageSize; }
};

// Lengths are clamped to [0, block_table capacity]: under jit a bad length
// cannot be rejected, and a page index past the table's row would read (and
// TMA-load through) memory that is not this sequence's.
__device__ __forceinline__ Chunk make_chunk(const DecodeParams& p, const SchedMeta& meta, int b) {
  const int capacity = p.max_blocks_per_seq * config::kPageSize;
  Chunk c;
  c.batch = b;
  c.seqlen = min(max(p.cache_seqlens[b], 0), capacity);
  c.end_token = min(b == meta.end_batch ? meta.end_token : c.seqlen, c.seqlen);
  c.begin_token = min(b == meta.begin_batch ? meta.begin_token : 0, c.end_token);
  c.split_idx = b == meta.begin_batch ? meta.begin_split_idx : 0;
  return c;
}

template <class F>
__device__ __forceinline__ void for_each_chunk(const DecodeParams& p, const SchedMeta& meta, F&& f) {
  for (int b = meta.begin_batch; b <= meta.end_batch; ++b) f(make_chunk(p, meta, b));
}

template <config::KvFormat kFormat>
struct SplitKvMlaKernel {
  using Tr = Traits<kFormat>;
  using Element = typename Tr::Element;
  using Plan = typename Tr::SharedMemoryPlan;
  static constexpr int kBlockM = decode_cfg::kBlockM;
  static constexpr int kBlockN = decode_cfg::kBlockN;
  static constexpr int kConsumers = decode_cfg::kNumConsumerThreads;

  // ---------------------------------------------------------------- producer
  __device__ static void producer(const SplitKvArgs& args, Plan& plan, const SchedMeta& meta,
                                  int head_k) {
    const DecodeParams& p = args.params;
    int it = 0;  // pages issued by this CTA, across chunks (ring position)
    for_each_chunk(p, meta, [&](const Chunk& c) {
      const int32_t* table = p.block_table + c.batch * p.block_table_batch_stride;
      for (int page = c.first_page(); page < c.end_page(); ++page, ++it) {
        const int stage = it % Tr::kNumStages;
        const uint32_t phase = (it / Tr::kNumStages) & 1;
        const int block = table[page];
        if constexpr (Tr::kScaleGroups) {
          mbarrier_wait(&plan.k_empty[stage], phase ^ 1);
          load_ds_page<Tr>(&args.k_map, &plan.k_full[stage], plan.k[stage], head_k, block);
        } else {
          // Left part first: the consumers release it first and S starts on it.
          for (int part = 0; part < 2; ++part) {
            mbarrier_wait(&plan.k_empty[stage][part], phase ^ 1);
            load_kv_page_part<Tr>(&args.k_map, &plan.k_full[stage][part], plan.k[stage], head_k, block, part);
          }
        }
      }
    });
  }

  // ------------------------------------------------------- Q tile of a chunk
  // Row r of the tile is query token r / heads_per_head_k of head
  // hk * heads_per_head_k + r % heads_per_head_k (params.h); rows past
  // q_rows_per_head_k are zero-filled (their results are never stored).
  __device__ static void load_q(const DecodeParams& p, Plan& plan, int batch, int head_k, int m_block,
                                int ctid) {
    using namespace cute;
    Tensor sQ = make_tensor(make_smem_ptr(plan.q), typename Tr::SmemLayoutQ{});
    constexpr int kElemsPerChunk = 16 / int(sizeof(Element));
    constexpr int kChunksPerRow = decode_cfg::kHeadDimQK / kElemsPerChunk;  // 16-byte pieces
    const Element* q = static_cast<const Element*>(p.q) + batch * p.q_batch_stride;
    for (int i = ctid; i < kBlockM * kChunksPerRow; i += kConsumers) {
      const int row = i / kChunksPerRow;
      const int col = (i % kChunksPerRow) * kElemsPerChunk;
      const int r = m_block * kBlockM + row;
      const bool valid = r < p.q_rows_per_head_k;
      const int s = valid ? r / p.heads_per_head_k : 0;
      const int h = valid ? head_k * p.heads_per_head_k + r % p.heads_per_head_k : 0;
      const Element* src = q + s * p.q_seq_stride + h * p.q_head_stride + col;
      // cp.async with src-size 0 writes 16 zero bytes (PTX ISA "cp.async").
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(
                       smem_addr(raw_pointer_cast(&sQ(row, col)))),
                   "l"(src), "r"(valid ? 16 : 0)
                   : "memory");
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    fence_proxy_async_smem();  // Q is read by WGMMA (async proxy)
    named_barrier_sync(NamedBarriers::kQReady, kConsumers);
  }

  // ------------------------------------------------------- V^T (FP8 formats)
  // Token order inside V^T rows and P columns ("p_column" below). The V^T
  // transpose moves tokens in pairs (ldmatrix .trans works on 16-bit
  // elements), so within each group of 16 tokens token u lands at column
  //   p_column(u) = 4 ((u % 8) / 2) + 2 (u / 8) + u % 2,
  // i.e. columns 4q..4q+3 hold tokens 2q, 2q+1, 2q+8, 2q+9. P V sums over
  // tokens, so P's columns only have to follow the same order, which is also
  // the order that lets P go out by stmatrix (store_p_e4m3).

  // Four probabilities as e4m3 bytes in one word, lowest address first.
  __device__ __forceinline__ static uint32_t pack_e4m3x4(float a, float b, float c, float d) {
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
    return lo | (hi << 16);
  }

  // Stores a warp's e4m3 P (rows 16 warp .. 16 warp + 15 of the 64-row tile):
  // value v of the S-shaped fragment `s` times scale(v). In p_column order,
  // the accumulator fragment of a thread (rows lane / 4 and + 8, tokens
  // 8j + 2 (lane % 4) + {0, 1}) puts, per row half h and token group k, 4
  // contiguous bytes at columns 16k + 4 (lane % 4): tokens 2q, 2q + 1 of
  // column block 2k and the same of block 2k + 1. That is exactly a thread's
  // element of an 8x8 b16 stmatrix tile (row lane / 4, bytes 4 (lane % 4) ..):
  // words[h][k] goes to tile (h, first_group + k).
  template <int kTokenGroups, class Frag, class Scale>
  __device__ static void store_p_e4m3(uint32_t p_tile, int warp, int lane, const Frag& s, Scale scale,
                                      int first_group) {
    static_assert(kTokenGroups % 2 == 0, "two token groups x two row halves per stmatrix.x4");
    uint32_t words[2][kTokenGroups];
    CUTE_UNROLL
    for (int k = 0; k < kTokenGroups; ++k) {
      CUTE_UNROLL
      for (int h = 0; h < 2; ++h) {
        const int v = 8 * k + 2 * h;  // column block 2k (v) and 2k + 1 (v + 4), row half h
        words[h][k] = pack_e4m3x4(s(v) * scale(v), s(v + 1) * scale(v + 1), s(v + 4) * scale(v + 4),
                                  s(v + 5) * scale(v + 5));
      }
    }
    const typename Tr::SmemLayoutP layout_p{};
    const int m = lane / 8;  // the matrix whose row this lane addresses: (h, k) = (m % 2, m / 2)
    const int row = 16 * warp + 8 * (m % 2) + lane % 8;
    CUTE_UNROLL
    for (int pair = 0; pair < kTokenGroups / 2; ++pair) {
      const int col = 16 * (first_group + 2 * pair + m / 2);
      asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(
                       p_tile + uint32_t(layout_p(row, col))),
                   "r"(words[0][2 * pair]), "r"(words[1][2 * pair]), "r"(words[0][2 * pair + 1]),
                   "r"(words[1][2 * pair + 1])
                   : "memory");
    }
  }

  // Consumer WG `wg` writes V^T[c][p_column(t)] = K[t][c] for its channels
  // c in [256 wg, 256 wg + 256) and the page's 64 tokens, with zeros for tokens
  // t >= `valid` (slots past the chunk's end may hold NaN, 0x7F / 0xFF in e4m3,
  // and 0 * NaN = NaN in P V): their ldmatrix rows point at a 16-byte zero
  // row instead, so the code stays branch-free while this WG's S WGMMA runs.
  // Per warp, eight blocks of 16 tokens x 32 channels (512 bytes), each:
  //   ldmatrix.x4.trans: matrix m = tokens 8 (m % 2) + 0..7 x channels
  //     16 (m / 2) + 0..15 as 8x8 b16; lane i gets, of channels c, c + 1
  //     (c = 2 (i / 4) [+ 16 for m >= 2]), tokens 2q, 2q + 1 (q = i % 4)
  //     [+ 8 for odd m], one register per matrix;
  //   two PRMT per matrix pair: channel c's bytes of tokens 2q, 2q+1, 2q+8,
  //     2q+9 in one register, channel c + 1's in the other;
  //   stmatrix.x4: row r of a matrix is one channel's 16 token bytes. Rows of
  //     the first matrix hold channels 0, 2, 4, 6, 9, 11, 13, 15 (the second
  //     the others): with the 64-byte swizzle those 8 rows fall in 8 distinct
  //     16-byte bank groups (even channels only would conflict 2-way), the
  //     per-lane choice costing nothing (a PRMT selector register).
  // The loads are conflict-free too (8 consecutive tokens of one swizzle
  // unit). The writer's fence.proxy.async and a barrier both WGs pass (a
  // page-ready barrier, or kPReady) order the stores before the P V WGMMA.
  __device__ static void transpose_v(const Element* k_slot, Element* vt, const Element* zeros, int wg, int tid,
                                     int valid) {
    static_assert(sizeof(Element) == 1, "byte transpose");
    const typename Tr::SmemLayoutK layout_k{};
    const typename Tr::SmemLayoutV layout_vt{};
    const uint32_t k_base = smem_addr(k_slot);
    const uint32_t vt_base = smem_addr(vt);
    const uint32_t zero_row = smem_addr(zeros);
    const int lane = tid % 32;
    const int m = lane / 8, r = lane % 8;  // the matrix and row this lane addresses
    const int ld_token = 8 * (m % 2) + r;
    const int ld_channel = 16 * (m / 2);
    const bool odd_first = r >= 4;  // stmatrix rows: see above
    const int st_channel = 16 * (m / 2) + 2 * r + ((m % 2) ^ int(odd_first));
    // This lane's registers go to stmatrix row lane / 4.
    const bool lane_odd_first = lane / 4 >= 4;
    const uint32_t sel_first = lane_odd_first ? 0x7531u : 0x6420u;
    const uint32_t sel_second = lane_odd_first ? 0x6420u : 0x7531u;
    const int warp_channels = wg * decode_cfg::kHeadDimVPerWG + (tid / 32) * 64;
    CUTE_UNROLL
    for (int block = 0; block < 8; ++block) {
      const int ch0 = warp_channels + (block / 4) * 32;
      const int t0 = (block % 4) * 16;
      const int token = t0 + ld_token;
      const uint32_t src = token < valid ? k_base + uint32_t(layout_k(token, ch0 + ld_channel)) : zero_row;
      uint32_t d[4];
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                   : "r"(src)
                   : "memory");  // stays after the k_full wait
      const uint32_t o0 = __byte_perm(d[0], d[1], sel_first), o1 = __byte_perm(d[0], d[1], sel_second);
      const uint32_t o2 = __byte_perm(d[2], d[3], sel_first), o3 = __byte_perm(d[2], d[3], sel_second);
      asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(
                       vt_base + uint32_t(layout_vt(ch0 + st_channel, t0))),
                   "r"(o0), "r"(o1), "r"(o2), "r"(o3)
                   : "memory");
    }
  }

  // ------------------------------------------ per-page steps of both consumers
  // Each consumer warp hands a K slot back once its share of the WGMMAs
  // reading it has retired (k_empty counts 8 warp arrivals).
  __device__ static void release_slot(Plan& plan, int stage, int lane) {
    __syncwarp();
    mbarrier_arrive_if(&plan.k_empty[stage], lane == 0);
  }

  // Visible keys of this thread's two rows within the chunk: tokens below
  // limit[h] (causal: query s of s_q sees keys [0, L - s_q + s]). Returns the
  // tile's smallest limit: pages below it need no mask.
  __device__ static int visible_limits(const DecodeParams& p, const Chunk& c, int seqlen, int m_block,
                                       const int (&rows)[2], int (&limit)[2]) {
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      const int r = m_block * kBlockM + rows[h];
      limit[h] = c.end_token;
      if (p.causal) limit[h] = min(limit[h], seqlen - p.seqlen_q + 1 + r / p.heads_per_head_k);
    }
    return p.causal ? min(c.end_token, seqlen - p.seqlen_q + 1) : c.end_token;
  }

  // Mask by selection, never by arithmetic: the scores of slots past the
  // sequence may be NaN. tok0 is the first token of this WG's half of the page.
  template <class TensorS, class TensorC>
  __device__ static void mask_invisible(TensorS& tSrS, const TensorC& tScS, int tok0, const int (&limit)[2]) {
    CUTE_UNROLL
    for (int v = 0; v < cute::size(tSrS); ++v) {
      if (tok0 + int(cute::get<1>(tScS(v))) >= limit[fragment_row_half(v)]) tSrS(v) = -INFINITY;
    }
  }

  // Row maxima of the page: each WG holds half of its tokens, so the two
  // exchange theirs and both halves of P share one reference.
  template <class TensorS>
  __device__ static void page_row_max(Plan& plan, const TensorS& tSrS, int it, int wg, int lane,
                                      const int (&rows)[2], float (&page_max)[2]) {
    row_max(tSrS, page_max);
    float(*xmax)[kBlockM] = plan.row_max[it & 1];
    if ((lane & 3) == 0) {
      xmax[wg][rows[0]] = page_max[0];
      xmax[wg][rows[1]] = page_max[1];
    }
    named_barrier_sync(NamedBarriers::kMaxReady, kConsumers);
    page_max[0] = fmaxf(page_max[0], xmax[wg ^ 1][rows[0]]);
    page_max[1] = fmaxf(page_max[1], xmax[wg ^ 1][rows[1]]);
  }

  // --------------------------------------------------------------- consumer
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
  //        every WGMMA, C7515) -> retire -> publish P_B, m_B (kPageBReady)
  //        -> rescale -> P_B V_B,R
  // WG w hands back part w of both slots (the left part holds V_L, the
  // right one V_R and RoPE); the other WG's reads of that part (its S) have
  // retired before the pair's ready barrier it passed.
  __device__ static void consumer(const SplitKvArgs& args, Plan& plan, const SchedMeta& meta,
                                  int head_k, int m_block, int wg, int tid) {
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
    Tensor tOrO = partition_fragment_C(mma_pv, Shape<Int<kBlockM>, Int<decode_cfg::kHeadDimVPerWG>>{});
    Tensor tScS = thr_qk.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
    Tensor tOcO = thr_pv.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<decode_cfg::kHeadDimVPerWG>>{}));
    static_assert(size(tSrS) == kBlockN / 2, "two rows x N/4 columns per thread");
    // The two rows this thread holds (fragment row halves 0 and 1).
    const int rows[2] = {int(get<0>(tScS(0))), int(get<0>(tScS(2)))};
    constexpr int kSteps = decltype(size<2>(tSrQ))::value;
    constexpr int kLeftSteps = kSteps * decode_cfg::kLeftSlabs / decode_cfg::kSlabs;
    static_assert(kLeftSteps * decode_cfg::kSlabs == kSteps * decode_cfg::kLeftSlabs, "k-steps per slab");

    auto stage_of = [](int i) { return i % Tr::kNumStages; };
    auto phase_of = [](int i) { return uint32_t(i / Tr::kNumStages) & 1u; };
    auto release = [&](int i) {  // this WG's part of page i's slot
      __syncwarp();
      mbarrier_arrive_if(&plan.k_empty[stage_of(i)][wg], lane == 0);
    };
    auto p_tile = [&](int page_role) {  // 0: page A, 1: page B
      return make_tensor(make_smem_ptr(plan.p[Tr::kNumPTiles == 1 ? 0 : page_role]), typename Tr::SmemLayoutP{});
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

    // S = Q K^T of page i over the 576 channels; the left part's k-steps
    // are issued while the right part may still be landing.
    // (always_inline: called from three places, it would otherwise become a
    // call, with the accumulators passed through the stack.)
    auto issue_s = [&](int i) __attribute__((always_inline)) {
      Tensor sK = make_tensor(make_smem_ptr(plan.k[stage_of(i)]), typename Tr::SmemLayoutK{});
      Tensor tSrK = thr_qk.partition_fragment_B(sK);
      warpgroup_fence_operand(tSrS);
      mbarrier_wait(&plan.k_full[stage_of(i)][0], phase_of(i));
      warpgroup_arrive();
      wgmma_k_steps<kLeftSteps>(mma_qk, tSrQ, tSrK, tSrS, false);
      mbarrier_wait(&plan.k_full[stage_of(i)][1], phase_of(i));
      warpgroup_arrive();  // after the wait loop's branch, or ptxas serializes (C7520)
      wgmma_k_steps<kSteps - kLeftSteps>(mma_qk, tSrQ, tSrK, tSrS, true, kLeftSteps);
      warpgroup_commit_batch();
    };
    // O_w (+)= P V_w with P from shared memory ...
    auto issue_pv_smem = [&](int i, int page_role, bool accumulate) __attribute__((always_inline)) {
      wgmma_batch(mma_pv, thr_pv.partition_fragment_A(p_tile(page_role)), v_operand(i, page_role), tOrO, accumulate);
    };
    // ... or with the WG's own P (fp32 probabilities in the S fragment)
    // rounded to bf16 in registers.
    auto issue_pv_regs = [&](const auto& tP, int i, int page_role, bool accumulate) __attribute__((always_inline)) {
      if constexpr (Tr::kOwnPInRegisters) {
        typename Tr::TiledMmaPVRegs mma_pv_regs;
        auto thr_pv_regs = mma_pv_regs.get_thread_slice(tid);
        Tensor tOrP = thr_pv_regs.partition_fragment_A(p_tile(page_role));  // registers, (MMA, 1, 4)
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
    auto store_p = [&](const auto& tP, int page_role) {
      if constexpr (std::is_same_v<Element, cutlass::bfloat16_t>) {
        Tensor sP = p_tile(page_role);
        CUTE_UNROLL
        for (int v = 0; v < size(tP); v += 2) {
          *reinterpret_cast<__nv_bfloat162*>(raw_pointer_cast(&sP(get<0>(tScS(v)), get<1>(tScS(v))))) =
              __floats2bfloat162_rn(tP(v), tP(v + 1));
        }
      } else {
        static_assert(std::is_same_v<Element, cutlass::float_e4m3_t>);
        store_p_e4m3<kBlockN / 16>(smem_addr(raw_pointer_cast(p_tile(page_role).data())), tid / 32, lane, tP,
                                   [](int) { return 1.f; }, 0);
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
        factor[h] = m == -INFINITY ? 1.f : exp2f((softmax.max[h] - m) * scale_log2);
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
        Tensor sK = make_tensor(make_smem_ptr(plan.k[stage_of(i)]), typename Tr::SmemLayoutK{});
        constexpr int kPiecesPerRow = decode_cfg::kHeadDimV / 8;  // 16-byte pieces
        for (int j = tid; j < (kBlockN - first) * kPiecesPerRow; j += 128) {
          const int t = first + j / kPiecesPerRow;
          *reinterpret_cast<uint4*>(raw_pointer_cast(&sK(t, (j % kPiecesPerRow) * 8))) = make_uint4(0, 0, 0, 0);
        }
      }
    };
    // Publishes this WG's page of the pair (page_role 0: A at kPageAReady by
    // WG0, 1: B at kPageBReady by WG1): stale V rows zeroed, P in its tile;
    // then rescales O by `factor` and queues the WG's own P V.
    auto publish_page = [&](const auto& tP, int i, int page, int page_role, const Chunk& c,
                            const float (&factor)[2], bool accumulate) __attribute__((always_inline)) {
      zero_stale_v(i, page, c);
      store_p(tP, page_role);
      fence_proxy_async_smem();
      // Both WGs pass the ready barrier, so it also orders this WG's own
      // writes (P, zeroed V rows) before its WGMMA reads them.
      named_barrier_sync(page_role == 0 ? NamedBarriers::kPageAReady : NamedBarriers::kPageBReady, kConsumers);
      rescale_o(factor);
      if constexpr (Tr::kOwnPInRegisters) {
        issue_pv_regs(tP, i, page_role, accumulate);
      } else {
        issue_pv_smem(i, page_role, accumulate);
      }
    };
    // Each WG queues its S of the next pair right behind its last P V of this
    // pair when the ring holds three pages or more (fp8_per_tensor); with two
    // (bf16), page B' reuses B's slot, which is free only once P_B V_B
    // retired. Early S also relies on V^T: the K slot is released before the
    // P V that follows it, so nothing is left to release after the S.
    constexpr bool kEarlyS = Tr::kNumStages >= 3;
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
      load_q(p, plan, c.batch, head_k, m_block, ctid);

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
        if (wg == 0 && kEarlyS) issue_s(it);
        if (wg == 1 && kEarlyS && page_begin + 1 < page_end) issue_s(it + 1);
      }

      // One pair loop per warpgroup (the branch outside the loops), so that
      // no control-flow path joins one WG's in-flight WGMMAs with the other's
      // code: ptxas would serialize every WGMMA (C7514).
      if (wg == 0) {
        for (int page = page_begin; page < page_end; page += 2) {
          const auto [has_b, has_next, next_has_b, ia, ib] = take_pair(page, page_end);
          float factor[2];
          // ---------------------------------------------------- WG0: page A
          if (!kEarlyS) issue_s(ia);
          if constexpr (Tr::kVNeedsTranspose) {
            transpose_v(plan.k[stage_of(ia)], plan.vt[0], plan.zeros, 0, tid, c.end_token - page * kBlockN);
          }
          // S_A, and (early S) the last pair's P_B V_B,L queued before it.
          warpgroup_wait<0>();
          warpgroup_fence_operand(tSrS);
          if constexpr (Tr::kVNeedsTranspose) release(ia);  // S_A and V^T_A,L have read the left part
          mask(tSrS, page);
          float page_max[2];
          row_max(tSrS, page_max);
          softmax.template update</*kLazy=*/true>(tSrS, page_max, scale_log2, factor);
          publish_max(softmax, plan.ref_max[0]);
          publish_page(tSrS, ia, page, 0, c, factor, accumulate);
          accumulate = true;
          if (has_b) {
            // ------------------------------------------ WG0: page B's left half
            if constexpr (Tr::kVNeedsTranspose) {
              // V^T_B's last reader (the last pair's P_B V_B,L) retired
              // before this pair's S_A did.
              mbarrier_wait(&plan.k_full[stage_of(ib)][0], phase_of(ib));
              transpose_v(plan.k[stage_of(ib)], plan.vt[1], plan.zeros, 0, tid, c.end_token - (page + 1) * kBlockN);
              fence_proxy_async_smem();
            }
            named_barrier_sync(NamedBarriers::kPageBReady, kConsumers);
            if constexpr (Tr::kVNeedsTranspose) release(ib);  // S_B retired before kPageBReady
            warpgroup_wait<0>();
            warpgroup_fence_operand(tOrO);
            if constexpr (!Tr::kVNeedsTranspose) release(ia);  // P_A V_A,L retired
            adopt_max(softmax, plan.ref_max[1], factor);
            rescale_o(factor);
            issue_pv_smem(ib, 1, true);
            if (kEarlyS && has_next) {
              issue_s(ib + 1);
            } else {
              warpgroup_wait<0>();
              warpgroup_fence_operand(tOrO);
              if constexpr (!Tr::kVNeedsTranspose) release(ib);  // P_B V_B,L retired
            }
          } else {
            warpgroup_wait<0>();
            warpgroup_fence_operand(tOrO);
            if constexpr (!Tr::kVNeedsTranspose) release(ia);
          }
        }
      } else {
        for (int page = page_begin; page < page_end; page += 2) {
          const auto [has_b, has_next, next_has_b, ia, ib] = take_pair(page, page_end);
          float factor[2];
          // ---------------------------------------------------- WG1: page B
          if (!kEarlyS && has_b) issue_s(ib);
          if constexpr (Tr::kVNeedsTranspose) {
            // V^T_A,R was last read by the last pair's P_A V_A,R (retired);
            // V^T_B,R by its P_B V_B,R, queued before S_B.
            mbarrier_wait(&plan.k_full[stage_of(ia)][1], phase_of(ia));
            transpose_v(plan.k[stage_of(ia)], plan.vt[0], plan.zeros, 1, tid, c.end_token - page * kBlockN);
            if (has_b) {
              warpgroup_wait<1>();
              transpose_v(plan.k[stage_of(ib)], plan.vt[1], plan.zeros, 1, tid, c.end_token - (page + 1) * kBlockN);
            }
            fence_proxy_async_smem();
          }
          Tensor tSrSb = make_fragment_like(tSrS);  // the softmax copy (see above)
          float page_max[2];
          if (has_b) {
            warpgroup_wait<0>();
            warpgroup_fence_operand(tSrS);
            if constexpr (Tr::kVNeedsTranspose) release(ib);  // S_B and V^T_B,R have read the right part
            CUTE_UNROLL
            for (int v = 0; v < size(tSrS); ++v) tSrSb(v) = tSrS(v);
            mask(tSrSb, page + 1);
            row_max(tSrSb, page_max);
          } else {
            warpgroup_wait<0>();  // the last pair's P_B V_B,R
          }
          named_barrier_sync(NamedBarriers::kPageAReady, kConsumers);
          if constexpr (Tr::kVNeedsTranspose) release(ia);  // S_A retired before kPageAReady
          adopt_max(softmax, plan.ref_max[0], factor);
          rescale_o(factor);
          issue_pv_smem(ia, 0, accumulate);
          accumulate = true;
          if (has_b) {
            softmax.template update</*kLazy=*/true>(tSrSb, page_max, scale_log2, factor);
            publish_max(softmax, plan.ref_max[1]);
          }
          // P_A V_A,R retires before P_B may overwrite P_A's tile (bf16) and
          // before O is rescaled.
          warpgroup_wait<0>();
          warpgroup_fence_operand(tOrO);
          if constexpr (!Tr::kVNeedsTranspose) release(ia);
          if (has_b) {
            publish_page(tSrSb, ib, page + 1, 1, c, factor, true);
            if (kEarlyS && next_has_b) {
              issue_s(ib + 2);
            } else {
              warpgroup_wait<0>();
              warpgroup_fence_operand(tOrO);
              if constexpr (!Tr::kVNeedsTranspose) release(ib);
            }
          }
        }
      }
      // Nothing is in flight here; ptxas cannot tell (it would serialize every
      // WGMMA, C7514), so say it.
      warpgroup_wait<0>();
      warpgroup_fence_operand(tOrO);
      epilogue(p, plan, c, head_k, m_block, wg, tid, softmax, tOrO, tOcO, rows, logit_scale, out_scale);
    }
  }

  // ============================================ fp8_ds_mla (Tr::kScaleGroups)
  // Design A of docs/NUMERICS.md; Traits<kFp8DsMla> has the arithmetic and the
  // shared-memory plan. Only instantiated for that format.

  // Q prologue: the 64 bf16 RoPE channels go to q_rope by cp.async; the 512
  // NoPE channels are quantized to e4m3 per (row, 128-channel group) with the
  // fp32 scale amax / 448 (1 for an all-zero group), q / scale rounded to
  // nearest even and saturated. 256 consumer threads = 64 rows x 4 groups:
  // thread (row, g) = (ctid / 4, ctid % 4) loads its 256 bytes, reduces, and
  // writes 128 e4m3 bytes and q_scale[row][g]. Rows past q_rows_per_head_k are
  // zeros (scale 1); their results are never stored.
  __device__ static void load_q_ds(const DecodeParams& p, Plan& plan, int batch, int head_k, int m_block,
                                   int ctid) {
    using namespace cute;
    static_assert(kConsumers == decode_cfg::kBlockM * Tr::kNumGroups, "one thread per (row, group)");
    // Opaque to the compiler: the addresses below are recomputed per chunk
    // rather than hoisted out of the chunk loop into registers (which spilled).
    asm volatile("" : "+r"(ctid));
    Tensor sQR = make_tensor(make_smem_ptr(plan.q_rope), typename Tr::SmemLayoutQRope{});
    const __nv_bfloat16* q = static_cast<const __nv_bfloat16*>(p.q) + batch * p.q_batch_stride;
    auto row_src = [&](int row, bool& valid) {
      const int r = m_block * kBlockM + row;
      valid = r < p.q_rows_per_head_k;
      const int s = valid ? r / p.heads_per_head_k : 0;
      const int h = valid ? head_k * p.heads_per_head_k + r % p.heads_per_head_k : 0;
      return q + s * p.q_seq_stride + h * p.q_head_stride;
    };
    constexpr int kRopePieces = Tr::kHeadDimRope / 8;  // 16-byte pieces per row
    for (int i = ctid; i < kBlockM * kRopePieces; i += kConsumers) {
      const int row = i / kRopePieces;
      const int col = (i % kRopePieces) * 8;
      bool valid;
      const __nv_bfloat16* src = row_src(row, valid) + Tr::kHeadDimNope + col;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(
                       smem_addr(raw_pointer_cast(&sQR(row, col)))),
                   "l"(src), "r"(valid ? 16 : 0)
                   : "memory");
    }
    {
      const int row = ctid / Tr::kNumGroups;
      const int g = ctid % Tr::kNumGroups;
      bool valid;
      const uint4* src = reinterpret_cast<const uint4*>(row_src(row, valid) + g * Tr::kGroupChannels);
      constexpr int kPieces = Tr::kGroupChannels / 8;  // 16 x 8 bf16
      // Two passes over the 256 bytes (the second hits L1), so only a few
      // registers are live next to O, which stays live across chunks.
      auto lo = [](uint32_t w) { return __uint_as_float(w << 16); };
      auto hi = [](uint32_t w) { return __uint_as_float(w & 0xffff0000u); };
      auto load = [&](int i) { return valid ? __ldg(src + i) : make_uint4(0u, 0u, 0u, 0u); };
      float amax = 0.f;
      CUTE_UNROLL
      for (int i = 0; i < kPieces; ++i) {
        const uint4 x = load(i);
        const uint32_t w[4] = {x.x, x.y, x.z, x.w};
        CUTE_UNROLL
        for (int j = 0; j < 4; ++j) amax = fmaxf(amax, fmaxf(fabsf(lo(w[j])), fabsf(hi(w[j]))));
      }
      const float scale = amax > 0.f ? __fdiv_rn(amax, 448.f) : 1.f;
      auto cvt4 = [&](uint32_t w0, uint32_t w1) {  // 4 bf16 -> 4 e4m3 bytes
        const __nv_fp8x2_storage_t a = __nv_cvt_float2_to_fp8x2(
            make_float2(__fdiv_rn(lo(w0), scale), __fdiv_rn(hi(w0), scale)), __NV_SATFINITE, __NV_E4M3);
        const __nv_fp8x2_storage_t b = __nv_cvt_float2_to_fp8x2(
            make_float2(__fdiv_rn(lo(w1), scale), __fdiv_rn(hi(w1), scale)), __NV_SATFINITE, __NV_E4M3);
        return uint32_t(a) | (uint32_t(b) << 16);
      };
      // SW64 e4m3 tile: channel c of row `row` is at slab c / 64 (4 KB each),
      // byte row * 64 + (((c % 64) / 16) ^ ((row >> 1) & 3)) * 16 + c % 16.
      // Computed here in 32 bits (a table of hoisted generic pointers spilled).
      const uint32_t row_base =
          smem_addr(plan.q) + uint32_t((g * Tr::kGroupChannels / 64) * Tr::kSlabBytes + row * 64);
      const int sw = (row >> 1) & 3;
      CUTE_UNROLL
      for (int i = 0; i < kPieces; i += 2) {  // 16 channels -> 16 e4m3 bytes
        const uint4 x0 = load(i), x1 = load(i + 1);
        const uint32_t addr = row_base + uint32_t((i / 8) * Tr::kSlabBytes + ((((i / 2) % 4) ^ sw) << 4));
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(cvt4(x0.x, x0.y)),
                     "r"(cvt4(x0.z, x0.w)), "r"(cvt4(x1.x, x1.y)), "r"(cvt4(x1.z, x1.w))
                     : "memory");
      }
      plan.q_scale[row][g] = scale;
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    fence_proxy_async_smem();  // Q is read by WGMMA (async proxy)
    named_barrier_sync(NamedBarriers::kQReady, kConsumers);
  }

  // Shared-window address of the four fp32 scales of token t in a K slot. The
  // scale slab is 64-byte swizzled like the others: the 16-byte unit of row t
  // is unit 0 XOR ((t >> 1) & 3).
  __device__ static uint32_t ds_scale_addr(uint32_t slot_base, int t) {
    return slot_base + uint32_t(Tr::kScaleSlab * Tr::kSlabBytes + t * 64 + (((t >> 1) & 3) << 4));
  }

  __device__ static void consumer_ds(const SplitKvArgs& args, Plan& plan, const SchedMeta& meta, int head_k,
                                     int m_block, int wg, int tid) {
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
    // of the WG's 32 tokens; these byte offsets (from this thread's first
    // token) locate its 8 tokens' scale rows. (t >> 1) & 3 = lane % 4 for all
    // of them, so the swizzle unit is fixed per thread.
    const int tok_first = wg * kNPerWG + int(get<1>(tScS(0)));  // within the page
    // The 8 tokens among them: value v is token j = 2 (v / 4) + v % 2 of the
    // thread, at offset 8 (j / 2) + j % 2 from tok_first.
    auto token_of = [](int v) { return 2 * (v / 4) + v % 2; };
    auto token_offset = [](int j) { return 8 * (j / 2) + j % 2; };

    auto k_nope = [&](int stage) {
      Tensor sK = make_tensor(make_smem_ptr(plan.k[stage]), typename Tr::SmemLayoutK{});
      return thr_nope.partition_fragment_B(
          local_tile(sK, Shape<Int<kNPerWG>, Int<Tr::kHeadDimNope>>{}, make_coord(wg, 0)));  // (MMA, 1, 16)
    };
    auto k_rope = [&](int stage) {
      Rope* base = reinterpret_cast<Rope*>(plan.k[stage] + Tr::kRopeSlab * Tr::kSlabBytes);
      Tensor sKR = make_tensor(make_smem_ptr(base), typename Tr::SmemLayoutKRope{});
      return thr_rope.partition_fragment_B(
          local_tile(sKR, Shape<Int<kNPerWG>, Int<Tr::kHeadDimRope>>{}, make_coord(wg, 0)));  // (MMA, 1, 4)
    };

    // begin_split_idx is re-read from global memory at the epilogue: held in a
    // register for the whole CTA it was the last value ptxas spilled.
    SchedMeta walk = meta;
    walk.begin_split_idx = 0;
    int it = 0;
    for_each_chunk(p, walk, [&](const Chunk& c) {
      load_q_ds(p, plan, c.batch, head_k, m_block, ctid);

      OnlineSoftmaxState softmax;
      softmax.reset();
      // O is written (not accumulated) at the chunk's first page.
      // Running per-group normalizer N_g: the largest k_scale[., g] of the
      // chunk's tokens so far. O_g holds (true O_g) * 256 / N_g.
      float norm[kGroups] = {0.f, 0.f, 0.f, 0.f};

      const int page_begin = c.first_page();
      const int page_end = c.end_page();
      for (int page = page_begin; page < page_end; ++page, ++it) {
        const int stage = it % Tr::kNumStages;
        const int valid = c.end_token - page * kBlockN;  // tokens of the page inside the chunk
        mbarrier_wait(&plan.k_full[stage], (it / Tr::kNumStages) & 1);
        const uint32_t slot = smem_addr(plan.k[stage]);
        const uint32_t my_scales = ds_scale_addr(slot, tok_first);
        // This thread's 8 tokens: value v of the fragment is token j = token_of(v),
        // at offset token_offset(j) from tok_first. k_scale[t, g] of them, as
        // stored (slots past the chunk may hold NaN: their scores are masked by
        // selection after the promotion, and P reads its own zero-filled copy, c).
        auto group_scales = [&](int g, float (&ks)[8]) {
          CUTE_UNROLL
          for (int j = 0; j < 8; ++j) {
            asm volatile("ld.shared.f32 %0, [%1];\n"
                         : "=f"(ks[j])
                         : "r"(my_scales + uint32_t(token_offset(j) * 64 + 4 * g))
                         : "memory");
          }
        };

        // Issue: RoPE into S and NoPE group 0 into T0 (one batch), group 1 into T1.
        Tensor tSrKN = k_nope(stage);
        Tensor tSrKR = k_rope(stage);
        auto q_ops = q_operands();
        auto& tSrQ = cute::get<0>(q_ops);
        auto& tSrQR = cute::get<1>(q_ops);
        constexpr int kGroupSteps = Tr::kGroupChannels / 32;
        auto issue_group = [&](auto& T, int g) {
          wgmma_batch<kGroupSteps>(mma_nope, tSrQ, tSrKN, T, false, g * kGroupSteps);
        };
        warpgroup_fence_operand(tSrS);
        warpgroup_fence_operand(tSrT0);
        warpgroup_arrive();
        wgmma_k_steps(mma_rope, tSrQR, tSrKR, tSrS, false);
        wgmma_k_steps<kGroupSteps>(mma_nope, tSrQ, tSrKN, tSrT0, false);
        warpgroup_commit_batch();
        // The transpose while S, T0 and the last page's P V are in flight.
        transpose_v(plan.k[stage], plan.vt[it & 1], plan.zeros, wg, tid, valid);
        // All retired here, the last P V included: a wait_group 1 over a batch
        // carried around the page loop makes ptxas serialize every WGMMA (C7514).
        warpgroup_wait<0>();
        warpgroup_fence_operand(tSrS);
        issue_group(tSrT1, 1);

        // n_g: the page's largest k_scale[., g] over its tokens in the chunk.
        // Every warp reduces all 64 tokens (two per lane) on its own, so all
        // agree on the running N_g = max(N_g, n_g) and on how much O_g shrinks.
        float n[kGroups];
        {
          float4 s0, s1;
          asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                       : "=f"(s0.x), "=f"(s0.y), "=f"(s0.z), "=f"(s0.w)
                       : "r"(ds_scale_addr(slot, lane))
                       : "memory");
          asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                       : "=f"(s1.x), "=f"(s1.y), "=f"(s1.z), "=f"(s1.w)
                       : "r"(ds_scale_addr(slot, lane + 32))
                       : "memory");
          const bool ok0 = lane < valid, ok1 = lane + 32 < valid;
          n[0] = fmaxf(ok0 ? s0.x : 0.f, ok1 ? s1.x : 0.f);
          n[1] = fmaxf(ok0 ? s0.y : 0.f, ok1 ? s1.y : 0.f);
          n[2] = fmaxf(ok0 ? s0.z : 0.f, ok1 ? s1.z : 0.f);
          n[3] = fmaxf(ok0 ? s0.w : 0.f, ok1 ? s1.w : 0.f);
          CUTE_UNROLL
          for (int g = 0; g < kGroups; ++g) {
            CUTE_UNROLL
            for (int off = 16; off > 0; off >>= 1) n[g] = fmaxf(n[g], __shfl_xor_sync(0xffffffffu, n[g], off));
            n[g] = n[g] > 0.f ? n[g] : 1.f;  // scales are positive powers of two; guard anyway
          }
        }
        float shrink[kGroups];  // N_g old / new: exact for power-of-two scales; unused at the first page
        CUTE_UNROLL
        for (int g = 0; g < kGroups; ++g) {
          const float grown = fmaxf(norm[g], n[g]);
          shrink[g] = norm[g] / grown;
          norm[g] = grown;
        }

        // S += (q_scale[r, g] * k_scale[t, g]) * T_g, in fp32. q_scale is read
        // from shared memory each time (8 fewer live registers next to O).
        auto promote = [&](auto& T, int g) {
          warpgroup_fence_operand(T);
          const float qs[2] = {plan.q_scale[rows[0]][g], plan.q_scale[rows[1]][g]};
          float ks[8];
          group_scales(g, ks);
          CUTE_UNROLL
          for (int v = 0; v < size(tSrS); ++v) {
            tSrS(v) += (qs[fragment_row_half(v)] * ks[token_of(v)]) * T(v);
          }
        };
        promote(tSrT0, 0);
        issue_group(tSrT0, 2);
        warpgroup_wait<1>();  // group 1
        promote(tSrT1, 1);
        issue_group(tSrT1, 3);
        warpgroup_wait<1>();  // group 2
        promote(tSrT0, 2);
        warpgroup_wait<0>();  // group 3
        promote(tSrT1, 3);
        warpgroup_fence_operand(tSrS);

        // Visible keys per row (as in consumer()), recomputed per page from an
        // opaque copy of the length: kept across the page loop, these three
        // registers made ptxas spill next to O.
        int limit[2];
        int seqlen = c.seqlen;
        asm volatile("" : "+r"(seqlen));
        const int min_limit = visible_limits(p, c, seqlen, m_block, rows, limit);
        const int tok0 = page * kBlockN + wg * kNPerWG;
        if (page * kBlockN + kBlockN > min_limit) mask_invisible(tSrS, tScS, tok0, limit);

        float page_max[2];
        page_row_max(plan, tSrS, it, wg, lane, rows, page_max);

        float o_scale[2];
        softmax.update(tSrS, page_max, p.softmax_scale_log2, o_scale);  // row sums of the unrounded p

        // P_g = e4m3(p * k_scale[t, g] * 256 / N_g) for all four groups of this WG's 32 tokens.
        // c[j][g] = k_scale[t_j, g] * 256 / N_g, from one 16-byte load per token;
        // 0 past the chunk (p is 0 there, but 0 * NaN would be NaN).
        float c[8][kGroups];
        CUTE_UNROLL
        for (int j = 0; j < 8; ++j) {
          float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
          asm volatile(
              "{\n .reg .pred ok;\n setp.lt.s32 ok, %4, %5;\n"
              " @ok ld.shared.v4.f32 {%0, %1, %2, %3}, [%6];\n}\n"
              : "+f"(x.x), "+f"(x.y), "+f"(x.z), "+f"(x.w)
              : "r"(tok_first + token_offset(j)), "r"(valid), "r"(my_scales + uint32_t(token_offset(j) * 64))
              : "memory");
          c[j][0] = x.x;
          c[j][1] = x.y;
          c[j][2] = x.z;
          c[j][3] = x.w;
        }
        // The slot's last reads (S retired, V^T and the scales copied): the
        // producer may refill it while this page's softmax and P V run.
        release_slot(plan, stage, lane);
        CUTE_UNROLL
        for (int g = 0; g < kGroups; ++g) {
          const float f = __fdiv_rn(256.f, norm[g]);  // a power of two when N_g is
          CUTE_UNROLL
          for (int j = 0; j < 8; ++j) c[j][g] *= f;
        }
        CUTE_UNROLL
        for (int g = 0; g < kGroups; ++g) {
          // This WG's 32 tokens are token groups 2 wg and 2 wg + 1 of the page.
          store_p_e4m3<kNPerWG / 16>(smem_addr(plan.p[g]), tid / 32, lane, tSrS,
                                     [&](int v) { return c[token_of(v)][g]; }, 2 * wg);
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
        fence_proxy_async_smem();
        named_barrier_sync(NamedBarriers::kPReady, kConsumers);
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
      }
      warpgroup_wait<0>();
      warpgroup_fence_operand(tOrO);
      // O_g * N_g / 256: the true O_g (a chunk has at least one page here).
      if (page_begin < page_end) {
        CUTE_UNROLL
        for (int j = 0; j < kPVBlocks; ++j) {
          const float f = (wg == 0 ? norm[j] : norm[2 + j]) * (1.f / 256.f);
          Tensor tOrOj = tOrO(_, _, j);
          CUTE_UNROLL
          for (int v = 0; v < size(tOrOj); ++v) tOrOj(v) *= f;
        }
      }
      Chunk ce = c;
      ce.split_idx = c.batch == meta.begin_batch ? __ldg(&p.sched_meta[blockIdx.x].begin_split_idx) : 0;
      epilogue(p, plan, ce, head_k, m_block, wg, tid, softmax, tOrO, tOcO, rows, p.softmax_scale, 1.f);
    });
  }

  // --------------------------------------------------------------- epilogue
  // A chunk that is its sequence's only split writes out (bf16) and lse
  // directly; otherwise o_accum / lse_accum at num_splits[b] + split_idx.
  // `scale` converts raw q.k to logits; `out_scale` (descale_k or 1)
  // multiplies the output, in partials alike.
  template <class FragO, class CoordO>
  __device__ static void epilogue(const DecodeParams& p, Plan& plan, const Chunk& c, int head_k,
                                  int m_block, int wg, int tid, const OnlineSoftmaxState& softmax,
                                  FragO& tOrO, const CoordO& tOcO, const int (&rows)[2], float scale,
                                  float out_scale) {
    using namespace cute;
    const int lane = tid % 32;
    float sum[2] = {quad_allreduce_sum(softmax.sum[0]), quad_allreduce_sum(softmax.sum[1])};
    if ((lane & 3) == 0) {
      plan.row_sum[wg][rows[0]] = sum[0];
      plan.row_sum[wg][rows[1]] = sum[1];
    }
    named_barrier_sync(NamedBarriers::kSumReady, kConsumers);

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

  __device__ static void run(const SplitKvArgs& args, char* smem_raw) {
    const DecodeParams& p = args.params;
    Plan& plan = *reinterpret_cast<Plan*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
    const int warp = threadIdx.x / 32;
    const int head_k = blockIdx.y;
    const int m_block = blockIdx.z;

    if (threadIdx.x == 0) {
      for (int s = 0; s < Tr::kNumStages; ++s) {
        if constexpr (Tr::kScaleGroups) {
          mbarrier_init(&plan.k_full[s], 1);
          mbarrier_init(&plan.k_empty[s], kConsumers / 32);
        } else {
          for (int part = 0; part < 2; ++part) {
            mbarrier_init(&plan.k_full[s][part], 1);
            mbarrier_init(&plan.k_empty[s][part], 4);  // the 4 warps of the part's warpgroup
          }
        }
      }
      fence_mbarrier_init();
    }
    if constexpr (Tr::kVNeedsTranspose) {
      // The row transpose_v reads for tokens past the chunk.
      if (threadIdx.x < sizeof(plan.zeros) / sizeof(uint32_t)) reinterpret_cast<uint32_t*>(plan.zeros)[threadIdx.x] = 0u;
    }
    if (threadIdx.x == kConsumers && p.num_blocks > 0) tma_prefetch_descriptor(&args.k_map);
    __syncthreads();

    // Programmatic dependent launch: everything above overlapped the previous
    // kernel's tail; inputs (scheduler metadata included) are read only after
    // it completed. Then let the combine kernel be scheduled early; it waits
    // for this grid's completion itself (griddepcontrol.wait).
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");

    const SchedMeta meta = p.sched_meta[blockIdx.x];
    if (meta.begin_batch > meta.end_batch) return;  // empty partition

    if (warp < kConsumers / 32) {
      cutlass::arch::warpgroup_reg_alloc<decode_cfg::kConsumerRegs>();
      if constexpr (Tr::kScaleGroups) {
        consumer_ds(args, plan, meta, head_k, m_block, warp / 4, threadIdx.x % 128);
      } else {
        // The warpgroup index through a shuffle, so that ptxas knows it is
        // warp-uniform: WGMMAs in flight across branches on it would otherwise
        // be serialized (C7518 / C7520).
        consumer(args, plan, meta, head_k, m_block, cutlass::canonical_warp_group_idx(), threadIdx.x % 128);
      }
    } else {
      cutlass::arch::warpgroup_reg_dealloc<decode_cfg::kProducerRegs>();
      if (threadIdx.x == kConsumers) producer(args, plan, meta, head_k);
    }
  }
};

template <config::KvFormat kFormat>
__global__ void __launch_bounds__(decode_cfg::kNumThreads, 1)
    splitkv_mla_kernel(const __grid_constant__ SplitKvArgs args) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ char smem_raw[];
  SplitKvMlaKernel<kFormat>::run(args, smem_raw);
#elif defined(__CUDA_ARCH__)
  __trap();  // built for a GPU without sm_90a WGMMA / TMA
#endif
}

// ------------------------------------------------------------------ host side

namespace detail {

// cuTensorMapEncodeTiled through the runtime's driver entry point, so the
// extension needs no link against libcuda. Resolved once per process.
using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

inline EncodeTiledFn encode_tiled_fn() {
  static EncodeTiledFn fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult qres{};
    check_cuda(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &qres),
               "splitkv_mla", "cudaGetDriverEntryPointByVersion(cuTensorMapEncodeTiled)");
    if (qres != cudaDriverEntryPointSuccess || ptr == nullptr)
      throw std::runtime_error("jax_flash_mla splitkv_mla: cuTensorMapEncodeTiled not found in the driver");
    return reinterpret_cast<EncodeTiledFn>(ptr);
  }();
  return fn;
}

}  // namespace detail

// The cache as (channel, head, token-in-page, block); strides in bytes.
template <config::KvFormat kFormat>
CUtensorMap make_k_tensor_map(const DecodeParams& p) {
  using Tr = Traits<kFormat>;
  constexpr int kElemBytes = sizeof(typename Tr::Element);
  CUtensorMap map;
  if (p.num_blocks == 0) {
    // No page can be loaded (every sequence is empty); the kernel never
    // touches the map, and an encode of a 0-sized tensor would fail.
    memset(&map, 0, sizeof(map));
    return map;
  }
  // Elements per token row: 576 for bf16 / fp8_per_tensor, 656 bytes for fp8_ds_mla.
  const cuuint64_t dims[4] = {cuuint64_t(Tr::kBytesPerToken / kElemBytes), cuuint64_t(p.num_heads_k),
                              cuuint64_t(config::kPageSize), cuuint64_t(p.num_blocks)};
  const cuuint64_t strides[3] = {cuuint64_t(p.k_head_stride) * kElemBytes, cuuint64_t(p.k_token_stride) * kElemBytes,
                                 cuuint64_t(p.k_block_stride) * kElemBytes};
  const cuuint32_t box[4] = {decode_cfg::kTmaBoxChannels, 1, cuuint32_t(config::kPageSize), 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  CUresult r = detail::encode_tiled_fn()(
      &map, Tr::kTmaDataType, 4, const_cast<void*>(p.k_cache), dims, strides, box, elem_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, Tr::kTmaSwizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw std::runtime_error("jax_flash_mla splitkv_mla: cuTensorMapEncodeTiled failed (" + std::to_string(int(r)) +
                             ")");
  return map;
}

template <config::KvFormat kFormat>
void run_splitkv_mla(const DecodeParams& params) {
  using Tr = Traits<kFormat>;
  if (params.batch == 0 || params.num_heads_k == 0 || params.q_rows_per_head_k == 0) return;
  SplitKvArgs args;
  args.params = params;
  args.k_map = make_k_tensor_map<kFormat>(params);

  auto kernel = &splitkv_mla_kernel<kFormat>;
  constexpr int kSmem = Tr::kSmemBytes;
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem), "splitkv_mla",
             "cudaFuncSetAttribute");
  launch_with_pdl(kernel, dim3(params.num_sm_parts, params.num_heads_k, params.num_m_blocks),
                  dim3(decode_cfg::kNumThreads), kSmem, params.stream, "splitkv_mla", args);
}

}  // namespace jax_flash_mla::sm90
