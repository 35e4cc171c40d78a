// Merges the split-KV partials (o_accum, lse_accum) of every sequence with more
// than one split into out / lse with a log-sum-exp reduction.
#pragma once

#include "params.h"

namespace jax_flash_mla {

void run_combine(const DecodeParams& params);

}  // namespace jax_flash_mla
