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
//                               at kMaxReady / kPReady per page. With <= 16
//                               query rows, the FP8 formats run kNarrow
//                               (consumer_narrow): S^T and O^T with tokens /
//                               channels as M, the WGs on alternate pages;
//   warps 8-11 (WG2)            producer: one lane walks the same chunks and
//                               streams K pages by TMA into a kNumStages-slot ring; the
//                               warpgroup gives its registers to the consumers.
// Slots (bf16 / fp8_per_tensor: each of their two parts) are handed back
// through k_empty once the WGMMAs and transposes that read them are done.
//
// Format differences come from Traits<kFormat>; the few code paths that
// differ are `if constexpr` on its flags:
//   kVNeedsTranspose (FP8 formats): FP8 WGMMA reads B only K-major, so each
//     consumer WG transposes its 256 V channels of the page into V^T (while its
//     S WGMMA runs) and zeroes the tokens past the chunk there, instead of
//     zeroing them in the K slot; P is stored as e4m3 (fp8_smem.h).
//   kUsesDescale: descale_q * descale_k (device scalars) fold into the softmax
//     scale, and descale_k multiplies the output (partials too, so the combine
//     stays format-agnostic); lse is of the scaled logits.
//   kScaleGroups (fp8_ds_mla): the producer loads six slabs per page
//     (load_ds_page) and the consumers run consumer_ds (design A of
//     docs/NUMERICS.md: q quantized in the prologue, per-group promoted QK,
//     P per output group accumulated into O under a running normalizer);
//     consumer() is not instantiated for it.
//
// Files: this one holds the class (producer, Q load, the per-page helpers both
// consumers share, run), the __global__ kernel and the host launcher; the long
// members live in consumer_pairs.cuh, consumer_ds.cuh, consumer_narrow.cuh and
// epilogue.cuh, and the FP8 shared-memory lane mappings in fp8_smem.h.
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
#include "kernels/event_trace.h"
#include "kernels/launch.h"
#include "kernels/sm90/decode/fp8_smem.h"
#include "kernels/sm90/decode/named_barriers.h"
#include "kernels/sm90/decode/paged_kv_load.h"
#include "kernels/sm90/decode/smem_matrix.h"
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
  CUtensorMap scale_map;  // fp8_ds_mla's token scales (zeros otherwise)
  // Several slabs per box (make_slab_tensor_map): a V half of a page for bf16 /
  // fp8_per_tensor, the four NoPE slabs for fp8_ds_mla.
  CUtensorMap slab_map;
  // The query tile by TMA (q_by_tma, run_splitkv_mla decides): q as (channel,
  // head within the KV head's group, KV head, query token, batch), one box per
  // 64-channel slab of 64 rows. Otherwise (zeros) the consumers copy it.
  CUtensorMap q_map;
  int q_by_tma;
#ifdef JAX_FLASH_MLA_EVENT_TRACE
  uint64_t* event_trace;  // kernels/event_trace.h; null until armed
#endif
};

// One (batch, token range) piece of a partition.
struct Chunk {
  int batch;
  int seqlen;       // cache_seqlens[batch]
  int begin_token;  // multiple of the page size, at most end_token rounded up to one
  int end_token;    // exclusive
  int split_idx;    // index among the sequence's splits
  int first_block;  // block_table[batch][first_page()] when the chunk has a page

  // Pages the chunk touches: [first_page, end_page), never past its last one.
  __device__ __forceinline__ int first_page() const { return begin_token / config::kPageSize; }
  __device__ __forceinline__ int end_page() const { return (end_token + config::kPageSize - 1) / config::kPageSize; }
};

