// FFI handlers "jax_flash_mla_decode_<format>": paged MLA decode with split-KV,
// one handler per cache format that was built (JAX_FLASH_MLA_HAS_<FORMAT>).
//
//   arg q             [b, s_q, h_q, 576]        bf16 (float8_e4m3fn for fp8_per_tensor)
//   arg k_cache       [num_blocks, 64, h_kv, D]  bf16, D 576 | float8_e4m3fn, D 576 (fp8_per_tensor) |
//                                                uint8 or float8_e4m3fn bytes, D 656 (fp8_ds_mla)
//   arg block_table   int32[b, max_blocks]
//   arg cache_seqlens int32[b]
//   arg sched_meta    int32[P, 8]      from jax_flash_mla_sched_meta with the same cache_seqlens
//   arg num_splits    int32[b + 1]
//   arg descale_q     float32[1] (or [])  read on device by fp8_per_tensor only
//   arg descale_k     float32[1] (or [])
//   ret out           bf16[b, s_q, h_q, 512]
//   ret lse           float32[b, h_q, s_q]
//   ret o_accum       float32[b + P, h_kv, s_q * h_q / h_kv, 512]   split-KV workspace
//   ret lse_accum     float32[b + P, h_kv, s_q * h_q / h_kv]        split-KV workspace
//   attr softmax_scale float32, causal bool
//
// All operands are dense row-major; strides follow from the shapes. The
// workspace results are outputs so that XLA owns that memory (no allocation
// here); callers drop them.

#include <cmath>
#include <cstdint>

#include <cuda_runtime.h>

#include "config.h"
#include "ffi/ffi_util.h"
#include "ffi/handlers.h"
#include "kernels/sm90/decode/splitkv_mla.h"
#include "kernels/smxx/combine.h"
#include "params.h"
#include "xla/ffi/api/ffi.h"

