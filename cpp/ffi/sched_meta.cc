// FFI handler "jax_flash_mla_sched_meta": runs the split-KV scheduler kernel
// (cpp/kernels/smxx/sched_meta.cu). The number of partitions P is the leading
// dim of the sched_meta result, fixed by the caller (scheduler.num_sm_parts).
//
//   arg  cache_seqlens  int32[b]
//   ret  sched_meta     int32[P, 8]   (SchedMeta rows, cpp/params.h)
//   ret  num_splits     int32[b + 1]  (cumulative chunks per sequence)

#include <cuda_runtime.h>

#include "config.h"
#include "ffi/ffi_util.h"
#include "ffi/handlers.h"
#include "kernels/smxx/sched_meta.h"
#include "params.h"
#include "xla/ffi/api/ffi.h"

namespace jax_flash_mla {
namespace {

namespace ffi = ::xla::ffi;
using ffi_util::check_buffer;
using ffi_util::kAnyDim;

ffi::Error sched_meta_impl(cudaStream_t stream, ffi::AnyBuffer cache_seqlens, ffi::Result<ffi::AnyBuffer> sched_meta,
                           ffi::Result<ffi::AnyBuffer> num_splits) {
  JFM_RETURN_IF_ERROR(check_buffer(cache_seqlens, "cache_seqlens", ffi::DataType::S32, {kAnyDim}, "[batch]"));
  const int64_t batch = cache_seqlens.dimensions()[0];
  JFM_RETURN_IF_ERROR(check_buffer(*sched_meta, "sched_meta", ffi::DataType::S32, {kAnyDim, config::kSchedMetaInts},
                                   "[num_sm_parts, 8]"));
  const int64_t parts = sched_meta->dimensions()[0];
  if (parts < 1) return ffi::Error::InvalidArgument("jax_flash_mla: sched_meta needs num_sm_parts >= 1 rows");
  JFM_RETURN_IF_ERROR(check_buffer(*num_splits, "num_splits", ffi::DataType::S32, {batch + 1}, "[batch + 1]"));
  JFM_RETURN_IF_ERROR(ffi_util::check_fits_int(batch + 1, "batch + 1"));
  JFM_RETURN_IF_ERROR(ffi_util::check_fits_int(parts, "num_sm_parts"));

  SchedMetaParams params{};
  params.cache_seqlens = static_cast<const int32_t*>(cache_seqlens.untyped_data());
  params.sched_meta = static_cast<SchedMeta*>(sched_meta->untyped_data());
  params.num_splits = static_cast<int32_t*>(num_splits->untyped_data());
  params.batch = static_cast<int>(batch);
  params.num_sm_parts = static_cast<int>(parts);
  params.stream = stream;
  return ffi_util::launch("sched_meta kernel", [&] { run_sched_meta(params); });
}

}  // namespace
}  // namespace jax_flash_mla

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashMlaSchedMeta, jax_flash_mla::sched_meta_impl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()   // cache_seqlens
                                  .Ret<xla::ffi::AnyBuffer>()   // sched_meta
                                  .Ret<xla::ffi::AnyBuffer>(),  // num_splits
                              {xla::ffi::Traits::kCmdBufferCompatible});