// Lengths are clamped to [0, block_table capacity]: under jit a bad length
// cannot be rejected, and a page index past the table's row would read (and
// TMA-load through) memory that is not this sequence's. Metadata computed for
// other lengths (an earlier decode step's, which nothing can check under jit)
// still reads every key once: a sequence's last split ends at its length, and
// a chunk that starts past the length starts at the page boundary after it
// and touches no page (a start clamped to the length would re-read the page
// the sequence ends in, which its previous split read). Being the last split
// decides a chunk's end, so the producer and every consumer must see the same
// split index: it is read from this CTA's partition (`meta`'s source) in
// global memory, once a chunk, as held in a register for the whole CTA it was
// what ptxas spilled in the consumers.
__device__ __forceinline__ Chunk make_chunk(const DecodeParams& p, const SchedMeta& meta, int b) {
  const int capacity = p.max_blocks_per_seq * config::kPageSize;
  Chunk c;
  c.batch = b;
  c.seqlen = min(max(p.cache_seqlens[b], 0), capacity);
  c.split_idx = b == meta.begin_batch ? __ldg(&p.sched_meta[blockIdx.x].begin_split_idx) : 0;
  const bool last_split = c.split_idx == p.num_splits[b + 1] - p.num_splits[b] - 1;
  c.end_token = b == meta.end_batch && !last_split ? min(meta.end_token, c.seqlen) : c.seqlen;
  c.begin_token = min(b == meta.begin_batch ? meta.begin_token : 0, c.end_page() * config::kPageSize);
  // Read beside the lengths, not after them: the producer's first TMA of the
  // chunk then waits for one global load after meta's, not two. The unclamped
  // first page is first_page() whenever the chunk has a page at all.
  const int first = b == meta.begin_batch ? meta.begin_token / config::kPageSize : 0;
  c.first_block = first < p.max_blocks_per_seq ? __ldg(p.block_table + b * p.block_table_batch_stride + first) : 0;
  return c;
}

// This CTA's partition row, all 32 bytes at once: loaded field by field as
// each was first used, total_pages (needed only by the producer, after its
// setmaxnreg) came a global round trip after the others, and the producer's
// first TMA waited for it. Plain loads: the scheduler kernel wrote the row.
__device__ __forceinline__ SchedMeta load_sched_meta(const SchedMeta* row) {
  int4 lo, hi;
  asm volatile("ld.global.v4.s32 {%0, %1, %2, %3}, [%8];\n\t"
               "ld.global.v4.s32 {%4, %5, %6, %7}, [%8 + 16];\n"
               : "=r"(lo.x), "=r"(lo.y), "=r"(lo.z), "=r"(lo.w), "=r"(hi.x), "=r"(hi.y), "=r"(hi.z), "=r"(hi.w)
               : "l"(row)
               : "memory");
  return SchedMeta{lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, {hi.z, hi.w}};
}

template <class F>
__device__ __forceinline__ void for_each_chunk(const DecodeParams& p, const SchedMeta& meta, F&& f) {
  for (int b = meta.begin_batch; b <= meta.end_batch; ++b) f(make_chunk(p, meta, b));
}

// kNarrow: the few-query-rows variant (consumer_narrow.cuh), on the format's
// NarrowTraits (its own shared-memory plan and stage count).
template <config::KvFormat kFormat, bool kNarrow = false>
struct SplitKvMlaKernel {
  using Tr = std::conditional_t<kNarrow, NarrowTraits<kFormat>, Traits<kFormat>>;
  using Element = typename Tr::Element;
  using Plan = typename Tr::SharedMemoryPlan;
  static constexpr int kBlockM = decode_cfg::kBlockM;
  static constexpr int kBlockN = decode_cfg::kBlockN;
  static constexpr int kConsumers = decode_cfg::kNumConsumerThreads;
  // The 64-row kernel may take its Q tile (fp8_ds_mla: q before its
  // quantization) from the producer's TMA (the few-rows kernel reads 16 rows:
  // its own load).
  static constexpr bool kQByTmaCapable = !kNarrow;

  // k_full per stage: one set for both consumer WGs, or in the narrow plan
  // one set per WG (consumer_narrow.cuh: each WG waits on its own pages only).
  __device__ static auto& full_barriers(Plan& plan, int owner) {
    if constexpr (kNarrow) {
      return plan.k_full[owner];
    } else {
      return plan.k_full;
    }
  }

  // A pipeline event of `role` (consumer WG 0 / 1, 2: producer) at ring position `page`; nothing unless built with
  // JAX_FLASH_MLA_EVENT_TRACE (kernels/event_trace.h).
  __device__ static void stamp(const SplitKvArgs& args, int role, int page, int event) {
#ifdef JAX_FLASH_MLA_EVENT_TRACE
    event_trace::stamp(args.event_trace, role, page, event);
#endif
  }
  // (clock64, globaltimer) at the producer's start (0) and end (1), which convert the stamps' cycles to ns.
  __device__ static void stamp_clocks(const SplitKvArgs& args, int which) {
#ifdef JAX_FLASH_MLA_EVENT_TRACE
    event_trace::stamp_clocks(args.event_trace, which);
#endif
  }

