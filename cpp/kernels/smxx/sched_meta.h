// Split-KV scheduler: balances (sequence, page range) chunks over num_sm_parts
// partitions. Algorithm: docs/DESIGN.md; jnp twin: jax_flash_mla/scheduler.py.
#pragma once

#include "params.h"

namespace jax_flash_mla {

void run_sched_meta(const SchedMetaParams& params);

}  // namespace jax_flash_mla
