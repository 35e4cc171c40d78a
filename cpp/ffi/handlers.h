// XLA FFI handler symbols of the extension, registered by module.cc under the
// target names given beside each. A decode handler exists only for the cache
// formats that were built (JAX_FLASH_MLA_HAS_<FORMAT>).
#pragma once

#include "xla/ffi/api/api.h"

// "jax_flash_mla_sched_meta": cache_seqlens int32[b] -> sched_meta int32[P, 8], num_splits int32[b + 1].
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFlashMlaSchedMeta);

// "jax_flash_mla_decode_<format>": see decode.cc for operands, results and attributes.
#ifdef JAX_FLASH_MLA_HAS_BF16
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFlashMlaDecodeBf16);
#endif
#ifdef JAX_FLASH_MLA_HAS_FP8_PER_TENSOR
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFlashMlaDecodeFp8PerTensor);
#endif
#ifdef JAX_FLASH_MLA_HAS_FP8_DS_MLA
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFlashMlaDecodeFp8DsMla);
// "jax_flash_mla_decode_fp8_ds_mla_token_scales": the same operands, design S on the page pairs (fast on caches with
// one scale per token; any fp8_ds_mla cache reads correctly).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxFlashMlaDecodeFp8DsMlaTokenScales);
#endif