  // ---------------------------------------------------------------- producer
  __device__ static void producer(const SplitKvArgs& args, Plan& plan, const SchedMeta& meta,
                                  int head_k, int m_block) {
    const DecodeParams& p = args.params;
    // One row tile per KV head: this CTA is a page's only reader, and a short
    // chunk bounds its stream; with several readers, the batch's pages must fit
    // in L2 (paged_kv_load.h).
    const bool single_reader = p.q_rows_per_head_k <= kBlockM;
    const bool batch_fits_l2 = int64_t{meta.total_pages} * p.num_heads_k * config::kPageSize * Tr::kBytesPerToken <=
                               kEvictFirstMaxSharedBytes;
    int it = 0;     // pages issued by this CTA, across chunks (ring position)
    int chunk = 0;  // chunks begun by this CTA (the Q tile's phase)
    stamp_clocks(args, 0);
    if constexpr (kQByTmaCapable) {
      // The partition's first Q tile goes out before the chunk walk reads its
      // lengths: it needs only the batch (kQAfterFirstPage: after the first
      // page, as every later chunk's).
      if (args.q_by_tma && !Tr::kQAfterFirstPage) load_q_tma(args, plan, meta.begin_batch, head_k, m_block, 0);
    }
    for_each_chunk(p, meta, [&](const Chunk& c) {
      const int32_t* table = p.block_table + c.batch * p.block_table_batch_stride;
      const bool evict_first = single_reader ? c.end_page() - c.first_page() <= kEvictFirstMaxPages : batch_fits_l2;
      // A later chunk's Q tile goes out right after its first page (a
      // hand-over's first page is issued while the last chunk still runs),
      // once every consumer warp is done with the last chunk's Q: the load
      // then overlaps the last chunk's epilogue instead of following it.
      auto issue_q = [&] {
        if constexpr (kQByTmaCapable) {
          if (args.q_by_tma && (chunk > 0 || Tr::kQAfterFirstPage)) {
            load_q_tma(args, plan, c.batch, head_k, m_block, chunk);
          }
        }
      };
      if (c.first_page() == c.end_page()) issue_q();
      for (int page = c.first_page(); page < c.end_page(); ++page, ++it) {
        const int stage = it % Tr::kNumStages;
        const uint32_t phase = (it / Tr::kNumStages) & 1;
        const int block = page == c.first_page() ? c.first_block : table[page];
        // Narrow: the WG that takes the page (alternate pages of the chunk) has its own k_full set.
        auto& full = full_barriers(plan, (page - c.first_page()) % decode_cfg::kNumConsumerWGs)[stage];
        if constexpr (Tr::kScaleGroups) {
          mbarrier_wait(&plan.k_empty[stage], phase ^ 1);
          stamp(args, 2, it, event_trace::kLeftIssued);
          load_ds_page<Tr>(&args.k_map, &args.slab_map, &args.scale_map, &full, plan.k[stage], head_k, block,
                           evict_first);
        } else {
          // Left part first: the consumers release it first and S starts on it;
          // with kBRightFirst the right part first for a pair's page B.
          const bool page_b = Tr::kBRightFirst && ((page - c.first_page()) & 1);
          for (int n = 0; n < 2; ++n) {
            const int part = page_b ? 1 - n : n;
            mbarrier_wait(&plan.k_empty[stage][part], phase ^ 1);
            stamp(args, 2, it, part == 0 ? event_trace::kLeftIssued : event_trace::kRightIssued);
            if constexpr (Tr::kTokenScales) {
              load_ds_page_part<Tr>(&args.k_map, &args.slab_map, &args.scale_map, &full[part], plan.k[stage], head_k,
                                    block, part, evict_first);
            } else {
              load_kv_page_part<Tr>(&args.k_map, &args.slab_map, &full[part * Tr::kPiecesPerPart], plan.k[stage],
                                    head_k, block, part, evict_first);
            }
          }
        }
        if (page == c.first_page()) issue_q();
      }
      ++chunk;
    });
    stamp_clocks(args, 1);
  }

