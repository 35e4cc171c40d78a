// Hopper (sm_90a) split-KV MLA decode: one kernel skeleton, the cache format a
// template parameter. Writes out/lse for single-split sequences and
// o_accum/lse_accum for the others; run_combine finishes the latter.
#pragma once

#include "config.h"
#include "params.h"

namespace jax_flash_mla::sm90 {

template <config::KvFormat kFormat>
void run_splitkv_mla(const DecodeParams& params);

}  // namespace jax_flash_mla::sm90
