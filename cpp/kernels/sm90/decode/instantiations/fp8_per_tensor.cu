// FP8 per-tensor cache: [num_blocks, 64, h_kv, 576] float8_e4m3fn, q float8_e4m3fn,
// descale_q / descale_k float32 device scalars. Left out of the build with
// JAX_FLASH_MLA_DISABLE_FP8 (CMakeLists.txt).
#include "kernels/sm90/decode/splitkv_mla.cuh"

namespace jax_flash_mla::sm90 {
template void run_splitkv_mla<config::KvFormat::kFp8PerTensor>(const DecodeParams& params);
}  // namespace jax_flash_mla::sm90
