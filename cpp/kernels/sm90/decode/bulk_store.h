// Bulk stores from shared to global memory by the TMA unit (the epilogue's
// rows of O; epilogue.cuh).
#pragma once

#include "kernels/sm90/decode/named_barriers.h"

namespace jax_flash_mla::sm90 {

// cp.async.bulk (PTX ISA "cp.async.bulk"): `bytes` (a multiple of 16) from
// shared to global memory by the TMA unit, in this thread's bulk group.
__device__ __forceinline__ void bulk_store(void* dst, const void* src, int bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(smem_addr(src)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Until this thread's bulk copies have read their shared-memory sources.
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
// Until they are complete (before the CTA exits).
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

}  // namespace jax_flash_mla::sm90