namespace jax_flash_mla {
namespace {

namespace ffi = ::xla::ffi;
using config::KvFormat;
using ffi_util::check_buffer;
using ffi_util::check_dtype;
using ffi_util::check_shape;
using ffi_util::kAnyDim;

// What a format expects of q and of the cache at the FFI boundary.
template <KvFormat kFormat>
struct FormatSpec;

template <>
struct FormatSpec<KvFormat::kBf16> {
  static constexpr ffi::DataType kQ = ffi::DataType::BF16;
  static constexpr ffi::DataType kCache = ffi::DataType::BF16;
  static constexpr ffi::DataType kCacheAlt = ffi::DataType::INVALID;
  static constexpr int64_t kCacheLastDim = config::kHeadDimQK;
  static constexpr bool kUsesDescale = false;
};

template <>
struct FormatSpec<KvFormat::kFp8PerTensor> {
  static constexpr ffi::DataType kQ = ffi::DataType::F8E4M3FN;
  static constexpr ffi::DataType kCache = ffi::DataType::F8E4M3FN;
  static constexpr ffi::DataType kCacheAlt = ffi::DataType::INVALID;
  static constexpr int64_t kCacheLastDim = config::kHeadDimQK;
  static constexpr bool kUsesDescale = true;
};

template <>
struct FormatSpec<KvFormat::kFp8DsMla> {
  // The 656-byte tokens are raw bytes; JAX may hand them over as uint8 or as e4m3.
  static constexpr ffi::DataType kQ = ffi::DataType::BF16;
  static constexpr ffi::DataType kCache = ffi::DataType::U8;
  static constexpr ffi::DataType kCacheAlt = ffi::DataType::F8E4M3FN;
  static constexpr int64_t kCacheLastDim = config::kDsMlaBytesPerToken;
  static constexpr bool kUsesDescale = false;
};

// Design S reads the same bytes.
template <>
struct FormatSpec<KvFormat::kFp8DsMlaTokenScales> : FormatSpec<KvFormat::kFp8DsMla> {};

template <KvFormat kFormat>
ffi::Error decode_impl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k_cache, ffi::AnyBuffer block_table,
                       ffi::AnyBuffer cache_seqlens, ffi::AnyBuffer sched_meta, ffi::AnyBuffer num_splits,
                       ffi::AnyBuffer descale_q, ffi::AnyBuffer descale_k, ffi::Result<ffi::AnyBuffer> out,
                       ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> o_accum,
                       ffi::Result<ffi::AnyBuffer> lse_accum, float softmax_scale, bool causal) {
  using Spec = FormatSpec<kFormat>;
  constexpr int64_t kDqk = config::kHeadDimQK;
  constexpr int64_t kDv = config::kHeadDimV;

  // q and the cache fix every size.
  JFM_RETURN_IF_ERROR(check_buffer(q, "q", Spec::kQ, {kAnyDim, kAnyDim, kAnyDim, kDqk}, "[b, s_q, h_q, 576]"));
  const auto qd = q.dimensions();
  const int64_t b = qd[0], s_q = qd[1], h_q = qd[2];
  JFM_RETURN_IF_ERROR(check_dtype(k_cache, "k_cache", Spec::kCache, Spec::kCacheAlt));
  JFM_RETURN_IF_ERROR(check_shape(k_cache, "k_cache", {kAnyDim, config::kPageSize, kAnyDim, Spec::kCacheLastDim},
                                  "[num_blocks, 64, h_kv, bytes-or-elements per token]"));
  const auto kd = k_cache.dimensions();
  const int64_t num_blocks = kd[0], h_kv = kd[2];
  if (s_q < 1 || h_q < 1 || h_kv < 1 || h_q % h_kv != 0) {
    return ffi::Error::InvalidArgument("jax_flash_mla: need s_q >= 1 and h_q a positive multiple of h_kv, got s_q " +
                                       std::to_string(s_q) + ", h_q " + std::to_string(h_q) + ", h_kv " +
                                       std::to_string(h_kv));
  }
  JFM_RETURN_IF_ERROR(check_buffer(block_table, "block_table", ffi::DataType::S32, {b, kAnyDim}, "[b, max_blocks]"));
  const int64_t max_blocks = block_table.dimensions()[1];
  JFM_RETURN_IF_ERROR(check_buffer(cache_seqlens, "cache_seqlens", ffi::DataType::S32, {b}, "[b]"));
  JFM_RETURN_IF_ERROR(check_buffer(sched_meta, "sched_meta", ffi::DataType::S32, {kAnyDim, config::kSchedMetaInts},
                                   "[num_sm_parts, 8]"));
  const int64_t parts = sched_meta.dimensions()[0];
  if (parts < 1) return ffi::Error::InvalidArgument("jax_flash_mla: sched_meta needs num_sm_parts >= 1 rows");
  // The decode kernel reads a row as two 16-byte loads (load_sched_meta).
  if (reinterpret_cast<uintptr_t>(sched_meta.untyped_data()) % 16 != 0) {
    return ffi::Error::InvalidArgument("jax_flash_mla: sched_meta must be 16-byte aligned");
  }
  JFM_RETURN_IF_ERROR(check_buffer(num_splits, "num_splits", ffi::DataType::S32, {b + 1}, "[b + 1]"));
  JFM_RETURN_IF_ERROR(ffi_util::check_f32_scalar(descale_q, "descale_q"));
  JFM_RETURN_IF_ERROR(ffi_util::check_f32_scalar(descale_k, "descale_k"));

  const int64_t heads_per_head_k = h_q / h_kv;
  const int64_t rows = s_q * heads_per_head_k;
  JFM_RETURN_IF_ERROR(check_buffer(*out, "out", ffi::DataType::BF16, {b, s_q, h_q, kDv}, "[b, s_q, h_q, 512]"));
  JFM_RETURN_IF_ERROR(check_buffer(*lse, "lse", ffi::DataType::F32, {b, h_q, s_q}, "[b, h_q, s_q]"));
  JFM_RETURN_IF_ERROR(check_buffer(*o_accum, "o_accum", ffi::DataType::F32, {b + parts, h_kv, rows, kDv},
                                   "[b + num_sm_parts, h_kv, s_q * h_q / h_kv, 512]"));
  JFM_RETURN_IF_ERROR(check_buffer(*lse_accum, "lse_accum", ffi::DataType::F32, {b + parts, h_kv, rows},
                                   "[b + num_sm_parts, h_kv, s_q * h_q / h_kv]"));
  JFM_RETURN_IF_ERROR(ffi_util::check_fits_int(b + parts, "b + num_sm_parts"));
  JFM_RETURN_IF_ERROR(ffi_util::check_fits_int(rows, "s_q * h_q / h_kv"));
  JFM_RETURN_IF_ERROR(ffi_util::check_fits_int(num_blocks, "num_blocks"));
  JFM_RETURN_IF_ERROR(ffi_util::check_fits_int(max_blocks, "max_blocks"));
  if (!std::isfinite(softmax_scale)) {
    return ffi::Error::InvalidArgument("jax_flash_mla: softmax_scale must be finite");
  }
  if (b == 0) return ffi::Error::Success();  // empty results; nothing to launch

  DecodeParams p{};
  p.batch = static_cast<int>(b);
  p.seqlen_q = static_cast<int>(s_q);
  p.num_heads_q = static_cast<int>(h_q);
  p.num_heads_k = static_cast<int>(h_kv);
  p.heads_per_head_k = static_cast<int>(heads_per_head_k);
  p.q_rows_per_head_k = static_cast<int>(rows);
  p.num_m_blocks = static_cast<int>((rows + config::kRowsPerTile - 1) / config::kRowsPerTile);
  p.num_sm_parts = static_cast<int>(parts);
  p.causal = causal;
  p.softmax_scale = softmax_scale;
  // log2(e) in double, rounded once.
  p.softmax_scale_log2 = static_cast<float>(static_cast<double>(softmax_scale) * 1.4426950408889634);

  p.q = q.untyped_data();
  p.q_head_stride = kDqk;
  p.q_seq_stride = h_q * kDqk;
  p.q_batch_stride = s_q * h_q * kDqk;

  p.k_cache = k_cache.untyped_data();
  p.k_head_stride = Spec::kCacheLastDim;
  p.k_token_stride = h_kv * Spec::kCacheLastDim;
  p.k_block_stride = config::kPageSize * h_kv * Spec::kCacheLastDim;
  p.num_blocks = static_cast<int>(num_blocks);

  p.block_table = static_cast<const int32_t*>(block_table.untyped_data());
  p.block_table_batch_stride = max_blocks;
  p.max_blocks_per_seq = static_cast<int>(max_blocks);
  p.cache_seqlens = static_cast<const int32_t*>(cache_seqlens.untyped_data());

  p.descale_q = Spec::kUsesDescale ? static_cast<const float*>(descale_q.untyped_data()) : nullptr;
  p.descale_k = Spec::kUsesDescale ? static_cast<const float*>(descale_k.untyped_data()) : nullptr;

  p.out = out->untyped_data();
  p.out_head_stride = kDv;
  p.out_seq_stride = h_q * kDv;
  p.out_batch_stride = s_q * h_q * kDv;
  p.lse = static_cast<float*>(lse->untyped_data());
  p.o_accum = static_cast<float*>(o_accum->untyped_data());
  p.lse_accum = static_cast<float*>(lse_accum->untyped_data());

  p.sched_meta = static_cast<const SchedMeta*>(sched_meta.untyped_data());
  p.num_splits = static_cast<const int32_t*>(num_splits.untyped_data());
  p.stream = stream;

  JFM_RETURN_IF_ERROR(ffi_util::launch("decode kernel", [&] { sm90::run_splitkv_mla<kFormat>(p); }));
  return ffi_util::launch("combine kernel", [&] { run_combine(p); });
}

// The binding every decode handler shares; the format only changes the impl.
auto decode_binding() {
  return xla::ffi::Ffi::Bind()
      .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
      .Arg<xla::ffi::AnyBuffer>()  // q
      .Arg<xla::ffi::AnyBuffer>()  // k_cache
      .Arg<xla::ffi::AnyBuffer>()  // block_table
      .Arg<xla::ffi::AnyBuffer>()  // cache_seqlens
      .Arg<xla::ffi::AnyBuffer>()  // sched_meta
      .Arg<xla::ffi::AnyBuffer>()  // num_splits
      .Arg<xla::ffi::AnyBuffer>()  // descale_q
      .Arg<xla::ffi::AnyBuffer>()  // descale_k
      .Ret<xla::ffi::AnyBuffer>()  // out
      .Ret<xla::ffi::AnyBuffer>()  // lse
      .Ret<xla::ffi::AnyBuffer>()  // o_accum
      .Ret<xla::ffi::AnyBuffer>()  // lse_accum
      .Attr<float>("softmax_scale")
      .Attr<bool>("causal");
}

}  // namespace
}  // namespace jax_flash_mla

