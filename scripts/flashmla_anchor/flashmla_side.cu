// FlashMLA's dense bf16 decode, called as its Python interface calls it (csrc/api/dense_decode.h of FlashMLA),
// for h_kv = 1. Compiled against a FlashMLA checkout (build.sh); nothing of FlashMLA is in this repository.
#include <algorithm>
#include <cmath>
#include <memory>

#include "decoders.h"

#include "params.h"
#include "sm90/decode/dense/splitkv_mla.h"
#include "smxx/decode/combine/combine.h"
#include "smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.h"

Decode flashmla_bf16_decode(const DecodeInputs& in, const DecodeOutputs& out) {
  const int rows = in.s_q * in.h_q;  // q_seq_per_hk: (s_q, head) order for one KV head
  // FlashMLA's partition count: SMs / h_kv / row tiles of 64.
  const int parts = std::max(in.num_sms / ((rows + 63) / 64), 1);
  const int total_splits = in.b + parts;
  auto scratch = std::make_shared<DecodeScratch<DecodingSchedMeta>>(parts, in.b, size_t(total_splits) * rows);
  GetDecodeSchedMetaParams sched = {in.b, in.s_q, kPage, 5, -1, -1, nullptr, nullptr, const_cast<int*>(in.seqlens),
                                    scratch->meta, scratch->num_splits, parts, 0};
  smxx::decode::run_get_decoding_sched_meta_kernel(sched);

  DenseAttnDecodeParams p{};
  p.b = in.b;
  p.s_q = in.s_q;
  p.q_seq_per_hk = rows;
  p.d = kHeadDim;
  p.d_v = kHeadDimV;
  p.h_q = in.h_q;
  p.h_k = 1;
  p.num_blocks = in.b * in.max_pages;
  p.q_head_per_hk = in.h_q;
  p.is_causal = in.causal && in.s_q > 1;  // FlashMLA's interface drops causal for s_q 1
  p.scale_softmax = in.softmax_scale;
  p.scale_softmax_log2 = in.softmax_scale * float(M_LOG2E);
  p.q_ptr = const_cast<void*>(in.q);
  p.k_ptr = const_cast<void*>(in.k_cache);
  p.o_ptr = out.out;
  p.softmax_lse_ptr = out.lse;
  p.q_batch_stride = int64_t(rows) * kHeadDim;
  p.k_batch_stride = int64_t(kPage) * kHeadDim;  // one page
  p.o_batch_stride = int64_t(rows) * kHeadDimV;
  p.q_row_stride = kHeadDim;
  p.k_row_stride = kHeadDim;
  p.o_row_stride = kHeadDimV;
  p.q_head_stride = kHeadDim;
  p.k_head_stride = kHeadDim;
  p.o_head_stride = int64_t(rows) * kHeadDimV;
  p.block_table = const_cast<int*>(in.block_table);
  p.block_table_batch_stride = in.max_pages;
  p.page_block_size = kPage;
  p.seqlens_k_ptr = const_cast<int*>(in.seqlens);
  p.tile_scheduler_metadata_ptr = scratch->meta;
  p.num_sm_parts = parts;
  p.num_splits_ptr = scratch->num_splits;
  p.total_num_splits = total_splits;
  p.softmax_lseaccum_ptr = scratch->lse_accum;
  p.oaccum_ptr = scratch->o_accum;
  const int h_q = in.h_q, s_q = in.s_q, b = in.b;
  CombineParams c = {b, s_q, h_q, kHeadDimV, p.softmax_lse_ptr, p.o_ptr, rows, h_q, h_q * s_q * kHeadDimV,
                     h_q * kHeadDimV, kHeadDimV, p.softmax_lseaccum_ptr, p.oaccum_ptr, rows, h_q,
                     h_q * s_q * kHeadDimV, h_q * kHeadDimV, kHeadDimV, p.tile_scheduler_metadata_ptr,
                     p.num_splits_ptr, parts, nullptr, 0};
  return Decode{[p, scratch](cudaStream_t stream) mutable {
                  p.stream = stream;
                  sm90::run_flash_splitkv_mla_kernel<cutlass::bfloat16_t>(p);
                },
                [c, scratch](cudaStream_t stream) mutable {
                  c.stream = stream;
                  smxx::decode::run_flash_mla_combine_kernel<cutlass::bfloat16_t>(c);
                }};
}