  // The producer's TMA of a chunk's Q tile: nine boxes of 64 channels x 64
  // rows into Tr::q_tma_destination, one slab each (fp8_per_tensor: the slabs
  // of SmemLayoutQ, the K page's layout; fp8_ds_mla: raw bf16 q for
  // load_q_ds). Rows past q_rows_per_head_k lie past q's query-token extent:
  // zero-filled.
  // A row of one box (64 channels of q's element type) and a slab (64 rows).
  __host__ __device__ static constexpr int q_tma_row_bytes() {
    return decode_cfg::kTmaBoxChannels * int(sizeof(typename Traits<kFormat>::QTmaElement));
  }
  __host__ __device__ static constexpr int q_tma_slab_bytes() { return kBlockM * q_tma_row_bytes(); }
  __device__ static void load_q_tma(const SplitKvArgs& args, Plan& plan, int batch, int head_k, int m_block,
                                    int chunk) {
    constexpr int kSlabBytes = q_tma_slab_bytes();
    const int row0 = m_block * kBlockM;
    const int heads = args.params.heads_per_head_k;
    char* dst = Tr::q_tma_destination(plan);
    mbarrier_wait(&plan.q_empty, (chunk & 1) ^ 1);
    mbarrier_arrive_expect_tx(&plan.q_full, uint32_t(decode_cfg::kSlabs * kSlabBytes));
    for (int slab = 0; slab < decode_cfg::kSlabs; ++slab) {
      tma_load_5d(&args.q_map, &plan.q_full, dst + slab * kSlabBytes, slab * decode_cfg::kTmaBoxChannels,
                  row0 % heads, head_k, row0 / heads, batch);
    }
  }

  // ------------------------------------------------------- Q tile of a chunk
  // Row r of the tile is query token r / heads_per_head_k of head
  // hk * heads_per_head_k + r % heads_per_head_k (params.h); rows past
  // q_rows_per_head_k are zero-filled (their results are never stored).
  __device__ static void load_q(const DecodeParams& p, Plan& plan, int batch, int head_k, int m_block,
                                int ctid) {
    copy_q_async(p, plan, batch, head_k, m_block, ctid);
    finish_q_copy(plan);
  }
  // load_q's two halves: this thread's cp.async pieces of the tile; the
  // wait for them, then both WGs meet.
  __device__ static void copy_q_async(const DecodeParams& p, Plan& plan, int batch, int head_k, int m_block,
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
  }
  __device__ static void finish_q_copy(Plan& plan) {
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    fence_proxy_async_smem();  // Q is read by WGMMA (async proxy)
    named_barrier_sync(NamedBarriers::kQReady, kConsumers);
  }

