// BF16 cache: [num_blocks, 64, h_kv, 576] bfloat16.
#include "kernels/sm90/decode/splitkv_mla.cuh"

namespace jax_flash_mla::sm90 {
template void run_splitkv_mla<config::KvFormat::kBf16>(const DecodeParams& params);
}  // namespace jax_flash_mla::sm90
