// fp8_ds_mla caches read by design S on the page pairs (Traits<kFp8DsMlaTokenScales>; docs/DESIGN.md, "Design S on
// the page pairs: the build"), flash_mla_with_kvcache(..., ds_scales="token"). Built with fp8_ds_mla (CMakeLists).
#include "kernels/sm90/decode/splitkv_mla.cuh"

namespace jax_flash_mla::sm90 {
// Few-rows shapes go to design A's launcher (run_splitkv_mla), instantiated in fp8_ds_mla.cu, not again here.
extern template void run_splitkv_mla<config::KvFormat::kFp8DsMla>(const DecodeParams& params);
template void run_splitkv_mla<config::KvFormat::kFp8DsMlaTokenScales>(const DecodeParams& params);
}  // namespace jax_flash_mla::sm90