  // The chunk's Q tile in shared memory for the consumers: from the
  // producer's TMA (load_q_tma) when kQByTmaCapable and args.q_by_tma, else
  // copied by them (copy_q_async). After the wait both WGs meet, as after
  // load_q: the last chunk's epilogue has read the row sums that this one
  // writes.
  __device__ static void acquire_q(const SplitKvArgs& args, Plan& plan, int batch, int head_k, int m_block,
                                   int ctid, int chunk) {
    if constexpr (kQByTmaCapable) {
      if (args.q_by_tma) {
        mbarrier_wait(&plan.q_full, chunk & 1);
        named_barrier_sync(NamedBarriers::kQReady, kConsumers);
        return;
      }
    }
    copy_q_async(args.params, plan, batch, head_k, m_block, ctid);
    finish_q_copy(plan);
  }
  // After the chunk's last WGMMA: this warp no longer reads what the next
  // chunk's Q TMA overwrites (Q; fp8_ds_mla: the V^T and P tiles).
  __device__ static void release_q(const SplitKvArgs& args, Plan& plan, int lane) {
    if constexpr (kQByTmaCapable) {
      if (args.q_by_tma) {
        __syncwarp();
        mbarrier_arrive_if(&plan.q_empty, lane == 0);
      }
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

  // Design S (Tr::kTokenScales): the producer warpgroup's prep warps, thread t of them taking token t of every
  // page (ds_page_prep.cuh).
  __device__ static void prep_pages(const SplitKvArgs& args, Plan& plan, const SchedMeta& meta, int t);
  // ---------------------------------------------------------- consumers
  // bf16 / fp8_per_tensor: page pairs (consumer_pairs.cuh).
  __device__ static void consumer(const SplitKvArgs& args, Plan& plan, const SchedMeta& meta, int head_k, int m_block,
                                  int wg, int tid);
  // fp8_ds_mla (consumer_ds.cuh): the quantizing Q prologue, a token's scale
  // address in a slot, and the per-page split consumer.
  __device__ static void load_q_ds(const SplitKvArgs& args, Plan& plan, int batch, int head_k, int m_block, int ctid,
                                   int chunk);
  __device__ static uint32_t ds_scale_addr(uint32_t slot_base, int t);
  // The four scales of token t (zeros for t >= valid), and the page's largest
  // scale per group over its first `valid` tokens (every warp reduces all 64).
  __device__ static float4 ds_token_scales(uint32_t slot_base, int t, int valid);
  __device__ static void ds_page_scale_max(uint32_t slot_base, int lane, int valid, float (&n)[4]);
  __device__ static void consumer_ds(const SplitKvArgs& args, Plan& plan, const SchedMeta& meta, int head_k,
                                     int m_block, int wg, int tid);
  // FP8 formats with at most Tr::kNarrowRows query rows per KV head
  // (consumer_narrow.cuh, on NarrowTraits): transposed WGMMAs, one page per
  // WG, the two WGs merged at the chunk's end by epilogue_narrow.
  __device__ static void consumer_narrow(const SplitKvArgs& args, Plan& plan, const SchedMeta& meta, int head_k,
                                         int wg, int tid);
  template <class FragO>
  __device__ static void epilogue_narrow(const DecodeParams& p, Plan& plan, const Chunk& c, int head_k, int wg,
                                         int tid, bool has_pages, const float (&m_ref)[4],
                                         const float (&l_part)[4], FragO& tOrO, float logit_scale, float scale_log2,
                                         float out_scale);
  // The chunk's end (epilogue.cuh): the row sums of both WGs meet, then O is
  // normalized and written as out / lse or as split partials.
  __device__ static void share_row_sums(Plan& plan, const OnlineSoftmaxState& softmax, int wg, int tid,
                                        const int (&rows)[2]);
  template <class FragO, class CoordO>
  __device__ static void epilogue(const DecodeParams& p, Plan& plan, const Chunk& c, int head_k, int m_block, int wg,
                                  int tid, const OnlineSoftmaxState& softmax, FragO& tOrO, const CoordO& tOcO,
                                  const int (&rows)[2], float scale, float out_scale);

  __device__ static void run(const SplitKvArgs& args, char* smem_raw) {
    const DecodeParams& p = args.params;
    // The 1 KB round-up of the dynamic shared memory base is pointer arithmetic on smem_raw itself, not an
    // integer round trip: the compiler then still knows that every tile is shared memory and emits STS / LDS
    // with 32-bit addresses instead of generic ST / LD with 64-bit ones (the bf16 P stores, the row maxima).
    Plan& plan = *reinterpret_cast<Plan*>(smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u));
    const int warp = threadIdx.x / 32;
    const int head_k = blockIdx.y;
    const int m_block = blockIdx.z;

    if (threadIdx.x == 0) {
      for (int s = 0; s < Tr::kNumStages; ++s) {
        for (int owner = 0; owner < (kNarrow ? decode_cfg::kNumConsumerWGs : 1); ++owner) {
          if constexpr (Tr::kScaleGroups) {
            mbarrier_init(&full_barriers(plan, owner)[s], 1);
          } else {
            for (int piece = 0; piece < 2 * Tr::kPiecesPerPart; ++piece) {
              mbarrier_init(&full_barriers(plan, owner)[s][piece], 1);
            }
          }
        }
        if constexpr (Tr::kScaleGroups) {
          // Every consumer warp reads every page; a narrow page has one WG.
          mbarrier_init(&plan.k_empty[s], kNarrow ? 4 : kConsumers / 32);
        } else {
          for (int part = 0; part < 2; ++part) {
            // The 4 warps of the part's warpgroup; in the page-pair consumer
            // the right part also waits for WG0's, whose S_A reads it.
            mbarrier_init(&plan.k_empty[s][part], part == 1 && !kNarrow ? 8 : 4);
          }
        }
      }
      if constexpr (Tr::kTokenScales) {
        for (int s = 0; s < Tr::kNumStages; ++s) mbarrier_init(&plan.prepared[s], Tr::kPrepWarps);
        for (int s = 0; s < Tr::kTableSlots; ++s) mbarrier_init(&plan.table_empty[s], kConsumers / 32);
      }
      if constexpr (kQByTmaCapable) {
        mbarrier_init(&plan.q_full, 1);
        mbarrier_init(&plan.q_empty, kConsumers / 32);  // every consumer warp's S read Q
      }
      fence_mbarrier_init();
    }
    if constexpr (Tr::kVNeedsTranspose) {
      // The row transpose_v reads for tokens past the chunk.
      if (threadIdx.x < sizeof(plan.zeros) / sizeof(uint32_t)) {
        reinterpret_cast<uint32_t*>(plan.zeros)[threadIdx.x] = 0u;
      }
    }
    if (threadIdx.x == kConsumers && p.num_blocks > 0) {
      tma_prefetch_descriptor(&args.k_map);
      tma_prefetch_descriptor(&args.slab_map);
      if constexpr (Tr::kScaleGroups || Tr::kTokenScales) tma_prefetch_descriptor(&args.scale_map);
      if constexpr (kQByTmaCapable) {
        if (args.q_by_tma) tma_prefetch_descriptor(&args.q_map);
      }
    }
    __syncthreads();

    // Programmatic dependent launch: everything above overlapped the previous
    // kernel's tail; inputs (scheduler metadata included) are read only after
    // it completed. Then let the combine kernel be scheduled early; it waits
    // for this grid's completion itself (griddepcontrol.wait).
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");

    const SchedMeta meta = load_sched_meta(p.sched_meta + blockIdx.x);
    if (meta.begin_batch > meta.end_batch) return;  // empty partition

    if (warp < kConsumers / 32) {
      cutlass::arch::warpgroup_reg_alloc<decode_cfg::kConsumerRegs>();
      if constexpr (kNarrow) {
        consumer_narrow(args, plan, meta, head_k, cutlass::canonical_warp_group_idx(), threadIdx.x % 128);
      } else if constexpr (Tr::kScaleGroups) {
        // Shuffled as for consumer(): warp-uniform, the K slot's WGMMA
        // descriptors (their tile depends on it) stay in uniform registers
        // instead of being built per page and moved there by R2UR.
        consumer_ds(args, plan, meta, head_k, m_block, cutlass::canonical_warp_group_idx(), threadIdx.x % 128);
      } else {
        // The warpgroup index through a shuffle, so that ptxas knows it is
        // warp-uniform: WGMMAs in flight across branches on it would otherwise
        // be serialized (C7518 / C7520).
        consumer(args, plan, meta, head_k, m_block, cutlass::canonical_warp_group_idx(), threadIdx.x % 128);
      }
    } else {
      cutlass::arch::warpgroup_reg_dealloc<decode_cfg::kProducerRegs>();
      if (threadIdx.x == kConsumers) {
        producer(args, plan, meta, head_k, m_block);
      } else if constexpr (Tr::kTokenScales) {
        if (warp > kConsumers / 32 && warp <= kConsumers / 32 + Tr::kPrepWarps) {
          prep_pages(args, plan, meta, threadIdx.x - kConsumers - 32);
        }
      }
    }
  }
};

}  // namespace jax_flash_mla::sm90

