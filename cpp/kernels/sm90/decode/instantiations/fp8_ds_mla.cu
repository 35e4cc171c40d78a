// fp8_ds_mla cache: [num_blocks, 64, h_kv, 656] bytes (e4m3 NoPE, four fp32
// group scales, bf16 RoPE), q bfloat16. Design A of docs/NUMERICS.md; see
// Traits<kFp8DsMla>. Left out of the build with JAX_FLASH_MLA_DISABLE_FP8.
#include "kernels/sm90/decode/splitkv_mla.cuh"

namespace jax_flash_mla::sm90 {
template void run_splitkv_mla<config::KvFormat::kFp8DsMla>(const DecodeParams& params);
}  // namespace jax_flash_mla::sm90
