// fp8_ds_mla caches read by design S on the page pairs (Traits<kFp8DsMlaTokenScales>; docs/DESIGN.md, "Design S on
// the page pairs: the build"). WIP (session 63): compiled, not yet launched by the FFI.
#include "kernels/sm90/decode/splitkv_mla.cuh"

namespace jax_flash_mla::sm90 {
template void run_splitkv_mla<config::KvFormat::kFp8DsMlaTokenScales>(const DecodeParams& params);
}  // namespace jax_flash_mla::sm90