#ifdef JAX_FLASH_MLA_HAS_BF16
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashMlaDecodeBf16,
                              jax_flash_mla::decode_impl<jax_flash_mla::config::KvFormat::kBf16>,
                              jax_flash_mla::decode_binding(), {xla::ffi::Traits::kCmdBufferCompatible});
#endif
#ifdef JAX_FLASH_MLA_HAS_FP8_PER_TENSOR
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashMlaDecodeFp8PerTensor,
                              jax_flash_mla::decode_impl<jax_flash_mla::config::KvFormat::kFp8PerTensor>,
                              jax_flash_mla::decode_binding(), {xla::ffi::Traits::kCmdBufferCompatible});
#endif
#ifdef JAX_FLASH_MLA_HAS_FP8_DS_MLA
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashMlaDecodeFp8DsMla,
                              jax_flash_mla::decode_impl<jax_flash_mla::config::KvFormat::kFp8DsMla>,
                              jax_flash_mla::decode_binding(), {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashMlaDecodeFp8DsMlaTokenScales,
                              jax_flash_mla::decode_impl<jax_flash_mla::config::KvFormat::kFp8DsMlaTokenScales>,
                              jax_flash_mla::decode_binding(), {xla::ffi::Traits::kCmdBufferCompatible});
#endif
