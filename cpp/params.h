// Plain-old-data parameter blocks shared by the FFI handlers (host) and the
// kernels (device). Strides are in elements of each tensor's storage type
// (bytes for the uint8 fp8_ds_mla cache). `stream` comes last.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "config.h"

namespace jax_flash_mla {

// Scheduler output for one partition ("SM part") of the split-KV grid, as
// `int32[kSchedMetaInts]`. Partition p walks batches begin_batch..end_batch
// (inclusive); in begin_batch it starts at token begin_token, in end_batch it
// stops before end_token, batches strictly between are processed whole.
// begin_batch > end_batch marks an empty partition.
struct SchedMeta {
  int32_t begin_batch;
  int32_t begin_token;      // multiple of kPageSize
  int32_t end_batch;
  int32_t end_token;        // exclusive; == cache_seqlens[end_batch] when whole
  int32_t begin_split_idx;  // split index of begin_batch's chunk in this part
  int32_t total_pages;      // pages of the whole batch (every row): the L2 hint's bound (paged_kv_load.h)
  int32_t pad[2];
};
static_assert(sizeof(SchedMeta) == config::kSchedMetaInts * sizeof(int32_t));

struct SchedMetaParams {
  const int32_t* cache_seqlens;  // [batch]
  SchedMeta* sched_meta;         // [num_sm_parts]
  int32_t* num_splits;           // [batch + 1], cumulative split counts
  int batch;
  int num_sm_parts;
  cudaStream_t stream;
};

// Query row r of KV head hk (0 <= r < q_rows_per_head_k = s_q * heads_per_head_k)
// is query token s = r / heads_per_head_k of head hk * heads_per_head_k +
// r % heads_per_head_k. Under `causal` it sees keys [0, len - s_q + s].
struct DecodeParams {
  int batch;
  int seqlen_q;
  int num_heads_q;
  int num_heads_k;
  int heads_per_head_k;   // num_heads_q / num_heads_k
  int q_rows_per_head_k;  // seqlen_q * heads_per_head_k
  int num_m_blocks;       // ceil(q_rows_per_head_k / kRowsPerTile)
  int num_sm_parts;
  bool causal;
  float softmax_scale;       // applied to q.k (times descale_q * descale_k for fp8_per_tensor)
  float softmax_scale_log2;  // softmax_scale * log2(e)

  const void* q;  // [batch, seqlen_q, num_heads_q, kHeadDimQK]
  int64_t q_batch_stride, q_seq_stride, q_head_stride;

  const void* k_cache;  // [num_blocks, kPageSize, num_heads_k, bytes-or-elements per token]
  int64_t k_block_stride, k_token_stride, k_head_stride;
  int num_blocks;

  const int32_t* block_table;  // [batch, max_blocks_per_seq]; entries past the used pages may be garbage
  int64_t block_table_batch_stride;
  int max_blocks_per_seq;
  const int32_t* cache_seqlens;  // [batch]

  const float* descale_q;  // fp8_per_tensor only: device scalar, else nullptr
  const float* descale_k;

  void* out;   // [batch, seqlen_q, num_heads_q, kHeadDimV] bf16
  int64_t out_batch_stride, out_seq_stride, out_head_stride;
  float* lse;  // [batch, num_heads_q, seqlen_q], natural log; +inf for a row that sees no key

  // Split-KV partials: [batch + num_sm_parts, num_heads_k, q_rows_per_head_k, kHeadDimV]
  // and [batch + num_sm_parts, num_heads_k, q_rows_per_head_k]; lse in natural log,
  // -inf for a split where the row sees no key.
  float* o_accum;
  float* lse_accum;

  const SchedMeta* sched_meta;  // [num_sm_parts]
  const int32_t* num_splits;    // [batch + 1]

  cudaStream_t stream;
};

}  // namespace jax_flash_mla