// The member functions too long to read inside the class.
#include "kernels/sm90/decode/consumer_pairs.cuh"
#include "kernels/sm90/decode/consumer_ds.cuh"
#include "kernels/sm90/decode/consumer_narrow.cuh"
#include "kernels/sm90/decode/ds_page_prep.cuh"
#include "kernels/sm90/decode/epilogue.cuh"

namespace jax_flash_mla::sm90 {

// kNarrow: the few-query-rows consumer (Traits::kNarrowRows > 0 only).
template <config::KvFormat kFormat, bool kNarrow>
__global__ void __launch_bounds__(decode_cfg::kNumThreads, 1)
    splitkv_mla_kernel(const __grid_constant__ SplitKvArgs args) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ char smem_raw[];
  SplitKvMlaKernel<kFormat, kNarrow>::run(args, smem_raw);
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

// A tiled map of `rank` dims (innermost first; byte strides of dims 1..rank-1)
// with unit element strides, the decode's L2 promotion and zero fill past the
// tensor's edges; throws naming `what` if the driver refuses it.
template <int rank>
void encode_tiled(CUtensorMap* map, CUtensorMapDataType type, const void* base, const cuuint64_t (&dims)[rank],
                  const cuuint64_t (&strides)[rank - 1], const cuuint32_t (&box)[rank], CUtensorMapSwizzle swizzle,
                  const char* what) {
  cuuint32_t elem_strides[rank];
  for (int i = 0; i < rank; ++i) elem_strides[i] = 1;
  const CUresult r = encode_tiled_fn()(map, type, rank, const_cast<void*>(base), dims, strides, box, elem_strides,
                                       CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, decode_cfg::kTmaL2Promotion,
                                       CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw std::runtime_error(std::string("jax_flash_mla splitkv_mla: cuTensorMapEncodeTiled (") + what +
                             ") failed (" + std::to_string(int(r)) + ")");
}

// No page can be loaded (every sequence is empty): the kernel never touches
// the cache's maps, and an encode of a 0-sized tensor would fail, so they
// stay zero.
inline bool zero_map_without_pages(const DecodeParams& p, CUtensorMap* map) {
  if (p.num_blocks != 0) return false;
  memset(map, 0, sizeof(*map));
  return true;
}

}  // namespace detail

// The cache as (channel, head, token-in-page, block); strides in bytes.
// Boxes of `box_elems` channels x 64 tokens with `swizzle`.
template <config::KvFormat kFormat>
CUtensorMap make_k_tensor_map(const DecodeParams& p, int box_elems, CUtensorMapSwizzle swizzle) {
  using Tr = Traits<kFormat>;
  constexpr int kElemBytes = sizeof(typename Tr::Element);
  CUtensorMap map;
  if (detail::zero_map_without_pages(p, &map)) return map;
  // Elements per token row: 576 for bf16 / fp8_per_tensor, 656 bytes for fp8_ds_mla.
  const cuuint64_t dims[4] = {cuuint64_t(Tr::kBytesPerToken / kElemBytes), cuuint64_t(p.num_heads_k),
                              cuuint64_t(config::kPageSize), cuuint64_t(p.num_blocks)};
  const cuuint64_t strides[3] = {cuuint64_t(p.k_head_stride) * kElemBytes, cuuint64_t(p.k_token_stride) * kElemBytes,
                                 cuuint64_t(p.k_block_stride) * kElemBytes};
  const cuuint32_t box[4] = {cuuint32_t(box_elems), 1, cuuint32_t(config::kPageSize), 1};
  detail::encode_tiled(&map, Tr::kTmaDataType, p.k_cache, dims, strides, box, swizzle, "k_cache");
  return map;
}

// The cache as (position within a slab, token-in-page, slab, head, block),
// slabs being the cache map's boxes (64 channels; fp8_ds_mla: 128 bytes), so
// one box of Tr::kSlabsPerBox slabs lands slab after slab, each as a box of
// make_k_tensor_map would (same bytes, same swizzle phase: slabs are 1 KB
// multiples). The map spans Tr::kSlabMapSlabs slabs of a token.
template <config::KvFormat kFormat>
CUtensorMap make_slab_tensor_map(const DecodeParams& p) {
  using Tr = Traits<kFormat>;
  constexpr int kElemBytes = sizeof(typename Tr::Element);
  CUtensorMap map;
  if (detail::zero_map_without_pages(p, &map)) return map;
  const cuuint64_t dims[5] = {cuuint64_t(Tr::kTmaBoxElems), cuuint64_t(config::kPageSize),
                              cuuint64_t(Tr::kSlabMapSlabs), cuuint64_t(p.num_heads_k), cuuint64_t(p.num_blocks)};
  const cuuint64_t strides[4] = {cuuint64_t(p.k_token_stride) * kElemBytes, cuuint64_t(Tr::kTmaBoxElems) * kElemBytes,
                                 cuuint64_t(p.k_head_stride) * kElemBytes, cuuint64_t(p.k_block_stride) * kElemBytes};
  const cuuint32_t box[5] = {cuuint32_t(Tr::kTmaBoxElems), cuuint32_t(config::kPageSize),
                             cuuint32_t(Tr::kSlabsPerBox), 1, 1};
  detail::encode_tiled(&map, Tr::kTmaDataType, p.k_cache, dims, strides, box, Tr::kTmaSwizzle, "k_cache slabs");
  return map;
}

// q [batch, s_q, h_q, 576] as (channel, head within the KV head's group, KV
// head, query token, batch): query-row tile m of KV head hk, rows r = s *
// heads + h, is one box {64, box_heads, 1, 64 / box_heads, 1} at {64c,
// 64m % heads, hk, 64m / heads, b} when the tile's rows tile that box:
// heads a multiple of 64 (box_heads = 64) or a divisor of 64 (box_heads =
// heads). Returns false (map untouched) for other group sizes, which keep the
// consumers' copy.
template <config::KvFormat kFormat>
bool make_q_tensor_map(const DecodeParams& p, CUtensorMap* map) {
  using Tr = Traits<kFormat>;
  constexpr int kElemBytes = sizeof(typename Tr::QTmaElement);
  const int heads = p.heads_per_head_k;
  const int block_m = decode_cfg::kBlockM;
  if (heads <= 0 || (heads >= block_m ? heads % block_m != 0 : block_m % heads != 0)) return false;
  const int box_heads = heads >= block_m ? block_m : heads;
  const cuuint64_t dims[5] = {cuuint64_t(config::kHeadDimQK), cuuint64_t(heads), cuuint64_t(p.num_heads_k),
                              cuuint64_t(p.seqlen_q), cuuint64_t(p.batch)};
  const cuuint64_t strides[4] = {cuuint64_t(p.q_head_stride) * kElemBytes,
                                 cuuint64_t(p.q_head_stride) * heads * kElemBytes,
                                 cuuint64_t(p.q_seq_stride) * kElemBytes, cuuint64_t(p.q_batch_stride) * kElemBytes};
  const cuuint32_t box[5] = {cuuint32_t(decode_cfg::kTmaBoxChannels), cuuint32_t(box_heads), 1,
                             cuuint32_t(block_m / box_heads), 1};
  detail::encode_tiled(map, Tr::kQTmaDataType, p.q, dims, strides, box, Tr::kQTmaSwizzle, "q");
  return true;
}

template <config::KvFormat kFormat>
void run_splitkv_mla(const DecodeParams& params) {
  using Tr = Traits<kFormat>;
  if constexpr (kFormat == config::KvFormat::kFp8DsMlaTokenScales) {
    // Design S has no few-rows kernel: those shapes run design A's (consumer_narrow), which reads any cache.
    if (params.q_rows_per_head_k <= Traits<config::KvFormat::kFp8DsMla>::kNarrowRows) {
      run_splitkv_mla<config::KvFormat::kFp8DsMla>(params);
      return;
    }
  }
  if (params.batch == 0 || params.num_heads_k == 0 || params.q_rows_per_head_k == 0) return;
  SplitKvArgs args;
  args.params = params;
  args.k_map = make_k_tensor_map<kFormat>(params, Tr::kTmaBoxElems, Tr::kTmaSwizzle);
  args.slab_map = make_slab_tensor_map<kFormat>(params);
  if constexpr (Tr::kScaleGroups || Tr::kTokenScales) {
    args.scale_map = make_k_tensor_map<kFormat>(params, Tr::kScaleRowBytes, CU_TENSOR_MAP_SWIZZLE_NONE);
  } else {
    memset(&args.scale_map, 0, sizeof(args.scale_map));
  }
  memset(&args.q_map, 0, sizeof(args.q_map));
  args.q_by_tma = 0;
  const bool narrow = Tr::kNarrowRows > 0 && params.q_rows_per_head_k <= Tr::kNarrowRows;
  if (!narrow) args.q_by_tma = make_q_tensor_map<kFormat>(params, &args.q_map);
#ifdef JAX_FLASH_MLA_EVENT_TRACE
  args.event_trace = event_trace::device_buffer();
#endif

  auto launch = [&](auto kernel, int smem_bytes) {
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes), "splitkv_mla",
               "cudaFuncSetAttribute");
    launch_with_pdl(kernel, dim3(params.num_sm_parts, params.num_heads_k, params.num_m_blocks),
                    dim3(decode_cfg::kNumThreads), smem_bytes, params.stream, "splitkv_mla", args);
  };
  if constexpr (Tr::kNarrowRows > 0) {
    if (narrow) {
      launch(&splitkv_mla_kernel<kFormat, true>, NarrowTraits<kFormat>::kSmemBytes);
      return;
    }
  }
  launch(&splitkv_mla_kernel<kFormat, false>, Tr::kSmemBytes);
}

}  // namespace jax_flash_mla::sm90
