// Our bf16 decode, with the parameters cpp/ffi/decode.cc sets for h_kv = 1, and the metadata of our scheduler
// (cpp/kernels/smxx/sched_meta.cu) over the partition count of jax_flash_mla/scheduler.py's num_sm_parts.
#include <algorithm>
#include <memory>

#include "decoders.h"

#include "config.h"
#include "kernels/sm90/decode/splitkv_mla.h"
#include "kernels/smxx/combine.h"
#include "kernels/smxx/sched_meta.h"
#include "params.h"

using namespace jax_flash_mla;

Decode our_bf16_decode(const DecodeInputs& in, const DecodeOutputs& out) {
  static_assert(kHeadDim == config::kHeadDimQK && kHeadDimV == config::kHeadDimV && kPage == config::kPageSize);
  const int rows = in.s_q * in.h_q;
  const int m_blocks = (rows + config::kRowsPerTile - 1) / config::kRowsPerTile;
  const int parts = std::max(in.num_sms / m_blocks, 1);
  auto scratch = std::make_shared<DecodeScratch<SchedMeta>>(parts, in.b, size_t(in.b + parts) * rows);
  SchedMetaParams sched{in.seqlens, scratch->meta, scratch->num_splits, in.b, parts, 0};
  run_sched_meta(sched);

  DecodeParams p{};
  p.batch = in.b;
  p.seqlen_q = in.s_q;
  p.num_heads_q = in.h_q;
  p.num_heads_k = 1;
  p.heads_per_head_k = in.h_q;
  p.q_rows_per_head_k = rows;
  p.num_m_blocks = m_blocks;
  p.num_sm_parts = parts;
  p.causal = in.causal;
  p.softmax_scale = in.softmax_scale;
  p.softmax_scale_log2 = static_cast<float>(static_cast<double>(in.softmax_scale) * 1.4426950408889634);
  p.q = in.q;
  p.q_head_stride = kHeadDim;
  p.q_seq_stride = int64_t(in.h_q) * kHeadDim;
  p.q_batch_stride = int64_t(rows) * kHeadDim;
  p.k_cache = in.k_cache;
  p.k_head_stride = kHeadDim;
  p.k_token_stride = kHeadDim;
  p.k_block_stride = int64_t(kPage) * kHeadDim;
  p.num_blocks = in.b * in.max_pages;
  p.block_table = in.block_table;
  p.block_table_batch_stride = in.max_pages;
  p.max_blocks_per_seq = in.max_pages;
  p.cache_seqlens = in.seqlens;
  p.out = out.out;
  p.out_head_stride = kHeadDimV;
  p.out_seq_stride = int64_t(in.h_q) * kHeadDimV;
  p.out_batch_stride = int64_t(rows) * kHeadDimV;
  p.lse = out.lse;
  p.o_accum = scratch->o_accum;
  p.lse_accum = scratch->lse_accum;
  p.sched_meta = scratch->meta;
  p.num_splits = scratch->num_splits;
  return Decode{[p, scratch](cudaStream_t stream) mutable {
                  p.stream = stream;
                  sm90::run_splitkv_mla<config::KvFormat::kBf16>(p);
                },
                [p, scratch](cudaStream_t stream) mutable {
                  p.stream = stream;
                  run_combine(p);
                }};
}
